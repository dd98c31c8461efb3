"""The stage counter the console's live tok/s reads: one decode row per generated token fed back, none for the prompt."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from meshd.net import rpc as net_rpc
from meshd.net.peers import PeersConfig, open_peers
from meshd.stage.books import StageLimits
from meshd.stage.node import stage_node
from wire.identity import NodeIdentity
from wire.stage import STAGE_PROTOCOL, Done, Metrics, MetricsRequest, Open, Opened, Prompt, new_session_id

# a stage with its engine worker process
pytestmark = pytest.mark.slow


async def test_decode_rows_count_the_generated_tokens_fed_back_and_reach_a_metrics_request(default_model: Path) -> None:
    limits = StageLimits(max_sessions=2, max_session_tokens=256)
    async with stage_node(default_model, None, limits, NodeIdentity.generate(), PeersConfig(drain_timeout=0.5),
                          threads=1) as node, open_peers(NodeIdentity.generate()) as asker:
        info = node.service.info()
        session = new_session_id()
        with trio.fail_after(60):
            async with await asker.open_stream(node.address, STAGE_PROTOCOL) as s:
                await s.send_message(Open(session=session, epoch=0, model_digest=info.model_digest,
                                          layer_begin=info.layer_begin, layer_end=info.layer_end, max_tokens=6))
                assert isinstance(await s.receive_message(), Opened)
                await s.send_message(Prompt(session=session, epoch=0, text="The capital of France is"))
                while not isinstance(done := await s.receive_message(), Done):
                    pass
            reply = await net_rpc.call(asker, node.address, STAGE_PROTOCOL, MetricsRequest(), Metrics, timeout=10)
        values = reply.values
        assert done.generated == 6
        # every token but the last goes round again as a row; the prompt's rows are not decode rows
        assert values["decode_rows"] == done.generated - 1
        assert values["rows"] > values["decode_rows"]
