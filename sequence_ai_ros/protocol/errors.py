"""Typed errors on the wire: ``ErrorCode`` <-> exception class <-> gRPC status code.

The worker sends per-request errors in-stream (``EpisodeReply.error``) and aborts a call with the
matching status for fatal ones; the client raises the same exception class either way.
"""

from __future__ import annotations

import math

import grpc

from sequence_ai_ros import exceptions as exc
from sequence_ai_ros.protocol import DRAINING, REFUSAL_METADATA
from sequence_ai_ros.protocol import sequence_ai_pb2 as pb

_TABLE: tuple[tuple[pb.ErrorCode, type[exc.SequenceAIError], grpc.StatusCode], ...] = (
    (pb.UNKNOWN_DEPLOYMENT, exc.UnknownDeployment, grpc.StatusCode.NOT_FOUND),
    (pb.PROTOCOL_VERSION, exc.ProtocolVersionError, grpc.StatusCode.FAILED_PRECONDITION),
    (pb.CONTRACT_VIOLATION, exc.ContractViolation, grpc.StatusCode.INVALID_ARGUMENT),
    (pb.POLICY_EXCEPTION, exc.PolicyException, grpc.StatusCode.INTERNAL),
    (pb.OVERLOADED, exc.Overloaded, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (pb.UNAUTHENTICATED, exc.Unauthenticated, grpc.StatusCode.UNAUTHENTICATED),
    (pb.NOT_READY, exc.NotReady, grpc.StatusCode.UNAVAILABLE),
    (pb.EPISODE_STATE, exc.EpisodeStateError, grpc.StatusCode.FAILED_PRECONDITION),
    (pb.PERMISSION_DENIED, exc.PermissionDenied, grpc.StatusCode.PERMISSION_DENIED),
)


def code_for(error: BaseException) -> pb.ErrorCode:
    """Return the ``ErrorCode`` for an exception (POLICY_EXCEPTION for anything unknown)."""
    for code, cls, _ in _TABLE:
        if type(error) is cls:
            return code
    for code, cls, _ in _TABLE:
        if isinstance(error, cls):
            return code
    return pb.POLICY_EXCEPTION


def status_for(code: int) -> grpc.StatusCode:
    """Return the gRPC status code that carries ``code`` when a call is aborted."""
    return next((s for c, _, s in _TABLE if c == code), grpc.StatusCode.UNKNOWN)


def to_error(error: BaseException, request_id: int = 0) -> pb.Error:
    """Return the in-stream ``Error`` message for an exception.

    An :class:`~exc.Overloaded`'s refusal and a :class:`~exc.NotReady`'s ``retry_after_s`` travel with it.
    """
    retry = getattr(error, 'retry_after_s', 0.0) if isinstance(error, exc.NotReady) else 0.0
    return pb.Error(code=code_for(error), message=str(error), request_id=request_id,
                    refusal=getattr(error, 'refusal', '') or '', retry_after_s=retry)


def from_error(msg: pb.Error) -> exc.SequenceAIError:
    """Return the exception instance an in-stream ``Error`` stands for.

    A refused stream (``refusal`` set, code OVERLOADED) is an :class:`~exc.Overloaded` carrying the refusal,
    :class:`~exc.Draining` when the replica is stopping. A NOT_READY carries its ``retry_after_s`` (s; 0 for
    one that is not a finite positive number).
    """
    if msg.refusal and msg.code == pb.OVERLOADED:
        refused = exc.Draining if msg.refusal == DRAINING else exc.Overloaded
        return refused(msg.message, refusal=msg.refusal)
    if msg.code == pb.NOT_READY:
        retry = msg.retry_after_s
        return exc.NotReady(msg.message, retry_after_s=retry if math.isfinite(retry) and retry > 0 else 0.0)
    cls = next((c for code, c, _ in _TABLE if code == msg.code), exc.SequenceAIError)
    return cls(msg.message)


def from_rpc_error(error: grpc.RpcError) -> exc.SequenceAIError:
    """Translate a failed call's status into the typed exception (ConnectionLost when unreachable).

    A call the worker refused carries the refusal in its trailing metadata (:data:`REFUSAL_METADATA`): a
    draining replica's Handshake is :class:`~exc.Draining`, as its in-stream refusal is.
    """
    status = error.code() if hasattr(error, 'code') else grpc.StatusCode.UNKNOWN
    details = error.details() if hasattr(error, 'details') else str(error)
    if status in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED,
                  grpc.StatusCode.DEADLINE_EXCEEDED) and not (details or '').startswith('['):
        return exc.ConnectionLost(f'worker unreachable: {status.name}: {details}')
    # Aborts from the worker prefix details with "[ERROR_CODE] ".
    if details and details.startswith('['):
        name = details[1:details.find(']')]
        code = name if name in pb.ErrorCode.keys() else pb.ERROR_CODE_UNSPECIFIED   # protobuf takes a name
        return from_error(pb.Error(code=code, message=details[details.find(']') + 2:], refusal=_refusal(error)))
    cls = next((c for _, c, s in _TABLE if s == status), exc.SequenceAIError)
    return cls(f'{status.name}: {details}')


def _refusal(error: grpc.RpcError) -> str:
    """The :data:`REFUSAL_METADATA` of a failed call's trailing metadata ('' when none)."""
    trailing = getattr(error, 'trailing_metadata', None)
    for key, value in (trailing() if callable(trailing) else None) or ():
        if key == REFUSAL_METADATA and isinstance(value, str):
            return value
    return ''


def abort_details(error: BaseException) -> tuple[grpc.StatusCode, str]:
    """Return (status, details) for ``context.abort`` so that :func:`from_rpc_error` recovers the type."""
    code = code_for(error)
    return status_for(code), f'[{pb.ErrorCode.Name(code)}] {error}'


def abort_trailers(error: BaseException) -> tuple[tuple[str, str], ...]:
    """Return the trailing metadata of ``context.abort`` for ``error``: its refusal (an Overloaded's), if any."""
    refusal = getattr(error, 'refusal', '') or ''
    return ((REFUSAL_METADATA, refusal),) if refusal else ()
