"""An attacker's engine worker (a fake, for tests and tools/bench_verify.py): meshd's own, whose fast path
flips the sign of one float of its output rows at one position (``--flip-at``), sending and hashing what it
flipped as an honest worker hashes what it sends: the receipts its daemon signs agree with the rows that
went on, so only a replay on a replica shows the lie."""

from __future__ import annotations

import os
import signal
import sys
from dataclasses import dataclass, fields

import numpy as np
import trio

from meshd.engine import fastpath, worker
from meshd.engine.supervisor import WorkerSpec
from meshd.stage.node import StageNode


@dataclass(frozen=True)
class LyingSpec(WorkerSpec):
    """This worker in place of a stage's own, flipping a float of its output rows at position ``at``."""

    at: int = 0

    def argv(self, fd: int, events_fd: int = -1) -> list[str]:
        honest = super().argv(fd, events_fd)
        return [sys.executable, __file__, "--flip-at", str(self.at), *honest[3:]]


def lying(spec: WorkerSpec, at: int) -> LyingSpec:
    return LyingSpec(**{f.name: getattr(spec, f.name) for f in fields(spec)}, at=at)


async def restart_worker(node: StageNode, spec: WorkerSpec) -> None:
    """``node``'s engine worker again, as ``spec`` says (its supervisor starts the new one)."""
    engine = node.service.engine
    engine.spec = spec
    generation = engine.generation
    assert engine.pid is not None
    os.kill(engine.pid, signal.SIGKILL)
    with trio.fail_after(120):
        while not engine.is_up or engine.generation == generation:
            await trio.sleep(0.05)


def main() -> int:
    at = int(sys.argv[sys.argv.index("--flip-at") + 1])
    del sys.argv[sys.argv.index("--flip-at"):sys.argv.index("--flip-at") + 2]
    honest = fastpath.FastPlane._send_rows

    def lying(self: fastpath.FastPlane, batch: list[fastpath.Work], out: np.ndarray) -> None:
        row = 0
        for w in batch:
            if w.pos <= at < w.pos + w.n:
                out = out.copy()
                out[row + at - w.pos, 0] = -out[row + at - w.pos, 0] or 1.0
            row += w.n
        honest(self, batch, out)

    fastpath.FastPlane._send_rows = lying  # type: ignore[method-assign]
    return worker.main()


if __name__ == "__main__":
    sys.exit(main())
