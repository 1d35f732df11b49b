"""Secrets out of everything distlock shows: exception messages, reprs, log lines, thread names, pages.

The one helper every such path goes through. Passwords reach distlock inside URLs (Redis, Redlock:
``redis://user:password@host``, or ``?password=`` in the query), inside dicts of keyword arguments
(Sentinel's ``SENTINEL_KWARGS``: ``{'password': ...}``) and, once exceptions quote them, inside
messages; whatever text is about to be shown passes through ``redact()``.
"""

import re

__all__ = ["REDACTED", "redact"]

#: The user-info of a URL: everything between ``scheme://`` and the last ``@`` of the authority.
_USERINFO = re.compile(r"(?P<scheme>\b[a-zA-Z][a-zA-Z0-9+.-]*://)[^/\s'\"]*@")
#: Query parameters that carry a secret (redis-py passes any query parameter on as a keyword), such as
#: ``password``, ``ssl_password`` (a key file's passphrase) or ``token``.
_SECRET_PARAMETER = re.compile(
    r"(?P<key>[?&;](?:\w*(?:password|passwd|pwd|token|secret)|pass|auth)=)[^&#\s'\"]*", re.IGNORECASE)
#: A secret keyword argument or dict entry as ``repr`` shows it: ``password='x'``, ``'password': 'x'``.
#: Only quoted values: an unquoted ``token: 34`` is a fencing token, not a secret.
_SECRET_ARGUMENT = re.compile(
    r"""(?P<key>\b\w*(?:password|passwd|pwd|token|secret)\w*['"]?\s*[:=]\s*)"""
    r"""b?(?:'(?:[^'\\]|\\.)*'|"(?:[^"\\]|\\.)*")""",
    re.IGNORECASE)

REDACTED = "***"


def redact(text):
    """Return ``text`` with the user-info of every URL and every secret query value or argument replaced by ``***``."""
    text = _USERINFO.sub(rf"\g<scheme>{REDACTED}@", str(text))
    text = _SECRET_PARAMETER.sub(rf"\g<key>{REDACTED}", text)
    return _SECRET_ARGUMENT.sub(rf"\g<key>'{REDACTED}'", text)
