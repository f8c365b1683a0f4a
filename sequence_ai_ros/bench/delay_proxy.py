"""A TCP proxy on loopback that adds network delay (with jitter) each way: the link of a far GPU worker.

Every read on either side of a connection is forwarded after a one-way delay drawn uniformly within
``+-jitter`` of ``one_way_s``, in order: a byte stream cannot overtake itself, so a read is never
forwarded before the one before it (as on a real TCP link, a late segment holds the ones behind it).
The delay lives on the link, so requests in flight overlap on it, as they would on a long network path;
the worker's own inference stays serialized as it is.

Threads: one ``delay-proxy`` thread runs an asyncio loop; :meth:`DelayProxy.close` stops and joins it.
"""

from __future__ import annotations

import asyncio
import random
import threading


class DelayProxy:
    """Forward ``127.0.0.1:<port>`` to ``target`` with a one-way delay each way.

    :param target_port: the worker's port on 127.0.0.1.
    :param one_way_s: mean one-way delay (s); the round trip adds twice this.
    :param jitter: uniform spread as a fraction of the delay (0.2 = +-20 %).
    :param seed: for reproducible draws.
    """

    def __init__(self, target_port: int, one_way_s: float, jitter: float = 0.0, seed: int = 0) -> None:
        self.target_port, self.one_way_s, self.jitter = target_port, float(one_way_s), float(jitter)
        self._rng = random.Random(seed)
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self.port = 0
        self._thread = threading.Thread(target=self._run, name='delay-proxy', daemon=True)
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError('delay proxy did not start')

    def _delay(self) -> float:
        return max(0.0, self.one_way_s * (1.0 + self.jitter * self._rng.uniform(-1.0, 1.0)))

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._main())
        self._loop.close()

    async def _main(self) -> None:
        self._stop = asyncio.Event()
        server = await asyncio.start_server(self._accept, '127.0.0.1', 0)
        self.port = server.sockets[0].getsockname()[1]
        self._ready.set()
        await self._stop.wait()
        server.close()
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection('127.0.0.1', self.target_port)
        except OSError:
            writer.close()
            return
        try:
            await asyncio.gather(self._pump(reader, up_writer), self._pump(up_reader, writer),
                                 return_exceptions=True)
        except asyncio.CancelledError:      # the proxy is closing
            for w in (writer, up_writer):
                w.close()

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        sender = asyncio.ensure_future(self._deliver(queue, writer))
        last = 0.0
        try:
            while True:
                data = await reader.read(1 << 16)
                if not data:
                    break
                last = max(last, loop.time() + self._delay())       # in order, never before the previous read
                queue.put_nowait((last, data))
        except (ConnectionError, OSError, asyncio.CancelledError):
            pass
        finally:
            queue.put_nowait((last, b''))
            try:
                await sender
            except (ConnectionError, OSError, asyncio.CancelledError):
                pass
            if not writer.is_closing():
                writer.close()

    @staticmethod
    async def _deliver(queue: asyncio.Queue, writer: asyncio.StreamWriter) -> None:
        """Write each read at its due time, in the order read (one writer: FIFO by construction)."""
        loop = asyncio.get_running_loop()
        while True:
            due, data = await queue.get()
            wait = due - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            if not data or writer.is_closing():
                return
            writer.write(data)
            await writer.drain()

    def close(self) -> None:
        """Stop the proxy and join its thread (open connections are dropped)."""
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(5)

    def __enter__(self) -> DelayProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ['DelayProxy']
