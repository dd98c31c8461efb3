"""A stage fast for the tracker's probes and slow for users (a fake, for tests): ``meshd join`` whose engine
worker's fast path sleeps before every batch it runs. Users' asks take the fast path; the tracker's
probes are check sessions on the daemons' path, which the worker runs at full speed. So the probes
time it as fast as an honest stage, and every user waits.

Slow, its span receipts still sign the time it took (``Receipt.t_us``: the worker times each step from
its rows coming whole to its output's send, the sleep inside). A liar also signs each span as taking no
time at all, so that the asker's wait looks like its neighbours' doing (meshd.mesh.traffic).

    python tools/slow_worker.py daemon SECONDS join ARGS...   a `meshd join ARGS` whose worker is this one
    python tools/slow_worker.py liar SECONDS join ARGS...     the same, its spans signed as taking 0 µs
    python tools/slow_worker.py worker|lying-worker SECONDS WORKER-ARGS...  the worker (the daemon starts it so)
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence

from meshd.cli.main import main as run_command
from meshd.engine import fastpath, spans, supervisor, worker


def slow_daemon(role: str, sleep: float, args: list[str]) -> int:
    honest = supervisor.WorkerSpec.argv

    def slow(self: supervisor.WorkerSpec, fd: int, events_fd: int = -1) -> list[str]:
        # [python, -m, meshd.engine.worker, ARGS...] -> [python, this file, ROLE, SECONDS, ARGS...]
        return [sys.executable, __file__, role, str(sleep), *honest(self, fd, events_fd)[3:]]

    supervisor.WorkerSpec.argv = slow  # type: ignore[method-assign]
    return run_command(args)


def slow_worker(sleep: float, lying: bool, args: list[str]) -> int:
    honest = fastpath.FastPlane._run

    def slow(self: fastpath.FastPlane, batch: list[fastpath.Work]) -> None:
        time.sleep(sleep)
        honest(self, batch)

    fastpath.FastPlane._run = slow  # type: ignore[method-assign]
    if lying:
        step = spans.SpanBook.step

        def untimed(self: spans.SpanBook, pos: int, ins: Sequence[bytes], outs: Sequence[bytes],
                    ids: Sequence[bytes] = (), drafts: int = 0, held: float = 0.0) -> list[spans.Span]:
            return step(self, pos, ins, outs, ids, drafts, 0.0)

        spans.SpanBook.step = untimed  # type: ignore[method-assign]
    sys.argv = [sys.argv[0], *args]
    return worker.main()


def main() -> int:
    role, sleep, args = sys.argv[1], float(sys.argv[2]), sys.argv[3:]
    if role in ("daemon", "liar"):
        return slow_daemon("worker" if role == "daemon" else "lying-worker", sleep, args)
    return slow_worker(sleep, role == "lying-worker", args)


if __name__ == "__main__":
    sys.exit(main())
