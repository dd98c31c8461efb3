"""The bounds of one protocol's untrusted bytes (``Limits``), declared per protocol beside its messages.

Only the stage protocol, which carries activations, is large; SWIM, mesh RPC, relay and control are
small. A link checks a message's length prefix against its protocol's cap before buffering the body
(wire.codec)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Limits:
    """Hard bounds on the untrusted bytes of one protocol's messages.

    ``max_message_bytes`` is checked at the length prefix, before the body is
    buffered; ``max_objects`` and ``max_depth`` cap the header walk of any
    message, whatever its schema would allow. The per-field lengths come from
    each message's own ``Bounds`` (its schema); the protocol's limits can only
    tighten them.
    """

    max_message_bytes: int = 128 << 20
    max_objects: int = 1 << 20
    max_depth: int = 32

    def tightened(self, other: Limits) -> Limits:
        """The stricter of ``self`` and ``other`` in every bound."""
        return Limits(
            max_message_bytes=min(self.max_message_bytes, other.max_message_bytes),
            max_objects=min(self.max_objects, other.max_objects),
            max_depth=min(self.max_depth, other.max_depth),
        )


DEFAULT_LIMITS = Limits()

_PROTOCOL_LIMITS: dict[str, Limits] = {}


def register_protocol(protocol: str, limits: Limits) -> None:
    """Declare the caps of the messages carried by streams of ``protocol``."""
    if _PROTOCOL_LIMITS.get(protocol, limits) != limits:
        raise ValueError(f"protocol {protocol!r} already has other limits")
    _PROTOCOL_LIMITS[protocol] = limits


def same_protocol_other_version(protocol: str, known: Iterable[str]) -> str | None:
    """The one of ``known`` that names ``protocol`` at another version, if any.

    Protocol names are ``FAMILY/VERSION`` (``meshd/stage/2``): a version changes when a change would
    break peers that speak the old one, so a name of a known family at an unknown version is a peer
    of another meshd release, which deserves to hear so rather than a bare "no handler"."""
    family, sep, version = protocol.rpartition("/")
    if not sep or not family:
        return None
    for name in sorted(known):
        other_family, other_sep, other_version = name.rpartition("/")
        if other_sep and other_family == family and other_version != version:
            return name
    return None


def protocol_limits(protocol: str, link_limits: Limits = DEFAULT_LIMITS) -> Limits:
    """The limits for a stream of ``protocol``: its declared caps, within the link's.

    A protocol nobody declared gets the link's limits (its streams are refused
    by the peer set unless a handler exists, and every handler's protocol is
    declared next to its messages)."""
    declared = _PROTOCOL_LIMITS.get(protocol)
    return link_limits if declared is None else declared.tightened(link_limits)
