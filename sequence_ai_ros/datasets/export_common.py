"""What every export shares: the ``--out`` rule, an atomic finish, and episode selection.

An export is written into a temporary directory beside ``--out`` and renamed into place at the end, so
an interrupted export leaves no half-written dataset. A non-empty ``--out`` is never overwritten
without ``force``; with ``force`` it is replaced only if it is an earlier export (it holds
``meta/info.json`` or ``episodes.jsonl``), never an arbitrary directory.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from sequence_ai_ros.capture.store import CapturedEpisode, CaptureStore
from sequence_ai_ros.exceptions import ExportError

EXPORT_MARKERS = ('meta/info.json', 'episodes.jsonl')


def check_out(out: str | Path, force: bool) -> Path:
    """Check that ``out`` may be written; return it as a Path.

    :raises ExportError: when ``out`` is a file, or a non-empty directory without ``force``, or a
        non-empty directory that is not an earlier export (even with ``force``).
    """
    out = Path(out).expanduser()
    if out.exists() and not out.is_dir():
        raise ExportError(f'--out {out} is a file, not a directory')
    if out.is_dir() and any(out.iterdir()):
        if not force:
            raise ExportError(f'--out {out} is not empty; pass --force to replace it')
        if not any((out / m).exists() for m in EXPORT_MARKERS):
            raise ExportError(f'--out {out} is not empty and is not an earlier export; refusing to replace it '
                              f'even with --force (choose an empty or new directory)')
    return out


def staging_dir(out: Path) -> Path:
    """Return a new temporary directory beside ``out`` (same filesystem, for an atomic rename)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f'.{out.name}.export-', dir=out.parent))


def finish(tmp: Path, out: Path) -> None:
    """Move the finished export ``tmp`` to ``out``, replacing an earlier export (checked by check_out)."""
    old = None
    if out.exists():
        old = out.with_name(f'.{out.name}.old-{tmp.name.rsplit("-", 1)[-1]}')
        out.rename(old)
    tmp.rename(out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def select(store: CaptureStore, since: float | None, until: float | None, labelled_only: bool) -> list[CapturedEpisode]:
    """Return the committed episodes to export, oldest first.

    :raises ExportError: when none match.
    """
    episodes = store.episodes(since=since, until=until, labelled_only=labelled_only)
    if not episodes:
        what = 'labelled ' if labelled_only else ''
        raise ExportError(f'deployment {store.deployment}: no {what}captured episodes match '
                          f'(store {store.root})')
    return episodes
