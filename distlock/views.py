"""The Prometheus endpoint: ``path("metrics/", distlock.views.metrics)``, closed unless the project opens it.

It serves distlock's own metrics only (never the rest of the ``prometheus_client`` registry): those of
this process, or of every process in ``prometheus_client`` multiprocess mode. Who may read them is an
explicit choice made in ``urls.py`` (see ``MetricsView`` and the README, Operations).
"""

import hmac

from django.core.exceptions import ImproperlyConfigured, PermissionDenied
from django.http import HttpResponse
from django.utils.decorators import method_decorator
from django.views import View
from django.views.decorators.cache import never_cache

from distlock.metrics import prometheus, this_process

__all__ = ["MetricsView", "metrics"]


@method_decorator(never_cache, name="dispatch")
class MetricsView(View):
    """Serve the distlock metrics in Prometheus text format to whom ``as_view()`` allows, and to no one else.

    .. code-block:: python

        path("metrics/", MetricsView.as_view(token=os.environ["METRICS_TOKEN"]))  # a scraper with a bearer token
        path("metrics/", distlock.views.metrics)          # logged-in users with distlock.view_lock only
        path("metrics/", MetricsView.as_view(public=True))  # anyone who can reach it: the network protects it

    A request is served if the view is ``public``, or carries ``Authorization: Bearer <token>``, or comes
    from a logged-in user with ``permission``. Otherwise: 401 with ``WWW-Authenticate: Bearer`` when a
    token is configured, else 403. A misconfiguration raises ``ImproperlyConfigured`` when the URLconf is
    loaded, so ``manage.py check`` reports it.
    """

    http_method_names = ["get", "head", "options"]
    #: The bearer token a scraper sends (Prometheus ``authorization: {credentials: ...}``); None: no token.
    token = None
    #: A logged-in user with this permission is served (the "Held locks" page shows the same figures);
    #: None: no session access.
    permission = "distlock.view_lock"
    #: True: serve anyone who can reach the URL. Say so explicitly, for an endpoint only the scraper can reach.
    public = False
    #: The shortest token accepted: a guessable one is no protection.
    min_token_length = 16

    @classmethod
    def as_view(cls, **initkwargs):
        token = initkwargs.get("token", cls.token)
        public = initkwargs.get("public", cls.public)
        permission = initkwargs.get("permission", cls.permission)
        if token is not None and (not isinstance(token, str) or len(token.strip()) < cls.min_token_length):
            raise ImproperlyConfigured(
                f"{cls.__name__}.as_view(token=...) must be a str of at least {cls.min_token_length} characters "
                "(a secret from the environment, e.g. `python -c 'import secrets; print(secrets.token_urlsafe())'`)."
            )
        if public and token is not None:
            raise ImproperlyConfigured(f"{cls.__name__}.as_view() got both public=True and a token: choose one.")
        if not public and token is None and permission is None:
            raise ImproperlyConfigured(f"{cls.__name__}.as_view() with no token, no permission and public=False "
                                       "serves no one.")
        return super().as_view(**initkwargs)

    def dispatch(self, request, *args, **kwargs):
        if self.public or self._has_token(request) or self._has_permission(request):
            return super().dispatch(request, *args, **kwargs)
        if self.token is not None:
            response = HttpResponse("A bearer token is required.\n", status=401, content_type="text/plain")
            response["WWW-Authenticate"] = 'Bearer realm="distlock metrics"'
            return response
        raise PermissionDenied

    def _has_token(self, request):
        if self.token is None:
            return False
        scheme, _, credentials = request.headers.get("Authorization", "").partition(" ")
        # compare_digest: the time taken must not tell how much of a guess was right.
        return scheme.lower() == "bearer" and hmac.compare_digest(credentials.strip().encode(), self.token.encode())

    def _has_permission(self, request):
        user = getattr(request, "user", None)
        return self.permission is not None and user is not None and user.has_perm(self.permission)

    def get(self, request, *args, **kwargs):
        """Return the Prometheus text exposition of the distlock metrics (and nothing else in the registry)."""
        this_process.drain()  # fold events still queued in this process, so a scrape sees them
        body, content_type = prometheus.exposition()
        return HttpResponse(body, content_type=content_type)


#: The endpoint for logged-in users with ``distlock.view_lock``; configure ``MetricsView`` for a scraper.
metrics = MetricsView.as_view()
