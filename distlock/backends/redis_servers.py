"""Which Redis server and database a URL names, for the backends that keep keys there (Redis, Redlock).

Without I/O, so system checks can compare configurations while servers are down: two URLs that
spell one loopback server differently (``localhost`` and ``127.0.0.1``, a default port left out)
name the same server.
"""

from urllib.parse import parse_qs, unquote, urlsplit

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
