"""Settings of the fault suite's client processes: the test settings plus the aliases a scenario passes them.

The scenario puts its ``DISTLOCK`` aliases (often on servers of its own, or behind a fault proxy)
in ``DISTLOCK_FAULTS_ALIASES`` and extra ``DATABASES`` (PostgreSQL behind a proxy) in
``DISTLOCK_FAULTS_DATABASES``, both JSON.
"""

import json
import os

from tests.settings import *  # noqa: F403 - the test databases and apps

DISTLOCK = {**DISTLOCK, **json.loads(os.environ.get("DISTLOCK_FAULTS_ALIASES", "{}"))}  # noqa: F405
DATABASES = {**DATABASES, **json.loads(os.environ.get("DISTLOCK_FAULTS_DATABASES", "{}"))}  # noqa: F405
