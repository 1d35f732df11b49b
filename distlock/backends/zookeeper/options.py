"""The ZooKeeper backend's options: their checks, the security options (ACLs, credentials, TLS) and their warnings.

Security options are passed to ``KazooClient`` as kazoo names them (auth_data, default_acl, use_ssl,
ca, certfile, keyfile, keyfile_password, verify_certs). kazoo gives ``default_acl`` to every create
that names no ACL, and this backend names none: KEY_PREFIX, lock parents and contenders all carry
it. Who may delete a contender is decided by its parent's ACL (ZooKeeper checks DELETE on the
parent), so the parent's ACL is what keeps other clients from deleting holders' znodes or planting
children.

Secrets (the credentials of AUTH_DATA, a digest ACL's password and hash, KEYFILE_PASSWORD) are kept
as ``Secret`` strings: the string itself for kazoo and the server, ``'***'`` in every repr. kazoo
logs each request it sends at DEBUG with its repr ("Sending request(xid=None): Auth(auth_type=0,
scheme='digest', auth=...)"), and the cleaned options are shown wherever settings are. Option errors
describe the shape of a bad value, never the value.
"""

import os

from django.core.exceptions import ImproperlyConfigured
from kazoo.security import ACL, Id, Permissions, make_digest_acl_credential

from distlock.backends.options import Option, positive_number
from distlock.redaction import REDACTED

__all__ = ["BUCKETS", "FLAT", "OPTIONS", "RENAMED_OPTIONS", "Secret", "check_tls_combination", "open_access_warnings"]

KEY_PREFIX_DEFAULT = "/distlock"

#: LAYOUT's values (``protocol``'s znode layouts): every lock's parent right under KEY_PREFIX, or under
#: one of a fixed number of hash buckets, so that a page of ``held_locks()`` reads a few buckets only.
FLAT, BUCKETS = "flat", "buckets"

#: kazoo sends the session timeout as a signed 32-bit number of milliseconds; a larger one kills its
#: connection thread (struct.error) and the alias never connects.
MAX_SESSION_TIMEOUT = (2**31 - 1) / 1000

#: ZooKeeper's permission names, as DEFAULT_ACL's dict form spells them ("all": every one).
PERMISSIONS = {"read": Permissions.READ, "write": Permissions.WRITE, "create": Permissions.CREATE,
               "delete": Permissions.DELETE, "admin": Permissions.ADMIN}

#: Permissions that let a client change the lock znodes (not just read them).
_WRITING = Permissions.WRITE | Permissions.CREATE | Permissions.DELETE


class Secret(str):
    """A credential: the string itself wherever it is used, ``'***'`` in every repr."""

    __slots__ = ()

    def __repr__(self):
        return repr(REDACTED)


def _shape(value):
    """Describe ``value`` by its type (and length), never its content: it may hold a secret."""
    if isinstance(value, (list, tuple)):
        return f"a {type(value).__name__} of {len(value)} item(s): ({', '.join(type(v).__name__ for v in value)})"
    return f"a {type(value).__name__}"


class _SecretOption(Option):
    """An option that may hold a credential: ``parse`` cleans it, and an error describes its shape only.

    ``parse(value)`` returns the cleaned value or raises ``ValueError`` with a message that quotes no
    part of the value.
    """

    def __init__(self, parse, *, expected):
        super().__init__(object, parse(None), expected=expected)
        self._parse = parse

    def clean(self, alias, name, value):
        try:
            return self._parse(value)
        except ValueError as exc:
            raise ImproperlyConfigured(
                f"DISTLOCK['{alias}']['OPTIONS']['{name}'] must be {self.expected}; {exc} (the value is not "
                "shown: it may hold a secret)."
            ) from None


def _clean_auth_data(value):
    """Return AUTH_DATA as a tuple of (scheme, secret credential) pairs."""
    if value is None:
        return ()
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"got {_shape(value)}")
    pairs = []
    for index, pair in enumerate(value):
        if not (isinstance(pair, (list, tuple)) and len(pair) == 2
                and all(isinstance(part, str) and part for part in pair)):
            raise ValueError(f"item {index} is {_shape(pair)}, not a (scheme, credential) pair of non-empty strings")
        scheme, credential = pair
        if scheme == "sasl":
            raise ValueError(f'item {index} uses the "sasl" scheme, which kazoo no longer takes in auth_data')
        pairs.append((scheme, Secret(credential)))
    return tuple(pairs)


def _permissions(value, index):
    if value == "all":
        return Permissions.ALL
    if (isinstance(value, (list, tuple)) and value
            and all(isinstance(name, str) and name in PERMISSIONS for name in value)):
        perms = 0
        for name in value:
            perms |= PERMISSIONS[name]
        return perms
    raise ValueError(f'entry {index}: "perms" must be "all" or a list of {", ".join(PERMISSIONS)}')


def _clean_acl_entry(entry, index):
    if isinstance(entry, ACL):
        if not (isinstance(entry.perms, int) and 0 < entry.perms <= Permissions.ALL and isinstance(entry.id, Id)
                and isinstance(entry.id.scheme, str) and isinstance(entry.id.id, str)):
            raise ValueError(f"entry {index} is a malformed kazoo ACL")
        scheme, identity, perms = entry.id.scheme, entry.id.id, entry.perms
    elif isinstance(entry, dict):
        keys = set(entry)
        if not ({"scheme", "perms"} <= keys <= {"scheme", "perms", "id", "credential"}) or len(keys) != 3:
            # The keys themselves are not quoted: a misplaced credential could be one.
            raise ValueError(f'entry {index} is a dict of {len(keys)} key(s); give exactly "scheme", "perms", and '
                             '"id" or (digest only) "credential"')
        scheme, perms = entry["scheme"], _permissions(entry["perms"], index)
        if not isinstance(scheme, str) or not scheme:
            raise ValueError(f'entry {index}: "scheme" must be a non-empty str')
        if "credential" in entry:
            credential = entry["credential"]
            if scheme != "digest" or not isinstance(credential, str) or ":" not in credential:
                raise ValueError(f'entry {index}: "credential" goes with the "digest" scheme, as a '
                                 '"user:password" str')
            identity = make_digest_acl_credential(*credential.split(":", 1))
        else:
            identity = entry["id"]
            if not isinstance(identity, str):
                raise ValueError(f'entry {index}: "id" must be a str, not {_shape(identity)}')
    else:
        raise ValueError(f"entry {index} is {_shape(entry)}, neither a kazoo ACL nor a dict")
    if scheme == "digest":
        identity = Secret(identity)  # "user:<hash of the password>": a hash is still a secret
    return ACL(perms, Id(scheme, identity))


def _clean_default_acl(value):
    """Return DEFAULT_ACL as a tuple of kazoo ``ACL`` objects, None if not set (kazoo's open ACL)."""
    if value is None:
        return None
    if not isinstance(value, (list, tuple)) or not value:
        raise ValueError(f"got {_shape(value)}")
    return tuple(_clean_acl_entry(entry, index) for index, entry in enumerate(value))


def _clean_keyfile_password(value):
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise ValueError(f"got {_shape(value)}")
    return Secret(value)


def _valid_hosts(value):
    if not value.strip() or any(not host.strip() for host in value.split(",")):
        return 'must list the ensemble as "host:port,host:port,..."'
    return None


def _valid_key_prefix(value):
    segments = value.split("/")[1:]
    if not value.startswith("/") or value == "/" or any(s in ("", ".", "..") for s in segments):
        return 'must be an absolute znode path such as "/distlock", without a trailing "/"'
    if segments[0] == "zookeeper":
        return 'must not be under "/zookeeper", which the server reserves'
    return None


def _valid_layout(value):
    return None if value in (FLAT, BUCKETS) else f'must be "{FLAT}" or "{BUCKETS}"'


def _valid_session_timeout(value):
    problem = positive_number(value)
    if problem is None and value > MAX_SESSION_TIMEOUT:
        problem = (f"must be at most {MAX_SESSION_TIMEOUT} seconds (2**31-1 milliseconds: kazoo sends it as a "
                   "32-bit number, and the server caps it at 20 ticks anyway)")
    return problem


def _valid_path(value):
    return None if value is None or os.fspath(value) else "must be a file path, not empty"


#: The backend's own options (``ZooKeeperBackend.options``); the security ones are named after KazooClient's arguments.
OPTIONS = {
    "HOSTS": Option(str, required=True, check=_valid_hosts, expected='the ensemble as "host:port,host:port,..."'),
    "KEY_PREFIX": Option(str, KEY_PREFIX_DEFAULT, check=_valid_key_prefix,
                         expected='an absolute znode path such as "/distlock"'),
    # Every process of an alias must use the same LAYOUT: two layouts never see each other's locks.
    "LAYOUT": Option(str, FLAT, check=_valid_layout, expected=f'"{FLAT}" or "{BUCKETS}"'),
    "SESSION_TIMEOUT": Option((int, float), 10, check=_valid_session_timeout, expected="a number of seconds"),
    "REQUEST_TIMEOUT": Option((int, float), 5, check=positive_number, expected="a number of seconds"),
    "AUTH_DATA": _SecretOption(_clean_auth_data, expected='a list of (scheme, credential) pairs such as '
                                                         '[("digest", "user:password")]'),
    "DEFAULT_ACL": _SecretOption(_clean_default_acl, expected='a non-empty list of kazoo ACLs or of dicts such as '
                                                             '{"scheme": "digest", "credential": "user:password", '
                                                             '"perms": "all"}, or None'),
    "USE_SSL": Option(bool, False),
    "CA": Option((str, os.PathLike, type(None)), None, check=_valid_path,
                 expected="the path of a PEM file of CA certificates, or None"),
    "CERTFILE": Option((str, os.PathLike, type(None)), None, check=_valid_path,
                       expected="the path of the client's PEM certificate, or None"),
    "KEYFILE": Option((str, os.PathLike, type(None)), None, check=_valid_path,
                      expected="the path of the client's PEM private key, or None"),
    "KEYFILE_PASSWORD": _SecretOption(_clean_keyfile_password, expected="the password of KEYFILE (a str), or None"),
    "VERIFY_CERTS": Option(bool, True),
}

#: Names of distlock 0.x (``ZooKeeperBackend.renamed_options``).
RENAMED_OPTIONS = {"ROOT": "KEY_PREFIX", "CONNECTION_TIMEOUT": "REQUEST_TIMEOUT"}


def check_tls_combination(alias, options):
    """Raise ``ImproperlyConfigured`` for TLS options that would be ignored, or are incomplete."""
    where = f"DISTLOCK['{alias}']['OPTIONS']"
    if not options["USE_SSL"]:
        ignored = [name for name in ("CA", "CERTFILE", "KEYFILE", "KEYFILE_PASSWORD") if options[name] is not None]
        ignored += [] if options["VERIFY_CERTS"] else ["VERIFY_CERTS"]
        if ignored:
            raise ImproperlyConfigured(f"{where} sets {', '.join(ignored)}, which only apply with USE_SSL True: "
                                       "set USE_SSL, or remove them.")
    if (options["CERTFILE"] is None) != (options["KEYFILE"] is None):
        raise ImproperlyConfigured(f"{where} must set CERTFILE and KEYFILE together: kazoo presents a client "
                                   "certificate only with both.")
    if options["KEYFILE_PASSWORD"] is not None and options["KEYFILE"] is None:
        raise ImproperlyConfigured(f"{where} sets KEYFILE_PASSWORD without KEYFILE.")


def _is_open(acl):
    """Return True if ``acl`` (cleaned DEFAULT_ACL) is missing or lets anyone change the znodes."""
    return not acl or any(entry.id.scheme == "world" and entry.perms & _WRITING for entry in acl)


def open_access_warnings(options):
    """Return a warning for each way the znodes are open to any client that reaches the ensemble, or TLS trusts all."""
    warnings = []
    acl_protects = bool(options["AUTH_DATA"]) and not _is_open(options["DEFAULT_ACL"])
    if not options["USE_SSL"] and not acl_protects:
        warnings.append(
            "ZooKeeper znodes are created with the open ACL (world:anyone) and the connection uses no TLS: any "
            "host that can reach the ensemble can delete holders' znodes (taking their locks) or plant children "
            "that block a lock. Set AUTH_DATA and a DEFAULT_ACL for those credentials (for example "
            '[{"scheme": "digest", "credential": "user:password", "perms": "all"}]), or USE_SSL with client '
            "certificates that the ensemble requires."
        )
    elif options["AUTH_DATA"] and _is_open(options["DEFAULT_ACL"]):
        warnings.append("AUTH_DATA authenticates the session, but DEFAULT_ACL is unset or lets world:anyone "
                        "write: the lock znodes are open to every client. Set a DEFAULT_ACL for those credentials.")
    if acl_protects and options["KEY_PREFIX"].count("/") == 1:
        warnings.append(
            f"KEY_PREFIX {options['KEY_PREFIX']!r} sits directly under \"/\", which ZooKeeper leaves open: while no "
            "lock is held, a client without the credentials can delete it and make it again with the open ACL, "
            "then delete holders' znodes. Use a KEY_PREFIX two levels deep such as \"/distlock/locks\": the backend "
            "creates both levels with DEFAULT_ACL, and never deletes KEY_PREFIX, so neither can be deleted by others."
        )
    if options["USE_SSL"] and not options["VERIFY_CERTS"]:
        warnings.append("VERIFY_CERTS is False: the TLS connection accepts any server certificate, so anyone on "
                        "the path can pose as the ensemble. Set CA to the ensemble's CA and keep VERIFY_CERTS.")
    return warnings
