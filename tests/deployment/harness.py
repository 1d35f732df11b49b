"""Servers and workers of the deployment tests and of ``make matrix``: gunicorn, Celery pools, load, checks.

Every scenario returns a dict of measured figures (``run_site``, ``run_green_pool``, ``run_storm``),
so the tests assert on them and ``tests.deployment.matrix`` prints them as a table.
Everything listens on loopback; waits are bounded polls.
"""

import http.client
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
import uuid

from tests.servers import ManagedProcess, free_port, port_open, wait_until
from tests.workers import ROOT, child_env

#: ``gunicorn -k`` worker classes of the matrix; gunicorn 24+ ships no eventlet worker.
GUNICORN_WORKERS = ("sync", "gthread", "gevent", "eventlet")


def gunicorn_has_worker(kind):
    import importlib.util  # noqa: PLC0415

    module = {"sync": "sync", "gthread": "gthread", "gevent": "ggevent", "eventlet": "geventlet"}[kind]
    return importlib.util.find_spec(f"gunicorn.workers.{module}") is not None


class Gunicorn(ManagedProcess):
    """``gunicorn -k KIND -w WORKERS`` serving ``tests.deployment.wsgi`` on a loopback port."""

    start_timeout = 60

    def __init__(self, kind, workers=2, threads=16, preload=False):
        super().__init__(f"gunicorn-{kind}")
        self.kind, self.workers, self.threads, self.preload = kind, workers, threads, preload
        self.port = free_port()

    def command(self):
        command = [sys.executable, "-m", "gunicorn", "-k", self.kind, "-w", str(self.workers),
                   "-b", f"127.0.0.1:{self.port}", "--timeout", "30", "--graceful-timeout", "10",
                   "--log-level", "info", "--chdir", str(ROOT)]
        if self.kind == "gthread":
            command += ["--threads", str(self.threads)]
        if self.kind in ("gevent", "eventlet"):
            command += ["--worker-connections", "1000"]
        if self.preload:
            command.append("--preload")
        return [*command, "tests.deployment.wsgi:application"]

    def env(self):
        return child_env(DJANGO_SETTINGS_MODULE="tests.deployment.settings")

    def ready(self):
        return port_open(self.port) and self.get_logs().count("Booting worker with pid") >= self.workers

    def worker_trouble(self):
        """Lines of the log that tell of a worker that died or was replaced after the start."""
        log = self.get_logs()
        boots = log.count("Booting worker with pid")
        trouble = [line for line in log.splitlines()
                   if re.search(r"WORKER TIMEOUT|was sent SIG|Worker \(pid:\d+\) exited|Segmentation|"
                                r"libev|corrupted|Fatal Python error", line)]
        if boots > self.workers:
            trouble.append(f"{boots - self.workers} worker(s) booted after the start")
        return trouble

    def stop(self, timeout=20):
        if self.running:
            self.process.terminate()
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self._close_log()


def drive(port, path_of, seconds, clients=32, request_timeout=15):
    """``clients`` threads send GETs back to back for ``seconds``; return every answer.

    Each answer is ``{"status", "body", "path", "elapsed"}``; a request that got no answer within
    ``request_timeout`` has status "hung", one whose connection failed "error: ...".
    """
    answers, lock = [], threading.Lock()
    deadline = time.monotonic() + seconds

    def client(number):
        rng = random.Random(number)
        while time.monotonic() < deadline:
            path = path_of(rng)
            started = time.monotonic()
            connection = http.client.HTTPConnection("127.0.0.1", port, timeout=request_timeout)
            try:
                connection.request("GET", path)
                response = connection.getresponse()
                status, body = response.status, response.read()
            except TimeoutError:
                status, body = "hung", b""
            except OSError as exc:
                status, body = f"error: {exc!r}", b""
            except http.client.HTTPException as exc:
                status, body = f"error: {exc!r}", b""
            finally:
                connection.close()
            with lock:
                answers.append({"status": status, "body": body, "path": path, "elapsed": time.monotonic() - started})

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(seconds + request_timeout + 30)
    return answers


def check_fenced_rows(answers, rows):
    """Compare the 200 answers with the fenced rows ``{name: (balance, fencing_token)}``; return the problems.

    Per name: the balances answered are exactly 1..N (no lost or doubled update) and N is the row's
    balance; ordered by balance, the tokens strictly increase (each grant is newer than the last
    write) and the last one is the row's token; no lease was lost.
    """
    problems = []
    by_name = {}
    for answer in answers:
        if answer["status"] == 200:
            body = json.loads(answer["body"])
            name = answer["path"].rstrip("/").rsplit("/", 1)[1]
            by_name.setdefault(name, []).append(body)
            if body["lost"]:
                problems.append(f"{name}: lease {body['token']} lost during the request")
    for name, (balance, token) in rows.items():
        served = sorted(by_name.get(name, []), key=lambda body: body["balance"])
        balances = [body["balance"] for body in served]
        if balances != list(range(1, len(served) + 1)) or balance != len(served):
            problems.append(f"{name}: row balance {balance}, {len(served)} successful requests, "
                            f"balances answered {balances[:5]}…{balances[-5:]}")
        tokens = [body["token"] for body in served]
        bad = [(a, b) for a, b in zip(tokens, tokens[1:]) if not b > a]
        if bad or (tokens and tokens[-1] != token):
            problems.append(f"{name}: tokens not strictly increasing in write order {bad[:5]}, "
                            f"last answered {tokens[-1:]} vs row {token}")
    return problems


def run_site(kind, alias, db, seconds, *, clients=32, hot_names=4, workers=2):
    """Serve the fenced view under ``gunicorn -k kind`` and drive ``seconds`` of load on hot names.

    Return the figures: ok / conflicts (409) / server errors (5xx) / hung / connection errors,
    rate of successful requests, worker trouble from gunicorn's log, and the fenced-row problems.
    """
    from tests.fencing_app.models import Account  # noqa: PLC0415 - after django.setup()

    prefix = f"order:{kind}:{alias}:{uuid.uuid4().hex[:6]}"
    names = [f"{prefix}:{n}" for n in range(hot_names)]
    for name in names:
        Account.objects.using(db).create(name=name)
    server = Gunicorn(kind, workers=workers).start()
    try:
        # One request per name first: every worker has connected before the clock starts.
        warm_up = []
        for name in names:
            connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
            connection.request("GET", f"/order/{alias}/{db}/{name}/")
            response = connection.getresponse()
            warm_up.append({"status": response.status, "body": response.read(), "path": f"/order/{alias}/{db}/{name}/"})
            connection.close()
            if response.status != 200:
                raise AssertionError(f"warm-up request answered {response.status}; log:\n{server.get_logs()[-3000:]}")
        started = time.monotonic()
        answers = drive(server.port, lambda rng: f"/order/{alias}/{db}/{rng.choice(names)}/", seconds, clients)
        elapsed = time.monotonic() - started
        trouble = server.worker_trouble()
        log = server.get_logs()
    finally:
        server.cleanup()
    rows = {account.name: (account.balance, account.fencing_token)
            for account in Account.objects.using(db).filter(name__in=names)}
    statuses = [answer["status"] for answer in answers]
    ok = statuses.count(200)
    return {
        "kind": kind, "alias": alias, "db": db, "seconds": round(elapsed, 1), "requests": len(answers), "ok": ok,
        "conflicts": statuses.count(409),
        "server_errors": sum(1 for status in statuses if isinstance(status, int) and status >= 500),
        "hung": statuses.count("hung"),
        "connection_errors": sum(1 for status in statuses if isinstance(status, str) and status.startswith("error")),
        "rate": round(ok / elapsed, 1), "worker_trouble": trouble,
        "row_problems": check_fenced_rows(warm_up + answers, rows),
        "log_tail": log[-3000:],
    }


# -- Celery pools -----------------------------------------------------------------------------------

class PoolWorker(ManagedProcess):
    """``celery -A project worker --pool POOL --concurrency N`` on its own queue of the test Redis broker."""

    start_timeout = 60

    def __init__(self, pool, concurrency):
        self.queue = f"distlock-deploy-{pool}-{uuid.uuid4().hex[:8]}"
        super().__init__(self.queue)
        self.pool, self.concurrency = pool, concurrency

    def command(self):
        return [sys.executable, "-m", "celery", "-A", "project", "worker", "--pool", self.pool,
                "--concurrency", str(self.concurrency), "--hostname", f"{self.queue}@%h", "--queues", self.queue,
                "--loglevel", "INFO", "--prefetch-multiplier", "4",
                "--without-gossip", "--without-mingle", "--without-heartbeat"]

    def env(self):
        return child_env(DISTLOCK_LOG_LEVEL="WARNING")

    def ready(self):
        return " ready." in self.get_logs()

    def warm_shutdown(self, timeout=30):
        """SIGTERM, as a deployment stops a worker; return the seconds it took, or None if it hung (then killed)."""
        started = time.monotonic()
        if not self.running:
            return None
        self.process.terminate()
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
            self._close_log()
            return None
        self._close_log()
        return round(time.monotonic() - started, 1)

    def stop(self, timeout=20):
        if self.running:
            self.warm_shutdown(timeout)
        self._close_log()


class ConnectionWatcher:
    """The most connections to the test PostgreSQL database at once, polled every 20 ms by a thread."""

    def __init__(self, database="postgres"):
        self.database, self.most, self._stop = database, 0, threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self):
        from django.db import connections  # noqa: PLC0415

        try:
            with connections[self.database].cursor() as cursor:
                while not self._stop.is_set():
                    cursor.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                                   "AND pid <> pg_backend_pid()")
                    self.most = max(self.most, cursor.fetchone()[0])
                    self._stop.wait(0.02)
        finally:
            connections[self.database].close()

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc_info):
        self._stop.set()
        self._thread.join(10)


def collect(results, timeout):
    """Wait for every ``AsyncResult`` (bounded); return ``(values, errors)`` where errors are reprs."""
    values, errors = [], []
    deadline = time.monotonic() + timeout
    for result in results:
        try:
            values.append(result.get(timeout=max(0.1, deadline - time.monotonic()), propagate=True))
        except Exception as exc:  # noqa: BLE001 - every failure is reported
            errors.append(f"{type(exc).__name__}: {exc}"[:300])
    return values, errors


def overlaps(sections):
    """Pairs of critical sections ``(enter, exit)`` on one name that overlap in time."""
    found = []
    by_name = {}
    for section in sections:
        by_name.setdefault(section["name"], []).append(section)
    for entries in by_name.values():
        entries.sort(key=lambda section: section["enter"])
        found += [(a, b) for a, b in zip(entries, entries[1:]) if b["enter"] < a["exit"]]
    return found


def run_green_pool(pool, alias, runs, concurrency, *, hot_names=5, long_run=None):
    """``runs`` runs of ``green_run`` on a ``pool`` worker, each holding its run lock and a hot lock.

    Return errors, skips, overlaps, the most PostgreSQL connections (database backend on PostgreSQL),
    what is still held under the prefix, the warm-shutdown time, and with ``long_run=(ttl, seconds)``
    whether a run of ``seconds`` with a ``ttl`` lease kept it.
    """
    from distlock.handler import locks  # noqa: PLC0415
    from tests.celery_app import deployment_tasks  # noqa: PLC0415

    prefix = f"green:{pool}:{alias}:{uuid.uuid4().hex[:6]}"
    worker = PoolWorker(pool, concurrency).start()
    figures = {"pool": pool, "alias": alias, "runs": runs, "concurrency": concurrency}
    try:
        watcher = ConnectionWatcher() if alias == "postgres" else None
        started = time.monotonic()
        if watcher:
            watcher.__enter__()
        try:
            task = deployment_tasks.GREEN_RUN[alias]
            results = [task.apply_async((prefix, n, hot_names), queue=worker.queue) for n in range(runs)]
            long_result = None
            if long_run:
                ttl, seconds = long_run
                long_result = deployment_tasks.LONG_RUN[alias].apply_async((prefix, seconds), queue=worker.queue)
            values, errors = collect(results, timeout=120 + runs * 0.2)
            if long_result is not None:
                long_values, long_errors = collect([long_result], timeout=seconds * 3 + 60)
                figures["long_run"] = long_values[0] if long_values else {"error": long_errors[0]}
        finally:
            if watcher:
                watcher.__exit__(None, None, None)
        figures["seconds"] = round(time.monotonic() - started, 1)
        figures["errors"] = errors
        figures["backend_unavailable"] = sum("BackendUnavailable" in error for error in errors)
        figures["skipped"] = values.count(None)
        sections = [value for value in values if value]
        figures["overlaps"] = len(overlaps(sections))
        figures["most_connections"] = watcher.most if watcher else None
        figures["held_after"] = [info.name for info in locks[alias].held_locks(prefix)]
        figures["shutdown_seconds"] = worker.warm_shutdown(timeout=30)
        figures["log_errors"] = [line for line in worker.get_logs().splitlines()
                                 if re.search(r"Traceback|ERROR|CRITICAL", line)][:10]
    finally:
        worker.cleanup()
    return figures


def run_storm(pool, aliases, runs_per_alias, concurrency, *, limit="soft", slots=4, low=0.02, high=0.6):
    """A time-limit storm: ``runs_per_alias`` runs of ``storm_run`` per alias on one ``pool`` worker, each
    with a time limit drawn uniformly from ``[low, high]`` s (``limit``: "soft" or "hard") while it
    does nothing but lock calls.

    Then, per alias: keys still held ``ttl + 1`` s after the last run ended (polled), and whether every
    run key's next run (no time limit) gets its lock.
    """
    from distlock.handler import locks  # noqa: PLC0415
    from tests.celery_app import deployment_tasks  # noqa: PLC0415

    ttl = deployment_tasks.STORM_TTL
    worker = PoolWorker(pool, concurrency).start()
    figures = {}
    try:
        prefixes = {alias: f"storm:{pool}:{alias}:{uuid.uuid4().hex[:6]}" for alias in aliases}
        rng = random.Random(25)
        results = {alias: [] for alias in aliases}
        for n in range(runs_per_alias):
            for alias in aliases:
                seconds = rng.uniform(low, high)
                limits = {"soft_time_limit": seconds, "time_limit": seconds + 10} if limit == "soft" \
                    else {"time_limit": seconds}
                results[alias].append(deployment_tasks.STORM_RUN[alias].apply_async(
                    (prefixes[alias], n % slots, 30.0), queue=worker.queue, **limits))
        outcomes = {}
        for alias in aliases:
            values, errors = collect(results[alias], timeout=120 + runs_per_alias * len(aliases))
            outcomes[alias] = (values, errors)
        ended = time.monotonic()
        for alias in aliases:
            values, errors = outcomes[alias]
            kinds = {}
            for error in errors:
                kind = error.split(":", 1)[0]
                kinds[kind] = kinds.get(kind, 0) + 1
            prefix = prefixes[alias]

            def held(alias=alias, prefix=prefix):
                return [info.name for info in locks[alias].held_locks(prefix)]

            try:
                wait_until(lambda held=held: not held(), ttl + 1 - (time.monotonic() - ended), "keys freed")
                still = []
            except TimeoutError:
                still = held()
            next_runs = [deployment_tasks.STORM_RUN[alias].apply_async((prefix, slot, 0.0), queue=worker.queue)
                         for slot in range(slots)]
            next_values, next_errors = collect(next_runs, timeout=60)
            figures[alias] = {"pool": pool, "limit": limit, "runs": runs_per_alias, "outcomes": kinds,
                              "completed": len(values), "held_past_ttl": still,
                              "next_runs_ran": sum(1 for value in next_values if value is not None),
                              "next_runs": slots, "next_errors": next_errors}
        figures["worker_alive"] = worker.running
    finally:
        worker.cleanup()
    return figures


# -- verdicts: the tests assert that these are empty, the matrix prints them ---------------------------

def site_failures(figures):
    """What went wrong in a ``run_site`` run (empty: the site held up)."""
    failures = [f"{figures[key]} {key.replace('_', ' ')}" for key in ("server_errors", "hung", "connection_errors")
                if figures[key]]
    if not figures["ok"]:
        failures.append("no successful request")
    # Rows written by requests the clients gave up on ("hung") show here too.
    return failures + list(figures["worker_trouble"]) + list(figures["row_problems"])


def green_failures(figures, max_connections=None):
    """What went wrong in a ``run_green_pool`` run."""
    failures = [f"{len(figures['errors'])} runs failed, e.g. {figures['errors'][:3]}"] if figures["errors"] else []
    if figures["skipped"]:
        failures.append(f"{figures['skipped']} runs skipped although every run key was free")
    if figures["overlaps"]:
        failures.append(f"{figures['overlaps']} overlapping critical sections")
    if figures["held_after"]:
        failures.append(f"still held after the runs: {figures['held_after']}")
    if figures["shutdown_seconds"] is None:
        failures.append("warm shutdown did not complete within 30 s")
    if max_connections is not None and (figures["most_connections"] or 0) > max_connections:
        failures.append(f"{figures['most_connections']} PostgreSQL connections (limit {max_connections})")
    long = figures.get("long_run")
    if long is not None and (long.get("error") or long.get("lost")):
        failures.append(f"the long run lost its lease: {long}")
    return failures


#: Pool × backend pairs distlock refuses by design -> what every run must fail with (gRPC has no eventlet
#: support, so the etcd alias refuses to be built in an eventlet-patched process; docs/DEPLOYMENT.md).
REFUSED = {("eventlet", "etcd"): ("ImproperlyConfigured", "eventlet")}


def refusal_failures(figures):
    """What went wrong in a ``run_green_pool`` run of a refused pair: every run, the long one included, must
    fail with the error that names the fix, and nothing may be left held or hang."""
    kind, named = REFUSED[(figures["pool"], figures["alias"])]
    errors = list(figures["errors"])
    if figures.get("long_run") is not None:
        errors.append(figures["long_run"].get("error") or "the long run ran")
    failures = [f"a run did not fail with {kind} naming {named}: {error}" for error in errors
                if not (error.startswith(kind) and named in error)][:3]
    if len(figures["errors"]) < figures["runs"]:
        failures.append(f"{figures['runs'] - len(figures['errors'])} of {figures['runs']} runs were not refused")
    if figures["held_after"]:
        failures.append(f"still held after the runs: {figures['held_after']}")
    if figures["shutdown_seconds"] is None:
        failures.append("warm shutdown did not complete within 30 s")
    return failures


#: How a storm run may end: its time limit, or skipped (its key held by an earlier run of the storm).
STORM_OUTCOMES = {"SoftTimeLimitExceeded", "TimeLimitExceeded"}


def storm_failures(figures):
    """What went wrong for one alias of a ``run_storm``."""
    failures = []
    other = {kind: count for kind, count in figures["outcomes"].items() if kind not in STORM_OUTCOMES}
    if other:
        failures.append(f"runs ended otherwise than by their time limit: {other}")
    if figures["held_past_ttl"]:
        failures.append(f"held past ttl + 1 s: {figures['held_past_ttl']}")
    if figures["next_runs_ran"] < figures["next_runs"] or figures["next_errors"]:
        failures.append(f"only {figures['next_runs_ran']} of {figures['next_runs']} next runs got their lock "
                        f"{figures['next_errors'][:2]}")
    return failures
