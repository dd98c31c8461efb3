"""A stage fast for the tracker's probes and slow for users (a fake, for tests): ``meshd join`` whose engine
worker's fast path sleeps before every batch it runs. Users' asks take the fast path; the tracker's
probes are check sessions on the daemons' path, which the worker runs at full speed. So the probes
time it as fast as an honest stage, and every user waits.

    python tools/slow_worker.py daemon SECONDS join ARGS...   a `meshd join ARGS` whose worker is this one
    python tools/slow_worker.py worker SECONDS WORKER-ARGS... the worker (the daemon starts it so)
"""

from __future__ import annotations

import sys
import time

from meshd.cli.main import main as run_command
from meshd.engine import fastpath, supervisor, worker


def slow_daemon(sleep: float, args: list[str]) -> int:
    honest = supervisor.WorkerSpec.argv

    def slow(self: supervisor.WorkerSpec, fd: int, events_fd: int = -1) -> list[str]:
        # [python, -m, meshd.engine.worker, ARGS...] -> [python, this file, worker, SECONDS, ARGS...]
        return [sys.executable, __file__, "worker", str(sleep), *honest(self, fd, events_fd)[3:]]

    supervisor.WorkerSpec.argv = slow  # type: ignore[method-assign]
    return run_command(args)


def slow_worker(sleep: float, args: list[str]) -> int:
    honest = fastpath.FastPlane._run

    def slow(self: fastpath.FastPlane, batch: list[fastpath.Work]) -> None:
        time.sleep(sleep)
        honest(self, batch)

    fastpath.FastPlane._run = slow  # type: ignore[method-assign]
    sys.argv = [sys.argv[0], *args]
    return worker.main()


def main() -> int:
    role, sleep, args = sys.argv[1], float(sys.argv[2]), sys.argv[3:]
    return slow_daemon(sleep, args) if role == "daemon" else slow_worker(sleep, args)


if __name__ == "__main__":
    sys.exit(main())
