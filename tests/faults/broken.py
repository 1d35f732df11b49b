"""A deliberately broken backend, so the tests can show that ``distlock verify`` fails when a backend is unsafe."""

import dataclasses

from distlock.backends.database import DatabaseBackend


class ConstantTokenBackend(DatabaseBackend):
    """The database backend, except that every grant carries token 1: fencing cannot tell holders apart."""

    def _try_acquire(self, attempt):
        grant = super()._try_acquire(attempt)
        return None if grant is None else dataclasses.replace(grant, token=1)
