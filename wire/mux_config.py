"""What one side of a mux grants its peer (``MuxConfig``) and the bytes a node's links may hold in
unfinished messages together (``HeldBudget``)."""

from __future__ import annotations

from dataclasses import dataclass

from wire.mux_frames import MAX_FRAME, MAX_WINDOW, MIN_FRAME


@dataclass(frozen=True, slots=True)
class MuxConfig:
    """What this side grants its peer. Windows are in bytes."""

    stream_window: int = 4 << 20
    link_window: int = 16 << 20
    max_frame: int = 64 << 10
    max_streams: int = 256
    # Bytes held in unfinished messages that are granted again as credit.
    max_held: int = 16 << 20
    # Per timer tick (a keepalive interval): PINGs answered, PINGs tolerated,
    # and refused OPENs plus RESETs either way tolerated.
    max_pongs: int = 8
    ping_flood: int = 64
    reset_flood: int = 512

    def __post_init__(self) -> None:
        if not (1 <= self.stream_window <= MAX_WINDOW and 1 <= self.link_window <= MAX_WINDOW):
            raise ValueError("windows must be between 1 and 2**31-1 bytes")
        if not MIN_FRAME <= self.max_frame <= MAX_FRAME:
            raise ValueError(f"max_frame must be between {MIN_FRAME} and {MAX_FRAME}")
        if not 0 <= self.max_streams <= 1 << 20:
            raise ValueError("max_streams must be between 0 and 2**20")
        if self.max_held < 0 or not 0 <= self.max_pongs <= self.ping_flood or self.reset_flood < 1:
            raise ValueError("max_held, max_pongs <= ping_flood and reset_flood must be sensible")


class HeldBudget:
    """Bytes held in unfinished messages across all of a node's links."""

    __slots__ = ("held", "limit")

    def __init__(self, limit: int) -> None:
        if limit < 0:
            raise ValueError("a held-bytes budget is not negative")
        self.limit = limit
        self.held = 0
