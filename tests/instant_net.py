"""A zero-latency network for driving sans-IO mesh state machines by hand, at explicit times."""

from __future__ import annotations

import hashlib
import random
from typing import Protocol

from meshd.mesh.membership import SwimMessage
from meshd.mesh.records import CapabilityRecord
from wire.identity import NodeIdentity


class Driven(Protocol):
    node_id: str

    def handle_message(self, now: float, src: str, message: SwimMessage) -> None: ...
    def handle_timer(self, now: float) -> None: ...
    def next_timer(self) -> float | None: ...
    def messages_to_send(self) -> list[tuple[str, SwimMessage]]: ...


def identity(i: int) -> NodeIdentity:
    return NodeIdentity.from_private_bytes(hashlib.sha256(b"test-node-%d" % i).digest())


def record(i: int, version: int = 1, **fields: object) -> CapabilityRecord:
    fields.setdefault("addresses", [f"10.0.0.{i}:7400"])
    return CapabilityRecord.create(identity(i), version, **fields)


def rng(i: int) -> random.Random:
    return random.Random(i)


class InstantNet:
    """Delivers every message the moment it is sent. Nodes in `down` neither send nor receive;
    `blocked` holds (src, dest) links that drop everything; `log` keeps what was delivered."""

    def __init__(self, *nodes: Driven) -> None:
        self.nodes = {node.node_id: node for node in nodes}
        self.down: set[str] = set()
        self.blocked: set[tuple[str, str]] = set()
        self.log: list[tuple[float, str, str, SwimMessage]] = []
        self.now = 0.0

    def add(self, node: Driven) -> None:
        self.nodes[node.node_id] = node

    def flush(self) -> None:
        busy = True
        while busy:
            busy = False
            for node in list(self.nodes.values()):
                for dest, message in node.messages_to_send():
                    busy = True
                    src = node.node_id
                    if (
                        src in self.down
                        or dest in self.down
                        or (src, dest) in self.blocked
                        or dest not in self.nodes
                    ):
                        continue
                    self.log.append((self.now, src, dest, message))
                    self.nodes[dest].handle_message(self.now, src, message)

    def run_until(self, end: float) -> None:
        """Fire every timer due up to `end`, in time order, delivering as it goes."""
        self.flush()
        while True:
            live = [node for node_id, node in self.nodes.items() if node_id not in self.down]
            timers = [t for t in (node.next_timer() for node in live) if t is not None]
            if not timers or min(timers) > end:
                break
            self.now = max(self.now, min(timers))
            for node in live:
                timer = node.next_timer()
                if timer is not None and timer <= self.now:
                    node.handle_timer(self.now)
            self.flush()
        self.now = end
