"""The local control channel: one framed request and reply over a Unix socket in the 0700 state directory."""

from __future__ import annotations

import errno
import os
import socket
import stat
import struct
import tempfile
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress
from pathlib import Path

import pytest
import trio
import trio.testing

from meshd.net import control
from meshd.net.control import (
    LOCK_NAME,
    ControlError,
    ControlLimits,
    Credentials,
    claim_state_dir,
    control_request,
    peer_allowed,
    serve_control,
    serve_listener,
    socket_path,
)
from wire.codec import MessageDecoder
from wire.decode import decode
from wire.errors import ErrorCode, ProtocolError
from wire.limits import Limits
from wire.meshrpc import RouteRequest, StatusReply, StatusRequest
from wire.message import ErrorMessage, Message, encode, error_message

NOBODY = 65534
# what the child writes to the pipe, before its exception, where it got no reply
CHILD_FAILED = b"child failed: "
STATUS = StatusReply(node_id="n" * 40, term=3, members=[], coverage=[])


async def answer(request: Message) -> Message:
    """A fake daemon: status is answered, a route request fails the way a daemon's would."""
    if isinstance(request, StatusRequest):
        return STATUS
    raise ProtocolError(ErrorCode.NOT_FOUND, "no member holds a model")


@asynccontextmanager
async def daemon(state: Path, limits: ControlLimits = ControlLimits()) -> AsyncIterator[Path]:
    with claim_state_dir(state) as claim:
        async with trio.open_nursery() as nursery:
            path = await nursery.start(serve_control, claim, answer, limits)
            yield path
            nursery.cancel_scope.cancel()


async def test_a_request_gets_the_daemons_reply_and_a_typed_error_crosses_as_one(tmp_path: Path) -> None:
    state = tmp_path / "state"
    async with daemon(state) as path:
        assert stat.S_IMODE(state.stat().st_mode) == 0o700
        assert stat.S_ISSOCK(path.stat().st_mode) and stat.S_IMODE(path.stat().st_mode) == 0o600
        assert await control_request(state, StatusRequest(), timeout=5) == STATUS
        with pytest.raises(ProtocolError) as caught:
            await control_request(state, RouteRequest(), timeout=5)
        assert caught.value.code is ErrorCode.NOT_FOUND
    assert not path.exists(), "the daemon removes its socket when it stops"


async def test_a_state_dir_path_longer_than_sun_path_still_works(tmp_path: Path) -> None:
    state = tmp_path / ("d" * 60) / ("e" * 60)
    assert len(str(socket_path(state))) > 108
    async with daemon(state):
        assert await control_request(state, StatusRequest(), timeout=5) == STATUS


def test_only_the_same_user_or_root_may_talk_to_the_daemon() -> None:
    assert peer_allowed(Credentials(pid=10, uid=1000, gid=1000), own_uid=1000)
    assert peer_allowed(Credentials(pid=10, uid=0, gid=0), own_uid=1000)
    assert not peer_allowed(Credentials(pid=10, uid=1001, gid=1000), own_uid=1000)
    assert not peer_allowed(Credentials(pid=10, uid=NOBODY, gid=NOBODY), own_uid=0)


@pytest.mark.skipif(os.geteuid() != 0, reason="setuid to nobody needs root")
def test_so_peercred_refuses_another_user(tmp_path: Path) -> None:
    """A child that became nobody connects (to an abstract socket: no file permissions in the way) and is refused."""
    name = f"\0meshd-test-{os.getpid()}"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(name)
    listener.listen(4)
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: no trio, no pytest, only syscalls, and out with os._exit whatever happens
        try:
            os.close(read_end)
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
                client.settimeout(30)
                client.connect(name)
                # the daemon refuses at once and closes: on a busy machine before the request is out
                with suppress(BrokenPipeError):
                    client.sendall(encode(StatusRequest()))
                # the whole reply, to the daemon's close (a reset, as it leaves the request unread): one recv
                # may hold only a part of it
                reply = b""
                with suppress(ConnectionResetError):
                    while data := client.recv(65536):
                        reply += data
            os.write(write_end, reply)
        except BaseException as exc:  # noqa: BLE001 (told to the parent, whose assertion shows it)
            os.write(write_end, CHILD_FAILED + repr(exc).encode())
        finally:
            os._exit(0)
    os.close(write_end)

    async def serve_until_the_child_is_done() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(serve_listener, trio.socket.from_stdlib_socket(listener), answer)
            with trio.fail_after(60):
                await trio.to_thread.run_sync(os.waitpid, pid, 0)
            nursery.cancel_scope.cancel()

    try:
        trio.run(serve_until_the_child_is_done)
    finally:
        listener.close()
    with os.fdopen(read_end, "rb") as pipe:
        got = pipe.read()
    assert not got.startswith(CHILD_FAILED), got
    reply = decode(got)
    assert isinstance(reply, ErrorMessage) and reply.code is ErrorCode.UNAUTHORIZED, reply
    assert f"uid {NOBODY}" in reply.message


async def test_a_refusal_sent_before_the_request_is_out_still_reaches_the_client(monkeypatch: pytest.MonkeyPatch) -> None:
    """A daemon refuses another uid at once and closes, the request unread. A client whose request goes out after
    that close (a broken pipe: what a busy machine's scheduling made of it in CI) still reads the refusal, the
    daemon's one clear line, instead of saying it hung up."""
    refusal = encode(error_message(ProtocolError(ErrorCode.UNAUTHORIZED, "uid 4242 may not use this control socket")))
    closed = threading.Event()
    # a short folder: the socket's path must fit sun_path for the fake daemon's bind
    with tempfile.TemporaryDirectory(dir="/tmp", prefix="meshd-ctl-") as state:
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(str(socket_path(Path(state))))
        listener.listen(1)

        def refuse() -> None:  # the fake daemon: answers before reading, and closes
            conn, _ = listener.accept()
            conn.sendall(refusal)
            conn.close()
            closed.set()

        thread = threading.Thread(target=refuse, daemon=True)
        thread.start()
        checked = control.peer_credentials

        def once_it_closed(sock: socket.socket) -> Credentials:
            # the client checks who serves the socket between its connect and its send: the close comes first here
            assert closed.wait(10), "the fake daemon never answered"
            return checked(sock)

        monkeypatch.setattr(control, "peer_credentials", once_it_closed)
        try:
            with pytest.raises(ProtocolError) as caught:
                await control_request(Path(state), StatusRequest(), timeout=10)
        finally:
            thread.join(10)
            listener.close()
    assert caught.value.code is ErrorCode.UNAUTHORIZED and "uid 4242" in caught.value.message


async def test_a_socket_whose_daemon_is_gone_is_stale_and_removed(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(str(socket_path(state)))
    dead.close()  # what a killed daemon leaves behind: the file, nobody listening
    (state / LOCK_NAME).write_text("4242\n")  # and its lock file, which nobody holds any more
    with pytest.raises(ControlError, match="no meshd running for state dir .* \\(stale socket removed\\)"):
        await control_request(state, StatusRequest(), timeout=5)
    assert not socket_path(state).exists()
    with pytest.raises(ControlError, match="no meshd running for state dir"):
        await control_request(state, StatusRequest(), timeout=5)


async def test_a_socket_of_a_live_daemon_is_not_removed_while_it_holds_the_lock(tmp_path: Path) -> None:
    state = tmp_path / "state"
    with claim_state_dir(state):
        # a daemon between claiming the directory and listening: the socket file is its, or about to be
        dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        dead.bind(str(socket_path(state)))
        dead.close()
        with pytest.raises(ControlError, match=f"pid {os.getpid()}.*not accepting"):
            await control_request(state, StatusRequest(), timeout=5)
        assert socket_path(state).exists()
        socket_path(state).unlink()
        with pytest.raises(ControlError, match="still starting"):
            await control_request(state, StatusRequest(), timeout=5)


def test_a_second_daemon_on_the_same_state_dir_is_refused(tmp_path: Path) -> None:
    state = tmp_path / "state"
    with claim_state_dir(state):
        with pytest.raises(ControlError, match=f"another meshd \\(pid {os.getpid()}\\) is already running"):
            with claim_state_dir(state):
                pass
    with claim_state_dir(state):  # the lock went with the first daemon
        pass


def test_a_state_dir_others_can_enter_is_refused(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    os.chmod(state, 0o755)
    with pytest.raises(ControlError, match="chmod 700"):
        with claim_state_dir(state):
            pass


async def raw_connect(path: Path) -> trio.SocketStream:
    sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    await sock.connect(str(path))
    return trio.SocketStream(sock)


async def read_reply(stream: trio.SocketStream) -> Message | None:
    decoder = MessageDecoder(Limits())
    while data := await stream.receive_some(65536):
        decoder.feed(data)
        message = decoder.next_message()
        if message is not None:
            return message
    return None


async def test_an_oversized_request_is_refused_before_its_body_is_read(tmp_path: Path) -> None:
    state = tmp_path / "state"
    async with daemon(state) as path:
        stream = await raw_connect(path)
        # a prefix announcing 100 MiB, and nothing else: the daemon must not wait for (or buffer) the body
        await stream.send_all(struct.pack(">I", 100 << 20) + b"\x80")
        with trio.fail_after(5):
            reply = await read_reply(stream)
        assert isinstance(reply, ErrorMessage) and reply.code is ErrorCode.BAD_REQUEST
        assert "exceeds the limit" in reply.message
        await stream.aclose()
        assert await control_request(state, StatusRequest(), timeout=5) == STATUS


async def test_undecodable_bytes_are_a_typed_error(tmp_path: Path) -> None:
    state = tmp_path / "state"
    async with daemon(state) as path:
        stream = await raw_connect(path)
        await stream.send_all(struct.pack(">I", 3) + b"\xc1\xc1\xc1")
        with trio.fail_after(5):
            reply = await read_reply(stream)
        assert isinstance(reply, ErrorMessage) and reply.code is ErrorCode.BAD_REQUEST
        await stream.aclose()


async def test_a_silent_client_is_dropped_at_the_deadline_and_others_are_served_meanwhile(
        tmp_path: Path, autojump_clock: trio.testing.MockClock) -> None:
    state = tmp_path / "state"
    async with daemon(state, ControlLimits(deadline=5.0)) as path:
        silent = await raw_connect(path)
        await silent.send_all(encode(StatusRequest())[:3])  # half a prefix, then nothing
        assert await control_request(state, StatusRequest(), timeout=1) == STATUS
        start = trio.current_time()
        with trio.fail_after(60):
            assert await silent.receive_some(100) == b""
        assert trio.current_time() - start == pytest.approx(5.0, abs=0.01)
        await silent.aclose()


async def test_clients_over_the_cap_are_turned_away_and_the_daemon_recovers(tmp_path: Path,
                                                                           autojump_clock: trio.testing.MockClock) -> None:
    state = tmp_path / "state"
    async with daemon(state, ControlLimits(deadline=5.0, max_clients=2)) as path:
        holders = [await raw_connect(path) for _ in range(2)]
        await trio.testing.wait_all_tasks_blocked()
        with pytest.raises(ProtocolError) as caught:
            await control_request(state, StatusRequest(), timeout=1)
        assert caught.value.code is ErrorCode.OVERLOADED
        for h in holders:
            await h.aclose()
        await trio.testing.wait_all_tasks_blocked()
        assert await control_request(state, StatusRequest(), timeout=1) == STATUS


async def test_a_daemon_that_never_answers_times_out_with_one_clear_error(tmp_path: Path,
                                                                          autojump_clock: trio.testing.MockClock) -> None:
    state = tmp_path / "state"
    with claim_state_dir(state):
        listener = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        await listener.bind(str(socket_path(state)))
        listener.listen(4)  # accepts at the kernel, never reads or answers
        with pytest.raises(ControlError, match="did not answer within 2 s"):
            await control_request(state, StatusRequest(), timeout=2)
        listener.close()


class FakeListenerOutOfFds:
    """A fake listener: the first accepts fail as they do when the process has no fd left, then it is real."""

    def __init__(self, real: trio.socket.SocketType, failures: int) -> None:
        self.real, self.failures = real, failures

    async def accept(self) -> tuple[trio.socket.SocketType, object]:
        if self.failures:
            self.failures -= 1
            await trio.lowlevel.checkpoint()
            raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))
        return await self.real.accept()


async def test_running_out_of_fds_pauses_the_control_socket_instead_of_ending_the_daemon(
        tmp_path: Path, autojump_clock: trio.testing.MockClock) -> None:
    state = tmp_path / "state"
    with claim_state_dir(state):
        listener = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        await listener.bind(str(socket_path(state)))
        listener.listen(4)
        fake = FakeListenerOutOfFds(listener, failures=3)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(serve_listener, fake, answer)
            assert await control_request(state, StatusRequest(), timeout=5) == STATUS
            assert fake.failures == 0
            nursery.cancel_scope.cancel()
        listener.close()
