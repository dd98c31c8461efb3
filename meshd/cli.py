"""The `meshd` command line.

Every failure a user can cause ends in one line on stderr and a non-zero exit.
"""

from __future__ import annotations

import argparse
import codecs
import json
import logging
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

import trio

from meshd.client.ask import (
    AskRequest,
    AskResult,
    RouteError,
    Stage,
    ask_with_failover,
    first_error,
    route_at,
    route_from_reply,
    run_session,
    stop_trim,
)
from meshd.daemon import MeshDaemon, NodeConfig, rpc
from meshd.engine.chain import parse_ranges
from meshd.engine.supervisor import EngineSupervisor, WorkerStartError
from meshd.mesh.models import ModelNotFound, default_model_path
from meshd.net.identity_store import IdentityError, load_mesh_key, load_or_create_identity
from meshd.net.peers import PeersConfig, open_peers
from meshd.relay.circuit import enable_circuits
from meshd.stage.service import StageLimits, stage_node
from relay.limits import RelayLimits
from wire.errors import ProtocolError
from wire.identity import NodeIdentity
from wire.meshrpc import RouteReply, RouteRequest, StatusReply, StatusRequest
from wire.stage import Sampling


class UsageError(Exception):
    pass


def parse_address(text: str, what: str = "address") -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise UsageError(f"{what} '{text}' is not HOST:PORT")
    return host, int(port)


def parse_layers(text: str) -> tuple[int, int]:
    try:
        (layers,) = parse_ranges(text)
    except ValueError as exc:
        raise UsageError(f"--layers: {exc}") from None
    return layers


def parse_size(text: str) -> int:
    units = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    t = text.strip().lower().removesuffix("b").removesuffix("i")
    num, unit = (t[:-1], t[-1]) if t and t[-1] in units else (t, "")
    try:
        value = float(num)
    except ValueError:
        raise UsageError(f"size '{text}' is not a number with an optional K/M/G/T suffix") from None
    if value < 0:
        raise UsageError(f"size '{text}' is negative")
    return int(value * units[unit])


def read_mesh_key(path: Path | None) -> bytes | None:
    if path is None:
        return None
    try:
        key = path.read_bytes().strip()
    except OSError as exc:
        raise UsageError(f"cannot read the mesh key file {path}: {exc.strerror}") from None
    if not key:
        raise UsageError(f"the mesh key file {path} is empty")
    return key


def model_path(arg: Path | None) -> Path:
    path = arg or default_model_path()
    if not path.is_file():
        raise UsageError(f"model file not found: {path}")
    return path


# ----- serve

async def serve(args: argparse.Namespace) -> int:
    host, port = parse_address(args.listen, "--listen")
    path = model_path(args.model)
    layers = parse_layers(args.layers) if args.layers else None
    for name in ("max_sessions", "session_tokens", "threads"):
        if getattr(args, name) < (0 if name == "threads" else 1):
            raise UsageError(f"--{name.replace('_', '-')} must be positive")
    if not -1 <= args.poll <= 100:
        raise UsageError("--poll must be between 0 and 100 (or -1 for ggml's default)")
    kv_tokens = args.kv_tokens or args.max_sessions * args.session_tokens
    limits = StageLimits(max_sessions=args.max_sessions, max_session_tokens=args.session_tokens,
                         max_total_tokens=kv_tokens, ttl=args.ttl, evict_after=args.evict_after)
    config = PeersConfig(mesh_key=read_mesh_key(args.mesh_key_file))
    async with stage_node(path, layers, limits, NodeIdentity.generate(), config, (host, port), args.threads,
                          args.poll) as node:
        report = node.service.report
        print(f"meshd: serving layers [{report.layer_begin}, {report.layer_end}) of {path.name} "
              f"({node.service.digest[:12]}) on {node.address} as node {node.peers.node_id[:16]}", flush=True)
        print(f"ready {node.address} pid={os.getpid()} worker={node.engine.pid}", flush=True)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(report_restarts, node.engine)
            await trio.sleep_forever()
    return 0


async def report_restarts(engine: EngineSupervisor) -> None:
    seen = engine.restarts
    while True:
        await trio.sleep(0.5)
        if engine.restarts != seen:
            seen = engine.restarts
            print(f"meshd: engine worker died; restarted (restart {seen}, worker {engine.pid})", file=sys.stderr, flush=True)


# ----- join

def state_dir(arg: Path | None) -> Path:
    base = os.environ.get("XDG_STATE_HOME") or os.path.expanduser("~/.local/state")
    return arg or Path(base) / "meshd"


def parse_seeds(args: argparse.Namespace) -> tuple[str, ...]:
    seeds = tuple(args.seed or ())
    for s in seeds:
        parse_address(s, "--seed")
    return seeds


def node_identity(args: argparse.Namespace) -> tuple[NodeIdentity, bytes | None]:
    """The node's lasting key from --state-dir, and the mesh key if one is given."""
    try:
        identity = load_or_create_identity(state_dir(args.state_dir))
        mesh_key = load_mesh_key(args.mesh_key_file) if args.mesh_key_file else None
    except IdentityError as exc:
        raise UsageError(str(exc)) from None
    return identity, mesh_key


async def run_until_signal(daemon: MeshDaemon, banner: str, control: Path | None = None) -> None:
    """Runs a daemon until SIGTERM or SIGINT, then leaves the mesh gracefully.

    `control`, if given, names the file where local `ask` and `status` find the daemon.
    """
    async with trio.open_nursery() as nursery:
        await nursery.start(daemon.run)
        if control is not None:
            control.write_text(json.dumps({"address": daemon.address, "node_id": daemon.identity.node_id,
                                           "pid": os.getpid()}))
        try:
            print(f"meshd: {daemon.identity.node_id[:16]} on {daemon.address}, {banner}", flush=True)
            print(f"ready {daemon.address} pid={os.getpid()} node={daemon.identity.node_id}", flush=True)
            with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                async for _ in signals:
                    break
            await daemon.leave()
        finally:
            if control is not None:
                control.unlink(missing_ok=True)
        nursery.cancel_scope.cancel()


async def join(args: argparse.Namespace) -> int:
    listen = parse_address(args.listen, "--listen")
    seeds = parse_seeds(args)
    model = model_path(args.model) if args.model or not args.no_model else None
    identity, mesh_key = node_identity(args)
    limits = StageLimits(max_sessions=args.max_sessions, max_session_tokens=args.session_tokens,
                         max_total_tokens=args.max_sessions * args.session_tokens)
    config = NodeConfig(listen=listen, seeds=seeds, model=model, memory_bytes=parse_size(args.memory),
                        threads=args.threads, limits=limits, peers=PeersConfig(mesh_key=mesh_key))
    what = f"volunteering {model.name}" if model else "without a model"
    await run_until_signal(MeshDaemon(identity, config),
                           f"{what}, memory {args.memory}, seeds: {', '.join(seeds) or 'none (first node)'}",
                           state_dir(args.state_dir) / "daemon.json")
    return 0


async def relay(args: argparse.Namespace) -> int:
    listen = parse_address(args.listen, "--listen")
    seeds = parse_seeds(args)
    for name in ("max_reservations", "max_circuits_per_peer", "circuit_seconds", "idle_timeout"):
        if getattr(args, name) <= 0:
            raise UsageError(f"--{name.replace('_', '-')} must be positive")
    limits = RelayLimits(max_reservations=args.max_reservations, max_circuits_per_peer=args.max_circuits_per_peer,
                         max_circuit_bytes=parse_size(args.max_circuit_bytes),
                         max_circuit_seconds=args.circuit_seconds, idle_timeout=args.idle_timeout)
    identity, mesh_key = node_identity(args)
    tap = None
    if args.tap is not None:
        try:
            tap_file = open(args.tap, "ab", buffering=0)
        except OSError as exc:
            raise UsageError(f"cannot open --tap file {args.tap}: {exc.strerror}") from None
        tap = tap_file.write
    if args.advertise is not None:
        parse_address(args.advertise, "--advertise")
    config = NodeConfig(listen=listen, seeds=seeds, model=None, memory_bytes=0, relay=True, relay_limits=limits,
                        relay_tap=tap, advertise=args.advertise, peers=PeersConfig(mesh_key=mesh_key))
    await run_until_signal(MeshDaemon(identity, config),
                           f"relay with up to {limits.max_reservations} reservations, {args.max_circuit_bytes} and "
                           f"{limits.max_circuit_seconds:g} s per circuit, "
                           f"seeds: {', '.join(seeds) or 'none (first node)'}")
    return 0


def daemon_address(args: argparse.Namespace) -> str:
    """Where to send mesh requests: --seed, else the local daemon of the state directory."""
    if args.seed:
        parse_address(args.seed, "--seed")
        return args.seed
    control = state_dir(args.state_dir) / "daemon.json"
    try:
        return json.loads(control.read_text())["address"]
    except (OSError, ValueError, KeyError):
        raise UsageError(f"no local daemon ({control} is missing): run `meshd join` or give --seed HOST:PORT") from None


async def status(args: argparse.Namespace) -> int:
    address = daemon_address(args)
    config = PeersConfig(mesh_key=read_mesh_key(args.mesh_key_file))
    async with open_peers(NodeIdentity.generate(), config) as peers:
        enable_circuits(peers)
        reply = await rpc(peers, address, StatusRequest(), timeout=args.timeout)
    assert isinstance(reply, StatusReply)
    print_status(reply)
    return 0


def print_status(s: StatusReply) -> None:
    print(f"tracker: {s.tracker[:16] if s.tracker else 'none elected'} (term {s.term}); "
          f"{len(s.members)} members; asked node {s.node_id[:16]}")
    print(f"{'node':<18}{'address':<22}{'state':<8}{'roles':<16}{'memory':>10}  serves")
    for m in sorted(s.members, key=lambda m: m.node_id):
        memory = f"{m.memory_bytes / (1 << 20):.0f} MiB" if m.memory_bytes else "-"
        print(f"{m.node_id[:16]:<18}{m.address:<22}{m.state:<8}{','.join(m.roles) or '-':<16}{memory:>10}  "
              f"{'; '.join(m.served) or '-'}")
        if m.reachability == "nat":
            print(f"{'':<18}behind NAT, reachable via: {', '.join(m.relay_addresses) or 'no relay yet'}")
    for c in s.coverage:
        print(f"model {c.name} ({c.model[:12]}): {c.covered_layers}/{c.n_layers} layers covered, "
              f"{c.replicas} spare replica(s); stages: {'; '.join(c.assigned) or 'none yet'}")


# ----- ask

async def ask(args: argparse.Namespace) -> int:
    request = build_request(args)
    config = PeersConfig(mesh_key=read_mesh_key(args.mesh_key_file))
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    out = sys.stdout

    def show(token: int, piece: bytes) -> None:
        out.write(decoder.decode(piece))
        out.flush()

    on_token = None if args.stop else show
    async with open_peers(NodeIdentity.generate(), config) as peers:
        enable_circuits(peers)
        if args.route:
            addresses = [a.strip() for a in args.route.split(",") if a.strip()]
            for a in addresses:
                parse_address(a, "route stage")
            result = AskResult()
            await run_session(peers, route_at(addresses), request, result, on_token=on_token,
                              stall_timeout=args.timeout)
        else:
            via = daemon_address(args)

            async def find_route(excluded: list[str]) -> list[Stage]:
                reply = await rpc(peers, via, RouteRequest(exclude=excluded), timeout=args.timeout)
                assert isinstance(reply, RouteReply)
                return route_from_reply(reply)

            result = await ask_with_failover(peers, find_route, request, on_token, stall_timeout=args.timeout)
    if args.stop:
        out.write(stop_trim(result.text, args.stop))
    else:
        out.write(decoder.decode(b"", final=True))
    out.write("\n")
    out.flush()
    print_figures(result)
    return 0


def split_seeds(args: argparse.Namespace) -> None:
    """`ask --seed` is both the sampling seed (a number) and a member to ask through (HOST:PORT)."""
    numbers = [s for s in args.seed if s.isdigit()]
    members = [s for s in args.seed if not s.isdigit()]
    if len(numbers) > 1 or len(members) > 1:
        raise UsageError("give at most one sampling --seed N and one member --seed HOST:PORT")
    for m in members:
        parse_address(m, "--seed")
    args.sampling_seed = int(numbers[0]) if numbers else 0
    args.seed = members[0] if members else None


def build_request(args: argparse.Namespace) -> AskRequest:
    split_seeds(args)
    if args.max_tokens < 1:
        raise UsageError("--max-tokens must be at least 1")
    try:
        sampling = Sampling(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.sampling_seed)
    except ValueError as exc:
        raise UsageError(f"bad sampling options: {exc.errors()[0]['loc'][0]} {exc.errors()[0]['msg']}") from None
    if args.raw:
        if args.system:
            raise UsageError("--system needs the chat template; leave out --raw")
        return AskRequest(text=args.prompt, sampling=sampling, max_tokens=args.max_tokens, stop=args.stop or [],
                          wire_dtype=args.wire_dtype)
    messages = ([{"role": "system", "content": args.system}] if args.system else []) + \
        [{"role": "user", "content": args.prompt}]
    return AskRequest(messages=messages, sampling=sampling, max_tokens=args.max_tokens, stop=args.stop or [],
                      wire_dtype=args.wire_dtype)


def print_figures(result: AskResult) -> None:
    ttft = result.ttft
    print(f"[{len(result.prompt_tokens)} prompt tokens, {len(result.tokens)} new tokens, "
          f"first token {ttft * 1000:.0f} ms, {result.decode_rate:.1f} tokens/s, "
          f"stopped by {result.reason or 'error'}]" if ttft is not None else
          f"[{len(result.prompt_tokens)} prompt tokens, no new tokens, stopped by {result.reason}]",
          file=sys.stderr, flush=True)


# ----- parser

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="meshd", description="Run one GGUF model across many machines.")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="serve one layer range by hand")
    s.add_argument("--model", type=Path, help="GGUF file (default: SmolLM2-135M-Instruct Q4_1)")
    s.add_argument("--layers", help="layer range START:END (default: all layers)")
    s.add_argument("--listen", default="127.0.0.1:0", help="HOST:PORT to accept peers on")
    s.add_argument("--threads", type=int, default=0, help="compute threads (default: all cores)")
    s.add_argument("--poll", type=int, default=0,
                   help="how long idle compute threads spin for the next step, 0..100 (default 0: they sleep at "
                        "once, leaving the cores to other stages; -1: no persistent thread pool, ggml's default)")
    s.add_argument("--max-sessions", type=int, default=8, help="sessions served at once (KV sequences)")
    s.add_argument("--session-tokens", type=int, default=2048, help="KV tokens one session may hold")
    s.add_argument("--kv-tokens", type=int, default=0,
                   help="KV tokens of all sessions together (default: max sessions x session tokens)")
    s.add_argument("--ttl", type=float, default=300.0, help="seconds an idle session keeps its KV")
    s.add_argument("--evict-after", type=float, default=2.0,
                   help="seconds idle after which a session may be evicted to make room")
    s.add_argument("--mesh-key-file", type=Path)

    j = sub.add_parser("join", help="join a mesh as a volunteer (or start one without --seed)")
    j.add_argument("--seed", action="append", help="HOST:PORT of a member (repeatable); none starts a new mesh")
    j.add_argument("--model", type=Path, help="GGUF file to volunteer (default: SmolLM2-135M-Instruct Q4_1)")
    j.add_argument("--no-model", action="store_true", help="volunteer no model (a seed or tracker only)")
    j.add_argument("--listen", default="127.0.0.1:0", help="HOST:PORT to accept peers on")
    j.add_argument("--memory", default="1G", help="memory this node offers, e.g. 512M or 4G")
    j.add_argument("--state-dir", type=Path, help="where the node key lives (default ~/.local/state/meshd)")
    j.add_argument("--mesh-key-file", type=Path)
    j.add_argument("--threads", type=int, default=0)
    j.add_argument("--max-sessions", type=int, default=4)
    j.add_argument("--session-tokens", type=int, default=1024)

    r = sub.add_parser("relay", help="relay for members behind NAT (run on a public host)")
    r.add_argument("--listen", default="0.0.0.0:7400", help="HOST:PORT to accept peers on (must be dialable)")
    r.add_argument("--seed", action="append", help="HOST:PORT of a member (repeatable)")
    r.add_argument("--advertise", help="HOST:PORT members dial (default: the --listen address)")
    r.add_argument("--state-dir", type=Path, help="where the node key lives (default ~/.local/state/meshd)")
    r.add_argument("--mesh-key-file", type=Path)
    r.add_argument("--max-reservations", type=int, default=128, help="nodes this relay serves at once")
    r.add_argument("--max-circuits-per-peer", type=int, default=16, help="circuits one node may take part in")
    r.add_argument("--max-circuit-bytes", default="1G", help="bytes one circuit may carry, both ways together")
    r.add_argument("--circuit-seconds", type=float, default=3600.0, help="how long one circuit may last")
    r.add_argument("--idle-timeout", type=float, default=120.0, help="seconds of silence that end a circuit")
    r.add_argument("--tap", type=Path, help="append every byte forwarded to this file (debugging; it is ciphertext)")

    st = sub.add_parser("status", help="members, tracker, assignments and coverage")
    st.add_argument("--seed", help="ask this member instead of the local daemon")
    st.add_argument("--state-dir", type=Path)
    st.add_argument("--mesh-key-file", type=Path)
    st.add_argument("--timeout", type=float, default=10.0)

    a = sub.add_parser("ask", help="ask a question")
    a.add_argument("prompt")
    a.add_argument("--route", help="stages in order, HOST:PORT,HOST:PORT,... (default: the mesh picks)")
    a.add_argument("--seed", action="append", default=[],
                   help="a number seeds sampling; HOST:PORT asks through that member instead of the local daemon")
    a.add_argument("--state-dir", type=Path)
    a.add_argument("--max-tokens", type=int, default=256)
    a.add_argument("--temperature", type=float, default=0.0)
    a.add_argument("--top-k", type=int, default=0)
    a.add_argument("--top-p", type=float, default=1.0)
    a.add_argument("--system", help="system message")
    a.add_argument("--raw", action="store_true", help="send the prompt as plain text, without the chat template")
    a.add_argument("--stop", action="append", help="stop string (repeatable)")
    a.add_argument("--wire-dtype", choices=["f32", "f16", "q8_0"], default="f32")
    a.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for a stage before giving up")
    a.add_argument("--mesh-key-file", type=Path)
    return p


COMMANDS = {"serve": serve, "ask": ask, "join": join, "status": status, "relay": relay}


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=os.environ.get("MESHD_LOG", "WARNING").upper(), format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    try:
        return trio.run(COMMANDS[args.command], args)
    except BaseExceptionGroup as group:
        return report_failure(args.command, first_error(group))
    except BaseException as exc:
        return report_failure(args.command, exc)


def report_failure(command: str, exc: BaseException) -> int:
    """One line for what a user can cause; anything else is a bug and keeps its traceback."""
    if isinstance(exc, KeyboardInterrupt):
        return 130
    if isinstance(exc, (UsageError, RouteError, ModelNotFound, WorkerStartError)):
        message = str(exc)
    elif isinstance(exc, ProtocolError):
        message = f"{exc.code.value}: {exc.message}"
    elif isinstance(exc, trio.TooSlowError):
        message = "timed out waiting for a stage"
    elif isinstance(exc, OSError):
        message = exc.strerror or str(exc)
    else:
        raise exc
    print(f"meshd {command}: {message}", file=sys.stderr)
    return 2 if isinstance(exc, UsageError) else 1


if __name__ == "__main__":
    sys.exit(main())
