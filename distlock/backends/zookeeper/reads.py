"""Many znode reads in few requests: ZooKeeper's multiRead (3.6 and later), which kazoo does not offer.

A page of ``held_locks()`` reads the children of each of its locks, then each holder's data: two
reads per lock. kazoo spends about as long in Python on each request as the ensemble takes to answer
it, so 1,000 requests cost a page most of its time even when pipelined. One multiRead carries many
of them: the server answers every operation in one reply, each with its own result or error.

A multiRead is the multi request (``Transaction``) with opcode 22 and read operations (getChildren,
getData): each operation behind a MultiHeader, a closing header, and a reply of one header and
result per operation. A server that does not know an opcode (ZooKeeper before 3.6) answers
"unimplemented" and drops the connection: on the session's own client that would suspend every
lease of the process. So the first listing of a session asks once on a client of its own
(``Session.spare_client``); if the ensemble refuses, every read goes as its own request, pipelined.
"""

import time

from collections import namedtuple

from kazoo.exceptions import EXCEPTIONS, ConnectionLoss, KazooException, NoNodeError, UnimplementedError
from kazoo.protocol.serialization import (
    GetChildren,
    GetData,
    MultiHeader,
    int_struct,
    multiheader_struct,
    read_buffer,
    read_string,
    stat_struct,
)
from kazoo.protocol.states import ZnodeStat

__all__ = ["children_of", "data_of"]

#: Bytes of operations per multiRead. The server refuses (and drops the connection of) a request over
#: its jute.maxbuffer, 1 MiB by default; a lock name encodes to at most a few hundred bytes.
BATCH_BYTES = 128 * 1024

#: ZooKeeper's opcode of a multiRead.
MULTI_READ = 22


class _NoMultiRead(Exception):
    """The ensemble answered a multiRead with no body: it does not know the opcode (before 3.6)."""


class _MultiRead(namedtuple("_MultiRead", "operations")):
    """A kazoo request (``client._call``) made of getChildren and getData operations."""

    type = MULTI_READ

    def serialize(self):
        request = bytearray()
        for operation in self.operations:
            request += MultiHeader(operation.type, False, -1).serialize() + operation.serialize()
        return request + multiheader_struct.pack(-1, True, -1)

    @classmethod
    def deserialize(cls, buffer, offset):
        """Return each operation's result: a list of children, (data, stat), or the exception it got."""
        if offset >= len(buffer):
            raise _NoMultiRead
        results = []
        header, offset = MultiHeader.deserialize(buffer, offset)
        while not header.done:
            if header.type == GetChildren.type:
                count = int_struct.unpack_from(buffer, offset)[0]
                offset += int_struct.size
                children = []
                for _ in range(max(count, 0)):
                    child, offset = read_string(buffer, offset)
                    children.append(child)
                results.append(children)
            elif header.type == GetData.type:
                data, offset = read_buffer(buffer, offset)
                results.append((data, ZnodeStat._make(stat_struct.unpack_from(buffer, offset))))
                offset += stat_struct.size
            elif header.type == -1:
                results.append(EXCEPTIONS[int_struct.unpack_from(buffer, offset)[0]]())
                offset += int_struct.size
            else:
                raise ValueError(f"unexpected operation type {header.type} in a multiRead reply")
            header, offset = MultiHeader.deserialize(buffer, offset)
        return results


def children_of(session, client, paths, io_deadline):
    """Return the children of each of ``paths``, in order, or a ``NoNodeError`` where the znode is not
    there; raise any other error a read got."""
    return _read(session, client, GetChildren, paths, io_deadline)


def data_of(session, client, paths, io_deadline):
    """Return the (data, stat) of each of ``paths``, in order, or a ``NoNodeError``; raise other errors."""
    return _read(session, client, GetData, paths, io_deadline)


def _read(session, client, kind, paths, io_deadline):
    """Return the results of reads of ``kind`` (``GetChildren`` or ``GetData``) of ``paths``."""
    if session.multi_read is None:
        session.multi_read = _answers_multi_read(session, io_deadline)
    if session.multi_read:
        return _multi_read(session, client, kind, paths, io_deadline)
    send = client.get_children_async if kind is GetChildren else client.get_async
    replies = [send(path) for path in paths]
    results = []
    for reply in replies:
        try:
            results.append(session.result(reply, io_deadline))
        except NoNodeError as exc:
            results.append(exc)
    return results


def _multi_read(session, client, kind, paths, io_deadline):
    """Send the reads as multiReads of at most ``BATCH_BYTES`` each, all at once; return their results."""
    chroot = client.chroot or ""  # prefixed as kazoo prefixes its own requests' paths
    batches, batch, size = [], [], 0
    for path in paths:
        batch.append(kind(chroot + path, None))
        size += len(path) + 16
        if size >= BATCH_BYTES:
            batches.append(batch)
            batch, size = [], 0
    if batch:
        batches.append(batch)
    replies = []
    for operations in batches:
        reply = client.handler.async_result()
        client._call(_MultiRead(operations), reply)
        replies.append(reply)
    results = []
    for reply in replies:
        results.extend(session.result(reply, io_deadline))
    for result in results:
        if isinstance(result, Exception) and not isinstance(result, NoNodeError):
            raise result
    return results


def _answers_multi_read(session, io_deadline):
    """Return whether the ensemble answers a multiRead, asked on a client of its own; None if it could not
    tell in time (the next listing asks again)."""
    client = session.spare_client()
    try:
        client.start(timeout=max(io_deadline - time.monotonic(), 0.1))
        reply = client.handler.async_result()
        # KEY_PREFIX may not exist yet: a NoNode inside the reply answers the question as well.
        client._call(_MultiRead([GetChildren((client.chroot or "") + session.root, None)]), reply)
        reply.get(timeout=max(io_deadline - time.monotonic(), 0.1))
    except (UnimplementedError, _NoMultiRead, ConnectionLoss):
        return False
    except (KazooException, client.handler.timeout_exception):
        return None
    finally:
        client.stop()
        client.close()
    return True
