"""The "Held locks" admin page and force release, through Django's test client, on every backend."""

import logging
import os
import re
import uuid
from html import unescape
from urllib.parse import parse_qs

import pytest
from django.contrib.admin.models import CHANGE, DELETION, LogEntry
from django.contrib.auth.models import Permission, User
from django.db import connections
from django.test import Client
from django.urls import reverse

import distlock
from distlock.metrics import Recorder
from distlock.models import FencingRejection
from tests.conftest import require_alias
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


#: Aliases whose pages end with the ``SCAN`` call that reached the page size: a page may run over it.
SCAN_PAGED = {"redis", "redis_cache"}


def shown_names(html, alias):
    """Return the names of the locks of ``alias`` on the page, in its order."""
    return re.findall(rf'<tr class="distlock-lock" data-alias="{re.escape(alias)}" data-name="([^"]+)"', html)


def page_link(html, alias, kind):
    """Return the query of the "Next page" or "First page" link of ``alias``, or None."""
    row = re.search(rf'<tr class="distlock-paging" data-alias="{re.escape(alias)}">(.*?)</tr>', html, re.S)
    link = row and re.search(rf'<a class="distlock-{kind}-page" href="{PAGE}\?([^"]+)"', row.group(1))
    return parse_qs(unescape(link.group(1))) if link else None


def error_rows(html):
    """Return the page's error rows: their text by alias."""
    return dict(re.findall(r'<tr class="distlock-error-row" data-alias="([^"]+)">(.*?)</tr>', html, re.S))


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


def test_filter_by_alias_and_search_by_name_prefix(viewer_client):
    tag = uuid.uuid4().hex[:8]
    with distlock.lock(f"alpha:{tag}", using="locmem"), distlock.lock(f"beta:{tag}", using="locmem"):
        html = viewer_client.get(PAGE, {"q": f"alpha:{tag}"}).content.decode()
        assert lock_row(html, "locmem", f"alpha:{tag}") is not None
        assert lock_row(html, "locmem", f"beta:{tag}") is None
        assert "whose name starts with “alpha:" in html and 'placeholder="Lock name starts with…"' in html
        html = viewer_client.get(PAGE, {"alias": "locmem", "q": tag}).content.decode()
        assert lock_row(html, "locmem", f"alpha:{tag}") is None, "a name containing the search is no match"
        html = viewer_client.get(PAGE, {"alias": "locmem", "q": "beta:"}).content.decode()
        assert lock_row(html, "locmem", f"beta:{tag}") is not None
        assert set(re.findall(r'<tr class="distlock-[a-z-]+" data-alias="([^"]+)"', html)) == {"locmem"}


def test_the_search_is_a_name_prefix_on_every_backend(viewer_client, backend_alias, lock_name):
    names = [f"{lock_name}:a", f"{lock_name}:b", f"{lock_name}-other", f"x{lock_name}:c"]
    leases = [distlock.acquire(name, ttl=30, using=backend_alias) for name in names]
    try:
        html = viewer_client.get(PAGE, {"alias": backend_alias, "q": f"{lock_name}:"}).content.decode()
        assert sorted(shown_names(html, backend_alias)) == names[:2], "the names starting with the search, and only those"
        assert "2 locks held whose name starts with" in html
    finally:
        for lease in leases:
            lease.release()


def test_the_locks_of_an_alias_come_page_by_page(operator_client, backend_alias, lock_name, monkeypatch):
    monkeypatch.setattr("distlock.admin.ROWS_PER_ALIAS", 3)
    leases = [distlock.acquire(f"{lock_name}:{index:02}", ttl=60, using=backend_alias) for index in range(20)]
    try:
        query, pages, seen = {"q": f"{lock_name}:"}, [], []
        while query is not None:
            html = operator_client.get(PAGE, query).content.decode()
            for url in re.findall(r'(?:href|action|src)="([^"]*)"', html):
                assert not [lease.owner for lease in leases if lease.owner in unescape(url)], url
            names = shown_names(html, backend_alias)
            assert backend_alias in SCAN_PAGED or len(names) <= 3
            pages.append(names)
            seen += names
            if len(pages) > 1:
                assert page_link(html, backend_alias, "first") == {"alias": [backend_alias], "q": [f"{lock_name}:"]}
            query = page_link(html, backend_alias, "next")
            if query is not None:
                assert query["alias"] == [backend_alias] and query["q"] == [f"{lock_name}:"] and query["cursor"]
                assert "locks shown" in html and "More locks on the next page." in html
        assert len(pages) >= 2, "twenty locks at three a page come in several pages"
        assert sorted(seen) == [lease.name for lease in leases], "every lock once, on one page or another"
        assert page_link(html, backend_alias, "next") is None
    finally:
        for lease in leases:
            lease.release()


def test_a_page_that_shows_everything_counts_every_lock_held(viewer_client, lock_name):
    leases = [distlock.acquire(f"{lock_name}:{index}", using="locmem") for index in range(3)]
    try:
        html = viewer_client.get(PAGE, {"alias": "locmem", "q": f"{lock_name}:"}).content.decode()
        assert "3 locks held whose name starts with" in html
        assert 'class="distlock-paging"' not in html, "one page: no link to another"
    finally:
        for lease in leases:
            lease.release()


def test_a_bad_cursor_is_an_error_on_its_alias_only(viewer_client, monkeypatch, lock_name):
    refused = []

    def refuse(backend, prefix="", *, limit=None, cursor=None):
        refused.append(cursor)
        raise ValueError(f"not a cursor of this backend: {cursor!r}")

    with distlock.lock(lock_name, using="locmem"), distlock.lock(lock_name, using="default"):
        monkeypatch.setattr(type(distlock.locks["default"]), "held_locks", refuse)
        response = viewer_client.get(PAGE, {"alias": "default", "cursor": "forged", "q": "test:"})
        assert response.status_code == 200
        html = response.content.decode()
        errors = error_rows(html)
        assert list(errors) == ["default"] and "not one this backend gave" in errors["default"]
        assert "ValueError" in errors["default"] and refused == ["forged"]
        assert page_link(html, "default", "first") == {"alias": ["default"], "q": ["test:"]}
        monkeypatch.undo()
        html = viewer_client.get(PAGE, {"cursor": "forged"}).content.decode()
        assert "A page of locks belongs to one alias" in html, "a cursor without its alias is dropped"
        assert lock_row(html, "locmem", lock_name) is not None and lock_row(html, "default", lock_name) is not None


def test_a_cursor_redis_cannot_parse_is_an_error_row_not_a_500(viewer_client, lock_name):
    require_alias("redis")
    with distlock.lock(lock_name, using="locmem"):
        for cursor in ("not-a-scan-cursor", "-1", "1" * 30):  # not a number; negative; past SCAN's 64 bits
            response = viewer_client.get(PAGE, {"alias": "redis", "cursor": cursor})
            assert response.status_code == 200
            errors = error_rows(response.content.decode())
            assert list(errors) == ["redis"], cursor
            assert "not one this backend gave" in errors["redis"] and "ValueError" in errors["redis"]


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
    errors = error_rows(html)
    assert "BackendUnavailable" in errors["down"]
    assert "InvalidLockBackendError" in errors["broken"] and "nonexistent" in errors["broken"]
    assert lock_row(html, "locmem", lock_name) is not None, "the other aliases are still listed"


# -- force release ----------------------------------------------------------------------------------


def release_form(html, alias, name):
    """Return the fields of the force-release form in the page's row of lock ``name`` on ``alias``."""
    row = lock_row(html, alias, name)
    assert row is not None, f"no row for {name!r} on {alias!r}"
    form = re.search(r'<form method="post" action="([^"]+)" class="distlock-release-form">(.*?)</form>', row, re.S)
    assert form is not None, "the row has no force-release form"
    assert form.group(1) == RELEASE
    fields = dict(re.findall(r'<input type="hidden" name="([a-z]+)" value="([^"]*)"', form.group(2)))
    assert fields.pop("csrfmiddlewaretoken"), "the form carries a CSRF token"
    return fields


def test_without_the_permission_there_is_no_control_and_a_crafted_post_gets_403(viewer_client, lock_name):
    with distlock.lock(lock_name, ttl=30, using="locmem") as lease:
        html = viewer_client.get(PAGE).content.decode()
        assert "Force release" not in lock_row(html, "locmem", lock_name)
        assert RELEASE not in html
        query = {"alias": "locmem", "name": lock_name, "owner": lease.owner}
        assert viewer_client.get(RELEASE, query).status_code == 403
        assert viewer_client.post(RELEASE, query).status_code == 403
        assert viewer_client.post(RELEASE, {**query, "confirm": "yes"}).status_code == 403
        assert not LogEntry.objects.exists()
        assert lease.extend(), "the lock must still be held by its lease"


def test_view_only_staff_see_no_owner_ids(viewer_client, lock_name):
    # Whoever knows an owner id can release that lease (release_owned), so it is a capability.
    with distlock.lock(lock_name, ttl=30, using="locmem") as lease, \
            distlock.lock(lock_name, ttl=30, using="default") as database_lease:
        html = viewer_client.get(PAGE).content.decode()
        assert lock_row(html, "locmem", lock_name) is not None
        assert lock_row(html, "default", lock_name) is not None
        assert lease.owner not in html and database_lease.owner not in html
        assert lease.owner[:10] not in html, "not even a truncated owner id"
        assert ">Owner<" not in html


def test_release_controls_post_and_no_url_carries_an_owner_id(operator_client, lock_name):
    with distlock.lock(lock_name, ttl=30, using="locmem") as lease:
        html = operator_client.get(PAGE).content.decode()
        assert lock_row(html, "locmem", lock_name) is not None
        for url in re.findall(r'(?:href|action|src)="([^"]*)"', html):
            assert lease.owner not in url, f"an owner id in the URL {url!r}"
        assert release_form(html, "locmem", lock_name) == {"alias": "locmem", "name": lock_name, "owner": lease.owner}
        query = {"alias": "locmem", "name": lock_name, "owner": lease.owner, "confirm": "yes"}
        response = operator_client.get(RELEASE, query)
        assert response.status_code == 405 and response["Allow"] == "POST"
        assert lease.extend(), "a GET must release nothing, whatever its query string"
        assert not LogEntry.objects.exists()


def test_the_release_forms_are_csrf_protected(lock_name):
    client = Client(enforce_csrf_checks=True)
    client.force_login(make_user("operator", perms=["view_lock", "force_release_lock"]))
    with distlock.lock(lock_name, ttl=30, using="locmem") as lease:
        fields = {"alias": "locmem", "name": lock_name, "owner": lease.owner}
        assert client.post(RELEASE, {**fields, "confirm": "yes"}).status_code == 403
        assert lease.extend() and not LogEntry.objects.exists()
        html = client.get(PAGE).content.decode()
        token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', lock_row(html, "locmem", lock_name)).group(1)
        confirmation = client.post(RELEASE, {**fields, "csrfmiddlewaretoken": token})
        assert confirmation.status_code == 200 and 'id="confirm-force-release"' in confirmation.content.decode()
        assert lease.extend()


def test_force_release_confirms_then_deletes_that_lease_and_logs_it(operator_client, backend_alias, lock_name, caplog):
    lease = distlock.acquire(lock_name, ttl=30, using=backend_alias)
    html = operator_client.get(PAGE).content.decode()
    fields = release_form(html, backend_alias, lock_name)
    assert fields == {"alias": backend_alias, "name": lock_name, "owner": lease.owner}

    confirmation = operator_client.post(RELEASE, fields)
    assert confirmation.status_code == 200
    page = confirmation.content.decode()
    assert lease.owner in page and str(lease.token) in page and 'id="confirm-force-release"' in page
    assert re.search(r'<form method="post" action="[^"]*">', page)
    assert '<input type="hidden" name="confirm" value="yes">' in page
    assert lease.extend(), "asking for confirmation must not release anything"
    assert not LogEntry.objects.exists()

    with caplog.at_level(logging.WARNING, logger="distlock.audit"):
        response = operator_client.post(RELEASE, {**fields, "confirm": "yes"})
    assert response.status_code == 302 and response["Location"].startswith(PAGE)
    assert not lease.extend(), "the evicted lease must find its lock gone at its next renewal"
    assert lease.lost
    entry = LogEntry.objects.get()
    assert entry.action_flag == DELETION and entry.user.username == "operator"
    assert lock_name in entry.change_message and lease.owner in entry.change_message
    assert "released" in entry.change_message and "nothing released" not in entry.change_message
    assert entry.content_type.model == "lock"
    [record] = [r for r in caplog.records if r.name == "distlock.audit"]
    assert record.outcome == "released" and record.actor == "admin user 'operator'" and record.lock_name == lock_name
    next_holder = distlock.acquire(lock_name, ttl=30, blocking=False, using=backend_alias)
    assert next_holder.token > lease.token
    next_holder.release()


def test_force_release_under_atomic_requests(operator_client, monkeypatch, lock_name):
    # ATOMIC_REQUESTS wraps each view in a transaction; on SQLite the database backend then refuses to
    # write (its statement would wait for the request's own transaction), so the release must run outside it.
    monkeypatch.setitem(connections["default"].settings_dict, "ATOMIC_REQUESTS", True)
    lease = distlock.acquire(lock_name, ttl=30, using="default")
    fields = {"alias": "default", "name": lock_name, "owner": lease.owner}
    response = operator_client.post(RELEASE, {**fields, "confirm": "yes"}, follow=True)
    assert f"Released lock {lock_name!r}" in unescape(response.content.decode())
    assert not lease.extend(), "the lock must be gone"
    assert LogEntry.objects.get().action_flag == DELETION
    page = operator_client.get(PAGE)
    assert page.status_code == 200 and lock_row(page.content.decode(), "default", lock_name) is None


def test_a_force_release_that_finds_another_owner_is_logged_and_touches_nothing(operator_client, lock_name, caplog):
    first = distlock.acquire(lock_name, ttl=30, using="locmem")
    first.release()
    second = distlock.acquire(lock_name, ttl=30, using="locmem")
    fields = {"alias": "locmem", "name": lock_name, "owner": first.owner}  # the page showed the first lease
    response = operator_client.post(RELEASE, fields, follow=True)
    assert "no longer held by that owner" in response.content.decode()
    assert not LogEntry.objects.exists(), "asking for confirmation is not an attempt"
    with caplog.at_level(logging.WARNING, logger="distlock.audit"):
        response = operator_client.post(RELEASE, {**fields, "confirm": "yes"}, follow=True)
    assert "Nothing released" in response.content.decode()
    assert second.extend(), "the lock acquired again meanwhile must not be touched"
    entry = LogEntry.objects.get()
    assert entry.action_flag == CHANGE and entry.user.username == "operator"
    assert "nothing released" in entry.change_message and first.owner in entry.change_message
    assert "held by another owner" in entry.change_message
    [record] = [r for r in caplog.records if r.name == "distlock.audit"]
    assert record.outcome == "owner_changed"
    second.release()


def test_a_force_release_of_a_lock_gone_or_unreadable_is_logged(operator_client, settings, lock_name):
    lease = distlock.acquire(lock_name, ttl=30, using="locmem")
    lease.release()
    operator_client.post(RELEASE, {"alias": "locmem", "name": lock_name, "owner": lease.owner, "confirm": "yes"})
    entry = LogEntry.objects.get()
    assert entry.action_flag == CHANGE and "nothing released" in entry.change_message
    assert "not held" in entry.change_message
    settings.DISTLOCK = {**settings.DISTLOCK, "down": {
        "BACKEND": "distlock.backends.redis.RedisBackend",
        "OPTIONS": {"URL": f"redis://127.0.0.1:{free_port()}/0", "SOCKET_CONNECT_TIMEOUT": 2}}}
    response = operator_client.post(RELEASE, {"alias": "down", "name": lock_name, "owner": lease.owner,
                                              "confirm": "yes"}, follow=True)
    assert "Could not" in response.content.decode()
    failed = LogEntry.objects.latest("pk")
    assert failed.pk != entry.pk and failed.action_flag == CHANGE
    assert "nothing released" in failed.change_message and "BackendUnavailable" in failed.change_message


def test_no_password_of_a_backend_url_shows_in_a_release_attempt(operator_client, settings, lock_name, caplog):
    secret = f"pw-{uuid.uuid4().hex}"
    settings.DISTLOCK = {**settings.DISTLOCK, "down": {
        "BACKEND": "distlock.backends.redis.RedisBackend",
        "OPTIONS": {"URL": f"redis://ops:{secret}@127.0.0.1:{free_port()}/0", "SOCKET_CONNECT_TIMEOUT": 2}}}
    fields = {"alias": "down", "name": lock_name, "owner": "0" * 32}
    with caplog.at_level(logging.DEBUG):
        pages = [operator_client.post(RELEASE, fields, follow=True),
                 operator_client.post(RELEASE, {**fields, "confirm": "yes"}, follow=True),
                 operator_client.get(PAGE)]
    for page in pages:
        assert page.status_code == 200 and secret not in page.content.decode()
    assert "Could not read" in unescape(pages[0].content.decode())
    entry = LogEntry.objects.get()
    assert "could not be read" in entry.change_message and secret not in entry.change_message
    assert "127.0.0.1" in entry.change_message, "the address stays, only the user-info goes"
    assert caplog.records and not [record for record in caplog.records if secret in record.getMessage()]


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
