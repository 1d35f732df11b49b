"""System checks report every misconfigured alias with its option, and do no network I/O."""

import pytest
from django.core.management import call_command
from django.core.management.base import SystemCheckError

from distlock.checks import check_distlock_setting, check_metrics_setting


def ids(errors):
    return [error.id for error in errors]


@pytest.fixture(autouse=True)
def _debug(settings):
    """DEBUG on, as in development: the checks here are errors; distlock.W001 (DEBUG off) is tested per backend."""
    settings.DEBUG = True


def test_the_test_settings_pass(settings):
    assert check_distlock_setting() == []


def test_no_setting_means_the_database_backend(settings):
    del settings.DISTLOCK
    assert check_distlock_setting() == []
    from distlock.handler import locks  # noqa: PLC0415

    assert type(locks["default"]).__name__ == "DatabaseBackend"


@pytest.mark.parametrize(("config", "expected_id", "words"), [
    ("not a dict", "distlock.E001", "must be a dict"),
    ({"other": {"BACKEND": "distlock.backends.locmem.LocMemBackend"}}, "distlock.E001", "'default'"),
    ({"default": "distlock.backends.locmem.LocMemBackend"}, "distlock.E002", "BACKEND"),
    ({"default": {"BACKEND": "distlock.backends.locmem.LocMemBackend", "OPTION": {}}}, "distlock.E002", "OPTION"),
    ({"default": {"BACKEND": "distlock.backends.nope.NopeBackend"}}, "distlock.E003", "could not be imported"),
    ({"default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"}}, "distlock.E003",
     "not a lock backend"),
    ({"default": {"BACKEND": "distlock.backends.locmem.LocMemBackend", "OPTIONS": {"DEFAULT_TTL": -1}}},
     "distlock.E004", "DEFAULT_TTL"),
    ({"default": {"BACKEND": "distlock.backends.locmem.LocMemBackend", "OPTIONS": {"DEFAULT_TTL": "30"}}},
     "distlock.E004", "DEFAULT_TTL"),
    ({"default": {"BACKEND": "distlock.backends.locmem.LocMemBackend", "OPTIONS": {"DEFAULT_TTL": 1e10}}},
     "distlock.E004", "at most 1e+09"),
    ({"default": {"BACKEND": "distlock.backends.locmem.LocMemBackend", "OPTIONS": {"AUTO_RENEW": "yes"}}},
     "distlock.E004", "AUTO_RENEW"),
    ({"default": {"BACKEND": "distlock.backends.locmem.LocMemBackend", "OPTIONS": {"TTL": 3}}},
     "distlock.E004", "unknown option"),
    ({"default": {"BACKEND": "distlock.backends.locmem.LocMemBackend", "OPTIONS": []}}, "distlock.E004",
     "must be a dict"),
])
def test_misconfiguration_is_reported_with_alias_and_option(settings, config, expected_id, words):
    settings.DISTLOCK = config
    errors = check_distlock_setting()
    assert expected_id in ids(errors)
    assert any(words in error.msg for error in errors)


def test_every_alias_at_fault_is_reported(settings):
    settings.DISTLOCK = {
        "default": {"BACKEND": "distlock.backends.locmem.LocMemBackend"},
        "a": {"BACKEND": "distlock.backends.locmem.LocMemBackend", "OPTIONS": {"MAX_HOLD": 0}},
        "b": {"BACKEND": "distlock.backends.missing.Backend"},
    }
    errors = check_distlock_setting()
    assert sorted(ids(errors)) == ["distlock.E003", "distlock.E004"]
    assert any("DISTLOCK['a']" in error.msg for error in errors)


def test_manage_py_check_fails_on_errors(settings):
    settings.DISTLOCK = {"default": {"BACKEND": "distlock.backends.nope.NopeBackend"}}
    with pytest.raises(SystemCheckError, match="distlock.E003"):
        call_command("check")


LOCMEM = {"BACKEND": "distlock.backends.locmem.LocMemBackend"}
REDIS, REDLOCK = "distlock.backends.redis.RedisBackend", "distlock.backends.redlock.RedlockBackend"
MASTERS = ["redis://127.0.0.1:7001/0", "redis://127.0.0.1:7002/0", "redis://127.0.0.1:7003/0"]


@pytest.mark.parametrize(("redis_options", "redlock_options", "shared"), [
    # The defaults: both use KEY_PREFIX "distlock"; Redlock's hashes sit where Redis expects strings.
    ({"URL": "redis://127.0.0.1:7001/0"}, {"URLS": MASTERS}, True),
    ({"URL": "redis://:pw@localhost:7001"}, {"URLS": MASTERS}, True),  # one server, spelled otherwise
    ({"URL": "redis://127.0.0.1:7001/1"}, {"URLS": MASTERS}, False),  # another database
    ({"URL": "redis://127.0.0.1:7001/0", "KEY_PREFIX": "locks"}, {"URLS": MASTERS}, False),
    ({"URL": "redis://127.0.0.1:7009/0"}, {"URLS": MASTERS}, False),
])
def test_two_aliases_keeping_keys_under_one_prefix_of_one_server_are_refused(
        settings, redis_options, redlock_options, shared):
    settings.DISTLOCK = {"default": LOCMEM, "cache": {"BACKEND": REDIS, "OPTIONS": redis_options},
                         "majority": {"BACKEND": REDLOCK, "OPTIONS": redlock_options}}
    errors = check_distlock_setting()
    assert ids(errors) == (["distlock.E005"] if shared else [])
    if shared:
        assert "DISTLOCK['majority'] and DISTLOCK['cache']" in errors[0].msg
        assert "KEY_PREFIX 'distlock'" in errors[0].msg and "localhost:7001, db 0" in errors[0].msg
        assert "pw" not in errors[0].msg


def test_a_redis_alias_on_a_cache_shares_the_cache_s_server(settings):
    settings.CACHES = {**settings.CACHES, "shared": {"BACKEND": "django_redis.cache.RedisCache",
                                                     "LOCATION": "redis://127.0.0.1:7001/0"}}
    settings.DISTLOCK = {"default": LOCMEM, "on_cache": {"BACKEND": REDIS, "OPTIONS": {"CACHE": "shared"}},
                         "on_url": {"BACKEND": REDIS, "OPTIONS": {"URL": "redis://localhost:7001/0"}}}
    assert ids(check_distlock_setting()) == ["distlock.E005"]


def test_redlock_counts_one_server_spelled_twice_once(settings):
    settings.DISTLOCK = {"default": LOCMEM, "majority": {"BACKEND": REDLOCK, "OPTIONS": {
        "URLS": ["redis://localhost:7001/0", "redis://127.0.0.1:7001/0", "redis://127.0.0.1:7003/0"]}}}
    errors = check_distlock_setting()
    assert ids(errors) == ["distlock.E004"]
    assert "each master once" in errors[0].msg


def test_an_invalid_distlock_metrics_is_reported_by_the_checks(settings):
    settings.DISTLOCK_METRICS = {"FLUSH_INTERVAL": "10"}
    errors = check_metrics_setting()
    assert ids(errors) == ["distlock.E006"]
    assert "FLUSH_INTERVAL" in errors[0].msg


@pytest.mark.filterwarnings("ignore:Overriding setting DATABASES")
def test_a_metrics_store_on_an_unsupported_database_is_refused(settings):
    settings.DATABASES = {**settings.DATABASES, "mysql": {"ENGINE": "tests.vendor_backends.mysql", "NAME": ":memory:"}}
    settings.DISTLOCK_METRICS = {"DATABASE": "mysql"}
    errors = check_metrics_setting()
    assert ids(errors) == ["distlock.E007"]
    assert "DATABASES['mysql'], a mysql database" in errors[0].msg
    settings.DISTLOCK_METRICS = {"DATABASE": "mysql", "ENABLED": False}
    assert check_metrics_setting() == []


def test_the_test_metrics_settings_pass():
    assert check_metrics_setting() == []
