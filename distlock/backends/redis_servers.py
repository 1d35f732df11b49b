"""Which Redis server and database a URL names, and whether redis-py can use it (Redis, Redlock).

Without I/O, so system checks can compare configurations while servers are down: two URLs that
spell one loopback server differently (``localhost`` and ``127.0.0.1``, a default port left out)
name the same server.
"""

from urllib.parse import parse_qs, unquote, urlsplit

__all__ = ["describe", "redis_server", "unsecured", "url_problem"]

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
    """Return ``server`` (from ``redis_server``) as text for messages."""
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
