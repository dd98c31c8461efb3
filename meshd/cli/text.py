"""Numbers as the command line writes them."""

from __future__ import annotations


def plural(n: int, word: str) -> str:
    return f"{n} {word if n == 1 else word + 's'}"


def mib(n: int) -> str:
    return f"{n / (1 << 20):.0f} MiB"
