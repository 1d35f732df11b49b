"""etcd v3 backend: a FIFO queue of keys per lock, one session lease per process, revisions as fencing tokens.

- ``transactions``: the protocol (key layout, invariant) and the transactions that keep it;
- ``backend``: ``EtcdBackend``, the acquire loop's hooks on top of them;
- ``session``: the session lease, the per-call ttls of held keys, the background loop;
- ``options``: the alias's options, checked without I/O;
- ``_transport``: gRPC (endpoints with failover, TLS and auth, fork and gevent safety).
"""

from distlock.backends.etcd.backend import EtcdBackend

__all__ = ["EtcdBackend"]
