"""Hostile byte strings and stranger sessions shared by the tests that attack real links and daemons."""

from __future__ import annotations

import contextlib

import numpy as np
import trio

from meshd.net.peers import Peers, open_peers
from meshd.net.stream import Stream
from wire.errors import ProtocolError
from wire.identity import NodeIdentity
from wire.message import ErrorMessage
from wire.stage import STAGE_PROTOCOL, Hop, Open, Opened, PeerRef, PromptTokens
from wire.tensors import Activation, TensorEntry, encode_activation, tensor_fields


def unfinished_activation(size: int) -> bytes:
    """A length-prefixed activation of about `size` bytes, all but its last byte.

    A well-formed head (type, version, session, a raw f32 tensor), so the decoder
    cannot refuse it at its first bytes and must hold what comes until the rest
    does, which never comes.
    """
    rows = np.zeros((1, max(1, size // 4)), dtype=np.float32)
    framed = encode_activation(session="s", epoch=0, step=0, pos=0, n_tokens=1,
                               tensors=[tensor_fields("hidden_states", rows, "f32", "raw")])
    return framed[:-1]


async def _drain(stream: Stream) -> None:
    with contextlib.suppress(ProtocolError, trio.EndOfChannel, trio.BrokenResourceError, trio.ClosedResourceError):
        while True:
            await stream.receive_message()


async def typed_error(stream: Stream, timeout: float = 30.0) -> ProtocolError:
    """The typed error a stream ends with: raised by the link, or sent as an ErrorMessage."""
    with trio.fail_after(timeout):
        while True:
            try:
                msg = await stream.receive_message()
            except ProtocolError as exc:
                return exc
            if isinstance(msg, ErrorMessage):
                return ProtocolError(msg.code, msg.message, msg.retry_after_ms)


async def stranger_error(peers: Peers, address: str, width: int, ids: list[int] | None, carry: int,
                         prompt_ids: list[int] | None = None) -> ProtocolError:
    """A stranger's session on the stage at ``address``: (optionally) the prompt's ids on its control
    stream, then a Hop saying the ids reach ``carry`` stages and two rows of ``width`` with ``ids``;
    returns its typed error."""
    async with open_peers(NodeIdentity.generate()) as sink_peers:
        sink_peers.handle(STAGE_PROTOCOL, _drain)
        port = await sink_peers.listen("127.0.0.1", 0)
        sink = PeerRef(address=f"127.0.0.1:{port}", node_id=sink_peers.node_id)
        with trio.fail_after(30):
            control = await peers.open_stream(address, STAGE_PROTOCOL)
            await control.send_message(Open(session="stranger", epoch=0, head=sink, next=sink))
            assert isinstance(await control.receive_message(), Opened)
            if prompt_ids is not None:
                await control.send_message(PromptTokens(session="stranger", epoch=0, tokens=prompt_ids))
            hop = await peers.open_stream(address, STAGE_PROTOCOL)
            await hop.send_message(Hop(session="stranger", epoch=0, prompt_tokens=2, carry_tokens=carry))
            rows = np.zeros((2, width), dtype=np.float32)
            await hop.send_message(Activation(session="stranger", epoch=0, step=0, pos=0, n_tokens=2,
                                              tensors=[TensorEntry(**tensor_fields("hidden_states", rows))],
                                              tokens=ids))
            return await typed_error(control)
