"""The Prometheus view: who may read it, and that it exports distlock's own metrics only."""

import prometheus_client
import pytest
from django.contrib.auth.models import AnonymousUser, Permission, User
from django.core.exceptions import ImproperlyConfigured
from django.test import RequestFactory
from django.urls import path
from prometheus_client.parser import text_string_to_metric_families

import distlock
from distlock import views

pytestmark = pytest.mark.django_db

TOKEN = "s3cret-scraper-token-0123456789"

#: This module is the URLconf of the tests marked ``urls``: the view as ``urls.py`` mounts it by default.
urlpatterns = [path("metrics/", views.metrics)]


@pytest.fixture
def unrelated_metric():
    """A metric of another app in the default registry, which the view must not export."""
    counter = prometheus_client.Counter("unrelated_app_orders", "Another app's business figure.")
    counter.inc(7)
    yield counter
    prometheus_client.REGISTRY.unregister(counter)


def families(response):
    assert response.status_code == 200
    assert response["Content-Type"].startswith("text/plain")
    return {family.name for family in text_string_to_metric_families(response.content.decode())}


def get(view, *, user=None, **headers):
    request = RequestFactory().get("/metrics/", headers=headers)
    request.user = user or AnonymousUser()
    return view(request)


@pytest.mark.urls(__name__)
def test_the_default_view_needs_the_view_lock_permission(client):
    assert client.get("/metrics/").status_code == 403
    staff = User.objects.create_user("staff", password="pw", is_staff=True)
    client.force_login(staff)
    assert client.get("/metrics/").status_code == 403
    staff.user_permissions.add(Permission.objects.get(content_type__app_label="distlock", codename="view_lock"))
    assert "distlock_acquisitions" in families(client.get("/metrics/"))


@pytest.mark.urls(__name__)
def test_only_distlock_metrics_are_exported(admin_client, unrelated_metric, lock_name):
    with distlock.lock(lock_name, using="locmem"):
        pass
    exported = families(admin_client.get("/metrics/"))
    assert {"distlock_acquisitions", "distlock_acquire_seconds", "distlock_hold_seconds"} <= exported
    assert not {name for name in exported if not name.startswith("distlock_")}, exported
    assert "unrelated_app_orders" not in exported and "python_info" not in exported


def test_a_scraper_authenticates_with_its_bearer_token(unrelated_metric):
    view = views.MetricsView.as_view(token=TOKEN)
    exported = families(get(view, Authorization=f"Bearer {TOKEN}"))
    assert "distlock_acquisitions" in exported and "unrelated_app_orders" not in exported
    for headers in ({}, {"Authorization": "Bearer wrong-token-wrong-token-wrong"}, {"Authorization": TOKEN},
                    {"Authorization": f"Basic {TOKEN}"}):
        response = get(view, **headers)
        assert response.status_code == 401, headers
        assert response["WWW-Authenticate"].startswith("Bearer")
        assert b"distlock_" not in response.content


def test_public_is_an_explicit_choice():
    assert "distlock_acquisitions" in families(get(views.MetricsView.as_view(public=True)))


@pytest.mark.parametrize("options", [{"token": ""}, {"token": "short"}, {"token": b"0123456789abcdef0123"},
                                     {"token": TOKEN, "public": True}])
def test_a_weak_or_contradictory_configuration_is_refused(options):
    with pytest.raises(ImproperlyConfigured):
        views.MetricsView.as_view(**options)
