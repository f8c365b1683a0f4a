"""Several capture stores of one deployment read as one: a fleet whose replicas each kept their own store.

A local fleet (``seq fleet``) shares one ``$SEQ_HOME`` and so one store per deployment (SQLite locking on
a local disk). Replicas on several machines (Kubernetes pods, one volume each) cannot: each keeps its own
store, e.g. ``/var/lib/seq/capture/<deployment>`` on its own PersistentVolume. :class:`StoreSet` reads
such stores together for ``seq policy data export``, ``seq policy stats`` and ``seq policy data plot``
(``--store DIR``, repeated), so a fleet's field data exports as one dataset.

No episode is duplicated: episode ids are unique per robot episode, and sticky routing keeps an
episode on one replica. When the same id was committed in two stores anyway (a replica died mid-episode
and the robot's next stream with the same id landed on a survivor), the copy with more telemetry frames
is kept (then the later end), and the other is listed in :attr:`StoreSet.duplicates`. None is lost: every
committed episode of every store is either read or listed there.

Labels are merged by episode id across the stores: a robot labels its episode on the replica the
balancer sends the call to, normally the episode's own (the call carries ``x-episode-id``), but another one
while that replica is stopped, which stores the label for an episode it does not hold (it keeps such a label
for the store's ``retention_days``, as long as an episode). Every episode read, and every run counted by
:meth:`StoreSet.runs`, carries the newest label (largest ``labelled_at``) any store holds for its id; so a
label given again later, on any replica, replaces an earlier one, as it does within one store. Two labels
given at the same ``labelled_at`` are told apart by what they say, never by the order of the stores: a
failure wins over a success, then the notes in code point order (:func:`newer_label`).

A label held by a store that never saw its episode joins the episode only when it was given by the identity
that ran it (each store records an episode's owner when it starts, and each label its labeller;
:mod:`sequence_ai_ros.worker.identity`): another identity's label of that id (a forged one) is left out and
listed in :attr:`StoreSet.foreign_labels`. Stores written before owners were recorded have none, and their
labels join as before.

Each store is checked before it is read: its episodes must be of the deployment asked for (the contract
each episode was captured under names its deployment) and share a contract (state and action names,
action space) with the other stores. A store that fails a check, or whose index cannot be read (e.g.
corrupt), is skipped and named in :attr:`StoreSet.skipped_stores` with the reason and, for a damaged
index, the command that repairs that store; the other stores are read. Only when every store is bad is
it an error.

Read-only: nothing is written to the stores (each is opened as a read-only
:class:`~sequence_ai_ros.capture.store.CaptureStore`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from sequence_ai_ros.capture.episode import CapturedEpisode
from sequence_ai_ros.capture.store import CaptureStore
from sequence_ai_ros.exceptions import CaptureError, ConfigError


def newer_label(label: dict[str, Any], other: dict[str, Any]) -> bool:
    """True when ``label`` wins over ``other`` (two labels of one episode id): the later ``labelled_at``.

    At the same ``labelled_at`` (two replicas storing conflicting labels at one instant), a failure wins over a
    success, then the notes later in code point order: a total order, so the merged label never depends on
    the order in which the stores are read.
    """
    def key(x: dict[str, Any]) -> tuple[float, bool, str]:
        return float(x['labelled_at']), not x['success'], str(x.get('notes') or '')

    return key(label) > key(other)


class StoreSet:
    """The capture stores of one deployment at ``roots``, read as one store.

    It answers what the readers of a :class:`~sequence_ai_ros.capture.store.CaptureStore` ask
    (:meth:`episodes`, :meth:`runs`, ``deployment``, ``root``).

    :param roots: the stores' directories (each holds an ``index.sqlite``), at least one.
    :param deployment: the deployment they belong to.
    :raises ConfigError: for no roots, a root given twice, or a directory that is not a capture store.
    """

    def __init__(self, roots: Sequence[str | Path], deployment: str) -> None:
        from sequence_ai_ros.capture.index import INDEX_FILE

        paths = [Path(r).expanduser().resolve() for r in roots]
        if not paths:
            raise ConfigError('no capture store given')
        if len(set(paths)) != len(paths):
            raise ConfigError(f'a capture store is given twice: {[str(p) for p in paths]}')
        for p in paths:
            if not (p / INDEX_FILE).is_file():
                raise ConfigError(f'{p} is not a capture store (no {INDEX_FILE}); a store is '
                                  f'$SEQ_HOME/capture/<deployment> of a replica')
        self.deployment = deployment
        self.roots = paths
        self.root = paths[0]
        self.stores = [CaptureStore(p, deployment=deployment, read_only=True) for p in paths]
        #: (episode_id, store directory) of committed copies not read because another store's copy was kept.
        self.duplicates: list[tuple[str, Path]] = []
        #: (store directory, why) of the stores not read: another deployment, another contract, a bad index.
        self.skipped_stores: list[tuple[Path, str]] = []
        #: (episode_id, store directory) of labels left out by the last :meth:`labels`: held by a store that
        #: never saw the episode, given by another identity than the one that ran it.
        self.foreign_labels: list[tuple[str, Path]] = []

    def _skip(self, store: CaptureStore, why: str) -> None:
        if all(root != store.root for root, _ in self.skipped_stores):
            self.skipped_stores.append((store.root, why))

    def _good(self) -> list[CaptureStore]:
        """The stores that pass the checks (see the module docstring); the others go to skipped_stores.

        :raises CaptureError: when no store is left, naming each store and why.
        """
        reference: tuple[Path, set] | None = None
        good = []
        for store in self.stores:
            if any(root == store.root for root, _ in self.skipped_stores):
                continue
            try:
                every = store.episodes()
            except CaptureError as exc:
                self._skip(store, str(exc))
                continue
            others = sorted({e.contract.deployment for e in every
                             if e.contract is not None and e.contract.deployment not in ('', self.deployment)})
            if others:
                self._skip(store, f'it holds episodes of deployment {others[0]!r}, not {self.deployment!r}')
                continue
            shapes = {_shape(e) for e in every if e.contract is not None}
            if shapes and reference is not None and not shapes & reference[1]:
                self._skip(store, f'its contract (state/action names or action space) differs from the one of '
                                  f'store {reference[0]}')
                continue
            if shapes and reference is None:
                reference = (store.root, shapes)
            good.append(store)
        if not good:
            raise CaptureError('no capture store could be read: ' +
                               '; '.join(f'{root}: {why}' for root, why in self.skipped_stores))
        return good

    def labels(self, stores: Sequence[CaptureStore] | None = None) -> dict[str, dict[str, Any]]:
        """Return the newest label of every episode id over the stores: ``{episode_id: label}``.

        A label is ``{'success': bool, 'notes': str, 'labelled_at': float}`` (s since the epoch); of two
        labels for one id in two stores, the one with the larger ``labelled_at`` is kept (:func:`newer_label`:
        the same whatever the order of the stores). A label held by a store that never saw its episode, given by
        another identity than the one another store recorded as the episode's owner, is left out and listed in
        :attr:`foreign_labels`.

        :param stores: the stores to read (default those that pass the checks).
        :raises CaptureError: when no store can be read (a bad store is skipped: :attr:`skipped_stores`).
        """
        read: list[tuple[CaptureStore, dict[str, dict[str, Any]], set[str]]] = []
        owners: dict[str, str] = {}
        for store in self._good() if stores is None else stores:
            try:
                held = store.labels()
                unseen = set(store.unmatched_labels()) if held else set()
                for eid, owner in store.owners().items():
                    owners.setdefault(eid, owner)
            except CaptureError as exc:
                self._skip(store, str(exc))
                continue
            read.append((store, held, unseen))
        merged: dict[str, dict[str, Any]] = {}
        self.foreign_labels = []
        for store, held, unseen in read:
            for eid, label in held.items():
                given_by, ran_by = label.get('owner') or '', owners.get(eid, '')
                if eid in unseen and given_by and ran_by and given_by != ran_by:
                    self.foreign_labels.append((eid, store.root))   # not the identity that ran it
                    continue
                label = {k: v for k, v in label.items() if k != 'owner'}
                seen = merged.get(eid)
                if seen is None or newer_label(label, seen):
                    merged[eid] = label
        return merged

    def unmatched_labels(self) -> list[str]:
        """Return the ids of the labels that match no episode in any store, sorted.

        A label one store holds for an episode another store ran (its replica was stopped when the robot
        labelled it) is matched; what is left matches no episode any store saw: a mistyped id, or an episode
        past retention in every store (or in a store not given).

        :raises CaptureError: when no store can be read (a bad store is skipped: :attr:`skipped_stores`).
        """
        good = self._good()
        stray: set[str] = set()
        for store in good:
            try:
                stray.update(store.unmatched_labels())
            except CaptureError as exc:
                self._skip(store, str(exc))
        for store in good:
            if stray and all(root != store.root for root, _ in self.skipped_stores):
                try:
                    stray -= store.seen(stray)
                except CaptureError as exc:
                    self._skip(store, str(exc))
        return sorted(stray)

    def episodes(self, since: float | None = None, until: float | None = None,
                 labelled_only: bool = False) -> list[CapturedEpisode]:
        """Return the committed episodes of every store, each id once, oldest first, with merged labels.

        Each episode's ``label`` is the newest one any store holds for its id (:meth:`labels`), so an
        episode labelled while its replica was stopped carries the label another replica stored.

        :param since: keep episodes started at or after this wall time (s since the epoch).
        :param until: keep episodes started before this wall time.
        :param labelled_only: keep labelled episodes only (labelled in any store).
        :raises CaptureError: when no store can be read (a bad store is skipped: :attr:`skipped_stores`).
        """
        best: dict[str, tuple[CapturedEpisode, Path]] = {}
        self.duplicates = []
        good = self._good()
        for store in good:
            try:
                chosen = store.episodes(since=since, until=until)
            except CaptureError as exc:   # it went bad since the check: skipped like any bad store
                self._skip(store, str(exc))
                continue
            for e in chosen:
                seen = best.get(e.episode_id)
                if seen is None:
                    best[e.episode_id] = (e, store.root)
                    continue
                keep, drop = ((e, store.root), seen) if _better(e, seen[0]) else (seen, (e, store.root))
                best[e.episode_id] = keep
                self.duplicates.append((drop[0].episode_id, drop[1]))
        labels = self.labels(good)
        merged = [dataclasses.replace(e, label=labels.get(e.episode_id)) for e, _ in best.values()]
        if labelled_only:
            merged = [e for e in merged if e.label is not None]
        return sorted(merged, key=lambda e: (e.started_at, e.episode_id))

    def runs(self) -> list[dict[str, Any]]:
        """Return every run recorded by any store (oldest first), each episode id once, with merged labels.

        A run recorded twice (the same episode id in two stores) counts once: the copy with a label, then
        the later end. Its ``success`` is the newest label's for its id in any store (:meth:`labels`), None
        when unlabelled.

        :raises CaptureError: when a store's index cannot be read.
        """
        best: dict[str, dict[str, Any]] = {}
        anonymous: list[dict[str, Any]] = []
        good = self._good()
        labels = self.labels(good)
        for store in good:
            try:
                recorded = store.runs()
            except CaptureError as exc:
                self._skip(store, str(exc))
                continue
            for run in recorded:
                eid = run.get('episode_id')
                if not eid:
                    anonymous.append(run)
                    continue
                if eid in labels:
                    run = {**run, 'success': labels[eid]['success']}
                seen = best.get(eid)
                if seen is None or _better_run(run, seen):
                    best[eid] = run
        runs = list(best.values()) + anonymous
        return sorted(runs, key=lambda r: (r.get('started_at') or 0.0, r.get('episode_id') or ''))


def _shape(e: CapturedEpisode) -> tuple:
    """What an export's features depend on in an episode's contract."""
    c = e.contract
    assert c is not None
    return (tuple(c.observation.state_names), tuple(c.action_names), c.action_space)


def _better(a: CapturedEpisode, b: CapturedEpisode) -> bool:
    """True when copy ``a`` of an episode should be read rather than copy ``b``: more frames, then later end."""
    return (a.frames, a.ended_at) > (b.frames, b.ended_at)


def _better_run(a: dict[str, Any], b: dict[str, Any]) -> bool:
    labelled_a, labelled_b = a.get('success') is not None, b.get('success') is not None
    if labelled_a != labelled_b:
        return labelled_a
    return (a.get('ended_at') or 0.0) > (b.get('ended_at') or 0.0)
