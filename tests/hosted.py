"""In-process stage nodes a module's tests share: held open on a trio loop of their own, in a thread; and
several nodes opened and closed at once.

A test's own trio loop lasts that test, so nodes opened in one cannot outlive it; nodes opened here
do, and several tests (the fast and the daemons' case of one claim, say) ask the same ring instead of
each starting its engine workers again. The nodes are real ones on loopback: a test asks them from
its own loop over the network, and what it reads or calls of their insides (books, engine calls) runs
on the host loop, through ``Hosted.run``.
"""

from __future__ import annotations

import math
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager, contextmanager
from typing import Any, Generic, TypeVar

import trio

T = TypeVar("T")
R = TypeVar("R")

# how long the nodes may take to open or to close (a bound against hangs, not a speed claim)
HOST_DEADLINE = 180.0


class Hosted(Generic[T]):
    """What the host loop holds open (``value``), and a way onto that loop."""

    def __init__(self, value: T, token: trio.lowlevel.TrioToken) -> None:
        self.value = value
        self._token = token

    async def run(self, fn: Callable[..., Awaitable[R]], *args: Any) -> R:
        """``await fn(*args)`` on the host loop, from a test's loop; what it raises is raised here."""
        return await trio.to_thread.run_sync(lambda: trio.from_thread.run(fn, *args, trio_token=self._token))


class Here(Hosted[T]):
    """Nodes a test opened on its own loop, asked as hosted ones are."""

    def __init__(self, value: T) -> None:
        self.value = value

    async def run(self, fn: Callable[..., Awaitable[R]], *args: Any) -> R:
        return await fn(*args)


@contextmanager
def hosted(opened: Callable[[], AbstractAsyncContextManager[T]]) -> Iterator[Hosted[T]]:
    """``opened()`` entered on a new loop in a thread, held until this context ends."""
    ready = threading.Event()
    box: dict[str, Any] = {}

    async def host() -> None:
        stop = trio.Event()
        box["stop"] = stop
        # one scope around the opening and the closing (a nursery the nodes open must sit inside it), with
        # no deadline while they are held
        with trio.CancelScope(deadline=trio.current_time() + HOST_DEADLINE) as bound:
            async with opened() as value:
                bound.deadline = math.inf
                box["hosted"] = Hosted(value, trio.lowlevel.current_trio_token())
                ready.set()
                await stop.wait()
                bound.deadline = trio.current_time() + HOST_DEADLINE
        if bound.cancelled_caught:
            raise TimeoutError(f"the hosted nodes took over {HOST_DEADLINE:g} s to open or close")

    def main() -> None:
        try:
            trio.run(host)
        except BaseException as exc:  # handed to the test that waits on it
            box["error"] = exc
        finally:
            ready.set()

    thread = threading.Thread(target=main, name="hosted-nodes", daemon=True)
    thread.start()
    ready.wait()
    if "hosted" not in box:
        thread.join()
        raise RuntimeError("the hosted nodes did not open") from box.get("error")
    try:
        yield box["hosted"]
    finally:
        box["hosted"]._token.run_sync_soon(box["stop"].set)
        thread.join(HOST_DEADLINE)
        if "error" in box:
            raise RuntimeError("the hosted nodes did not close cleanly") from box["error"]


@asynccontextmanager
async def together(managers: Sequence[AbstractAsyncContextManager[T]]) -> AsyncIterator[list[T]]:
    """Every one of ``managers`` entered at once (each in a task of its own), and left at once: a ring's
    stages start their engine workers side by side, and drain their links side by side."""
    values: dict[int, T] = {}
    all_open, leave = trio.Event(), trio.Event()

    async def hold(i: int, manager: AbstractAsyncContextManager[T]) -> None:
        async with manager as value:
            values[i] = value
            if len(values) == len(managers):
                all_open.set()
            await leave.wait()

    async with trio.open_nursery() as nursery:
        for i, manager in enumerate(managers):
            nursery.start_soon(hold, i, manager)
        await all_open.wait()
        try:
            yield [values[i] for i in range(len(managers))]
        finally:
            leave.set()
