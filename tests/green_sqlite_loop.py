"""A green thread looping on SQLite lock calls, beside another: ``python -m tests.green_sqlite_loop gevent|eventlet``.

SQLite's calls never yield to the hub. One green thread makes back-to-back non-blocking lock calls
on the SQLite alias for ``SECONDS``, as a task that try-locks in a loop does; another ticks every
10 ms, as a timer (a time limit), a renewal or another request would. Prints one JSON line: the
loop's calls and the ticks the other got in while the loop still ran.
"""

import sys

SECONDS = 1.5


def main(library):
    if library == "gevent":
        from gevent import monkey

        monkey.patch_all()
        import gevent

        spawn, sleep = gevent.spawn, gevent.sleep

        def wait(thread):
            thread.join()
    else:
        import eventlet

        eventlet.monkey_patch()
        spawn, sleep = eventlet.spawn, eventlet.sleep

        def wait(thread):
            thread.wait()

    import json
    import time

    import django

    django.setup()
    import distlock

    ended, calls, ticks = [], [0], []

    def loop():
        deadline = time.monotonic() + SECONDS
        while time.monotonic() < deadline:
            try:
                distlock.acquire("green-loop", ttl=5, blocking=False, using="default").release()
            except distlock.LockNotAcquired:
                pass
            calls[0] += 1
        ended.append(time.monotonic())

    def tick():
        while not ended:
            ticks.append(time.monotonic())
            sleep(0.01)

    looping, ticking = spawn(loop), spawn(tick)
    wait(looping)
    wait(ticking)
    print(json.dumps({"calls": calls[0], "ticks_while_looping": sum(1 for at in ticks if at < ended[0])}))


if __name__ == "__main__":
    main(sys.argv[1])
