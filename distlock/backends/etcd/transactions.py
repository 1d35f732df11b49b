"""The etcd lock protocol: key layout, its invariant, and the transactions that keep it.

Keys. Every contender for lock NAME, the holder and each waiter, owns one key
    {KEY_PREFIX}{quote(NAME)}/{session lease id, hex}-{slot}
attached to its process's session lease, so etcd deletes it once that process stops keeping the
lease alive (crash, pause, partition). quote() leaves no "/" in the name part, so the range
"{KEY_PREFIX}{quote(NAME)}/" holds exactly the keys of NAME whatever the name contains ("/", "..",
spaces, unicode). The value is the holder record (``distlock.holder.holder_record``: owner, host,
pid, task_id, created_at): the lease's owner id lives there, read by held_locks() and release_owned().

Slots. The slot is the lowest number no other acquire call of this process is using for NAME, so
a process reuses a handful of keys per lock instead of making one per acquisition: etcd keeps a
deleted key in its index until the cluster is compacted, and the range compare of ACQUIRE visits
every such key, so fresh keys would slow a hot lock's every transaction as it is used (see
``bench/etcd_baselines.py``). A slot is free again only once its key is known to be gone (released,
expired, deleted), so a key never has two contenders; its incarnations differ by their create
revision, which identifies the contender in RELEASE, EXTEND and TURN.

Invariant. The holder of NAME is its key with the lowest create revision. A key is only ever
created at the end of the queue (etcd's revision grows with every write), so holders follow one
another in create-revision order. The fencing token is the revision of the write that granted the
lock: the create, for an acquisition that found the lock free; for a waiter, a put of its own key
in the TURN that finds it at the head (its create revision dates from when it queued, older than
tokens other names were granted meanwhile). So every token exceeds every token granted before it,
for any name of the cluster. The create revision stays the key's identity for release and extend.

Late copies. A request retried on another member may also be applied later through the first one
(a proposal held up in a cut link, delivered when it heals): a late ACQUIRE can put a released key
back. So a token is only ever the revision of the write that granted the lock in this call, never a
revision read back from a key found in place (``EtcdBackend._join`` takes its turn again with TURN).
A key put back for a slot nobody uses any more waits in its queue, or holds the lock, until this
process uses the slot again or its session lease ends.

Waiting. A waiter watches only the key just before its own (no herd). The watch starts at the
member's current revision (a watch starting in the past waits for etcd's 100 ms catch-up loop);
if that is later than the revision at which the waiter saw the key, it reads the key once more,
so a deletion in between is not missed. Whatever wakes it (the deletion - a release, a ttl
running out, a session lease expiring - or a broken watch stream) it re-reads its place with
TURN before believing anything.

Listing. held_locks() reads ranges in key order with a limit, so a page costs about one page of keys
however many locks are held. A lock's keys are contiguous in that order (its name part holds no
"/"), and its holder is the one of them with the lowest create revision, so a lock is only reported
from a range that holds all of its keys: the last lock of a range cut by its limit is read again by
the next range, and a lock whose queue alone fills a range has its holder read with holder_request().
Key order is the order of quote(NAME) + "/", not of NAME ("a-1" comes before "a"); the cursor of a
page is the name of its last lock in key order, and the next page starts after that lock's keys.

The per-call ttl is enforced by this process: a background thread deletes the key with RELEASE
when it runs out unless the lease was extended. etcd frees the locks of a dead or paused process
when its session lease expires (lease.session_timeout).
"""

import functools
from typing import NamedTuple
from urllib.parse import quote

from etcd3 import etcdrpc

__all__ = [
    "acquire_txn", "count_request", "extend_txn", "holder_request", "keys_of_lock", "listing_request", "lock_queues",
    "range_end", "release_txn", "turn_txn",
]

_CREATE = etcdrpc.Compare.CREATE
_EQUAL = etcdrpc.Compare.EQUAL
_GREATER = etcdrpc.Compare.GREATER
_BY_CREATE = etcdrpc.RangeRequest.CREATE
_ASCEND = etcdrpc.RangeRequest.ASCEND
_DESCEND = etcdrpc.RangeRequest.DESCEND

#: Lock names, keys and templates remembered: the recent ones, so a process touching many names stays small.
_CACHED = 1024


@functools.lru_cache(maxsize=_CACHED)
def keys_of_lock(prefix, name):
    """Return the prefix of the keys of lock ``name`` (see Keys above): percent-encoding a name is not free."""
    return prefix + quote(name, safe="").encode() + b"/"


def range_end(prefix):
    """Return the end of the key range holding every key that starts with ``prefix`` (etcd's "prefix end")."""
    for index in reversed(range(len(prefix))):
        if prefix[index] < 0xFF:
            return prefix[:index] + bytes([prefix[index] + 1])
    return b"\0"


def _queue_range(lock_prefix, lock_end, **options):
    return etcdrpc.RequestOp(request_range=etcdrpc.RangeRequest(
        key=lock_prefix, range_end=lock_end, sort_target=_BY_CREATE, **options))


def _key_range(key):
    return etcdrpc.RequestOp(request_range=etcdrpc.RangeRequest(key=key))


def acquire_txn(lock_prefix, key, value, lease_id, enqueue):
    """ACQUIRE: take a free lock in one round trip or, if ``enqueue``, join the end of its queue.

        If   create_revision(lock/*) == 0            the lock has no holder and no waiter
        Then put(key, value, lease)                  ours: token = header.revision
        Else [0] range(key)                          our key, if an earlier try of this request got through
             [1] range(lock/*, create asc, limit 1)  the holder
             [2] put(key, value, lease)              enqueue only: join the queue (a retry keeps its place)
             [3] range(lock/*, create desc, limit 2) enqueue only: our new key, then the one just before it

    Idempotent for one key, so a request whose answer was lost is simply sent again.
    """
    request = etcdrpc.TxnRequest()
    request.CopyFrom(_acquire_template(lock_prefix, key, lease_id, enqueue))
    request.success[0].request_put.value = value
    if enqueue:
        request.failure[2].request_put.value = value
    return request


@functools.lru_cache(maxsize=_CACHED)
def _acquire_template(lock_prefix, key, lease_id, enqueue):
    """ACQUIRE for one key, without the value: shared, so only ever copied (a copy costs 1/8 of building it)."""
    lock_end = range_end(lock_prefix)
    put = etcdrpc.RequestOp(request_put=etcdrpc.PutRequest(key=key, lease=lease_id))
    failure = [_key_range(key), _queue_range(lock_prefix, lock_end, sort_order=_ASCEND, limit=1)]
    if enqueue:
        failure += [put, _queue_range(lock_prefix, lock_end, sort_order=_DESCEND, limit=2)]
    return etcdrpc.TxnRequest(
        compare=[etcdrpc.Compare(result=_EQUAL, target=_CREATE, key=lock_prefix, range_end=lock_end,
                                 create_revision=0)],
        success=[put], failure=failure,
    )


def turn_txn(lock_prefix, key, revision, value, lease_id):
    """TURN: a waiter whose predecessor went away takes the lock if nobody is left before it.

        If   create_revision(key) == revision              still queued: our session lease is alive and no
                                                           operator removed us (a waiter must never take the
                                                           lock with an expired lease: etcd issue 11456)
             create_revision(lock/*) > revision - 1        every key of the lock came after ours
        Then put(key, value, lease)                        ours: token = header.revision (waiters watch with
                                                           NOPUT, so this wakes nobody)
        Else [0] range(key)                                empty: our key is gone, queue again
             [1] range(lock/*, create < revision,          the key just before ours: watch it next
                       create desc, limit 1)
    """
    lock_end = range_end(lock_prefix)
    put = etcdrpc.RequestOp(request_put=etcdrpc.PutRequest(key=key, value=value, lease=lease_id))
    return etcdrpc.TxnRequest(
        compare=[
            etcdrpc.Compare(result=_EQUAL, target=_CREATE, key=key, create_revision=revision),
            etcdrpc.Compare(result=_GREATER, target=_CREATE, key=lock_prefix, range_end=lock_end,
                            create_revision=revision - 1),
        ],
        success=[put],
        failure=[_key_range(key),
                 _queue_range(lock_prefix, lock_end, sort_order=_DESCEND, limit=1, max_create_revision=revision - 1)],
    )


def extend_txn(key, create_revision):
    """EXTEND: If create_revision(key) == ours - still ours (a read); the new expiry lives in this process."""
    return etcdrpc.TxnRequest(
        compare=[etcdrpc.Compare(result=_EQUAL, target=_CREATE, key=key, create_revision=create_revision)],
    )


def release_txn(key, create_revision):
    """RELEASE: If create_revision(key) == ours Then delete(key) - never deletes a later incarnation of the key."""
    request = etcdrpc.TxnRequest()
    request.CopyFrom(_release_template(key))
    request.compare[0].create_revision = create_revision
    return request


@functools.lru_cache(maxsize=_CACHED)
def _release_template(key):
    """RELEASE for one key, without the revision: shared, so only ever copied."""
    return etcdrpc.TxnRequest(
        compare=[etcdrpc.Compare(result=_EQUAL, target=_CREATE, key=key)],
        success=[etcdrpc.RequestOp(request_delete_range=etcdrpc.DeleteRangeRequest(key=key))],
    )


def holder_request(lock_prefix):
    """Read the holder of a lock: its key with the lowest create revision (see Invariant)."""
    return etcdrpc.RangeRequest(key=lock_prefix, range_end=range_end(lock_prefix), sort_target=_BY_CREATE,
                                sort_order=_ASCEND, limit=1)


def listing_request(start, end, limit):
    """Read the first ``limit`` keys from ``start`` up to ``end`` in key order: each lock's keys come together.

    No sort order is asked: etcd returns a range in key order anyway, and with any sort order set it
    reads the whole range before it sorts and cuts it to the limit (a first page took 0.75 s with
    100,000 locks held; bench/listing.py).
    """
    return etcdrpc.RangeRequest(key=start, range_end=end, limit=limit)


class Queue(NamedTuple):
    """The keys of one lock that a listing range read, and the key range ``[start, end)`` the lock spans."""

    start: bytes
    end: bytes
    kvs: list


def lock_queues(prefix, kvs):
    """Split ``kvs``, read in key order under ``prefix``, into one ``Queue`` per lock, in key order.

    A key with no "/" after ``prefix`` is no contender's: it is a ``Queue`` of its own with no keys, so
    a listing steps over it.
    """
    queues = []
    for kv in kvs:
        quoted_name, separator, _ = kv.key[len(prefix):].partition(b"/")
        if not separator:
            queues.append(Queue(kv.key, kv.key + b"\0", []))
            continue
        lock_prefix = prefix + quoted_name + b"/"
        if queues and queues[-1].start == lock_prefix:
            queues[-1].kvs.append(kv)
        else:
            queues.append(Queue(lock_prefix, range_end(lock_prefix), [kv]))
    return queues


def count_request(start):
    """Count the keys that start with ``start`` and read none (a ping)."""
    return etcdrpc.RangeRequest(key=start, range_end=range_end(start), count_only=True)
