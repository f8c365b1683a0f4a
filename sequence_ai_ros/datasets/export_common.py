"""What every export shares: the ``--out`` rule, an atomic finish, and episode selection.

An export is written into a temporary directory beside ``--out`` and renamed into place at the end, so
an interrupted export leaves no half-written dataset. A non-empty ``--out`` is never overwritten
without ``force``; with ``force`` it is replaced only if it is an earlier export of ours: every export
leaves :data:`EXPORT_MARK` listing the files it wrote, and ``--out`` is replaced only when it holds that
mark and nothing but the files listed there. Any other folder (a LeRobot dataset recorded or downloaded
elsewhere, an export someone added files to) is refused, so ``--force`` never removes what we did not write.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

from sequence_ai_ros.capture.store import CapturedEpisode, CaptureStore
from sequence_ai_ros.exceptions import ExportError

#: Left at the top of every export: ``{"written_by": "sequence_ai_ros", "files": [relative paths]}``.
EXPORT_MARK = '.seq-export.json'
WRITER = 'sequence_ai_ros'


def _files(root: Path) -> set[str]:
    """Relative paths of the files (and links) under ``root``."""
    out = set()
    for dirpath, _dirs, names in os.walk(root):
        for name in names:
            out.add(os.path.relpath(os.path.join(dirpath, name), root))
    return out


def _foreign(out: Path) -> str:
    """Why ``out`` is not (only) an earlier export of ours, or '' when --force may replace it."""
    try:
        mark = json.loads((out / EXPORT_MARK).read_text(encoding='utf-8'))
        ours = set(mark['files']) if mark.get('written_by') == WRITER else None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        ours = None
    if ours is None:
        return f'it has no {EXPORT_MARK} (it was not written by seq policy data export)'
    extra = sorted(_files(out) - ours - {EXPORT_MARK})
    if extra:
        return f'it holds {len(extra)} files our export did not write (e.g. {extra[:3]})'
    return ''


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
        why = _foreign(out)
        if why:
            raise ExportError(f'--out {out} is not empty and is not an earlier export of ours: {why}; '
                              f'refusing to replace it even with --force (choose an empty or new directory)')
    return out


def staging_dir(out: Path) -> Path:
    """Return a new temporary directory beside ``out`` (same filesystem, for an atomic rename)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f'.{out.name}.export-', dir=out.parent))


def finish(tmp: Path, out: Path) -> None:
    """Mark the finished export ``tmp`` (:data:`EXPORT_MARK`) and move it to ``out``.

    An earlier export at ``out`` (checked by check_out) is replaced.
    """
    mark = tmp / EXPORT_MARK
    mark.write_text(json.dumps({'written_by': WRITER, 'files': sorted(_files(tmp) - {EXPORT_MARK})}, indent=1),
                    encoding='utf-8')
    old = None
    if out.exists():
        old = out.with_name(f'.{out.name}.old-{tmp.name.rsplit("-", 1)[-1]}')
        out.rename(old)
    tmp.rename(out)
    if old is not None:
        _remove_ours(old)


def _remove_ours(old: Path) -> None:
    """Remove an earlier export of ours: only the files its mark lists, then its emptied folders.

    A file added since :func:`check_out` looked is left where it is (the folder is kept, and said).
    """
    try:
        listed = json.loads((old / EXPORT_MARK).read_text(encoding='utf-8'))['files']
    except (OSError, ValueError, KeyError, TypeError):
        listed = []
    for rel in [*listed, EXPORT_MARK]:
        path = old / rel
        if '..' not in Path(rel).parts and not Path(rel).is_absolute():
            path.unlink(missing_ok=True)
    for dirpath, _dirs, _files in sorted(os.walk(old), key=lambda w: -len(w[0])):
        try:
            os.rmdir(dirpath)
        except OSError:
            pass
    if old.exists():
        print(f'note: {old} holds files the earlier export did not write; they were kept there', file=sys.stderr)


def unmatched_labels(store: CaptureStore) -> tuple[list[str], list[str]]:
    """Return the ids of the labels matching no episode the store (or stores) saw, and the summary note naming them.

    Such a label was given for an id no episode has: mistyped, or an episode past retention, or one held in a
    replica's store that is not read with the others (see ``StoreSet``).
    """
    ids = list(store.unmatched_labels())
    notes = []
    foreign = sorted({eid for eid, _ in getattr(store, 'foreign_labels', [])})
    if foreign:   # held by a replica that did not run the episode, given by another identity than its owner
        shown = ', '.join(foreign[:10]) + (f' and {len(foreign) - 10} more' if len(foreign) > 10 else '')
        notes.append(f'{len(foreign)} label(s) left out: {shown} (given on a replica that did not run the episode, '
                     'by another client than the one that ran it)')
    if not ids:
        return [], notes
    shown = ', '.join(ids[:10]) + (f' and {len(ids) - 10} more' if len(ids) > 10 else '')
    what = '1 label matches' if len(ids) == 1 else f'{len(ids)} labels match'
    return ids, [*notes, f'{what} no episode in the stores read: {shown} (a mistyped episode id, an episode past '
                 'retention, or one in a replica\'s store not given with --store)']


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
