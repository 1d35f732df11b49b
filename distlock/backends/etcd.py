"""etcd v3 backend: a FIFO queue of keys per lock, one session lease per process, revisions as fencing tokens."""

import functools
import heapq
import json
import logging
import math
import os
import threading
import time
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import NamedTuple
from urllib.parse import quote, unquote

import grpc
from django.core.exceptions import ImproperlyConfigured
from etcd3 import etcdrpc
from google.protobuf.message import DecodeError
from grpc._cython import cygrpc

from distlock.backends.base import (
    NOTIFICATIONS, SAFE_FENCING_TOKENS, BaseLockBackend, Grant, LockInfo, Option, positive_number,
    refuse_after_late_grants,
)
from distlock.backends.green import Daemon, green_library, killed
from distlock.backends.offload import Abandoned, Offloader
from distlock.exceptions import BackendUnavailable, LockNotAcquired
from distlock.holder import holder_record, new_owner
from distlock.redaction import redact

logger = logging.getLogger("distlock.backends.etcd")

# -- Protocol ---------------------------------------------------------------------------------------
#
# Keys. Every contender for lock NAME, the holder and each waiter, owns one key
#     {PREFIX}{quote(NAME)}/{session lease id, hex}-{slot}
# attached to its process's session lease, so etcd deletes it once that process stops keeping the
# lease alive (crash, pause, partition). quote() leaves no "/" in the name part, so the range
# "{PREFIX}{quote(NAME)}/" holds exactly the keys of NAME whatever the name contains ("/", "..",
# spaces, unicode). The value is JSON {owner, host, pid, task_id, created_at}: the lease's owner id
# lives there, read by held_locks() and force_release().
#
# Slots. The slot is the lowest number no other acquire call of this process is using for NAME, so
# a process reuses a handful of keys per lock instead of making one per acquisition: etcd keeps a
# deleted key in its index until the cluster is compacted, and the range compare of ACQUIRE visits
# every such key, so fresh keys would slow a hot lock's every transaction as it is used (+20% after
# 4,000 acquisitions on a test cluster). A slot is free again only once its key is known to be gone
# (released, expired, deleted), so a key never has two contenders; its incarnations differ by their
# create revision, which identifies the contender in RELEASE, EXTEND and TURN.
#
# Invariant. The holder of NAME is its key with the lowest create revision. A key is only ever
# created at the end of the queue (etcd's revision grows with every write), so holders follow one
# another in create-revision order. The fencing token is the revision of the write that granted the
# lock: the create, for an acquisition that found the lock free; for a waiter, a put of its own key
# in the TURN that finds it at the head (its create revision dates from when it queued, older than
# tokens other names were granted meanwhile). So every token exceeds every token granted before it,
# for any name of the cluster. The create revision stays the key's identity for release and extend.
#
# Waiting. A waiter watches only the key just before its own (no herd). The watch starts at the
# member's current revision (a watch starting in the past waits for etcd's 100 ms catch-up loop);
# if that is later than the revision at which the waiter saw the key, it reads the key once more,
# so a deletion in between is not missed. Whatever wakes it (the deletion - a release, a ttl
# running out, a session lease expiring - or a broken watch stream) it re-reads its place with
# TURN before believing anything.
#
# The per-call ttl is enforced by this process: a background thread deletes the key with RELEASE
# when it runs out unless the lease was extended. etcd frees the locks of a dead or paused process
# when its session lease expires (lease.session_timeout).

_CREATE = etcdrpc.Compare.CREATE
_EQUAL = etcdrpc.Compare.EQUAL
_GREATER = etcdrpc.Compare.GREATER
_BY_CREATE = etcdrpc.RangeRequest.CREATE
_ASCEND = etcdrpc.RangeRequest.ASCEND
_DESCEND = etcdrpc.RangeRequest.DESCEND


#: Lock names, keys and templates remembered: the recent ones, so a process touching many names stays small.
_CACHED = 1024


@functools.lru_cache(maxsize=_CACHED)
def _keys_of_lock(prefix, name):
    """Return the prefix of the keys of lock ``name`` (see Keys above): percent-encoding a name is not free."""
    return prefix + quote(name, safe="").encode() + b"/"


def _range_end(prefix):
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
    lock_end = _range_end(lock_prefix)
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
    lock_end = _range_end(lock_prefix)
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


# -- Talking to the cluster -------------------------------------------------------------------------

#: Codes after which the same request goes to the next endpoint: the member is down, has no leader, or hung.
_RETRIED_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})
#: Makes a member without a leader refuse at once ("etcdserver: no leader") instead of holding the request.
_REQUIRE_LEADER = (("hasleader", "true"),)
#: A restarted member is reconnected to within a second, not after gRPC's default back-off of up to 2 minutes.
#: Each channel keeps its own connections (no process-wide subchannel pool), so a channel built after a fork
#: never picks up a connection of the parent's.
_CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.use_local_subchannel_pool", 1),
]
#: Seconds a request gets even when the caller's timeout is shorter (a non-blocking attempt still needs an answer).
MIN_REQUEST_SECONDS = 1.0
#: Seconds ``fork()`` waits for the calls it cancelled to return before it goes ahead anyway.
FORK_QUIESCE_SECONDS = 2.0
#: What etcd answers (INVALID_ARGUMENT) once an auth token expired (``--auth-token-ttl``, 5 minutes idle).
_INVALID_TOKEN = "invalid auth token"

class _SessionGone(BackendUnavailable):
    """etcd no longer knows the session lease ("requested lease not found"): it expired or was revoked."""


#: The exception a response deserializer raised in this thread during the current call (see ``_guarded``).
_foreign = threading.local()


def _guarded(parse):
    """Return the response deserializer ``parse``, remembering in ``_foreign`` any exception it raises.

    gRPC catches an ``Exception`` raised while a response is deserialized and reports the call as
    failed (INTERNAL, "Exception deserializing response!"). Only a malformed message should end that
    way: a Celery soft time limit (``SoftTimeLimitExceeded``) or another signal handler's exception
    landing there is re-raised by ``_raise_foreign`` as itself, not reported as the cluster failing.
    """
    def deserialize(data):
        try:
            return parse(data)
        except DecodeError:
            raise
        except BaseException as exc:
            _foreign.exc = exc
            raise

    return deserialize


def _raise_foreign():
    """Raise the exception a deserializer of this thread's current call raised, if any (see ``_guarded``)."""
    exc = getattr(_foreign, "exc", None)
    if exc is not None:
        _foreign.exc = None
        raise exc.with_traceback(exc.__traceback__) from None


class _Service:
    """The methods of one etcd gRPC service this backend calls, with guarded response deserializers."""

    def __init__(self, channel, service, methods):
        for method, (kind, request, response) in methods.items():
            setattr(self, method, getattr(channel, kind)(
                f"/etcdserverpb.{service}/{method}", request_serializer=request.SerializeToString,
                response_deserializer=_guarded(response.FromString)))


#: True once this module opened a gRPC channel in this process (see ``_prepare_for_green_threads``).
_channels_opened = False
#: Keeps gRPC initialized from the first channel on (a completion queue holds a reference, as a channel
#: does). Without it, closing the last channel, as ``_before_fork`` does, shuts gRPC down on a thread of its
#: own, and a child forked while that thread holds gRPC's init lock hangs in its first channel.
_grpc_reference = None


class _Channel:
    """One endpoint: its gRPC channel and the methods of etcd's API (python3-etcd3's generated messages)."""

    def __init__(self, address, security):
        global _channels_opened, _grpc_reference  # noqa: PLW0603 - once per process
        if _grpc_reference is None:
            _grpc_reference = cygrpc.CompletionQueue()
        _channels_opened = True
        self.address = address
        if security.tls:
            self.channel = grpc.secure_channel(address, security.channel_credentials(), options=_CHANNEL_OPTIONS)
        else:
            self.channel = grpc.insecure_channel(address, options=_CHANNEL_OPTIONS)
        self.kv = _Service(self.channel, "KV", {
            "Range": ("unary_unary", etcdrpc.RangeRequest, etcdrpc.RangeResponse),
            "Txn": ("unary_unary", etcdrpc.TxnRequest, etcdrpc.TxnResponse),
            "DeleteRange": ("unary_unary", etcdrpc.DeleteRangeRequest, etcdrpc.DeleteRangeResponse),
        })
        self.lease = _Service(self.channel, "Lease", {
            "LeaseGrant": ("unary_unary", etcdrpc.LeaseGrantRequest, etcdrpc.LeaseGrantResponse),
            "LeaseRevoke": ("unary_unary", etcdrpc.LeaseRevokeRequest, etcdrpc.LeaseRevokeResponse),
            "LeaseKeepAlive": ("stream_stream", etcdrpc.LeaseKeepAliveRequest, etcdrpc.LeaseKeepAliveResponse),
        })
        self.watch = _Service(self.channel, "Watch", {
            "Watch": ("stream_stream", etcdrpc.WatchRequest, etcdrpc.WatchResponse),
        })
        self.auth = _Service(self.channel, "Auth", {
            "Authenticate": ("unary_unary", etcdrpc.AuthenticateRequest, etcdrpc.AuthenticateResponse),
        })


@dataclass(frozen=True)
class _Security:
    """TLS and etcd auth settings of an alias. The password never shows in a repr, a message or a log line."""

    tls: bool = False
    ca_cert: str | None = None
    cert_key: str | None = None
    cert_cert: str | None = None
    user: str | None = None
    password: str | None = field(default=None, repr=False)

    def channel_credentials(self):
        """Return gRPC TLS credentials from the PEM files (read at each channel build, so renewed files count)."""
        def read(option, path):
            if path is None:
                return None
            try:
                with open(path, "rb") as file:
                    return file.read()
            except OSError as exc:
                raise BackendUnavailable(f"could not read the {option} file {path!r}: {exc.strerror}") from None

        return grpc.ssl_channel_credentials(root_certificates=read("CA_CERT", self.ca_cert),
                                            private_key=read("CERT_KEY", self.cert_key),
                                            certificate_chain=read("CERT_CERT", self.cert_cert))


#: Every live connection of this process, for the fork hooks below.
_CONNECTIONS = weakref.WeakSet()


class _Connection:
    """The cluster's endpoints with failover: requests go to one endpoint until it fails, then to the next.

    Built on gRPC stubs of python3-etcd3's generated messages rather than on its ``Etcd3Client``,
    which has one timeout for every call (a caller's timeout could not bound a request), drops the
    transaction header (the fencing token), shuns a failed endpoint for 5 minutes, and whose watch
    thread dies with ``NameError: six`` when a stream ends, leaving waiters asleep.

    Fork. gRPC's core is not safe to fork while a thread is inside a call (the child hangs or finds
    the parent's sockets in its new channels), so ``fork()`` first holds new calls back, closes the
    channels (which cancels the calls in flight: they are sent again on new channels, as after a
    failed endpoint) and waits for those calls to return. Both processes then build new channels at
    their next request; the parent's session lease and locks are untouched.
    """

    def __init__(self, alias, addresses, timeout, security=None):
        self.alias = alias
        self.addresses = addresses
        self.timeout = timeout
        self.security = security or _Security()
        self._channels = None
        self._current = 0
        self._reset_state()
        _CONNECTIONS.add(self)

    def _reset_state(self):
        self._lock = threading.Lock()
        #: Signalled when the last call in flight returns while a fork waits for it.
        self._idle = threading.Condition(self._lock)
        self._in_flight = 0
        self._forking = False
        #: Bumped when a fork closes the channels: a call that fails on an older channel is sent again.
        self._generation = 0
        #: The etcd auth token (USER/PASSWORD), or None until the first request authenticates.
        self._token = None

    def _channel(self):
        """Return the current endpoint's channel, opening the channels if needed."""
        with self._lock:
            return self._open()

    def _open(self):
        if self._channels is None:
            self._channels = [_Channel(address, self.security) for address in self.addresses]
        return self._channels[self._current]

    @contextmanager
    def _using(self):
        """Yield the current channel and its generation, counted as in flight (a fork waits for it)."""
        with self._lock:
            while self._forking:
                self._idle.wait()
            channel = self._open()
            generation = self._generation
            self._in_flight += 1
        try:
            yield channel, generation
        finally:
            with self._lock:
                self._in_flight = max(self._in_flight - 1, 0)
                if self._forking and not self._in_flight:
                    self._idle.notify_all()

    def _failed(self, channel):
        """Send the next requests to the endpoint after ``channel`` (unless another thread already moved on)."""
        with self._lock:
            if self._channels is not None and self._channels[self._current] is channel:
                self._current = (self._current + 1) % len(self._channels)

    def deadline(self, caller_deadline=None):
        """Return when a request gives up: TIMEOUT from now, or the caller's deadline if sooner (but >= 1 s)."""
        now = time.monotonic()
        budget = self.timeout
        if caller_deadline is not None:
            budget = min(budget, max(caller_deadline - now, MIN_REQUEST_SECONDS))
        return now + budget

    def _metadata(self, channel, timeout):
        """Return the metadata of a request: require a leader and, with USER set, carry the auth token."""
        security = self.security
        if security.user is None:
            return _REQUIRE_LEADER
        token = self._token
        if token is None:
            try:
                token = channel.auth.Authenticate(
                    etcdrpc.AuthenticateRequest(name=security.user, password=security.password),
                    timeout=timeout, metadata=_REQUIRE_LEADER).token
            except grpc.RpcError as exc:
                _raise_foreign()
                if exc.code() in _RETRIED_CODES:
                    raise  # the member is down: the next endpoint is tried
                raise BackendUnavailable(
                    f"etcd alias '{self.alias}' could not authenticate as USER {security.user!r}: "
                    f"{exc.code().name}: {exc.details()} (endpoint {channel.address}). Check USER and PASSWORD."
                ) from None
            self._token = token
        return (*_REQUIRE_LEADER, ("token", token))

    def call(self, what, invoke, deadline):
        """Return ``invoke(channel, timeout, metadata)``, trying the endpoints in turn until one answers or
        ``deadline`` passes.

        Only idempotent requests go through here: a request whose answer was lost may have been applied.
        An exception that is not gRPC's (a time limit, ``KeyboardInterrupt``) propagates untouched, even
        when it was raised inside gRPC's response deserializer.
        """
        attempt_limit = max(self.timeout / len(self.addresses), MIN_REQUEST_SECONDS)
        pause = 0.02
        failures = 0
        renewed_token = False
        while True:
            with self._using() as (channel, generation):
                timeout = max(min(deadline - time.monotonic(), attempt_limit), 0.001)
                _foreign.exc = None
                try:
                    return invoke(channel, timeout, self._metadata(channel, timeout))
                except grpc.RpcError as exc:
                    _raise_foreign()
                    if generation != self._generation:
                        continue  # a fork closed the channel under the call: send it again on a new one
                    code, details = exc.code(), exc.details() or ""
                    if code is grpc.StatusCode.NOT_FOUND and "lease not found" in details:
                        raise _SessionGone(f"etcd alias '{self.alias}': {details} ({what}).") from exc
                    if _INVALID_TOKEN in details and not renewed_token:
                        self._token, renewed_token = None, True  # expired: authenticate again, once
                        continue
                    if code not in _RETRIED_CODES or time.monotonic() + pause >= deadline:
                        raise BackendUnavailable(
                            f"etcd alias '{self.alias}' could not {what}: {code.name}: {details} "
                            f"(last endpoint {channel.address}; ENDPOINTS {', '.join(self.addresses)}). "
                            f"{self._hint(code, details)}"
                        ) from exc
                except ValueError as exc:
                    if "closed channel" not in str(exc):
                        raise
                    if generation != self._generation:
                        continue  # closed by a fork between taking the channel and calling it
                    # close() ran meanwhile
                    raise BackendUnavailable(f"etcd alias '{self.alias}' could not {what}: {exc}") from exc
            self._failed(channel)
            failures += 1
            if failures % len(self.addresses) == 0:  # every endpoint failed once: do not spin
                time.sleep(pause)
                pause = min(pause * 2, 0.5)

    def _hint(self, code, details):
        lowered = details.lower()
        if "handshake" in lowered or "certificate" in lowered or "ssl" in lowered:
            return ("The TLS handshake failed: check that CA_CERT is the CA that signed the members' certificates "
                    "(and CERT_CERT/CERT_KEY if the cluster checks client certificates).")
        if "permission denied" in lowered or "user name" in lowered or "auth" in lowered:
            return "etcd auth refused the request: check USER and PASSWORD, and the user's role."
        if code in _RETRIED_CODES:
            return "Check that the cluster is up and has a leader" + (
                "." if self.security.tls else ", and set CA_CERT if it serves TLS.")
        return "etcd refused the request."

    def txn(self, what, request, deadline):
        return self.call(what, lambda channel, timeout, metadata: channel.kv.Txn(
            request, timeout=timeout, metadata=metadata), deadline)

    def range(self, what, request, deadline):
        return self.call(what, lambda channel, timeout, metadata: channel.kv.Range(
            request, timeout=timeout, metadata=metadata), deadline)

    def delete(self, what, key, deadline):
        return self.call(what, lambda channel, timeout, metadata: channel.kv.DeleteRange(
            etcdrpc.DeleteRangeRequest(key=key), timeout=timeout, metadata=metadata), deadline)

    def grant_lease(self, ttl, deadline):
        # Not idempotent: a grant whose answer is lost leaves a lease nobody keeps alive; it expires after ttl.
        return self.call("grant a session lease", lambda channel, timeout, metadata: channel.lease.LeaseGrant(
            etcdrpc.LeaseGrantRequest(TTL=ttl), timeout=timeout, metadata=metadata), deadline)

    def revoke_lease(self, lease_id, deadline):
        return self.call("revoke the session lease", lambda channel, timeout, metadata: channel.lease.LeaseRevoke(
            etcdrpc.LeaseRevokeRequest(ID=lease_id), timeout=timeout, metadata=metadata), deadline)

    def keep_alive(self, lease_id, deadline):
        """Refresh the lease once; return its TTL as etcd reports it (0 or less: etcd no longer has it)."""
        def invoke(channel, timeout, metadata):
            stream = channel.lease.LeaseKeepAlive(iter([etcdrpc.LeaseKeepAliveRequest(ID=lease_id)]),
                                                  timeout=timeout, metadata=metadata)
            try:
                return next(stream).TTL
            except StopIteration:
                return 0
            finally:
                stream.cancel()

        return self.call("keep the session lease alive", invoke, deadline)

    def wait_for_deletion(self, key, create_revision, seen_at, until):
        """Return once incarnation ``create_revision`` of ``key``, alive at revision ``seen_at``, is deleted,
        the watch stream ends, or ``until`` passes.

        The watch starts at the member's current revision, not at ``seen_at + 1``: etcd serves a watch
        that starts in the past from a catch-up loop that runs every 100 ms, which would add up to
        100 ms to each hand-off of a busy lock (other waiters write in between). A deletion between
        ``seen_at`` and the start of the watch is caught by reading the key once the watch exists.
        The caller re-reads the queue whatever woke it, so a stream that broke (its member stopped or
        lost the leader, a fork closed the channel) wakes the waiter instead of leaving it blocked.
        """
        timeout = until - time.monotonic()
        if timeout <= 0:
            return
        request = etcdrpc.WatchRequest(create_request=etcdrpc.WatchCreateRequest(
            key=key, filters=[etcdrpc.WatchCreateRequest.NOPUT]))
        with self._using() as (channel, _):
            _foreign.exc = None
            try:
                metadata = self._metadata(channel, timeout)
                stream = channel.watch.Watch(iter([request]), timeout=timeout, metadata=metadata)
            except grpc.RpcError:
                _raise_foreign()
                return  # the caller re-reads the queue through ``call``, which reports a failing cluster
            except ValueError:  # the channel was closed by close() or a fork; the next request reports it
                return
            try:
                for response in stream:
                    if response.events or response.canceled or response.compact_revision:
                        return
                    # The watch reports every deletion after header.revision, the revision it started at.
                    if response.created and response.header.revision > seen_at and not self._still_there(
                            channel, key, create_revision, until, metadata):
                        return
            except grpc.RpcError as exc:
                _raise_foreign()
                if exc.code() not in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED):
                    logger.info("etcd watch on %s ended (%s: %s); re-reading the queue", channel.address,
                                exc.code().name, exc.details())
                    self._failed(channel)
                    time.sleep(min(0.05, max(until - time.monotonic(), 0)))  # do not spin on a member that is down
            finally:
                stream.cancel()

    @staticmethod
    def _still_there(channel, key, create_revision, until, metadata):
        """Return True if incarnation ``create_revision`` of ``key`` exists now (a linearizable read)."""
        kvs = channel.kv.Range(etcdrpc.RangeRequest(key=key, keys_only=True),
                               timeout=max(until - time.monotonic(), 0.001), metadata=metadata).kvs
        return bool(kvs) and kvs[0].create_revision == create_revision

    def close(self):
        with self._lock:
            channels, self._channels, self._current = self._channels, None, 0
        for channel in channels or ():
            channel.channel.close()

    # -- fork (see the class docstring) -------------------------------------------------------------

    def _before_fork(self):
        """Hold new calls back, close the channels (cancelling calls in flight), wait for those to return.

        Returns with ``_lock`` held: no thread of the parent holds it while the child is made.
        """
        with self._lock:
            self._forking = True
            channels, self._channels = self._channels, None
            self._generation += 1
        for channel in channels or ():
            try:
                channel.channel.close()
            except Exception:  # noqa: BLE001 - a fork hook must not fail half-way (it would leave _lock taken)
                logger.exception("etcd alias '%s': closing a channel before fork() failed", self.alias)
        give_up = time.monotonic() + FORK_QUIESCE_SECONDS
        self._lock.acquire()
        while self._in_flight and time.monotonic() < give_up:
            self._idle.wait(max(give_up - time.monotonic(), 0))
        # gRPC's own thread that completes streaming calls leaves once their cancellations are processed.
        while any(_managed_calls(channel) for channel in channels or ()) and time.monotonic() < give_up:
            self._idle.wait(0.005)
        if self._in_flight or any(_managed_calls(channel) for channel in channels or ()):
            logger.warning("etcd alias '%s': calls were still in gRPC when fork() went ahead after %.1fs",
                           self.alias, FORK_QUIESCE_SECONDS)

    def _after_fork_in_parent(self):
        self._forking = False
        self._idle.notify_all()
        self._lock.release()

    def _after_fork_in_child(self):
        """Start afresh: no parent thread exists here to release the lock or finish a call."""
        self._channels, self._current = None, 0
        self._reset_state()


def _managed_calls(channel):
    """Return how many calls gRPC's completion thread of ``channel`` still handles (0 if unknown)."""
    state = getattr(channel.channel, "_call_state", None)
    return getattr(state, "managed_calls", 0)


def _before_fork():
    for connection in list(_CONNECTIONS):
        connection._before_fork()
    if _CONNECTIONS and _gevent_activated():
        _wait_for_grpc_greenlets()


def _wait_for_grpc_greenlets():
    """Under gevent, wait for gRPC's greenlet that takes completions from its C threads to end.

    It waits for them on a thread of gevent's pool, in a C++ mutex of gRPC's: a child forked while that
    thread held it finds it locked forever, and hangs in its first channel. It ends once the last
    channel is closed, as ``_before_fork`` just did.
    """
    greenlets = getattr(cygrpc, "g_gevent_pool", None)  # gRPC's own group of those greenlets
    if greenlets is not None and not greenlets.join(timeout=FORK_QUIESCE_SECONDS):
        logger.warning("gRPC's gevent greenlet still ran when fork() went ahead after %.1fs (another gRPC channel "
                       "of this process is open?): the child may hang in its first etcd call", FORK_QUIESCE_SECONDS)


def _after_fork_in_parent():
    for connection in list(_CONNECTIONS):
        if connection._forking:
            connection._after_fork_in_parent()


def _after_fork_in_child():
    for connection in list(_CONNECTIONS):
        connection._after_fork_in_child()
    for backend in list(_BACKENDS):
        backend._after_fork_in_child()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent,
                        after_in_child=_after_fork_in_child)


# -- State kept by the backend ----------------------------------------------------------------------


class _Session:
    """One etcd lease shared by every key this backend owns in this process (like etcd's ``concurrency.Session``).

    Its slots (see the protocol) belong to it: keys of another session have other names.
    """

    def __init__(self, lease_id, ttl, sent):
        self.id = lease_id
        #: The TTL etcd granted: at least its minimum (1.5 x election timeout), whatever LEASE_TTL asked.
        self.ttl = ttl
        #: Until then etcd keeps the lease even if no keepalive gets through: the last one that did was
        #: *sent* at ``valid_until - ttl``, and etcd restarted the TTL when it arrived, later.
        self.valid_until = sent + ttl
        self.next_keepalive = sent + ttl / 3
        #: Why it was declared lost, or None while alive.
        self.lost = None
        self.leases = weakref.WeakSet()
        #: Slots in use, per lock name: {name: {slot: owner of the acquire call using it}}.
        self.slots = {}
        #: The process that holds it: a forked child inherits the object, not the session.
        self.pid = os.getpid()

    def usable(self, now):
        """Return True if locks may be granted on this session at ``now`` (monotonic): not lost, not run out."""
        return self.lost is None and now < self.valid_until

    @property
    def ours(self):
        """True in the process that was granted the session; False in a forked child."""
        return self.pid == os.getpid()


@dataclass
class _Contender:
    """One acquire call: its key in the lock's queue and, once queued, that key's create revision."""

    name: str
    owner: str
    lock_prefix: bytes
    #: Our key, and the session whose slot it is: set by ``_take_slot`` for each session we queue on.
    key: bytes = b""
    session: "_Session | None" = None
    slot: int | None = None
    #: The key's create revision once queued: its identity for release and extend.
    revision: int | None = None
    #: The revision of the write that granted the lock (see the protocol): the fencing token.
    token: int | None = None
    #: The key's value (holder metadata), written again by TURN.
    value: bytes = b""
    #: True once a request that may have created the key was sent: leaving without the lock deletes it.
    may_exist: bool = False
    #: ACQUIRE and TURN requests sent; more than one means the call waited (``Lease.attempts``).
    attempts: int = 0
    #: Grants that came back after the ttl had run out (see ``refuse_after_late_grants``).
    late_grants: int = 0
    #: The offloaded job running this call: once cancelled (its caller was interrupted), the wait stops.
    job: object = None


class _Held(NamedTuple):
    """``Lease.handle``: the key that holds the lock, its create revision (its identity), its session and slot."""

    key: bytes
    create_revision: int
    session: _Session
    name: str
    slot: int
    owner: str


@dataclass
class _Expiry:
    """When the background thread deletes a held key whose per-call ttl ran out."""

    held: _Held
    deadline: float  # time.monotonic()
    #: Extensions in flight: the key is not deleted while one may still succeed.
    extending: int = 0
    deleting: bool = False


def _parse_endpoints(value):
    """Return ``value`` ("host:port,..." or a list of them) as a list of "host:port", and whether they are
    ``https://`` (TLS); raise ``ValueError``."""
    items = value.split(",") if isinstance(value, str) else list(value)
    endpoints, schemes = [], set()
    for item in items:
        if not isinstance(item, str):
            raise ValueError(f"each endpoint must be a 'host:port' string, got {redact(repr(item))}")
        address = item.strip()
        scheme, separator, rest = address.partition("://")
        if separator:
            if scheme not in ("http", "https"):
                raise ValueError(f"an endpoint's scheme must be http:// or https://, got {redact(repr(item))}")
            schemes.add(scheme)
            address = rest
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536 or "@" in host or "/" in host:
            raise ValueError(f"each endpoint must be 'host:port' with a port from 1 to 65535, got {redact(repr(item))}")
        endpoints.append(address)
    if not endpoints:
        raise ValueError("at least one endpoint is needed")
    if len(schemes) > 1:
        raise ValueError("endpoints mix http:// and https://; one cluster speaks TLS on every member or on none")
    return endpoints, schemes == {"https"}


def _check_endpoints(value):
    if value is None:
        return None
    try:
        _parse_endpoints(value)
    except ValueError as exc:
        return f"is not usable: {exc}"
    return None


def _check_lease_ttl(value):
    if not 1 <= value <= 9_000_000_000:
        return "must be a whole number of seconds from 1 to 9000000000 (etcd's maximum lease TTL)"
    return None


def _check_prefix(value):
    return None if value else "must not be empty"


def _check_port(value):
    return None if value is None or 0 < value < 65536 else "must be a port number from 1 to 65535"


def _check_not_empty(value):
    return None if value is None or value else "must not be empty (None leaves it unset)"


class _SecretOption(Option):
    """An option whose value is a secret: no message ever shows it, not even a wrong one."""

    def clean(self, alias, name, value):
        if value is not None and (not isinstance(value, str) or not value):
            raise ImproperlyConfigured(
                f"DISTLOCK['{alias}']['OPTIONS']['{name}'] must be {self.expected}, got "
                f"{'an empty str' if value == '' else 'a ' + type(value).__name__} (the value is not shown)."
            )
        return value


def _uses_tls(options):
    """Return True if the alias's cleaned options ask for TLS: a CA_CERT, or ``https://`` endpoints."""
    https = options["ENDPOINTS"] is not None and _parse_endpoints(options["ENDPOINTS"])[1]
    return options["CA_CERT"] is not None or https


def _gevent_activated():
    return bool(getattr(cygrpc, "g_gevent_activated", False))  # gRPC's own flag, set by init_gevent()


def _green_problem(alias):
    """Return why gRPC would block this green process's hub, or None (no I/O, no side effect).

    Under eventlet gRPC's C core blocks the hub (there is no eventlet support in gRPC): refused.
    Under gevent ``init_gevent()`` makes gRPC cooperative, but only before the process opened a channel.
    """
    green = green_library()
    if green == "eventlet":
        return (f"DISTLOCK['{alias}'] uses etcd in a process monkey-patched by eventlet: gRPC has no eventlet "
                "support, its calls block every green thread of the process (keepalives miss, leases are lost). "
                "Run this process without eventlet (Celery --pool=prefork, threads or gevent), or use another "
                "backend (Redis, ZooKeeper, the database) for this alias.")
    if green == "gevent" and _channels_opened and not _gevent_activated():
        return (f"DISTLOCK['{alias}'] uses etcd in a process monkey-patched by gevent, but gRPC channels were "
                "opened before gRPC's gevent support was enabled, so its calls would block every greenlet. Call "
                "grpc.experimental.gevent.init_gevent() right after gevent.monkey.patch_all(), before anything "
                "uses etcd.")
    return None


def _prepare_for_green_threads(alias):
    """Make gRPC cooperative in a gevent-patched process (``init_gevent()``); raise where it cannot be."""
    problem = _green_problem(alias)
    if problem:
        raise ImproperlyConfigured(problem)
    if green_library() == "gevent" and not _gevent_activated():
        import grpc.experimental.gevent  # noqa: PLC0415 - only under gevent

        grpc.experimental.gevent.init_gevent()
        logger.info("etcd alias '%s': gevent-patched process, enabled gRPC's gevent support (init_gevent())", alias)


def _parse_time(value):
    return datetime.fromisoformat(value) if isinstance(value, str) else None


#: Every live backend of this process, for the fork hook (``_after_fork_in_child``).
_BACKENDS = weakref.WeakSet()


class EtcdBackend(BaseLockBackend):
    """Locks on an etcd v3 cluster: linearizable, granted in FIFO order, fenced by create revisions.

    Each lock is a queue of keys, one per contender, attached to the process's session lease (see
    the protocol at the top of this module). Acquiring a free lock costs one transaction; a waiter
    watches only the key just before its own. One session lease per backend per process, granted
    at the first acquisition and kept alive every TTL/3 by a background thread, is what etcd
    frees a dead process's locks by: ``lease.session_timeout`` is its TTL as etcd granted it, which
    etcd silently raises to its minimum (1.5 x election timeout: 2 s with default flags). If the
    keepalive cannot get through for that long, every lease held on the session is marked lost and
    ``lock_lost`` is sent; the next acquisition grants a new session lease.

    The per-call ``ttl`` keeps its meaning: this process deletes the key when it runs out unless the
    lease was extended.
    """

    capabilities = frozenset({SAFE_FENCING_TOKENS, NOTIFICATIONS})

    options = {
        "ENDPOINTS": Option((str, list, tuple, type(None)), None, check=_check_endpoints,
                            expected="a list of 'host:port' strings or one comma-separated string"),
        "HOST": Option((str, type(None)), None, expected="a host name or address"),
        "PORT": Option((int, type(None)), None, check=_check_port, expected="an int"),
        "LEASE_TTL": Option(int, 10, check=_check_lease_ttl, expected="a whole number of seconds (int)"),
        "TIMEOUT": Option((int, float), 5, check=positive_number, expected="a number of seconds"),
        "PREFIX": Option(str, "/distlock/", check=_check_prefix, expected="a str"),
        # TLS and auth, named like python3-etcd3's client(ca_cert=, cert_key=, cert_cert=, user=, password=).
        "CA_CERT": Option((str, type(None)), None, check=_check_not_empty,
                          expected="the path of the PEM file of the CA that signed the members' certificates"),
        "CERT_KEY": Option((str, type(None)), None, check=_check_not_empty,
                           expected="the path of the PEM file of the client certificate's private key"),
        "CERT_CERT": Option((str, type(None)), None, check=_check_not_empty,
                            expected="the path of the PEM file of the client certificate"),
        "USER": Option((str, type(None)), None, check=_check_not_empty, expected="an etcd user name"),
        "PASSWORD": _SecretOption((str, type(None)), None, expected="a non-empty str"),
    }

    @classmethod
    def check_combination(cls, alias, options):
        if options["ENDPOINTS"] is not None and (options["HOST"] is not None or options["PORT"] is not None):
            raise ImproperlyConfigured(
                f"DISTLOCK['{alias}']['OPTIONS'] gives both ENDPOINTS and HOST/PORT; "
                "use ENDPOINTS for a cluster, or HOST/PORT for a single member."
            )
        if (options["CERT_KEY"] is None) != (options["CERT_CERT"] is None):
            raise ImproperlyConfigured(
                f"DISTLOCK['{alias}']['OPTIONS'] gives only one of CERT_KEY and CERT_CERT; a client certificate "
                "needs both (or neither)."
            )
        if options["CERT_CERT"] is not None and not _uses_tls(options):
            raise ImproperlyConfigured(
                f"DISTLOCK['{alias}']['OPTIONS'] gives a client certificate (CERT_CERT/CERT_KEY) without TLS; set "
                "CA_CERT (or https:// ENDPOINTS to trust the system's CAs)."
            )
        if (options["USER"] is None) != (options["PASSWORD"] is None):
            raise ImproperlyConfigured(
                f"DISTLOCK['{alias}']['OPTIONS'] gives only one of USER and PASSWORD; etcd auth needs both."
            )
        problem = _green_problem(alias)
        if problem:
            raise ImproperlyConfigured(problem)

    @classmethod
    def security_warnings(cls, alias, options):
        """Warn when the alias speaks to etcd in clear text without auth, or sends its password in clear text."""
        tls, auth = _uses_tls(options), options["USER"] is not None
        if not tls and not auth:
            return ["etcd is used without TLS and without auth: anyone who can reach the cluster can read and "
                    "delete lock keys (and so take any lock). Set CA_CERT (TLS; CERT_CERT/CERT_KEY for client "
                    "certificates) and USER/PASSWORD (etcd auth)."]
        if auth and not tls:
            return ["etcd auth is used without TLS: the password and the auth token cross the network in clear "
                    "text. Set CA_CERT (and https:// ENDPOINTS)."]
        return []

    def __init__(self, alias, options):
        super().__init__(alias, options)
        settings = self.settings
        tls = _uses_tls(settings)
        if settings["ENDPOINTS"] is not None:
            endpoints, _ = _parse_endpoints(settings["ENDPOINTS"])
        else:
            endpoints = [f"{settings['HOST'] or '127.0.0.1'}:{settings['PORT'] or 2379}"]
        _prepare_for_green_threads(alias)
        self._prefix = settings["PREFIX"].encode()
        security = _Security(tls=tls, ca_cert=settings["CA_CERT"], cert_key=settings["CERT_KEY"],
                             cert_cert=settings["CERT_CERT"], user=settings["USER"], password=settings["PASSWORD"])
        self._connection = _Connection(alias, endpoints, settings["TIMEOUT"], security)
        #: Guards the session pointer, the expiry schedule and the cleanup sets (never held during I/O).
        self._lock = threading.Lock()
        #: Serialises granting a session lease, so concurrent first acquisitions share one.
        self._session_grant_lock = threading.Lock()
        self._session = None
        self._expiries = {}
        self._expiry_heap = []
        self._orphan_keys = set()
        self._orphan_leases = set()
        self._keeper = None
        self._keeper_wake = None
        self._keeper_stop = None
        self._offload = Offloader(alias, f"distlock-etcd-runner:{alias}", green_library())
        _BACKENDS.add(self)

    def _after_fork_in_child(self):
        """Forget the parent's session in a forked child: its keys are the parent's; this process gets its own.

        The parent's threads do not exist here; under gevent its greenlets do, and its keeper is ended.
        Its leases stay the parent's: releasing or extending one here does nothing.
        """
        if self._keeper is not None:
            self._keeper_stop.set()
            self._keeper.end_in_child()
        self._lock = threading.Lock()
        self._session_grant_lock = threading.Lock()
        self._session = None
        self._expiries = {}
        self._expiry_heap = []
        self._orphan_keys = set()
        self._orphan_leases = set()
        self._keeper = self._keeper_wake = self._keeper_stop = None

    def _lock_prefix(self, name):
        return _keys_of_lock(self._prefix, name)

    @staticmethod
    def _record(owner):
        """Return the value stored in a contender's key, and its wall-clock creation time."""
        now = datetime.now(timezone.utc)
        return holder_record(owner=owner, created_at=now.isoformat()).encode(), now

    # -- acquiring -------------------------------------------------------------------------------

    def acquire(self, name, *, ttl, timeout, blocking):
        """Return a ``Lease`` on ``name``: one transaction if the lock is free, else a wait in its queue.

        Raise ``LockNotAcquired`` on a miss or timeout (the queued key is deleted) and
        ``BackendUnavailable`` if the cluster does not answer within the timeout. Run out of reach of
        the caller's interrupts (``distlock.backends.offload``): an interrupt inside gRPC left its
        channel's locks held and every later call of the process hung.
        """
        return self._offload.call(functools.partial(self._acquire, name, ttl=ttl, timeout=timeout, blocking=blocking),
                                  abandon=self._give_back)

    def _acquire(self, name, job, *, ttl, timeout, blocking):
        deadline = None if timeout is None else time.monotonic() + timeout
        contender = _Contender(name=name, owner=new_owner(), lock_prefix=self._lock_prefix(name), job=job)
        try:
            while True:  # again only if our session lease expired before the lock came to us
                session = self._live_session(deadline)
                if contender.session is not session:
                    self._take_slot(contender, session)
                try:
                    lease = self._join_and_wait(contender, session, ttl, deadline, blocking, timeout)
                except _SessionGone as exc:
                    self._session_lost(session, str(exc))
                    contender.may_exist = False  # a key on an expired lease is deleted by etcd
                    continue
                if lease is not None:
                    return lease
        except BaseException as exc:
            self._abandon(contender, exc)
            raise

    def _join_and_wait(self, contender, session, ttl, deadline, blocking, timeout):
        """Send ACQUIRE; return the Lease, None if our key vanished with the session, or raise ``LockNotAcquired``."""
        value, acquired_at = self._record(contender.owner)
        contender.value = value
        started = time.monotonic()
        contender.may_exist = True
        contender.attempts += 1
        response = self._connection.txn(
            "acquire a lock", acquire_txn(contender.lock_prefix, contender.key, value, session.id, blocking),
            self._connection.deadline(deadline))
        if response.succeeded:
            contender.revision = contender.token = response.header.revision
            return self._grant(contender, session, ttl, started, acquired_at)
        own, holder = response.responses[0].response_range.kvs, response.responses[1].response_range.kvs
        if own and holder[0].key == contender.key:  # a retry whose first try took the free lock
            contender.revision, contender.token = own[0].create_revision, own[0].mod_revision
            return self._grant(contender, session, ttl, started, acquired_at)
        if not blocking:
            contender.may_exist = bool(own)
            raise LockNotAcquired(self._not_acquired_message(contender.name, blocking, timeout))
        if own:  # a retry whose first try joined the queue: TURN finds the key before ours
            contender.revision, predecessor = own[0].create_revision, None
        else:
            newest = response.responses[3].response_range.kvs
            contender.revision = newest[0].create_revision
            predecessor = newest[1] if len(newest) > 1 else None
        return self._wait_in_queue(contender, session, predecessor, response.header.revision, ttl, deadline, timeout)

    def _wait_in_queue(self, contender, session, predecessor, seen_at, ttl, deadline, timeout):
        """Wait until no key is left before ours; return the Lease, or None if our key is gone.

        ``predecessor`` is the key-value of the key just before ours as read at revision ``seen_at``.
        """
        while True:
            if contender.job.cancelled:
                raise Abandoned(contender.name)
            if predecessor is not None:
                until = time.monotonic() + self._connection.timeout
                if deadline is not None:
                    until = min(until, deadline)
                self._connection.wait_for_deletion(predecessor.key, predecessor.create_revision, seen_at, until)
            acquired_at = datetime.now(timezone.utc)
            started = time.monotonic()
            contender.attempts += 1
            response = self._connection.txn(
                "wait for a lock",
                turn_txn(contender.lock_prefix, contender.key, contender.revision, contender.value, session.id),
                self._connection.deadline(deadline))
            if response.succeeded:
                contender.token = response.header.revision
                return self._grant(contender, session, ttl, started, acquired_at)
            own, before = response.responses[0].response_range.kvs, response.responses[1].response_range.kvs
            if not own or own[0].create_revision != contender.revision:
                logger.info("Lost our place in the queue of lock %r (session lease expired?); queueing again",
                            contender.name)
                contender.may_exist = False
                return None
            predecessor, seen_at = (before[0] if before else None), response.header.revision
            if deadline is not None and time.monotonic() >= deadline:
                raise LockNotAcquired(self._not_acquired_message(contender.name, True, timeout))

    def _grant(self, contender, session, ttl, started, acquired_at):
        """Return the Lease for our key, or None (key deleted) if the session died before the answer came,
        or the answer came after the ttl had run out (then another owner may hold the lock already)."""
        now = time.monotonic()
        late = now - started >= ttl
        with self._lock:
            usable = session.usable(now) and not late
            if usable:
                handle = _Held(contender.key, contender.revision, session, contender.name, contender.slot,
                               contender.owner)
                lease = self.make_lease(contender.name, contender.owner, ttl, started, Grant(
                    token=contender.token, acquired_at=acquired_at, handle=handle, session_timeout=session.ttl))
                lease.attempts = contender.attempts
                session.leases.add(lease)
                self._schedule_expiry(_Expiry(handle, started + ttl))
        if usable:
            return lease
        # Nobody may think it holds the lock through this key (it may also outlive our belief in the
        # session by a moment): delete it.
        self._connection.delete("give back an unusable grant", contender.key, self._connection.deadline())
        contender.may_exist = False
        if late:
            contender.late_grants += 1
            refuse_after_late_grants(contender.late_grants, self.alias, contender.name, ttl)
        return None

    def _take_slot(self, contender, session):
        """Give ``contender`` a key of ``session``: the lowest slot of its lock no acquire call here is using."""
        with self._lock:
            if contender.session is not None:
                self._free_slot(contender)
            taken = session.slots.get(contender.name)
            if taken is None:  # the usual case: nobody else here wants this lock
                session.slots[contender.name] = taken = {}
                slot = 0
            else:
                slot = next(number for number in range(len(taken) + 1) if number not in taken)
            taken[slot] = contender.owner
        contender.session, contender.slot = session, slot
        contender.key = contender.lock_prefix + f"{session.id:x}-{slot}".encode()

    @staticmethod
    def _free_slot(user):
        """Let later acquire calls reuse the slot of ``user`` (a ``_Contender`` or ``_Held``), whose key is gone.

        Call with ``_lock`` held. Only the acquire call that took the slot frees it (``user.owner``): a
        lease released after the background thread expired its key must not free the slot a later
        call is using. A contender that has not queued on a session yet has no slot.
        """
        taken = user.session.slots.get(user.name) if user.session is not None else None
        if taken is not None and taken.get(user.slot) == user.owner:
            del taken[user.slot]
            if not taken:
                del user.session.slots[user.name]

    def _abandon(self, contender, reason):
        """Delete the key of an acquire call that leaves without the lock: now, or from the background thread.

        Straight to the background when ``reason`` is the cluster not answering, so the caller's
        timeout is not spent twice.
        """
        if contender.may_exist and not isinstance(reason, BackendUnavailable):
            try:
                self._connection.delete("leave a lock queue", contender.key,
                                        time.monotonic() + min(self._connection.timeout, MIN_REQUEST_SECONDS))
                contender.may_exist = False
            except BackendUnavailable as exc:
                reason = exc
        with self._lock:
            if not contender.may_exist:
                self._free_slot(contender)
                return
            # The slot stays taken: the key may still exist, and nobody else may use it.
            self._orphan_keys.add(contender.key)
        logger.warning("Could not leave the queue of lock %r (%s); retrying in the background", contender.name, reason)
        self._wake_keeper()

    # -- the session lease -----------------------------------------------------------------------

    def _live_session(self, caller_deadline):
        """Return the session lease, granting one if there is none (one round trip, the first time only)."""
        session = self._session
        if session is not None and session.usable(time.monotonic()):
            return session
        with self._session_grant_lock:
            session = self._session
            if session is not None and session.usable(time.monotonic()):
                return session  # granted by the call that held the grant lock before us
            if session is not None:
                self._session_lost(session, "its keepalive did not get through in time")
            sent = time.monotonic()
            response = self._connection.grant_lease(self.settings["LEASE_TTL"],
                                                    self._connection.deadline(caller_deadline))
            if response.error:
                raise BackendUnavailable(f"etcd alias '{self.alias}' refused a session lease: {response.error}")
            session = _Session(response.ID, response.TTL, sent)
            if response.TTL != self.settings["LEASE_TTL"]:
                logger.info("etcd alias '%s' granted a session lease of %ss instead of LEASE_TTL=%ss (its minimum)",
                            self.alias, response.TTL, self.settings["LEASE_TTL"])
            with self._lock:
                self._session = session
            self._ensure_keeper()
            return session

    def _keep_alive(self, session):
        sent = time.monotonic()
        try:
            ttl = self._connection.keep_alive(session.id, min(session.valid_until, sent + self._connection.timeout))
        except BackendUnavailable as exc:
            logger.warning("etcd alias '%s': session lease keepalive failed (%s); %.1fs left before it expires",
                           self.alias, exc, session.valid_until - time.monotonic())
            session.next_keepalive = time.monotonic() + min(0.5, session.ttl / 6)
            return
        if ttl <= 0:
            self._session_lost(session, "etcd no longer has it (it expired or was revoked)")
            return
        session.valid_until = sent + ttl
        session.next_keepalive = sent + ttl / 3

    def _session_lost(self, session, reason):
        """Mark every lease held on ``session`` lost (once) and forget the session; revoke it when reachable.

        Setting ``session.lost`` makes every one of its leases fail ``check()`` at once (see
        ``session_valid_until``), before the first ``lock_lost`` is sent.
        """
        with self._lock:
            if session.lost is not None:
                return
            session.lost = reason
            leases = list(session.leases)
            if self._session is session:
                self._session = None
            # Revoking makes etcd drop the keys now, in case it still has the lease we gave up on.
            self._orphan_leases.add(session.id)
            for lease in leases:
                self._forget_expiry(lease.handle)
        try:
            self._announce_lost(leases, f"its etcd session lease {session.id:x} was lost: {reason}")
        finally:
            self._wake_keeper()

    def _announce_lost(self, leases, reason):
        """Mark each lease lost and send ``lock_lost``: a receiver that raises stops neither the rest nor us.

        On the background thread anything a receiver raises is logged; on a caller's thread an exception
        that is not an ``Exception`` (``KeyboardInterrupt``, a time limit) is raised again once every
        lease was announced.
        """
        pending = None
        for lease in leases:
            try:
                lease.mark_lost(reason)
            except BaseException as exc:  # noqa: BLE001 - every lease must be reported, whatever a receiver does
                logger.exception("Reporting the loss of lock %r (alias %r) raised; the other leases are still "
                                 "reported.", lease.name, self.alias)
                pending = pending or exc
        keeper = self._keeper
        if pending is not None and (keeper is None or not keeper.is_current()):
            raise pending

    # -- the per-call ttl ------------------------------------------------------------------------

    def _schedule_expiry(self, expiry):
        """Have the background thread delete ``expiry.held`` at ``expiry.deadline`` (call with ``_lock`` held)."""
        key = expiry.held.key
        self._expiries[key] = expiry
        entry = (expiry.deadline, key)
        heapq.heappush(self._expiry_heap, entry)
        if self._expiry_heap[0] == entry:  # due before anything else: the thread must wake sooner
            self._wake_keeper()

    def _forget_expiry(self, held):
        """Drop the expiry of ``held`` (call with ``_lock`` held); rebuild the heap once stale entries dominate it.

        The key may hold a later incarnation by now (its slot was reused): that one's expiry stays.
        Released keys leave their heap entries behind; without the rebuild each would still wake the
        background thread at its old deadline.
        """
        expiry = self._expiries.get(held.key)
        if expiry is not None and expiry.held.create_revision == held.create_revision:
            del self._expiries[held.key]
        if len(self._expiry_heap) > 2 * len(self._expiries) + 64:
            self._expiry_heap = [(expiry.deadline, key) for key, expiry in self._expiries.items()]
            heapq.heapify(self._expiry_heap)

    def _delete_expired(self, deadline):
        now = time.monotonic()
        due = []
        with self._lock:
            while self._expiry_heap and self._expiry_heap[0][0] <= now:
                at, key = heapq.heappop(self._expiry_heap)
                expiry = self._expiries.get(key)
                # Skip stale heap entries, keys being extended (the extension re-schedules) or already going.
                if expiry is None or expiry.deadline != at or expiry.extending or expiry.deleting:
                    continue
                expiry.deleting = True
                due.append(expiry)
        for expiry in due:
            held = expiry.held
            try:
                self._connection.txn("delete a lock whose ttl ran out", release_txn(held.key, held.create_revision),
                                     deadline)
            except BackendUnavailable as exc:
                logger.warning("Could not delete expired lock key %r (%s); retrying", held.key, exc)
                with self._lock:
                    expiry.deleting = False
                    expiry.deadline = time.monotonic() + 0.5
                    heapq.heappush(self._expiry_heap, (expiry.deadline, held.key))
                continue
            with self._lock:
                self._forget_expiry(held)
                self._free_slot(held)

    # -- the background thread -------------------------------------------------------------------

    def _ensure_keeper(self):
        """Start the background thread, or wake it: a new session must get its first keepalive in time
        (the thread may be asleep for up to a minute after the previous session was lost)."""
        with self._lock:
            if self._keeper is not None and self._keeper.is_alive():
                self._keeper_wake.set()
                return
            self._keeper_wake, self._keeper_stop = threading.Event(), threading.Event()
            self._keeper = Daemon(_run_keeper, weakref.ref(self), self._keeper_wake, self._keeper_stop,
                                  name=f"distlock-etcd-keeper:{self.alias}")
            self._keeper.start()

    def _wake_keeper(self):
        wake = self._keeper_wake
        if wake is not None:
            wake.set()

    def _keep(self):
        """Do the background work that is due; return the seconds until more is due.

        Keepalive first, with a budget that ends at the session's expiry, so that slow cleanups
        cannot make the session expire.
        """
        session = self._session
        if session is not None and session.lost is None:
            if time.monotonic() >= session.valid_until:
                self._session_lost(session, f"its keepalive did not get through for {session.ttl}s")
            elif time.monotonic() >= session.next_keepalive:
                self._keep_alive(session)
        session = self._session
        next_keepalive = session.next_keepalive if session is not None else float("inf")
        cleanup_deadline = min(time.monotonic() + self._connection.timeout,
                               max(next_keepalive, time.monotonic() + 0.2))
        self._delete_expired(cleanup_deadline)
        self._clean_orphans(cleanup_deadline)
        with self._lock:
            due = [next_keepalive]
            if self._expiry_heap:
                due.append(self._expiry_heap[0][0])
            if self._orphan_keys or self._orphan_leases:
                due.append(time.monotonic() + 0.5)
        if session is not None:
            due.append(session.valid_until)
        return max(0.0, min(min(due) - time.monotonic(), 60.0))

    def _clean_orphans(self, deadline):
        with self._lock:
            keys, lease_ids = list(self._orphan_keys), list(self._orphan_leases)
        for key in keys:
            try:
                self._connection.delete("delete a key left behind", key, deadline)
            except BackendUnavailable:
                return
            with self._lock:
                self._orphan_keys.discard(key)
        for lease_id in lease_ids:
            try:
                self._connection.revoke_lease(lease_id, deadline)
            except _SessionGone:
                pass  # expired already: nothing left to free
            except BackendUnavailable:
                return
            with self._lock:
                self._orphan_leases.discard(lease_id)

    # -- holding ---------------------------------------------------------------------------------

    def _give_back(self, lease):
        """Release a lease granted to a caller that was interrupted before it could take it."""
        logger.info("Releasing lock %r (alias %r, token %s): the call that acquired it was interrupted.",
                    lease.name, self.alias, lease.token)
        self._release(lease)

    def _do_release(self, lease):
        return self._offload.call(lambda job: self._release(lease))

    def _release(self, lease):
        handle = lease.handle
        if not handle.session.ours:
            return False  # the parent's lock, inherited by a forked child: not this process's to release
        with self._lock:
            handle.session.leases.discard(lease)
            self._forget_expiry(handle)
        try:
            response = self._connection.txn("release a lock", release_txn(handle.key, handle.create_revision),
                                            self._connection.deadline())
        except BackendUnavailable:
            # The key is ours alone (its slot stays taken): delete it whenever the cluster answers.
            with self._lock:
                self._orphan_keys.add(handle.key)
            self._wake_keeper()
            raise
        with self._lock:  # deleted now, or gone before (expired, force-released): the slot is free
            self._free_slot(handle)
        return response.succeeded

    def session_valid_until(self, lease):
        """The session lease's validity: the last keepalive that got through was sent ``ttl`` before it.

        -inf once the session is known lost, so all its leases fail ``check()`` together, and in a
        forked child, which does not hold the parent's session.
        """
        session = lease.handle.session
        if session.lost is not None or not session.ours:
            return -math.inf
        return session.valid_until

    def _do_extend(self, lease, ttl):
        return self._offload.call(lambda job: self._extend(lease, ttl))

    def _extend(self, lease, ttl):
        handle = lease.handle
        if not handle.session.ours:
            return False  # the parent's lock, inherited by a forked child
        started = time.monotonic()
        with self._lock:
            expiry = self._expiries.get(handle.key)
            if (expiry is None or expiry.deleting or expiry.held.create_revision != handle.create_revision
                    or started >= expiry.deadline):
                return False  # ran out (or released, or its session was lost): renewing comes too late
            expiry.extending += 1
        extended = False
        try:
            response = self._connection.txn("extend a lock", extend_txn(handle.key, handle.create_revision),
                                             self._connection.deadline())
            extended = response.succeeded
        finally:
            with self._lock:
                expiry.extending -= 1
                if extended:
                    expiry.deadline = max(expiry.deadline, started + ttl)
                heapq.heappush(self._expiry_heap, (expiry.deadline, handle.key))
            self._wake_keeper()
        return extended

    # -- operating -------------------------------------------------------------------------------

    def held_locks(self, prefix=""):
        return self._offload.call(lambda job: self._held_locks(prefix))

    def _held_locks(self, prefix):
        start = self._prefix + quote(prefix, safe="").encode()
        response = self._connection.range("list held locks", etcdrpc.RangeRequest(
            key=start, range_end=_range_end(start), sort_target=_BY_CREATE, sort_order=_ASCEND),
            self._connection.deadline())
        holders = {}
        for kv in response.kvs:  # ascending create revision: the first key of each lock holds it
            quoted_name, separator, _ = kv.key[len(self._prefix):].rpartition(b"/")
            if separator:
                holders.setdefault(quoted_name, kv)
        infos = [self._lock_info(unquote(quoted_name.decode()), kv) for quoted_name, kv in holders.items()]
        return sorted(infos, key=lambda info: info.name)

    def _lock_info(self, name, kv):
        try:
            record = json.loads(kv.value)
        except ValueError:
            record = {}
        return LockInfo(
            alias=self.alias, name=name, owner=record.get("owner", ""), token=self.public_token(kv.mod_revision),
            acquired_at=_parse_time(record.get("created_at")),
            host=record.get("host", ""), pid=record.get("pid"), task_id=record.get("task_id", ""),
        )

    def force_release(self, name, owner):
        return self._offload.call(lambda job: self._force_release(name, owner))

    def _force_release(self, name, owner):
        lock_prefix = self._lock_prefix(name)
        deadline = self._connection.deadline()
        holder = self._connection.range("find a lock's holder", etcdrpc.RangeRequest(
            key=lock_prefix, range_end=_range_end(lock_prefix), sort_target=_BY_CREATE, sort_order=_ASCEND,
            limit=1), deadline).kvs
        if not holder or self._lock_info(name, holder[0]).owner != owner:
            return False
        key, create_revision = holder[0].key, holder[0].create_revision
        released = self._connection.txn("force-release a lock", release_txn(key, create_revision), deadline).succeeded
        if released:
            self._forget_forced(key, create_revision)
        return released

    def _forget_forced(self, key, create_revision):
        """Mark this process's lease on that key incarnation lost at once, if it has one, instead of at its next renewal."""
        with self._lock:
            session = self._session
            leases = [lease for lease in (session.leases if session else ())
                      if (lease.handle.key, lease.handle.create_revision) == (key, create_revision)]
            for lease in leases:
                self._forget_expiry(lease.handle)
        self._announce_lost(leases, "an operator force-released it")

    def ping(self):
        return self._offload.call(lambda job: self._ping())

    def _ping(self):
        self._connection.range("answer a ping", etcdrpc.RangeRequest(
            key=self._prefix, range_end=_range_end(self._prefix), count_only=True), self._connection.deadline())

    def close(self):
        """Stop the background thread and revoke the session lease: every lock held through it is freed and lost."""
        try:
            self._offload.call(lambda job: self._close())
        finally:
            self._offload.stop()

    def _close(self):
        with self._lock:
            keeper, stop, wake = self._keeper, self._keeper_stop, self._keeper_wake
            self._keeper = self._keeper_stop = self._keeper_wake = None
        if keeper is not None:
            stop.set()
            wake.set()
            if not keeper.is_current():
                keeper.join()
        with self._lock:
            session = self._session
        if session is not None:
            try:
                self._connection.revoke_lease(session.id, time.monotonic() + MIN_REQUEST_SECONDS)
            except BackendUnavailable as exc:
                logger.warning("etcd alias '%s': could not revoke the session lease on close (%s); "
                               "its locks are freed when it expires", self.alias, exc)
            self._session_lost(session, "the backend was closed")
        with self._lock:
            self._orphan_leases.clear()
            self._orphan_keys.clear()
            self._expiries.clear()
            self._expiry_heap.clear()
        self._connection.close()


def _run_keeper(backend_ref, wake, stop):
    """Loop of the background thread; it holds the backend only weakly, so a dropped backend stops it."""
    while not stop.is_set():
        backend = backend_ref()
        if backend is None:
            return
        wake.clear()
        try:
            wait = backend._keep()
        except BaseException as exc:  # noqa: BLE001 - the thread that keeps the session alive must outlive anything
            if killed(exc):
                raise  # the greenlet was ended on purpose (a forked child)
            logger.exception("etcd background work failed; retrying")
            wait = 0.5
        del backend
        wake.wait(wait)
