"""The local control channel: `meshd ask` and `meshd status` talking to the daemon of a state directory.

A Unix stream socket, ``control.sock``, in the daemon's 0700 state directory.
Each connection carries one framed msgpack request (wire/codec) and one reply,
then closes. The daemon answers only a peer whose SO_PEERCRED uid is its own
or root's, and the client trusts only a daemon running as itself or root: the
directory's mode keeps others out already, the credential check does not rely
on it. Requests are small and bounded in bytes, time and concurrency.

A daemon holds an exclusive ``flock`` on ``daemon.lock`` for its whole life.
The kernel drops it when the process dies, however it dies, so the lock (not
the socket file) says whether a daemon is alive: a second daemon on the same
directory is refused, and a socket left by a dead one is stale and removed.
Every removal of the socket happens under the lock (the daemon's exclusive
one, or a client's shared probe), so nobody removes a live daemon's socket.

Usage::

    with claim_state_dir(state) as claim:                      # the daemon
        await nursery.start(serve_control, claim, answer)      # answer(request) -> reply
    reply = await control_request(state, StatusRequest(), timeout=10)   # a client
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import socket
import stat
import struct
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

import trio

from wire.codec import MessageDecoder
from wire.errors import ErrorCode, ProtocolError
from wire.limits import Limits
from wire.message import ErrorMessage, Message, encode, error_from_message, error_message

log = logging.getLogger(__name__)

SOCKET_NAME = "control.sock"
LOCK_NAME = "daemon.lock"

ControlHandler = Callable[[Message], Awaitable[Message]]

# struct ucred: pid, uid, gid
_UCRED = struct.Struct("3i")
# sun_path holds 108 bytes with its terminating NUL.
_MAX_SUN_PATH = 107


@dataclass(frozen=True)
class ControlLimits:
    # A request is a status or route request: a few hundred bytes, at most a list of excluded node ids.
    request: Limits = Limits(max_message_bytes=64 << 10, max_objects=4096, max_depth=4)
    # A reply is the daemon's own status of the whole mesh, read by a client that trusts that daemon.
    reply: Limits = Limits(max_message_bytes=16 << 20)
    # From accept to the reply sent: a client that sends nothing, or never reads, costs at most this.
    deadline: float = 5.0
    max_clients: int = 32


DEFAULT_LIMITS = ControlLimits()
_OUT_OF_RESOURCES = {errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS}
_BUSY = encode(error_message(ProtocolError(ErrorCode.OVERLOADED, "the daemon is answering too many control "
                                           "requests at once", retry_after_ms=100)))


class ControlError(Exception):
    """The local daemon cannot be used; the message says why and, where there is one, what to do."""


@dataclass(frozen=True, slots=True)
class Credentials:
    pid: int
    uid: int
    gid: int


def peer_credentials(sock: socket.socket | trio.socket.SocketType) -> Credentials:
    """Who is at the other end of a connected Unix socket, as the kernel recorded it at connect time."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    return Credentials(*_UCRED.unpack(raw))


def peer_allowed(peer: Credentials, own_uid: int) -> bool:
    """Only the daemon's own user and root may use it (and be trusted as it)."""
    return peer.uid in (own_uid, 0)


def socket_path(state_dir: Path) -> Path:
    return Path(state_dir) / SOCKET_NAME


def _check_private(state_dir: Path) -> None:
    st = state_dir.stat()
    if not stat.S_ISDIR(st.st_mode):
        raise ControlError(f"state dir {state_dir} is not a directory")
    if st.st_uid != os.geteuid():
        raise ControlError(f"state dir {state_dir} belongs to uid {st.st_uid}, not to you (uid {os.geteuid()})")
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ControlError(f"state dir {state_dir} is accessible by others (mode {stat.S_IMODE(st.st_mode):04o}); "
                           f"run: chmod 700 {state_dir}")


def _holder_pid(lock_fd: int) -> str:
    try:
        text = os.pread(lock_fd, 32, 0).decode("ascii", "replace").strip()
    except OSError:
        return "?"
    return text if text.isdigit() else "?"


@contextmanager
def _short_path(path: Path) -> Iterator[str]:
    """A name for `path` that fits sun_path: itself, or the same file reached through an open fd of its folder."""
    if len(os.fsencode(path)) <= _MAX_SUN_PATH:
        yield str(path)
        return
    fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        yield f"/proc/self/fd/{fd}/{path.name}"
    finally:
        os.close(fd)


@dataclass
class StateClaim:
    """This process's exclusive hold on a state directory (see `claim_state_dir`)."""

    state_dir: Path
    lock_fd: int

    @property
    def socket(self) -> Path:
        return socket_path(self.state_dir)


@contextmanager
def claim_state_dir(state_dir: Path, *, attempts: int = 5) -> Iterator[StateClaim]:
    """Makes `state_dir` (0700) this daemon's, or raises ControlError if another daemon has it.

    A client's stale-socket probe holds a shared lock for an instant; a few
    tries a few milliseconds apart keep that from refusing a starting daemon.
    """
    state_dir = Path(state_dir)
    try:
        state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        _check_private(state_dir)
        fd = os.open(state_dir / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise ControlError(f"cannot use state dir {state_dir}: {exc.strerror}") from None
    try:
        for attempt in range(attempts):
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if attempt == attempts - 1:
                    raise ControlError(f"another meshd (pid {_holder_pid(fd)}) is already running for state dir "
                                       f"{state_dir}; stop it or give another --state-dir") from None
                time.sleep(0.01)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        # Left by a daemon that died without cleaning up: nobody listens on it (we hold the lock).
        socket_path(state_dir).unlink(missing_ok=True)
        yield StateClaim(state_dir, fd)
    finally:
        os.close(fd)


async def serve_control(claim: StateClaim, handler: ControlHandler, limits: ControlLimits = DEFAULT_LIMITS, *,
                        task_status: trio.TaskStatus[Path] = trio.TASK_STATUS_IGNORED) -> None:
    """Listens on the claimed state directory's control socket until cancelled, then removes it."""
    path = claim.socket
    listener = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        with _short_path(path) as name:
            await listener.bind(name)
        os.chmod(path, 0o600)
        listener.listen(limits.max_clients)
        task_status.started(path)
        await serve_listener(listener, handler, limits)
    finally:
        listener.close()
        path.unlink(missing_ok=True)


async def serve_listener(listener: trio.socket.SocketType, handler: ControlHandler,
                         limits: ControlLimits = DEFAULT_LIMITS, own_uid: int | None = None) -> None:
    """Answers one request per connection on a listening Unix socket, at most `max_clients` at once."""
    uid = os.geteuid() if own_uid is None else own_uid
    busy = 0

    async def one(sock: trio.socket.SocketType) -> None:
        nonlocal busy
        try:
            await _answer(sock, handler, limits, uid)
        finally:
            busy -= 1

    async with trio.open_nursery() as nursery:
        while True:
            try:
                sock, _ = await listener.accept()
            except OSError as exc:
                if exc.errno not in _OUT_OF_RESOURCES:
                    raise
                # Out of fds or memory (someone holds many connections): the control socket waits, as
                # trio's serve_listeners does, rather than taking the daemon down.
                log.warning("control socket cannot accept: %s", exc.strerror)
                await trio.sleep(0.1)
                continue
            if busy >= limits.max_clients:
                # A fresh socket's buffer takes this small reply at once, so refusing costs the loop no wait.
                with sock, trio.move_on_after(limits.deadline):
                    await sock.send(_BUSY)
                continue
            busy += 1
            nursery.start_soon(one, sock)


async def _answer(sock: trio.socket.SocketType, handler: ControlHandler, limits: ControlLimits, own_uid: int) -> None:
    stream = trio.SocketStream(sock)
    try:
        with trio.move_on_after(limits.deadline):
            reply = await _reply_for(stream, handler, limits, own_uid)
            if reply is not None:
                # Closing with the request (or part of it) unread resets the connection, but only after
                # the client has read what was sent before: the reply always arrives.
                await stream.send_all(encode(reply))
    except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
        log.debug("control client went away: %s", exc)
    finally:
        await trio.aclose_forcefully(stream)


async def _reply_for(stream: trio.SocketStream, handler: ControlHandler, limits: ControlLimits,
                     own_uid: int) -> Message | None:
    peer = peer_credentials(stream.socket)
    if not peer_allowed(peer, own_uid):
        log.warning("refused a control connection from uid %d (pid %d)", peer.uid, peer.pid)
        return error_message(ProtocolError(ErrorCode.UNAUTHORIZED,
                                           f"uid {peer.uid} may not use the control socket of uid {own_uid}'s meshd"))
    try:
        request = await _receive(stream, limits.request)
    except ProtocolError as exc:
        return error_message(exc)
    if request is None:
        return None
    try:
        return await handler(request)
    except ProtocolError as exc:
        return error_message(exc)
    except Exception:
        log.exception("control request %s failed", request.type)
        return error_message(ProtocolError(ErrorCode.INTERNAL, f"the daemon failed to answer {request.type}"))


async def _receive(stream: trio.SocketStream, limits: Limits) -> Message | None:
    """One framed message; None if the other end closed before sending a byte."""
    decoder = MessageDecoder(limits)
    while True:
        data = await stream.receive_some(1 << 16)
        if not data:
            if decoder.buffered:
                raise ProtocolError(ErrorCode.BAD_REQUEST, "the control connection closed mid-message")
            return None
        decoder.feed(data)
        message = decoder.next_message()
        if message is not None:
            return message


async def control_request(state_dir: Path, request: Message, *, timeout: float,
                          limits: ControlLimits = DEFAULT_LIMITS) -> Message:
    """Sends one request to the daemon of `state_dir` and returns its reply; a typed error reply is raised."""
    state_dir = Path(state_dir)
    path = socket_path(state_dir)
    sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stream: trio.SocketStream | None = None
    try:
        with trio.move_on_after(timeout) as scope:
            try:
                with _short_path(path) as name:
                    await sock.connect(name)
            except FileNotFoundError:
                raise ControlError(_not_running(state_dir)) from None
            except ConnectionRefusedError:
                raise ControlError(_stale(state_dir)) from None
            except OSError as exc:
                if exc.errno == errno.ENOENT:  # the folder itself, reached through /proc/self/fd
                    raise ControlError(_not_running(state_dir)) from None
                raise ControlError(f"cannot reach the meshd of state dir {state_dir}: {exc.strerror}") from None
            stream = trio.SocketStream(sock)
            daemon = peer_credentials(sock)
            if not peer_allowed(daemon, os.geteuid()):
                raise ControlError(f"{path} is served by uid {daemon.uid} (pid {daemon.pid}), not by you or root; "
                                   "not trusting it")
            with suppress(trio.BrokenResourceError):
                # a daemon that refuses this uid answers at once and closes, the request unread: on a busy
                # machine it has before the request is out (a broken pipe), and its answer waits to be read
                await stream.send_all(encode(request))
            try:
                reply = await _receive(stream, limits.reply)
            except ProtocolError as exc:
                raise ControlError(f"the meshd of state dir {state_dir} sent a bad reply: {exc.message}") from None
        if scope.cancelled_caught:
            raise ControlError(f"the meshd of state dir {state_dir} did not answer within {timeout:g} s")
    except (trio.BrokenResourceError, OSError) as exc:
        raise ControlError(f"the meshd of state dir {state_dir} hung up: {exc}") from None
    finally:
        if stream is not None:
            await trio.aclose_forcefully(stream)
        else:
            sock.close()
    if reply is None:
        raise ControlError(f"the meshd of state dir {state_dir} closed the control connection without answering "
                           "(busy, or shutting down)")
    if isinstance(reply, ErrorMessage):
        raise error_from_message(reply)
    return reply


@contextmanager
def _probe(state_dir: Path) -> Iterator[str | None]:
    """The pid of the daemon that holds `state_dir`, or None, holding a shared lock meanwhile if none does."""
    try:
        fd = os.open(state_dir / LOCK_NAME, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        yield None
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            yield _holder_pid(fd)
        else:
            yield None
    finally:
        os.close(fd)


def _not_running(state_dir: Path) -> str:
    with _probe(state_dir) as pid:
        if pid is not None:
            return f"the meshd (pid {pid}) of state dir {state_dir} is still starting; try again shortly"
    return f"no meshd running for state dir {state_dir}: run `meshd join`, or give --seed HOST:PORT"


def _stale(state_dir: Path) -> str:
    """Nobody listens on the socket: removes it if its daemon is gone."""
    with _probe(state_dir) as pid:
        if pid is not None:
            return (f"the meshd (pid {pid}) of state dir {state_dir} is not accepting control connections "
                    "(starting or stopping); try again shortly")
        try:
            socket_path(state_dir).unlink(missing_ok=True)
        except OSError as exc:
            return f"no meshd running for state dir {state_dir} (cannot remove its stale socket: {exc.strerror})"
    return f"no meshd running for state dir {state_dir} (stale socket removed): run `meshd join`, or give --seed HOST:PORT"
