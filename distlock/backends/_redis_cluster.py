"""The Redis backend on a Redis Cluster: each lock's keys in one hash slot, and each command sent to the slot's master.

Redis Cluster splits the keys into 16384 slots, each served by one master, and runs a script only
if every key it names lies in one slot (else ``CROSSSLOT``). So on a cluster every key of a lock
carries one hash tag (``hash_tag``), and there is no alias-wide token counter: the acquire script
reads and writes the counter of the lock's tag, in the lock's slot.

The token rule: ``max(counter + 1, server time in µs)`` with the counter of the name's tag, so a
name's tokens strictly increase (each grant of the name reads and raises its tag's counter), and
survive a restart without persistence or a failover as the single instance's do (the clock). Tokens
of names with different tags are not ordered: two masters, two clocks, two counters
(``tokens_grow_alias_wide`` is False). The 65536 tags bound the counters a cluster keeps.

``ClusterConnections`` learns which master serves which slot (``CLUSTER SLOTS``, asked of any node
it knows) and keeps one ``_Connections`` per master, so the wire (``_redis.exchange``), its bounds
and its behaviour under interrupts are the single instance's. A ``MOVED`` reply (the slot changed
master: a failover, a resharding) makes it read the slots again and send the command once more to
the new master; an ``ASK`` reply (a slot being migrated) sends it once to the node named, after
``ASKING``. A node that fails or answers ``CLUSTERDOWN`` makes the next call read the slots again:
nothing waits for a failover, as with Sentinel.
"""

import bisect
import threading
from hashlib import sha1

import redis
from redis.crc import key_slot
from redis.exceptions import AskError, MovedError

from distlock.backends import _redis

__all__ = ["ClusterConnections", "SLOTS", "TAG_DIGITS", "cursor_problem", "hash_tag", "key_slot", "parse_cursor"]

#: How many slots a Redis Cluster has.
SLOTS = 16384
#: Hex digits of a lock name's SHA-1 in its hash tag: 65536 tags, so at most that many token counters,
#: spread over every slot.
TAG_DIGITS = 4


def hash_tag(name):
    """Return the hash tag of lock ``name``'s keys, ``{xxxx}``: the first ``TAG_DIGITS`` hex digits of its SHA-1.

    A digest rather than the name itself: a name may hold ``{`` and ``}``, and ``}x`` would make the
    tag empty, which Redis ignores (each key would go to a slot of its own).
    """
    return "{" + sha1(name.encode()).hexdigest()[:TAG_DIGITS] + "}"


def cursor_problem(cursor):
    """Return why ``cursor`` is no page's cursor on a cluster (``<slot>:<SCAN cursor>``), or None; no I/O."""
    slot, colon, scan = cursor.partition(":")
    if not (colon and slot.isascii() and slot.isdigit() and scan.isascii() and scan.isdigit()):
        return "a cluster page's cursor is <slot>:<SCAN cursor>"
    if int(slot) >= SLOTS or int(scan) >= 2**64:
        return f"its slot must be below {SLOTS} and its SCAN cursor below 2**64"
    return None


def parse_cursor(cursor):
    """Return the (slot, SCAN cursor) a cluster page's ``cursor`` stands for; (0, 0) for the first page."""
    if not cursor:
        return 0, 0
    slot, _, scan = cursor.partition(":")
    return int(slot), int(scan)


def _text(value):
    return value.decode() if isinstance(value, bytes) else value


class ClusterConnections:
    """Connections to every master of one Redis Cluster, and which slots each serves.

    ``make_connections(host, port)`` returns the ``_Connections`` of one node (the URL's credentials
    and TLS, another address). The slot map is read on first use and again after a ``MOVED`` reply
    or a failed node; a call reads only a snapshot of it, so no lock is taken on the way.
    """

    def __init__(self, seed, make_connections, socket_timeout):
        #: The URL's node, asked for the slots when no master known so far answers.
        self.seed = seed
        self._make_connections = make_connections
        self.socket_timeout = socket_timeout
        self._nodes = {}  # (host, port) -> _Connections
        #: (the first slot of each range, sorted; each range as (first, last, (host, port) of its master)),
        #: or None until read.
        self._map = None
        #: True once a node failed or answered ``CLUSTERDOWN`` or ``MOVED``: the next call reads the slot map first.
        self._stale = False
        self._lock = threading.Lock()

    @property
    def pool(self):
        """The redis-py connection pool of the ``URL``'s node."""
        return self.node(self.seed).pool

    # -- the slot map ----------------------------------------------------------------------------

    def node(self, address):
        """Return the ``_Connections`` of the node at ``address``, made on first use."""
        connections = self._nodes.get(address)
        if connections is None:
            with self._lock:
                connections = self._nodes.get(address)
                if connections is None:
                    connections = self._nodes[address] = self._make_connections(*address)
        return connections

    def refresh(self, timeout):
        """Read the slot map again from the first node that answers ``CLUSTER SLOTS``: known masters, then the seed.

        Raise the last node's failure if none answers. A map that leaves slots without a master is
        kept all the same: commands for those slots fail as ``CLUSTERDOWN`` would.
        """
        known = [] if self._map is None else list(dict.fromkeys(node for _, _, node in self._map[1]))
        error = None
        for address in [*known, *([self.seed] if self.seed not in known else [])]:
            try:
                (reply,) = self.node(address).exchange([("CLUSTER", "SLOTS")], timeout)
            except _redis.CLIENT_ERRORS as exc:
                error = exc
                continue
            if isinstance(reply, redis.ResponseError):
                error = reply
                continue
            ranges = sorted((int(entry[0]), int(entry[1]), self._address(entry[2], address)) for entry in reply)
            if ranges:
                self._map = ([start for start, _, _ in ranges], [(start, end, node) for start, end, node in ranges])
                return
            error = redis.ResponseError("CLUSTERDOWN the cluster serves no slot yet")
        raise error

    @staticmethod
    def _address(master, asked):
        """Return the (host, port) of a ``CLUSTER SLOTS`` master entry; an unknown host is the asked node's."""
        host = _text(master[0])
        return (host if host not in ("", "?") else asked[0]), int(master[1])

    def _ranges(self, timeout):
        if self._map is None:
            self.refresh(timeout)
        return self._map

    def master_for(self, slot, timeout):
        """Return the (host, port) of the master serving ``slot``; raise ``CLUSTERDOWN`` if none does."""
        starts, ranges = self._ranges(timeout)
        index = bisect.bisect_right(starts, slot) - 1
        if index < 0 or ranges[index][1] < slot:
            raise redis.ResponseError(f"CLUSTERDOWN Hash slot {slot} is not served by any master")
        return ranges[index][2]

    def masters(self, timeout):
        """Return each master once, as (its lowest slot, (host, port)), by lowest slot."""
        _, ranges = self._ranges(timeout)
        lowest = {}
        for start, _, address in ranges:
            lowest.setdefault(address, start)
        return sorted((start, address) for address, start in lowest.items())

    # -- commands --------------------------------------------------------------------------------

    @staticmethod
    def slot_of(command):
        """Return the slot of ``command``'s first key (every command sent here names its key there, or is a script)."""
        key = command[3] if command[0] == "EVALSHA" else command[1]
        return key_slot(key.encode() if isinstance(key, str) else key)

    def exchange(self, commands, timeout):
        """Return the replies to ``commands``, each sent to the master of its key's slot; one round trip per master.

        Error replies come back in place of replies, as from ``_redis.exchange``. Commands answered
        ``MOVED`` go once more after the slot map was read again (once for all of them); a second
        ``MOVED`` is returned (the cluster is still moving: a refusal, ``_redis.refusal_code``). A
        command answered ``ASK`` goes once to the node named, after ``ASKING``.
        """
        if self._stale:
            self._stale = False
            self.refresh(timeout)
        replies = [None] * len(commands)
        self._send(commands, range(len(commands)), replies, timeout)
        moved = [index for index, reply in enumerate(replies) if isinstance(reply, MovedError)]
        if moved:
            self.refresh(timeout)
            self._send(commands, moved, replies, timeout)
        for index, reply in enumerate(replies):
            if isinstance(reply, AskError) and not isinstance(reply, MovedError):
                # A script as source: after NOSCRIPT the exchange would send it again without ASKING.
                _, replies[index] = self.on_node(
                    reply.node_addr, [("ASKING",), _redis.with_source(commands[index])], timeout)
        return replies

    def _send(self, commands, indexes, replies, timeout):
        """Send the ``commands`` at ``indexes`` to their slots' masters, one batch per master, into ``replies``."""
        by_node = {}
        for index in indexes:
            by_node.setdefault(self.master_for(self.slot_of(commands[index]), timeout), []).append(index)
        for address, batch in by_node.items():
            for index, reply in zip(batch, self.on_node(address, [commands[i] for i in batch], timeout)):
                replies[index] = reply

    def on_node(self, address, commands, timeout):
        """Return the replies of the node at ``address`` to ``commands``.

        A node that fails, or answers ``CLUSTERDOWN`` or ``MOVED``, makes the next call read the slot map again.
        """
        try:
            replies = self.node(address).exchange(commands, timeout)
        except _redis.CLIENT_ERRORS:
            self._stale = True
            raise
        if any(_redis.refusal_code(reply) in ("CLUSTERDOWN", "MOVED") for reply in replies
               if isinstance(reply, redis.ResponseError)):
            self._stale = True
        return replies

    def exchange_acknowledged(self, command, timeout, wait, wait_seconds, written):
        """``_Connections.exchange_acknowledged`` on the master of ``command``'s slot, after one ``MOVED`` at most."""
        for _ in range(2):
            address = self.master_for(self.slot_of(command), timeout)
            try:
                reply, acknowledged = self.node(address).exchange_acknowledged(
                    command, timeout, wait, wait_seconds, written)
            except _redis.CLIENT_ERRORS:
                self._stale = True
                raise
            if not isinstance(reply, MovedError):
                return reply, acknowledged
            self.refresh(timeout)
        return reply, acknowledged

    def close(self):
        for connections in list(self._nodes.values()):
            connections.close()

