"""Relay messages and circuit addresses.

Two stream protocols, after libp2p's circuit relay v2: a *hop* stream goes to
the relay (a volunteer reserves a slot; a dialer asks for a circuit to a
reserved node), and a *stop* stream goes from the relay to the reserved node
(someone wants a circuit to you). After ``Connected``/``Accepted`` both
streams carry raw bytes, spliced by the relay: the end-to-end Noise handshake
and everything after it, which the relay cannot read.
"""

from __future__ import annotations

from pydantic import Field

from wire.limits import Limits, register_protocol
from wire.message import Message
from wire.types import Count, Host, NodeId

HOP_PROTOCOL = "meshd/relay-hop/1"
STOP_PROTOCOL = "meshd/relay-stop/1"

# `relay-host:port/p2p-circuit/<target node id>`, as libp2p spells a relayed address.
CIRCUIT_MARK = "/p2p-circuit/"

# Relay messages are a few dozen bytes; once a circuit is up the streams carry raw bytes.
for _protocol in (HOP_PROTOCOL, STOP_PROTOCOL):
    register_protocol(_protocol, Limits(max_message_bytes=4 << 10, max_objects=64, max_depth=2))


class Reserve(Message, tag="relay_reserve"):
    """To a relay, on a hop stream held open for as long as the reservation lasts;
    sent again on that stream to renew it."""


class Reserved(Message, tag="relay_reserved"):
    """The reservation holds, under these limits, until either side ends the stream
    or ``lifetime_seconds`` pass (None: no end). Another ``Reserve`` on the same
    stream renews it, answered by another ``Reserved``."""

    max_circuit_bytes: Count
    max_circuit_seconds: float = Field(ge=0.0)
    lifetime_seconds: float | None = Field(default=None, gt=0.0)


class Connect(Message, tag="relay_connect"):
    """To a relay, on a fresh hop stream: a circuit to ``target``, please."""

    target: NodeId


class Connected(Message, tag="relay_connected"):
    """The circuit is up: from now on the hop stream carries the target's bytes.

    ``observed``: the host the relay sees the target's link come from (its NAT's public address),
    the only host a hole punch to the target may dial (meshd.relay.punch)."""

    observed: Host = ""


class Incoming(Message, tag="relay_incoming"):
    """From a relay to a reserved node: ``source`` (authenticated by the relay) dials you, from
    ``observed`` as the relay sees it (see ``Connected``)."""

    source: NodeId
    observed: Host = ""


class Accepted(Message, tag="relay_accepted"):
    """The reserved node takes the circuit: from now on the stop stream carries the dialer's bytes."""


def circuit_address(relay_address: str, target: str) -> str:
    return f"{relay_address}{CIRCUIT_MARK}{target}"


def is_circuit_address(address: str) -> bool:
    return CIRCUIT_MARK in address


def parse_circuit_address(address: str) -> tuple[str, str]:
    """``(relay address, target node id)``; ValueError if ``address`` is not a circuit address."""

    relay, mark, target = address.partition(CIRCUIT_MARK)
    if not mark or not relay or not target or CIRCUIT_MARK in target:
        raise ValueError(f"{address!r} is not RELAY_HOST:PORT{CIRCUIT_MARK}NODE_ID")
    return relay, target
