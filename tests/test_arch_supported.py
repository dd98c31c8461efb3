"""The architectures the patched llama.cpp accepts a partial layer range for are exactly those a
parity test covers (tests/test_engine_arch_parity.py, test_arch_moe.py, test_arch_dense.py,
test_arch_recurrent.py, test_arch_dsv4.py, test_arch_dsa.py, test_arch_hybrid_*.py): a case added to
llm_arch_supports_layer_range without its test, or a tested architecture dropped from it, fails here."""

from __future__ import annotations

import re
from pathlib import Path

from gguf_dense import DENSE_SPECS
from gguf_dsa import DSA_SPECS
from gguf_dsv4 import ARCH as DSV4_ARCH
from gguf_factory import TINY_SPECS
from gguf_moe import MOE_SPECS
from test_arch_hybrid_a import HYBRID_A_ARCHS
from test_arch_hybrid_b import HYBRID_B_ARCHS
from test_arch_recurrent import RECURRENT_ARCHS

ROOT = Path(__file__).resolve().parent.parent


def _supported_archs() -> set[str]:
    """Architectures llm_arch_supports_layer_range accepts, read from the patched source the library
    was built from (tools/build_native.py keeps it beside the library)."""
    src = (ROOT / "build/native/llama-arch.cpp").read_text()
    names = dict(re.findall(r'\{\s*(LLM_ARCH_\w+),\s*"([^"]+)"\s*\}', src))
    body = re.search(r"bool llm_arch_supports_layer_range\(.*?\{(.*?)\n\}", src, re.S)
    assert body, "llm_arch_supports_layer_range not found in build/native/llama-arch.cpp"
    return {names[c] for c in re.findall(r"case (LLM_ARCH_\w+):", body.group(1))}


def test_supported_architectures_are_exactly_the_tested_ones() -> None:
    tested = ({s.arch for s in TINY_SPECS.values()} | {s.arch for s in DENSE_SPECS.values()}
              | {s.arch for s in MOE_SPECS.values()} | set(RECURRENT_ARCHS) | {DSV4_ARCH} | set(DSA_SPECS)
              | set(HYBRID_A_ARCHS) | set(HYBRID_B_ARCHS))
    supported = _supported_archs()
    assert supported - tested == set(), "accepted without a parity test"
    assert tested - supported == set(), "tested but refused"
