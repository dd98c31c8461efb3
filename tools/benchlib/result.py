"""One JSON shape for every benchmark's result, and the command line every benchmark shares.

A result is ``{"schema", "bench", "when", "host", "smoke", "args", "figures", "table"}``: ``figures`` holds
what that benchmark measured (its samples and medians, in its own keys), ``table`` the text it printed.
``--smoke`` runs a benchmark at its smallest, in seconds: CI runs each one that way
(tests/test_bench_smoke.py) so a benchmark that no longer runs is seen the day it breaks; a smoke run's
figures are no measurement.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
from pathlib import Path
from typing import Any

SCHEMA = "meshd-bench/1"
KEYS = ("schema", "bench", "when", "host", "smoke", "args", "figures", "table")


def parser(doc: str | None, **kwargs: Any) -> argparse.ArgumentParser:
    """A benchmark's argument parser with the two options every benchmark has."""
    ap = argparse.ArgumentParser(description=(doc or "").strip().splitlines()[0] if doc else None, **kwargs)
    ap.add_argument("--json", type=Path, help="write the result here (schema " + SCHEMA + ")")
    ap.add_argument("--smoke", action="store_true",
                    help="the smallest run that goes through every part, in seconds (CI's check that it runs; no figures)")
    return ap


def host() -> dict[str, Any]:
    """Where the figures were taken: what a reader needs to compare two results."""
    return {"machine": platform.machine(), "system": platform.platform(), "python": platform.python_version(),
            "cpus": os.cpu_count(), "usable_cpus": len(os.sched_getaffinity(0))}


def _plain(value: Any) -> Any:
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set):
        return [_plain(v) for v in value]
    return value


def result(bench: str, args: argparse.Namespace, figures: Any, table: str = "") -> dict[str, Any]:
    return {"schema": SCHEMA, "bench": bench, "when": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "host": host(), "smoke": bool(getattr(args, "smoke", False)), "args": _plain(vars(args)),
            "figures": _plain(figures), "table": table}


def publish(bench: str, args: argparse.Namespace, figures: Any, table: str = "") -> dict[str, Any]:
    """The table on stdout and, with --json, the whole result in the file; returns the result."""
    out = result(bench, args, figures, table)
    if table:
        print(table)
    path: Path | None = getattr(args, "json", None)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(out, indent=2, allow_nan=True) + "\n")
    return out


def check(out: Any) -> list[str]:
    """What is wrong with a result's shape (empty when nothing is): the smoke test's check."""
    if not isinstance(out, dict):
        return ["not an object"]
    wrong = [f"missing {k!r}" for k in KEYS if k not in out]
    if out.get("schema") != SCHEMA:
        wrong.append(f"schema {out.get('schema')!r} is not {SCHEMA!r}")
    if not isinstance(out.get("args"), dict) or not isinstance(out.get("host"), dict):
        wrong.append("args and host are objects")
    if out.get("figures") in (None, {}, []):
        wrong.append("no figures")
    return wrong


def fail(bench: str, message: str) -> int:
    """A benchmark that cannot run says why in one line and exits non-zero."""
    print(f"{bench}: {message}", file=sys.stderr)
    return 1
