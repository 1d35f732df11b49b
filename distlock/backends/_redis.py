"""What the Redis and Redlock backends share: Lua scripts, the wire, the words for failures, the fork hook.

Both send their lock commands on redis-py connections without redis-py's client: ``pack`` encodes a
command, ``exchange`` writes a batch in one go and reads each reply within a bound of its own. Both
run their protocol as Lua scripts (``Script``), and the Lua helpers they share (``LUA_CLOCK``) are
written once, here. ``failure_cause`` words a server's failure for ``BackendUnavailable``, with the
same hints for both.
"""

import inspect
import re
from hashlib import sha1

import redis
from redis.exceptions import NoScriptError
from redis.sentinel import MasterNotFoundError

from distlock.backends.options import Option
from distlock.backends.green import ForkedChildHook

__all__ = [
    "CLIENT_ERRORS",
    "KEY_PREFIX_OPTION",
    "LUA_CLOCK",
    "MIN_REQUEST_SECONDS",
    "Script",
    "exchange",
    "failure_cause",
    "FORGET_IN_FORKED_CHILD",
    "glob_escape",
    "pack",
    "refusal_code",
    "with_source",
]

#: What redis-py raises for a server that is down, slow, or answers a command with an error.
CLIENT_ERRORS = (redis.RedisError, OSError)

#: Shortest bound of one request near the caller's deadline (``request_seconds``): a server that
#: answers in time is not reported down because the deadline was a millisecond away.
MIN_REQUEST_SECONDS = 0.1

#: ``KEY_PREFIX``: where an alias keeps its keys on each server.
KEY_PREFIX_OPTION = Option(str, "distlock", check=lambda prefix: None if prefix else "must not be empty",
                           expected="a str")


#: Every object of the two backends that keeps sockets or threads: in a forked child its
#: ``forget_after_fork()`` forgets the parent's.
FORGET_IN_FORKED_CHILD = ForkedChildHook("forget_after_fork")


# -- Lua scripts -------------------------------------------------------------------------------------

# clock(): the server's time (TIME) in µs and in ms. Every expiry and every token is judged on the
#   server's clock, never a client's.
LUA_CLOCK = """
local function clock()
  local time = redis.call('TIME')
  local now_us = tonumber(time[1]) * 1000000 + tonumber(time[2])
  return now_us, math.floor(now_us / 1000)
end
"""


class Script:
    """A Lua script run by its SHA1 (``EVALSHA``); its source goes to a server that forgot it (NOSCRIPT).

    ``helpers`` (Lua function definitions such as ``LUA_CLOCK``) are put before ``body``, in order.
    """

    #: Every script by its SHA1, for a server that answers NOSCRIPT (``exchange``).
    by_sha = {}

    def __init__(self, name, body, *, helpers=()):
        self.name = name
        self.source = "".join(helpers) + body
        self.sha = sha1(self.source.encode()).hexdigest()
        Script.by_sha[self.sha] = self

    def command(self, keys, args):
        """Return the command that runs the script on ``keys`` with ``args``."""
        return ("EVALSHA", self.sha, len(keys), *keys, *args)


def glob_escape(text):
    """Return ``text`` with the characters ``SCAN MATCH`` reads as a glob escaped, to match a prefix literally."""
    return "".join("\\" + char if char in "*?[]\\" else char for char in text)


# -- the wire ----------------------------------------------------------------------------------------

def pack(command):
    """Encode ``command`` (str, bytes and int arguments) as one RESP request.

    redis-py's ``pack_command`` costs more than the rest of a loopback round trip's client work for
    the dozen arguments of an acquire script (``bench/redis_baselines.py``); keys and values are
    always UTF-8 here.
    """
    parts = [arg.encode() if isinstance(arg, str) else arg if isinstance(arg, bytes) else b"%d" % arg
             for arg in command]
    return b"*%d\r\n" % len(parts) + b"".join(b"$%d\r\n%s\r\n" % (len(part), part) for part in parts)


def exchange(connection, commands, timeout, packed=None, *, once=False):
    """Send ``commands`` on ``connection`` in one write; return their replies, error replies in their place.

    ``packed`` is each command already ``pack``ed, when the caller sends one command to several
    servers (Redlock packs once per round, not once per master).

    ``timeout`` bounds the wait for each reply (None: none but the socket's). A script the server
    forgot (a restart, ``SCRIPT FLUSH``) is sent again as source (``EVAL``, which caches it). A
    connection the server closed while it sat idle (a restart, an idle timeout) fails before the
    first reply: the commands go once more on a fresh connection. That is safe because every command
    both backends send may run twice: an acquire script reports its owner's earlier grant again,
    extend and leave are idempotent, reads are reads, and a release that ran reports 0 the second time.

    A caller whose exchange an exception interrupted must disconnect the connection: its next user
    would read the replies left unread as its own (a refused acquire read as a grant).

    ``once``: never send again on a fresh connection (a ``WAIT``, whose answer is about the writes
    of the connection it is sent on).

    A connection is (re)connected with ``connect()`` before the send: that is where a Sentinel-managed
    connection asks the Sentinels for the master's address, and redis-py 8's send connects without it,
    to the address of the master that went away.
    """
    was_connected = connection._sock is not None  # redis-py 8's ``is_connected``, in every release line
    replies = []
    try:
        if not was_connected:
            connection.connect()
        _send_and_read(connection, commands, timeout, replies, packed)
    except redis.ConnectionError:
        if once or not was_connected or replies:
            raise
        connection.disconnect()
        connection.connect()
        _send_and_read(connection, commands, timeout, replies, packed)
    if NoScriptError not in map(type, replies):
        return replies  # the usual case, decided in C
    forgotten = [index for index, reply in enumerate(replies) if isinstance(reply, NoScriptError)]
    sources = []
    _send_and_read(connection, [with_source(commands[index]) for index in forgotten], timeout, sources)
    for index, reply in zip(forgotten, sources):
        replies[index] = reply
    return replies


def with_source(command):
    """Return the ``EVAL`` of the script that the ``EVALSHA`` ``command`` runs (any other command as it is)."""
    if command[0] != "EVALSHA":
        return command
    return ("EVAL", Script.by_sha[command[1]].source, *command[2:])


def _send_and_read(connection, commands, timeout, replies, packed=None):
    """Send ``commands`` in one write and append one reply per command to ``replies`` as it is read."""
    connection.send_packed_command((b"".join(packed or map(pack, commands)),))
    for _ in commands:
        replies.append(_read_reply(connection, timeout))


def _read_reply(connection, timeout):
    """Return the next reply, waiting at most ``timeout`` seconds for it; an error reply is returned, not raised.

    The socket already waits ``socket_timeout``: then there is nothing to change. redis-py 8 bounds
    one read itself (``read_response(timeout=...)``); before 8 the socket's timeout is set around
    the read and put back afterwards (on an error redis-py has disconnected: no socket to put back).
    """
    try:
        if timeout == connection.socket_timeout:
            return connection.read_response()
        if _READ_TAKES_TIMEOUT:
            return connection.read_response(timeout=timeout)
        sock = connection._sock
        sock.settimeout(timeout)
        try:
            return connection.read_response()
        finally:
            if connection._sock is sock:
                sock.settimeout(connection.socket_timeout)
    except redis.ResponseError as error:  # read in full: the next reply is the next command's
        return error


#: True from redis-py 8 on: ``Connection.read_response`` takes a ``timeout`` for one read.
_READ_TAKES_TIMEOUT = "timeout" in inspect.signature(redis.connection.Connection.read_response).parameters


# -- errors ------------------------------------------------------------------------------------------

#: Error replies meaning "this server cannot take locks now" (``BackendUnavailable``); any other error
#: reply is a bug, or another program's key under the prefix. A cluster's ``MOVED`` and ``ASK`` are
#: followed once (``_redis_cluster``); one that comes back again means the slot is still moving.
_REFUSALS = ("OOM", "MISCONF", "READONLY", "read only replica", "NOREPLICAS", "BUSY", "LOADING", "MASTERDOWN",
             "CLUSTERDOWN", "TRYAGAIN", "MOVED", "ASK", "NOPERM", "NOAUTH", "WRONGPASS")
#: The codes of those errors by redis-py's class: before redis-py 5 an error reply's code ("OOM",
#: "READONLY", ...) went into the class and out of the message, and there is no ``status_code``.
_REFUSAL_CLASSES = {getattr(redis.exceptions, name): code for name, code in (
    ("OutOfMemoryError", "OOM"), ("ReadOnlyError", "READONLY"), ("BusyLoadingError", "LOADING"),
    ("NoPermissionError", "NOPERM"), ("MasterDownError", "MASTERDOWN"), ("TryAgainError", "TRYAGAIN"),
    ("AuthenticationError", "NOAUTH"), ("ClusterDownError", "CLUSTERDOWN"), ("MovedError", "MOVED"),
    ("AskError", "ASK")) if hasattr(redis.exceptions, name)}

#: What redis-py reports when a plain connection meets a TLS-only port (the server drops it).
_PLAIN_ON_TLS = ("reset by peer", "Connection closed by server")


def refusal_code(error):
    """Return the code of an error that says the server cannot take locks now ("OOM", "READONLY"...), else None."""
    code = getattr(error, "status_code", None) or _REFUSAL_CLASSES.get(type(error))
    message = str(error)
    return next((refusal for refusal in _REFUSALS if refusal == code or refusal in message), None)


def failure_cause(error, url):
    """Return the words for redis-py's ``error`` in ``BackendUnavailable``, with a hint where one helps.

    ``url`` is the server's (None if unknown): a plain ``redis://`` one dropped the way a TLS-only
    port drops it gets a hint to use TLS; a refused command says its code, and an ACL refusal what
    the ACL user needs; a Sentinel service without a master says where to look.
    """
    message = str(error).rstrip(".") or type(error).__name__
    code = refusal_code(error)
    if code is not None and code not in message:
        message = f"{code} {message}"
    if (url or "").startswith("redis://") and isinstance(error, (redis.ConnectionError, OSError)) and any(
            symptom in message for symptom in _PLAIN_ON_TLS):
        message += " (if the server takes TLS connections only, use a rediss:// URL)"
    elif code == "NOPERM":
        message += " (the URL's ACL user needs the keys under KEY_PREFIX and the commands distlock sends)"
    elif isinstance(error, MasterNotFoundError):
        message = _SENTINEL_CLIENT.sub(r"Sentinel \g<host>:\g<port>", message)
        message += (" (no Sentinel of SENTINELS answered with a master it sees up under that name: check the "
                    "service name in the URL, redis://<service_name>/<db>, and SENTINEL_KWARGS)")
    return message


#: How redis-py names each Sentinel that failed in ``MasterNotFoundError``: its client's repr, from
#: ``Redis<ConnectionPool<Connection<host=...,port=...,db=0>>>`` to redis-py 8's every keyword argument.
_SENTINEL_CLIENT = re.compile(
    r"<?(?:redis\.client\.)?Redis[<(].*?host=(?P<host>[^,>)]+),port=(?P<port>\d+).*?(?:\)>\)>\)>|>>>)")
