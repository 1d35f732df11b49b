"""URLs of the demo project."""

from django.contrib import admin
from django.urls import path

import distlock.views

urlpatterns = [
    path("admin/", admin.site.urls),
    # Prometheus scrapes this; open here because the demo listens on loopback only (see README, Operations).
    path("metrics/", distlock.views.metrics, name="distlock-metrics"),
]
