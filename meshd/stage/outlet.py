"""Where a session's outgoing messages go, in order, without a task switch when they can.

A decode step's output (rows for the next stage, the ring's token for the
head, the sampled token for the asker) is sent from the scheduler, straight
from the engine's reply: onto its stream with ``Stream.send_nowait`` (which
encrypts and writes at once when the link is idle). Whatever cannot go that
way (the stream not attached yet, another task sending on it, the peer's
credit short, the stream broken) goes to the outlet's task, which awaits the
stream; while it holds any, later items follow it there, so the order on the
stream is the order of ``send_nowait`` calls. The task is also how a broken
stream is noticed: its send raises.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Generic, TypeVar

import trio

from meshd.net.stream import Stream

T = TypeVar("T")


class Outlet(Generic[T]):
    def __init__(self, encode: Callable[[T], bytes]) -> None:
        self._encode = encode
        self._send, self.receive = trio.open_memory_channel[T](math.inf)
        # set by the task once what must go first has gone (a hop stream's Hop)
        self.stream: Stream | None = None
        # items given to the task and not yet written by it
        self._handed = 0

    def send_nowait(self, item: T) -> None:
        stream = self.stream
        if self._handed == 0 and stream is not None and stream.send_nowait(self._encode(item)):
            return
        self._handed += 1
        self._send.send_nowait(item)

    async def run(self, stream: Stream) -> None:
        """Writes what was handed to the task, on ``stream``, then lets ``send_nowait`` write on it
        directly; raises what the stream raises."""
        self.stream = stream
        try:
            async for item in self.receive:
                try:
                    await stream.send_all(self._encode(item))
                finally:
                    self._handed -= 1
        finally:
            self.stream = None
