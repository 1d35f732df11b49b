"""Passwords in URLs never show: not in messages, reprs, log lines, thread names or ``distlock check``."""

import io
import logging
import threading

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.core.management import CommandError, call_command

import distlock
from distlock.backends.redlock import RedlockBackend
from distlock.handler import locks
from distlock.redaction import redact
from tests.servers import free_port

SECRET = "s3cret-Pa55"


@pytest.mark.parametrize(("text", "shown"), [
    ("redis://:s3cret@127.0.0.1:6379/0", "redis://***@127.0.0.1:6379/0"),
    ("rediss://user:s3cret@host:6380", "rediss://***@host:6380"),
    ("redis://user:p@ss@host/0", "redis://***@host/0"),  # an unencoded @ in the password
    ("unix://:s3cret@/run/redis.sock?db=1", "unix://***@/run/redis.sock?db=1"),
    ("redis://host:6379/0?password=s3cret&db=1", "redis://host:6379/0?password=***&db=1"),
    ("rediss://h/0?ssl_keyfile=k.pem&ssl_password=s3cret", "rediss://h/0?ssl_keyfile=k.pem&ssl_password=***"),
    ("failed: redis://u:s3cret@a:1/0, redis://u:s3cret@b:2/0.", "failed: redis://***@a:1/0, redis://***@b:2/0."),
    ("redis://127.0.0.1:6379/0 refused", "redis://127.0.0.1:6379/0 refused"),
    ("user@example.com wrote", "user@example.com wrote"),
])
def test_redact_removes_the_user_info_and_secret_parameters_of_urls(text, shown):
    assert redact(text) == shown


@pytest.fixture
def passworded_redlock(settings):
    """A Redlock alias whose masters' URLs carry a password, on ports nothing listens on."""
    urls = [f"redis://admin:{SECRET}@127.0.0.1:{free_port()}/0" for _ in range(3)]
    settings.DISTLOCK = {**settings.DISTLOCK, "passworded": {
        "BACKEND": "distlock.backends.redlock.RedlockBackend", "OPTIONS": {"URLS": urls, "REQUEST_TIMEOUT": 0.1}}}
    yield "passworded"
    locks.close_all()


def test_a_password_in_a_redlock_url_shows_in_no_message_repr_log_or_thread_name(passworded_redlock, caplog):
    caplog.set_level(logging.DEBUG, logger="distlock")
    backend = locks[passworded_redlock]
    with pytest.raises(distlock.BackendUnavailable) as excinfo:
        distlock.acquire("secret-test", ttl=10, blocking=False, using=passworded_redlock)
    shown = [str(excinfo.value), repr(excinfo.value), repr(backend.masters),
             *(thread.name for thread in threading.enumerate()), *(record.getMessage() for record in caplog.records)]
    assert "127.0.0.1" in str(excinfo.value) or "masters" in str(excinfo.value)
    assert not [text for text in shown if SECRET in text]


def test_a_password_in_a_url_shows_not_in_distlock_check(passworded_redlock):
    out = io.StringIO()
    with pytest.raises(CommandError):
        call_command("distlock", "check", "--using", passworded_redlock, stdout=out)
    assert "FAILED" in out.getvalue()
    assert SECRET not in out.getvalue()


def test_a_password_in_a_refused_option_shows_not_in_the_configuration_error():
    with pytest.raises(ImproperlyConfigured) as excinfo:
        RedlockBackend.clean_options("x", {"URLS": [f"http://u:{SECRET}@a/0", "redis://b", "redis://c"]})
    assert "http://***@a/0" in str(excinfo.value)
    assert SECRET not in str(excinfo.value)


def test_a_password_in_a_redis_url_shows_not_in_backend_unavailable(settings):
    settings.DISTLOCK = {**settings.DISTLOCK, "passworded_redis": {
        "BACKEND": "distlock.backends.redis.RedisBackend",
        "OPTIONS": {"URL": f"redis://admin:{SECRET}@127.0.0.1:{free_port()}/0", "REQUEST_TIMEOUT": 0.5}}}
    try:
        with pytest.raises(distlock.BackendUnavailable) as excinfo:
            distlock.acquire("secret-test", ttl=10, blocking=False, using="passworded_redis")
        assert SECRET not in str(excinfo.value)
    finally:
        locks.close_all()
