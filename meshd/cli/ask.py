"""`meshd ask`: a question put to the mesh, its answer streamed to the terminal.

It asks through the one asker (meshd.client.asker), as the HTTP front door does; its member is the
local daemon (on its control socket) or the member `--seed` names. A chat is rendered on the model's
own template (meshd.client.chat), as the front door renders it, so the same question gets the same
prompt and the same greedy answer either way.
"""

from __future__ import annotations

import argparse
import codecs
import contextlib
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import trio

from meshd import progress
from meshd.cli.failures import CommandError, UsageError, expect
from meshd.cli.figures import print_figures
from meshd.client.ask import AskRequest, AskResult, stop_trim
from meshd.client.asker import Unverified, member_asker, unverified_reason
from meshd.client.chat import ChatRequest
from meshd.client.route import route_at
from meshd.client.served import Served
from meshd.client.session import run_session
from meshd.net.control import ControlError, control_request
from meshd.net.peers import Peers, PeersConfig, open_peers
from meshd.net.rpc import mesh_rpc
from meshd.relay.circuit import enable_circuits
from wire.credit import CountersignRequest, Voucher, VoucherReply, VoucherRequest
from wire.errors import ErrorCode, ProtocolError
from wire.identity import NodeIdentity
from wire.meshrpc import RouteReply, RouteRequest, TrafficReport
from wire.message import Message
from wire.receipt import Proof, ProofGossip
from wire.stage import Sampling

# `meshd ask -`: the prompt comes from standard input (a file, a pipe), as with cat and grep.
STDIN = "-"
# How often `ask --wait` asks again for a route while the mesh cannot cover the model.
COVERAGE_POLL = 1.0
# Most work summaries one countersign request carries (the control socket's bound).
MAX_SUMMARIES = 64


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
            member = LocalMember(args, peers) if args.seed is None else SeedMember(args, peers)
            asker = member_asker(peers, member, args.model, verify_every=args.verify,
                                 require_verified=args.require_verified, stall_timeout=args.timeout)
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


class LocalMember:
    """The daemon on this machine, on its control socket, as the asker's member: its operator's asks
    are made on its credit, and it countersigns what they were served."""

    remote = True

    def __init__(self, args: argparse.Namespace, peers: Peers) -> None:
        self.state_dir: Path = args.state_dir
        self.timeout: float = args.timeout
        self.wait: float = args.wait
        # the asker's own identity, which signs the summaries the member countersigns
        self.identity = peers.identity

    async def route(self, model: str | None, excluded: list[str]) -> RouteReply:
        async def ask_route() -> Message:
            return await control_request(self.state_dir, RouteRequest(model=model, exclude=excluded),
                                         timeout=self.timeout)
        # mid-failover the model is covered: a missing route means the failed stages were the last of
        # their ranges, which no waiting for coverage brings back
        return await route_when_covered(ask_route, "the local meshd", 0.0 if excluded else self.wait)

    async def take_proof(self, proof: Proof) -> None:
        await self._request(ProofGossip(proof=proof))

    async def countersign(self, served: list[Served]) -> None:
        if served:
            at = int(time.time())
            summaries = [w.signed(self.identity, at) for w in served][:MAX_SUMMARIES]
            await self._request(CountersignRequest(summaries=summaries))

    async def voucher(self, opener: str) -> Voucher | None:
        return await own_voucher(self.state_dir, opener, self.timeout)

    async def report_traffic(self, report: TrafficReport) -> None:
        # the member reports it to the tracker as its own; a figure lost is the user's no concern
        with contextlib.suppress(ProtocolError, ControlError):
            await control_request(self.state_dir, report, timeout=self.timeout)

    async def _request(self, request: Message) -> None:
        try:
            await control_request(self.state_dir, request, timeout=self.timeout)
        except ControlError as exc:
            raise ProtocolError(ErrorCode.UNREACHABLE, str(exc)) from None


class SeedMember:
    """The member `--seed` names, over the mesh: it plans the routes and takes the proofs; the ask is a
    newcomer's (no member vouches for it, and nobody countersigns its work)."""

    remote = True

    def __init__(self, args: argparse.Namespace, peers: Peers) -> None:
        self.seed: str = args.seed
        self.timeout: float = args.timeout
        self.wait: float = args.wait
        self.peers = peers

    async def route(self, model: str | None, excluded: list[str]) -> RouteReply:
        async def ask_route() -> Message:
            return await mesh_rpc(self.peers, self.seed, RouteRequest(model=model, exclude=excluded), timeout=self.timeout)
        return await route_when_covered(ask_route, self.seed, 0.0 if excluded else self.wait)

    async def take_proof(self, proof: Proof) -> None:
        await mesh_rpc(self.peers, self.seed, ProofGossip(proof=proof), timeout=self.timeout)

    async def countersign(self, served: list[Served]) -> None:
        return None

    async def voucher(self, opener: str) -> Voucher | None:
        return None

    async def report_traffic(self, report: TrafficReport) -> None:
        return None  # with --seed no member asks: nobody reports for it


async def own_voucher(state_dir: Path, opener: str, timeout: float) -> Voucher | None:
    """The local member's voucher for `opener` (this command's identity): stages rank the ask by the
    member's credit. None where the daemon gives none (the ask is then a newcomer's); no daemon at all
    is the ask's own error (ControlError), said as for its routes."""
    try:
        reply = await control_request(state_dir, VoucherRequest(opener=opener), timeout=timeout)
    except ProtocolError:
        return None
    return reply.voucher if isinstance(reply, VoucherReply) else None


async def route_when_covered(ask_route: Callable[[], Awaitable[Message]], what: str, wait: float) -> RouteReply:
    """A route, asked for again while the mesh has none to give (NOT_FOUND) for up to `wait` seconds;
    on a terminal the wait shows what is missing. Any other error, or the last NOT_FOUND, is raised."""
    deadline = trio.current_time() + wait
    try:
        return expect(await ask_route(), RouteReply, what)
    except ProtocolError as exc:
        if exc.code is not ErrorCode.NOT_FOUND or wait < COVERAGE_POLL:
            raise
        missing = exc.message
    async with progress.waiting(f"waiting for the mesh to cover the model: {missing}") as line:
        # the last round raises: it ends within one poll of the deadline
        for _ in range(int(wait / COVERAGE_POLL)):
            await trio.sleep(COVERAGE_POLL)
            try:
                return expect(await ask_route(), RouteReply, what)
            except ProtocolError as exc:
                if exc.code is not ErrorCode.NOT_FOUND or trio.current_time() + COVERAGE_POLL > deadline:
                    raise
                line.say(f"waiting for the mesh to cover the model: {exc.message}")
    raise CommandError(f"the mesh did not cover the model within {wait:g} s")


def build_request(args: argparse.Namespace) -> AskRequest:
    """The ask's request: the prompt as plain text with --raw, else a chat the asker renders with the
    model's own template, as the HTTP API renders a chat completion of the same messages."""
    sampling = Sampling(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.sampling_seed)
    if args.raw:
        return AskRequest(text=args.prompt, sampling=sampling, max_tokens=args.max_tokens, stop=args.stop or [],
                          wire_dtype=args.wire_dtype, speculate=args.speculate, fast=not args.no_fast)
    messages = ([{"role": "system", "content": args.system}] if args.system else []) + \
        [{"role": "user", "content": args.prompt}]
    return AskRequest(chat=ChatRequest(messages=messages), sampling=sampling, max_tokens=args.max_tokens,
                      stop=args.stop or [], wire_dtype=args.wire_dtype, speculate=args.speculate,
                      fast=not args.no_fast)
