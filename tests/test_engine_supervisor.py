"""The engine worker against hostile frames, cancellation and its daemon's death.

Real worker processes (the tiny random-weight models load in milliseconds);
every process a test starts is stopped by PID, every wait is bounded.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import trio
import trio.testing
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from localmesh import gone

from meshd.cli.serve import report_restarts
from meshd.engine.supervisor import EngineSupervisor, WorkerDown, WorkerRefused, WorkerSpec, _read_frame, _send_frame
from meshd.engine.workerproto import MAX_HEADER, PREFIX, encode_prefix, take_frames

# generous: a bound against hangs, not a speed claim
DEADLINE = 60

pytestmark = pytest.mark.slow  # real worker processes


@pytest.fixture
def tiny(tiny_models: dict[str, Path]) -> Path:
    return tiny_models["llama-gqa-tied"]


@asynccontextmanager
async def supervised(model: Path, **kwargs: Any) -> AsyncIterator[EngineSupervisor]:
    sup = EngineSupervisor(WorkerSpec(model, n_ctx=256, n_seq_max=2, n_batch=256, threads=1), **kwargs)
    async with trio.open_nursery() as nursery:
        with trio.fail_after(DEADLINE):
            await nursery.start(sup.run)
        try:
            yield sup
        finally:
            nursery.cancel_scope.cancel()


async def until_gone(pid: int) -> None:
    with trio.fail_after(DEADLINE):
        while not gone(pid):
            await trio.sleep(0.02)


@contextmanager
def stopped_by_pid(*pids: int) -> Iterator[None]:
    """Whatever the test did, every PID it names ends up SIGKILLed (a stopped one included)."""
    try:
        yield
    finally:
        for pid in pids:
            if pid <= 0:
                continue  # never 0 or -1: those signal whole groups, this test run's own included
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def worker_children() -> list[int]:
    """PIDs of this process's children that run the engine worker."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (entry / "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue
        if ppid == os.getpid() and b"meshd.engine.worker" in cmdline:
            found.append(int(entry.name))
    return found


async def raw_exchange(sup: EngineSupervisor, frame: bytes) -> list[dict[str, object]]:
    """Bytes straight onto the worker's socket, past every check of call(); the replies that come back.

    One reply per frame the bytes hold (after the first prefix, `frame` may hold several).
    """
    assert sup._sock is not None
    replies = []
    async with sup._lock:
        with trio.fail_after(DEADLINE):
            await _send_frame(sup._sock, frame, b"")
            reply, _ = await _read_frame(sup._sock, bytearray(1 << 16))
            replies.append(reply)
    return replies


async def read_frames(sock: socket.socket, n: int) -> list[dict[str, Any]]:
    """`n` reply frames, however the worker's writes arrive (the supervisor's reader takes one per recv)."""
    buf = bytearray()
    frames: list[dict[str, Any]] = []
    while len(frames) < n:
        await trio.lowlevel.wait_readable(sock)
        chunk = sock.recv(1 << 16)
        assert chunk, "the worker closed its socket"
        buf += chunk
        frames += take_frames(buf)
    return frames


GARBAGE_HEADERS = {
    "reserved byte 0xc1": b"\xc1",
    "truncated array": b"\x92\x01",
    "trailing bytes": msgpack.packb({"op": "ping"}) + b"\x00",
    "not a map": msgpack.packb([1, 2, 3]),
    "integer map keys": msgpack.packb({1: 2}),
    "array claiming 4G items": b"\xdd\xff\xff\xff\xff",
    "nested 100k deep": b"\x91" * 100_000,
    "ext type": b"\xd4\x05\x00",
}
BAD_REQUESTS: dict[str, dict[str, Any]] = {
    "no op": {},
    "op not a string": {"op": 7},
    "unknown op": {"op": "format_disk"},
    "forward without fields": {"op": "forward"},
    "forward with wrong types": {"op": "forward", "seq": 5, "pos": "x", "tokens": [1]},
    "forward rows of odd length": {"op": "forward", "seq": b"\x00\x00\x00", "pos": b"\x00", "tokens": b"\x00"},
    "forward history not pairs": {"op": "forward", "history": [1, 2, 3]},
    "sampler params not a map": {"op": "sampler_new", "sid": 0, "params": [1, 2]},
    "sampler id not a number": {"op": "sampler_free", "sid": "zero"},
    "remove huge seq": {"op": "remove", "seq": 2**63},
    "chat messages not a list of maps": {"op": "tokenize", "messages": 42},
    "detokenize ids out of range": {"op": "detokenize", "tokens": [10**12]},
}


async def test_worker_answers_an_oversized_frame_with_a_typed_error_and_keeps_its_pid(tiny: Path) -> None:
    async with supervised(tiny) as sup:
        pid = sup.pid
        assert pid is not None
        # a header one byte over the limit, and the 16.8 MB of it that follow (a 16.8 MB prompt)
        size = MAX_HEADER + 1
        [reply] = await raw_exchange(sup, PREFIX.pack(size, 0) + b"\xa5" * size)
        assert reply["ok"] is False and reply["kind"] == "FrameTooLarge", reply
        assert f"header {size} bytes" in str(reply["message"])
        reply, _ = await sup.call({"op": "tokenize", "text": "the cat"})
        assert reply["tokens"] and sup.pid == pid and not gone(pid) and sup.restarts == 0


async def test_worker_answers_every_undecodable_header_with_a_typed_error(tiny: Path) -> None:
    # one worker for all of them: each header is answered, and the same worker serves the next
    async with supervised(tiny) as sup:
        pid = sup.pid
        for name, raw in GARBAGE_HEADERS.items():
            [reply] = await raw_exchange(sup, PREFIX.pack(len(raw), 0) + raw)
            assert reply["ok"] is False and reply["kind"] == "BadFrame", (name, reply)
            reply, _ = await sup.call({"op": "tokenize", "text": "the cat"})
            assert reply["tokens"] and sup.pid == pid and sup.restarts == 0, name


async def test_worker_answers_every_malformed_request_and_keeps_serving(tiny: Path) -> None:
    async with supervised(tiny) as sup:
        pid = sup.pid
        for name, header in BAD_REQUESTS.items():
            with pytest.raises(WorkerRefused) as refused:
                await sup.call(header)
            assert refused.value.kind in ("InvalidInput", "EngineError"), (name, refused.value.kind, str(refused.value))
        # a payload that cannot be this model's rows: the frame is fine, the request is refused
        with pytest.raises(WorkerRefused):
            await sup.call({"op": "forward", "seq": np.zeros(2, np.int32).tobytes(),
                            "pos": np.arange(2, dtype=np.int32).tobytes()}, b"\x00" * 13)
        reply, _ = await sup.call({"op": "tokenize", "text": "the cat"})
        assert reply["tokens"] and sup.pid == pid and sup.restarts == 0


async def test_two_frames_in_one_write_get_two_replies(tiny: Path) -> None:
    async with supervised(tiny) as sup:
        assert sup._sock is not None
        async with sup._lock:
            with trio.fail_after(DEADLINE):
                await _send_frame(sup._sock, encode_prefix({"op": "ping"}, 0) + encode_prefix({"op": "nope"}, 0), b"")
                first, second = await read_frames(sup._sock, 2)
        assert first == {"ok": True} and second["kind"] == "InvalidInput"
        reply, _ = await sup.call({"op": "ping"})
        assert reply["ok"] and sup.restarts == 0


async def test_a_request_over_the_frame_limit_is_refused_unsent(tiny: Path) -> None:
    async with supervised(tiny) as sup:
        pid = sup.pid
        with pytest.raises(WorkerRefused) as refused:
            await sup.call({"op": "tokenize", "text": "x" * (MAX_HEADER + 1)})
        assert refused.value.kind == "FrameTooLarge"
        reply, _ = await sup.call({"op": "tokenize", "text": "the cat"})
        assert reply["tokens"] and sup.pid == pid and sup.restarts == 0


async def test_a_reply_too_large_for_a_frame_is_a_typed_error(tiny: Path) -> None:
    """Input under the limit that asks for output over it: " the" (4 bytes) for each 3-byte token id."""
    from gguf_factory import byte_level_vocab

    the = byte_level_vocab()[0].index("Ġthe")
    n = (MAX_HEADER - 64) // 3
    async with supervised(tiny) as sup:
        pid = sup.pid
        with pytest.raises(WorkerRefused) as refused:
            await sup.call({"op": "detokenize", "tokens": [the] * n})
        assert refused.value.kind == "ReplyTooLarge", str(refused.value)
        reply, _ = await sup.call({"op": "detokenize", "tokens": [the] * 3})
        assert reply["text"] == " the the the" and sup.pid == pid and sup.restarts == 0


async def test_a_cancelled_call_costs_neither_the_worker_nor_the_next_reply(tiny: Path) -> None:
    """Cancelled while the worker holds the request: the caller still takes its own reply."""
    async with supervised(tiny, health_interval=3600) as sup:
        pid = sup.pid
        assert pid is not None
        n = 64
        prefill = {"op": "forward", "seq": np.zeros(n, np.int32).tobytes(),
                   "pos": np.arange(n, dtype=np.int32).tobytes(), "tokens": np.full(n, 42, np.int32).tobytes()}
        got: list[dict[str, object]] = []
        scope = trio.CancelScope()

        async def caller() -> None:
            with scope:
                reply, _ = await sup.call(prefill)
                got.append(reply)
                await trio.lowlevel.checkpoint()

        # stopped, the worker cannot answer before the cancel: the call is in flight when it comes
        os.kill(pid, signal.SIGSTOP)
        with trio.fail_after(DEADLINE):
            try:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(caller)
                    await trio.testing.wait_all_tasks_blocked()
                    assert sup._lock.locked() and not got
                    scope.cancel()
                    await trio.testing.wait_all_tasks_blocked()
                    assert not got, "the cancel cut the call short"
                    os.kill(pid, signal.SIGCONT)
            finally:
                os.kill(pid, signal.SIGCONT)
        assert scope.cancelled_caught
        assert got and got[0]["rows"] == 1
        reply, _ = await sup.call({"op": "tokenize", "text": "Hello"})
        assert reply["tokens"] and sup.restarts == 0 and sup.pid == pid and sup.is_up


async def test_a_cancelled_start_kills_its_child(tiny: Path) -> None:
    sup = EngineSupervisor(WorkerSpec(tiny, n_ctx=256, n_seq_max=2, threads=1))
    child: list[int] = []
    with trio.fail_after(DEADLINE):
        async with trio.open_nursery() as nursery:

            async def cancel_mid_start() -> None:
                while not (found := worker_children()):
                    await trio.sleep(0.01)
                child.extend(found)
                # stopped, it cannot become ready: the start is cancelled while it loads
                os.kill(found[0], signal.SIGSTOP)
                nursery.cancel_scope.cancel()

            nursery.start_soon(cancel_mid_start)
            await nursery.start(sup.run)
            pytest.fail("the start finished although its worker was stopped")
    with stopped_by_pid(*child):
        assert len(child) == 1 and sup.pid is None
        assert gone(child[0]), f"worker {child[0]} outlived its cancelled start"


async def test_wait_restart_wakes_on_a_dead_worker_and_the_cli_reports_it(
        tiny: Path, capsys: pytest.CaptureFixture[str]) -> None:
    async with supervised(tiny, backoff_min=0.0) as sup, trio.open_nursery() as nursery:
        nursery.start_soon(report_restarts, sup)
        first = sup.pid
        assert first is not None
        os.kill(first, signal.SIGKILL)
        with trio.fail_after(DEADLINE):
            assert await sup.wait_restart(0) == 1
            await trio.testing.wait_all_tasks_blocked()
        assert "status -9" in sup.last_down
        assert f"meshd: engine worker {first} exited with status -9; restarting (restart 1)" in capsys.readouterr().err
        # a count already behind returns at once; the next restart is a new worker
        assert await sup.wait_restart(0) == 1
        with trio.fail_after(DEADLINE):
            while sup.pid == first or not sup.is_up:
                await trio.sleep(0.02)
        reply, _ = await sup.call({"op": "ping"})
        assert reply["ok"]
        nursery.cancel_scope.cancel()


DAEMON = textwrap.dedent("""
    import sys, trio
    from pathlib import Path
    from meshd.engine.supervisor import EngineSupervisor, WorkerSpec

    async def main():
        sup = EngineSupervisor(WorkerSpec(Path(sys.argv[1]), n_ctx=256, n_seq_max=2, threads=1))
        async with trio.open_nursery() as nursery:
            await nursery.start(sup.run)
            print(sup.pid, flush=True)
            await trio.sleep_forever()

    trio.run(main)
""")


def test_a_worker_dies_with_its_daemon_even_when_it_cannot_read_its_socket(tiny: Path) -> None:
    daemon = subprocess.Popen([sys.executable, "-c", DAEMON, str(tiny)], stdout=subprocess.PIPE, text=True,
                              cwd=Path(__file__).resolve().parent.parent)
    with stopped_by_pid(daemon.pid):
        assert daemon.stdout is not None
        line = daemon.stdout.readline()
        assert line.strip().isdigit(), f"the daemon printed {line!r}"
        worker = int(line)
        with stopped_by_pid(worker):
            # stopped, the worker would never notice its socket close: only the parent-death signal ends it
            os.kill(worker, signal.SIGSTOP)
            os.kill(daemon.pid, signal.SIGKILL)
            daemon.wait(DEADLINE)
            trio.run(until_gone, worker)


@pytest.fixture(scope="module")
def raw_worker(tiny_models: dict[str, Path]) -> Iterator[tuple[socket.socket, int]]:
    """A worker on a blocking socket of this process (no supervisor): bytes in, frames out."""
    ours, theirs = socket.socketpair()
    spec = WorkerSpec(tiny_models["llama-gqa-tied"], n_ctx=256, n_seq_max=2, n_batch=256, threads=1)
    proc = subprocess.Popen(spec.argv(theirs.fileno()), pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL)
    theirs.close()
    ours.settimeout(DEADLINE)
    with stopped_by_pid(proc.pid):
        assert blocking_frames(ours, 1)[0]["ok"]
        yield ours, proc.pid
        ours.close()
        proc.wait(DEADLINE)


def blocking_frames(sock: socket.socket, n: int) -> list[dict[str, Any]]:
    buf = bytearray()
    frames: list[dict[str, Any]] = []
    while len(frames) < n:
        chunk = sock.recv(1 << 16)
        assert chunk, "the worker closed its socket"
        buf += chunk
        frames += take_frames(buf)
    return frames


OPS = ["ping", "forward", "remove", "sampler_new", "sampler_free", "tokenize", "detokenize", "fast_open", "fast_link",
       "fast_end", "fast_stats", "fast_state", "nope"]
values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=20)
    | st.binary(max_size=64),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
requests = st.fixed_dictionaries({"op": st.sampled_from(OPS)}, optional={
    k: values for k in ("seq", "pos", "tokens", "want", "history", "sample", "sid", "params", "text", "messages",
                        "p0", "p1", "return_logits", "tag", "max_pos", "prompt_len", "max_tokens", "prompt", "key",
                        "out", "chunk", "carry", "gets_ids")})


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(header=st.one_of(requests.map(lambda r: msgpack.packb(r, use_bin_type=True)), st.binary(max_size=64)),
       payload=st.binary(max_size=256))
@example(header=b"\xc1", payload=b"")
@example(header=msgpack.packb({"op": "forward", "seq": b"\x00" * 4, "pos": b"\x00" * 4}), payload=b"\x00" * 3)
def test_no_frame_ends_the_worker(raw_worker: tuple[socket.socket, int], header: bytes, payload: bytes) -> None:
    """Any header bytes and payload: one reply each, and the worker lives on (then answers a ping)."""
    sock, pid = raw_worker
    sock.sendall(PREFIX.pack(len(header), len(payload)) + header + payload + encode_prefix({"op": "ping"}, 0))
    reply, pong = blocking_frames(sock, 2)
    assert isinstance(reply.get("ok"), bool) and (reply["ok"] or isinstance(reply.get("kind"), str)), reply
    assert pong == {"ok": True} and not gone(pid)


async def test_a_worker_whose_model_file_is_gone_is_given_up_after_its_failed_starts_saying_why(
        tiny: Path, tmp_path: Path) -> None:
    model = tmp_path / "doomed.gguf"
    shutil.copy(tiny, model)
    told: list[str] = []
    # two failed starts in a row, not the default five: the count is the supervisor's, each start a process
    sup = EngineSupervisor(WorkerSpec(model, n_ctx=256, n_seq_max=2, n_batch=256, threads=1), backoff_min=0.0,
                           give_up_after=2, on_gone=told.append)
    with trio.fail_after(DEADLINE):
        async with trio.open_nursery() as nursery:
            await nursery.start(sup.run)
            first = sup.pid
            assert first is not None and sup.gone is None
            model.unlink()
            os.kill(first, signal.SIGKILL)
            while sup.gone is None:
                await trio.sleep(0.02)
            # run() has returned: this nursery ends without a cancel
        assert told == [sup.gone] and sup.restarts == 1 and not sup.is_up
        assert sup.gone.startswith(f"the engine worker failed to start {sup.give_up_after} times in a row: ")
        assert "doomed.gguf" in sup.gone, sup.gone
        with pytest.raises(WorkerDown):
            await sup.call({"op": "ping"})
