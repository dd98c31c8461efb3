"""Every benchmark under tools/ still runs: each one's --smoke (its smallest run through every part, no
figures worth reading) ends well and writes one result of the one schema (tools/benchlib/result.py).
And `meshd bench` tells a volunteer its figures in one screen.

The benchmarks are found, not listed: a new tools/bench_*.py is smoked the day it lands. One that needs
what CI does not build (llama.cpp's own programs) leaves that part out of its smoke run.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from benchlib.result import check

from meshd.cli.main import main

ROOT = Path(__file__).resolve().parent.parent
TOOLS = ROOT / "tools"
SMOKE_SECONDS = 300
AT_ONCE = 2
BENCHES = sorted(p.stem for p in TOOLS.glob("bench_*.py")) + ["profile_hop"]


def test_every_benchmark_takes_smoke_and_json() -> None:
    """Cheap, no process: each benchmark's command line is the shared one (benchlib.result.parser)."""
    for name in BENCHES:
        text = (TOOLS / f"{name}.py").read_text()
        assert "parser(__doc__" in text and "publish(" in text, f"{name} does not take benchlib's --smoke and --json"
        assert "sys.path" not in text, f"{name} edits sys.path"


def smoke(name: str, out: Path) -> str | None:
    """What is wrong with ``name``'s smoke run (None when nothing is)."""
    try:
        done = subprocess.run([sys.executable, str(TOOLS / f"{name}.py"), "--smoke", "--json", str(out)], cwd=ROOT,
                              capture_output=True, text=True, timeout=SMOKE_SECONDS)
    except subprocess.TimeoutExpired:
        return f"{name} --smoke ran past {SMOKE_SECONDS} s"
    if done.returncode != 0:
        return f"{name} --smoke failed (rc {done.returncode}):\n{done.stderr[-2000:]}"
    result = json.loads(out.read_text())
    wrong = check(result)
    if result.get("smoke") is not True or result.get("args", {}).get("smoke") is not True:
        wrong.append("not marked a smoke run")
    return f"{name}: {'; '.join(wrong)}" if wrong else None


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_every_benchmark_runs_its_smoke(tmp_path: Path) -> None:
    # two at once: most of a smoke run's time is processes starting and models loading; four at once on 2 busy
    # cores (load 13) took as long (560 s against 589 s one by one) and an engine worker missed its health check
    with ThreadPoolExecutor(max_workers=AT_ONCE) as pool:
        wrong = [w for w in pool.map(lambda name: smoke(name, tmp_path / f"{name}.json"), BENCHES) if w]
    assert wrong == []


def bench_screen(capsys: pytest.CaptureFixture[str], *args: str) -> list[str]:
    assert main(["bench", "--threads", "1", "--tokens", "2", *args]) == 0
    return capsys.readouterr().out.splitlines()


@pytest.mark.slow
def test_meshd_bench_tells_a_volunteer_its_figures_in_one_screen(capsys: pytest.CaptureFixture[str]) -> None:
    lines = bench_screen(capsys, "--memory", "1G")
    text = "\n".join(lines)
    assert len(lines) <= 24 and all(len(line) <= 130 for line in lines), lines
    heads = [line.split()[0] for line in lines if not line.startswith(" ")]
    assert heads == ["meshd", "speed", "memory", "offer"], lines
    speed = re.search(r"decode ([\d.]+) ms a layer per token \(([\d.]+) ms a token for all (\d+)", text)
    assert speed is not None
    per_layer, per_token, layers = float(speed[1]), float(speed[2]), int(speed[3])
    assert layers == 30 and per_layer > 0 and per_token == pytest.approx(per_layer * layers, rel=0.01)
    assert "holds the whole model" in lines[-1]

    # memory for three layers and a half, KV included: three of a middle stage, and not the whole model
    layer = re.search(r"a layer: ([\d.]+) MiB of weights \(largest [\d.]+\) \+ ([\d.]+) MiB of KV", text)
    assert layer is not None
    with_kv = float(layer[1]) + float(layer[2])
    three = bench_screen(capsys, "--memory", f"{int(with_kv * 3.5 * 1024)}K")[-1]
    assert re.search(r"holds 3 of 30 layers of a middle stage", three), three
    none = bench_screen(capsys, "--memory", "1M")[-1]
    assert "holds no layer" in none, none
