"""Progress on a terminal (a pty here) for loading, joining and waiting for coverage; silence on a pipe."""

from __future__ import annotations

import fcntl
import io
import logging
import os
import pty
import re
import select
import struct
import subprocess
import sys
import termios
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
from localmesh import READY, Served, meshd_command, spawn, start_join, stop_process

from meshd import progress
from meshd.cli.ask import route_when_covered
from meshd.cli.serve import range_wait
from meshd.logs import setup_logging
from wire.errors import ErrorCode, ProtocolError
from wire.meshrpc import RouteReply, RouteStage
from wire.message import Message


@pytest.fixture
def terminal() -> Iterator[tuple[io.TextIOWrapper, int]]:
    """A pty: the stream a program writes to (its terminal), and the fd the terminal's screen reads."""
    screen, tty = pty.openpty()
    stream = io.TextIOWrapper(os.fdopen(tty, "wb", buffering=0), encoding="utf-8", write_through=True)
    try:
        yield stream, screen
    finally:
        stream.close()
        os.close(screen)


def read_screen(fd: int) -> str:
    chunks = []
    while select.select([fd], [], [], 0)[0]:
        try:
            chunk = os.read(fd, 65536)
        except OSError:  # EIO: the terminal's other end is closed
            break
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks).decode("utf-8", "replace")


async def test_a_wait_on_a_terminal_shows_what_and_how_long_then_clears(
        terminal: tuple[io.TextIOWrapper, int]) -> None:
    stream, screen = terminal
    async with progress.waiting("joining the mesh\nthrough 10.0.0.1:7000", stream) as line:
        assert line.shown
        await trio.sleep(progress.REDRAW * 2.5)
        line.say("loading layers [0, 15) of m.gguf")
        await trio.sleep(progress.REDRAW * 1.5)
    shown = read_screen(screen)
    assert "joining the mesh through 10.0.0.1:7000 00:00" in shown
    assert "loading layers [0, 15) of m.gguf 00:0" in shown
    # redrawn in place, never a new line; cleared at the end (leave=False)
    assert shown.count("\r") >= 3 and "\n" not in shown.replace("\r\n", "")
    assert shown.rstrip(" ").endswith("\r")


async def test_a_record_logged_during_a_wait_goes_above_the_line(
        terminal: tuple[io.TextIOWrapper, int], monkeypatch: pytest.MonkeyPatch) -> None:
    stream, screen = terminal
    monkeypatch.setattr(sys, "stderr", stream)
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        setup_logging(logging.INFO)
        async with progress.waiting("loading"):
            logging.getLogger("meshd.test").info("seed answered")
            await trio.sleep(progress.REDRAW * 1.5)
    finally:
        root.handlers[:], root.level = handlers, level
    shown = read_screen(screen)
    before, record, after = re.split(r"(\S+Z INFO meshd\.test: seed answered\r?\n)", shown)
    # the line is cleared before the record and drawn again after it
    assert "loading 00:00" in before and before.endswith("\r") and "loading 00:0" in after


async def test_a_wait_off_a_terminal_writes_nothing() -> None:
    read, write = os.pipe()
    with os.fdopen(write, "w") as pipe:
        async with progress.waiting("loading", pipe) as line:
            assert not line.shown
            line.say("still loading")
            await trio.sleep(progress.REDRAW * 2)
    with os.fdopen(read) as out:
        assert out.read() == ""
    assert not progress.on_terminal(io.StringIO())


# ----- ask --wait: asking again while the mesh cannot cover the model

ROUTE = RouteReply(model="d" * 64, n_layers=30, stages=[RouteStage(node_id="a" * 40, address="10.0.0.1:7000",
                                                                   start=0, end=30)], seconds_per_token=0.01)


def answers(*replies: Message | ProtocolError) -> tuple[Callable[[], Awaitable[Message]], list[float]]:
    """A fake route source: the replies in turn; it records when it was asked."""
    asked: list[float] = []
    queue = list(replies)

    async def ask() -> Message:
        asked.append(trio.current_time())
        reply = queue.pop(0)
        if isinstance(reply, ProtocolError):
            raise reply
        return reply
    return ask, asked


UNCOVERED = ProtocolError(ErrorCode.NOT_FOUND, "no route for m: layers [15, 30) are served by no one")


async def test_ask_waits_for_coverage_and_takes_the_route_once_there(autojump_clock: trio.testing.MockClock) -> None:
    ask, asked = answers(UNCOVERED, UNCOVERED, ROUTE)
    route = await route_when_covered(ask, "seed", wait=10.0)
    assert [s.address for s in route.stages] == ["10.0.0.1:7000"]
    assert [round(t - asked[0], 3) for t in asked] == [0.0, 1.0, 2.0]


async def test_ask_without_wait_says_what_is_missing_at_once(autojump_clock: trio.testing.MockClock) -> None:
    ask, asked = answers(UNCOVERED, ROUTE)
    with pytest.raises(ProtocolError, match="served by no one"):
        await route_when_covered(ask, "seed", wait=0.0)
    assert len(asked) == 1


async def test_ask_gives_up_when_the_wait_is_over(autojump_clock: trio.testing.MockClock) -> None:
    ask, asked = answers(*[UNCOVERED] * 10)
    began = trio.current_time()
    with pytest.raises(ProtocolError, match="served by no one"):
        await route_when_covered(ask, "seed", wait=3.5)
    assert len(asked) == 4 and trio.current_time() - began <= 3.5


async def test_other_errors_are_not_waited_on(autojump_clock: trio.testing.MockClock) -> None:
    ask, asked = answers(ProtocolError(ErrorCode.UNREACHABLE, "gone"), ROUTE)
    with pytest.raises(ProtocolError, match="gone"):
        await route_when_covered(ask, "seed", wait=60.0)
    assert len(asked) == 1


def test_a_volunteer_says_what_it_waits_for() -> None:
    assert range_wait((0, 15), None, "m") == "loading layers [0, 15) of m"
    assert range_wait(None, "the model needs 2 GiB", "m") == "waiting for the mesh to cover m: the model needs 2 GiB"
    assert range_wait(None, None, "m") == "waiting for the tracker to assign this node its layers"


# ----- the commands, on a pty and on a pipe

def run_on_pty(argv: list[str], until: Callable[[str, str], bool], timeout: float) -> tuple[subprocess.Popen[bytes], str, str]:
    """`argv` with stderr on a terminal and stdout on a pipe; reads both until `until(stdout, screen)`
    or the process ends (within `timeout`); the process is left to the caller to stop."""
    screen, tty = pty.openpty()
    # a terminal of 100 x 30, as a person's would be (the in-process tests use one that reports no size)
    fcntl.ioctl(tty, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 100, 0, 0))
    env = os.environ | {"PYTHONUNBUFFERED": "1"}
    proc = spawn(argv, stdout=subprocess.PIPE, stderr=tty, env=env)
    os.close(tty)
    assert proc.stdout is not None
    out, shown = b"", ""
    deadline = time.monotonic() + timeout
    watched: list[Any] = [proc.stdout, screen]
    while time.monotonic() < deadline:
        ready = select.select(watched, [], [], 0.1)[0]
        if proc.stdout in ready:
            chunk = os.read(proc.stdout.fileno(), 65536)
            out += chunk
            if not chunk:  # end of file stays readable: stop watching it, or the loop spins to its deadline
                watched.remove(proc.stdout)
        if screen in ready:
            shown += read_screen(screen)
        if until(out.decode(), shown) or (proc.poll() is not None and proc.stdout not in watched):
            break
    shown += read_screen(screen)
    os.close(screen)
    return proc, out.decode(), shown


def ready_in(out: str) -> bool:
    return any(READY.match(line) for line in out.splitlines())


@pytest.mark.slow
def test_serve_shows_loading_on_a_terminal_and_nothing_on_a_pipe(tmp_path: Path) -> None:
    argv = meshd_command("serve", "--layers", "0:15", "--listen", "127.0.0.1:0", "--threads", "1",
                         "--max-sessions", "1", "--session-tokens", "64")
    proc, out, shown = run_on_pty(argv, lambda out, _: ready_in(out), 120)
    try:
        assert ready_in(out), (out, shown)
        assert re.search(r"loading layers \[0, 15\) of SmolLM2-135M-Instruct\.Q4_1\.gguf 00:\d\d", shown), shown
    finally:
        stop_process(proc)
    log = tmp_path / "serve.log"
    with log.open("w") as sink:
        piped = spawn(argv, stdout=sink, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not ready_in(log.read_text()) and time.monotonic() < deadline and piped.poll() is None:
            time.sleep(0.1)
        assert ready_in(log.read_text())
    finally:
        stop_process(piped)
    assert piped.stderr is not None and piped.stderr.read() == ""


@pytest.fixture(scope="module")
def modelless(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    served = start_join("--no-model", "--state-dir", str(tmp_path_factory.mktemp("modelless") / "state"))
    try:
        yield served
    finally:
        served.stop()


@pytest.mark.slow
def test_ask_shows_its_wait_for_coverage_on_a_terminal_and_only_its_one_line_on_a_pipe(modelless: Served) -> None:
    argv = meshd_command("ask", "--seed", modelless.address, "--wait", "2", "hello")
    proc, out, shown = run_on_pty(argv, lambda *_: False, 60)
    assert proc.wait(10) == 1 and out == ""
    assert "waiting for the mesh to cover the model: no member holds a model 00:0" in shown, shown
    assert shown.rstrip().endswith("meshd ask: NOT_FOUND: no member holds a model"), shown
    piped = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=os.environ | {"PYTHONUNBUFFERED": "1"})
    assert piped.returncode == 1 and piped.stderr == "meshd ask: NOT_FOUND: no member holds a model\n"


@pytest.mark.slow
def test_join_shows_the_join_on_a_terminal(modelless: Served, tmp_path: Path) -> None:
    argv = meshd_command("join", "--no-model", "--listen", "127.0.0.1:0", "--seed", modelless.address,
                         "--state-dir", str(tmp_path / "state"))
    proc, out, shown = run_on_pty(argv, lambda out, _: "ready " in out, 60)
    try:
        assert "ready " in out, (out, shown)
        assert f"joining the mesh through {modelless.address} 00:0" in shown, shown
    finally:
        stop_process(proc)


def range_wait_ended(shown: str) -> bool:
    """The volunteer's range wait was drawn and then cleared (tqdm's leave=False): it serves, and the
    screen will say no more; whether it said "loading" on the way is the test's to check."""
    wait = shown.rfind("waiting for the tracker to assign this node its layers")
    return wait >= 0 and re.search(r"\r +\r$", shown[wait:]) is not None


@pytest.mark.slow
def test_a_volunteer_shows_its_wait_for_a_range_and_the_load(modelless: Served, tmp_path: Path) -> None:
    """Last in this file: it gives the model-less mesh a volunteer (which leaves again)."""
    argv = meshd_command("join", "--listen", "127.0.0.1:0", "--seed", modelless.address, "--threads", "1",
                         "--memory", "1G", "--max-sessions", "1", "--session-tokens", "256",
                         "--state-dir", str(tmp_path / "state"))
    proc, out, shown = run_on_pty(argv, lambda _, shown: "loading layers [0, 30) of" in shown or range_wait_ended(shown),
                                  120)
    try:
        assert "ready " in out, (out, shown)
        assert "loading layers [0, 30) of Smollm2 135M" in shown, shown
    finally:
        stop_process(proc)
