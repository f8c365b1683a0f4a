"""A bounded TCP server for the worker's side ports (metrics, HAProxy agent): one thread, whatever the load.

``socketserver``'s and ``prometheus_client``'s threading servers start a thread per connection, so 1,000
idle connections made 1,000 threads. Here every connection is a coroutine of one asyncio loop on one
thread (``seq-<name>``); at most ``max_connections`` are open at once (a new one past that closes the
oldest one still waiting for its request, so a flood of idle connections can neither hold the port nor
its descriptors), and each must send its request within ``read_timeout_s`` (else it is closed).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
from collections.abc import Awaitable, Callable

from sequence_ai_ros.exceptions import ConfigError

LOG = logging.getLogger(__name__)
#: Connections open at once; past it the oldest still idle is closed for the new one.
MAX_CONNECTIONS = 128
#: Seconds a connection has to send its request.
READ_TIMEOUT_S = 5.0
#: Largest request head read (bytes).
MAX_REQUEST_BYTES = 16 << 10

#: handler(reader, writer): serve one connection (the server closes it afterwards)
Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


class BoundedServer:
    """Serve ``handler`` on ``host:port`` from one thread.

    :param name: thread name suffix (``seq-<name>``).
    :param handler: coroutine serving one connection; it reads with :data:`READ_TIMEOUT_S` applied.
    :param host: bind address; :param port: TCP port (0: a free one, see :attr:`port`).
    :raises ConfigError: when the port cannot be bound.
    """

    def __init__(self, name: str, handler: Handler, host: str, port: int, max_connections: int = MAX_CONNECTIONS,
                 read_timeout_s: float = READ_TIMEOUT_S) -> None:
        self.max_connections = max_connections
        self.read_timeout_s = read_timeout_s
        self._handler = handler
        self._open = 0
        self.refused = 0
        #: connections that have not sent their request yet, oldest first (the ones a newcomer evicts)
        self._idle: collections.OrderedDict[asyncio.StreamWriter, None] = collections.OrderedDict()
        self._loop = asyncio.new_event_loop()
        try:
            self._server = self._loop.run_until_complete(
                asyncio.start_server(self._serve, host, port, limit=MAX_REQUEST_BYTES, reuse_address=True))
        except OSError as exc:
            self._loop.close()
            raise ConfigError(f'cannot serve {name} on {host}:{port}: {exc}') from None
        self.port: int = self._server.sockets[0].getsockname()[1]
        self._thread = threading.Thread(target=self._loop.run_forever, name=f'seq-{name}', daemon=True)
        self._thread.start()

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The server's event loop (handlers may run blocking work on its default executor)."""
        return self._loop

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._open >= self.max_connections:
            if not self._idle:
                self.refused += 1
                writer.close()
                return
            oldest, _ = self._idle.popitem(last=False)
            self.refused += 1
            oldest.transport.abort()
        self._open += 1
        self._idle[writer] = None
        try:
            await asyncio.wait_for(self._handler(reader, writer), timeout=self.read_timeout_s + 10.0)
        except (asyncio.TimeoutError, ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError,
                ValueError) as exc:
            LOG.debug('side port connection closed: %s', exc)
        finally:
            self._open -= 1
            self._idle.pop(writer, None)
            try:
                writer.close()
            except Exception:  # noqa: BLE001 - a transport already gone
                pass

    async def read_line(self, reader: asyncio.StreamReader) -> bytes:
        """Read one line (the request line, a header) within :attr:`read_timeout_s`."""
        return await asyncio.wait_for(reader.readline(), timeout=self.read_timeout_s)

    def busy(self, writer: asyncio.StreamWriter) -> None:
        """The connection sent its request: it is no longer idle (a newcomer will not evict it)."""
        self._idle.pop(writer, None)

    def open_connections(self) -> int:
        """Return the connections open now."""
        return self._open

    def close(self) -> None:
        """Stop serving and join the thread (timed)."""
        async def stop() -> None:
            self._server.close()
            await self._server.wait_closed()

        if self._loop.is_running():
            try:
                asyncio.run_coroutine_threadsafe(stop(), self._loop).result(5.0)
            except Exception as exc:  # noqa: BLE001 - closing regardless
                LOG.debug('side port close: %s', exc)
            self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5.0)
        if not self._loop.is_running():
            self._loop.close()
