"""The daemon's side of the engine worker: start, readiness, health, restart with backoff.

The worker's death is seen at once (its socket closes and the process wait
returns); a worker that stops answering is killed after a deadline. Every
restart bumps `generation`, which tells sessions that the KV they held is gone.
A worker that fails to start `give_up_after` times in a row is given up
(`gone` says why).
"""

from __future__ import annotations

import array
import collections
import contextlib
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

from meshd.engine import ops
from meshd.engine.engine import RangeReport
from meshd.engine.workerproto import (
    MAX_HEADER,
    MAX_PAYLOAD,
    PREFIX,
    FrameError,
    FrameTooLarge,
    decode_header,
    drop_sent,
    encode_prefix,
    frame_parts,
    parse_prefix,
    take_frames,
)

# A reply that fits here (every decode step's) arrives in one recv.
_SCRATCH_BYTES = 64 << 10


class WorkerDown(Exception):
    """The worker died, hung or was restarted: its KV is lost."""


class WorkerStartError(Exception):
    """The worker could not load its model; the message is the engine's."""


class WorkerRefused(Exception):
    """The engine refused a request (bad input); the worker is fine."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True)
class WorkerSpec:
    model: Path
    layers: tuple[int, int] | None = None
    # owned layers to offload to a GPU, counted from the end of the range; -1: all of them
    gpu_layers: int = 0
    n_ctx: int = 4096
    n_seq_max: int = 16
    n_batch: int = 512
    threads: int = 0
    # How long idle compute threads of the worker's persistent thread pool spin
    # for the next step, 0..100; < 0: no persistent pool (ggml then starts and
    # joins its threads on every step, 3x slower decode at 2 threads here).
    # 0, because busy threads of one stage starve the others sharing the cores
    # (3 stages x 2 threads on 2 cores: 5x faster decode than 50), at no cost
    # to a stage alone.
    poll: int = 0

    def argv(self, fd: int, events_fd: int = -1) -> list[str]:
        args = [sys.executable, "-m", "meshd.engine.worker", "--fd", str(fd), "--events-fd", str(events_fd),
                "--parent", str(os.getpid()),
                "--model", str(self.model),
                "--n-ctx", str(self.n_ctx), "--n-seq-max", str(self.n_seq_max), "--n-batch", str(self.n_batch),
                "--threads", str(self.threads), "--poll", str(self.poll), "--gpu-layers", str(self.gpu_layers)]
        if self.layers is not None:
            args += ["--layers", f"{self.layers[0]}:{self.layers[1]}"]
        return args


@dataclass
class EngineSupervisor:
    spec: WorkerSpec
    on_down: Callable[[int, str], None] | None = None
    # called with the generation each time a worker serves again after one went down
    on_up: Callable[[int], None] | None = None
    # called with each event the worker sends unasked (a fast session's token or failure)
    on_event: Callable[[dict[str, Any]], None] | None = None
    load_timeout: float = 300.0
    call_timeout: float = 60.0
    health_interval: float = 1.0
    health_timeout: float = 10.0
    backoff_min: float = 0.2
    backoff_max: float = 10.0
    # Failed starts in a row after which the worker is given up: `run` returns, `gone` says why and
    # `on_gone` hears it. With the backoff doubling from backoff_min, the fifth failure comes about
    # 6 s after the worker went down: a cause that lasts through five tries that far apart (its model
    # file deleted or truncated, a library gone) will not go away by itself, and a node that keeps
    # trying offers its range to nobody meanwhile. Only starts count, never a worker that started and
    # then died: no peer can make a start fail, so no peer can make this node give its range up.
    give_up_after: int = 5
    on_gone: Callable[[str], None] | None = None
    gone: str | None = None
    generation: int = 0
    restarts: int = 0
    report: RangeReport | None = None
    pid: int | None = None
    # why the last worker went down ("exited with status -9", ...), for logs
    last_down: str = ""
    # A plain non-blocking socket, driven with trio's wait_readable/wait_writable:
    # trio's socket methods take a scheduling round per call, three per reply.
    _sock: socket.socket | None = field(default=None, repr=False)
    _scratch: bytearray = field(default_factory=lambda: bytearray(_SCRATCH_BYTES), repr=False)
    _lock: trio.Lock = field(default_factory=trio.Lock, repr=False)
    # set (and replaced) each time `restarts` grows: the event wait_restart() waits on
    _restarted: trio.Event = field(default_factory=trio.Event, repr=False)
    _proc: WorkerProcess | None = field(default=None, repr=False)
    _events: socket.socket | None = field(default=None, repr=False)

    @property
    def is_up(self) -> bool:
        return self._sock is not None

    async def wait_restart(self, seen: int) -> int:
        """Waits until `restarts` differs from `seen` (a worker went down), then returns it.

        Returns at once if it already differs, so a caller that passes the count it
        last saw misses no restart between two waits.
        """
        while self.restarts == seen:
            await self._restarted.wait()
        return self.restarts

    async def run(self, *, task_status: trio.TaskStatus[RangeReport] = trio.TASK_STATUS_IGNORED) -> None:
        """Keeps a worker running until cancelled; reports the first load through task_status."""
        started = False
        delay = self.backoff_min
        failures = 0
        while True:
            try:
                proc, sock, report = await self._start()
            except WorkerStartError as exc:
                if not started:
                    raise
                failures += 1
                if failures >= self.give_up_after:
                    self.gone = f"the engine worker failed to start {failures} times in a row: {exc}"
                    if self.on_gone:
                        self.on_gone(self.gone)
                    return
                await trio.sleep(delay)
                delay = min(delay * 2, self.backoff_max)
                continue
            failures = 0
            self._proc, self._sock, self.report, self.pid = proc, sock, report, proc.pid
            self.generation += 1
            if not started:
                task_status.started(report)
                started = True
            elif self.on_up:
                self.on_up(self.generation)
            up_since = trio.current_time()
            try:
                reason = await self._supervise(proc)
            finally:
                with trio.CancelScope(shield=True):
                    await self._stop(proc, sock)
            self.last_down = reason
            if self.on_down:
                self.on_down(self.generation, reason)
            self.restarts += 1
            self._restarted.set()
            self._restarted = trio.Event()
            if trio.current_time() - up_since > 30.0:
                delay = self.backoff_min
            await trio.sleep(delay)
            delay = min(delay * 2, self.backoff_max)

    async def _start(self) -> tuple[WorkerProcess, socket.socket, RangeReport]:
        ours, theirs = socket.socketpair()
        events, their_events = socket.socketpair()
        try:
            proc = WorkerProcess(self.spec.argv(theirs.fileno(), their_events.fileno()),
                                 (theirs.fileno(), their_events.fileno()))
        except BaseException:
            _close(ours)
            _close(events)
            raise
        finally:
            theirs.close()
            their_events.close()
        events.setblocking(False)
        if self._events is not None:
            _close(self._events)
        self._events = events
        sock = ours
        sock.setblocking(False)
        ready: dict[str, Any] | None = None
        try:
            with trio.move_on_after(self.load_timeout):
                try:
                    ready, _ = await _read_frame(sock, self._scratch)
                except (WorkerDown, OSError, FrameError):
                    ready = None
        finally:
            # refused, timed out, or cancelled while it loads: the child never outlives the start
            if not ready or not ready.get("ok"):
                proc.kill()
                with trio.CancelScope(shield=True):
                    await proc.wait()
                _close(sock)
        if not ready or not ready.get("ok"):
            message = ready.get("message") if ready else "the engine worker exited before it was ready"
            raise WorkerStartError(message or "the engine worker failed to start")
        return proc, sock, RangeReport.from_dict(ready["report"])

    async def _supervise(self, proc: WorkerProcess) -> str:
        async with trio.open_nursery() as nursery:
            reason = "exited"

            async def watch_exit() -> None:
                nonlocal reason
                code = await proc.wait()
                reason = f"exited with status {code}"
                nursery.cancel_scope.cancel()

            async def watch_health() -> None:
                nonlocal reason
                while True:
                    await trio.sleep(self.health_interval)
                    try:
                        await self.call(ops.Ping().header(), timeout=self.health_timeout)
                    except WorkerDown as exc:
                        reason = f"failed its health check: {exc}"
                        proc.kill()
                        nursery.cancel_scope.cancel()
                        return

            async def watch_events() -> None:
                events = self._events
                if events is None:
                    return
                reader = EventReader(events)
                with contextlib.suppress(WorkerDown, OSError, FrameError, trio.ClosedResourceError):
                    while True:
                        event = await reader.next()
                        if self.on_event is not None:
                            self.on_event(event)

            nursery.start_soon(watch_exit)
            nursery.start_soon(watch_health)
            nursery.start_soon(watch_events)
        return reason

    async def _stop(self, proc: WorkerProcess, sock: socket.socket) -> None:
        self._sock = None
        _close(sock)
        if self._events is not None:
            _close(self._events)
            self._events = None
        proc.kill()
        await proc.wait()

    async def call(self, header: dict[str, Any], payload: bytes | memoryview = b"",
                   timeout: float | None = None, fds: tuple[int, ...] = ()) -> tuple[dict[str, Any], bytearray]:
        """One request (an op's ``header()``, meshd.engine.ops, which the worker checks on decode), one
        reply. Raises WorkerDown if the worker is or goes away.

        ``fds`` go with the request (SCM_RIGHTS): the worker holds its own copies once
        the call returns. A request over the frame limits (a 16 MiB prompt) is refused
        here, as the worker would refuse it, without sending it.
        """
        head = encode_prefix(header, len(payload))
        if len(head) - PREFIX.size > MAX_HEADER or len(payload) > MAX_PAYLOAD:
            raise WorkerRefused("FrameTooLarge", str(FrameTooLarge(len(head) - PREFIX.size, len(payload))))
        lock = self._lock
        try:
            # Uncontended (the usual case), this spares acquire()'s scheduling
            # round; reading the reply always waits, so the call still checkpoints.
            lock.acquire_nowait()
        except trio.WouldBlock:
            await lock.acquire()
        try:
            sock = self._sock
            if sock is None:
                raise WorkerDown("the engine worker is down")
            # Shielded: a caller cancelled mid-call (its session failed, its
            # asker left) must neither leave the reply unread for the next
            # caller nor cost every other session the worker. The call's own
            # deadline still holds, and closing the socket still wakes it.
            deadline = trio.current_time() + (timeout or self.call_timeout)
            with trio.CancelScope(deadline=deadline, shield=True) as scope:
                try:
                    await _send_frame(sock, head, payload, fds)
                    reply, body = await _read_frame(sock, self._scratch)
                except (OSError, WorkerDown, FrameError, trio.ClosedResourceError) as exc:
                    self._lost(sock)
                    raise WorkerDown(f"the engine worker went away: {exc}") from exc
                except BaseException:
                    # Cut short between request and reply (an interrupt), the
                    # socket is out of step: the next caller would read this
                    # call's reply.
                    self._lost(sock)
                    raise
            if scope.cancelled_caught:
                self._lost(sock)
                raise WorkerDown(f"the engine worker did not answer {header.get('op')} in time")
        finally:
            lock.release()
        if not reply.get("ok"):
            raise WorkerRefused(str(reply.get("kind")), str(reply.get("message")))
        return reply, body

    def _lost(self, sock: socket.socket) -> None:
        # Seen by a caller before the supervising task notices: nobody may use
        # this worker from now on.
        if self._sock is sock:
            self._sock = None
            if self._proc is not None:
                self._proc.kill()


class WorkerProcess:
    """The worker child, forked from the event loop's own thread and awaited through a pidfd.

    Not trio.lowlevel.open_process: that forks from a thread of trio's thread
    cache, and the worker's parent-death signal (PR_SET_PDEATHSIG) fires when the
    thread that forked it exits (after 10 idle seconds), not when the daemon dies.
    """

    def __init__(self, argv: list[str], fds: tuple[int, ...]) -> None:
        # Ctrl-C at a terminal reaches the whole process group, the worker too, and the worker only
        # ignores it once its imports are done: one that came before printed a traceback. The child
        # starts with SIGINT blocked (a signal mask outlives exec), so it never sees one; the daemon
        # ends it. A SIGINT meanwhile goes to another thread of the daemon, or waits the instant.
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            self.popen = subprocess.Popen(argv, pass_fds=fds, stdin=subprocess.DEVNULL,
                                          env=os.environ | {"PYTHONUNBUFFERED": "1"})
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        self.pid = self.popen.pid
        self._pidfd: int | None = os.pidfd_open(self.pid)

    def kill(self) -> None:
        """SIGKILL unless already reaped (Popen never signals a reaped PID)."""
        self.popen.kill()

    async def wait(self) -> int:
        """The exit status, once the child has exited; reaps it."""
        pidfd = self._pidfd
        if pidfd is not None:
            while self.popen.poll() is None:
                await trio.lowlevel.wait_readable(pidfd)
            self._pidfd = None
            os.close(pidfd)
        return self.popen.wait()


def _close(sock: socket.socket) -> None:
    # wakes a task waiting on the socket (with ClosedResourceError) before the fd goes
    trio.lowlevel.notify_closing(sock)
    sock.close()


async def _send_frame(sock: socket.socket, head: bytes, payload: bytes | memoryview, fds: tuple[int, ...] = ()) -> None:
    parts = frame_parts(head, payload)
    # the descriptors ride with the frame's first bytes
    ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
    while parts:
        try:
            drop_sent(parts, sock.sendmsg(parts, ancillary))
            ancillary = []
        except BlockingIOError:
            await trio.lowlevel.wait_writable(sock)


async def _recv_some(sock: socket.socket, view: memoryview) -> int:
    while True:
        try:
            k = sock.recv_into(view)
        except BlockingIOError:
            await trio.lowlevel.wait_readable(sock)
            continue
        if k == 0:
            raise WorkerDown("the engine worker closed its socket")
        return k


class EventReader:
    """The worker's events, frames one after another on their own socket (several may come in one recv)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = bytearray()
        self.scratch = bytearray(_SCRATCH_BYTES)
        self.ready: collections.deque[dict[str, Any]] = collections.deque()

    async def next(self) -> dict[str, Any]:
        while not self.ready:
            k = await _recv_some(self.sock, memoryview(self.scratch))
            self.buf += memoryview(self.scratch)[:k]
            self.ready.extend(take_frames(self.buf))
        return self.ready.popleft()


async def _read_frame(sock: socket.socket, scratch: bytearray) -> tuple[dict[str, Any], bytearray]:
    """One frame, in a single recv when it fits `scratch`: the worker writes each reply at once.

    The worker answers one request at a time, so nothing follows the frame;
    bytes beyond it are a broken worker.
    """
    # The reply cannot be there yet: wait first rather than try a recv that fails.
    await trio.lowlevel.wait_readable(sock)
    view = memoryview(scratch)
    got = 0
    while got < PREFIX.size:
        got += await _recv_some(sock, view[got:])
    header_len, payload_len = parse_prefix(view[:PREFIX.size])
    head_end = PREFIX.size + header_len
    if got > head_end + payload_len:
        raise FrameError("the engine worker sent more than one frame")
    if head_end > len(scratch):
        whole = memoryview(bytearray(head_end))
        whole[:got] = view[:got]
        view = whole
    while got < head_end:
        got += await _recv_some(sock, view[got:head_end])
    header = decode_header(view[PREFIX.size:head_end])
    payload = bytearray(payload_len)
    have = got - head_end
    payload[:have] = view[head_end:got]
    rest = memoryview(payload)
    while have < payload_len:
        have += await _recv_some(sock, rest[have:])
    return header, payload
