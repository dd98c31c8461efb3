"""Progress of the long waits (loading a model, joining a mesh, waiting for coverage) on a terminal.

A tqdm line on stderr that says what is awaited and for how long, redrawn by a
trio task, and cleared when the wait ends; log records meanwhile go above it. Where stderr is no terminal (a pipe,
a file, a service's journal) nothing is written at all: logs and the one-line
errors stay as they are.
"""

from __future__ import annotations

import os
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import IO, TYPE_CHECKING

import trio

if TYPE_CHECKING:
    from tqdm import tqdm

# How often the elapsed time is redrawn: often enough to look alive, rarely enough to cost nothing.
REDRAW = 0.5


class Waiting:
    """One wait's line; `say` changes what it says is awaited, `done` ends it. Without a terminal it does nothing."""

    def __init__(self, bar: tqdm | None) -> None:
        self._bar = bar
        self._redraws = trio.CancelScope()

    @property
    def shown(self) -> bool:
        return self._bar is not None

    def say(self, what: str) -> None:
        if self._bar is not None:
            # one line: a newline from a peer's reason would break the redraw
            self._bar.set_description_str(" ".join(what.split()), refresh=True)

    def done(self) -> None:
        """Clears the line now, even if the body goes on (such as a service that has started)."""
        self._redraws.cancel()
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    async def redraw_until_done(self) -> None:
        with self._redraws:
            while self._bar is not None:
                await trio.sleep(REDRAW)
                self._bar.refresh()


def on_terminal(stream: IO[str]) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # a replaced or closed stream is no terminal
        return False


@asynccontextmanager
async def waiting(what: str, stream: IO[str] | None = None) -> AsyncIterator[Waiting]:
    """A line on `stream` (stderr) while the body runs, if it is a terminal: `what`, then the time spent.

    Its redraw task lives in a nursery around the body, so a body may open a service that outlives
    the wait (`stage_node`) and end the line with `done()` once it is up, nesting correctly."""
    out = stream if stream is not None else sys.stderr
    if not on_terminal(out):
        yield Waiting(None)
        return
    # Fitted to the terminal as it is resized; tqdm draws nothing on a terminal that reports no size
    # (0 x 0, as a fresh pty or a serial console): such a one is taken as 80 x 24.
    sized = min(_size(out)) > 0
    # imported only for a terminal: tqdm's logging helper loads asyncio and the rest of tqdm (0.05 CPU-s), which
    # every daemon and `meshd ask` run by a script or a service would pay for a line it never draws
    from tqdm import tqdm
    from tqdm.contrib.logging import logging_redirect_tqdm

    handle = Waiting(tqdm(desc=" ".join(what.split()), total=None, file=out, leave=False, dynamic_ncols=sized,
                          ncols=None if sized else 80, nrows=None if sized else 24, bar_format="{desc} {elapsed}",
                          mininterval=0))
    try:
        # log records meanwhile are written above the line (tqdm clears and redraws it), not into it
        with logging_redirect_tqdm():
            async with trio.open_nursery() as nursery:
                nursery.start_soon(handle.redraw_until_done)
                yield handle
                handle.done()
    finally:
        handle.done()


def _size(stream: IO[str]) -> tuple[int, int]:
    try:
        size = os.get_terminal_size(stream.fileno())
    except (AttributeError, ValueError, OSError):
        return 0, 0
    return size.columns, size.lines


