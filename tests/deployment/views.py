"""One view as a site would write it: a lock per hot name around a read-modify-write of a fenced row."""

import os

from django.http import JsonResponse

import distlock
from tests.fencing_app.models import Account


def order(request, alias, db, name):
    """Add 1 to the ``Account`` row ``name`` on database ``db`` under lock ``name`` of ``alias``.

    Answer 200 with the lease's token and the balance written, 409 when the lock stayed held for the
    2 s timeout; anything else is the site failing (Django answers 500).
    """
    try:
        with distlock.lock(name, ttl=5, timeout=2, using=alias) as lease:
            account = Account.objects.using(db).get(name=name)
            account.balance += 1
            account.save(lease=lease, using=db)
            lost = lease.lost
    except distlock.LockNotAcquired:
        return JsonResponse({"conflict": name}, status=409)
    return JsonResponse({"token": lease.token, "balance": account.balance, "lost": lost, "pid": os.getpid()})
