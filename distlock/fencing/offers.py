"""What a caller offers with a fenced write: a ``Lease`` or a bare token, checked before any I/O."""

from dataclasses import dataclass

from django.core.exceptions import FieldDoesNotExist

from distlock.exceptions import UnsafeFencingToken
from distlock.lease import Lease, LeaseSet

__all__ = ["MAX_TOKEN", "Offer", "lease_for_lookup", "lease_for_row", "offer", "offer_for_save"]

#: Largest token a ``BigIntegerField`` stores.
MAX_TOKEN = 2**63 - 1


@dataclass(frozen=True)
class Offer:
    """A fencing token offered with a write, and what is known of the lock that issued it."""

    token: int
    #: The lock's name and alias, known when a ``Lease`` was given rather than a bare int.
    lock_name: str | None = None
    alias: str | None = None


def offer_for_save(model, lease, fencing_token):
    """Return the ``Offer`` of ``save(lease=...)`` or ``save(fencing_token=...)``; None when neither is given."""
    if lease is not None and fencing_token is not None:
        raise TypeError("save() takes lease= or fencing_token=, not both: the lease's token is the fencing token.")
    if lease is not None:
        if not isinstance(lease, Lease):
            raise TypeError(
                f"lease must be a distlock Lease, got {type(lease).__name__}; pass a bare token as fencing_token=."
            )
        return _lease_offer(model, lease)
    if fencing_token is not None:
        return _token_offer(fencing_token, "fencing_token", "an int fencing token (lease.token)")
    return None


def offer(model, lease_or_token, argument):
    """Return the ``Offer`` of ``lease_or_token``, a ``Lease`` or an int token (``claim``, ``fenced_update``)."""
    if isinstance(lease_or_token, Lease):
        return _lease_offer(model, lease_or_token)
    if isinstance(lease_or_token, LeaseSet):
        raise TypeError(
            f"{argument} must be one Lease or an int fencing token, got {lease_or_token!r}: every row this write "
            "changes gets one token; pass the lease of the lock that guards them (lease_set.lease_for(name))."
        )
    return _token_offer(lease_or_token, argument, "a distlock Lease or an int fencing token")


def _lease_offer(model, lease):
    """Return the ``Offer`` of ``lease``, checked before any I/O.

    A lease known lost or expired raises ``LockLost``; a lease from a backend whose tokens may go
    backwards (Redlock) raises ``UnsafeFencingToken`` unless ``model.allow_unsafe_tokens``; a lease of
    an alias whose server this process saw go back raises ``TokenRegression``
    (``distlock.backends.token_order``).
    """
    if not lease.token_is_safe and not model.allow_unsafe_tokens:
        raise UnsafeFencingToken(
            f"{model._meta.label} refuses the lease on {lease.name!r}: alias '{lease.alias}' "
            f"({type(lease.backend).__name__}) cannot promise that its tokens never go backwards. Use a "
            f"backend with safe tokens, or set allow_unsafe_tokens = True on {model.__name__} to accept the risk."
        )
    refusal = lease.backend.token_order.refusal()
    if refusal is not None:
        raise refusal
    lease.check()
    return Offer(token=lease.token, lock_name=lease.name, alias=lease.alias)


def _token_offer(token, argument, expected):
    if isinstance(token, bool) or not isinstance(token, int):
        raise TypeError(f"{argument} must be {expected}, got {type(token).__name__}.")
    if not 0 < token <= MAX_TOKEN:
        raise ValueError(f"{argument} must be a fencing token between 1 and 2**63 - 1, got {token}.")
    return Offer(token=token)


# -- a LeaseSet (lock_many()): the member lease whose lock guards the row --------------------------

def lease_for_row(model, lease_set, instance):
    """Return the lease of ``lease_set`` on the lock guarding ``instance`` (``save(lease=lease_set)``)."""
    return _member(model, lease_set, _InstanceValues(instance), f"pk={instance.pk!r}")


def lease_for_lookup(model, lease_set, lookup):
    """Return the lease of ``lease_set`` on the lock guarding the row ``lookup`` names (``claim(lease_set, ...)``).

    The lock name is built from the lookup itself, before any I/O: only exact lookups on the fields
    ``model.lock_name_template`` names count (``pk`` or the primary key's own name for ``{pk}``).
    """
    pk = model._meta.pk
    values = {}
    for key, value in lookup.items():
        if key in ("pk", pk.name, pk.attname):
            values.update({"pk": value, pk.name: value, pk.attname: value})
            continue
        try:
            field = model._meta.get_field(key)
        except FieldDoesNotExist:
            continue  # e.g. "name__iexact": no exact value to build a name from
        values.update({field.name: value, getattr(field, "attname", field.name): value})
    return _member(model, lease_set, values, " ".join(f"{key}={value!r}" for key, value in lookup.items()))


class _InstanceValues(dict):
    """The values of a model instance by ``pk``, field name or attname (a foreign key gives its id), read as needed."""

    def __init__(self, instance):
        super().__init__()
        self._instance = instance

    def __missing__(self, key):
        if key == "pk":
            return self._instance.pk
        try:
            field = self._instance._meta.get_field(key)
        except FieldDoesNotExist:
            raise KeyError(key) from None
        return getattr(self._instance, field.attname)


def _member(model, lease_set, values, row):
    label = f"{model._meta.label} {row}"
    try:
        name = model.lock_name_for(values)
    except KeyError as exc:
        raise TypeError(
            f"{label}: the lock name template {model.lock_name_template!r} of {model.__name__} needs "
            f"{exc.args[0]!r}, which is not given exactly; claim the row by the fields the template names "
            "(e.g. pk=...)."
        ) from None
    try:
        return lease_set.lease_for(name)
    except KeyError:
        raise ValueError(
            f"{label} is guarded by lock {name!r} ({model.__name__}.lock_name_for()), which is not one of the "
            f"locks of {lease_set!r}; nothing was written."
        ) from None
