"""The word masker gives exactly wsproto's masked bytes, chunk by chunk."""

from __future__ import annotations

import wsproto.frame_protocol as frame_protocol
from hypothesis import given, settings
from hypothesis import strategies as st

from meshd.net import wsmask
from meshd.net.wsmask import WordMasker, stock_masking


@settings(max_examples=300, deadline=None)
@given(
    key=st.binary(min_size=4, max_size=4),
    data=st.binary(max_size=300),
    cuts=st.lists(st.integers(min_value=0, max_value=300), max_size=6),
)
def test_word_masker_matches_wsproto_across_chunks(key: bytes, data: bytes, cuts: list[int]) -> None:
    bounds = sorted({0, len(data), *(c for c in cuts if c <= len(data))})
    chunks = [data[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    stock = wsmask._STOCK(bytearray(key))
    ours = WordMasker(key)
    for chunk in chunks:
        assert ours.process(chunk) == stock.process(bytearray(chunk))


def test_masking_twice_restores_the_payload() -> None:
    data = bytes(range(256)) * 130 + b"xyz"
    assert WordMasker(b"\x01\x02\x03\x04").process(WordMasker(b"\x01\x02\x03\x04").process(data)) == data


def test_links_use_the_word_masker_and_stock_masking_restores_wsproto_for_a_block() -> None:
    import meshd.net.transport  # noqa: F401  (installs the masker)

    assert frame_protocol.XorMaskerSimple is WordMasker
    with stock_masking():
        assert frame_protocol.XorMaskerSimple is wsmask._STOCK
    assert frame_protocol.XorMaskerSimple is WordMasker


def test_binary_frame_is_one_whole_binary_message_to_wsproto_at_every_length_form() -> None:
    from wsproto import ConnectionType
    from wsproto.connection import Connection, ConnectionState
    from wsproto.events import BytesMessage

    for size in (0, 1, 125, 126, 65535, 65536, 70000):
        payload = bytes(range(256)) * (size // 256) + bytes(size % 256)
        for masked in (True, False):
            # a server reads what a client writes (masked), and the other way round
            reader = Connection(ConnectionType.SERVER if masked else ConnectionType.CLIENT)
            assert reader.state is ConnectionState.OPEN
            reader.receive_data(wsmask.binary_frame(payload, masked))
            events = list(reader.events())
            assert all(isinstance(e, BytesMessage) for e in events)
            assert b"".join(bytes(e.data) for e in events) == payload and events[-1].message_finished
