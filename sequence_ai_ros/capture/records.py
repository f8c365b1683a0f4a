"""Append-only record files of a captured episode: typed protobuf messages, never pickle.

One file holds a sequence of records, each a 13-byte little-endian header ``<IBd`` (payload length in
bytes, kind, wall-clock receive time in s since the epoch) then the serialized message:

======  ==========================  ==============================================
kind    message                     meaning
======  ==========================  ==============================================
1       ``ObservationRequest``      what the robot sent (pixels stripped without images)
2       ``ActionChunk``             the chunk the worker answered with
3       ``Error``                   the in-stream error the worker answered with
4       ``TelemetryFrame``          what the robot did, at the capture fps
======  ==========================  ==============================================

Records of one request are written in order: the request, then its chunk or error. A file cut short
(a crash mid-write, a truncated copy) is detected: :func:`read_records` raises :class:`CaptureError`
naming the offset, unless ``tolerate_tail`` is set.
"""

from __future__ import annotations

import dataclasses
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from sequence_ai_ros.exceptions import CaptureError
from sequence_ai_ros.protocol import sequence_ai_pb2 as pb

HEADER = struct.Struct('<IBd')
REQUEST, CHUNK, ERROR, TELEMETRY = 1, 2, 3, 4
#: A record's message: its type is its kind's (the table above).
RecordMessage = pb.ObservationRequest | pb.ActionChunk | pb.Error | pb.TelemetryFrame
_TYPES: dict[int, type[RecordMessage]] = {
    REQUEST: pb.ObservationRequest, CHUNK: pb.ActionChunk, ERROR: pb.Error, TELEMETRY: pb.TelemetryFrame}


@dataclasses.dataclass(frozen=True)
class Record:
    """One decoded record.

    :param kind: REQUEST, CHUNK, ERROR or TELEMETRY.
    :param wall_time: worker wall-clock time the record was received (s since the epoch).
    :param message: the decoded protobuf message, of the kind's type (narrow it with ``isinstance``).
    """

    kind: int
    wall_time: float
    message: RecordMessage


def encode_record(kind: int, wall_time: float, message: RecordMessage) -> bytes:
    """Return header + payload bytes for one record.

    :raises CaptureError: for an unknown kind.
    """
    if kind not in _TYPES:
        raise CaptureError(f'unknown record kind {kind}')
    payload = message.SerializeToString()
    return HEADER.pack(len(payload), kind, wall_time) + payload


def read_records(path: str | Path, *, tolerate_tail: bool = False) -> Iterator[Record]:
    """Yield the records of a file in order.

    :param tolerate_tail: stop quietly at a record cut short instead of raising.
    :raises CaptureError: for a truncated or corrupt record, or a missing file.
    """
    path = Path(path)
    try:
        f: BinaryIO = path.open('rb')
    except OSError as exc:
        raise CaptureError(f'capture file {path} unreadable: {exc}') from None
    with f:
        offset = 0
        while True:
            head = f.read(HEADER.size)
            if not head:
                return
            if len(head) < HEADER.size:
                if tolerate_tail:
                    return
                raise CaptureError(f'capture file {path} is truncated at byte {offset} (partial header)')
            size, kind, wall = HEADER.unpack(head)
            payload = f.read(size)
            if len(payload) < size:
                if tolerate_tail:
                    return
                raise CaptureError(f'capture file {path} is truncated at byte {offset} '
                                   f'({len(payload)} of {size} payload bytes)')
            cls = _TYPES.get(kind)
            if cls is None:
                raise CaptureError(f'capture file {path} is corrupt at byte {offset} (record kind {kind})')
            msg = cls()
            try:
                msg.ParseFromString(payload)
            except Exception as exc:  # protobuf's DecodeError
                raise CaptureError(f'capture file {path} is corrupt at byte {offset}: {exc}') from None
            yield Record(kind, wall, msg)
            offset += HEADER.size + size
