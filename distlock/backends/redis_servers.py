"""Which Redis server and database a URL names, and whether redis-py can use it (Redis, Redlock, Sentinel).

Without I/O, so system checks can compare configurations while servers are down: two URLs that
spell one loopback server differently (``localhost`` and ``127.0.0.1``, a default port left out)
name the same server. With Sentinel the URL names a service, not a server
(``redis://<service_name>/<db>``, as django-redis's ``SentinelClient`` takes it), and the Sentinels
say which server is its master.
"""

import inspect
import math
from urllib.parse import parse_qs, unquote, urlsplit

import redis

__all__ = [
    "describe",
    "redis_server",
    "sentinel_kwargs_problem",
    "sentinel_kwargs_shown",
    "sentinel_service",
    "sentinel_url_problem",
    "sentinels_problem",
    "unsecured",
    "unsecured_sentinels",
    "url_problem",
]

#: Accepted values of redis-py's ``ssl_cert_reqs``.
CERT_REQS = ("none", "optional", "required")

#: The URL schemes redis-py's ``from_url`` takes.
SCHEMES = ("redis://", "rediss://", "unix://")
DEFAULT_PORT = 6379
_LOOPBACK = {"localhost", "127.0.0.1", "::1", "ip6-localhost"}


def redis_server(url):
    """Return a hashable identity of the server and database ``url`` names, its password left out."""
    parts = urlsplit(url)
    query = parse_qs(parts.query)
    if parts.scheme == "unix":
        return ("unix", unquote(parts.path), query.get("db", ["0"])[0])
    host = (parts.hostname or "localhost").lower()
    if host in _LOOPBACK:
        host = "loopback"
    try:
        port = parts.port or DEFAULT_PORT
    except ValueError:  # not a port number: redis-py refuses the URL; compare it as written
        return ("url", url.split("@")[-1])
    path_db = parts.path.lstrip("/")
    db_text = path_db if path_db else query.get("db", ["0"])[0]
    return ("tcp", host, port, int(db_text) if db_text.isdigit() else db_text)


def describe(server):
    """Return ``server`` (from ``redis_server`` or ``sentinel_service``) as text for messages."""
    if server[0] == "sentinel":
        return f"behind Sentinel service {server[1]!r}, db {server[2]}"
    if server[0] == "unix":
        return f"unix socket {server[1]}, db {server[2]}"
    if server[0] == "url":
        return server[1]
    host = "localhost" if server[1] == "loopback" else server[1]
    return f"{host}:{server[2]}, db {server[3]}"


def url_problem(url):
    """Return why ``url`` cannot name a Redis server for redis-py, or None; no I/O, so the system checks can call it.

    TLS is redis-py's, from the URL: ``rediss://`` with ``ssl_ca_certs``, ``ssl_certfile``,
    ``ssl_keyfile``, ``ssl_cert_reqs``... in the query, which ``from_url`` passes on. Certificate
    files are not read.
    """
    if not isinstance(url, str) or not url.startswith(SCHEMES):
        return "is not a redis://, rediss:// or unix:// URL"
    return _tls_problem(url)


def _tls_problem(url):
    """Return why the TLS parameters of ``url`` cannot work, or None."""
    query = parse_qs(urlsplit(url).query)
    given = [name for name in query if name.startswith("ssl_")]
    if given and not url.startswith("rediss://"):
        return f"gives {', '.join(given)} but is not a rediss:// URL (redis-py uses TLS only for rediss://)"
    reqs = query.get("ssl_cert_reqs", ["required"])[0]
    if reqs not in CERT_REQS:
        return f"has ssl_cert_reqs={reqs!r}; redis-py takes one of {', '.join(CERT_REQS)}"
    return None


def unsecured(url, *, password=None):
    """Return a W001 message if ``url`` reaches a server over the network with neither TLS nor a password, else None.

    A unix socket is left alone: only local users that the socket file's permissions let in reach it.
    """
    parts = urlsplit(url)
    if parts.scheme != "redis":
        return None
    if password or parts.password or unquote(parse_qs(parts.query).get("password", [""])[0]):
        return None
    return (f"the Redis server {describe(redis_server(url))} is reached with neither TLS nor a password: anyone "
            "who can connect to it can take, release or delete every lock. Use a rediss:// URL (with "
            "ssl_ca_certs=... in its query) and an ACL user: rediss://user:password@host:port/db.")


# -- Sentinel --------------------------------------------------------------------------------------------

#: What a Sentinel alias's ``URL`` looks like, for messages.
SENTINEL_URL_SHAPE = "redis://<service_name>/<db>"

#: redis-py keyword arguments ``SENTINEL_KWARGS`` may not set: distlock gives each Sentinel's address.
_SENTINEL_ADDRESS_KWARGS = {"host", "port", "unix_socket_path", "connection_pool"}

#: ``SENTINEL_KWARGS`` that bound a request to a Sentinel; None would let a frozen Sentinel hang a call.
_SENTINEL_TIMEOUTS = ("socket_timeout", "socket_connect_timeout")


def sentinel_service(url):
    """Return the hashable identity ``("sentinel", service name, db)`` of a Sentinel alias's ``url``.

    The service name is the host part as written: Sentinel compares names case-sensitively, and
    ``urlsplit`` would lower-case it.
    """
    parts = urlsplit(url)
    path_db = parts.path.lstrip("/")
    db_text = path_db if path_db else parse_qs(parts.query).get("db", ["0"])[0]
    return ("sentinel", parts.netloc.rpartition("@")[2], int(db_text) if db_text.isdigit() else db_text)


def sentinel_url_problem(url):
    """Return why ``url`` cannot name a Sentinel service (``redis://<service_name>/<db>``), or None; no I/O."""
    if not url.startswith(("redis://", "rediss://")):
        return (f"must be {SENTINEL_URL_SHAPE} (or rediss:// for TLS) with SENTINELS: the Sentinels give the "
                "master's address")
    _, service, db = sentinel_service(url)
    if not service:
        return f"names no Sentinel service; put its name where the host goes: {SENTINEL_URL_SHAPE}"
    if ":" in service:
        return (f"gives a port, but with SENTINELS the host part is the Sentinel service name and the Sentinels "
                f"give the master's address: {SENTINEL_URL_SHAPE}")
    if not isinstance(db, int):
        return f"has db {db!r}, which is not a number: {SENTINEL_URL_SHAPE}"
    return _tls_problem(url)


def sentinels_problem(sentinels):
    """Return why ``sentinels`` is not a non-empty list of ``(host, port)`` pairs, or None; no I/O.

    Lists of two are taken as pairs too: JSON and YAML settings have no tuples.
    """
    if not sentinels:
        return "must list at least one Sentinel"
    for entry in sentinels:
        if not (isinstance(entry, (list, tuple)) and len(entry) == 2):
            return f"must hold (host, port) pairs, and {entry!r} is not one"
        host, port = entry
        if not (isinstance(host, str) and host):
            return f"has {entry!r}, whose host is not a non-empty str"
        if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
            return f"has {entry!r}, whose port is not a port number (an int from 1 to 65535)"
    return None


def sentinel_kwargs_problem(kwargs):
    """Return why ``kwargs`` cannot be redis-py's keyword arguments for the Sentinels, or None; no I/O.

    Names are checked against the installed redis-py's ``Redis`` (a misspelt one would fail on first
    use); timeouts must be numbers, so that no request to a Sentinel waits forever.
    """
    accepted = set(inspect.signature(redis.Redis.__init__).parameters) - {"self"} - _SENTINEL_ADDRESS_KWARGS
    unknown = sorted(str(name) for name in kwargs if name not in accepted)
    if unknown:
        given = [name for name in unknown if name in _SENTINEL_ADDRESS_KWARGS]
        if given:
            return f"sets {', '.join(given)}, which SENTINELS gives"
        return f"has {', '.join(unknown)}, which redis-py's Redis() does not take"
    for name in _SENTINEL_TIMEOUTS:
        value = kwargs.get(name, 1)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            return f"has {name} {value!r}; it must be a number of seconds above zero"
    for name in ("username", "password"):
        if not isinstance(kwargs.get(name, ""), str):
            return f"has a {name} that is not a str"
    return None


def sentinel_kwargs_shown(kwargs):
    """Return ``kwargs`` as messages show it: names only, so a misspelt ``password`` shows no password."""
    if not isinstance(kwargs, dict):
        return f"a {type(kwargs).__name__}"
    return "{" + ", ".join(f"{name!r}: ..." for name in kwargs) + "}"


def unsecured_sentinels(sentinels, kwargs):
    """Return a W001 message if the Sentinels are reached with neither TLS nor a password, else None."""
    if kwargs.get("ssl") or kwargs.get("password"):
        return None
    addresses = ", ".join(f"{host}:{port}" for host, port in sentinels)
    return (f"the Redis Sentinels {addresses} are reached with neither TLS nor a password: anyone who can connect "
            "to them can name a master of their own (SENTINEL SET, SENTINEL FAILOVER) and take every lock. Set "
            "requirepass on the Sentinels and SENTINEL_KWARGS {'password': ..., 'ssl': True, 'ssl_ca_certs': ...}.")
