"""ZooKeeper locks (kazoo): ephemeral sequential znodes, the holder's zxid as fencing token, session-aware leases.

- ``protocol``: the znode layouts, the queue rules and their invariants, one contender's turns, the listing;
- ``reads``: many reads in one request (multiRead), for the listing;
- ``session``: the kazoo client of an alias and process, its connection states, held leases, leftovers;
- ``connection``: the kazoo client itself (handler, TLS socket, negotiated session timeout);
- ``options``: the options, the security options (ACLs, credentials, TLS) and their warnings;
- ``backend``: ``ZooKeeperBackend``, the base class's hooks on top of them.
"""

from distlock.backends.zookeeper.backend import ZooKeeperBackend
from distlock.backends.zookeeper.protocol import (
    READ,
    WRITE,
    NodeGone,
    ahead_of,
    blocker_of,
    decode_name,
    encode_name,
    holders_of,
)

__all__ = ["READ", "WRITE", "NodeGone", "ZooKeeperBackend", "ahead_of", "blocker_of", "decode_name", "encode_name",
           "holders_of"]
