#!/usr/bin/env python3
"""What a layer range costs in memory: process RSS next to the bytes the engine says it owns.

Each range runs in a fresh subprocess (so nothing another range touched is
counted): load the range, create a context, run one short forward, then read
VmRSS, RssAnon, RssFile and VmHWM from /proc/self/status. A first row, "none",
is a process that only loads the engine library: the floor every range stands on.

RssFile is file-backed pages (shared, reclaimable page cache): the libraries,
plus the model's mmapped bytes from the first to the last owned tensor in file
order, which llama.cpp populates at load. RssAnon is private memory: KV cache,
compute buffers, the Python interpreter. VmHWM is the peak, load included.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from benchlib.result import parser, publish

from meshd.engine.chain import parse_ranges
from meshd.mesh.models import default_model_path

STATUS_FIELDS = ("VmRSS", "RssAnon", "RssFile", "VmHWM")
MIB = 1 << 20


def proc_status_kib() -> dict[str, int]:
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in STATUS_FIELDS:
            fields[key] = int(value.split()[0])
    return fields


def child(model: Path, layers: tuple[int, int] | None, n_ctx: int, threads: int, prompt_len: int) -> dict[str, object]:
    """Runs in the subprocess: one range, one forward, then the process's memory."""
    import numpy as np

    from meshd.engine import Context, Model
    from meshd.engine.native import load

    load()  # the "none" row still pays for the library, like every range does
    row: dict[str, object] = {"range": "none" if layers is None else f"{layers[0]}:{layers[1]}"}
    if layers is not None:
        m = Model(model, layers)
        c = Context(m, n_ctx=n_ctx, n_threads=threads)
        r = m.report
        seq, pos = [0] * prompt_len, list(range(prompt_len))
        if r.has_input:
            c.forward(seq, pos, tokens=[(7 * i + 1) % r.n_vocab for i in range(prompt_len)])
        else:
            # a residual of realistic scale: what the previous stage would hand on
            hidden = np.random.default_rng(0).standard_normal((prompt_len, r.stage_width)).astype(np.float32)
            c.forward(seq, pos, hidden=hidden)
        role = {(True, True): "full", (True, False): "head", (False, True): "tail", (False, False): "middle"}
        row.update(role=role[(r.has_input, r.has_output)], n_tensors=r.n_tensors, owned_bytes=r.n_bytes)
    row.update({k: v * 1024 for k, v in proc_status_kib().items()})
    return row


def run_isolated(args: argparse.Namespace, spec: str) -> dict[str, object]:
    cmd = [sys.executable, __file__, "--child", spec, "--model", str(args.model), "--n-ctx", str(args.n_ctx),
           "--threads", str(args.threads), "--prompt", str(args.prompt)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def table(rows: list[dict[str, object]]) -> str:
    head = f"{'range':>7} {'role':>6} {'tensors':>7} {'owned MiB':>9} {'VmRSS MiB':>9} {'RssAnon MiB':>11} " \
           f"{'RssFile MiB':>11} {'VmHWM MiB':>9}"
    lines = [head, "-" * len(head)]
    for r in rows:
        owned = f"{r['owned_bytes'] / MIB:9.1f}" if "owned_bytes" in r else f"{'-':>9}"
        lines.append(
            f"{r['range']:>7} {r.get('role', '-'):>6} {r.get('n_tensors', '-'):>7} {owned} "
            f"{r['VmRSS'] / MIB:9.1f} {r['RssAnon'] / MIB:11.1f} {r['RssFile'] / MIB:11.1f} {r['VmHWM'] / MIB:9.1f}"
        )
    return "\n".join(lines)


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--model", type=Path, default=None, help="GGUF file (default: the default model)")
    p.add_argument("--ranges", default="0:10,10:20,20:30,0:30", help="comma-separated START:END layer ranges")
    p.add_argument("--n-ctx", type=int, default=512)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prompt", type=int, default=8, help="rows in the one forward")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    args.model = args.model or default_model_path()
    if args.smoke:  # the smallest run through every part: the floor and one short range
        args.ranges, args.n_ctx = "0:2", 64

    if args.child is not None:
        layers = None if args.child == "none" else parse_ranges(args.child)[0]
        print(json.dumps(child(args.model, layers, args.n_ctx, args.threads, args.prompt)))
        return

    rows = [run_isolated(args, spec) for spec in ["none", *args.ranges.split(",")]]
    meta = {"model": str(args.model), "n_ctx": args.n_ctx, "threads": args.threads, "forward_rows": args.prompt}
    publish("engine_memory", args, {**meta, "rows": rows},
            f"model: {args.model.name}  n_ctx: {args.n_ctx}  threads: {args.threads}  forward rows: {args.prompt}\n"
            + table(rows))


if __name__ == "__main__":
    main()
