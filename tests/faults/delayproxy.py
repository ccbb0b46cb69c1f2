"""A TCP proxy that delays every byte by a fixed time, each way: delay without netem.

The kernel here has no ``sch_netem``, so a delayed link is a proxy on the path: a client
connects to :attr:`DelayProxy.port` on 127.0.0.1 instead of the service, and each chunk
read from either side is written to the other ``delay_s`` after it arrived, in order. The
proxy runs an asyncio loop in a thread of the test process; :meth:`close` stops it and
every connection. ``chunks`` counts the chunks it delayed (evidence the path was used).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time


class DelayProxy:
    def __init__(self, target_port: int, delay_s: float, host: str = "127.0.0.1") -> None:
        self.target = (host, target_port)
        self.delay_s = delay_s
        self.port = 0
        self.chunks = 0
        self.delayed = 0
        """Chunks passed on late (``delay_s`` above 0 when they arrived)."""
        self.connections = 0
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, name="delay-proxy", daemon=True)

    def __enter__(self) -> DelayProxy:
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("the delay proxy did not start")
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout=10)

    def _run(self) -> None:
        self._loop.run_until_complete(self._main())
        self._loop.close()

    async def _main(self) -> None:
        self._stop = asyncio.Event()
        server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = server.sockets[0].getsockname()[1]
        self._ready.set()
        async with server:
            await self._stop.wait()
            server.close()
        for task in asyncio.all_tasks() - {asyncio.current_task()}:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    async def _serve(self, cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            sr, sw = await asyncio.open_connection(*self.target)
        except OSError:
            cw.close()
            return
        await asyncio.gather(self._pipe(cr, sw), self._pipe(sr, cw), return_exceptions=True)
        for w in (cw, sw):
            w.close()

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        async def send() -> None:
            while True:
                due, data = await queue.get()
                if not data:
                    writer.close()
                    return
                await asyncio.sleep(max(0.0, due - time.monotonic()))
                writer.write(data)
                await writer.drain()

        sender = asyncio.create_task(send())
        try:
            while True:
                try:
                    data = await reader.read(65536)
                except OSError:  # reset (a worker killed, a link cut): end this way too
                    data = b""
                await queue.put((time.monotonic() + self.delay_s, data))
                if not data:
                    break
                self.chunks += 1
                self.delayed += self.delay_s > 0
            await sender
        finally:
            sender.cancel()
