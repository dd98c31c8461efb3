"""What a member says of the mesh: `meshd status`, `meshd models` and `meshd credits`."""

from __future__ import annotations

import argparse
import json
from collections.abc import Awaitable, Callable

import trio

from meshd import status_table
from meshd.cli.failures import CommandError, expect
from meshd.cli.text import mib, plural
from meshd.net.control import control_request
from meshd.net.peers import PeersConfig, open_peers
from meshd.net.rpc import mesh_rpc
from meshd.relay.circuit import enable_circuits
from wire.credit import (
    CreditsReply,
    CreditsRequest,
    PeerCredit,
)
from wire.identity import NodeIdentity
from wire.meshrpc import FetchStatus, StatusReply, StatusRequest
from wire.message import Message

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


def print_status(s: StatusReply, as_json: bool = False) -> None:
    if as_json:
        print(json.dumps(status_table.as_json(s), indent=2))
        return
    print(status_table.render(s))
    for f in s.fetches:
        print(fetch_line(f))
