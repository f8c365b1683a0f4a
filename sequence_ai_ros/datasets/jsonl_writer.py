"""Export captured episodes as JSON Lines: everything kept, readable without protobuf.

Files written in ``--out``:

- ``requests.jsonl``: one object per observation request: ``episode_id``, ``request_id``,
  ``received_at`` (worker wall time, s since the epoch), ``robot_time_s``, ``instruction``,
  ``observation`` (``state`` list (D,), ``state_names``, ``images`` as ``{key, encoding, width, height}``
  and, with ``images``, ``data_b64``), ``history_len``, ``params`` (the inference parameters),
  ``chunk`` (``actions`` list (T, D), ``action_space``, ``dt`` s, ``covers_seconds`` s, ``done``) or
  null, ``error`` (``code``, ``message``) or null, and ``timings`` (``queue_wait_ms``, ``inference_ms``);
- ``episodes.jsonl``: one object per episode: ``episode_id``, ``instruction``, ``started_at``,
  ``ended_at``, ``reason``, ``label`` (``success``, ``notes``) or null, ``stats`` (the run's figures),
  ``requests``, ``frames``, ``fps``, ``images``, ``contract``;
- ``telemetry.jsonl``: one object per telemetry record (one control tick): ``episode_id``, ``frame_index``,
  ``robot_time_s``, ``state``, ``action`` (what the robot executed, or null when it commanded nothing),
  ``policy_action`` (the policy's, when it differed, else null), ``hold``, ``hold_reason``, ``clamped``,
  ``grid_index``, ``step_start``, ``step_end`` (the tick's place on the timeline; 0 in stores written before
  records carried it).
"""

from __future__ import annotations

import base64
import json
import shutil
import sys
from pathlib import Path
from typing import Any, TextIO

from sequence_ai_ros.capture.episode import contract_to_json
from sequence_ai_ros.capture.store import CaptureStore
from sequence_ai_ros.datasets.export_common import check_out, finish, select, staging_dir, unmatched_labels
from sequence_ai_ros.exceptions import CaptureError, ContractViolation
from sequence_ai_ros.protocol import codec
from sequence_ai_ros.protocol import sequence_ai_pb2 as pb
from sequence_ai_ros.protocol.limits import json_safe
from sequence_ai_ros.protocol.spaces import ActionSpace


def _tensor(t: pb.Tensor) -> list[Any] | dict[str, str] | None:
    if not t.dtype:
        return None
    try:
        return codec.from_tensor(t).tolist()
    except ContractViolation as exc:
        return {'invalid': str(exc)}


def _images(images: Any, keep: bool) -> list[dict[str, Any]]:
    out = []
    for im in images:
        d: dict[str, Any] = {'key': im.key, 'encoding': im.encoding, 'width': im.width, 'height': im.height}
        if keep:
            d['data_b64'] = base64.b64encode(im.data).decode('ascii')
        out.append(d)
    return out


def _request_row(episode_id: str, wall: float, req: pb.ObservationRequest, images: bool) -> dict[str, Any]:
    return {'episode_id': episode_id, 'request_id': req.request_id, 'received_at': wall,
            'robot_time_s': req.robot_time_s, 'instruction': req.instruction,
            'observation': {'state': _tensor(req.state), 'state_names': list(req.state_names),
                            'images': _images(req.images, images)},
            'history_len': len(req.history), 'expected_delay_actions': req.expected_delay_actions,
            'params': dict(req.params), 'chunk': None, 'error': None, 'timings': None}


def _chunk(msg: pb.ActionChunk) -> dict[str, Any]:
    try:
        space = ActionSpace.from_proto(msg.action_space).value
    except ValueError:
        space = None
    return {'actions': _tensor(msg.actions), 'action_space': space, 'dt': msg.dt,
            'covers_seconds': msg.covers_seconds, 'done': msg.done}


def _write(f: TextIO, row: dict[str, Any]) -> None:
    f.write(json.dumps(json_safe(row), ensure_ascii=False, allow_nan=False) + '\n')


def export_jsonl(store: CaptureStore, out: str | Path, *, since: float | None = None, until: float | None = None,
                 labelled_only: bool = False, images: bool = False, force: bool = False,
                 progress: bool | None = None) -> dict[str, Any]:
    """Write the store's committed episodes as JSON Lines at ``out`` (see the module docstring).

    :param images: include image bytes (base64) where the capture kept them.
    :returns: ``{'out', 'episodes', 'requests', 'frames', 'skipped': [(episode_id, why)], 'unmatched_labels': [ids
        of labels matching no episode the store saw], 'notes': [summary lines]}``.
    :raises ExportError: for a non-empty ``out`` without ``force`` or no matching episodes.
    """
    out = check_out(out, force)
    chosen = select(store, since, until, labelled_only)
    tmp = staging_dir(out)
    counts = {'episodes': 0, 'requests': 0, 'frames': 0}
    skipped: list[tuple[str, str]] = []
    try:
        from tqdm import tqdm

        with (tmp / 'requests.jsonl').open('w', encoding='utf-8') as freq, \
                (tmp / 'telemetry.jsonl').open('w', encoding='utf-8') as ftel, \
                (tmp / 'episodes.jsonl').open('w', encoding='utf-8') as fep:
            for ep in tqdm(chosen, unit='episode', desc=f'export {store.deployment}',
                           disable=(None if progress is None else not progress)):
                try:
                    records = ep.records()
                except CaptureError as exc:
                    skipped.append((ep.episode_id, str(exc)))
                    print(f'warning: skipping episode {ep.episode_id}: {exc}', file=sys.stderr)
                    continue
                pending: dict[str, Any] | None = None
                frame_index = 0
                for rec in records:
                    msg = rec.message
                    if isinstance(msg, pb.ObservationRequest):
                        if pending is not None:
                            _write(freq, pending)
                        pending = _request_row(ep.episode_id, rec.wall_time, msg, images)
                        counts['requests'] += 1
                    elif isinstance(msg, pb.ActionChunk) and pending is not None:
                        pending['chunk'] = _chunk(msg)
                        pending['timings'] = {'queue_wait_ms': msg.timings.queue_wait_ms,
                                              'inference_ms': msg.timings.inference_ms}
                    elif isinstance(msg, pb.Error) and pending is not None:
                        pending['error'] = {'code': pb.ErrorCode.Name(msg.code), 'message': msg.message}
                    elif isinstance(msg, pb.TelemetryFrame):
                        _write(ftel, {'episode_id': ep.episode_id, 'frame_index': frame_index,
                                      'robot_time_s': msg.robot_time_s, 'state': _tensor(msg.state),
                                      'action': _tensor(msg.action) if msg.HasField('action') else None,
                                      'policy_action': (_tensor(msg.policy_action) if msg.HasField('policy_action')
                                                        else None),
                                      'hold': msg.hold, 'hold_reason': msg.hold_reason, 'clamped': msg.clamped,
                                      'grid_index': msg.grid_index, 'step_start': msg.step_start,
                                      'step_end': msg.step_end, 'images': _images(msg.images, images)})
                        frame_index += 1
                if pending is not None:
                    _write(freq, pending)
                counts['frames'] += frame_index
                label = None if ep.label is None else {'success': ep.label['success'], 'notes': ep.label['notes']}
                _write(fep, {'episode_id': ep.episode_id, 'instruction': ep.instruction, 'started_at': ep.started_at,
                             'ended_at': ep.ended_at, 'reason': ep.reason, 'label': label, 'stats': ep.stats,
                             'requests': ep.requests, 'frames': ep.frames, 'fps': ep.fps, 'images': ep.images,
                             'contract': contract_to_json(ep.contract)})
                counts['episodes'] += 1
        finish(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    stray, notes = unmatched_labels(store)
    return {'out': str(out), **counts, 'skipped': skipped, 'unmatched_labels': stray, 'notes': notes}
