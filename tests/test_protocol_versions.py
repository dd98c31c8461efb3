"""A peer of another meshd release: a stream of a known protocol at another version is refused with a
typed error naming both versions, not a bare "no handler"."""

from __future__ import annotations

import pytest
import trio

from meshd.net.peers import PeersConfig, open_peers
from meshd.net.stream import Stream
from wire.errors import ErrorCode, ProtocolError
from wire.identity import NodeIdentity
from wire.limits import same_protocol_other_version
from wire.message import ErrorMessage
from wire.stage import STAGE_PROTOCOL

QUICK = PeersConfig(drain_timeout=0.1)


def test_the_stage_protocol_is_version_7() -> None:
    # 2: a tail waits for the asker's PromptTokens; receipts moved to meshd/receipt/2
    # 3: receipts sign meshd/receipt/3 bytes
    # 4: the fast path (Open.fast, Hop.fast)
    # 5: the prefix cache (Prompt.cache, Hop.start, the cache messages, StageInfo.cache_tokens)
    # 6: the model's own chat template and grammars (Open.chat_template, Prompt.grammar, ...), logprobs
    # 7: receipts sign meshd/receipt/4 bytes, with the stage's own time (Receipt.t_us)
    assert STAGE_PROTOCOL == "meshd/stage/7"


def test_a_name_of_a_known_family_at_another_version_is_recognised() -> None:
    known = {"meshd/stage/2", "meshd/swim/1", "echo"}
    assert same_protocol_other_version("meshd/stage/1", known) == "meshd/stage/2"
    assert same_protocol_other_version("meshd/stage/3", known) == "meshd/stage/2"
    # the same version, another family, or no version at all: not a version mismatch
    assert same_protocol_other_version("meshd/stage/2", known) is None
    assert same_protocol_other_version("meshd/fetch/1", known) is None
    for name in ("echo", "/1", "meshd", ""):
        assert same_protocol_other_version(name, known | {"echo/1", "meshd/"}) is None


async def test_a_peer_speaking_another_stage_version_gets_a_typed_error_and_others_are_served() -> None:
    async def stage(stream: Stream) -> None:
        async for message in stream.messages():
            await stream.send_message(message)

    with trio.fail_after(20):
        async with open_peers(NodeIdentity.generate(), QUICK) as new, open_peers(NodeIdentity.generate(), QUICK) as old:
            new.handle(STAGE_PROTOCOL, stage)
            address = f"127.0.0.1:{await new.listen('127.0.0.1', 0)}"
            stale = await old.open_stream(address, "meshd/stage/1")
            await stale.send_message(ErrorMessage(code=ErrorCode.BAD_REQUEST, message="hello"))
            with pytest.raises(ProtocolError) as refused:
                await stale.receive_message()
            assert refused.value.code is ErrorCode.VERSION_MISMATCH and not refused.value.retryable
            assert "speaks meshd/stage/7, not meshd/stage/1" in refused.value.message
            # an unknown protocol is still only unknown; the current version is served on the same link
            other = await old.open_stream(address, "meshd/nonesuch/1")
            with pytest.raises(ProtocolError) as unknown:
                await other.receive_message()
            assert unknown.value.code is ErrorCode.NOT_FOUND
            current = await old.open_stream(address, STAGE_PROTOCOL)
            await current.send_message(ErrorMessage(code=ErrorCode.BAD_REQUEST, message="hello"))
            assert isinstance(await current.receive_message(), ErrorMessage)
