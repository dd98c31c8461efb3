"""A fake record transport for tests and simulations: an in-memory pipe between two ends."""

from __future__ import annotations

import trio


class MemoryTransport:
    """One end of an in-memory record pipe; see ``memory_transport_pair``."""

    def __init__(
        self,
        send: trio.MemorySendChannel[bytes],
        receive: trio.MemoryReceiveChannel[bytes],
        remote_address: str,
    ) -> None:
        self._send = send
        self._receive = receive
        self.remote_address = remote_address

    async def send_record(self, record: bytes) -> None:
        try:
            await self._send.send(bytes(record))
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            raise trio.BrokenResourceError("memory transport closed") from None

    async def receive_record(self) -> bytes:
        try:
            return await self._receive.receive()
        except (trio.ClosedResourceError, trio.EndOfChannel):
            raise trio.EndOfChannel from None

    async def aclose(self) -> None:
        await self._send.aclose()
        await self._receive.aclose()


def memory_transport_pair(buffer: int = 64) -> tuple[MemoryTransport, MemoryTransport]:
    """Two connected in-memory transports holding up to ``buffer`` records each way."""
    a_to_b_send, a_to_b_receive = trio.open_memory_channel[bytes](buffer)
    b_to_a_send, b_to_a_receive = trio.open_memory_channel[bytes](buffer)
    return (
        MemoryTransport(a_to_b_send, b_to_a_receive, "memory:b"),
        MemoryTransport(b_to_a_send, a_to_b_receive, "memory:a"),
    )
