"""The daemons: `meshd serve` (one layer range by hand), `meshd join` (a member) and `meshd relay`,
with the control socket's answers and the HTTP front door of a member.
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import trio

from meshd import progress
from meshd.cli.failures import UsageError
from meshd.cli.flags import check_port, default_state_dir, model_or_default
from meshd.cli.gpu import AUTO, gpu_layers_text, offload_text, resolve_gpu
from meshd.cli.hub import hub_whole, resolve_hub
from meshd.cli.pull import hub_range
from meshd.cli.text import mib
from meshd.client.ask import STALL_TIMEOUT
from meshd.client.served import Served
from meshd.client.verify import DEFAULT_VERIFY
from meshd.daemon import MeshDaemon
from meshd.daemon.config import NodeConfig
from meshd.engine.supervisor import EngineSupervisor
from meshd.fetch.hub import HubSpec
from meshd.mesh.assignment import ModelSpec
from meshd.mesh.election import ElectionConfig
from meshd.mesh.records import is_loopback, join_address
from meshd.net.control import ControlHandler, StateClaim, claim_state_dir, serve_control
from meshd.net.identity_store import IdentityError, load_or_create_identity
from meshd.net.peers import PeersConfig, open_peers
from meshd.relay.circuit import enable_circuits
from meshd.stage.books import StageLimits
from meshd.stage.model_file import describe_model
from meshd.stage.node import stage_node
from meshd.store.split import shown_name
from relay.limits import RelayLimits
from relay.punch import PunchLimits
from wire.credit import (
    CountersignRequest,
    CreditsRequest,
    VoucherReply,
    VoucherRequest,
    WorkTaken,
)
from wire.errors import ErrorCode, ProtocolError
from wire.identity import NodeIdentity
from wire.meshrpc import RouteRequest, StatusRequest, TrafficReport
from wire.message import Message
from wire.receipt import ProofGossip

# How long a daemon stopped by Ctrl-C gossips its goodbye: the rest of the second is for shutting down.
LEAVE_ON_INTERRUPT = 0.25


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
    # --api-stall-timeout (hidden): how long a stage of an ask may stay silent before the ask fails over
    stall_timeout: float = STALL_TIMEOUT


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
        # imported with a key file only: the front door's module loads prometheus_client, which a daemon without
        # an HTTP API (most volunteers) would pay for at every start
        from meshd.front.door import load_api_keys

        try:
            keys = load_api_keys(args.api_key_file)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
    if keys is None and not is_loopback(host.strip("[]")):
        raise UsageError(f"--api {join_address(host.strip('[]'), port)} is beyond loopback: give --api-key-file FILE "
                         f"so only holders of a key may ask (or bind 127.0.0.1)")
    if args.require_verified and args.verify == 0:
        raise UsageError("--require-verified needs spot checks: it cannot go with --verify 0")
    return ApiConfig(host.strip("[]"), port, keys, args.require_verified, args.verify, args.api_stall_timeout)


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
        front = FrontDoor(DaemonMesh(daemon, peers, api.stall_timeout, require_verified=api.require_verified,
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
    resolve_gpu(args, runs_layers=not args.no_model)
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
                             cache_tokens=args.cache_tokens, tenure=args.tenure)
        config = NodeConfig(listen=args.listen, seeds=tuple(args.seed), model=model, memory_bytes=args.memory,
                            gpu_memory_bytes=args.gpu_memory, gpu_layers=args.gpu_layers,
                            threads=args.threads, limits=limits, advertise=args.advertise,
                            peers=PeersConfig(mesh_key=args.mesh_key), state_dir=args.state_dir,
                            model_id=args.model_id, hub=hub_model, disk_bytes=args.disk,
                            progress=sys.stderr.isatty(), punch_limits=PunchLimits(retry_after=args.punch_retry),
                            ledger_interval=args.ledger_interval, credit_votes_every=args.credit_votes_every,
                            standing_every=args.standing_every,
                            asker_window_cap=args.asker_window_cap,
                            election=ElectionConfig(election_timeout=args.election_timeout))
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
