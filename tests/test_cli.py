"""`meshd serve` and `meshd ask`: answers on stdout, figures and failures as one clear line."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
from localmesh import Served, copy_with_other_digest, run_meshd, start_serve, stop_all


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def halves() -> Iterator[list[Served]]:
    served = []
    try:
        for r in ("0:15", "15:30"):
            served.append(start_serve("--layers", r, "--threads", "1", "--max-sessions", "2", "--session-tokens", "256"))
        yield served
    finally:
        stop_all(served)


def one_line_error(result, exit_code: int = 1) -> str:
    assert result.returncode == exit_code, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


def test_ask_prints_the_answer_then_one_line_of_figures(halves: list[Served]) -> None:
    route = ",".join(s.address for s in halves)
    result = run_meshd("ask", "--route", route, "--max-tokens", "16", "What is the capital of France?")
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout
    figures = result.stderr.strip().splitlines()
    assert len(figures) == 1
    assert "prompt tokens" in figures[0] and "first token" in figures[0] and "tokens/s" in figures[0]


def test_ask_with_raw_text_and_stop_string(halves: list[Served]) -> None:
    route = ",".join(s.address for s in halves)
    result = run_meshd("ask", "--route", route, "--raw", "--max-tokens", "24", "--stop", ",", "1, 2, 3, 4,")
    assert result.returncode == 0, result.stderr
    assert "," not in result.stdout


def test_unreachable_stage_is_one_line(halves: list[Served]) -> None:
    route = f"{halves[0].address},127.0.0.1:{free_port()}"
    line = one_line_error(run_meshd("ask", "--route", route, "--timeout", "5", "hello"))
    assert "unreachable" in line


def test_route_that_leaves_layers_uncovered_is_one_line(halves: list[Served]) -> None:
    line = one_line_error(run_meshd("ask", "--route", halves[0].address, "hello"))
    assert "layers [15, 30) uncovered" in line


def test_route_that_covers_layers_twice_is_one_line(halves: list[Served]) -> None:
    route = ",".join([halves[0].address, halves[0].address, halves[1].address])
    line = one_line_error(run_meshd("ask", "--route", route, "hello"))
    assert "covered twice" in line


def test_stages_of_different_model_files_are_one_line(halves: list[Served], default_model: Path,
                                                      tmp_path: Path) -> None:
    other = copy_with_other_digest(default_model, tmp_path / "other.gguf")
    tail = start_serve("--model", str(other), "--layers", "15:30", "--threads", "1", "--max-sessions", "1",
                       "--session-tokens", "64")
    try:
        line = one_line_error(run_meshd("ask", "--route", f"{halves[0].address},{tail.address}", "hello"))
        assert "different model files" in line
    finally:
        tail.stop()


@pytest.mark.parametrize(("args", "needle"), [
    (["serve", "--layers", "5"], "not of the form START:END"),
    (["serve", "--listen", "nowhere"], "not HOST:PORT"),
    (["serve", "--model", "/nonexistent/model.gguf"], "model file not found"),
    (["serve", "--layers", "20:10"], "empty or inverted"),
    (["serve", "--layers", "0:99"], "out of bounds"),
    (["ask", "--state-dir", "/nonexistent/state", "hello"], "meshd join"),
    (["ask", "--route", "localhost", "hello"], "not HOST:PORT"),
    (["ask", "--route", "127.0.0.1:1", "--max-tokens", "0", "hello"], "--max-tokens"),
])
def test_bad_flags_are_one_line(args: list[str], needle: str) -> None:
    result = run_meshd(*args)
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], result.stderr
