"""Settings of the test suite, built from the addresses ``python -m tests.servers`` exports.

A DISTLOCK alias exists only where its server was started; ``conftest.backend_alias`` fails the test
(or skips it, outside ``make test``) when an alias is missing. Child processes started by the tests
set ``DISTLOCK_TEST_CHILD=1`` and connect straight to the test databases the parent created.
"""

import os
import tempfile

from project.settings import *  # noqa: F403 - the demo project's apps, templates and URLs

TMP = os.environ.get("DISTLOCK_TEST_TMP") or tempfile.gettempdir()
# setdefault into os.environ, so processes started by the tests share the database names.
RUN_ID = os.environ.setdefault("DISTLOCK_TEST_RUN_ID", str(os.getpid()))
CHILD = os.environ.get("DISTLOCK_TEST_CHILD") == "1"

# The fenced models of tests/test_fencing.py and bench/fencing.py.
INSTALLED_APPS = [*INSTALLED_APPS, "tests.fencing_app"]  # noqa: F405

SQLITE_TEST_NAME = os.path.join(TMP, f"test-distlock-{RUN_ID}.sqlite3")
DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": SQLITE_TEST_NAME if CHILD else os.path.join(TMP, f"distlock-{RUN_ID}.sqlite3"),
        "OPTIONS": {"timeout": 20, "transaction_mode": "IMMEDIATE",
                    "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;"},
        "TEST": {"NAME": SQLITE_TEST_NAME},
    },
    # Where tests/test_configurations.py's router sends the distlock app (its own tables only).
    "locks": {
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": os.path.join(TMP, f"{'test-' if CHILD else ''}distlock-locks-{RUN_ID}.sqlite3"),
        # As "default": without WAL each commit of the flush after every test waits for a sync.
        "OPTIONS": {"init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;"},
        "TEST": {"NAME": os.path.join(TMP, f"test-distlock-locks-{RUN_ID}.sqlite3")},
    },
}

DISTLOCK = {
    "default": {"BACKEND": "distlock.backends.database.DatabaseBackend", "OPTIONS": {}},
    "locmem": {"BACKEND": "distlock.backends.locmem.LocMemBackend", "OPTIONS": {}},
}
CACHES = {"default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"}}
# Never the machine's shared Redis: in-memory Celery unless the test Redis is started (below).
CELERY_BROKER_URL, CELERY_RESULT_BACKEND = "memory://", "cache+memory://"

if os.environ.get("DISTLOCK_TEST_PG"):
    _host, _port = os.environ["DISTLOCK_TEST_PG"].rsplit(":", 1)
    PG_TEST_NAME = f"test_distlock_{RUN_ID}"
    DATABASES["postgres"] = {
        "ENGINE": "django.db.backends.postgresql",
        "HOST": _host,
        "PORT": _port,
        "USER": "postgres",
        "NAME": PG_TEST_NAME if CHILD else "test",
        "TEST": {"NAME": PG_TEST_NAME},
    }
    DISTLOCK["postgres"] = {"BACKEND": "distlock.backends.database.DatabaseBackend",
                            "OPTIONS": {"DATABASE": "postgres"}}

if os.environ.get("DISTLOCK_TEST_REDIS_URL"):
    REDIS_URL = os.environ["DISTLOCK_TEST_REDIS_URL"]
    CACHES["redis"] = {"BACKEND": "django_redis.cache.RedisCache", "LOCATION": REDIS_URL}
    DISTLOCK["redis"] = {"BACKEND": "distlock.backends.redis.RedisBackend",
                         "OPTIONS": {"URL": REDIS_URL, "KEY_PREFIX": f"distlock-test-{RUN_ID}"}}
    DISTLOCK["redis_cache"] = {"BACKEND": "distlock.backends.redis.RedisBackend",
                               "OPTIONS": {"CACHE": "redis", "KEY_PREFIX": f"distlock-test-cache-{RUN_ID}"}}
    # Celery (tests/test_celery.py): broker and results on other db numbers of the same test Redis.
    CELERY_BROKER_URL = REDIS_URL.rsplit("/", 1)[0] + "/1"
    CELERY_RESULT_BACKEND = REDIS_URL.rsplit("/", 1)[0] + "/2"

if os.environ.get("DISTLOCK_TEST_REDIS_CLUSTER_URL"):
    DISTLOCK["redis_cluster"] = {"BACKEND": "distlock.backends.redis.RedisBackend",
                                 "OPTIONS": {"URL": os.environ["DISTLOCK_TEST_REDIS_CLUSTER_URL"], "CLUSTER": True,
                                             "KEY_PREFIX": f"distlock-test-{RUN_ID}"}}

if os.environ.get("DISTLOCK_TEST_REDLOCK_URLS"):
    DISTLOCK["redlock"] = {"BACKEND": "distlock.backends.redlock.RedlockBackend",
                           "OPTIONS": {"URLS": os.environ["DISTLOCK_TEST_REDLOCK_URLS"].split(",")}}
    # Processes that load the CPU on purpose (tests/thread_churn.py) give the masters longer to answer.
    if os.environ.get("DISTLOCK_TEST_REDLOCK_REQUEST_TIMEOUT"):
        DISTLOCK["redlock"]["OPTIONS"]["REQUEST_TIMEOUT"] = float(os.environ["DISTLOCK_TEST_REDLOCK_REQUEST_TIMEOUT"])

if os.environ.get("DISTLOCK_TEST_ZK_HOSTS"):
    DISTLOCK["zookeeper"] = {"BACKEND": "distlock.backends.zookeeper.ZooKeeperBackend",
                             "OPTIONS": {"HOSTS": os.environ["DISTLOCK_TEST_ZK_HOSTS"],
                                         "KEY_PREFIX": f"/distlock-test-{RUN_ID}"}}
    # The same ensemble with the other znode layout (LAYOUT in the README), on a KEY_PREFIX of its own.
    DISTLOCK["zookeeper_buckets"] = {"BACKEND": "distlock.backends.zookeeper.ZooKeeperBackend",
                                     "OPTIONS": {"HOSTS": os.environ["DISTLOCK_TEST_ZK_HOSTS"],
                                                 "KEY_PREFIX": f"/distlock-test-buckets-{RUN_ID}", "LAYOUT": "buckets"}}

if os.environ.get("DISTLOCK_TEST_ETCD_ENDPOINTS"):
    DISTLOCK["etcd"] = {"BACKEND": "distlock.backends.etcd.EtcdBackend",
                        "OPTIONS": {"ENDPOINTS": os.environ["DISTLOCK_TEST_ETCD_ENDPOINTS"],
                                    "KEY_PREFIX": f"/distlock-test-{RUN_ID}/"}}

# Children whose paused or killed holders must be freed sooner than a 10 s session (tests/test_fencing.py,
# tests/backends/test_contract.py): ZooKeeper's session timeout and etcd's session lease, in whole seconds.
if os.environ.get("DISTLOCK_TEST_SESSION_TIMEOUT"):
    for _alias, _option in (("zookeeper", "SESSION_TIMEOUT"), ("zookeeper_buckets", "SESSION_TIMEOUT"),
                            ("etcd", "LEASE_TTL")):
        if _alias in DISTLOCK:
            DISTLOCK[_alias]["OPTIONS"][_option] = int(os.environ["DISTLOCK_TEST_SESSION_TIMEOUT"])

# The tasks and run records of tests/test_celery.py; workers find them through autodiscovery.
INSTALLED_APPS = [*INSTALLED_APPS, "tests.celery_app"]  # noqa: F405
CELERY_TASK_DEFAULT_QUEUE = f"distlock-test-{RUN_ID}"

PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]

# A child that must flush its metrics sooner than the default 10 s (tests/test_metrics.py's live process).
if os.environ.get("DISTLOCK_TEST_METRICS_FLUSH_INTERVAL"):
    DISTLOCK_METRICS = {"FLUSH_INTERVAL": float(os.environ["DISTLOCK_TEST_METRICS_FLUSH_INTERVAL"])}
