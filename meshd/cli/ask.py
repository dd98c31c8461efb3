"""`meshd ask`: a question put to the mesh, its answer streamed to the terminal."""

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
from meshd.client.asker import Asker, Unverified, unverified_reason
from meshd.client.route import RouteSources, Stage, route_at, route_from_reply
from meshd.client.served import Served
from meshd.client.session import run_session
from meshd.net.control import ControlError, control_request
from meshd.net.peers import PeersConfig, open_peers
from meshd.net.rpc import mesh_rpc
from meshd.relay.circuit import enable_circuits
from wire.codec import Message
from wire.credit import (
    CountersignRequest,
    Voucher,
    VoucherReply,
    VoucherRequest,
)
from wire.errors import ErrorCode, ProtocolError
from wire.identity import NodeIdentity
from wire.meshrpc import RouteReply, RouteRequest, TrafficReport
from wire.receipt import Proof, ProofGossip
from wire.stage import Sampling

# `meshd ask -`: the prompt comes from standard input (a file, a pipe), as with cat and grep.
STDIN = "-"


async def own_voucher(state_dir: Path, opener: str, timeout: float) -> Voucher | None:
    """The local member's voucher for `opener` (this command's identity): stages rank the ask by the
    member's credit. None where the daemon gives none (the ask is then a newcomer's); no daemon at all
    is the ask's own error (ControlError), said as for its routes."""
    try:
        reply = await control_request(state_dir, VoucherRequest(opener=opener), timeout=timeout)
    except ProtocolError:
        return None
    return reply.voucher if isinstance(reply, VoucherReply) else None


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
