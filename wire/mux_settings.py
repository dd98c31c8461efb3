"""SETTINGS, a mux's first frame (wire.mux): what each side grants the other, as (key u16, value u32)
entries; an entry of an unknown key is passed over, a known one missing or out of range ends the link."""

from __future__ import annotations

from dataclasses import dataclass

from wire.errors import bad_request
from wire.mux_config import MuxConfig
from wire.mux_frames import MAX_FRAME, MAX_WINDOW, MIN_FRAME, SETTING

S_STREAM_WINDOW, S_LINK_WINDOW, S_MAX_FRAME, S_MAX_STREAMS = 1, 2, 3, 4


@dataclass(frozen=True, slots=True)
class PeerSettings:
    stream_window: int
    link_window: int
    max_frame: int
    max_streams: int


def settings_payload(config: MuxConfig) -> bytes:
    """The SETTINGS payload of what `config` grants the peer."""
    return b"".join(
        SETTING.pack(key, value)
        for key, value in (
            (S_STREAM_WINDOW, config.stream_window),
            (S_LINK_WINDOW, config.link_window),
            (S_MAX_FRAME, config.max_frame),
            (S_MAX_STREAMS, config.max_streams),
        )
    )


def read_settings(payload: bytes) -> PeerSettings:
    """What the peer's SETTINGS grant; a link error where they are not whole entries, lack one or are out of range."""
    if len(payload) % SETTING.size:
        raise bad_request("SETTINGS payload is not whole entries")
    values = {
        S_STREAM_WINDOW: 0,
        S_LINK_WINDOW: 0,
        S_MAX_FRAME: 0,
        S_MAX_STREAMS: -1,
    }
    for offset in range(0, len(payload), SETTING.size):
        key, value = SETTING.unpack_from(payload, offset)
        if key in values:
            values[key] = value
    if not (
        1 <= values[S_STREAM_WINDOW] <= MAX_WINDOW
        and 1 <= values[S_LINK_WINDOW] <= MAX_WINDOW
        and MIN_FRAME <= values[S_MAX_FRAME] <= MAX_FRAME
        and values[S_MAX_STREAMS] >= 0
    ):
        raise bad_request("SETTINGS missing or out of range")
    return PeerSettings(
        stream_window=values[S_STREAM_WINDOW],
        link_window=values[S_LINK_WINDOW],
        max_frame=values[S_MAX_FRAME],
        max_streams=values[S_MAX_STREAMS],
    )
