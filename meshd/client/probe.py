"""The tracker's stage probe, carried out: a check session timed step by step (see meshd.mesh.probes).

The stage gets what an asker's spot check sends it (``Open`` with ``check``, a
hop stream from its opener, one-row steps) and answers each step with its
signed receipt, so to the stage a probe is one more check session. Its inputs
are made up (token ids for a head, random rows for a later stage): only the
time counts, not the output.
"""

from __future__ import annotations

import numpy as np
import trio

from meshd.client.check_session import open_check_session
from meshd.mesh.probes import ProbeConfig, ProbeResult, StageProbe
from meshd.net import rpc
from meshd.net.peers import Peers
from meshd.net.stream import Stream
from wire.errors import ErrorCode, ProtocolError
from wire.message import ErrorMessage, error_from_message
from wire.receipt import Receipts
from wire.stage import STAGE_PROTOCOL, Cancel, Metrics, MetricsRequest, Sampling, StageInfo
from wire.tensors import encode_activation, tensor_fields

HIDDEN = "hidden_states"
# a token id every vocabulary has: the head's probe input
PROBE_TOKEN = 1


# messages a probe's control stream may bring per step (its receipt, a tail's token): past it, a stage
# that floods is done with
MAX_PER_STEP = 8


class StageBusy(Exception):
    """The stage holds sessions: a probe would take a slot from (or evict) a user's."""


class _Timing:
    def __init__(self, now: float) -> None:
        self.rtt = 0.0
        self.steps: list[float] = []
        self.since = now  # when what is under way (the link's round trip, the open, a step) began


async def probe_stage(peers: Peers, address: str, probe: StageProbe, config: ProbeConfig) -> ProbeResult | None:
    """Times `probe`'s stage: the link's round trip, then `config.steps` one-row steps of a check
    session. None where the stage was busy, refused or broke off; a timeout is a result
    (`timed_out`: the step under way counts as the time it had)."""
    timing = _Timing(trio.current_time())
    with trio.move_on_after(config.timeout) as scope:
        try:
            timing.rtt = await _link_rtt(peers, address, probe, config.timeout)
            timing.since = trio.current_time()
            await _timed_steps(peers, address, probe, config.steps, timing)
        # ValueError: a stage width the wire cannot carry a row of (a stage's own word, bounded by StageInfo)
        except (ProtocolError, StageBusy, ValueError, trio.BrokenResourceError, trio.ClosedResourceError,
                trio.EndOfChannel):
            return None
        return ProbeResult(timing.rtt, tuple(timing.steps))
    assert scope.cancelled_caught
    # out of time at the link, the open or a step: the one under way took at least what it had
    return ProbeResult(timing.rtt, (*timing.steps, trio.current_time() - timing.since), timed_out=True)


async def _link_rtt(peers: Peers, address: str, probe: StageProbe, timeout: float) -> float:
    """One metrics request's round trip on the link to the stage; StageBusy if it holds sessions."""
    t0 = trio.current_time()
    metrics = await rpc.call(peers, address, STAGE_PROTOCOL, MetricsRequest(), Metrics, node_id=probe.node_id,
                             timeout=timeout)
    rtt = trio.current_time() - t0
    if metrics.values.get("sessions", 0.0) != 0.0:
        raise StageBusy()
    return rtt


async def _timed_steps(peers: Peers, address: str, probe: StageProbe, n_steps: int, timing: _Timing) -> None:
    def placed(info: StageInfo) -> None:
        if (info.node_id, info.model_digest, info.layer_begin, info.layer_end) != (
                probe.node_id, probe.model, probe.start, probe.end):
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"stage {address} serves other layers than placed")

    # a tail's sampler reads the prompt's ids: one token here, the first step's
    opened = await open_check_session(peers, address, probe.node_id, probe.model, (probe.start, probe.end),
                                      Sampling(), n_steps + 1, [PROBE_TOKEN], f"stage {address} opening a probe",
                                      placed)
    info, session, control, hop = opened.info, opened.session, opened.control, opened.hop
    assert hop is not None, "the prober feeds the session it opened"
    head = info.layer_begin == 0
    try:
        rows = np.random.default_rng(0)
        for pos in range(n_steps):
            tensors = [] if head else [tensor_fields(HIDDEN, rows.standard_normal((1, info.stage_width), np.float32))]
            tokens = [PROBE_TOKEN] if head or info.needs_tokens else None
            timing.since = trio.current_time()
            await hop.send_all(encode_activation(session=session, epoch=0, step=pos, pos=pos, n_tokens=1,
                                                 tensors=tensors, tokens=tokens))
            await _receipt(control)
            timing.steps.append(trio.current_time() - timing.since)
    finally:
        with trio.CancelScope(shield=True), trio.move_on_after(0.5):
            try:
                await control.send_message(Cancel(session=session, epoch=0))
            except (ProtocolError, trio.BrokenResourceError, trio.ClosedResourceError):
                pass
            await hop.aclose()
            await control.aclose()


async def _receipt(control: Stream) -> None:
    """The next step's receipt (tokens a tail samples come too: passed over)."""
    for _ in range(MAX_PER_STEP):
        msg = await control.receive_message()
        if isinstance(msg, Receipts):
            return
        if isinstance(msg, ErrorMessage):
            raise error_from_message(msg)
    raise ProtocolError(ErrorCode.BAD_REQUEST, "a probe's step brought no receipt")
