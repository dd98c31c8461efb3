"""Shared fixtures: the default model and what the engine knows of it; Hypothesis profiles."""

from __future__ import annotations

import json
import os
import socket
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

from meshd.mesh.models import default_model_path
from meshd.net.peers import Peers, open_peers
from wire.identity import NodeIdentity

# HYPOTHESIS_PROFILE picks one (.ci/run exports "ci"):
#   ci:  the same examples on every run (derandomized, no example database), so CI
#        fails for a reason a rerun reproduces; print_blob gives the @reproduce_failure line
#   dev: Hypothesis's defaults, randomized, with the local database
#   big: a long randomized run by hand, e.g. HYPOTHESIS_PROFILE=big pytest tests/test_wire_codec.py
# Every profile caps stateful runs; a test's own @settings(max_examples=...) is its cap.
settings.register_profile("ci", derandomize=True, database=None, print_blob=True, deadline=None,
                          stateful_step_count=50, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", deadline=None, stateful_step_count=50)
settings.register_profile("big", max_examples=5000, stateful_step_count=200, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
_profile = os.environ.get("HYPOTHESIS_PROFILE", "dev")
if _profile not in ("ci", "dev", "big"):
    raise pytest.UsageError(f"HYPOTHESIS_PROFILE={_profile!r} is not one of ci, dev, big")
settings.load_profile(_profile)


@pytest.fixture
def refusing_address() -> Iterator[str]:
    """``127.0.0.1:PORT`` of a socket bound and never listening, held for the whole test: a dial there is
    refused, and no other process can take the port meanwhile (a port found free and let go, as these
    tests once picked them, may be another test's listener by the time it is dialled)."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        yield f"127.0.0.1:{held.getsockname()[1]}"


@pytest.fixture(scope="session")
def default_model() -> Path:
    return default_model_path()


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny random-weight GGUFs of each range-capable architecture, by name (see gguf_factory.TINY_SPECS)."""
    # imported here so that a suite run without the `gguf` test extra fails only the tests that need it
    from gguf_factory import TINY_SPECS, write_tiny_gguf

    root = tmp_path_factory.mktemp("tiny-gguf")
    return {name: write_tiny_gguf(root / f"{name}.gguf", spec) for name, spec in TINY_SPECS.items()}


@pytest.fixture(scope="session")
def tiny_draft_model(tmp_path_factory: pytest.TempPathFactory, default_model: Path) -> Path:
    """A tiny random-weight llama with the default model's vocabulary: a draft model for it."""
    from gguf_factory import TINY_SPECS, write_tiny_gguf

    path = tmp_path_factory.mktemp("tiny-draft") / "draft-llama.gguf"
    return write_tiny_gguf(path, TINY_SPECS["llama-gqa-tied"], vocab_of=default_model)


@pytest.fixture(scope="session")
def unsupported_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny GGUF of an architecture (gpt2) whose graph builder has no layer-range support."""
    from gguf_factory import UNSUPPORTED_SPEC, write_tiny_gguf

    return write_tiny_gguf(tmp_path_factory.mktemp("tiny-gguf-unsupported") / "gpt2.gguf", UNSUPPORTED_SPEC)


def greedy_reference(model: Path, prompts: list[str], new_tokens: int) -> dict[str, list[int]]:
    """Greedy answers of the whole model in one process: what every split pipeline must reproduce."""
    from meshd.engine.chain import LocalChain

    chain = LocalChain(model, None, n_ctx=1024, n_threads=1)
    try:
        out = {}
        for p in prompts:
            prompt = chain.head.tokenize(chain.head.apply_chat([{"role": "user", "content": p}]), add_special=False)
            out[p] = [t for t in chain.generate(prompt, new_tokens) if not chain.head.is_eog(t)]
        return out
    finally:
        chain.close()


def greedy_chat_reference(model: Path, prompts: list[str], new_tokens: int) -> dict[str, list[int]]:
    """Greedy answers of the whole model in one process to each prompt as one user message, rendered on
    the model's own chat template as the asker renders it (meshd.client.chat): what `meshd ask` and a
    chat completion of the same message must give."""
    from meshd.client.chat import ChatRequest, own_or_chatml
    from meshd.engine import chat as native_chat
    from meshd.engine.chain import LocalChain
    from wire.stage import ChatTemplate

    chain = LocalChain(model, None, n_ctx=1024, n_threads=1)
    try:
        template = own_or_chatml(ChatTemplate(**chain.head.chat_info()))
        out = {}
        for p in prompts:
            text = native_chat.render(ChatRequest(messages=[{"role": "user", "content": p}]).as_request(template))
            prompt = chain.head.tokenize(text["prompt"], add_special=True, parse_special=True)
            out[p] = [t for t in chain.generate(prompt, new_tokens) if not chain.head.is_eog(t)]
        return out
    finally:
        chain.close()


@pytest.fixture
async def peers() -> AsyncIterator[Peers]:
    """A peer identity of the test's own, for asking members over the mesh."""
    async with open_peers(NodeIdentity.generate()) as p:
        yield p


# Seconds each test file took in a whole run (setup, call and teardown of its tests), longest first: the
# suite runs the longest files first, so under xdist's whole-file scheduling (tools/dev test) no long file
# starts last while the other worker idles. A stale or missing entry only costs time, never a result.
# Refresh it with MESHD_DURATIONS_OUT=tests/durations.json tools/dev test.
DURATIONS = Path(__file__).with_name("durations.json")
_took: dict[str, float] = {}


def file_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def longest_files_first(items: list[pytest.Item]) -> None:
    seconds: dict[str, float] = json.loads(DURATIONS.read_text()) if DURATIONS.exists() else {}
    # stable: a file's tests keep their order, and files of equal (or unknown) time theirs
    items.sort(key=lambda item: -seconds.get(file_of(item.nodeid), 0.0))


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Counts each file's time (in the xdist controller too, where every worker's reports arrive)."""
    _took[file_of(report.nodeid)] = _took.get(file_of(report.nodeid), 0.0) + report.duration


def pytest_sessionfinish(session: pytest.Session) -> None:
    out = os.environ.get("MESHD_DURATIONS_OUT")
    # only where every test ran (the controller, or a run without xdist): a worker saw a part of them
    if not out or hasattr(session.config, "workerinput"):
        return
    path = Path(out)
    kept: dict[str, float] = json.loads(path.read_text()) if path.exists() else {}
    kept.update({name: round(took, 1) for name, took in _took.items()})
    path.write_text(json.dumps(dict(sorted(kept.items(), key=lambda kv: -kv[1])), indent=0) + "\n")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The longest files first (DURATIONS). `gpu` tests need a device the engine offloads to
    (tests/gpu_lane.py); the engine is asked only when such a test was collected."""
    longest_files_first(items)
    marked = [item for item in items if item.get_closest_marker("gpu")]
    if not marked:
        return
    from gpu_lane import engine_gpu

    device, why = engine_gpu()
    if device is None:
        skip = pytest.mark.skip(reason=f"no GPU: {why}")
        for item in marked:
            item.add_marker(skip)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """A test that fails while local daemons run shows their logs' tails and keeps their files."""
    outcome = yield
    report = outcome.get_result()
    # only a test that imported the harness can have started daemons
    localmesh = sys.modules.get("localmesh")
    if report.failed and call.when in ("setup", "call") and localmesh and (logs := localmesh.running_logs()):
        report.sections.append(("meshd daemon logs", logs))
