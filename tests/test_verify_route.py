"""Output verification on a real route: lying stages (attackers) are caught, blamed and routed around.

Stages of a tiny random model run in this process, each with its own engine
worker; the middle range is served three times, the tail twice. Two
attackers are meshd's own stage service with one thing patched: one flips a
float of its output at one of the answer's last steps (signing what it sent, so
only a spot check on a replica can catch it), one forwards its activations one position
off. Each is blamed (not an honest neighbour), and the answer is identical
to an undisturbed one.
"""

from __future__ import annotations

import random
import struct
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio
from hosted import together

import meshd.stage.batching as batching_module
from meshd.client.ask import AskRequest, AskResult
from meshd.client.failover import ask_with_failover
from meshd.client.probe import probe_stage
from meshd.client.route import Stage
from meshd.client.session import run_session
from meshd.client.verifier import Verifier
from meshd.client.verify import CheckPlan
from meshd.mesh.probes import ProbeConfig, StageProbe, probe_seconds
from meshd.mesh.proofs import check_proof
from meshd.net import rpc
from meshd.net.peers import Peers, PeersConfig, open_peers
from meshd.net.stream import Stream
from meshd.stage.books import StageLimits
from meshd.stage.node import StageNode, stage_node
from meshd.stage.service import StageService
from wire.errors import ErrorCode, ProtocolError
from wire.identity import NodeIdentity
from wire.message import ErrorMessage, Message
from wire.receipt import MAX_CHAIN, NO_PREV, WIRE_BYTES, Receipt, Receipts, row_hash
from wire.stage import STAGE_PROTOCOL, Hop, Open, Opened, PeerRef, Token, new_session_id
from wire.tensors import Activation, TensorEntry

pytestmark = pytest.mark.slow  # six engine workers

ASK_DEADLINE = 120
RANGES = {"head": (0, 2), "mid": (2, 4), "mid2": (2, 4), "mid3": (2, 4), "tail": (4, 6), "tail2": (4, 6)}
# the daemons' path, whose stage services the attackers patch (tests/test_verify_fast.py: the fast path)
REQUEST = AskRequest(text="The lighthouse keeper climbed the stairs", max_tokens=24, fast=False)


def stage_of(node: StageNode) -> Stage:
    r = node.service.report
    return Stage(node.address, node.peers.node_id, node.service.digest, (r.layer_begin, r.layer_end))


def attacker_flipping_a_float(service: StageService, at_call: int) -> None:
    """An attacker: flips the sign of one float of its output in its ``at_call``-th engine call of a
    routed session (not of a check session), and signs what it sends as an honest stage would."""
    honest = service.batcher.dispatch
    calls = [0]

    def lying(batch: list[Any], reply: dict[str, Any], body: bytearray) -> None:
        if any(not w.payload.session.open.check for w in batch):
            calls[0] += 1
            if calls[0] == at_call:
                rows = np.frombuffer(body, dtype=np.float32)
                rows[0] = -rows[0] if rows[0] else 1.0
        honest(batch, reply, body)

    service.batcher.dispatch = lying  # type: ignore[method-assign]


def attacker_one_position_off(service: StageService) -> None:
    """An attacker: forwards every activation one position further on than the rows it computed."""
    honest = service.batcher.dispatch

    def shifted(batch: list[Any], reply: dict[str, Any], body: bytearray) -> None:
        # _dispatch does not yield, so no other stage of this process encodes meanwhile
        real = batching_module.encode_activation

        def moved(**fields: Any) -> bytes:
            fields["pos"] += 1
            return real(**fields)

        batching_module.encode_activation = moved
        try:
            honest(batch, reply, body)
        finally:
            batching_module.encode_activation = real

    service.batcher.dispatch = shifted  # type: ignore[method-assign]


async def refused_chain(peers: Peers, head: PeerRef, node: StageNode, chain: Callable[[str, bytes], bytes],
                        ) -> ProtocolError:
    """An attacker upstream (the opener, named upstream at open, and the tail's ``head``) sends the tail
    ``node`` one step of rows with ``chain(session, h_rows)`` as its packed receipts; the typed error that
    fails the session, after checking that nothing of the step (a receipt, a token) came back before it."""
    session = new_session_id()
    r = node.service.report
    async with await peers.open_stream(node.address, STAGE_PROTOCOL, node_id=node.peers.node_id) as control:
        await rpc.request(control, Open(session=session, epoch=0, layer_begin=r.layer_begin, layer_end=r.layer_end,
                                        head=head, upstream=peers.node_id, receipts=True), Opened,
                          "an attacker's session")
        async with await peers.open_stream(node.address, STAGE_PROTOCOL, node_id=node.peers.node_id) as hop:
            await hop.send_message(Hop(session=session, epoch=0, prompt_tokens=1))
            rows = TensorEntry.from_array("hidden_states", np.ones((1, r.stage_width), dtype=np.float32))
            await hop.send_message(Activation.unvalidated({
                "type": "activation", "v": 1, "session": session, "epoch": 0, "step": 0, "pos": 0, "n_tokens": 1,
                "tensors": [rows], "tokens": None, "deadline_ms": None, "drafts": 0,
                "receipts": chain(session, row_hash(rows.data))}))
            with trio.fail_after(30):
                msg = await control.receive_message()
            assert isinstance(msg, ErrorMessage), f"{msg.type} left the stage before the error"
            assert not isinstance(msg, Receipts | Token)
            return ProtocolError(msg.code, msg.message)


def route_finder(pool: Sequence[StageNode]) -> Callable[[list[str]], Any]:
    """Routes over ``pool`` as a tracker would plan them: the first node of each range not excluded."""

    async def find(excluded: list[str]) -> list[Stage]:
        route: list[Stage] = []
        for begin in (0, 2, 4):
            route.append(next(stage_of(n) for n in pool if n.service.report.layer_begin == begin
                              and n.peers.node_id not in excluded))
        return route

    return find


@asynccontextmanager
async def stage_nodes(model: Path, ranges: dict[str, tuple[int, int]]) -> AsyncIterator[dict[str, StageNode]]:
    """A stage of ``model`` for each named range, in this process, each with an engine worker of one thread."""
    limits = StageLimits(max_sessions=6, max_session_tokens=256)
    # started side by side, and stopped so
    async with together([stage_node(model, layers, limits, NodeIdentity.generate(), PeersConfig(drain_timeout=0.5),
                                    threads=1) for layers in ranges.values()]) as nodes:
        yield dict(zip(ranges, nodes, strict=True))


async def test_lying_stages_are_caught_blamed_and_routed_around(tiny_models: dict[str, Path]) -> None:
    async with stage_nodes(tiny_models["llama-gqa-untied"], RANGES) as nodes:
        pool = list(nodes.values())
        find = route_finder(pool)
        identity = NodeIdentity.generate()
        async with open_peers(identity, PeersConfig(drain_timeout=0.5)) as peers:
            with trio.fail_after(ASK_DEADLINE):
                undisturbed = await run_session(peers, await find([]), REQUEST, AskResult())
                # verification on and nobody lying: the same answer, and checks that found nothing
                plan = CheckPlan(every=1, candidates=[stage_of(n) for n in pool])
                honest = await ask_with_failover(peers, find, REQUEST, verifier=Verifier(peers, plan))
                assert honest.tokens == undisturbed.tokens and honest.epochs == 1
                assert plan.checks > 0
                # the ranges with a replica were checked to the end; the head's has none, and says so
                assert [(n.layers, n.since, n.why) for n in honest.unverified] == [("[0, 2)", 0, "no replica")]

                # a stage computing wrongly at one of the answer's last steps, after the last draw of a
                # spot check (none comes at 1 in 2**30): the check every range gets once the answer is
                # in catches it, so no lie goes unchecked for want of a draw after it
                liar = nodes["mid"]
                attacker_flipping_a_float(liar.service, REQUEST.max_tokens - 1)
                verifier = Verifier(peers, CheckPlan(every=1 << 30, candidates=[stage_of(n) for n in pool],
                                                     rng=random.Random(8)))
                caught = await ask_with_failover(peers, find, REQUEST, verifier=verifier)
                assert verifier.liars == {liar.peers.node_id}
                assert caught.tokens == undisturbed.tokens and caught.epochs == 2
                # every range with a replica was checked to the end of the answer; the head's has none, and says so
                assert [(n.layers, n.why) for n in caught.unverified] == [("[0, 2)", "no replica")]
                (proof,) = verifier.proofs
                # two replicas against one: anyone can check it and name the liar
                assert proof.kind == "divergence" and check_proof(proof) == liar.peers.node_id

                # a stage forwarding its rows one position off: the stage after it refuses them, and as its
                # word is no evidence (it could be framing its upstream), both are routed around for the ask,
                # neither named to the mesh; the answer is the undisturbed one
                shifter = nodes["mid2"]
                attacker_one_position_off(shifter.service)
                verifier = Verifier(peers, CheckPlan(every=0))
                moved = await ask_with_failover(peers, route_finder([nodes["head"], shifter, nodes["mid3"],
                                                                     nodes["tail"], nodes["tail2"]]),
                                                REQUEST, verifier=verifier)
                assert shifter.peers.node_id in verifier.liars and len(verifier.liars) == 2
                assert not verifier.proofs and moved.tokens == undisturbed.tokens

            # An attacker upstream sends a stage rows whose packed receipts are truncated, too many, made
            # up, or its own receipt with its signature spoiled: each fails only the attacker's session,
            # typed, before anything of the step leaves the stage (which never signs over a forgery);
            # the stage serves on (the probe below runs a session of its own on it)
            target = nodes["tail2"]
            # the attacker is the tail's head too: what the tail sends around the ring comes here
            ring: list[Message] = []

            async def ring_end(stream: Stream) -> None:
                async for message in stream.messages():
                    ring.append(message)

            peers.handle(STAGE_PROTOCOL, ring_end)
            me = PeerRef(address=f"127.0.0.1:{await peers.listen('127.0.0.1', 0)}", node_id=peers.node_id)

            def signed_badly(session: str, h_rows: bytes) -> bytes:
                mine = Receipt.build(session, 0, 0, 1, target.service.digest, 0, target.service.report.layer_begin,
                                     row_hash(b"in"), h_rows, row_hash(b"hist"), NO_PREV, identity.public_key,
                                     identity)
                return mine.wire[:-1] + bytes([mine.wire[-1] ^ 1])

            attacks = {
                "truncated": (lambda session, h: bytes(2 * WIRE_BYTES - 1), ErrorCode.PAYLOAD_CORRUPT, "1 to 32"),
                "too many": (lambda session, h: bytes(WIRE_BYTES * (MAX_CHAIN + 1)), ErrorCode.BAD_REQUEST, "receipts"),
                "garbage": (lambda session, h: np.random.default_rng(5).bytes(WIRE_BYTES), ErrorCode.PAYLOAD_CORRUPT,
                            "out of bounds"),
                # in bounds (step 0+1, layers [0, 4)), the rest made up
                "made up": (lambda session, h: struct.pack("<IIII", 0, 1, 0, 4) + np.random.default_rng(5).bytes(
                    WIRE_BYTES - 16), ErrorCode.PAYLOAD_CORRUPT, "receipts from the upstream stage"),
                "signed badly": (signed_badly, ErrorCode.PAYLOAD_CORRUPT, "bad signature"),
            }
            for what, (chain, code, fragment) in attacks.items():
                refused = await refused_chain(peers, me, target, chain)
                assert refused.code is code and fragment in refused.message, (what, refused)
            assert not any(isinstance(m, Activation) for m in ring)

            # The tracker's probe (meshd.client.probe) times a real head, middle and tail: a check
            # session of one-row steps, each answered with a receipt, and the session gone after.
            for name in ("head", "mid3", "tail2"):
                node = nodes[name]
                r = node.service.report
                probe = StageProbe(node.peers.node_id, node.service.digest, r.layer_begin, r.layer_end)
                timed = await probe_stage(peers, node.address, probe, ProbeConfig())
                assert timed is not None and len(timed.steps) == 3 and not timed.timed_out, name
                assert probe_seconds(timed) is not None, name
                with trio.fail_after(10):
                    while node.service.metric_values()["sessions"]:
                        await trio.sleep(0.01)
            # a stage that holds a session is not probed: a probe never takes (or evicts) a user's slot
            head = nodes["head"]
            async with await peers.open_stream(head.address, STAGE_PROTOCOL, node_id=head.peers.node_id) as held:
                await rpc.request(held, Open(session=new_session_id(), epoch=0, receipts=True, check=True), Opened,
                                  "a session the probe must not disturb", timeout=10)
                r = head.service.report
                probe = StageProbe(head.peers.node_id, head.service.digest, r.layer_begin, r.layer_end)
                assert await probe_stage(peers, head.address, probe, ProbeConfig()) is None
                assert head.service.metric_values()["sessions"] == 1
