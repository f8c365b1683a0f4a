"""Unary calls whose request body does not decode: INVALID_ARGUMENT naming the message, never UNKNOWN.

gRPC answers a request deserializer that raises with status UNKNOWN and no details (grpc's asyncio server
logs 'Failed to deserialize request' and fails the call), so a robot sending a malformed Handshake, Ready or
Label body could not tell its own fault from the worker's. :func:`unary_handler` registers a unary method
with a deserializer that never raises: bytes that are not the request message become a
:class:`Malformed` marker, and the call is aborted with ``INVALID_ARGUMENT`` and
``[CONTRACT_VIOLATION] ...`` details (:func:`~sequence_ai_ros.protocol.errors.from_rpc_error` recovers a
:class:`~sequence_ai_ros.exceptions.ContractViolation`) before the method runs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from sequence_ai_ros.exceptions import ContractViolation
from sequence_ai_ros.protocol import errors
from sequence_ai_ros.protocol.contract import clip


@dataclasses.dataclass(frozen=True)
class Malformed:
    """A unary request body that did not decode as ``message`` (its name), ``size`` bytes, and why."""

    message: str
    size: int
    why: str

    def error(self) -> ContractViolation:
        """The typed error the call answers with."""
        return ContractViolation(f'the request body ({self.size} bytes) is not a {self.message}: '
                                 f'{clip(self.why, 120)}')


def decoder(message: Any) -> Callable[[bytes], Any]:
    """A request deserializer for the protobuf class ``message`` that returns :class:`Malformed` instead of raising."""
    name = message.DESCRIPTOR.full_name

    def decode(data: bytes) -> Any:
        try:
            return message.FromString(data)
        except (DecodeError, ValueError) as exc:   # upb raises DecodeError; a bad UTF-8 string ValueError on some
            return Malformed(name, len(data), str(exc) or type(exc).__name__)

    return decode


def refusing_malformed(method: Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]]
                       ) -> Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]]:
    """Wrap a unary servicer coroutine: a :class:`Malformed` request aborts with INVALID_ARGUMENT, typed."""

    async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if isinstance(request, Malformed):
            status, details = errors.abort_details(request.error())
            await context.abort(status, details)
        return await method(request, context)

    return call


def unary_handler(method: Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]], request: Any,
                  reply: Any) -> grpc.RpcMethodHandler[Any, Any]:
    """The unary-unary handler of ``method``, its ``request`` bodies decoded by :func:`decoder`."""
    return grpc.unary_unary_rpc_method_handler(refusing_malformed(method), request_deserializer=decoder(request),
                                               response_serializer=reply.SerializeToString)
