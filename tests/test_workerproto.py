"""Framing between the daemon and its engine worker: partial writes lose and repeat nothing."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from meshd.engine.workerproto import drop_sent, frame_parts


@settings(max_examples=200, deadline=None)
@given(head=st.binary(min_size=1, max_size=40), payload=st.binary(max_size=80),
       writes=st.lists(st.integers(min_value=0, max_value=50), max_size=20))
def test_partial_writes_leave_exactly_the_unsent_rest(head: bytes, payload: bytes, writes: list[int]) -> None:
    parts = frame_parts(head, payload)
    frame = head + payload
    sent_so_far = 0
    for size in writes:
        size = min(size, len(frame) - sent_so_far)
        drop_sent(parts, size)
        sent_so_far += size
        assert b"".join(bytes(p) for p in parts) == frame[sent_so_far:]
        assert all(len(p) for p in parts)
