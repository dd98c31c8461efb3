"""Typed protocol errors shared by every layer and every peer."""

from __future__ import annotations

import enum


class ErrorCode(str, enum.Enum):
    EPOCH_STALE = "EPOCH_STALE"
    CACHE_MISS = "CACHE_MISS"
    OVERLOADED = "OVERLOADED"
    DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"
    PAYLOAD_CORRUPT = "PAYLOAD_CORRUPT"
    MODEL_MISMATCH = "MODEL_MISMATCH"
    NOT_FOUND = "NOT_FOUND"
    UNAUTHORIZED = "UNAUTHORIZED"
    BAD_REQUEST = "BAD_REQUEST"
    INTERNAL = "INTERNAL"
    # The peer could not be reached, or the link to it was lost or shut down.
    UNREACHABLE = "UNREACHABLE"
    # The other end abandoned the exchange (closed its stream before finishing).
    CANCELLED = "CANCELLED"
    # The peer speaks another version of the stream's protocol: it runs another meshd release.
    VERSION_MISMATCH = "VERSION_MISMATCH"

    @property
    def retryable(self) -> bool:
        """Whether sending the same request again (possibly elsewhere or later) can help."""
        return self in _RETRYABLE


_RETRYABLE = frozenset(
    {
        ErrorCode.CACHE_MISS,
        ErrorCode.OVERLOADED,
        ErrorCode.DEADLINE_EXCEEDED,
        ErrorCode.PAYLOAD_CORRUPT,
        ErrorCode.INTERNAL,
        ErrorCode.UNREACHABLE,
    }
)


class ProtocolError(Exception):
    """A typed error that can cross the wire: a code, a message, an optional retry hint."""

    def __init__(self, code: ErrorCode, message: str, retry_after_ms: int | None = None) -> None:
        super().__init__(f"{code.value}: {message}")
        self.code = code
        self.message = message
        self.retry_after_ms = retry_after_ms

    @property
    def retryable(self) -> bool:
        return self.code.retryable


def bad_request(message: str) -> ProtocolError:
    """The error of a message that breaks the protocol's rules (its peer's fault, not a retryable one)."""
    return ProtocolError(ErrorCode.BAD_REQUEST, message)
