"""The "Held locks" admin page and force release, through Django's test client, on every backend."""

import os
import re
import uuid

import pytest
from django.contrib.admin.models import DELETION, LogEntry
from django.contrib.auth.models import Permission, User
from django.urls import reverse

import distlock
from distlock.metrics import Recorder
from distlock.models import FencingRejection
from tests.servers import free_port
from tests.test_metrics import acquire_n

pytestmark = pytest.mark.django_db(transaction=True, databases="__all__")

PAGE = "/admin/distlock/lock/"
RELEASE = "/admin/distlock/lock/release/"


def make_user(username, *, staff=True, perms=()):
    user = User.objects.create_user(username, password="pw", is_staff=staff)
    for codename in perms:
        user.user_permissions.add(Permission.objects.get(content_type__app_label="distlock", codename=codename))
    return user


@pytest.fixture
def viewer_client(client):
    """A staff user who may view the page but not force-release."""
    client.force_login(make_user("viewer", perms=["view_lock"]))
    return client


@pytest.fixture
def operator_client(client):
    """A staff user with the view and force-release permissions."""
    client.force_login(make_user("operator", perms=["view_lock", "force_release_lock"]))
    return client


def lock_row(html, alias, name):
    """Return the page's table row of lock ``name`` on ``alias``, or None."""
    match = re.search(rf'<tr class="distlock-lock" data-alias="{re.escape(alias)}" data-name="{re.escape(name)}">'
                      r"(.*?)</tr>", html, re.S)
    return match.group(1) if match else None


def metrics_row(html, window, alias, prefix):
    table = re.search(rf'<table class="distlock-metrics" data-window="{window}">(.*?)</table>', html, re.S).group(1)
    match = re.search(rf'data-alias="{re.escape(alias)}" data-prefix="{re.escape(prefix)}">(.*?)</tr>', table, re.S)
    return match.group(1) if match else None


def flagged(row):
    """Return the figures flagged in a metrics row."""
    return set(re.findall(r'distlock-alert[^"]*" data-figure="([a-z_0-9]+)"', row))


# -- who sees the page ----------------------------------------------------------------------------


def test_admin_index_links_held_locks(admin_client):
    html = admin_client.get("/admin/").content.decode()
    assert re.search(rf'<a href="{PAGE}"[^>]*>Held locks</a>', html)


def test_staff_sees_the_held_lock_of_every_backend(admin_client, backend_alias, lock_name):
    with distlock.lock(lock_name, ttl=30, using=backend_alias) as lease:
        response = admin_client.get(PAGE)
        assert response.status_code == 200
        row = lock_row(response.content.decode(), backend_alias, lock_name)
        assert row is not None, f"no row for {lock_name!r} on {backend_alias!r}"
        assert f">{lease.token}<" in row
        assert f'title="{lease.owner}"' in row
        assert f"pid {os.getpid()}" in row
    after = admin_client.get(PAGE).content.decode()
    assert lock_row(after, backend_alias, lock_name) is None


def test_non_staff_is_sent_to_the_login_page(client):
    client.force_login(make_user("customer", staff=False))
    response = client.get(PAGE)
    assert response.status_code == 302 and response["Location"].startswith("/admin/login/")


def test_staff_without_the_view_permission_gets_403(client):
    client.force_login(make_user("intern"))
    assert client.get(PAGE).status_code == 403
    html = client.get("/admin/").content.decode()
    assert "Held locks" not in html


def test_filter_by_alias_and_search_by_name(viewer_client):
    tag = uuid.uuid4().hex[:8]
    with distlock.lock(f"alpha:{tag}", using="locmem"), distlock.lock(f"beta:{tag}", using="locmem"):
        html = viewer_client.get(PAGE, {"q": f"ALPHA:{tag}"}).content.decode()
        assert lock_row(html, "locmem", f"alpha:{tag}") is not None
        assert lock_row(html, "locmem", f"beta:{tag}") is None
        html = viewer_client.get(PAGE, {"alias": "locmem", "q": tag}).content.decode()
        assert lock_row(html, "locmem", f"beta:{tag}") is not None
        assert set(re.findall(r'<tr class="distlock-[a-z-]+" data-alias="([^"]+)"', html)) == {"locmem"}


def test_a_long_list_is_cut_and_says_how_much_is_hidden(viewer_client, monkeypatch):
    monkeypatch.setattr("distlock.admin.ROWS_PER_ALIAS", 2)
    tag = uuid.uuid4().hex[:8]
    leases = [distlock.acquire(f"many{tag}:{number}", using="locmem") for number in range(5)]
    html = viewer_client.get(PAGE, {"alias": "locmem", "q": tag}).content.decode()
    assert len(re.findall(r'<tr class="distlock-lock"', html)) == 2
    assert "3 more locks not shown" in html and "5 locks held" in html
    for lease in leases:
        lease.release()


def test_an_unreachable_or_broken_backend_is_an_error_row(viewer_client, settings, lock_name):
    settings.DISTLOCK = {
        **settings.DISTLOCK,
        "down": {"BACKEND": "distlock.backends.redis.RedisBackend",
                 "OPTIONS": {"URL": f"redis://127.0.0.1:{free_port()}/0", "SOCKET_CONNECT_TIMEOUT": 2}},
        "broken": {"BACKEND": "distlock.backends.nonexistent.Backend"},
    }
    with distlock.lock(lock_name, using="locmem"):
        response = viewer_client.get(PAGE)
    assert response.status_code == 200
    html = response.content.decode()
    errors = dict(re.findall(r'<tr class="distlock-error-row" data-alias="([^"]+)">(.*?)</tr>', html, re.S))
    assert "BackendUnavailable" in errors["down"]
    assert "InvalidLockBackendError" in errors["broken"] and "nonexistent" in errors["broken"]
    assert lock_row(html, "locmem", lock_name) is not None, "the other aliases are still listed"


# -- force release ----------------------------------------------------------------------------------


def test_without_the_permission_there_is_no_control_and_a_crafted_post_gets_403(viewer_client, lock_name):
    with distlock.lock(lock_name, ttl=30, using="locmem") as lease:
        html = viewer_client.get(PAGE).content.decode()
        assert "Force release" not in lock_row(html, "locmem", lock_name)
        assert RELEASE not in html
        query = {"alias": "locmem", "name": lock_name, "owner": lease.owner}
        assert viewer_client.get(RELEASE, query).status_code == 403
        assert viewer_client.post(RELEASE, query).status_code == 403
        assert not LogEntry.objects.exists()
        assert lease.extend(), "the lock must still be held by its lease"


def test_force_release_confirms_then_deletes_that_lease_and_logs_it(operator_client, backend_alias, lock_name):
    lease = distlock.acquire(lock_name, ttl=30, using=backend_alias)
    html = operator_client.get(PAGE).content.decode()
    [confirm_url] = re.findall(r'href="([^"]+)">Force release</a>', lock_row(html, backend_alias, lock_name))
    confirm_url = confirm_url.replace("&amp;", "&")
    assert confirm_url.startswith(RELEASE)

    confirmation = operator_client.get(confirm_url)
    assert confirmation.status_code == 200
    page = confirmation.content.decode()
    assert lease.owner in page and str(lease.token) in page and 'id="confirm-force-release"' in page
    assert lease.extend(), "asking for confirmation must not release anything"

    response = operator_client.post(RELEASE, {"alias": backend_alias, "name": lock_name, "owner": lease.owner})
    assert response.status_code == 302 and response["Location"].startswith(PAGE)
    assert not lease.extend(), "the evicted lease must find its lock gone at its next renewal"
    assert lease.lost
    entry = LogEntry.objects.get()
    assert entry.action_flag == DELETION and entry.user.username == "operator"
    assert lock_name in entry.change_message and lease.owner in entry.change_message
    assert entry.content_type.model == "lock"
    next_holder = distlock.acquire(lock_name, ttl=30, blocking=False, using=backend_alias)
    assert next_holder.token > lease.token
    next_holder.release()


def test_force_release_compares_the_owner(operator_client, lock_name):
    first = distlock.acquire(lock_name, ttl=30, using="locmem")
    first.release()
    second = distlock.acquire(lock_name, ttl=30, using="locmem")
    query = {"alias": "locmem", "name": lock_name, "owner": first.owner}  # the page showed the first lease
    response = operator_client.get(RELEASE, query, follow=True)
    assert "no longer held by that owner" in response.content.decode()
    operator_client.post(RELEASE, query)
    assert second.extend(), "the lock acquired again meanwhile must not be touched"
    assert not LogEntry.objects.exists()
    second.release()


# -- metrics on the page -------------------------------------------------------------------------


def test_the_page_flags_thresholds_in_colour(viewer_client):
    prefix = f"hot{uuid.uuid4().hex[:8]}"
    recorder = Recorder()
    acquire_n(recorder, "locmem", f"{prefix}:1", 60)
    acquire_n(recorder, "locmem", f"{prefix}:1", 40, attempts=2)  # 40% contended
    acquire_n(recorder, "locmem", f"{prefix}calm:1", 100)
    recorder.flush()
    html = viewer_client.get(PAGE, {"alias": "locmem"}).content.decode()
    assert flagged(metrics_row(html, "recent", "locmem", prefix)) == {"contention_rate"}
    assert flagged(metrics_row(html, "since-start", "locmem", prefix)) == {"contention_rate"}
    assert flagged(metrics_row(html, "recent", "locmem", f"{prefix}calm")) == set()
    assert 'id="fencing-alarm"' not in html
    assert '<svg id="activity-chart"' in html and "<rect class=\"bar\"" in html


def test_fencing_rejections_are_the_loudest_alert_and_are_listed(viewer_client):
    prefix = f"fenced{uuid.uuid4().hex[:8]}"
    FencingRejection.objects.create(model_label="demo.account", object_pk="42", offered_token=7, current_token=9,
                                    lock_name=f"{prefix}:42", alias="locmem", host="web-1", pid=1234)
    html = viewer_client.get(PAGE).content.decode()
    assert 'id="fencing-alarm"' in html
    row = metrics_row(html, "recent", "locmem", prefix)
    assert 'distlock-alert distlock-alert-fencing" data-figure="fencing_rejections">1<' in row
    listing = re.search(r'<table id="fencing-rejection-list">(.*?)</table>', html, re.S).group(1)
    assert f"{prefix}:42" in listing and "demo.account" in listing and "web-1, pid 1234" in listing


def test_release_url_is_named():
    assert reverse("admin:distlock_lock_force_release") == RELEASE
