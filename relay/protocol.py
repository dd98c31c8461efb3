"""Relay messages and circuit addresses.

Two stream protocols, after libp2p's circuit relay v2: a *hop* stream goes to
the relay (a volunteer reserves a slot; a dialer asks for a circuit to a
reserved node), and a *stop* stream goes from the relay to the reserved node
(someone wants a circuit to you). After ``Connected``/``Accepted`` both
streams carry raw bytes, spliced by the relay: the end-to-end Noise handshake
and everything after it, which the relay cannot read.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from wire.codec import Message, register

HOP_PROTOCOL = "meshd/relay-hop/1"
STOP_PROTOCOL = "meshd/relay-stop/1"

# `relay-host:port/p2p-circuit/<target node id>`, as libp2p spells a relayed address.
CIRCUIT_MARK = "/p2p-circuit/"

NodeId = Annotated[str, Field(min_length=1, max_length=64)]


@register
class Reserve(Message):
    """To a relay, on a hop stream held open for as long as the reservation lasts;
    sent again on that stream to renew it."""

    type: Literal["relay_reserve"] = "relay_reserve"
    v: Literal[1] = 1


@register
class Reserved(Message):
    """The reservation holds, under these limits, until either side ends the stream
    or ``lifetime_seconds`` pass (None: no end). Another ``Reserve`` on the same
    stream renews it, answered by another ``Reserved``."""

    type: Literal["relay_reserved"] = "relay_reserved"
    v: Literal[1] = 1
    max_circuit_bytes: int = Field(ge=0)
    max_circuit_seconds: float = Field(ge=0.0)
    lifetime_seconds: float | None = Field(default=None, gt=0.0)


@register
class Connect(Message):
    """To a relay, on a fresh hop stream: a circuit to ``target``, please."""

    type: Literal["relay_connect"] = "relay_connect"
    v: Literal[1] = 1
    target: NodeId


@register
class Connected(Message):
    """The circuit is up: from now on the hop stream carries the target's bytes."""

    type: Literal["relay_connected"] = "relay_connected"
    v: Literal[1] = 1


@register
class Incoming(Message):
    """From a relay to a reserved node: ``source`` (authenticated by the relay) dials you."""

    type: Literal["relay_incoming"] = "relay_incoming"
    v: Literal[1] = 1
    source: NodeId


@register
class Accepted(Message):
    """The reserved node takes the circuit: from now on the stop stream carries the dialer's bytes."""

    type: Literal["relay_accepted"] = "relay_accepted"
    v: Literal[1] = 1


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
