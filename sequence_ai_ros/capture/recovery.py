"""Crash recovery of a capture store, and its size on disk.

:func:`recover_store` runs when a store opens (and after :meth:`CaptureStore.repair`): staging directories
whose episode id is no longer claimed by a live holder (:mod:`sequence_ai_ros.capture.claims`) are removed
(their episodes were never committed), committed directories
missing from the index (a crash between the commit rename and the index insert, or a rebuilt index) are
indexed from their ``episode.json`` and ``label.json``, and index rows whose directory is gone are dropped.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from sequence_ai_ros.capture import claims
from sequence_ai_ros.capture.episode import LABEL_FILE, META_FILE
from sequence_ai_ros.capture.index import Index


def recover_store(root: Path, index: Index) -> dict[str, int]:
    """Clean up after crashes (see the module docstring).

    :returns: ``{'dropped': n, 'indexed': n, 'missing': n}``.
    :raises sqlite3.Error: when the index cannot be read or written.
    """
    out = {'dropped': 0, 'indexed': 0, 'missing': 0}
    staging = root / 'staging'
    entries = sorted(staging.iterdir()) if staging.is_dir() else []
    live: dict[str, int] = {}   # dir name -> pid of its live claim's holder
    for d in entries:
        if d.name.startswith('.claim-'):   # an episode id's capture claim (CaptureStore._claim): a dead
            holder = claims.read_holder(d)  # holder's goes; a half-written one (no holder yet) is left to its writer
            if holder is None:
                continue
            if claims.alive(holder, d):
                live[d.name[len('.claim-'):]] = holder.pid
            else:
                d.unlink(missing_ok=True)
    for d in entries:
        if d.name.startswith('.'):
            continue  # a claim, or a free-space probe file of a live store
        pid, _, name = d.name.partition('-')
        # A staging directory is kept while its episode id's claim is live and held by the pid that wrote it
        # (a pid alone is never trusted: it may be another pid namespace's, or reused).
        if not (pid.isdigit() and live.get(name) == int(pid)):
            shutil.rmtree(d, ignore_errors=True)
            out['dropped'] += 1
    indexed = index.dirs()
    episodes = root / 'episodes'
    for d in sorted(episodes.iterdir()) if episodes.is_dir() else ():
        if d.name in indexed or not (d / META_FILE).is_file():
            continue
        try:
            meta = json.loads((d / META_FILE).read_text(encoding='utf-8'))
            label_path = d / LABEL_FILE
            label = json.loads(label_path.read_text(encoding='utf-8')) if label_path.is_file() else None
            row = {k: meta[k] for k in ('episode_id', 'instruction', 'started_at', 'ended_at', 'reason',
                                        'requests', 'frames', 'bytes', 'images', 'fps', 'stats')}
        except (OSError, ValueError, KeyError):
            continue  # not an episode we can vouch for: left alone, never listed
        index.add_episode({**row, 'dir': d.name}, label)
        out['indexed'] += 1
    for name, episode_id in indexed.items():
        if not (episodes / name).is_dir():
            index.delete_episode(episode_id)
            out['missing'] += 1
    return out


def tree_bytes(path: Path, skip: str | None = None) -> int:
    """Return the bytes of every file under ``path`` (not following links), skipping the entry ``skip``."""
    total = 0
    try:
        entries = list(os.scandir(path))
    except OSError:
        return 0
    for entry in entries:
        if entry.name == skip:
            continue
        try:
            if entry.is_dir(follow_symlinks=False):
                total += tree_bytes(Path(entry.path))
            else:
                total += entry.stat(follow_symlinks=False).st_size
        except OSError:
            continue
    return total
