"""The Prometheus endpoint: ``path("metrics/", distlock.views.metrics)``.

It serves this process's metrics (or every process's, in ``prometheus_client`` multiprocess mode) to
anyone who can reach it: mount it where only the scraper can, or wrap it (see the README, Operations).
"""

from django.http import HttpResponse
from django.views.decorators.http import require_GET

from distlock.metrics import prometheus, this_process


@require_GET
def metrics(request):
    """Return the Prometheus text exposition of the distlock metrics (and any others in the registry)."""
    this_process.drain()  # fold events still queued in this process, so a scrape sees them
    body, content_type = prometheus.exposition()
    return HttpResponse(body, content_type=content_type)
