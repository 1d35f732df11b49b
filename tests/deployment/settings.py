"""The test settings plus a URLconf with one fenced view, for the site gunicorn serves in tests/test_deployment.py."""

from tests.settings import *  # noqa: F403

ROOT_URLCONF = "tests.deployment.urls"
DEBUG = False
ALLOWED_HOSTS = ["127.0.0.1", "localhost"]
# Every unhandled exception of a view goes to gunicorn's log, so a failing run shows its traceback.
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"console": {"class": "logging.StreamHandler"}},
    "loggers": {"distlock": {"handlers": ["console"], "level": "WARNING"},
                "django.request": {"handlers": ["console"], "level": "ERROR", "propagate": False}},
}
