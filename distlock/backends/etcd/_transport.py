"""Talking to an etcd cluster over gRPC: endpoints with failover, TLS and auth, fork and gevent safety.

Built on gRPC stubs of python3-etcd3's generated messages rather than on its ``Etcd3Client``,
which has one timeout for every call (a caller's timeout could not bound a request), drops the
transaction header (the fencing token), shuns a failed endpoint for 5 minutes, and whose watch
thread dies with ``NameError: six`` when a stream ends, leaving waiters asleep.

A request that fails raises ``RequestFailed`` (its ``str()`` is the cause); the backend words it
with ``translate_errors``. Nothing here raises ``BackendUnavailable``.
"""

import logging
import os
import threading
import time
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field

import grpc
from django.core.exceptions import ImproperlyConfigured
from etcd3 import etcdrpc
from google.protobuf.message import DecodeError
from grpc._cython import cygrpc

from distlock.backends.green import green_library

logger = logging.getLogger(__name__)

__all__ = [
    "MIN_REQUEST_SECONDS", "Connection", "RequestFailed", "Security", "SessionGone", "green_problem", "hint",
    "prepare_for_green_threads",
]

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
#: Seconds a request gets even when the caller's timeout is shorter (a non-blocking attempt still needs an answer):
#: the ``minimum`` of ``request_deadline`` for etcd.
MIN_REQUEST_SECONDS = 1.0
#: Seconds ``fork()`` waits for the calls it cancelled to return before it goes ahead anyway.
FORK_QUIESCE_SECONDS = 2.0
#: What etcd answers (INVALID_ARGUMENT) once an auth token expired (``--auth-token-ttl``, 5 minutes idle).
_INVALID_TOKEN = "invalid auth token"


class RequestFailed(Exception):
    """A request the cluster did not answer in time, or refused; ``str()`` says why, for the error message."""

    def __init__(self, message, code=None, details=""):
        super().__init__(message)
        #: gRPC's status code, or None when the request never reached gRPC.
        self.code = code
        self.details = details


class SessionGone(RequestFailed):
    """etcd no longer knows the session lease ("requested lease not found"): it expired or was revoked."""


def hint(exc, tls):
    """Return what to check for the failed request ``exc`` (TLS, auth, a cluster down), or None."""
    lowered = exc.details.lower()
    if "handshake" in lowered or "certificate" in lowered or "ssl" in lowered:
        return ("the TLS handshake failed: check that CA_CERT is the CA that signed the members' certificates "
                "(and CERT_CERT/CERT_KEY if the cluster checks client certificates)")
    if "permission denied" in lowered or "user name" in lowered or "auth" in lowered:
        return "etcd auth refused the request: check USER and PASSWORD, and the user's role"
    if exc.code in _RETRIED_CODES:
        return "check that the cluster is up and has a leader" + ("" if tls else ", and set CA_CERT if it serves TLS")
    return None


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


#: True once this module opened a gRPC channel in this process (see ``prepare_for_green_threads``).
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
class Security:
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
                raise RequestFailed(f"could not read the {option} file {path!r}: {exc.strerror}") from None

        return grpc.ssl_channel_credentials(root_certificates=read("CA_CERT", self.ca_cert),
                                            private_key=read("CERT_KEY", self.cert_key),
                                            certificate_chain=read("CERT_CERT", self.cert_cert))


class _StreamCanceller:
    """``Job.wake`` while a waiter watches: a cancelled job (its caller was interrupted) ends the watch at once."""

    def __init__(self, stream):
        self._stream = stream

    def set(self):
        self._stream.cancel()


#: Every live connection of this process, for the fork hooks below.
_CONNECTIONS = weakref.WeakSet()


class Connection:
    """The cluster's endpoints with failover: requests go to one endpoint until it fails, then to the next.

    Fork. gRPC's core is not safe to fork while a thread is inside a call (the child hangs or finds
    the parent's sockets in its new channels), so ``fork()`` first holds new calls back, closes the
    channels (which cancels the calls in flight: they are sent again on new channels, as after a
    failed endpoint) and waits for those calls to return. Both processes then build new channels at
    their next request; the parent's session lease and locks are untouched.
    """

    def __init__(self, alias, addresses, timeout, security=None, order=None):
        self.alias = alias
        self.addresses = addresses
        #: REQUEST_TIMEOUT: spread over the endpoints a request tries, and the longest wait on a watch.
        self.timeout = timeout
        self.security = security or Security()
        #: The alias's ``TokenOrder``, which every KV reply's header is checked against (``_kv``); None: unchecked.
        self.order = order
        #: The cluster id the first KV reply showed; another one later means another cluster.
        self._cluster_id = None
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
                raise RequestFailed(
                    f"etcd refused to authenticate USER {security.user!r}: {exc.code().name}: {exc.details()} "
                    f"(endpoint {channel.address})", exc.code(), exc.details() or "",
                ) from None
            self._token = token
        return (*_REQUIRE_LEADER, ("token", token))

    def call(self, invoke, deadline):
        """Return ``invoke(channel, timeout, metadata)``, trying the endpoints in turn until one answers or
        ``deadline`` (``time.monotonic()``) passes; raise ``RequestFailed``.

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
                        raise SessionGone(details, code, details) from exc
                    if _INVALID_TOKEN in details and not renewed_token:
                        self._token, renewed_token = None, True  # expired: authenticate again, once
                        continue
                    if code not in _RETRIED_CODES or time.monotonic() + pause >= deadline:
                        raise RequestFailed(
                            f"{code.name}: {details} (last endpoint {channel.address}; "
                            f"ENDPOINTS {', '.join(self.addresses)})", code, details,
                        ) from exc
                except ValueError as exc:
                    if "closed channel" not in str(exc):
                        raise
                    if generation != self._generation:
                        continue  # closed by a fork between taking the channel and calling it
                    raise RequestFailed(f"the connection was closed ({exc})") from exc  # close() ran meanwhile
            self._failed(channel)
            failures += 1
            if failures % len(self.addresses) == 0:  # every endpoint failed once: do not spin
                time.sleep(pause)
                pause = min(pause * 2, 0.5)

    def txn(self, request, deadline):
        return self._kv(lambda channel, timeout, metadata: channel.kv.Txn(
            request, timeout=timeout, metadata=metadata), deadline)

    def range(self, request, deadline):
        return self._kv(lambda channel, timeout, metadata: channel.kv.Range(
            request, timeout=timeout, metadata=metadata), deadline)

    def delete(self, key, deadline):
        return self._kv(lambda channel, timeout, metadata: channel.kv.DeleteRange(
            etcdrpc.DeleteRangeRequest(key=key), timeout=timeout, metadata=metadata), deadline)

    def _kv(self, invoke, deadline):
        """``call`` for a KV request, whose reply header is checked against the alias's ``TokenOrder``.

        Every KV request here is linearizable (writes, transactions, and ranges without
        ``serializable``), so its reply shows a revision at least as high as any reply received
        before it was sent, from the same cluster id. A lower revision means the cluster went back
        (restored from an older snapshot); another cluster id, a cluster rebuilt or restored with a
        new ``--initial-cluster-token``, whose revisions tell nothing about those seen before. Either
        makes the process refuse the alias (the reply itself is returned: releases still work).
        Keepalive and watch replies are not checked: a follower fills their header from its own
        store, which may lag.
        """
        order = self.order
        if order is None:
            return self.call(invoke, deadline)
        floor = order.highest
        response = self.call(invoke, deadline)
        header = response.header
        if header.cluster_id != self._cluster_id:
            if self._cluster_id is None:
                self._cluster_id = header.cluster_id
            else:
                order.went_back(f"the etcd cluster id changed from {self._cluster_id:x} to {header.cluster_id:x} "
                                "(a new cluster, or one restored from a snapshot with a new --initial-cluster-token)")
        if header.revision < floor:
            order.went_back(f"the etcd cluster went back to revision {header.revision} from {floor} (restored from a "
                            "snapshot?)")
        order.saw(header.revision)
        return response

    def grant_lease(self, ttl, deadline):
        # Not idempotent: a grant whose answer is lost leaves a lease nobody keeps alive; it expires after ttl.
        return self.call(lambda channel, timeout, metadata: channel.lease.LeaseGrant(
            etcdrpc.LeaseGrantRequest(TTL=ttl), timeout=timeout, metadata=metadata), deadline)

    def revoke_lease(self, lease_id, deadline):
        return self.call(lambda channel, timeout, metadata: channel.lease.LeaseRevoke(
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

        return self.call(invoke, deadline)

    def wait_for_deletion(self, key, create_revision, seen_at, until, job):
        """Return once incarnation ``create_revision`` of ``key``, alive at revision ``seen_at``, is deleted,
        the watch stream ends, ``until`` passes, or ``job`` (``distlock.backends.offload``) is cancelled.

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
            except (grpc.RpcError, RequestFailed):
                _raise_foreign()
                return  # the caller re-reads the queue through ``call``, which reports a failing cluster
            except ValueError:  # the channel was closed by close() or a fork; the next request reports it
                return
            job.wake = _StreamCanceller(stream)
            try:
                if job.cancelled:
                    return
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
                job.wake = None
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


os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent, after_in_child=_after_fork_in_child)


# -- green threads -----------------------------------------------------------------------------------


def _gevent_activated():
    return bool(getattr(cygrpc, "g_gevent_activated", False))  # gRPC's own flag, set by init_gevent()


def green_problem(alias):
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


def prepare_for_green_threads(alias):
    """Make gRPC cooperative in a gevent-patched process (``init_gevent()``); raise where it cannot be."""
    problem = green_problem(alias)
    if problem:
        raise ImproperlyConfigured(problem)
    if green_library() == "gevent" and not _gevent_activated():
        import grpc.experimental.gevent  # noqa: PLC0415 - only under gevent

        grpc.experimental.gevent.init_gevent()
        logger.info("etcd alias '%s': gevent-patched process, enabled gRPC's gevent support (init_gevent())", alias)
