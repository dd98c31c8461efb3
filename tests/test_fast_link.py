"""The stage fast path (wire.fastlink, meshd.engine.fastpath) under attack, and exact.

Four layers, bottom up:

* wire.fastlink alone (sans-IO): every length is bounded before a byte of the
  frame is buffered, every altered, replayed, dropped, reordered or foreign
  frame fails to open, every step's kind, row count, draft count and body
  length is checked, and honest steps come back byte for byte however they
  are cut.
* Real engine worker processes on a tiny model's three ranges, driven as their
  daemon drives them (fast_open, fast_link with the connection as an
  SCM_RIGHTS descriptor): a hostile upstream costs its own session one typed
  error event and nothing else (the worker answers pings and serves an honest
  session beside it, bit for bit what the engine gives in process); drafted
  rows and rewinds replace KV exactly; a downstream that never reads stalls
  only its own session; three workers wired into a ring answer the whole
  model's greedy tokens, whichever of a worker's connections comes first.
* The listener and in-process stage nodes (the tiny model): a stranger's
  preamble is closed unanswered, by the pre-auth deadline when it stalls
  (without polling); bogus preambles spend their source's admission tokens,
  honest fast connections spend none.
* Three `meshd serve` stages of the default model: fast and slow sessions
  answer the whole model's greedy tokens and count the same rows, strangers'
  preambles meanwhile; a fast session finishes while the middle daemon is
  stopped (its rows never go through it).

Every process a test starts is stopped by PID; every wait is bounded (a bound
against hangs, never a speed claim).
"""

from __future__ import annotations

import array
import contextlib
import fcntl
import itertools
import os
import selectors
import signal
import socket
import subprocess
import termios
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio
from hosted import together
from hypothesis import given, settings
from hypothesis import strategies as st
from localmesh import Served, serving

from meshd.client.ask import AskRequest, AskResult
from meshd.client.route import route_at
from meshd.client.session import run_session
from meshd.engine import ops
from meshd.engine.chain import LocalChain
from meshd.engine.engine import Context, Model
from meshd.engine.fastpath import FastPlane, HeldEvents
from meshd.engine.supervisor import WorkerSpec
from meshd.engine.workerproto import encode_prefix, take_frames
from meshd.net import fastconn
from meshd.net.admission import AdmissionConfig
from meshd.net.peers import Peers, PeersConfig, open_peers
from meshd.net.urls import split_address
from meshd.stage.books import StageLimits
from meshd.stage.fast import FastDoor
from meshd.stage.node import StageNode, stage_node
from tests.conftest import greedy_reference
from wire.errors import ErrorCode, ProtocolError
from wire.fastlink import (
    KEY_BYTES,
    LENGTH,
    MAGIC,
    PREAMBLE_BYTES,
    ROWS,
    ROWS_IDS,
    STEP,
    TAG_BYTES,
    TOKEN_BYTES,
    TOKENS,
    Opener,
    Sealer,
    Step,
    preamble,
    read_preamble,
)
from wire.identity import NodeIdentity
from wire.stage import STAGE_PROTOCOL, Metrics, MetricsRequest
from wire.tensors import MAX_DRAFT

# a bound against hangs, not a speed claim
DEADLINE = 60

# ====================================================================== wire.fastlink, sans-IO

KEY = bytes(range(KEY_BYTES))
OTHER_KEY = bytes(range(1, KEY_BYTES + 1))
WIDTH = 8
MAX_ROWS = 4


def rows_of(n: int, width: int = WIDTH, seed: int = 0) -> bytes:
    """``n`` rows of ``width`` finite float32s (a stage's residual)."""
    return np.random.default_rng(seed).standard_normal((n, width), dtype=np.float32).tobytes()


def ids_of(*tokens: int) -> bytes:
    return np.asarray(tokens, dtype=np.int32).tobytes()


def feed_all(opener: Opener, data: bytes, chunk: int | None = None) -> list[Step]:
    """Feeds ``data`` never more than ``wanted()`` at once (at most ``chunk``); the steps that open."""
    steps = []
    view = memoryview(data)
    while view:
        wanted = opener.wanted()
        assert 0 < wanted <= max(LENGTH.size, opener.max_sealed)
        take = min(wanted, len(view), chunk or len(view))
        step = opener.feed(view[:take])
        view = view[take:]
        if step is not None:
            steps.append(step)
    return steps


def corrupt(opener: Opener, data: bytes) -> ProtocolError:
    """The PAYLOAD_CORRUPT error ``data`` ends in, however many frames open before it."""
    with pytest.raises(ProtocolError) as err:
        feed_all(opener, data)
    assert err.value.code is ErrorCode.PAYLOAD_CORRUPT, err.value
    return err.value


def sealed(steps: list[tuple[int, int, int, bytes]], key: bytes = KEY) -> list[bytes]:
    sealer = Sealer(key)
    return [sealer.seal(*step) for step in steps]


HONEST_STEPS = [
    (ROWS, 0, 3, rows_of(3, seed=1)),
    (ROWS_IDS, 3, 2, rows_of(2, seed=2) + ids_of(7, 9)),
    (TOKENS, 5, 1, ids_of(42)),
    (ROWS_IDS, 6, MAX_ROWS, rows_of(MAX_ROWS, seed=3) + ids_of(1, 2, 3, 4)),
]


def test_honest_steps_come_back_byte_for_byte() -> None:
    frames = sealed(HONEST_STEPS)
    steps = feed_all(Opener(KEY, WIDTH, MAX_ROWS), b"".join(frames))
    assert len(steps) == len(HONEST_STEPS)
    for (kind, pos, n, payload), step in zip(HONEST_STEPS, steps, strict=True):
        rows = n * WIDTH * 4 if kind != TOKENS else 0
        assert (step.kind, step.pos, step.n) == (kind, pos, n)
        assert step.rows == payload[:rows] and step.ids == payload[rows:]
        assert len(step.ids) == (0 if kind == ROWS else 4 * n)
    # the largest step this stage takes (every row, with its id) is exactly the bound, and opens
    assert len(frames[-1]) == LENGTH.size + Opener(KEY, WIDTH, MAX_ROWS).max_sealed


def test_steps_fed_one_byte_at_a_time_open_alike() -> None:
    data = b"".join(sealed(HONEST_STEPS))
    opener = Opener(KEY, WIDTH, MAX_ROWS)
    steps = []
    for i in range(len(data)):
        step = opener.feed(data[i:i + 1])
        if step is not None:
            steps.append(step)
    assert steps == feed_all(Opener(KEY, WIDTH, MAX_ROWS), data)
    assert [(s.kind, s.pos, s.n) for s in steps] == [(k, p, n) for k, p, n, _ in HONEST_STEPS]


@settings(max_examples=60, deadline=None)
@given(cuts=st.lists(st.integers(1, 97), min_size=1, max_size=40))
def test_steps_cut_anywhere_open_alike(cuts: list[int]) -> None:
    data = b"".join(sealed(HONEST_STEPS))
    want = feed_all(Opener(KEY, WIDTH, MAX_ROWS), data)
    opener = Opener(KEY, WIDTH, MAX_ROWS)
    steps: list[Step] = []
    view = memoryview(data)
    for size in itertools.cycle(cuts):
        if not view:
            break
        take = min(size, opener.wanted(), len(view))
        step = opener.feed(view[:take])
        view = view[take:]
        if step is not None:
            steps.append(step)
    assert steps == want


def test_more_than_wanted_is_refused() -> None:
    opener = Opener(KEY, WIDTH, MAX_ROWS)
    assert opener.wanted() == LENGTH.size
    with pytest.raises(ValueError):
        opener.feed(b"\x00" * (LENGTH.size + 1))


@pytest.mark.parametrize("over", [1, 1000, 1 << 20])
def test_a_length_over_the_bound_is_refused_before_a_byte_of_its_body(over: int) -> None:
    opener = Opener(KEY, WIDTH, MAX_ROWS)
    prefix = LENGTH.pack(opener.max_sealed + over)
    assert opener.feed(prefix[:3]) is None and opener.wanted() == 1
    # the prefix's last byte is where it ends: no byte of the frame's body is ever asked for
    with pytest.raises(ProtocolError) as err:
        opener.feed(prefix[3:])
    assert err.value.code is ErrorCode.PAYLOAD_CORRUPT and "a frame of" in err.value.message


def test_the_largest_length_asks_for_no_more_than_the_bound() -> None:
    opener = Opener(KEY, WIDTH, MAX_ROWS)
    assert opener.max_sealed == STEP.size + MAX_ROWS * (WIDTH + 1) * 4 + TAG_BYTES
    assert opener.feed(LENGTH.pack(opener.max_sealed)) is None
    assert opener.wanted() == opener.max_sealed


@pytest.mark.parametrize("size", [0, 1, STEP.size + TAG_BYTES - 1])
def test_a_frame_under_the_minimum_is_refused(size: int) -> None:
    err = corrupt(Opener(KEY, WIDTH, MAX_ROWS), LENGTH.pack(size) + bytes(size))
    assert "a frame of" in err.message


def test_a_sealed_empty_step_is_refused() -> None:
    # the smallest frame there is (a step header and its tag) opens, but says nothing
    [frame] = sealed([(ROWS, 0, 1, b"")])
    assert len(frame) == LENGTH.size + STEP.size + TAG_BYTES
    assert "with 0 bytes" in corrupt(Opener(KEY, WIDTH, MAX_ROWS), frame).message


@settings(max_examples=200, deadline=None)
@given(size=st.integers(0, (1 << 32) - 1), body=st.binary(max_size=200))
def test_no_bytes_but_a_sealed_frame_open(size: int, body: bytes) -> None:
    """Any length and body: either refused, or still waiting (never more than the bound), never a step."""
    opener = Opener(KEY, WIDTH, MAX_ROWS)
    try:
        steps = feed_all(opener, LENGTH.pack(size) + body)
    except ProtocolError as exc:
        assert exc.code is ErrorCode.PAYLOAD_CORRUPT
        return
    assert steps == [] and opener.wanted() <= opener.max_sealed


def test_every_flipped_byte_of_a_frame_fails_to_open() -> None:
    [frame] = sealed([(ROWS_IDS, 0, 1, rows_of(1) + ids_of(5))])
    cases = 0
    for i in range(len(frame)):
        for mask in (0x01, 0x80, 0xFF):
            bad = bytearray(frame)
            bad[i] ^= mask
            opener = Opener(KEY, WIDTH, MAX_ROWS)
            with pytest.raises(ProtocolError) as err:
                # a flipped length may leave the opener waiting for more: give it what it wants
                assert feed_all(opener, bytes(bad)) == []
                feed_all(opener, bytes(opener.wanted()))
            assert err.value.code is ErrorCode.PAYLOAD_CORRUPT, (i, mask)
            cases += 1
    assert cases == 3 * len(frame)


@pytest.mark.parametrize("order, opened", [
    pytest.param([0, 0], 1, id="replayed"),
    pytest.param([0, 2], 1, id="one dropped"),
    pytest.param([1, 0], 0, id="two swapped"),
    pytest.param([0, 1, 1, 2], 2, id="replayed later"),
])
def test_replayed_dropped_and_reordered_frames_fail_to_open(order: list[int], opened: int) -> None:
    frames = sealed([(ROWS, i, 1, rows_of(1, seed=i)) for i in range(3)])
    opener = Opener(KEY, WIDTH, MAX_ROWS)
    steps: list[Step] = []
    with pytest.raises(ProtocolError) as err:
        for i in order:
            steps += feed_all(opener, frames[i])
    assert err.value.code is ErrorCode.PAYLOAD_CORRUPT and "does not open" in err.value.message
    assert [s.pos for s in steps] == list(range(opened))


def test_a_frame_sealed_with_another_key_fails_to_open() -> None:
    [frame] = sealed([(ROWS, 0, 1, rows_of(1))], key=OTHER_KEY)
    assert "does not open" in corrupt(Opener(KEY, WIDTH, MAX_ROWS), frame).message


BAD_STEPS: dict[str, tuple[tuple[Any, ...], str]] = {
    "kind 0": ((0, 0, 1, rows_of(1)), "unknown step kind 0"),
    "kind 4": ((4, 0, 1, rows_of(1)), "unknown step kind 4"),
    "kind 255": ((255, 0, 1, rows_of(1)), "unknown step kind 255"),
    "no rows": ((ROWS, 0, 0, b""), "a step of 0 rows"),
    "tokens over max_rows": ((TOKENS, 0, MAX_ROWS + 1, ids_of(*range(MAX_ROWS + 1))), f"a step of {MAX_ROWS + 1} rows"),
    "rows over max_rows": ((ROWS, 0, MAX_ROWS + 1, rows_of(MAX_ROWS + 1)), "a frame of"),
    "n of 2**32 - 1": ((TOKENS, 0, (1 << 32) - 1, ids_of(1)), f"a step of {(1 << 32) - 1} rows"),
    "one row short": ((ROWS, 0, 2, rows_of(1)), "not 64"),
    "a byte over": ((ROWS, 0, 1, rows_of(1) + b"\x00"), "not 32"),
    "rows without their ids": ((ROWS_IDS, 0, 1, rows_of(1)), "not 36"),
    "ids without their rows": ((ROWS_IDS, 0, 1, ids_of(1)), "not 36"),
    "tokens with rows": ((TOKENS, 0, 1, ids_of(1) + rows_of(1)), "not 4"),
    "rows and ids as plain rows": ((ROWS, 0, 1, rows_of(1) + ids_of(1)), "not 32"),
    "every row drafted": ((ROWS, 5, 2, rows_of(2), 2), "2 drafted rows of 2"),
    "more drafts than rows": ((TOKENS, 5, 1, ids_of(1), 200), "200 drafted rows of 1"),
}


@pytest.mark.parametrize("name", list(BAD_STEPS))
def test_a_step_of_a_bad_kind_count_or_length_is_refused(name: str) -> None:
    step, message = BAD_STEPS[name]
    assert message in corrupt(Opener(KEY, WIDTH, MAX_ROWS), sealed([step])[0]).message


def test_drafted_rows_come_back_counted_and_are_bounded() -> None:
    wide = MAX_DRAFT + 4
    sealer = Sealer(KEY)
    frames = [sealer.seal(ROWS_IDS, 9, 3, rows_of(3) + ids_of(1, 2, 3), 2),
              sealer.seal(TOKENS, 12, MAX_DRAFT + 1, ids_of(*range(MAX_DRAFT + 1)), MAX_DRAFT),
              sealer.seal(TOKENS, 40, MAX_DRAFT + 2, ids_of(*range(MAX_DRAFT + 2)), MAX_DRAFT + 1)]
    opener = Opener(KEY, WIDTH, wide)
    first, most = feed_all(opener, b"".join(frames[:2]))
    assert (first.kind, first.pos, first.n, first.drafts, first.ids) == (ROWS_IDS, 9, 3, 2, ids_of(1, 2, 3))
    assert (most.n, most.drafts) == (MAX_DRAFT + 1, MAX_DRAFT)
    assert f"{MAX_DRAFT + 1} drafted rows" in corrupt(opener, frames[2]).message


def test_a_preamble_is_magic_then_the_token_and_nothing_else() -> None:
    token = bytes(range(100, 100 + TOKEN_BYTES))
    assert preamble(token) == MAGIC + token and len(preamble(token)) == PREAMBLE_BYTES
    assert read_preamble(preamble(token)) == token
    for bad in [b"", MAGIC, MAGIC + token[:-1], MAGIC + token + b"x", b"MESHFST2" + token, b"GET / HTTP/1.1\r\n\r\n",
                bytes(PREAMBLE_BYTES), token + MAGIC]:
        with pytest.raises(ValueError):
            read_preamble(bad)
    for size in (0, TOKEN_BYTES - 1, TOKEN_BYTES + 1):
        with pytest.raises(ValueError):
            preamble(bytes(size))


@pytest.mark.parametrize("size", [0, KEY_BYTES - 1, KEY_BYTES + 1])
def test_a_key_of_the_wrong_size_is_refused(size: int) -> None:
    with pytest.raises(ValueError):
        Sealer(bytes(size))
    with pytest.raises(ValueError):
        Opener(bytes(size), WIDTH, MAX_ROWS)


# ====================================================================== the worker's plane, on a fake engine


@dataclass
class FakeMiddleReport:
    """A middle stage's report, for a fake engine: rows in, rows out."""

    has_input: bool = False
    has_output: bool = False
    needs_tokens: bool = False
    stage_width: int = WIDTH
    n_vocab: int = 100


@dataclass
class FakeMiddleModel:
    report: FakeMiddleReport


class FakeEchoContext:
    """A fake engine context (not llama.cpp): gives each row back as it came, and records which
    sessions each call took; the plane's own logic is what is under test."""

    n_seq_max, n_ctx_seq, n_batch = 4, 4096, MAX_ROWS

    def __init__(self) -> None:
        self.calls: list[list[int]] = []

    def forward(self, seq: np.ndarray, pos: np.ndarray, tokens: np.ndarray | None = None,
                hidden: np.ndarray | None = None, want_output: np.ndarray | None = None) -> np.ndarray:
        self.calls.append(sorted({int(x) for x in seq}))
        assert hidden is not None
        return hidden


def test_a_step_that_does_not_fit_the_batch_waits_unwatched_and_runs_next() -> None:
    """Two sessions' steps that do not fit one engine call together: the second waits for the next
    pass, its connection unwatched meanwhile (the selector is level-triggered), then watched again;
    decode steps of both share one call."""
    selector = selectors.DefaultSelector()
    ctx = FakeEchoContext()
    plane = FastPlane(FakeMiddleModel(FakeMiddleReport()), ctx, {}, selector, lambda events: None)
    n = MAX_ROWS // 2 + 1  # two of them are over the batch
    ends = {}
    for seq in (0, 1):
        plane.open(ops.FastOpen(seq=seq, tag=seq + 1, max_pos=n + 4, prompt_len=n))
        up, up_theirs = socket.socketpair()
        down, down_theirs = socket.socketpair()
        ends[seq] = (up, down, Sealer(KEY), Opener(OTHER_KEY, WIDTH, MAX_ROWS))
        up.sendall(ends[seq][2].seal(ROWS, 0, n, rows_of(n, WIDTH, seed=seq)))
        plane.link(ops.FastLink(seq=seq, tag=seq + 1, key=OTHER_KEY, out=True), down_theirs)
        plane.link(ops.FastLink(seq=seq, tag=seq + 1, key=KEY, out=False), up_theirs)
    watched = {key.fileobj for key in selector.get_map().values()}
    assert all(getattr(plane.sessions[seq].link_in, "sock", None) in watched for seq in (0, 1))

    plane.run()
    assert ctx.calls == [[0]]
    held = plane.sessions[1].link_in
    assert held is not None and held.step is not None
    assert held.sock not in {key.fileobj for key in selector.get_map().values()}
    assert plane.ready()
    plane.run()
    assert ctx.calls == [[0], [1]]
    assert held.sock in {key.fileobj for key in selector.get_map().values()}

    def rows_back(seq: int) -> Step:
        _, down, _, opener = ends[seq]
        down.settimeout(DEADLINE)
        while (step := opener.feed(down.recv(opener.wanted()))) is None:
            pass
        return step

    for seq in (0, 1):
        step = rows_back(seq)
        assert (step.pos, step.n, step.rows) == (0, n, rows_of(n, WIDTH, seed=seq))
        ends[seq][0].sendall(ends[seq][2].seal(ROWS, n, 1, rows_of(1, WIDTH, seed=10 + seq)))
    def both_held() -> bool:
        return all(getattr(plane.sessions[seq].link_in, "step", None) is not None for seq in (0, 1))

    deadline = time.monotonic() + DEADLINE
    while not both_held() and time.monotonic() < deadline:
        for key, mask in selector.select(1.0):
            plane.on_ready(key.data, mask)
    plane.run()
    assert ctx.calls[-1] == [0, 1], "decode steps of both sessions in one engine call"
    for seq in (0, 1):
        assert rows_back(seq).rows == rows_of(1, WIDTH, seed=10 + seq)
    for seq in (0, 1):
        plane.drop(seq)
        for sock in ends[seq][:2]:
            sock.close()
    selector.close()


# ====================================================================== the tail's stream of tokens to its daemon


def token_events(*tokens: int) -> list[dict[str, Any]]:
    return [{"ev": "token", "token": t} for t in tokens]


def test_held_tokens_are_told_together_once_the_first_has_waited_the_interval() -> None:
    held = HeldEvents(interval=0.05)
    assert held.timeout(10.0) is None
    assert held.hold(token_events(1), 10.0) == []
    assert held.timeout(10.01) == pytest.approx(0.04)
    assert held.hold(token_events(2), 10.03) == []
    assert held.due(10.049) == []
    assert held.due(10.05) == token_events(1, 2)
    assert held.timeout(10.05) is None and held.due(11.0) == []
    # the interval counts from the first event held, not from the last telling
    assert held.hold(token_events(3), 20.0) == []
    assert held.hold(token_events(4), 20.06) == token_events(3, 4)


def test_a_token_told_at_once_takes_the_held_ones_along_in_order() -> None:
    held = HeldEvents(interval=0.05)
    assert held.hold(token_events(1, 2), 1.0) == []
    assert held.hold(token_events(3), 1.01, at_once=True) == token_events(1, 2, 3)
    assert held.timeout(1.01) is None
    assert held.hold([], 1.02) == [] and held.timeout(1.02) is None, "nothing held, nothing due"


def test_with_no_interval_every_token_is_told_as_it_comes() -> None:
    held = HeldEvents(interval=0.0)
    assert held.hold(token_events(1), 5.0) == token_events(1)
    assert held.hold(token_events(2, 3), 5.0) == token_events(2, 3)


# ====================================================================== engine workers, driven as a daemon would

# a step as the upstream sends it: kind, position, rows, payload[, drafted rows]
Sent = tuple[Any, ...]

TINY_RANGES = {"head": (0, 2), "mid": (2, 4), "tail": (4, 6)}
N_CTX, N_SEQ, N_BATCH = 512, 4, 64
# positions a session may take on a stage (its reservation)
MAX_POS = 16
TAGS = itertools.count(1)


@dataclass
class FastEnds:
    """Our ends of one fast session's two connections on a worker: we are its upstream and downstream."""

    seq: int
    tag: int
    up: socket.socket
    down: socket.socket
    sealer: Sealer
    opener: Opener

    def send(self, kind: int, pos: int, n: int, payload: bytes, drafts: int = 0) -> None:
        self.up.sendall(self.sealer.seal(kind, pos, n, payload, drafts))

    def read(self, n: int) -> list[Step]:
        """The next ``n`` steps the worker sends downstream."""
        steps: list[Step] = []
        while len(steps) < n:
            data = self.down.recv(min(self.opener.wanted(), 1 << 16))
            assert data, f"the worker closed session {self.seq}'s downstream after {len(steps)} of {n} steps"
            step = self.opener.feed(data)
            if step is not None:
                steps.append(step)
        return steps

    def closed_by_worker(self) -> bool:
        """Reads the downstream to its end (whatever the worker sent first): True once it is closed."""
        for _ in range(10_000):
            try:
                if not self.down.recv(1 << 16):
                    return True
            except ConnectionResetError:
                return True
        return False

    def close(self) -> None:
        self.up.close()
        self.down.close()


class RawWorker:
    """An engine worker process on blocking sockets of this test (no supervisor): requests, replies, events."""

    # the tiny model's residual: what every one of its stages takes and gives
    width = 64

    def __init__(self, spec: WorkerSpec) -> None:
        self.sock, theirs = socket.socketpair()
        self.events, their_events = socket.socketpair()
        try:
            self.proc = subprocess.Popen(spec.argv(theirs.fileno(), their_events.fileno()),
                                         pass_fds=(theirs.fileno(), their_events.fileno()), stdin=subprocess.DEVNULL)
        finally:
            theirs.close()
            their_events.close()
        self.sock.settimeout(DEADLINE)
        self.events.settimeout(DEADLINE)
        self._replies = bytearray()
        self._events = bytearray()
        self._seen: list[dict[str, Any]] = []
        ready = self._next_reply()
        assert ready["ok"], ready
        self.pid = int(ready["pid"])
        assert self.pid == self.proc.pid

    def stop(self) -> None:
        self.sock.close()
        self.events.close()
        try:
            self.proc.wait(DEADLINE)
        finally:
            if self.proc.poll() is None:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(DEADLINE)

    def _next_reply(self) -> dict[str, Any]:
        while not (frames := take_frames(self._replies)):
            chunk = self.sock.recv(1 << 16)
            assert chunk, "the worker closed its socket"
            self._replies += chunk
        assert len(frames) == 1 and not self._replies, "the worker sent more than one reply"
        return frames[0]

    def call(self, header: dict[str, Any], fds: tuple[int, ...] = ()) -> dict[str, Any]:
        """One request (the descriptors riding with its first byte, as the supervisor sends them), its reply."""
        head = encode_prefix(header, 0)
        ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
        sent = self.sock.sendmsg([head], ancillary)
        self.sock.sendall(head[sent:])
        return self._next_reply()

    def ok(self, header: dict[str, Any], fds: tuple[int, ...] = ()) -> dict[str, Any]:
        reply = self.call(header, fds)
        assert reply["ok"], (header["op"], reply)
        return reply

    def event(self, wanted: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
        """The next event ``wanted`` takes (events before it are kept for ``pending_events``)."""
        for _ in range(10_000):
            for i, ev in enumerate(self._seen):
                if wanted(ev):
                    return self._seen.pop(i)
            chunk = self.events.recv(1 << 16)
            assert chunk, "the worker closed its events socket"
            self._events += chunk
            self._seen += take_frames(self._events)
        raise AssertionError("no such event among 10,000 reads")

    def pending_events(self) -> list[dict[str, Any]]:
        """Every event already sent (read without waiting), and those kept."""
        self.events.setblocking(False)
        try:
            while True:
                try:
                    chunk = self.events.recv(1 << 16)
                except BlockingIOError:
                    break
                assert chunk, "the worker closed its events socket"
                self._events += chunk
        finally:
            self.events.settimeout(DEADLINE)
        self._seen += take_frames(self._events)
        seen, self._seen = self._seen, []
        return seen

    def fast_session(self, seq: int, max_pos: int = MAX_POS, prompt_len: int = 4, *, down_sndbuf: int = 0,
                     prefill: list[Sent] | None = None, upstream_first: bool = False,
                     **opened: Any) -> FastEnds:
        """fast_open, then its downstream and upstream connections handed over (our ends returned).

        ``prefill`` steps are in the upstream connection before the worker gets it; ``down_sndbuf``
        shrinks what the kernel takes of the worker's writes downstream; ``upstream_first`` hands
        the upstream connection over before the downstream one (a daemon may do either: its two
        connections of a session are set up by two tasks)."""
        tag = next(TAGS)
        self.ok({"op": "fast_open", "seq": seq, "tag": tag, "max_pos": max_pos, "prompt_len": prompt_len,
                 "max_tokens": 8, **opened})
        key_in, key_out = os.urandom(KEY_BYTES), os.urandom(KEY_BYTES)
        up, up_theirs = socket.socketpair()
        down, down_theirs = socket.socketpair()
        ends = FastEnds(seq, tag, up, down, Sealer(key_in), Opener(key_out, self.width, N_BATCH))
        try:
            for s in (up, down):
                s.settimeout(DEADLINE)
            if down_sndbuf:
                down_theirs.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, down_sndbuf)
            for step in prefill or []:
                ends.send(*step)
            links = [({"out": True, "key": key_out}, down_theirs), ({"out": False, "key": key_in}, up_theirs)]
            for link, theirs in reversed(links) if upstream_first else links:
                self.ok({"op": "fast_link", "seq": seq, "tag": tag, **link}, fds=(theirs.fileno(),))
        except BaseException:
            ends.close()
            raise
        finally:
            # the worker holds its own copies now
            up_theirs.close()
            down_theirs.close()
        return ends

    def forget(self, *seqs: int) -> None:
        """As the daemon ends a session: its KV cleared, its fast session dropped (connections closed)."""
        for seq in seqs:
            self.ok({"op": "remove", "seq": seq})


@pytest.fixture(scope="module")
def tiny(tiny_models: dict[str, Path]) -> Path:
    return tiny_models["llama-gqa-tied"]


@pytest.fixture(scope="module")
def workers(tiny: Path) -> Iterator[dict[str, RawWorker]]:
    started: dict[str, RawWorker] = {}
    try:
        for name, layers in TINY_RANGES.items():
            started[name] = RawWorker(WorkerSpec(tiny, layers, n_ctx=N_CTX, n_seq_max=N_SEQ, n_batch=N_BATCH,
                                                 threads=1))
        yield started
    finally:
        for w in started.values():
            w.stop()


class Reference:
    """The same range in this process (``Context.forward``): what a worker's fast steps must equal, bit for bit."""

    def __init__(self, model: Path, layers: tuple[int, int]) -> None:
        self.model = Model(model, layers)
        self.ctx = Context(self.model, n_ctx=N_CTX, n_seq_max=N_SEQ, n_batch=N_BATCH, n_threads=1, poll=0)

    def run(self, seq: int, steps: list[Sent]) -> list[bytes]:
        """The rows each step gives (a fresh sequence ``seq``; a step at a position held replaces
        what the sequence holds from there, as a rejected draft's)."""
        self.ctx.remove(seq, 0, -1)
        report = self.model.report
        out = []
        held = 0
        for kind, pos, n, payload, *_ in steps:
            if pos < held:
                self.ctx.remove(seq, pos, -1)
            held = pos + n
            positions = np.arange(pos, pos + n, dtype=np.int32)
            seqs = np.full(n, seq, dtype=np.int32)
            if kind == TOKENS:
                rows = self.ctx.forward(seqs, positions, tokens=np.frombuffer(payload, np.int32))
            else:
                hidden = np.frombuffer(payload[:n * report.stage_width * 4], np.float32).reshape(n, -1)
                rows = self.ctx.forward(seqs, positions, hidden=hidden)
            out.append(rows.tobytes())
        self.ctx.remove(seq, 0, -1)
        return out

    def close(self) -> None:
        self.ctx.close()
        self.model.close()


@pytest.fixture(scope="module")
def mid_ref(tiny: Path) -> Iterator[Reference]:
    ref = Reference(tiny, TINY_RANGES["mid"])
    yield ref
    ref.close()


@pytest.fixture(scope="module")
def head_ref(tiny: Path) -> Iterator[Reference]:
    ref = Reference(tiny, TINY_RANGES["head"])
    yield ref
    ref.close()


W = RawWorker.width
N_VOCAB = 264


def nan_rows(n: int) -> bytes:
    rows = np.frombuffer(rows_of(n, W), np.float32).copy()
    rows[W + 3 if n > 1 else 3] = np.nan
    return rows.tobytes()


def inf_rows(n: int) -> bytes:
    rows = np.frombuffer(rows_of(n, W), np.float32).copy()
    rows[-1] = -np.inf
    return rows.tobytes()


def flipped(frame: bytes, at: int) -> bytes:
    bad = bytearray(frame)
    bad[at] ^= 0x10
    return bytes(bad)


def max_sealed() -> int:
    return STEP.size + N_BATCH * (W + 1) * 4 + TAG_BYTES


# What a hostile upstream sends a middle stage (given its session's sealer), the session's error,
# and how the session was opened (whether its rows come with token ids)
Attack = Callable[[Sealer], bytes]
MID_ATTACKS: dict[str, tuple[Attack, ErrorCode, dict[str, Any]]] = {
    "a step at another position": (
        lambda s: s.seal(ROWS, 3, 1, rows_of(1, W)), ErrorCode.CACHE_MISS, {}),
    "a step at a position already run": (
        lambda s: s.seal(ROWS, 0, 2, rows_of(2, W)) + s.seal(ROWS, 1, 1, rows_of(1, W)), ErrorCode.CACHE_MISS, {}),
    "a step past the session's positions": (
        lambda s: s.seal(ROWS, 0, MAX_POS + 1, rows_of(MAX_POS + 1, W)), ErrorCode.OVERLOADED, {}),
    "a step that ends past them": (
        lambda s: s.seal(ROWS, 0, MAX_POS - 1, rows_of(MAX_POS - 1, W)) + s.seal(ROWS, MAX_POS - 1, 2, rows_of(2, W)),
        ErrorCode.OVERLOADED, {}),
    "a NaN in the rows": (lambda s: s.seal(ROWS, 0, 2, nan_rows(2)), ErrorCode.PAYLOAD_CORRUPT, {}),
    "an infinity in the rows": (lambda s: s.seal(ROWS, 0, 3, inf_rows(3)), ErrorCode.PAYLOAD_CORRUPT, {}),
    "garbage bytes": (lambda s: b"\xff" * 64, ErrorCode.PAYLOAD_CORRUPT, {}),
    "a frame of zeros": (lambda s: bytes(64), ErrorCode.PAYLOAD_CORRUPT, {}),
    "a length one over the bound": (lambda s: LENGTH.pack(max_sealed() + 1), ErrorCode.PAYLOAD_CORRUPT, {}),
    "a frame sealed with another key": (
        lambda s: Sealer(OTHER_KEY).seal(ROWS, 0, 1, rows_of(1, W)), ErrorCode.PAYLOAD_CORRUPT, {}),
    "a flipped byte in the seal": (
        lambda s: flipped(s.seal(ROWS, 0, 1, rows_of(1, W)), -1), ErrorCode.PAYLOAD_CORRUPT, {}),
    "a flipped byte in the step's header": (
        lambda s: flipped(s.seal(ROWS, 0, 1, rows_of(1, W)), LENGTH.size + 2), ErrorCode.PAYLOAD_CORRUPT, {}),
    "a replayed frame": (lambda s: 2 * s.seal(ROWS, 0, 1, rows_of(1, W)), ErrorCode.PAYLOAD_CORRUPT, {}),
    "a dropped frame": (
        lambda s: [s.seal(ROWS, 0, 1, rows_of(1, W)), s.seal(ROWS, 1, 1, rows_of(1, W))][1], ErrorCode.PAYLOAD_CORRUPT,
        {}),
    "an unknown step kind": (lambda s: s.seal(9, 0, 1, rows_of(1, W)), ErrorCode.PAYLOAD_CORRUPT, {}),
    "a body one row short": (lambda s: s.seal(ROWS, 0, 2, rows_of(1, W)), ErrorCode.PAYLOAD_CORRUPT, {}),
    "the ring's tokens at a middle stage": (lambda s: s.seal(TOKENS, 0, 1, ids_of(5)), ErrorCode.BAD_REQUEST, {}),
    "token ids the session sends this stage none of": (
        lambda s: s.seal(ROWS_IDS, 0, 1, rows_of(1, W) + ids_of(5)), ErrorCode.BAD_REQUEST, {}),
    "rows without the ids the session sends": (
        lambda s: s.seal(ROWS, 0, 1, rows_of(1, W)), ErrorCode.BAD_REQUEST, {"gets_ids": True, "carry": 1}),
    "a token id past the vocabulary": (
        lambda s: s.seal(ROWS_IDS, 0, 2, rows_of(2, W) + ids_of(5, N_VOCAB)), ErrorCode.BAD_REQUEST,
        {"gets_ids": True, "carry": 1}),
    "a negative token id": (
        lambda s: s.seal(ROWS_IDS, 0, 1, rows_of(1, W) + ids_of(-1)), ErrorCode.BAD_REQUEST,
        {"gets_ids": True, "carry": 1}),
    "drafted rows in the prompt": (lambda s: s.seal(ROWS, 0, 3, rows_of(3, W), 1), ErrorCode.BAD_REQUEST, {}),
    "a rewind to before the drafts": (
        lambda s: s.seal(ROWS, 0, 4, rows_of(4, W)) + s.seal(ROWS, 4, 3, rows_of(3, W), 2)
        + s.seal(ROWS, 4, 1, rows_of(1, W)), ErrorCode.CACHE_MISS, {}),
    "a rewind into verified rows": (
        lambda s: s.seal(ROWS, 0, 4, rows_of(4, W)) + s.seal(ROWS, 4, 3, rows_of(3, W), 1)
        + s.seal(ROWS, 7, 1, rows_of(1, W)) + s.seal(ROWS, 6, 1, rows_of(1, W)), ErrorCode.CACHE_MISS, {}),
    "drafts past the session's positions": (
        lambda s: s.seal(ROWS, 0, 4, rows_of(4, W)) + s.seal(ROWS, 4, MAX_POS - 3, rows_of(MAX_POS - 3, W), 3),
        ErrorCode.OVERLOADED, {}),
}
HONEST_MID = [(ROWS, 0, 4, rows_of(4, W, seed=11)), (ROWS, 4, 1, rows_of(1, W, seed=12)),
              (ROWS, 5, 1, rows_of(1, W, seed=13))]


def assert_rows(steps: list[Step], sent: list[Sent], want: list[bytes]) -> None:
    """The worker's steps are the rows ``want`` says, at the positions (and with the drafts) sent."""
    assert [(s.kind, s.pos, s.n, s.drafts) for s in steps] == [(ROWS, s[1], s[2], s[4] if len(s) > 4 else 0)
                                                               for s in sent]
    for i, (step, rows) in enumerate(zip(steps, want, strict=True)):
        assert step.rows == rows, f"step {i}: the worker's rows differ from Context.forward's"


def errors_of(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in events if e.get("ev") == "error"]


@pytest.mark.slow
@pytest.mark.parametrize("attack", list(MID_ATTACKS))
def test_a_hostile_upstream_fails_its_session_alone(workers: dict[str, RawWorker], mid_ref: Reference,
                                                     attack: str) -> None:
    mid = workers["mid"]
    send, code, opened = MID_ATTACKS[attack]
    hostile = mid.fast_session(1, **opened)
    honest = mid.fast_session(0)
    try:
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            hostile.up.sendall(send(hostile.sealer))
        honest.send(*HONEST_MID[0])
        error = mid.event(lambda e: e.get("ev") == "error")
        assert (error["seq"], error["tag"], error["code"]) == (1, hostile.tag, code.value), error
        # the failed session's connections are closed; the worker runs nothing more of it
        assert hostile.closed_by_worker()
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            hostile.up.sendall(b"\x00" * 64 + send(hostile.sealer))
        for step in HONEST_MID[1:]:
            honest.send(*step)
        assert_rows(honest.read(len(HONEST_MID)), HONEST_MID, mid_ref.run(0, HONEST_MID))
        assert mid.ok({"op": "ping"}) == {"ok": True}
        assert errors_of(mid.pending_events()) == [], "one error event per failed session, none for the honest one"
        assert mid.proc.poll() is None
    finally:
        mid.forget(0, 1)
        hostile.close()
        honest.close()


HEAD_PROMPT = [3, 17, 99, 200]
# (what the hostile tail sends, the session's error, its positions)
HEAD_ATTACKS: dict[str, tuple[Attack, ErrorCode, int]] = {
    "rows on the ring": (lambda s: s.seal(ROWS, 4, 1, rows_of(1, W)), ErrorCode.BAD_REQUEST, MAX_POS),
    "rows and ids on the ring": (
        lambda s: s.seal(ROWS_IDS, 4, 1, rows_of(1, W) + ids_of(5)), ErrorCode.BAD_REQUEST, MAX_POS),
    "two tokens a step": (lambda s: s.seal(TOKENS, 4, 2, ids_of(5, 6)), ErrorCode.BAD_REQUEST, MAX_POS),
    "a token past the vocabulary": (lambda s: s.seal(TOKENS, 4, 1, ids_of(N_VOCAB)), ErrorCode.BAD_REQUEST, MAX_POS),
    "a token at the prompt's positions": (lambda s: s.seal(TOKENS, 2, 1, ids_of(5)), ErrorCode.CACHE_MISS, MAX_POS),
    "a token a position ahead": (lambda s: s.seal(TOKENS, 5, 1, ids_of(5)), ErrorCode.CACHE_MISS, MAX_POS),
    "a token past the session's positions": (
        lambda s: s.seal(TOKENS, 4, 1, ids_of(5)) + s.seal(TOKENS, 5, 1, ids_of(6)), ErrorCode.OVERLOADED,
        len(HEAD_PROMPT) + 1),
    "a replayed token": (lambda s: 2 * s.seal(TOKENS, 4, 1, ids_of(5)), ErrorCode.PAYLOAD_CORRUPT, MAX_POS),
}


@pytest.mark.slow
@pytest.mark.parametrize("attack", list(HEAD_ATTACKS))
def test_a_hostile_ring_fails_its_head_session_alone(workers: dict[str, RawWorker], head_ref: Reference,
                                                      attack: str) -> None:
    """At the head the prompt runs at once; the ring brings one token a step (here, from a hostile tail)."""
    head = workers["head"]
    send, code, max_pos = HEAD_ATTACKS[attack]
    prompt = ids_of(*HEAD_PROMPT)
    n = len(HEAD_PROMPT)
    hostile = head.fast_session(1, max_pos=max_pos, prompt_len=n, prompt=HEAD_PROMPT)
    honest = head.fast_session(0, prompt_len=n, prompt=HEAD_PROMPT)
    try:
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            hostile.up.sendall(send(hostile.sealer))
        error = head.event(lambda e: e.get("ev") == "error")
        assert (error["seq"], error["tag"], error["code"]) == (1, hostile.tag, code.value), error
        assert hostile.closed_by_worker()
        sent = [(TOKENS, 0, n, prompt), (TOKENS, n, 1, ids_of(77)), (TOKENS, n + 1, 1, ids_of(5))]
        honest.send(*sent[1])
        honest.send(*sent[2])
        assert_rows(honest.read(3), sent, head_ref.run(0, sent))
        assert head.ok({"op": "ping"}) == {"ok": True}
        assert errors_of(head.pending_events()) == []
    finally:
        head.forget(0, 1)
        hostile.close()
        honest.close()


@pytest.mark.slow
def test_drafted_rows_pass_on_and_a_rewind_replaces_them_exactly(workers: dict[str, RawWorker],
                                                                  mid_ref: Reference) -> None:
    """Speculation on the fast path, at a middle stage: drafted rows run and go on with their count; the
    next step may start inside them (the drafts from there were rejected): the stage drops their KV first."""
    mid = workers["mid"]
    steps: list[Sent] = [
        (ROWS, 0, 4, rows_of(4, W, seed=31)),
        (ROWS, 4, 3, rows_of(3, W, seed=32), 2),  # a verified row, then two drafts (5 and 6)
        (ROWS, 5, 3, rows_of(3, W, seed=33), 2),  # draft 5 was wrong: 5 again, then drafts 6 and 7
        (ROWS, 6, 2, rows_of(2, W, seed=34), 1),  # draft 6 was wrong too
        (ROWS, 8, 1, rows_of(1, W, seed=35)),  # draft 7 was right: on after it
    ]
    before = mid.ok({"op": "fast_stats"})["stats"]
    honest = mid.fast_session(0)
    try:
        for step in steps:
            honest.send(*step)
        assert_rows(honest.read(len(steps)), steps, mid_ref.run(0, steps))
        state = mid.ok({"op": "fast_state", "seq": 0})
        assert (state["next_pos"], state["draft_from"]) == (9, None), state
        assert mid.ok({"op": "fast_stats"})["stats"]["draft_rewinds"] - before["draft_rewinds"] == 2
        assert errors_of(mid.pending_events()) == []
    finally:
        mid.forget(0)
        honest.close()


def unread_bytes(sock: socket.socket) -> int:
    buf = array.array("i", [0])
    fcntl.ioctl(sock.fileno(), termios.FIONREAD, buf)
    return buf[0]


def cpu_seconds(pid: int) -> float:
    """User and system CPU of a process (every thread), from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.mark.slow
def test_a_downstream_that_never_reads_stalls_only_its_session(workers: dict[str, RawWorker],
                                                                 mid_ref: Reference) -> None:
    mid = workers["mid"]
    steps, n = 24, 4
    stalled_steps = [(ROWS, i * n, n, rows_of(n, W, seed=100 + i)) for i in range(steps)]
    # every step is in the upstream connection before the worker gets it; the kernel takes a few
    # KB of its writes downstream, where nobody reads
    stalled = mid.fast_session(2, max_pos=steps * n, prompt_len=n, down_sndbuf=1, prefill=stalled_steps)
    honest = mid.fast_session(0)
    try:
        # each ping is one more turn of the worker's loop, each turn one more step of the stalled
        # session while it has somewhere to write: after these it has run out of room
        for _ in range(steps + 2):
            assert mid.ok({"op": "ping"}) == {"ok": True}
        frame = LENGTH.size + STEP.size + n * W * 4 + TAG_BYTES
        held = unread_bytes(stalled.down)
        assert 0 < held < steps * frame, f"{held} bytes downstream: the output did not back up"
        # a step held, more bytes behind it upstream, no room downstream: the worker waits, it does not
        # wake for those bytes again and again (the selector is level-triggered)
        spent = cpu_seconds(mid.pid)
        time.sleep(1.0)
        assert cpu_seconds(mid.pid) - spent < 0.2, "the worker spun while its session's step was held"
        # the worker is not blocked: an honest session beside it runs, exactly
        for step in HONEST_MID:
            honest.send(*step)
        assert_rows(honest.read(len(HONEST_MID)), HONEST_MID, mid_ref.run(0, HONEST_MID))
        assert mid.ok({"op": "ping"}) == {"ok": True}
        # read at last, the stalled session's every step comes, in order, exactly
        assert_rows(stalled.read(steps), stalled_steps, mid_ref.run(2, stalled_steps))
        assert errors_of(mid.pending_events()) == []
    finally:
        mid.forget(0, 2)
        stalled.close()
        honest.close()


@pytest.mark.slow
def test_three_workers_wired_into_a_ring_answer_the_whole_models_greedy_tokens(
        workers: dict[str, RawWorker], tiny: Path) -> None:
    """The data plane alone: head, middle and tail workers connected to each other directly (as
    the daemons hand them their connections), the prompt in at the head, tokens out at the tail."""
    prompt, new = [1, 40, 80, 120, 160, 200], 8
    chain = LocalChain(tiny, None, n_ctx=256, n_threads=1)
    try:
        want = list(chain.generate(prompt, new))
    finally:
        chain.close()
    seq = 3
    head, mid, tail = workers["head"], workers["mid"], workers["tail"]
    before = {name: w.ok({"op": "fast_stats"})["stats"] for name, w in workers.items()}
    tags = {name: next(TAGS) for name in workers}
    common = {"seq": seq, "max_pos": len(prompt) + new, "prompt_len": len(prompt), "max_tokens": new}
    tail.ok({"op": "sampler_new", "sid": seq, "params": {}})
    head.ok({"op": "fast_open", "tag": tags["head"], "prompt": prompt, **common})
    mid.ok({"op": "fast_open", "tag": tags["mid"], **common})
    tail.ok({"op": "fast_open", "tag": tags["tail"], "history": prompt, **common})
    wires = [("head", "mid"), ("mid", "tail"), ("tail", "head")]
    try:
        ends = {wire: socket.socketpair() for wire in wires}
        keys = {wire: os.urandom(KEY_BYTES) for wire in wires}
        try:
            # each worker gets its downstream connection before its upstream one (see
            # test_a_tail_whose_ring_comes_after_its_rows_still_sends_the_head_its_token)
            for (up, down), (a, _) in ends.items():
                workers[up].ok({"op": "fast_link", "seq": seq, "tag": tags[up], "out": True, "key": keys[up, down]},
                               fds=(a.fileno(),))
            for (up, down), (_, b) in ends.items():
                workers[down].ok({"op": "fast_link", "seq": seq, "tag": tags[down], "out": False,
                                  "key": keys[up, down]}, fds=(b.fileno(),))
        finally:
            for a, b in ends.values():
                a.close()
                b.close()
        got: list[int] = []
        for _ in range(new):
            ev = tail.event(lambda e: e.get("ev") in ("token", "error") and e.get("tag") == tags["tail"])
            assert ev["ev"] == "token", ev
            got.append(int(ev["token"]))
            if ev["eog"]:
                break
        assert got == want
        for name, w in workers.items():
            stats = w.ok({"op": "fast_stats"})["stats"]
            # the prompt and every token but the last went round the ring once
            assert stats["engine_calls"] > before[name]["engine_calls"], name
            assert stats["rows"] - before[name]["rows"] == len(prompt) + len(want) - 1, name
            # the worker's own time on each decode hop: every decode step that came from upstream and sent
            # its output on (the tail's last sends nothing), and time counted for each
            calls = stats["decode_calls"] - before[name]["decode_calls"]
            assert calls == len(want) - (2 if name == "tail" else 1), name
            for key in ("hop_in_us", "hop_out_us"):
                assert stats[key] - before[name][key] > 0, (name, key)
        for w in workers.values():
            assert errors_of(w.pending_events()) == []
    finally:
        for w in workers.values():
            w.forget(seq)
        tail.ok({"op": "sampler_free", "sid": seq})


@pytest.mark.slow
def test_a_tail_whose_ring_comes_after_its_rows_still_sends_the_head_its_token(workers: dict[str, RawWorker]) -> None:
    """The daemon hands a session's two connections over from two tasks, in either order (a tail's
    upstream one often comes first). A tail that sampled before its ring connection came would owe
    the head that token for ever, and the session would stall (as it did before FastPlane._next
    waited for the tail's ring connection too)."""
    tail = workers["tail"]
    seq, n = 2, 4
    tail.ok({"op": "sampler_new", "sid": seq, "params": {}})
    # the middle stage's rows of the prompt are there when the tail gets its upstream connection,
    # and the connection to the head comes second
    ring = tail.fast_session(seq, prompt_len=n, history=[5, 6, 7, 8], upstream_first=True,
                             prefill=[(ROWS, 0, n, rows_of(n, W, seed=21))])
    try:
        token = tail.event(lambda e: e.get("ev") in ("token", "error") and e.get("tag") == ring.tag)
        assert token["ev"] == "token", token
        # the worker sends the token around the ring as it samples it: by this reply it has
        assert tail.ok({"op": "ping"}) == {"ok": True}
        assert unread_bytes(ring.down) > 0, f"the tail sampled {token['token']} and sent the head nothing"
        [step] = ring.read(1)
        assert (step.kind, step.pos, step.n, step.ids) == (TOKENS, n, 1, ids_of(token["token"]))
    finally:
        tail.forget(seq)
        tail.ok({"op": "sampler_free", "sid": seq})
        ring.close()


@pytest.mark.slow
def test_a_tail_tells_its_daemon_a_held_token_when_no_step_comes_after_it(workers: dict[str, RawWorker]) -> None:
    """The first token is told at once; the second is held for the ones after it (STREAM_INTERVAL),
    and with no step coming after it the worker's timer tells it: no token waits on the next one."""
    tail = workers["tail"]
    seq, n = 2, 4
    tail.ok({"op": "sampler_new", "sid": seq, "params": {}})
    ring = tail.fast_session(seq, prompt_len=n, history=[5, 6, 7, 8], prefill=[(ROWS, 0, n, rows_of(n, W, seed=3))])
    try:
        def told(e: dict[str, Any]) -> bool:
            return e.get("ev") in ("token", "error") and e.get("tag") == ring.tag

        first = tail.event(told)
        assert first["ev"] == "token", first
        [step] = ring.read(1)
        assert step.ids == ids_of(first["token"])
        ring.send(ROWS, n, 1, rows_of(1, W, seed=4))
        [step] = ring.read(1)
        second = tail.event(told)
        assert second["ev"] == "token" and step.ids == ids_of(second["token"]), second
    finally:
        tail.forget(seq)
        tail.ok({"op": "sampler_free", "sid": seq})
        ring.close()


# ====================================================================== stage nodes: the listener's fast door

# where strangers connect from: a source of their own, as a remote attacker's would be (honest stages dial
# from 127.0.0.1)
STRANGER_SOURCE = "127.0.0.2"
PREAUTH = 3.0
TINY_LIMITS = StageLimits(max_sessions=4, max_session_tokens=128)
TINY_TOKENS = 6


@asynccontextmanager
async def tiny_mesh(model: Path) -> AsyncIterator[list[StageNode]]:
    """Head, middle and tail of the tiny model, each a stage node of this process with its engine worker."""
    config = PeersConfig(drain_timeout=0.5, admission=AdmissionConfig(preauth_timeout=PREAUTH))
    async with together([stage_node(model, layers, TINY_LIMITS, NodeIdentity.generate(), config, threads=1)
                         for layers in TINY_RANGES.values()]) as nodes:
        yield nodes


async def ask(peers: Peers, addresses: list[str], prompt: str, fast: bool, max_tokens: int) -> list[int]:
    request = AskRequest(messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens, fast=fast)
    with trio.fail_after(DEADLINE):
        result = await run_session(peers, route_at(addresses), request, AskResult())
    assert result.tokens
    return result.tokens


@dataclass
class Paths:
    """A stage's engine calls: its daemon's (every slow row goes through them), its worker's fast batches."""

    daemon: int
    fast: int


async def paths(nodes: list[StageNode]) -> list[Paths]:
    counts = []
    for node in nodes:
        reply, _ = await node.engine.call({"op": "fast_stats"})
        counts.append(Paths(node.service.metrics.engine_calls, int(reply["stats"]["engine_calls"])))
    return counts


async def stranger(address: str, data: bytes, heard: list[bytes], source: str = STRANGER_SOURCE,
                   sent: list[bytes] | None = None) -> None:
    """Connects from ``source``, sends ``data`` (then notes it in ``sent``), and keeps what the stage
    answers until it closes the connection."""
    host, port = split_address(address)
    with trio.fail_after(DEADLINE):
        stream = await trio.open_tcp_stream(host, port, local_address=source)
        async with stream:
            await stream.send_all(data)
            if sent is not None:
                sent.append(data)
            got = b""
            while True:
                try:
                    chunk = await stream.receive_some(1024)
                except trio.BrokenResourceError:
                    break  # reset: closed with bytes of ours unread
                if not chunk:
                    break
                got += chunk
    heard.append(got)


def strangers() -> dict[str, bytes]:
    token = os.urandom(TOKEN_BYTES)
    return {
        "a random token": MAGIC + os.urandom(TOKEN_BYTES),
        "a random token, then sealed rows": MAGIC + token + Sealer(os.urandom(KEY_BYTES)).seal(ROWS, 0, 1, rows_of(1, W)),
        "the magic alone": MAGIC,
        "a part of the magic": MAGIC[:5],
        "a byte": MAGIC[:1],
        "a token a byte short": (MAGIC + token)[:-1],
    }


class CountingTrio:
    """trio, with the sleeps of the module that uses it counted."""

    def __init__(self) -> None:
        self.sleeps = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(trio, name)

    async def sleep(self, seconds: float) -> None:
        self.sleeps += 1
        await trio.sleep(seconds)


@pytest.mark.parametrize("first", [
    pytest.param(b"", id="nothing"),
    pytest.param(MAGIC, id="the magic"),
    # is_fast once peeked again every 5 ms while the first bytes were a part of MAGIC: each stalled
    # stranger woke the listener's event loop 200 times a second until its pre-auth deadline
    pytest.param(MAGIC[:3], id="a part of the magic"),
])
async def test_a_stalled_stranger_costs_the_listener_no_polling(monkeypatch: pytest.MonkeyPatch,
                                                               first: bytes) -> None:
    """A stranger that sends a few bytes and stalls waits for its pre-auth deadline as one that sends
    nothing does: on its socket, not in a loop of peeks."""
    counting = CountingTrio()
    monkeypatch.setattr(fastconn, "trio", counting)
    async with open_peers(NodeIdentity.generate(), PeersConfig(admission=AdmissionConfig(preauth_timeout=1.0))) as node:
        node.handle_fast(FastDoor().accept)
        port = await node.listen("127.0.0.1", 0)
        heard: list[bytes] = []
        await stranger(f"127.0.0.1:{port}", first, heard)
    assert heard == [b""]
    assert counting.sleeps <= 2, f"the listener woke {counting.sleeps} times to look at one stalled stranger"


@pytest.mark.slow
async def test_a_strangers_preamble_is_closed_unanswered_and_the_stages_serve_on(tiny: Path, peers: Peers) -> None:
    prompt = "Name a colour."
    async with tiny_mesh(tiny) as nodes:
        addresses = [n.address for n in nodes]
        slow = await ask(peers, addresses, prompt, fast=False, max_tokens=TINY_TOKENS)
        before = await paths(nodes)
        heard: list[bytes] = []
        async with trio.open_nursery() as nursery:
            for address in addresses:
                for data in strangers().values():
                    nursery.start_soon(stranger, address, data, heard)
            # while they wait for their deadline, an honest fast session takes its connections
            fast = await ask(peers, addresses, prompt, fast=True, max_tokens=TINY_TOKENS)
        # every stranger's connection closed (those that stall, by the pre-auth deadline) with no
        # ACCEPTED, nor any other byte
        assert heard == [b""] * len(addresses) * len(strangers())
        assert fast == slow
        after = await paths(nodes)
        for i, (b, a) in enumerate(zip(before, after, strict=True)):
            assert a.daemon == b.daemon, f"stage {i}: the fast session's rows went through its daemon"
            assert a.fast > b.fast, f"stage {i}: its worker ran none of the fast session"
        # and after them: both paths still answer alike, each its own way
        assert await ask(peers, addresses, prompt, fast=True, max_tokens=TINY_TOKENS) == slow
        assert await ask(peers, addresses, prompt, fast=False, max_tokens=TINY_TOKENS) == slow
        last = await paths(nodes)
        for i, (b, a) in enumerate(zip(after, last, strict=True)):
            assert a.daemon > b.daemon and a.fast > b.fast, i


@pytest.mark.slow
async def test_bogus_preambles_cost_their_source_and_honest_fast_links_cost_nothing(tiny: Path, peers: Peers) -> None:
    """A flood of bogus fast connections from one source, twice the pending connections a source may
    have at each stage, while honest fast sessions set up theirs: every honest session takes the fast
    path and answers alike; only the flood's source is charged for its failures (admission tokens),
    the stages' own (their fast connections are handed off, as proven by their token) never."""
    config = AdmissionConfig()
    prompts = ["Name a colour.", "Count to three.", "Say hello."]
    async with tiny_mesh(tiny) as nodes:
        addresses = [n.address for n in nodes]
        want = [await ask(peers, addresses, p, fast=False, max_tokens=TINY_TOKENS) for p in prompts]
        before = await paths(nodes)
        heard: list[bytes] = []
        sent: list[bytes] = []
        got: list[list[int]] = []
        flood = 2 * config.max_preauth_per_source
        async with trio.open_nursery() as nursery:
            for address in addresses:
                for _ in range(flood):
                    nursery.start_soon(stranger, address, MAGIC + os.urandom(TOKEN_BYTES), heard, STRANGER_SOURCE,
                                       sent)
            with trio.fail_after(DEADLINE):
                while len(sent) < flood * len(addresses):
                    await trio.sleep(0.01)
            # more honest fast connections than a source's burst of failures, all from 127.0.0.1
            for p in prompts * 3:
                got.append(await ask(peers, addresses, p, fast=True, max_tokens=TINY_TOKENS))
        assert got == want * 3
        assert heard == [b""] * flood * len(addresses)
        now = trio.current_time()
        for i, (node, b, a) in enumerate(zip(nodes, before, await paths(nodes), strict=True)):
            assert a.daemon == b.daemon and a.fast > b.fast, i
            admission = node.peers._admission
            assert admission is not None
            assert "127.0.0.1" not in admission._buckets, f"stage {i} charged the honest stages' source"
            assert admission._tokens(STRANGER_SOURCE, now) < 1, f"stage {i} did not charge the flood's source"
            assert admission.preauth == 0


# ====================================================================== three `meshd serve` stages of the default model

RANGES = ["0:10", "10:20", "20:30"]
PROMPTS = ["What is the capital of France?", "Write a haiku about the sea."]
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def stages() -> Iterator[list[Served]]:
    with serving(RANGES, 4, 512) as served:
        yield served


@pytest.fixture(scope="module")
def expected(default_model: Path) -> dict[str, list[int]]:
    return greedy_reference(default_model, PROMPTS, NEW_TOKENS)


async def ask_served(peers: Peers, stages: list[Served], prompt: str, fast: bool,
                     on_token: Callable[[int, bytes], None] | None = None) -> list[int]:
    request = AskRequest(messages=[{"role": "user", "content": prompt}], max_tokens=NEW_TOKENS, fast=fast)
    with trio.fail_after(2 * DEADLINE):
        result = await run_session(peers, route_at([s.address for s in stages]), request, AskResult(), on_token)
    return result.tokens


async def metrics(peers: Peers, stages: list[Served]) -> list[dict[str, float]]:
    values = []
    for stage in stages:
        with trio.fail_after(DEADLINE):
            stream = await peers.open_stream(stage.address, STAGE_PROTOCOL)
            async with stream:
                await stream.send_message(MetricsRequest())
                reply = await stream.receive_message()
        assert isinstance(reply, Metrics)
        values.append(reply.values)
    return values


@pytest.mark.slow
async def test_fast_and_slow_sessions_answer_the_whole_models_greedy_tokens(
        stages: list[Served], peers: Peers, expected: dict[str, list[int]]) -> None:
    heard: list[bytes] = []
    async with trio.open_nursery() as nursery:
        # strangers' preambles at every stage meanwhile: each closed unanswered (those that stall,
        # by the pre-auth deadline), none in any session's way
        for stage in stages:
            for data in strangers().values():
                nursery.start_soon(stranger, stage.address, data, heard)
        for prompt in PROMPTS:
            before = await metrics(peers, stages)
            slow = await ask_served(peers, stages, prompt, fast=False)
            between = await metrics(peers, stages)
            fast = await ask_served(peers, stages, prompt, fast=True)
            after = await metrics(peers, stages)
            assert slow == expected[prompt], prompt
            assert fast == expected[prompt], prompt
            for i, (m0, m1, m2) in enumerate(zip(before, between, after, strict=True)):
                # the stage's figures count the rows its worker ran on the fast path as the slow path's
                assert m2["rows"] - m1["rows"] == m1["rows"] - m0["rows"] > 0, (i, m0, m1, m2)
                assert m2["engine_calls"] > m1["engine_calls"] > m0["engine_calls"], i
                # the KV the fast session reserved whole is free again
                assert m2["sessions"] == 0 and m2["kv_tokens"] == 0, (i, m2)
    assert heard == [b""] * len(stages) * len(strangers())
    for stage in stages:
        assert stage.proc.poll() is None


@pytest.mark.slow
async def test_a_fast_sessions_rows_never_go_through_the_middle_daemon(
        stages: list[Served], peers: Peers, expected: dict[str, list[int]]) -> None:
    """Stopped (SIGSTOP) once the first token is in, the middle stage's daemon cannot pass a row on:
    the fast session's every later row goes through its engine worker alone, which runs on."""
    prompt = PROMPTS[0]
    want = expected[prompt]
    assert len(want) > 2
    middle = stages[1].proc.pid
    got: list[int] = []

    def on_token(token: int, piece: bytes) -> None:
        got.append(token)
        if len(got) == 1:
            os.kill(middle, signal.SIGSTOP)
        elif len(got) == len(want):
            # the answer is in: the daemon may release the session
            os.kill(middle, signal.SIGCONT)

    try:
        tokens = await ask_served(peers, stages, prompt, fast=True, on_token=on_token)
    finally:
        os.kill(middle, signal.SIGCONT)
    assert tokens == want
    # and it serves on, both ways
    assert await ask_served(peers, stages, prompt, fast=False) == want


def test_the_fast_paths_counts_only_grow_across_a_new_worker() -> None:
    """What a worker last told of its fast batches stays counted after it dies (the console's live
    figures are differences of these counts: a new worker's small ones must not make them fall)."""
    from meshd.stage.metrics import StageMetrics

    m = StageMetrics()
    m.fast = {"engine_calls": 10, "decode_rows": 40, "max_sessions_per_call": 3}
    m.worker_gone()
    m.fast = {"engine_calls": 2, "decode_rows": 5, "max_sessions_per_call": 1}
    assert (m.fast_count("engine_calls"), m.fast_count("decode_rows")) == (12, 45)
    assert m.fast_count("max_sessions_per_call") == 3 and m.fast_count("draft_rewinds") == 0
