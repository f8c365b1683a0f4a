"""Break-it: captured rows through a real node process across stalls, back-to-back episodes and re-activation."""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest
from std_msgs.msg import Float64MultiArray
from test_node_lifecycle import _lifecycle, _params
from test_node_support import RAMP, Probe, node_log, spawn_node, wait_for

pytestmark = [pytest.mark.ros, pytest.mark.slow]

NAMES = ['j0', 'j1', 'j2', 'j3']


def _collapse(values: np.ndarray) -> np.ndarray:
    keep = np.ones(len(values), bool)
    keep[1:] = np.any(values[1:] != values[:-1], axis=1)
    return values[keep]


@pytest.mark.parametrize('rate_hz', [30.0, 47.0])
def test_rows_match_the_topic_across_stalls_back_to_back_and_reactivation(tmp_path, processes, rclpy_context,
                                                                          rate_hz):
    from sequence_ai_ros.capture.settings import CaptureSettings, save_settings
    from sequence_ai_ros.capture.store import CaptureStore
    from sequence_ai_ros.datasets.rows import build_rows
    from sequence_ai_ros.protocol.spaces import ActionSpace
    from sequence_ai_ros.worker import serve_policy_file

    capture = tmp_path / 'capture'
    save_settings(capture / 'ramp', CaptureSettings(rate=1.0, enabled=True))
    probe = Probe(rclpy_context, Float64MultiArray, '/arm/commands')
    results = []
    try:
        with serve_policy_file(RAMP, 'ramp', capture_root=capture, names=NAMES, step=0.002) as server:
            proc = spawn_node(processes, tmp_path / 'node.log',
                              _params(tmp_path, server.port, control_rate_hz=rate_hz))
            probe.publish_joints(NAMES)
            assert probe.wait_connected(timeout=60), node_log(proc)
            state, transition = _lifecycle(probe)
            # 1 and 2 back to back; a SIGSTOP stall of 0.3 s in 2
            for k in range(2):
                h = probe.send_goal(instruction=f'ep{k}', max_seconds=1.2)
                assert h.accepted
                if k == 1:
                    time.sleep(0.5)
                    os.kill(proc.pid, signal.SIGSTOP)
                    time.sleep(0.3)
                    os.kill(proc.pid, signal.SIGCONT)
                results.append(probe.result(h, timeout=30))
            # 3 deactivated mid-episode, re-activated (a new control grid), 4 at once
            h = probe.send_goal(instruction='ep2', max_seconds=5.0)
            assert h.accepted
            time.sleep(0.7)
            assert transition('deactivate')[1](), node_log(proc)
            results.append(probe.result(h, timeout=30))
            assert transition('activate')[1](), node_log(proc)
            assert wait_for(lambda: probe.wait_connected(timeout=1) is not None, 20)
            h = probe.send_goal(instruction='ep3', max_seconds=1.2)
            assert h.accepted, node_log(proc)
            results.append(probe.result(h, timeout=30))
            time.sleep(0.5)
    finally:
        topic = np.array([v for _, v in probe.values()], np.float32)
        probe.close()
    assert [r.reason for r in results] == ['timeout', 'timeout', 'interrupted', 'timeout'], results
    episodes = {e.episode_id: e for e in CaptureStore(capture / 'ramp', 'ramp').episodes()}
    assert len(episodes) == 4, list(episodes)
    for r in results:
        rows = build_rows(episodes[r.episode_id], 30.0, ActionSpace.JOINT_ABSOLUTE, 4, 4, [])
        action = rows.action
        assert len(action) > 5, r
        starts = np.flatnonzero(np.all(topic == action[0], axis=1))
        assert starts.size, f'{r.episode_id}: row 0 is no command the controller received'
        got = _collapse(action)
        best = None
        for st in starts:     # every episode's ramp starts from the measured state: try each occurrence
            seq = _collapse(topic[st:])[:len(got)] if rate_hz == 30.0 else _collapse(topic[st:])
            if rate_hz == 30.0:
                bad = int(np.any(seq != got, axis=1).sum()) if len(seq) == len(got) else len(got)
            else:   # rows sample the ticks: every row's command was received, in order
                j, bad = 0, 0
                for row in got:
                    while j < len(seq) and not np.array_equal(seq[j], row):
                        j += 1
                    bad += j >= len(seq)
                seq = None
            best = bad if best is None else min(best, bad)
        assert best == 0, f'{r.episode_id} ({r.reason}): {best} of {len(got)} rows are no command, in order'
        # the stall shows as held rows (>= 0.3 s at 30 fps ~ 8 rows) in episode 2
        if r is results[1]:
            if len(action) < r.actions:
                # a loaded machine: the stall outlasted the episode (the node woke after its deadline), so no
                # tick came after it: the rows end at the last command, the missed periods are ticks_skipped
                assert r.ticks_skipped >= 7 and len(action) + r.ticks_skipped >= r.actions, (len(action), r)
            else:
                assert rows.held.sum() >= 7, (int(rows.held.sum()), r)
