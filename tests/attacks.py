"""Hostile byte strings shared by the tests that attack real links and daemons."""

from __future__ import annotations

import numpy as np

from wire.tensors import encode_activation, tensor_fields


def unfinished_activation(size: int) -> bytes:
    """A length-prefixed activation of about `size` bytes, all but its last byte.

    A well-formed head (type, version, session, a raw f32 tensor), so the decoder
    cannot refuse it at its first bytes and must hold what comes until the rest
    does, which never comes.
    """
    rows = np.zeros((1, max(1, size // 4)), dtype=np.float32)
    framed = encode_activation(session="s", epoch=0, step=0, pos=0, n_tokens=1,
                               tensors=[tensor_fields("hidden_states", rows, "f32", "raw")])
    return framed[:-1]
