"""The kazoo client of a ZooKeeper alias: its handler, its TLS socket, a connection handler that reports the session.

Under gevent or eventlet (detected when the alias is built: ``is_module_patched("socket")`` /
``is_monkey_patched("socket")``) kazoo gets its own sequential gevent/eventlet handler, with retry
objects built for its sleep function.
"""

import os
import socket
import ssl
import time

from kazoo.client import KazooClient
from kazoo.exceptions import SessionExpiredError, SessionMovedError
from kazoo.handlers.threading import SequentialThreadingHandler
from kazoo.protocol.connection import ConnectionHandler
from kazoo.protocol.serialization import Connect
from kazoo.retry import KazooRetry

__all__ = ["detach", "new_client"]

#: kazoo reconnects with this back-off (seconds), instead of its default that grows to a minute.
RECONNECT = {"max_tries": -1, "delay": 0.05, "backoff": 2, "max_delay": 1.0}


def new_client(settings, green):
    """Return a kazoo client (not started) for an alias's cleaned ``settings``, on ``green``'s handler if any."""
    handler = _kazoo_handler(green)
    if settings["USE_SSL"]:
        handler.create_connection = _tls_connection
    # A dict would make kazoo build a retry with the threading sleep, which it then refuses next to a
    # gevent or eventlet handler.
    client = KazooClient(hosts=settings["HOSTS"], timeout=settings["SESSION_TIMEOUT"], handler=handler,
                         connection_retry=KazooRetry(sleep_func=handler.sleep_func, **RECONNECT),
                         command_retry=KazooRetry(sleep_func=handler.sleep_func),
                         auth_data=list(settings["AUTH_DATA"]) or None, default_acl=settings["DEFAULT_ACL"],
                         use_ssl=settings["USE_SSL"], verify_certs=settings["VERIFY_CERTS"], ca=settings["CA"],
                         certfile=settings["CERTFILE"], keyfile=settings["KEYFILE"],
                         keyfile_password=settings["KEYFILE_PASSWORD"])
    client._connection = NegotiatingConnection(client, client._conn_retry.copy(), logger=client.logger)
    return client


def _kazoo_handler(green):
    """Return kazoo's handler for this process: its gevent or eventlet one under that library's patching."""
    if green == "gevent":
        from kazoo.handlers.gevent import SequentialGeventHandler  # noqa: PLC0415

        return SequentialGeventHandler()
    if green == "eventlet":
        from kazoo.handlers.eventlet import SequentialEventletHandler  # noqa: PLC0415

        return SequentialEventletHandler()
    return SequentialThreadingHandler()


def _tls_connection(address, hostname=None, timeout=None, *, ca=None, certfile=None, keyfile=None,
                    keyfile_password=None, verify_certs=True, **_):
    """Return a TLS socket connected to ``address``: kazoo's ``create_connection`` under ``USE_SSL``.

    It differs from kazoo's (``kazoo.handlers.utils.create_tcp_connection``) in two ways. A failed
    handshake closes its socket; kazoo drops it unclosed, once per retry against a server that refuses
    the certificate. And with ``CA`` set only that CA is trusted; kazoo adds the system's store, where,
    as it checks no host names, a certificate any public CA issued for any name would pass. Without
    ``CA``, the system store is used and the certificate must name the host as written in ``HOSTS``.
    Under gevent or eventlet, ``socket`` is the patched module. Called on kazoo's connection thread.
    """
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    if ca:
        context.load_verify_locations(ca)
    else:
        context.load_default_certs(ssl.Purpose.SERVER_AUTH)
    context.check_hostname = verify_certs and not ca
    context.verify_mode = ssl.CERT_REQUIRED if verify_certs else ssl.CERT_NONE
    if certfile and keyfile:
        context.load_cert_chain(certfile=certfile, keyfile=keyfile, password=keyfile_password)
    family = socket.getaddrinfo(address[0], address[1], 0, socket.SOCK_STREAM)[0][0]
    raw = socket.socket(family)
    try:
        sock = context.wrap_socket(raw, server_hostname=hostname)
    except BaseException:
        raw.close()
        raise
    try:
        sock.settimeout(timeout)
        sock.connect(address)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    except BaseException:
        sock.close()
        raise
    return sock


class NegotiatingConnection(ConnectionHandler):
    """kazoo's connection handler, remembering the negotiated session timeout and the last proof of life.

    kazoo reads the timeout from the Connect reply but keeps it in a local variable; ``lease.session_timeout``
    must report it, because the server frees a dead holder's lock after that time, not after the
    one asked for (the server clamps it between 2 and 20 ticks). Pinned by test_zookeeper.py.

    ``last_answered_sent`` is when the newest request (or ping, or the Connect) that the server has
    answered was sent (monotonic): the server touched the session after that, so it expires no sooner
    than that plus the negotiated timeout. ``Session.valid_until`` is bounded by it, so a holder frozen
    past its session fails ``check()`` the moment it wakes, before kazoo's thread hears of the expiry.
    Only kazoo's connection thread writes these; readers see whole floats.
    """

    negotiated_timeout = None
    last_answered_sent = None
    #: Why the last attempt to connect failed (a TLS handshake, an auth failure), as its repr (holding
    #: no traceback, whose frames would keep the failed socket alive); None once connected.
    last_failure = None

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._sent_at = {}  # xid -> when it was sent (pings share one xid, one at a time)

    def _connect(self, host, hostip, port):
        try:
            result = super()._connect(host, hostip, port)
        except Exception as exc:
            self.last_failure = repr(exc)
            raise
        self.last_failure = None
        return result

    def _invoke(self, timeout, request, xid=None):
        sent = time.monotonic()
        if isinstance(request, Connect):
            self._sent_at.clear()  # a new connection: nothing sent on the old one will be answered
        result = super()._invoke(timeout, request, xid)
        if isinstance(request, Connect):
            self.negotiated_timeout = result[0].time_out / 1000
            self.last_answered_sent = sent
        return result

    def _submit(self, request, timeout, xid=None):
        if xid is not None:
            self._sent_at[xid] = time.monotonic()
        return super()._submit(request, timeout, xid)

    def _read_header(self, timeout):
        header, buffer, offset = super()._read_header(timeout)
        sent = self._sent_at.pop(header.xid, None)
        if sent is not None and header.err not in (SessionExpiredError.code, SessionMovedError.code):
            if self.last_answered_sent is None or sent > self.last_answered_sent:
                self.last_answered_sent = sent
        return header, buffer, offset


def detach(sock):
    """Point this process's descriptor of ``sock`` at /dev/null: the connection stays the parent's, out of reach."""
    if sock is not None and sock.fileno() >= 0:
        devnull = os.open(os.devnull, os.O_RDWR)
        try:
            os.dup2(devnull, sock.fileno())
        finally:
            os.close(devnull)
