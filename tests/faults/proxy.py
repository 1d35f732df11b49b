"""A tiny TCP proxy on loopback that can delay or black-hole traffic to one server (after etcd's proxy).

Runs its own asyncio loop in a daemon thread, so tests drive it synchronously:

    with FaultProxy(target_port) as proxy:      # clients connect to proxy.port
        proxy.delay(0.5)                         # every chunk waits 0.5 s each way
        proxy.blackhole()                        # connections stay open, bytes vanish
        proxy.heal()
"""

import asyncio
import threading

from tests.servers import free_port


class FaultProxy:
    def __init__(self, target_port, target_host="127.0.0.1", port=None):
        self.target = (target_host, target_port)
        self.port = port or free_port()
        self._delay = 0.0
        self._blackhole = False
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True, name=f"proxy:{self.port}")
        self._server = None
        self._writers = set()

    def start(self):
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(10)
        return self

    async def _start(self):
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", self.port)

    async def _handle(self, client_reader, client_writer):
        try:
            server_reader, server_writer = await asyncio.open_connection(*self.target)
        except OSError:
            client_writer.close()
            return
        self._writers.update((client_writer, server_writer))
        await asyncio.gather(self._pipe(client_reader, server_writer), self._pipe(server_reader, client_writer),
                             return_exceptions=True)
        for writer in (client_writer, server_writer):
            self._writers.discard(writer)
            writer.close()

    async def _pipe(self, reader, writer):
        while data := await reader.read(65536):
            if self._delay:
                await asyncio.sleep(self._delay)
            if self._blackhole:
                continue  # dropped: the peer sees a silent connection, as with a partition
            writer.write(data)
            await writer.drain()
        writer.close()

    def delay(self, seconds):
        """Hold every chunk ``seconds`` before forwarding it, both ways."""
        self._delay = seconds

    def blackhole(self):
        """Drop all bytes both ways while keeping connections open."""
        self._blackhole = True

    def heal(self):
        self._delay, self._blackhole = 0.0, False

    def cut(self):
        """Close every proxied connection (as a crashed middlebox would)."""
        def close_all():
            for writer in list(self._writers):
                writer.close()
        self._loop.call_soon_threadsafe(close_all)

    def stop(self):
        async def shutdown():
            self._server.close()
            for writer in list(self._writers):
                writer.close()
        asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        self._loop.close()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
