"""An attacker's engine worker (a fake for tests): meshd's own, whose fast path flips the sign of one float
of its output rows at one position (``--flip-at``), sending and hashing what it flipped as an honest worker
hashes what it sends: the receipts its daemon signs agree with the rows that went on, so only a replay on
a replica shows the lie."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path[:0] = [str(Path(__file__).resolve().parents[1])]

from meshd.engine import fastpath, worker  # noqa: E402


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
