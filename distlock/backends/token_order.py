"""The order of an alias's fencing tokens as this process saw it, and the refusal of a server that went back.

Every built-in token source grows alias-wide: a grant whose request was sent after another grant of
the alias came back carries a larger token, whatever the two names (the contract suite checks it).
A server restored from an older backup or snapshot, wiped, or restarted without its counter while
its clock stands behind breaks that: it issues tokens below, or equal to, tokens already handed out,
and a fenced row would then take an old holder's write after a new holder's, or two holders' writes
with one token.

``TokenOrder`` keeps the highest token of the alias this process was shown (for etcd also the
highest revision and the cluster id of any reply). A grant at or below the highest known *when its
request was sent* is impossible on a sound server; requests in flight together may come back in any
order, so only that snapshot counts, never a concurrent reply. Once one is seen the process
refuses, until it restarts, every grant on the alias and every fenced write with one of its leases
(``TokenRegression``, a ``BackendUnavailable``), logs an error, counts ``distlock_token_regressions``
and sends ``token_regression``. The operator action: raise the alias's ``TOKEN_EPOCH`` by one, which
puts every later token above every earlier one, and restart the processes that use the alias.

What it cannot see: a process only knows what it was shown. One started after the server went
back, or shown none of the tokens above the server's new position, takes the low tokens without
complaint; a fenced row written with a higher token refuses them (``StaleFencingToken``), a row
never written with one accepts them, and an equal token reissued to another holder passes both
layers. ``TOKEN_EPOCH`` is what moves every process above the old tokens.
"""

import logging
import threading
import weakref

from distlock.exceptions import TokenRegression
from distlock.metrics import prometheus
from distlock.signals import send_robustly, token_regression

__all__ = ["TokenOrder"]

logger = logging.getLogger(__name__)


class TokenOrder:
    """The highest token one alias showed this process, and why its server is refused once it went back."""

    def __init__(self, backend):
        self.alias = backend.alias
        #: The backend class, the ``sender`` of ``token_regression``.
        self.sender = type(backend)
        # Weakly: the backend holds this object. Its label may only be known once it is fully built.
        self._backend = weakref.ref(backend)
        #: The highest token (or etcd revision) the server showed, as the server issues it (before ``TOKEN_EPOCH``).
        self.highest = 0
        #: The message of the refusal once the server went back; None while its tokens kept their order.
        self.regression = None
        self._lock = threading.Lock()

    def saw(self, value):
        """Note that the server showed ``value`` (a grant's token, a reply's revision)."""
        if value > self.highest:
            with self._lock:
                if value > self.highest:
                    self.highest = value

    def went_back(self, what):
        """Refuse the alias from now on because ``what`` happened; log, count and signal it the first time only."""
        backend = self._backend()
        label = backend.label if backend is not None else self.sender.__name__
        with self._lock:
            if self.regression is not None:
                return
            self.regression = (
                f"Lock alias '{self.alias}' ({label}) refuses locks and fenced writes: {what}. Its server went "
                "back (restored from an older backup or snapshot, its data wiped, or restarted without its counter "
                "while its clock was behind): tokens it issues now may repeat tokens already used. Raise "
                f"DISTLOCK['{self.alias}']['OPTIONS']['TOKEN_EPOCH'] by one (`manage.py distlock check` names the "
                "value when fenced rows store higher tokens) and restart every process that uses the alias."
            )
        logger.error("%s", self.regression)
        prometheus.count_token_regression(self.alias)
        send_robustly(token_regression, "token_regression", sender=self.sender, alias=self.alias,
                      reason=self.regression)

    def refusal(self):
        """Return the ``TokenRegression`` to raise once the server went back, else None (no I/O)."""
        return None if self.regression is None else TokenRegression(self.regression)

    def check_grant(self, token, floor, name):
        """Return the ``TokenRegression`` refusing a grant of ``token`` on ``name``, or None and note the token.

        ``floor`` is ``highest`` when the attempt began: the grant's request was sent after every grant
        behind it came back, so a sound server issued a larger token.
        """
        if token <= floor:
            self.went_back(f"lock {name!r} was granted token {token}, not above token {floor} granted before "
                           "it was asked for")
        if self.regression is not None:
            return TokenRegression(self.regression)
        self.saw(token)
        return None
