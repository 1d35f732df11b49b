"""``manage.py distlock list|release|check|stats|verify``: held locks, force release, health probe, metrics,
conformance run."""

import argparse
import getpass
import json
import socket
import uuid

from django.apps import apps
from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError
from django.db import DEFAULT_DB_ALIAS, DatabaseError, connections, router
from django.db.models import Max

from distlock import audit, inventory
from distlock.backends.options import EPOCH_SHIFT
from distlock.backends.database import DatabaseBackend
from distlock.conf import DEFAULT_ALIAS, get_config
from distlock.conformance.report import markdown_table
from distlock.conformance.verify import NotVerifiable, verify
from distlock.exceptions import LockError
from distlock.fencing import TOKEN_FIELD, FencedModel
from distlock.handler import locks
from distlock.metrics import conf as metrics_conf
from distlock.metrics import report
from distlock.redaction import redact

__all__ = ["Command", "DATABASE_BACKEND_SCHEMA", "SCHEMA_LOOKUPS"]

#: What the database backend's statements use, per vendor, and the distlock migration that creates each:
#: (kind, name, migration). ``distlock check`` looks them up, since ``SELECT 1`` succeeds on a database
#: that was never migrated, and the migration records cannot tell (an SQL-only deploy has none).
DATABASE_BACKEND_SCHEMA = {
    "postgresql": (("table", "distlock_lock", "0001_initial"),
                   ("sequence", "distlock_token_seq", "0002_token_sequence"),
                   ("table", "distlock_lockwaiter", "0004_lockwaiter")),
    "sqlite": (("table", "distlock_lock", "0001_initial"),
               ("table", "distlock_tokensequence", "0001_initial"),
               ("table", "distlock_lockwaiter", "0004_lockwaiter")),
}

#: Catalog lookups that return the kind of the object with that name as the backend's statements resolve
#: it (PostgreSQL: through the search_path), or no row.
SCHEMA_LOOKUPS = {
    "postgresql": "SELECT CASE WHEN relkind IN ('r', 'p') THEN 'table' WHEN relkind = 'S' THEN 'sequence' END "
                  "FROM pg_class WHERE oid = to_regclass(%s)",
    "sqlite": "SELECT type FROM sqlite_master WHERE name = %s",
}


def _missing_schema(backend):
    """Return the ``(kind, name, migration)`` of each object the database ``backend`` needs and lacks."""
    with connections[backend.database].cursor() as cursor:
        missing = []
        for kind, name, migration in DATABASE_BACKEND_SCHEMA[backend.vendor]:
            cursor.execute(SCHEMA_LOOKUPS[backend.vendor], [name])
            row = cursor.fetchone()
            if row is None or row[0] != kind:
                missing.append((kind, name, migration))
        return missing


def _schema_error(alias):
    """Return why the database backend of ``alias`` cannot work on its database's schema, or ""."""
    backend = locks[alias]
    if not isinstance(backend, DatabaseBackend):
        return ""
    where = f"DATABASES['{backend.database}'] ({backend.vendor})"
    try:
        missing = _missing_schema(backend)
    except DatabaseError as exc:
        return redact(f"could not read the schema of {where}: {exc}")
    if not missing:
        return ""
    objects = ", ".join(f"{kind} {name} (migration distlock.{migration})" for kind, name, migration in missing)
    return (f"{where} lacks what the database backend needs: {objects}. Run `manage.py migrate distlock "
            f"--database {backend.database}`, or apply the output of `manage.py sqlmigrate distlock "
            f"<migration> --database {backend.database}` for each migration named.")


def _fenced_tables():
    """Yield ``(label, database, highest token)`` for each fenced model's table holding tokens above 0."""
    for model in apps.get_models():
        if issubclass(model, FencedModel) and model._meta.managed and not model._meta.proxy:
            database = router.db_for_read(model)
            highest = model._base_manager.using(database).aggregate(highest=Max(TOKEN_FIELD))["highest"]
            if highest:
                yield model._meta.label, database, highest


def _token_warnings(alias, tables):
    """Return why fenced rows would refuse every write under ``alias``'s locks: they store tokens above its own.

    Tokens compare only among one backend's: an alias pointed at another backend, or at a server
    started afresh, restarts below what the rows store (``TOKEN_EPOCH`` is the fix). One probe lock
    shows where the alias's tokens stand.
    """
    backend = locks[alias]
    if not backend.token_is_safe or not tables:
        return []
    lease = backend.acquire(f"distlock-check:{uuid.uuid4().hex}", ttl=10, timeout=10, blocking=True)
    lease.release()
    needed = max(backend.settings["TOKEN_EPOCH"] + 1, (max(highest for *_, highest in tables) >> EPOCH_SHIFT) + 1)
    return [
        f"{label} rows (DATABASES['{database}']) store fencing tokens up to {highest}, above the token alias "
        f"'{alias}' issues now ({lease.token}): if they are written under '{alias}' locks, every write is refused "
        f"as stale. If the alias was pointed at another backend or a server started afresh, set "
        f"DISTLOCK['{alias}']['OPTIONS']['TOKEN_EPOCH'] to {needed} so that its tokens start above every earlier one."
        for label, database, highest in tables if highest > lease.token
    ]


def _listed(info):
    """The JSON object ``distlock list`` prints for one lock."""
    return {"alias": info.alias, "name": info.name, "owner": info.owner, "token": info.token,
            "acquired_at": _iso(info.acquired_at), "expires_at": _iso(info.expires_at), "host": info.host,
            "pid": info.pid}


def _positive_int(text):
    """argparse type of ``--limit``."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not at least 1")
    return value


def _iso(moment):
    return None if moment is None else moment.isoformat()


def _percent(value):
    return "—" if value is None else f"{value * 100:.3g}%"


def _seconds(value):
    return "—" if value is None else f"{value * 1000:.3g}ms" if value < 1 else f"{value:.3g}s"


class Command(BaseCommand):
    help = ("Operate distributed locks: list held locks, force-release one, check backends, show metrics, "
            "verify a backend.")

    def add_arguments(self, parser):
        commands = parser.add_subparsers(dest="subcommand", required=True, metavar="{list,release,check,stats,verify}")

        listing = commands.add_parser("list", help="List the locks held on every alias (or one).")
        listing.add_argument("--using", help="only this DISTLOCK alias")
        listing.add_argument("--prefix", default="", help="only the locks whose name starts with this")
        listing.add_argument("--limit", type=_positive_int, help="at most this many locks per alias")
        output = listing.add_mutually_exclusive_group()
        output.add_argument("--json", action="store_true", dest="as_json", help="print a JSON list of objects")
        output.add_argument("--json-lines", action="store_true",
                            help="print one JSON object per line, as the pages come (for scripts)")

        release = commands.add_parser(
            "release", help="Delete a lock another process holds; its holder finds out at its next renewal.")
        release.add_argument("name", help="the lock name")
        release.add_argument("--using", default=DEFAULT_ALIAS, help="the DISTLOCK alias (default: 'default')")
        release.add_argument("--owner", help="release only if this owner (from `list`) still holds it")
        release.add_argument("--force", action="store_true", help="required: confirms you mean it")
        release.add_argument("--user", dest="username",
                             help="also record the attempt in the admin's history (a LogEntry) as this user; "
                                  "every attempt is logged to the 'distlock.audit' logger either way")

        check = commands.add_parser(
            "check", help="Make one round trip to every backend and, for database backends, look up the tables "
                          "(and sequence) they need; exit non-zero if any fails (a health probe). Warns when "
                          "fenced rows store tokens above those an alias issues (see TOKEN_EPOCH).")
        check.add_argument("--using", help="only this DISTLOCK alias")

        stats = commands.add_parser("stats", help="Show the lock metrics of every process, with alerts.")
        stats.add_argument("--using", help="only this DISTLOCK alias")
        stats.add_argument("--window", type=float, help="seconds of the recent window "
                                                        "(default: DISTLOCK_METRICS['RECENT_WINDOW'])")
        stats.add_argument("--json", action="store_true", dest="as_json", help="print JSON")

        verify_ = commands.add_parser(
            "verify", help="Run client processes against one alias (contention, a paused and a killed holder, "
                           "bad input), check their history, print a table; exit non-zero on a violation.")
        verify_.add_argument("--using", default=DEFAULT_ALIAS, help="the DISTLOCK alias (default: 'default')")
        verify_.add_argument("--database", default=DEFAULT_DB_ALIAS,
                             help="the database for the fenced test table, created and dropped (default: 'default')")
        verify_.add_argument("--clients", type=int, default=8, help="contending processes (default: 8)")
        verify_.add_argument("--iterations", type=int, default=25, help="acquisitions per process (default: 25)")
        verify_.add_argument("--runs", type=int, default=1, help="runs of the pause and crash scenarios (default: 1)")
        verify_.add_argument("--ttl", type=float, default=2.0, help="ttl of the paused and killed holders (default: 2)")

    def handle(self, *args, subcommand, **options):
        using = options.get("using")
        if using is not None and using not in get_config():
            raise CommandError(f"There is no alias {using!r} in settings.DISTLOCK "
                               f"(configured: {', '.join(map(repr, get_config()))}).")
        getattr(self, f"handle_{subcommand}")(**options)

    # -- list --------------------------------------------------------------------------------

    def handle_list(self, *, using, as_json, json_lines, prefix, limit, **options):
        """Print the held locks page by page, as they are read: one page in memory at a time (but for ``--json``)."""
        listed, errors, shown = [], [], 0
        for alias in inventory.aliases(using):
            try:
                for info in inventory.each_held(alias, prefix=prefix, limit=limit):
                    shown += 1
                    if as_json:
                        listed.append(_listed(info))
                    elif json_lines:
                        self.stdout.write(json.dumps(_listed(info)))
                    else:
                        holder = f"{info.host or '?'}:{info.pid if info.pid is not None else '?'}"
                        self.stdout.write(f"{info.alias}\t{info.name}\ttoken={info.token}\towner={info.owner}\t"
                                          f"acquired={_iso(info.acquired_at)}\texpires={_iso(info.expires_at)}\t{holder}")
            except Exception as exc:  # noqa: BLE001 - reported per alias: one broken alias hides no other
                errors.append((alias, inventory.describe_failure(exc)))
        if as_json:
            self.stdout.write(json.dumps(listed, indent=2))
        elif not json_lines and not shown:
            self.stdout.write("No lock held.")
        self._fail_on_errors(errors)

    def _fail_on_errors(self, errors):
        for alias, error in errors:
            self.stderr.write(f"{alias}: {error}")
        if errors:
            raise CommandError(f"{len(errors)} alias(es) could not be read: {', '.join(a for a, _ in errors)}.")

    # -- release -------------------------------------------------------------------------------

    def handle_release(self, *, name, using, owner, force, username, **options):
        if not force:
            raise CommandError(
                f"Refusing to release lock {name!r} on alias '{using}' without --force: its holder keeps "
                "running and learns of it only at its next renewal or expiry. Check it with "
                "`distlock list`, then repeat with --force."
            )
        user = self._audit_user(username) if username is not None else None
        actor = f"manage.py distlock release as user {username!r}" if user is not None else (
            f"manage.py distlock release by {self._os_user()} on {socket.gethostname()}")
        # Audited whatever happens: the 'distlock.audit' logger, and a LogEntry with --user.
        attempt = audit.force_release(using, name, owner, actor=actor, user=user)
        if attempt.outcome == audit.NOT_HELD:
            raise CommandError(f"Lock {name!r} is not held on alias '{using}'; nothing released.")
        if attempt.outcome == audit.OWNER_CHANGED and owner is not None and attempt.info.owner != owner:
            raise CommandError(f"Lock {name!r} on alias '{using}' is now held by owner {attempt.info.owner}, "
                               f"not {owner}; nothing released.")
        if attempt.outcome == audit.OWNER_CHANGED:
            raise CommandError(f"Lock {name!r} on alias '{using}' changed hands while releasing; nothing released.")
        if attempt.outcome == audit.READ_ERROR:
            raise CommandError(f"Could not read lock {name!r} on alias '{using}'; nothing released: {attempt.error}")
        if attempt.outcome == audit.ERROR:
            raise CommandError(f"Could not release lock {name!r} on alias '{using}'; it may or may not have been "
                               f"released (check with `distlock list`): {attempt.error}")
        current = attempt.info
        self.stdout.write(f"Released lock {name!r} on alias '{using}': owner {current.owner}, token "
                          f"{current.token}, host {current.host or '?'}, pid {current.pid}.")

    def _audit_user(self, username):
        """Return the user ``--user`` names, checked before anything is released."""
        if not apps.is_installed("django.contrib.admin"):
            raise CommandError("--user records the attempt as an admin LogEntry, which needs django.contrib.admin "
                               "in INSTALLED_APPS; without it, the 'distlock.audit' logger records every attempt.")
        model = get_user_model()
        try:
            return model._default_manager.get_by_natural_key(username)
        except model.DoesNotExist:
            raise CommandError(f"There is no user {username!r}; nothing released.") from None

    @staticmethod
    def _os_user():
        try:
            return getpass.getuser()
        except (KeyError, OSError):  # no login name and no passwd entry (some containers)
            return "an unknown OS user"

    # -- check ---------------------------------------------------------------------------------

    def handle_check(self, *, using, **options):
        results = inventory.ping_all(using)
        tables = None
        for result in results:
            if not result.error:
                # Reachable is not enough: an unmigrated database answers SELECT 1 and refuses every lock.
                result.error = _schema_error(result.alias)
            warnings = list(result.foreign)
            if not result.error:
                try:
                    tables = list(_fenced_tables()) if tables is None else tables
                    warnings += _token_warnings(result.alias, tables)
                except (LockError, DatabaseError) as exc:
                    result.error = redact(f"could not compare its fencing tokens with the fenced rows: {exc}")
            if result.error:
                self.stdout.write(f"{result.alias}: FAILED {result.error} ({result.backend})")
            else:
                self.stdout.write(f"{result.alias}: ok {result.seconds * 1000:.2f} ms ({result.backend})")
            for warning in warnings:
                self.stdout.write(f"{result.alias}: WARNING {warning}")
        failed = [result.alias for result in results if result.error]
        if failed:
            raise CommandError(f"{len(failed)} backend(s) failed: {', '.join(failed)}.")

    # -- stats ---------------------------------------------------------------------------------

    def handle_stats(self, *, using, window, as_json, **options):
        window = metrics_conf.get().recent_window if window is None else window
        windows = {"recent": report.summarize(window, alias=using), "since_start": report.summarize(None, alias=using)}
        if as_json:
            self.stdout.write(json.dumps({"window_seconds": window,
                                      **{key: [row.as_dict() for row in found.rows] for key, found in windows.items()}},
                                         indent=2))
            return
        for key, found in windows.items():
            title = f"Last {window:g} s" if key == "recent" else "Since start"
            self.stdout.write(self.style.MIGRATE_HEADING(f"{title} (every process; ! = past its alert threshold)"))
            if not found.rows:
                self.stdout.write("  nothing recorded")
            for row in found.rows:
                self.stdout.write(self._stats_line(row))

    # -- verify --------------------------------------------------------------------------------

    def handle_verify(self, *, using, database, clients, iterations, runs, ttl, **options):
        try:
            results, kept = verify(using, database=database, clients=clients, iterations=iterations, runs=runs,
                                   ttl=ttl, progress=lambda step: self.stderr.write(f"{using}: {step}"))
        except NotVerifiable as exc:
            raise CommandError(str(exc)) from exc
        self.stdout.write(markdown_table(results))
        failed = [f"{result.scenario}: {'; '.join(result.violations)}" for result in results if not result.ok]
        if failed:
            raise CommandError(f"alias '{using}' violated {len(failed)} scenario(s); histories kept in {kept}.\n"
                               + "\n".join(failed))

    def _stats_line(self, row):
        alerts = row.alerts

        def mark(figure, text):
            return f"{text}!" if figure in alerts else text

        label = f"  {row.prefix}:*" if row.prefix else row.alias or "(no alias)"
        return (f"{label:<24} attempts={row.attempts} acquired={row.acquired} "
                f"p50={_seconds(row.acquire_p50)} p99={_seconds(row.acquire_p99)} "
                f"p99/ttl={mark('acquire_p99_of_ttl', _percent(row.acquire_p99_of_ttl))} "
                f"contention={mark('contention_rate', _percent(row.contention_rate))} "
                f"timeouts={mark('timeout_rate', _percent(row.timeout_rate))} "
                f"hold_p99={_seconds(row.hold_p99)} hold_p99/ttl={mark('hold_p99_of_ttl', _percent(row.hold_p99_of_ttl))} "
                f"lost={row.counts['lost']} fencing_rejections={mark('fencing_rejections', str(row.fencing_rejections))}")

