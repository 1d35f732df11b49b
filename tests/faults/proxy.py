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
    def __init__(self, target_port, target_host="127.0.0.1", port=None, listen_host="127.0.0.1"):
        """``listen_host``: the address clients connect to (a test network's bridge, for clients on test hosts)."""
        self.target = (target_host, target_port)
        self.listen_host = listen_host
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
        self._server = await asyncio.start_server(self._handle, self.listen_host, self.port)

    async def _handle(self, client_reader, client_writer):
        try:
            server_reader, server_writer = await asyncio.open_connection(*self.target)
        except OSError:
            client_writer.close()
            return
        writers = (client_writer, server_writer)
        self._writers.update(writers)
        link = {"writers": writers}
        await asyncio.gather(self._pipe(client_reader, server_writer, link, from_client=True),
                             self._pipe(server_reader, client_writer, link, from_client=False),
                             return_exceptions=True)
        for writer in writers:
            self._forget(writer)
            writer.close()

    def _forget(self, writer):
        self._writers.discard(writer)

    async def _pipe(self, reader, writer, link, *, from_client):
        """Copy ``reader`` to ``writer`` (one direction of a ``link``) as the fault in force allows."""
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


class ReplicationProxy(FaultProxy):
    """A ``FaultProxy`` in front of a Redis node that can stall the replication links through it, and only those.

    A connection is a replication link once its client sent ``REPLCONF`` or ``PSYNC`` (a replica's
    handshake). ``stall_replication()`` drops every byte of those links both ways while keeping them
    open, so the node's writes stop reaching its replica and the replica does not notice; clients
    and Sentinels going through the same proxy are served as usual. ``heal()`` cuts the stalled
    links: their streams lost bytes, so the replica must reconnect and resynchronise (``PSYNC``)
    rather than read on from the middle of a command.
    """

    _HANDSHAKE = (b"REPLCONF", b"PSYNC")

    def __init__(self, target_port, target_host="127.0.0.1", port=None):
        super().__init__(target_port, target_host, port)
        self._stalled = False
        self._replication_writers = set()

    def _forget(self, writer):
        super()._forget(writer)
        self._replication_writers.discard(writer)

    async def _pipe(self, reader, writer, link, *, from_client):
        while data := await reader.read(65536):
            if from_client and not link.get("replication") and any(word in data for word in self._HANDSHAKE):
                link["replication"] = True
                self._replication_writers.update(link["writers"])
            if link.get("replication") and self._stalled:
                continue
            writer.write(data)
            await writer.drain()
        writer.close()

    def stall_replication(self):
        """Drop the bytes of every replication link, both ways, from now on."""
        self._stalled = True

    def heal(self):
        """Forward everything again, once the replication links that were stalled are cut."""
        async def cut_then_forward():
            # On the loop's thread, so no byte of a stalled stream is forwarded before its link is cut.
            if self._stalled:
                for writer in list(self._replication_writers):
                    writer.close()
            self._stalled = False

        asyncio.run_coroutine_threadsafe(cut_then_forward(), self._loop).result(10)
        super().heal()
