"""Labels from the wire under attack: conflicting labels at one instant, callers without the token, no id.

Real capture stores on disk and a real worker (gRPC on loopback).
"""

from __future__ import annotations

from pathlib import Path

from sequence_ai_ros.capture.settings import CaptureSettings, save_settings
from sequence_ai_ros.capture.store import CaptureStore
from sequence_ai_ros.capture.store_set import StoreSet

FAST = Path(__file__).resolve().parents[1] / 'policies' / 'fast.py'


def test_labels_given_at_one_instant_merge_the_same_whatever_the_order_of_the_stores(tmp_path):
    """Attack: conflicting labels of one episode stored by two replicas at the same labelled_at.

    The merged label was the first store's, so ``--store a --store b`` and ``--store b --store a`` exported
    opposite labels.
    """
    roots = []
    for name, success, notes in (('a', True, 'grasped'), ('b', False, 'dropped it')):
        root = tmp_path / name / 'fast'
        save_settings(root, CaptureSettings(rate=1.0, enabled=True, fps=30.0))
        store = CaptureStore(root, deployment='fast', clock=lambda: 1_800_000_000.0)
        assert store.label('ep-1', success, notes) is False       # an episode neither store ran
        store.close()
        roots.append(root)
    forward = StoreSet(roots, 'fast').labels()
    backward = StoreSet(roots[::-1], 'fast').labels()
    assert forward == backward
    assert forward['ep-1']['success'] is False and forward['ep-1']['notes'] == 'dropped it'
