"""``MeshDriver``: the sans-IO ``MeshDuty`` run in trio."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

import trio

from meshd.mesh.duty import MeshDuty
from meshd.mesh.duty_events import DutyEvent
from meshd.mesh.membership import SwimMessage

log = logging.getLogger(__name__)


class MeshDriver:
    """Runs a `MeshDuty` in trio: feeds it what arrives and the time, sleeps until its next timer,
    and hands on what it sends and asks.

    Transport-agnostic: `send(dest, message)` and `on_event(event)` must not block (start a task,
    or queue); received messages come in through `deliver`. After calling a duty method from
    another task, `poke` the loop so it sends what that queued and looks at the timers again.
    """

    def __init__(self, duty: MeshDuty, send: Callable[[str, SwimMessage], None],
                 on_event: Callable[[DutyEvent], None], inbox: float = 256) -> None:
        self.duty = duty
        self._send = send
        self._on_event = on_event
        self._inbox, self._pending = trio.open_memory_channel[tuple[str, SwimMessage] | None](inbox)
        self._announced = trio.Event()

    def deliver(self, src: str, message: SwimMessage) -> None:
        try:
            self._inbox.send_nowait((src, message))
        except trio.WouldBlock:
            log.debug("SWIM inbox full: dropped a %s from %s", message.type, src[:12])

    def poke(self) -> None:
        try:
            self._inbox.send_nowait(None)
        except trio.WouldBlock:
            pass  # a full inbox wakes the loop anyway

    def flush(self) -> None:
        """Sends what the duty queued and hands on its events."""
        for dest, message in self.duty.messages_to_send():
            self._send(dest, message)
        for event in self.duty.events():
            self._on_event(event)
        if self.duty.left_announced:
            self._announced.set()

    async def run(self) -> None:
        duty = self.duty
        while True:
            deadline = duty.next_timer()
            with trio.move_on_at(math.inf if deadline is None else deadline):
                item = await self._pending.receive()
                # everything already waiting is taken in this pass: one send-out per wakeup
                now = trio.current_time()
                while True:
                    if item is not None:
                        duty.handle_message(now, *item)
                    try:
                        item = self._pending.receive_nowait()
                    except trio.WouldBlock:
                        break
            now = trio.current_time()
            deadline = duty.next_timer()
            if deadline is not None and now >= deadline:
                duty.handle_timer(now)
            self.flush()

    async def leave(self) -> None:
        """Says goodbye and returns once the news is out (`left_announced`); `run` must be running.
        Bound it with a deadline: with every peer gone, nobody takes the news."""
        self.duty.leave(trio.current_time())
        self.flush()
        self.poke()
        await self._announced.wait()
