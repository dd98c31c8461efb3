"""One way to open a check session on a stage, for the asker's spot checks and the tracker's probes.

A check session (``Open.check``) is fed by its opener: the opener is its upstream and its head's
ring, the stage signs a receipt of each step and sends nothing on. To the stage a spot check's
replica and a probe are the same thing, so they are opened the same way here. A check session may
also be a link of a chain of them (meshd.client.chain_check): fed by the link before it instead of
its opener, and feeding the next one, each signing for the opener alone.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import trio

from meshd.client.session import release_all
from meshd.net import rpc
from meshd.net.peers import Peers
from meshd.net.stream import Stream
from wire.stage import (
    STAGE_PROTOCOL,
    Grammar,
    Hop,
    Open,
    Opened,
    PeerRef,
    PromptTokens,
    Sampling,
    StageInfo,
    new_session_id,
)


@dataclass
class CheckSession:
    session: str
    control: Stream
    # the opener's hop stream, which feeds it (None: the link of a chain before it feeds it)
    hop: Stream | None
    info: StageInfo

    async def aclose(self) -> None:
        """Ends it as a route's sessions end: the stage's Released before the streams close, so it never
        writes a receipt still due onto a stream the opener already reset."""
        with trio.CancelScope(shield=True), trio.move_on_after(0.5):
            await release_all([self.control], self.session, 0)
        with trio.CancelScope(shield=True):
            if self.hop is not None:
                await self.hop.aclose()


async def open_check_session(peers: Peers, address: str, node_id: str | None, model: str | None,
                             layers: tuple[int, int] | None, sampling: Sampling, max_tokens: int,
                             prompt_ids: Sequence[int], what: str,
                             check: Callable[[StageInfo], None], session: str | None = None,
                             upstream: str | None = None, next_stage: PeerRef | None = None,
                             grammar: Grammar | None = None, generated: int = 0, sketch: int = 0) -> CheckSession:
    """Opens a check session on the stage at ``address`` for a prompt of ``prompt_ids``. ``check``
    sees the stage's own account before anything more is sent and may refuse it (a ProtocolError):
    the session is then released, as on any failure here. A tail after the head gets the prompt's
    ids (its sampler's penalty history); a head is fed as the ring feeds it. A tail that samples under
    ``grammar`` gets it with the ids (a whole-model tail too), the last ``generated`` of which it reads
    first. In a chain, the node
    ``upstream`` feeds it (else the opener does, on a hop stream opened here) and it sends its rows
    on to ``next_stage``, whose link of the chain is open by then. With ``sketch`` each receipt comes
    with a sketch of its step's output (a replica of other numerics: wire.sketch)."""
    control = await peers.open_stream(address, STAGE_PROTOCOL, node_id=node_id)
    session = session or new_session_id()
    hop: Stream | None = None
    begin, end = layers or (None, None)
    try:
        reply = await rpc.request(control, Open(
            session=session, epoch=0, model_digest=model, layer_begin=begin, layer_end=end, next=next_stage,
            upstream=upstream or peers.node_id, sampling=sampling, max_tokens=max_tokens, receipts=True,
            check=True, sketch=sketch), Opened, what)
        info = reply.info
        check(info)
        head = info.layer_begin == 0
        # before the hop is opened, so the stage has set the grammar before a row can come to be sampled
        if info.layer_end == info.n_layer and (not head or grammar is not None):
            await control.send_message(PromptTokens(session=session, epoch=0, tokens=list(prompt_ids),
                                                    grammar=grammar, generated=generated))
        if upstream is None:
            hop = await peers.open_stream(address, STAGE_PROTOCOL, node_id=info.node_id)
            await hop.send_message(Hop(session=session, epoch=0, ring=head, prompt_tokens=len(prompt_ids),
                                       carry_tokens=int(info.needs_tokens)))
    except BaseException:
        with trio.CancelScope(shield=True), trio.move_on_after(0.5):
            await release_all([control], session, 0)
            if hop is not None:
                await hop.aclose()
        raise
    return CheckSession(session, control, hop, info)
