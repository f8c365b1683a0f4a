"""The worker's ``grpc.health.v1.Health`` service, bounded, on every port that serves it.

One :class:`HealthStatuses` holds the statuses (``''``: the server, SERVING while it runs; one per deployment,
NOT_SERVING until its policy is ready); each gRPC port serves them through its own
:class:`BoundedHealthServicer`, which answers a caller in one of two views:

- **per deployment** (a caller the worker trusts: the main port's callers with the token, or every caller of a
  worker without one): ``''`` and each deployment's own status; an unknown name is NOT_FOUND (Check) or
  SERVICE_UNKNOWN (Watch), as the reference servicer answers;
- **tokenless** (the probe port's callers, and a main-port caller without the token that ``--anonymous-streams``
  lets in): ``''`` is the server's status, and *every other name* is the worker's readiness: SERVING when every
  served deployment is (none warming, failed or draining), else NOT_SERVING. The name is never looked up, so a
  deployment's name and any other name get the same answer: the names served cannot be enumerated without the
  token (kubelet's ``readinessProbe.grpc.service: my_policy`` keeps working: it asks the worker's readiness).

Bounds, whatever the caller sends:

- a service name longer than :data:`MAX_SERVICE_NAME_BYTES` (UTF-8) is INVALID_ARGUMENT before any lookup;
  every deployment name is far shorter (at most 64 characters, see ``registry.check_name``), so the answer
  depends on the length alone and tells nothing about which deployments exist;
- at most :data:`MAX_WATCHES` Watch streams are open at once per port; one more is RESOURCE_EXHAUSTED (Check
  always answers);
- a Watch stream ends (status OK) once it has sent nothing for :data:`WATCH_IDLE_S` seconds: the status did not
  change. Watch clients (gRPC's client-side health checking) open it again and get the current status at once;
  kubelet's gRPC probe uses Check, which this does not touch;
- ``List`` (which would name every service) is UNIMPLEMENTED.

Everything here runs on the worker's event loop (``seq-grpc-loop``); :meth:`HealthStatuses.set` is a coroutine
of that loop, as the reference servicer's is.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

#: Longest service name answered (bytes of UTF-8); a longer one is INVALID_ARGUMENT (deployment names: <= 64).
MAX_SERVICE_NAME_BYTES = 256
#: Watch streams open at once on one port; one more is RESOURCE_EXHAUSTED.
MAX_WATCHES = 64
#: A Watch stream that has sent nothing for this long (s) ends with OK; its client opens it again.
WATCH_IDLE_S = 60.0

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVICE_UNKNOWN = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN

#: trusted(context): True when the call may see each deployment's own health (the per-deployment view)
Trusted = Callable[[grpc.aio.ServicerContext], bool]


def never(context: grpc.aio.ServicerContext) -> bool:
    """The probe port's rule: no caller gets the per-deployment view."""
    return False


class HealthStatuses:
    """The worker's health statuses, ``''`` and one per deployment, shared by every port's servicer.

    ``''`` starts SERVING. Set from the worker's event loop (:meth:`set`, :meth:`enter_graceful_shutdown`);
    every change wakes the open Watch streams.
    """

    def __init__(self) -> None:
        self._status: dict[str, int] = {'': SERVING}
        self._shutting_down = False
        self._changed = asyncio.Event()   # set and replaced at each change (asyncio.Event binds its loop on use)

    @property
    def changed(self) -> asyncio.Event:
        """The event the next change sets (take it before reading a status, then wait on it)."""
        return self._changed

    async def set(self, service: str, status: int) -> None:
        """Set ``service``'s status (``health_pb2.HealthCheckResponse`` enum); ignored once shutting down."""
        if not self._shutting_down:
            self._set(service, status)

    async def enter_graceful_shutdown(self) -> None:
        """Turn every status NOT_SERVING for good: later :meth:`set` calls are ignored (idempotent)."""
        if self._shutting_down:
            return
        self._shutting_down = True
        for service in list(self._status):
            self._set(service, NOT_SERVING)

    def _set(self, service: str, status: int) -> None:
        self._status[service] = status
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    def status(self, service: str) -> int | None:
        """``service``'s own status; None when it was never set."""
        return self._status.get(service)

    def readiness(self) -> int:
        """The worker's readiness: SERVING when the server is and every served deployment is (at least one)."""
        if self._status[''] != SERVING:
            return NOT_SERVING
        served = [s for name, s in self._status.items() if name and s != SERVICE_UNKNOWN]
        return SERVING if served and all(s == SERVING for s in served) else NOT_SERVING

    def answer(self, service: str, per_deployment: bool) -> int | None:
        """What a caller asking for ``service`` is told (see the module docstring); None: NOT_FOUND.

        :param per_deployment: the caller may see each deployment's own status; else any name but ``''`` is
            the worker's readiness and is never looked up.
        """
        if not service:
            return self._status['']
        return self._status.get(service) if per_deployment else self.readiness()


class BoundedHealthServicer(health_pb2_grpc.HealthServicer):
    """``grpc.health.v1.Health`` over ``statuses``, with the bounds of the module docstring, for one port.

    :param statuses: the worker's statuses (one object for every port).
    :param trusted: whether a call gets the per-deployment view (:func:`never` on the probe port).
    :param max_watches: Watch streams open at once on this port; default :data:`MAX_WATCHES`.
    :param watch_idle_s: a Watch stream that sent nothing for this long (s) ends; default :data:`WATCH_IDLE_S`.
    """

    def __init__(self, statuses: HealthStatuses, trusted: Trusted = never, max_watches: int | None = None,
                 watch_idle_s: float | None = None) -> None:
        self.statuses = statuses
        self._trusted = trusted
        self.max_watches = MAX_WATCHES if max_watches is None else max_watches
        self.watch_idle_s = WATCH_IDLE_S if watch_idle_s is None else watch_idle_s
        #: Watch streams open now, and those refused (over max_watches) and ended idle since start
        self.watching = 0
        self.refused = 0
        self.idle_ended = 0

    async def _name(self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext) -> str:
        """The request's service name, or INVALID_ARGUMENT when it is longer than the bound (nothing looked up)."""
        name = request.service
        if len(name) > MAX_SERVICE_NAME_BYTES or len(name.encode('utf-8')) > MAX_SERVICE_NAME_BYTES:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f'service name longer than {MAX_SERVICE_NAME_BYTES} bytes')
        return name

    async def Check(self, request: health_pb2.HealthCheckRequest,   # noqa: N802 - the gRPC method's name
                    context: grpc.aio.ServicerContext) -> health_pb2.HealthCheckResponse:
        """Answer the status of ``request.service`` (NOT_FOUND: unknown, in the per-deployment view only)."""
        name = await self._name(request, context)
        status = self.statuses.answer(name, self._trusted(context))
        if status is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, 'unknown service')
        return health_pb2.HealthCheckResponse(status=status)

    async def Watch(self, request: health_pb2.HealthCheckRequest,   # noqa: N802 - the gRPC method's name
                    context: grpc.aio.ServicerContext) -> None:
        """Send the status now and at each change; end once nothing was sent for :attr:`watch_idle_s`."""
        name = await self._name(request, context)
        if self.watching >= self.max_watches:
            self.refused += 1
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f'{self.max_watches} health Watch streams are open on this port; use Check')
        per_deployment = self._trusted(context)
        self.watching += 1
        try:
            last: int | None = None
            sent_at = time.monotonic()
            while True:
                changed = self.statuses.changed
                status = self.statuses.answer(name, per_deployment)
                status = SERVICE_UNKNOWN if status is None else status
                if status != last:
                    await context.write(health_pb2.HealthCheckResponse(status=status))
                    last, sent_at = status, time.monotonic()
                left = self.watch_idle_s - (time.monotonic() - sent_at)
                if left <= 0:
                    break
                try:
                    await asyncio.wait_for(changed.wait(), timeout=left)
                except asyncio.TimeoutError:
                    break
            self.idle_ended += 1
        finally:
            self.watching -= 1

    async def List(self, request: Any, context: grpc.aio.ServicerContext) -> Any:   # noqa: N802 - gRPC's name
        """UNIMPLEMENTED: listing would name every deployment."""
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, 'List is not served')
