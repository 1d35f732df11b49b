"""Each run of a test task writes one row, so the test process can check runs in several workers."""

from django.db import models


class TaskRun(models.Model):
    """One run of a test task: its lock, fencing token and the interval it held the lock.

    ``started_ns``/``finished_ns`` are ``time.monotonic_ns()``: CLOCK_MONOTONIC is system-wide on
    Linux, so intervals recorded by different worker processes compare directly.
    """

    key = models.CharField(max_length=255)
    alias = models.CharField(max_length=32)
    task_id = models.CharField(max_length=64)
    token = models.BigIntegerField()
    pid = models.IntegerField()
    retries = models.IntegerField()
    started_ns = models.BigIntegerField()
    finished_ns = models.BigIntegerField(null=True)
