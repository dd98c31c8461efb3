"""What an ask saw of the route it took, for the tracker's stage speeds (meshd.mesh.traffic)."""

from __future__ import annotations

from meshd.client.ask import AskResult
from meshd.mesh.traffic import MIN_TRAFFIC_TOKENS
from wire.meshrpc import MAX_SECONDS_PER_TOKEN, TimedStage, TrafficReport


def traffic_report(result: AskResult) -> TrafficReport | None:
    """The route of ``result`` and the seconds per token its decode took; None where the answer timed no
    decode on one route (a failover or a new start mixes routes) or too few tokens to time one."""
    if result.epochs != 1 or result.failovers or result.withdrawn or len(result.tokens) < MIN_TRAFFIC_TOKENS \
            or not result.route or result.decode_rate <= 0.0:
        return None
    model = result.route[0].model_digest
    if any(info.model_digest != model for info in result.route):
        return None
    # each stage's own word (its signed span receipts) only where every stage's of the decode is in
    timed = len(result.own_seconds) == len(result.route) and result.own_rows > 0
    return TrafficReport(model=model, tokens=len(result.tokens),
                         seconds_per_token=min(1.0 / result.decode_rate, MAX_SECONDS_PER_TOKEN),
                         stages=[TimedStage(node_id=i.node_id, start=i.layer_begin, end=i.layer_end,
                                            own=min(result.own_seconds[k] / result.own_rows, MAX_SECONDS_PER_TOKEN)
                                            if timed else None)
                                 for k, i in enumerate(result.route)])
