"""URLs of the demo project."""

from django.contrib import admin
from django.urls import path

import distlock.views

urlpatterns = [
    path("admin/", admin.site.urls),
    # Prometheus scrapes this; public (an explicit choice) because the demo listens on loopback only
    # (see README, Operations).
    path("metrics/", distlock.views.MetricsView.as_view(public=True), name="distlock-metrics"),
]
