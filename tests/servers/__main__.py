"""Start the shared test servers, run a command with their addresses in the environment, stop them.

    python -m tests.servers [--servers postgres,redis,...] -- python -m pytest [args]

Each server kind registers a starter in ``STARTERS``; it returns the environment variables that
``tests/settings.py`` reads and the processes to stop afterwards. ``DISTLOCK_TEST_REQUIRE`` lists
the kinds started, so a test whose server is missing fails instead of being skipped.
"""

import argparse
import os
import subprocess
import sys
import tempfile
import uuid

from django.utils.module_loading import import_string


#: Server kind -> the function that starts it, given a temporary directory, and returns
#: ``(environment variables for tests/settings.py, processes to stop afterwards)``.
STARTERS = {
    "postgres": "tests.servers.postgres.start_postgres",
    "redis": "tests.servers.redis.start_redis",
    "redlock": "tests.servers.redis.start_redlock",
    "rediscluster": "tests.servers.redis.start_redis_cluster",
    "zookeeper": "tests.servers.zookeeper.start_zookeeper",
    "etcd": "tests.servers.etcd.start_etcd",
}


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m tests.servers", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--servers", default=",".join(STARTERS),
                        help=f"comma-separated kinds to start (default: all of {', '.join(STARTERS)})")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command to run, after --")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to run after --")
    kinds = [kind for kind in args.servers.split(",") if kind]
    unknown = set(kinds) - set(STARTERS)
    if unknown:
        parser.error(f"unknown server kind(s): {', '.join(sorted(unknown))}")

    tmp = tempfile.mkdtemp(prefix="distlock-servers-")
    os.chmod(tmp, 0o755)
    env = dict(os.environ, DISTLOCK_TEST_TMP=tmp, DISTLOCK_TEST_RUN_ID=uuid.uuid4().hex[:8],
               DISTLOCK_TEST_REQUIRE=",".join(kinds))
    started = []
    try:
        for kind in kinds:
            print(f"[tests.servers] starting {kind}", flush=True)
            variables, processes = import_string(STARTERS[kind])(tmp)
            started.extend(processes)
            env.update(variables)
            print(f"[tests.servers] {kind}: {variables}", flush=True)
        return subprocess.call(command, env=env)
    finally:
        for process in reversed(started):
            process.cleanup()


if __name__ == "__main__":
    sys.exit(main())
