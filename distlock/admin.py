"""Admin: the "Held locks" page (live from every backend, with cluster-wide metrics) and force release.

The page is the changelist of the ``Lock`` model, so the admin index links it under the app with the
model's plural name, "Held locks", for users with ``distlock.view_lock``. Its rows are read from
each alias's server, not from the model's table. Force release needs ``distlock.force_release_lock``,
and so does seeing owner ids: whoever knows one can release that lease, so it is a capability. Owner
ids therefore travel only in POST bodies, never in URLs.
"""

import functools
from datetime import UTC, datetime
from urllib.parse import urlencode

from django.contrib import admin, messages
from django.core.exceptions import PermissionDenied
from django.db import DatabaseError, connections, transaction
from django.http import HttpResponseNotAllowed
from django.shortcuts import redirect
from django.template.response import TemplateResponse
from django.urls import path, reverse
from django.utils.translation import gettext as _
from django.utils.translation import gettext_lazy

from distlock import audit, inventory
from distlock.conf import get_config
from distlock.metrics import conf as metrics_conf
from distlock.metrics import report
from distlock.models import FencingRejection, Lock
from distlock.redaction import redact

__all__ = [
    "CHART_MINUTES",
    "FORCE_RELEASE_PERMISSION",
    "FencingRejectionAdmin",
    "HeldLocksAdmin",
    "METRIC_COLUMNS",
    "RECENT_REJECTIONS",
    "ROWS_PER_ALIAS",
    "ReadOnlyAdmin",
]

#: The permission the force-release control and its views require.
FORCE_RELEASE_PERMISSION = "distlock.force_release_lock"
#: Fencing rejections listed on the page.
RECENT_REJECTIONS = 20
#: Minutes in the acquisitions/contention chart.
CHART_MINUTES = 60
#: Locks asked of each alias per page; a "Next page" link follows when it holds more. A Redis page may
#: hold a few more (as its last ``SCAN`` brought), a ZooKeeper page each reader of a read lock.
ROWS_PER_ALIAS = 500


def _outside_request_transactions(view):
    """Return ``view`` exempted from ``ATOMIC_REQUESTS`` on every database (``transaction.non_atomic_requests``).

    These views talk to lock servers, not only to the database: a request transaction would hold, on
    SQLite, the one write slot the database backend needs (its force release would refuse to wait for
    its own caller), and elsewhere keep a transaction open across network round trips. Their writes are
    single statements (the compare-and-delete, one ``LogEntry``), each committed on its own.
    """

    @functools.wraps(view)
    def wrapper(request, *args, **kwargs):
        return view(request, *args, **kwargs)

    for alias in connections:
        wrapper = transaction.non_atomic_requests(using=alias)(wrapper)
    return wrapper


def _seconds(value):
    if value is None:
        return "—"
    return f"{value * 1000:.3g} ms" if value < 1 else f"{value:.3g} s"


def _fraction(value):
    return "—" if value is None else f"{value * 100:.3g}%"


def _rejections(figures):
    count, rate = figures.fencing_rejections, figures.fencing_rejection_rate
    return f"{count} ({_fraction(rate)} of acquired)" if count and rate is not None else str(count)


#: The metrics table: (figure, header, text of a ``Figures``). A figure named in ``Figures.alerts`` is flagged.
METRIC_COLUMNS = [
    ("attempts", gettext_lazy("Attempts"), lambda f: str(f.attempts)),
    ("acquire_p50", gettext_lazy("Acquire p50"), lambda f: _seconds(f.acquire_p50)),
    ("acquire_p99", gettext_lazy("Acquire p99"), lambda f: _seconds(f.acquire_p99)),
    ("acquire_p99_of_ttl", gettext_lazy("Acquire p99 of TTL"), lambda f: _fraction(f.acquire_p99_of_ttl)),
    ("contention_rate", gettext_lazy("Contention"), lambda f: _fraction(f.contention_rate)),
    ("timeout_rate", gettext_lazy("Timeouts"), lambda f: _fraction(f.timeout_rate)),
    ("hold_p99", gettext_lazy("Hold p99"), lambda f: _seconds(f.hold_p99)),
    ("hold_p99_of_ttl", gettext_lazy("Hold p99 of TTL"), lambda f: _fraction(f.hold_p99_of_ttl)),
    ("lost", gettext_lazy("Lost"), lambda f: str(f.counts["lost"])),
    ("fencing_rejections", gettext_lazy("Fencing rejections"), _rejections),
]


def _metric_rows(figures_list):
    """Return the metrics table rows: a label and formatted cells, each flagged if past its threshold."""
    rows = []
    for figures in figures_list:
        alerts = figures.alerts
        rows.append({
            "alias": figures.alias,
            "prefix": figures.prefix,
            "cells": [{"figure": figure, "text": text(figures), "alert": figure in alerts}
                      for figure, _header, text in METRIC_COLUMNS],
            "task_conflicts": ", ".join(f"{outcome} {count}" for outcome, count in figures.task_conflicts.items()),
        })
    return rows


def _chart(points, *, width=720, height=140):
    """Return the geometry of an SVG chart: one bar of attempts per minute, a line of contention %."""
    most = max((attempts for _start, attempts, _contended in points), default=0) or 1
    step = width / max(len(points), 1)
    bars, line = [], []
    for index, (start, attempts, contended) in enumerate(points):
        bar_height = height * attempts / most
        minute = datetime.fromtimestamp(start, UTC).strftime("%H:%M")
        rate = contended / attempts if attempts else 0.0
        bars.append({"x": round(index * step + 1, 1), "y": round(height - bar_height, 1),
                     "width": round(max(step - 2, 1), 1), "height": round(bar_height, 1),
                     "title": f"{minute} UTC: {attempts} attempts, {rate:.0%} contended"})
        line.append(f"{index * step + step / 2:.1f},{height - height * rate:.1f}")
    minutes = [datetime.fromtimestamp(start, UTC).strftime("%H:%M") for start, _a, _c in points[:1] + points[-1:]]
    return {"width": width, "height": height, "bars": bars, "line": " ".join(line), "most": most,
            "first_minute": minutes[0] if minutes else "", "last_minute": minutes[-1] if minutes else "",
            "threshold_y": round(height * (1 - report.CONTENTION_RATE), 1)}


class ReadOnlyAdmin(admin.ModelAdmin):
    """Nobody adds, edits or deletes these rows through the admin: operators act on locks, not on records."""

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False


@admin.register(Lock)
class HeldLocksAdmin(ReadOnlyAdmin):
    """The "Held locks" page; the model is only its anchor in the admin index and for permissions."""

    change_list_template = "admin/distlock/held_locks.html"
    force_release_template = "admin/distlock/force_release_confirmation.html"

    def get_urls(self):
        # Only the page and the release view: the model's own add/change/delete views would show the
        # database backend's table alone, which is not what operators need. admin_view() copies the
        # non-atomic marks onto its wrapper (functools.wraps), which is what the request handler reads.
        def view(method):
            return self.admin_site.admin_view(_outside_request_transactions(method))

        info = self.opts.app_label, self.opts.model_name
        return [
            path("", view(self.changelist_view), name="%s_%s_changelist" % info),
            path("release/", view(self.force_release_view), name="%s_%s_force_release" % info),
        ]

    def _release_url(self):
        return reverse(f"admin:{self.opts.app_label}_{self.opts.model_name}_force_release")

    def _changelist_url(self, alias=None, search="", cursor=None):
        # A cursor is a backend's page position (a lock name, a SCAN cursor), never an owner id.
        url = reverse(f"admin:{self.opts.app_label}_{self.opts.model_name}_changelist")
        query = urlencode({key: value for key, value in (("alias", alias), ("q", search), ("cursor", cursor))
                           if value})
        return f"{url}?{query}" if query else url

    def changelist_view(self, request, extra_context=None):
        if not self.has_view_permission(request):
            raise PermissionDenied
        alias = request.GET.get("alias") or None
        if alias is not None and alias not in get_config():
            messages.error(request, _("There is no alias %(alias)r in settings.DISTLOCK.") % {"alias": alias})
            alias = None
        # The search is a name prefix, so each backend filters on its server (the prefix of its keys).
        search = request.GET.get("q", "").strip()
        cursor = request.GET.get("cursor") or None
        if cursor is not None and alias is None:
            messages.error(request, _("A page of locks belongs to one alias; showing the first page of each."))
            cursor = None
        # Owner ids are capabilities: only users who may force-release see them (in POST forms, never URLs).
        can_release = request.user.has_perm(FORCE_RELEASE_PERMISSION)
        now = datetime.now(UTC)
        groups = []
        for entry in inventory.held_locks(alias, prefix=search, limit=ROWS_PER_ALIAS, cursor=cursor):
            rows = []
            for info in entry.locks:
                remaining = (info.expires_at - now).total_seconds() if info.expires_at else None
                rows.append({"info": info, "remaining": remaining})
            groups.append({
                "entry": entry,
                "rows": rows,
                "next_url": self._changelist_url(entry.alias, search, entry.cursor) if entry.cursor else None,
                "first_url": self._changelist_url(entry.alias, search) if cursor else None,
            })
        context = {
            **self.admin_site.each_context(request),
            "opts": self.opts,
            "title": _("Held locks"),
            "aliases": [{"name": name, "url": self._changelist_url(name, search), "selected": name == alias}
                        for name in get_config()],
            "all_aliases_url": self._changelist_url(None, search),
            "alias": alias,
            "search": search,
            "groups": groups,
            "cursor": cursor,
            "shown_count": sum(len(group["rows"]) for group in groups),
            # Every lock held is shown only on first pages that no next page follows.
            "complete": cursor is None and not any(group["next_url"] for group in groups),
            "can_force_release": can_release,
            "release_url": self._release_url() if can_release else None,
            # Cells after the alias in a full-width row: name, token, acquired, expires, remaining, holder,
            # plus owner and the release control for users who may release.
            "row_span": 8 if can_release else 6,
            "metric_headers": [header for _figure, header, _formatter in METRIC_COLUMNS],
            "thresholds": {"acquire": _fraction(report.ACQUIRE_P99_OF_TTL),
                           "contention": _fraction(report.CONTENTION_RATE),
                           "hold": _fraction(report.HOLD_P99_OF_TTL), "timeout": _fraction(report.TIMEOUT_RATE)},
            **self._metrics_context(alias),
            **(extra_context or {}),
        }
        return TemplateResponse(request, self.change_list_template, context)

    def _metrics_context(self, alias):
        settings = metrics_conf.get()
        try:
            recent = report.summarize(settings.recent_window, alias=alias)
            since_start = report.summarize(None, alias=alias)
            points = report.timeline(CHART_MINUTES, alias=alias)
            rejections = FencingRejection.objects.all()
            if alias is not None:
                rejections = rejections.filter(alias=alias)
            rejections = list(rejections[:RECENT_REJECTIONS])
        except DatabaseError as exc:
            return {"metrics_error": redact(f"{type(exc).__name__}: {exc}")}
        recent_rejections = sum(row.fencing_rejections for row in recent.rows if not row.prefix)
        return {
            "windows": [
                {"title": _("Last %(minutes)d minutes") % {"minutes": settings.recent_window // 60},
                 "rows": _metric_rows(recent.rows)},
                {"title": _("Since start"), "rows": _metric_rows(since_start.rows)},
            ],
            "recent_fencing_rejections": recent_rejections,
            "chart": _chart(points),
            "rejections": rejections,
        }

    def force_release_view(self, request):
        """Confirm, then perform, the release of one exact lease: alias, name and owner, all POSTed.

        The page's button posts the lease it showed and gets the confirmation page; that page posts the
        same fields with ``confirm``, which releases. GET is refused, so no link, bookmark or prefetch
        (nor any URL carrying an owner id) can release or reveal anything.
        """
        if not (self.has_view_permission(request) and request.user.has_perm(FORCE_RELEASE_PERMISSION)):
            raise PermissionDenied
        if request.method != "POST":
            return HttpResponseNotAllowed(["POST"])
        alias, name, owner = (request.POST.get(key, "") for key in ("alias", "name", "owner"))
        back = self._changelist_url(alias if alias in get_config() else None)
        if alias not in get_config() or not name or not owner:
            messages.error(request, _("Force release needs the alias, name and owner of a held lock."))
            return redirect(back)
        if request.POST.get("confirm") == "yes":
            # Audited whatever happens (distlock.audit): the logger and this user's LogEntry.
            return self._force_release(request, alias, name, owner, back)
        try:
            current = inventory.find(alias, name)
        except Exception as exc:  # noqa: BLE001 - shown to the operator, like an error row on the page
            messages.error(request, _("Could not read lock %(name)r on alias '%(alias)s': %(error)s")
                           % {"name": name, "alias": alias, "error": redact(f"{type(exc).__name__}: {exc}")})
            return redirect(back)
        if current is None or current.owner != owner:
            messages.warning(request, _("Nothing released: lock %(name)r on alias '%(alias)s' is no longer held by "
                                        "that owner (released, expired, or acquired again meanwhile).")
                             % {"name": name, "alias": alias})
            return redirect(back)
        context = {
            **self.admin_site.each_context(request),
            "opts": self.opts,
            "title": _("Force release a lock"),
            "lock": current,
            "release_url": self._release_url(),
            "back_url": back,
        }
        return TemplateResponse(request, self.force_release_template, context)

    def _force_release(self, request, alias, name, owner, back):
        attempt = audit.force_release(alias, name, owner, actor=f"admin user {request.user.get_username()!r}",
                                      user=request.user)
        values = {"name": name, "alias": alias, "error": attempt.error}
        if attempt.released:
            messages.success(request, _("Released lock %(name)r on alias '%(alias)s' (token %(token)s). Its holder "
                                        "finds out at its next renewal or when its lease runs out.")
                             % {**values, "token": attempt.info.token})
        elif attempt.outcome == audit.READ_ERROR:
            messages.error(request, _("Could not read lock %(name)r on alias '%(alias)s'; nothing released: "
                                      "%(error)s") % values)
        elif attempt.outcome == audit.ERROR:
            messages.error(request, _("Could not release lock %(name)r on alias '%(alias)s'; it may or may not "
                                      "have been released (reload the page): %(error)s") % values)
        else:
            messages.warning(request, _("Nothing released: lock %(name)r on alias '%(alias)s' is no longer held by "
                                        "that owner (released, expired, or acquired again meanwhile).") % values)
        return redirect(back)


@admin.register(FencingRejection)
class FencingRejectionAdmin(ReadOnlyAdmin):
    """The log of refused fenced writes, read-only: it is evidence."""

    list_display = ("created_at", "model_label", "object_pk", "offered_token", "current_token", "lock_name",
                    "alias", "host", "pid")
    list_filter = ("alias", "model_label")
    search_fields = ("lock_name", "object_pk")
    date_hierarchy = "created_at"

