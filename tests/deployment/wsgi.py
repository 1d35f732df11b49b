"""WSGI entry point of the deployment tests' site (``gunicorn tests.deployment.wsgi:application``)."""

import os

from django.core.wsgi import get_wsgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.deployment.settings")
application = get_wsgi_application()
