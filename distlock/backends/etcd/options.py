"""The options of an etcd alias: endpoints, session lease, TLS and auth; checked without any I/O."""

from django.core.exceptions import ImproperlyConfigured

from distlock.backends.options import Option, positive_number
from distlock.backends.etcd._transport import Security, green_problem
from distlock.redaction import redact

__all__ = ["OPTIONS", "RENAMED_OPTIONS", "check_together", "endpoints_of", "left_open", "security_of"]


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


def _check_key_prefix(value):
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


OPTIONS = {
    "ENDPOINTS": Option((str, list, tuple, type(None)), None, check=_check_endpoints,
                        expected="a list of 'host:port' strings or one comma-separated string"),
    "HOST": Option((str, type(None)), None, expected="a host name or address"),
    "PORT": Option((int, type(None)), None, check=_check_port, expected="an int"),
    "LEASE_TTL": Option(int, 10, check=_check_lease_ttl, expected="a whole number of seconds (int)"),
    "REQUEST_TIMEOUT": Option((int, float), 5, check=positive_number, expected="a number of seconds"),
    "KEY_PREFIX": Option(str, "/distlock/", check=_check_key_prefix, expected="a str"),
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

#: The names these options had before distlock 1.0 (``BaseLockBackend.renamed_options``).
RENAMED_OPTIONS = {"PREFIX": "KEY_PREFIX", "TIMEOUT": "REQUEST_TIMEOUT"}


def _uses_tls(options):
    """Return True if the alias's cleaned options ask for TLS: a CA_CERT, or ``https://`` endpoints."""
    https = options["ENDPOINTS"] is not None and _parse_endpoints(options["ENDPOINTS"])[1]
    return options["CA_CERT"] is not None or https


def endpoints_of(options):
    """Return the "host:port" of every member the cleaned ``options`` name (HOST/PORT: one, local by default)."""
    if options["ENDPOINTS"] is not None:
        return _parse_endpoints(options["ENDPOINTS"])[0]
    return [f"{options['HOST'] or '127.0.0.1'}:{options['PORT'] or 2379}"]


def security_of(options):
    """Return the ``Security`` (TLS files, auth) of the cleaned ``options``."""
    return Security(tls=_uses_tls(options), ca_cert=options["CA_CERT"], cert_key=options["CERT_KEY"],
                    cert_cert=options["CERT_CERT"], user=options["USER"], password=options["PASSWORD"])


def check_together(alias, options):
    """Raise ``ImproperlyConfigured`` for options that are fine alone but not together, or for a green
    process whose gRPC cannot cooperate."""
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
    problem = green_problem(alias)
    if problem:
        raise ImproperlyConfigured(problem)


def left_open(options):
    """Return what the cleaned ``options`` leave open: clear text without auth, or a password in clear text."""
    tls, auth = _uses_tls(options), options["USER"] is not None
    if not tls and not auth:
        return ["etcd is used without TLS and without auth: anyone who can reach the cluster can read and "
                "delete lock keys (and so take any lock). Set CA_CERT (TLS; CERT_CERT/CERT_KEY for client "
                "certificates) and USER/PASSWORD (etcd auth)."]
    if auth and not tls:
        return ["etcd auth is used without TLS: the password and the auth token cross the network in clear "
                "text. Set CA_CERT (and https:// ENDPOINTS)."]
    return []
