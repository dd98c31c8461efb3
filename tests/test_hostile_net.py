"""Hostile bytes against real daemons: strangers, members and dead seeds.

One mesh (a seed and a volunteer serving the whole default model, both with a
mesh key and RLIMIT_NOFILE soft = hard = 1024) is shared by every case. Each
attack runs in its own process (this file, run as a script), so that it
competes with the daemon for the CPU as a remote attacker would and not with
the bystander's measurements for this process's interpreter. During each one:

* the volunteer's RSS (VmRSS) stays within 64 MiB of its baseline,
* a bystander's status request (a fresh connection and handshake each time,
  as `meshd status` makes) answers every time, within STATUS_BOUND: a bound
  only a daemon the attack starves misses (the medians before and during are
  printed; speed itself is not asserted, it moves with the box's load),
* the engine worker is the same process,
* and an honest ask gives the same tokens after as before.
"""

from __future__ import annotations

import os
import resource
import signal
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import msgpack
import pytest
import trio
from attacks import unfinished_activation
from localmesh import READY, Served, meshd_command, stop_all, stop_process
from wsproto import ConnectionType, WSConnection
from wsproto.events import AcceptConnection, BytesMessage, Message, Request

from meshd.client.ask import AskRequest
from meshd.client.failover import ask_with_failover
from meshd.client.route import Stage, route_from_reply
from meshd.net.identity_store import load_mesh_key
from meshd.net.peers import PeersConfig, open_peers
from meshd.net.rpc import mesh_rpc
from wire.identity import NodeIdentity
from wire.link import SecureLink
from wire.meshrpc import MESH_PROTOCOL, RouteReply, RouteRequest, StatusReply, StatusRequest
from wire.noise import SecureChannel, mesh_key_from_secret
from wire.stage import STAGE_PROTOCOL

pytestmark = pytest.mark.slow

FD_LIMIT = 1024
RSS_SLACK = 64 << 20
STATUS_BOUND = 3.0
PROMPT = "Name three colours."
ASK_TOKENS = 12
TRIES = 5


def limit_fds() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (FD_LIMIT, FD_LIMIT))
    # a shell without job control may have left SIGINT ignored for its children
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def start_limited(*args: str, timeout: float = 90.0) -> Served:
    """`meshd join ARGS` under a 1024 fd limit, once it prints its ready line."""
    log = tempfile.NamedTemporaryFile("w+", prefix="meshd-hostile-", suffix=".log", delete=False)
    proc = subprocess.Popen(meshd_command("join", "--listen", "127.0.0.1:0", *args), stdout=log,
                            stderr=subprocess.STDOUT, text=True, preexec_fn=limit_fds,
                            env=os.environ | {"PYTHONUNBUFFERED": "1"})
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        for line in Path(log.name).read_text().splitlines():
            m = READY.match(line)
            if m:
                return Served(proc, m.group(1), 0, node_id=m.group(3), log=Path(log.name))
        time.sleep(0.05)
    stop_process(proc)
    raise RuntimeError("meshd join did not become ready:\n" + Path(log.name).read_text())


@dataclass
class Mesh:
    seed: Served
    volunteer: Served
    key_file: Path
    key: bytes


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    base = tmp_path_factory.mktemp("hostile")
    key_file = base / "mesh.key"
    key_file.write_text(os.urandom(32).hex() + "\n")
    key_file.chmod(0o600)
    nodes: list[Served] = []
    try:
        nodes.append(start_limited("--no-model", "--state-dir", str(base / "seed"), "--mesh-key-file", str(key_file)))
        nodes.append(start_limited("--seed", nodes[0].address, "--state-dir", str(base / "vol"), "--mesh-key-file",
                                   str(key_file), "--memory", "1G", "--threads", "1", "--max-sessions", "2",
                                   "--session-tokens", "256"))
        yield Mesh(nodes[0], nodes[1], key_file, load_mesh_key(key_file))
    finally:
        stop_all(nodes)


# ----- what the bystander sees


def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) << 10
    raise AssertionError(f"no VmRSS for {pid}")


def children(pid: int) -> set[int]:
    found: set[int] = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        found.update(int(c) for c in (task / "children").read_text().split())
    return found


async def status_time(mesh: Mesh, address: str) -> float:
    """One status request on a fresh connection, as `meshd status` makes it."""
    started = time.perf_counter()
    async with open_peers(NodeIdentity.generate(), PeersConfig(mesh_key=mesh.key, drain_timeout=0.1)) as peers:
        reply = await mesh_rpc(peers, address, StatusRequest(), timeout=STATUS_BOUND)
        took = time.perf_counter() - started
    assert isinstance(reply, StatusReply)
    return took


async def median_status_time(mesh: Mesh) -> float:
    return statistics.median([await status_time(mesh, mesh.volunteer.address) for _ in range(TRIES)])


async def honest_ask(mesh: Mesh) -> list[int]:
    async with open_peers(NodeIdentity.generate(), PeersConfig(mesh_key=mesh.key, drain_timeout=0.1)) as peers:

        async def find(excluded: list[str]) -> list[Stage]:
            reply = await mesh_rpc(peers, mesh.seed.address, RouteRequest(exclude=excluded), timeout=20.0)
            assert isinstance(reply, RouteReply)
            return route_from_reply(reply)

        with trio.fail_after(60):
            result = await ask_with_failover(
                peers, find, AskRequest(messages=[{"role": "user", "content": PROMPT}], max_tokens=ASK_TOKENS))
    return result.tokens


@dataclass
class Baseline:
    answer: list[int]
    rss: int
    status: float
    workers: set[int]


@pytest.fixture(scope="module")
def baseline(mesh: Mesh) -> Baseline:
    async def measure() -> Baseline:
        with trio.fail_after(90):
            while True:  # until the volunteer serves the model
                try:
                    answer = await honest_ask(mesh)
                    break
                except Exception:
                    await trio.sleep(0.5)
        await median_status_time(mesh)  # warm up
        workers = children(mesh.volunteer.proc.pid)
        assert workers, "the volunteer has no engine worker"
        return Baseline(answer, rss(mesh.volunteer.proc.pid), await median_status_time(mesh), workers)

    return trio.run(measure)


@asynccontextmanager
async def attacker(case: str, mesh: Mesh, target: str) -> AsyncIterator[subprocess.Popen[str]]:
    """This file as a script, running one attack until stopped; yields once it is under way."""
    code = "import sys; sys.path[:0] = ['tests', 'tools']; import test_hostile_net as t; t.attack_main(sys.argv[1:])"
    proc = subprocess.Popen([sys.executable, "-c", code, case, target, str(mesh.key_file)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, preexec_fn=raise_own_fd_limit)
    try:
        assert proc.stdout is not None
        with trio.fail_after(30):
            line = await trio.to_thread.run_sync(proc.stdout.readline, abandon_on_cancel=True)
        assert line.startswith("attacking"), f"the attacker failed to start: {line}{proc.stdout.read()}"
        yield proc
    finally:
        stop_process(proc)


def raise_own_fd_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 8192), hard))


def check_under_attack(case: str, mesh: Mesh, baseline: Baseline, settle: float = 3.0) -> None:
    """Run attack ``case`` against the volunteer and assert what the bystander sees."""
    pid = mesh.volunteer.proc.pid

    async def run() -> None:
        async with attacker(case, mesh, mesh.volunteer.address) as proc:
            peak = rss(pid)
            await trio.sleep(settle)
            times = []
            for _ in range(TRIES):
                peak = max(peak, rss(pid))
                times.append(await status_time(mesh, mesh.volunteer.address))
                peak = max(peak, rss(pid))
                await trio.sleep(0.1)
            for _ in range(10):
                peak = max(peak, rss(pid))
                await trio.sleep(0.05)
            during = statistics.median(times)
            assert proc.poll() is None, "the attacker gave up early"
            print(f"{case}: RSS {baseline.rss >> 20} -> peak {peak >> 20} MiB; status {baseline.status * 1e3:.0f} ms "
                  f"-> {during * 1e3:.0f} ms (median of {TRIES})")
            assert peak - baseline.rss <= RSS_SLACK, f"{case}: RSS grew by {(peak - baseline.rss) >> 20} MiB"
        assert children(pid) == baseline.workers, f"{case}: the engine worker changed"
        assert await honest_ask(mesh) == baseline.answer, f"{case}: the honest answer changed"

    trio.run(run)


# ----- the cases


def test_preauth_connections_holding_a_megabyte_frame(mesh: Mesh, baseline: Baseline) -> None:
    check_under_attack("preauth-frames", mesh, baseline)


def test_never_finished_messages_on_a_member_link(mesh: Mesh, baseline: Baseline) -> None:
    check_under_attack("unfinished", mesh, baseline)


def test_a_ping_flood_from_a_member_that_never_reads(mesh: Mesh, baseline: Baseline) -> None:
    check_under_attack("ping-flood", mesh, baseline)


def test_idle_sockets_beyond_the_fd_limit(mesh: Mesh, baseline: Baseline) -> None:
    check_under_attack("idle-sockets", mesh, baseline)


def test_a_stranger_without_the_mesh_key(mesh: Mesh, baseline: Baseline) -> None:
    check_under_attack("stranger", mesh, baseline)


def test_a_nested_array_bomb_on_a_member_stream(mesh: Mesh, baseline: Baseline) -> None:
    check_under_attack("bomb", mesh, baseline)


def silent_host() -> socket.socket:
    """A host that accepts TCP (the kernel does) and never answers."""
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)
    return silent


def test_a_silent_seed_ends_join_with_one_line_and_sigint_before_the_dial_bound(tmp_path: Path) -> None:
    with silent_host() as silent:
        seed = f"127.0.0.1:{silent.getsockname()[1]}"
        command = meshd_command("join", "--no-model", "--state-dir", str(tmp_path), "--listen", "127.0.0.1:0",
                                "--seed", seed)
        started = time.monotonic()
        done = subprocess.run(command, capture_output=True, text=True, timeout=60, preexec_fn=limit_fds)
        took = time.monotonic() - started
    assert done.returncode != 0
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert lines == [f"meshd join: UNREACHABLE: no seed answered: no WebSocket upgrade from {seed} within 5 s"]
    assert "Traceback" not in done.stdout + done.stderr
    print(f"join gave up after {took:.1f} s (5 s dial deadline, plus start-up)")

    with silent_host() as silent:
        seed = f"127.0.0.1:{silent.getsockname()[1]}"
        command = command[:-1] + [seed]
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                preexec_fn=limit_fds)
        try:
            silent.settimeout(30)
            held, _ = silent.accept()  # the dial is under way
            with held:
                time.sleep(0.3)
                proc.send_signal(signal.SIGINT)
                sent = time.monotonic()
                _, err = proc.communicate(timeout=10)
                took = time.monotonic() - sent
        finally:
            stop_process(proc)
    # below the 5 s dial bound: the interrupt does not wait for the dial (1 s was too tight on a loaded box)
    assert took < 4.0, f"SIGINT took {took:.2f} s"
    assert proc.returncode != 0 and "Traceback" not in err


# ----- the attacker (this file run as a script)


def attack_main(argv: list[str]) -> None:
    case, target, key_file = argv
    trio.run(ATTACKS[case], target, load_mesh_key(Path(key_file)))


def ready() -> None:
    print("attacking", flush=True)


def parse(target: str) -> tuple[str, int]:
    host, port = target.rsplit(":", 1)
    return host, int(port)


def upgrade_request(target: str) -> bytes:
    return (f"GET / HTTP/1.1\r\nHost: {target}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
            "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n").encode()


async def raw_connect(target: str, source: str) -> trio.SocketStream:
    sock = trio.socket.socket()
    await sock.bind((source, 0))
    await sock.connect(parse(target))
    return trio.SocketStream(sock)


async def read_upgrade(stream: trio.SocketStream) -> bytes:
    reply = b""
    while b"\r\n\r\n" not in reply:
        data = await stream.receive_some(4096)
        if not data:
            raise trio.BrokenResourceError("closed during the upgrade")
        reply += data
    if not reply.startswith(b"HTTP/1.1 101"):
        raise trio.BrokenResourceError(reply.split(b"\r\n", 1)[0].decode())
    return reply.split(b"\r\n\r\n", 1)[1]


async def attack_preauth_frames(target: str, key: bytes) -> None:
    """300 connections, each upgraded and sending 1 MiB - 1 of one binary frame, back a second after each drop."""
    length = (1 << 20) - 1
    header = b"\x82\xff" + struct.pack(">Q", length) + b"\0\0\0\0"  # masked with a zero key
    chunk = bytes(64 << 10)

    async def one(n: int) -> None:
        while True:
            try:
                stream = await raw_connect(target, f"127.0.1.{2 + n % 30}")
                async with stream:
                    await stream.send_all(upgrade_request(target))
                    await read_upgrade(stream)
                    await stream.send_all(header)
                    sent = 0
                    while sent < length - 1:
                        piece = chunk[: min(len(chunk), length - 1 - sent)]
                        await stream.send_all(piece)
                        sent += len(piece)
                    await trio.sleep_forever()
            except (OSError, trio.BrokenResourceError, trio.ClosedResourceError):
                await trio.sleep(1.0)

    async with trio.open_nursery() as nursery:
        for n in range(300):
            nursery.start_soon(one, n)
        await trio.sleep(1.0)
        ready()


async def attack_unfinished(target: str, key: bytes) -> None:
    """8 streams at a time, each the start of a 24 MiB message that never ends; reopened when reset."""
    async with open_peers(NodeIdentity.generate(), PeersConfig(mesh_key=key)) as peers:
        link = await peers.connect(target)
        message = unfinished_activation(24 << 20)
        chunk = 64 << 10

        async def one() -> None:
            while True:
                try:
                    stream = link.open_stream(STAGE_PROTOCOL)
                    for start in range(0, len(message), chunk):
                        await stream.send_all(message[start:start + chunk])
                    await trio.sleep_forever()
                except Exception:
                    await trio.sleep(0.1)

        async with trio.open_nursery() as nursery:
            for _ in range(8):
                nursery.start_soon(one)
            await trio.sleep(1.0)
            ready()


async def member_handshake(target: str, key: bytes | None) -> tuple[trio.SocketStream, WSConnection, SecureLink]:
    """A member's link by hand (wsproto and the sans-IO core), so that it can stop reading."""
    stream = await raw_connect(target, "127.0.0.1")
    ws = WSConnection(ConnectionType.CLIENT)
    core = SecureLink(NodeIdentity.generate(), dialer=True,
                      mesh_key=None if key is None else mesh_key_from_secret(key))
    await stream.send_all(ws.send(Request(host=target, target="/")))

    async def flush() -> None:
        for record in core.records_to_send():
            await stream.send_all(ws.send(Message(data=record)))

    while not core.established:
        data = await stream.receive_some(65536)
        if not data:
            raise trio.BrokenResourceError("closed during the handshake")
        ws.receive_data(data)
        for event in ws.events():
            if isinstance(event, AcceptConnection):
                await flush()
            elif isinstance(event, BytesMessage):
                core.receive_record(bytes(event.data))
                await flush()
    return stream, ws, core


async def attack_ping_flood(target: str, key: bytes) -> None:
    """A member that sends PINGs as fast as it can and never reads; it comes back when dropped."""
    announced = False
    while True:
        try:
            stream, ws, core = await member_handshake(target, key)
            async with stream:
                if not announced:
                    ready()
                    announced = True
                now = 0.0
                while True:
                    for _ in range(64):
                        now += 1
                        core.mux.send_ping(now)
                    for record in core.records_to_send():
                        await stream.send_all(ws.send(Message(data=record)))
        except Exception:
            await trio.sleep(0.05)


async def attack_idle_sockets(target: str, key: bytes) -> None:
    """1,100 idle TCP connections from many source addresses, reopened a second after the node drops them."""

    async def one(n: int) -> None:
        while True:
            try:
                stream = await raw_connect(target, f"127.0.2.{2 + n % 100}")
                async with stream:
                    while await stream.receive_some(4096):
                        pass
            except (OSError, trio.BrokenResourceError, trio.ClosedResourceError):
                pass
            await trio.sleep(1.0)

    async with trio.open_nursery() as nursery:
        for n in range(1100):
            nursery.start_soon(one, n)
        await trio.sleep(1.0)
        ready()


async def attack_stranger(target: str, key: bytes) -> None:
    """Handshakes with a guessed key, 8 at a time: each must get a REJECT, never message 2."""
    identity = NodeIdentity.generate()

    async def one() -> None:
        while True:
            try:
                stream = await raw_connect(target, "127.0.3.2")
                async with stream:
                    ws = WSConnection(ConnectionType.CLIENT)
                    channel = SecureChannel(identity, initiator=True, mesh_key=mesh_key_from_secret(b"a guess"))
                    await stream.send_all(ws.send(Request(host=target, target="/")))
                    while True:
                        data = await stream.receive_some(65536)
                        if not data:
                            break
                        ws.receive_data(data)
                        for event in ws.events():
                            if isinstance(event, AcceptConnection):
                                for record in channel.records_to_send():
                                    await stream.send_all(ws.send(Message(data=record)))
                            elif isinstance(event, BytesMessage):
                                if bytes(event.data)[:1] != b"\x02":
                                    print("LEAK: the node answered a stranger with", bytes(event.data)[:1], flush=True)
                                    os._exit(3)
            except (OSError, trio.BrokenResourceError, trio.ClosedResourceError):
                await trio.sleep(0.05)

    async with trio.open_nursery() as nursery:
        for _ in range(8):
            nursery.start_soon(one)
        await trio.sleep(0.5)
        ready()


async def attack_bomb(target: str, key: bytes) -> None:
    """Messages of empty arrays just under the 8 MiB mark, one after another, on member streams, each
    behind the well-formed head of a message whose schema holds lists (a prompt, a status), so the
    decoder cannot refuse it by its first bytes alone."""
    bomb = b"\xdc\x00\x08" + (b"\xdd" + struct.pack(">I", 1 << 20) + b"\x90" * (1 << 20)) * 8
    messages = {}
    for protocol, tag in ((STAGE_PROTOCOL, "prompt"), (MESH_PROTOCOL, "status")):
        body = b"\x83" + b"".join(msgpack.packb(x) for x in ("type", tag, "v", 1, "messages")) + bomb
        messages[protocol] = struct.pack(">I", len(body)) + body
    async with open_peers(NodeIdentity.generate(), PeersConfig(mesh_key=key)) as peers:
        link = await peers.connect(target)
        announced = False
        while True:
            for protocol, message in messages.items():
                try:
                    stream = link.open_stream(protocol)
                    await stream.send_all(message)
                    if not announced:
                        ready()
                        announced = True
                    with trio.move_on_after(2):
                        await stream.receive_some()
                    await stream.aclose()
                except Exception:
                    await trio.sleep(0.05)


ATTACKS = {
    "preauth-frames": attack_preauth_frames,
    "unfinished": attack_unfinished,
    "ping-flood": attack_ping_flood,
    "idle-sockets": attack_idle_sockets,
    "stranger": attack_stranger,
    "bomb": attack_bomb,
}

if __name__ == "__main__":
    raise SystemExit("run through pytest; the attacks are started by the tests")
