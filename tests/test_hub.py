"""Hugging Face as a source (issue 29, part 2): ``hf:`` specs resolved through ``huggingface_hub`` against a
fake hub (tests/fake_hub.py: a real HTTP server on loopback speaking the hub's API and resolve paths, with
Range and per-token byte counters) named by ``HF_ENDPOINT``.

A hub model has the id its files have locally; ``meshd pull hf:...`` takes it whole or by range, every
byte checked; a lying mirror, a stale mirror and a lying member's manifest are caught, and a user's
mistakes are one line. A mesh of three volunteers joined with ``--model hf:org/repo`` (real daemons)
answers like the whole model, the later two having read from the hub just their own tensors and the
headers (the server's counters say which bytes each token read).
"""

from __future__ import annotations

import dataclasses
import shutil
import subprocess
import threading
import tracemalloc
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest
import trio
from fake_hub import FakeHub
from gguf_factory import TINY_SPECS, split_gguf, write_tiny_gguf
from localmesh import Served, mesh_status, start_join, start_serve, stop_all
from test_fetch_mesh import finder, served
from test_split_sets import ask_route

from meshd.cli.main import main
from meshd.client.ask import AskRequest
from meshd.client.failover import ask_with_failover
from meshd.fetch.fetcher import FetchFailed
from meshd.fetch.hub import HubError, HubReader, HubSpec, HubSpecError, parse_spec, resolve
from meshd.fetch.hub_chunks import fetch_from_hub
from meshd.fetch.hub_hash import check_binding, hash_model
from meshd.net.peers import Peers
from meshd.store.manifest import TensorEntry, manifest_for
from meshd.store.ranges import range_chunks
from meshd.store.sparse import SparseFile
from tests.conftest import greedy_reference

REPO = "org/tiny"
SET = "tiny-Q4_K_M"


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The hub repo's files: a single tiny model, the same as a 3-part set, and a projector to pass over."""
    base = tmp_path_factory.mktemp("hub-files")
    single = write_tiny_gguf(base / "tiny-Q8_0.gguf", TINY_SPECS["llama-gqa-untied"])
    parts = split_gguf(single, base / f"{SET}.gguf", 3)
    return {single.name: single, **{p.name: p for p in parts}, "mmproj-tiny-f16.gguf": single,
            "README.md": single}


@pytest.fixture
def hub(files: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeHub]:
    with FakeHub() as server:
        server.publish(REPO, files)
        monkeypatch.setenv("HF_ENDPOINT", server.endpoint)
        monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
        yield server


def meshd(capsys: pytest.CaptureFixture[str], *args: str) -> subprocess.CompletedProcess[str]:
    """`meshd ARGS` in this process (the CLI's own main), as a finished process: a process each took some
    4 s of the suite for the same lines."""
    capsys.readouterr()
    try:
        code = main(list(args))
    except SystemExit as exc:  # argparse's own exit
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(list(args), code, out, err)


def test_specs_name_a_repo_a_quant_a_file_and_a_revision() -> None:
    assert parse_spec("hf:org/repo") == HubSpec("org/repo")
    assert parse_spec("hf:org/repo:Q4_K_M") == HubSpec("org/repo", quant="Q4_K_M")
    assert parse_spec("hf:org/repo:Q4_K_M@v1.0") == HubSpec("org/repo", quant="Q4_K_M", revision="v1.0")
    assert parse_spec("hf:org/repo@main:Q8_0") == HubSpec("org/repo", quant="Q8_0", revision="main")
    assert parse_spec("hf:org/repo/sub/x-00002-of-00003.gguf@abc") == HubSpec(
        "org/repo", file="sub/x-00002-of-00003.gguf", revision="abc")
    for bad in ("org/repo", "hf:", "hf:org", "hf:org/repo/x.bin", "hf:org/repo/../x.gguf", "hf:org/repo:Q4 K",
                "hf:org/repo/x.gguf:Q4_K_M", "hf:org/repo@", "hf:org/repo@a..b", "hf:-org/repo"):
        with pytest.raises(HubSpecError):
            parse_spec(bad)


def test_a_hub_model_is_the_model_its_files_are_here_single_or_split(hub: FakeHub, files: dict[str, Path]) -> None:
    single = resolve(parse_spec(f"hf:{REPO}:Q8_0"))
    assert [f.path for f in single.files] == ["tiny-Q8_0.gguf"] and len(single.commit) == 40
    # no quant: llama-server's default among several; any part names its set, resolved as the set
    for spec in (f"hf:{REPO}", f"hf:{REPO}:q4_k_m", f"hf:{REPO}/{SET}-00002-of-00003.gguf@main",
                 f"hf:{REPO}@{single.commit}:Q4_K_M"):
        model = resolve(parse_spec(spec))
        assert [f.path for f in model.files] == [f"{SET}-0000{i}-of-00003.gguf" for i in (1, 2, 3)], spec
        assert model.name == f"{SET}.gguf"
    reader = HubReader(single)
    assert hash_model(reader, 4096) == manifest_for(files["tiny-Q8_0.gguf"], chunk_size=4096)
    # every byte once, and the header twice (read to be parsed, then hashed in the pass)
    assert files["tiny-Q8_0.gguf"].stat().st_size < reader.read_bytes < 1.1 * files["tiny-Q8_0.gguf"].stat().st_size
    split = hash_model(HubReader(resolve(parse_spec(f"hf:{REPO}"))))
    assert split.model_id == manifest_for(files[f"{SET}-00001-of-00003.gguf"]).model_id


@pytest.mark.parametrize("spec, says", [
    ("hf:org/none", "no repository org/none at http://127.0.0.1:"),
    (f"hf:{REPO}@v9", f"{REPO} has no revision 'v9'"),
    (f"hf:{REPO}:Q2_K", "no Q2_K file in org/tiny@"),
    (f"hf:{REPO}/other.gguf", "no file other.gguf in org/tiny@"),
    ("hf:org", "'org' is not a repository (ORG/REPO)"),
])
def test_a_users_mistake_is_one_line_and_a_failure(hub: FakeHub, spec: str, says: str,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    done = meshd(capsys, "pull", spec, "--state-dir", "/nonexistent/never-written")
    assert done.returncode != 0 and "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and says in done.stderr, done.stderr


def test_a_hub_set_with_a_part_missing_or_not_of_it_is_one_line_naming_the_part(
        hub: FakeHub, files: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    second, third = f"{SET}-00002-of-00003.gguf", f"{SET}-00003-of-00003.gguf"
    missing = hub.publish("org/missing", {p: f for p, f in files.items() if p != second})
    # the third part of another model's set (56 tensors: tied head) in place of this one's
    other = split_gguf(write_tiny_gguf(tmp_path / "other.gguf", TINY_SPECS["llama-gqa-tied"]),
                       tmp_path / "other-set.gguf", 3)
    foreign = hub.publish("org/foreign", {**files, third: other[2]})
    for spec, says in [
            ("hf:org/missing", f"part 2 of 3 of {SET} is not in org/missing@{missing[:12]}: {second}"),
            ("hf:org/foreign", f"org/foreign@{foreign[:12]}: {third} is not part 3 of this 3-part set of 57 tensors "
                               "(its header says part 3 of 3, 56 tensors)")]:
        for layers in ([], ["--layers", "0:2"]):
            done = meshd(capsys, "pull", spec, *layers, "--state-dir", str(tmp_path / "state"))
            assert done.returncode == 1 and "Traceback" not in done.stderr
            assert done.stderr.strip().splitlines() == [f"meshd pull: {says}"], done.stderr
    # nothing of either is left to be taken for the model
    assert not list((tmp_path / "state" / "models").glob(f"{SET}*"))


def test_layers_the_hub_model_lacks_are_one_line_before_its_files_are_read(
        hub: FakeHub, files: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    done = meshd(capsys, "pull", f"hf:{REPO}", "--layers", "4:9", "--state-dir", str(tmp_path))
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [
        "meshd pull: --layers: layers 4:9 are not a range of a 6-layer model"], done.stderr
    # the first part's header (read in growing prefixes from 64 KiB: at most twice it), not the set
    header = manifest_for(files[f"{SET}-00001-of-00003.gguf"]).header_size
    assert hub.bytes_read() <= max(64 << 10, 2 * header) < sum(f.stat().st_size for f in files.values())


def test_no_network_is_one_line(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                capsys: pytest.CaptureFixture[str]) -> None:
    # port 9 on loopback: nothing listens (the discard service is not run here)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    done = meshd(capsys, "pull", f"hf:{REPO}", "--state-dir", str(tmp_path))
    assert done.returncode == 1 and done.stderr.strip() == (
        "meshd pull: cannot reach the hub at http://127.0.0.1:9: ConnectError: [Errno 111] Connection refused")


def test_a_private_repo_takes_its_token(hub: FakeHub, files: dict[str, Path], tmp_path: Path,
                                        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    hub.private[REPO] = "hf_secret"
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))  # no token saved by a login either
    done = meshd(capsys, "pull", f"hf:{REPO}:Q8_0", "--state-dir", str(tmp_path))
    assert done.returncode == 1 and done.stderr.strip() == (
        f"meshd pull: no repository {REPO} at {hub.endpoint} (or it is private: give a token, HF_TOKEN)")
    # the library's token, from HF_TOKEN: every request carries it
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    done = meshd(capsys, "pull", f"hf:{REPO}:Q8_0", "--state-dir", str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "models" / "tiny-Q8_0.gguf").read_bytes() == files["tiny-Q8_0.gguf"].read_bytes()
    assert hub.bytes_read("hf_secret") >= files["tiny-Q8_0.gguf"].stat().st_size


def test_pull_takes_a_hub_model_whole_or_by_range_every_byte_checked(hub: FakeHub, files: dict[str, Path],
                                                                      tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    done = meshd(capsys, "pull", f"hf:{REPO}:Q8_0", "--state-dir", str(tmp_path))
    assert done.returncode == 0, done.stderr
    pulled = tmp_path / "models" / "tiny-Q8_0.gguf"
    assert pulled.read_bytes() == files["tiny-Q8_0.gguf"].read_bytes()
    assert "every file checked against its sha256" in done.stdout
    # a range of the set: its manifest built once (the whole files read), then just the range's chunks
    manifest = manifest_for(files[f"{SET}-00001-of-00003.gguf"])
    done = meshd(capsys, "pull", f"hf:{REPO}", "--layers", "2:4", "--state-dir", str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert manifest.model_id[:16] in done.stdout
    sparse = SparseFile.resume(tmp_path / "models" / f"{manifest.model_id}.gguf", manifest.model_id)
    wanted = {c.index for c in range_chunks(manifest, 6, 2, 4)} | {c.index for c in manifest.header_chunks_list()}
    assert {c.index for c in manifest.chunks if sparse.has(c.index)} == wanted
    sparse.close()
    # another range: the manifest is this node's already; only the new range's tensors are read
    before = hub.bytes_read()
    done = meshd(capsys, "pull", f"hf:{REPO}", "--layers", "4:6", "--state-dir", str(tmp_path))
    assert done.returncode == 0, done.stderr
    owned = manifest.bytes_of(c for c in range_chunks(manifest, 6, 4, 6) if c.tensor is not None)
    headers = sum(p.header_size for p in manifest.parts)
    # the range, and the headers read again to check the server still serves the pinned commit's
    assert owned <= hub.bytes_read() - before <= owned + 2 * headers
    # the same range again: resumed from the sparse file's journal, nothing of it read twice
    before = hub.bytes_read()
    done = meshd(capsys, "pull", f"hf:{REPO}", "--layers", "4:6", "--state-dir", str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert "0 MiB fetched from the hub" in done.stdout and hub.bytes_read() - before <= 2 * headers


def test_a_lying_mirror_is_caught_with_one_line(hub: FakeHub, files: dict[str, Path], tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    hub.lie = ("tiny-Q8_0.gguf", files["tiny-Q8_0.gguf"].stat().st_size - 10)
    done = meshd(capsys, "pull", f"hf:{REPO}:Q8_0", "--state-dir", str(tmp_path))
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines() == [
        f"meshd pull: the bytes {hub.endpoint} serves as tiny-Q8_0.gguf do not hash to the sha256 "
        f"{_sha(hub, 'tiny-Q8_0.gguf')[:12]} that commit {hub.repos[REPO].refs['main'][:12]} pins (a lying mirror)"]
    # nothing half-written is left to be taken for the model
    assert not list((tmp_path / "models").glob("tiny-Q8_0.gguf*"))


def _sha(hub: FakeHub, path: str) -> str:
    repo = hub.repos[REPO]
    return repo.commits[repo.refs["main"]].files[path][1]


def test_a_stale_mirror_is_caught_with_one_line(hub: FakeHub, files: dict[str, Path], tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    old = hub.repos[REPO].refs["main"]
    # a new revision: the single file changed by one byte of a tensor
    data = bytearray(files["tiny-Q8_0.gguf"].read_bytes())
    data[-5] ^= 1
    (tmp_path / "new.gguf").write_bytes(bytes(data))
    new = hub.publish(REPO, {**files, "tiny-Q8_0.gguf": tmp_path / "new.gguf"})
    # the mirror still serves the old commit for every revision asked of it
    hub.stale_commit = old
    done = meshd(capsys, "pull", f"hf:{REPO}@{new}:Q8_0", "--state-dir", str(tmp_path))
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert done.stderr.strip() == (f"meshd pull: {hub.endpoint} serves {REPO} at commit {old[:12]}, not the "
                                   f"{new[:12]} named (a stale or wrong mirror)")
    # pinned at resolution by a fresh server, then read from the stale one: the file's own headers say so
    hub.stale_commit = None
    model = resolve(parse_spec(f"hf:{REPO}:Q8_0"))
    assert model.commit == new
    hub.stale_commit = old
    with pytest.raises(HubError, match=f"serves tiny-Q8_0.gguf of commit {old[:12]}, not the pinned {new[:12]} "
                                       r"\(a stale mirror\)"):
        HubReader(model).check()


async def test_a_members_manifest_that_lies_about_a_tensor_gets_no_wrong_byte_in(hub: FakeHub, tmp_path: Path,
                                                                                   files: dict[str, Path]) -> None:
    model = resolve(parse_spec(f"hf:{REPO}:Q8_0"))
    reader = HubReader(model)
    honest = manifest_for(files["tiny-Q8_0.gguf"])
    check_binding(reader, honest)
    # a member's manifest naming other bytes for one tensor: sizes and header are the hub's, so it binds,
    # but the hub's bytes of that tensor do not match it and are not taken
    victim = honest.tensors[-1]
    forged = dataclasses.replace(honest, tensors=(*honest.tensors[:-1], TensorEntry(
        victim.name, victim.offset, victim.size, bytes(32), tuple(bytes(32) for _ in victim.chunk_hashes))))
    check_binding(reader, forged)
    sparse = SparseFile.open(tmp_path / "forged.gguf", forged)
    with pytest.raises(FetchFailed, match="do not match the manifest"):
        await fetch_from_hub(reader, sparse, list(forged.chunks))
    assert not any(sparse.has(c.index) for c in forged.chunks_of([victim.name]))
    sparse.close()
    # what was written of it as it came is freed, not left for anything to read
    with open(tmp_path / "forged.gguf", "rb") as f:
        f.seek(victim.offset)
        assert not f.read(victim.size).strip(b"\0")
    # a manifest of another file (its header differs) does not bind at all
    other = manifest_for(files[f"{SET}-00001-of-00003.gguf"])
    with pytest.raises(HubError, match="parts where org/tiny@"):
        check_binding(reader, other)
    with pytest.raises(HubError, match="is not the one the manifest names"):
        check_binding(reader, dataclasses.replace(honest, header_sha256=bytes(32)))


async def test_a_stalling_hub_fails_the_fetch_at_the_chunks_deadline(hub: FakeHub, tmp_path: Path,
                                                                     files: dict[str, Path]) -> None:
    model = resolve(parse_spec(f"hf:{REPO}:Q8_0"))
    manifest = manifest_for(files["tiny-Q8_0.gguf"])
    sparse = SparseFile.open(tmp_path / "stalled.gguf", manifest)
    # headers sent, body held back: a read's own timeout would wait it out; the chunk's deadline does not
    hub.stall = 30.0
    with trio.fail_after(10), pytest.raises(FetchFailed, match="did not deliver .* of tiny-Q8_0.gguf within 1 s"):
        await fetch_from_hub(HubReader(model), sparse, manifest.header_chunks_list(), first_byte=0.5, min_rate=1e9)
    assert not sparse.has(0)
    sparse.close()


async def test_a_read_given_up_on_writes_nothing_once_its_fetch_has_returned(hub: FakeHub, tmp_path: Path,
                                                                            files: dict[str, Path]) -> None:
    model = resolve(parse_spec(f"hf:{REPO}:Q8_0"))
    manifest = manifest_for(files["tiny-Q8_0.gguf"])
    path = tmp_path / "late.gguf"
    sparse = SparseFile.open(path, manifest)
    # the body comes after the chunk's deadline: its thread, given up on, reads it whole a moment later
    hub.stall = 1.0
    with pytest.raises(FetchFailed, match="did not deliver"):
        await fetch_from_hub(HubReader(model), sparse, list(manifest.chunks), first_byte=0.2, min_rate=1e9)
    # once a fetch returns its caller may close the file, and the descriptor be another file's: the thread
    # writes nothing from then on. Waited for, not slept on: the hub has sent the body and the thread has left
    # store_next (trio names a thread for the function it runs), so it has tried to write what it read
    with trio.fail_after(60):
        while not hub.bytes_read() or any(t.name.startswith("store_next") for t in threading.enumerate()):
            await trio.sleep(0.05)
    sparse.close()
    assert not path.read_bytes().strip(b"\0")


async def test_a_fetch_reads_a_run_of_chunks_in_one_request_and_a_mirror_sending_more_is_cut_off(
        hub: FakeHub, tmp_path: Path, files: dict[str, Path]) -> None:
    model = resolve(parse_spec(f"hf:{REPO}:Q8_0"))
    manifest = manifest_for(files["tiny-Q8_0.gguf"], chunk_size=4 << 10)
    sparse = SparseFile.open(tmp_path / "runs.gguf", manifest)
    await fetch_from_hub(HubReader(model), sparse, list(manifest.chunks))
    # chunks one after another (tensors 32 bytes apart at most) are one request, not one each
    reads = hub.ranges("")
    assert len(manifest.chunks) > 100 and len(reads) == 1, (len(manifest.chunks), reads[:4])
    sparse.close()
    assert (tmp_path / "runs.gguf").read_bytes() == files["tiny-Q8_0.gguf"].read_bytes()
    # a chunk held already between two it lacks is not read again: two runs
    sparse = SparseFile.open(tmp_path / "held.gguf", manifest)
    held = manifest.chunks[len(manifest.chunks) // 2]
    data = files["tiny-Q8_0.gguf"].read_bytes()
    sparse.write(held, data[held.offset:held.offset + held.size])
    await fetch_from_hub(HubReader(model), sparse, list(manifest.chunks))
    sparse.close()
    reads = hub.ranges("")[1:]
    span = ("tiny-Q8_0.gguf", held.offset, held.offset + held.size)
    assert len(reads) == 2 and outside([span], reads) == [span], reads
    assert (tmp_path / "held.gguf").read_bytes() == data
    # a mirror sending 256 MiB past each range: the run's last chunk is refused with one line, and what is
    # held meanwhile is the workers' buffers, not the body
    hub.oversize = 256 << 20
    sparse = SparseFile.open(tmp_path / "more.gguf", manifest)
    tracemalloc.start()
    try:
        with pytest.raises(FetchFailed, match=r"answered bytes 0-\d+ of tiny-Q8_0.gguf with more bytes"):
            await fetch_from_hub(HubReader(model), sparse, list(manifest.chunks))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20, peak
    assert not sparse.has(manifest.chunks[-1].index)
    sparse.close()


async def test_a_hub_fetch_journals_what_it_verified_as_it_goes(hub: FakeHub, tmp_path: Path,
                                                              files: dict[str, Path]) -> None:
    model = resolve(parse_spec(f"hf:{REPO}:Q8_0"))
    manifest = manifest_for(files["tiny-Q8_0.gguf"], chunk_size=4 << 10)
    data = files["tiny-Q8_0.gguf"].read_bytes()
    path = tmp_path / "going.gguf"
    sparse = SparseFile.open(path, manifest)
    # a chunk held between two runs: the fetch (one request at a time) reads the first run, then asks for the
    # second, whose body the hub holds back: the fetch is still going while the test looks
    held = manifest.chunks[len(manifest.chunks) // 2]
    sparse.write(held, data[held.offset:held.offset + held.size])
    first = manifest.chunks[:held.index]

    def progress(_: object) -> None:
        hub.stall = 60.0

    returned = False

    async def fetch() -> None:
        nonlocal returned
        await fetch_from_hub(HubReader(model), sparse, list(manifest.chunks), progress=progress, concurrency=1,
                             flush_interval=0.05)
        returned = True

    async with trio.open_nursery() as nursery:
        nursery.start_soon(fetch)
        # what a crash now would leave (the files and journal copied while the fetch waits on the second run):
        # every chunk of the first run, journalled
        crash = tmp_path / "crash"
        with trio.fail_after(30):
            while True:
                await trio.sleep(0.05)
                shutil.rmtree(crash, ignore_errors=True)
                crash.mkdir()
                for f in tmp_path.glob("going.gguf*"):
                    shutil.copy(f, crash / f.name)
                copy = SparseFile.open(crash / "going.gguf", manifest)
                kept = [c for c in first if copy.has(c.index)]
                copy.close()
                if len(kept) == len(first):
                    break
        assert not returned
        nursery.cancel_scope.cancel()
    sparse.close()
    assert (crash / "going.gguf").read_bytes()[:first[-1].offset + first[-1].size] == \
        data[:first[-1].offset + first[-1].size]


def test_a_mirror_sending_more_than_a_range_asked_costs_the_range_and_is_one_line(hub: FakeHub) -> None:
    model = resolve(parse_spec(f"hf:{REPO}:Q8_0"))
    # the range's bytes, then 256 MiB more, as its Content-Length says: read whole, the body would be held
    hub.oversize = 256 << 20
    tracemalloc.start()
    try:
        with pytest.raises(HubError, match=r"answered bytes 0-4095 of tiny-Q8_0.gguf with more bytes, not 4096"):
            HubReader(model).read(0, 0, 4096)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20, peak


@pytest.mark.slow  # a stage process
def test_serve_takes_a_hub_model(hub: FakeHub, files: dict[str, Path], tmp_path: Path,
                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    stage = start_serve("--model", f"hf:{REPO}", "--threads", "1", "--max-sessions", "1", "--session-tokens", "64")
    try:
        # the set pulled whole into the state directory, checked, and served from its first part
        assert any(f"of {SET}.gguf ({manifest_for(files[f'{SET}-00001-of-00003.gguf']).model_id[:12]})" in line
                   for line in stage.lines), stage.lines
        assert (tmp_path / "meshd" / "models" / f"{SET}-00003-of-00003.gguf").read_bytes() == \
            files[f"{SET}-00003-of-00003.gguf"].read_bytes()
    finally:
        stop_all([stage])


@pytest.mark.slow  # three stage processes
async def test_serve_with_layers_takes_the_header_and_its_range_of_a_hub_model(
        hub: FakeHub, files: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    manifest = manifest_for(files[f"{SET}-00001-of-00003.gguf"])
    headers = sum(p.header_size for p in manifest.parts)
    expected = greedy_reference(files["tiny-Q8_0.gguf"], [PROMPT], 8)[PROMPT]
    stages: list[Served] = []
    try:
        # one after another: the first builds the manifest (a read of the set) and keeps it, the others take it
        for start, end in [(0, 2), (2, 4), (4, 6)]:
            monkeypatch.setenv("HF_TOKEN", f"stage{start}")
            stages.append(start_serve("--model", f"hf:{REPO}", "--layers", f"{start}:{end}", "--threads", "1",
                                      "--max-sessions", "1", "--session-tokens", "64"))
        tokens = await ask_route([s.address for s in stages], 8)
    finally:
        stop_all(stages)
    assert tokens == expected
    sparse = SparseFile.resume(tmp_path / "meshd" / "models" / f"{manifest.model_id}.gguf", manifest.model_id)
    # no whole file on disk: the one sparse copy holds the three ranges, the header and nothing else
    assert not list((tmp_path / "meshd" / "models").glob(f"{SET}-*"))
    assert {c.index for c in manifest.chunks if sparse.has(c.index)} == {c.index for c in manifest.chunks}
    sparse.close()
    for start, end in [(0, 2), (2, 4), (4, 6)]:
        owned = manifest.bytes_of(c for c in range_chunks(manifest, 6, start, end) if c.tensor is not None)
        read = hub.bytes_read(f"stage{start}")
        if start == 0:
            # the set once, to build the manifest, then its range
            assert read >= manifest.total_size + owned
        else:
            # its own tensors, and the headers at most twice: nothing of another range
            assert owned <= read <= owned + 2 * headers, (start, owned, read)


# ----- a mesh of three volunteers, each its own range from the hub

SESSIONS = ["--threads", "1", "--max-sessions", "2", "--session-tokens", "512"]
VOLUNTEER = ["--memory", "64M", *SESSIONS]
# Two of the tiny model's six layers with that KV (279 KB a layer, 592 KB at the head, 626 KB at the tail),
# not three (871 KB at the head, 837 KB in the middle): the model takes three volunteers.
THIRD = ["--memory", "700K", *SESSIONS]
PROMPT = "What is the capital of France?"
TOKENS = 16


@pytest.mark.slow  # three daemons on the tiny 3-part set
async def test_three_volunteers_joined_with_a_hub_model_read_only_their_own_tensors_and_answer_like_the_whole(
        files: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, peers: Peers) -> None:
    parts = [files[f"{SET}-0000{i}-of-00003.gguf"] for i in (1, 2, 3)]
    manifest = manifest_for(parts[0])
    expected = greedy_reference(files["tiny-Q8_0.gguf"], [PROMPT], TOKENS)[PROMPT]
    started: list[Served] = []
    with FakeHub() as hub:
        hub.publish(REPO, {p.name: p for p in parts})
        monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
        try:
            nodes: list[Served] = []
            for i in range(3):
                monkeypatch.setenv("HF_TOKEN", f"volunteer{i}")
                seed = ["--seed", nodes[0].address] if nodes else []
                nodes.append(start_join(*seed, "--state-dir", str(tmp_path / f"v{i}"), "--model", f"hf:{REPO}",
                                        *THIRD))
                started.append(nodes[-1])
                if i == 0:
                    # the first holder builds the manifest (one read of the whole set) before the others look
                    with trio.fail_after(120):
                        while not (await mesh_status(peers, nodes[0])).coverage:
                            await trio.sleep(0.2)
            with trio.fail_after(240):
                while True:
                    assert not [n for n in nodes if n.proc.poll() is not None], "a daemon exited"
                    view = await mesh_status(peers, nodes[0])
                    ranges = served(view)
                    if all(ranges.get(n.node_id) for n in nodes) and view.coverage and \
                            view.coverage[0].covered_layers == view.coverage[0].n_layers:
                        break
                    await trio.sleep(0.5)
            assert view.coverage[0].model == manifest.model_id
            result = await ask_with_failover(peers, finder(peers, nodes[0]), AskRequest(
                messages=[{"role": "user", "content": PROMPT}], max_tokens=TOKENS))
            assert result.tokens == expected
        finally:
            stop_all(started)
        names = [p.name for p in parts]
        headers = {(names[i], 0, p.header_size) for i, p in enumerate(manifest.parts)}
        print()
        for i, node in enumerate(nodes):
            (rng,) = ranges[node.node_id]
            owned = [c for c in range_chunks(manifest, 6, *rng) if c.tensor is not None]
            allowed = headers | {(names[c.part], c.part_offset, c.part_offset + c.size) for c in owned}
            reads = hub.ranges(f"volunteer{i}")
            read = sum(e - s for _, s, e in reads)
            print(f"volunteer {i} layers [{rng[0]}, {rng[1]}): owned {manifest.bytes_of(owned)} B, read {read} B "
                  f"from the hub in {len(reads)} requests, of a {manifest.total_size} B set")
            if i == 0:
                # the first holder: the whole set once (checked against each part's sha256), then its range
                assert read >= manifest.total_size + manifest.bytes_of(owned)
                continue
            # the others: every byte read is a header's or one of their own tensors' (but for the alignment
            # between two of them a run reads past), and all of those
            gaps = outside(reads, allowed)
            assert all(e - s < 32 for _, s, e in gaps), ("read bytes that are not its own", gaps[:4])
            assert not outside(allowed, set(reads))
            # its tensors once, and the headers twice at most (checked against the manifest, then fetched)
            header_bytes = sum(p.header_size for p in manifest.parts)
            assert manifest.bytes_of(owned) + header_bytes <= read - sum(e - s for _, s, e in gaps) <= \
                manifest.bytes_of(owned) + 2 * header_bytes


def outside(spans: Iterable[tuple[str, int, int]], cover: Iterable[tuple[str, int, int]]) -> list[tuple[str, int, int]]:
    """The bytes of ``spans`` (file, start, end) that no span of ``cover`` holds, as spans."""
    held: dict[str, list[tuple[int, int]]] = {}
    for name, start, end in sorted(cover):
        runs = held.setdefault(name, [])
        if runs and start <= runs[-1][1]:
            runs[-1] = (runs[-1][0], max(runs[-1][1], end))
        else:
            runs.append((start, end))
    left = []
    for name, start, end in sorted(spans):
        at = start
        for a, b in held.get(name, []):
            if b <= at or a >= end:
                continue
            if a > at:
                left.append((name, at, a))
            at = max(at, b)
        if at < end:
            left.append((name, at, end))
    return left


@pytest.mark.slow  # four daemons on the tiny set
async def test_a_volunteer_takes_from_members_what_they_hold_once_two_addresses_name_the_manifest(
        files: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, peers: Peers) -> None:
    manifest = manifest_for(files[f"{SET}-00001-of-00003.gguf"])
    headers = sum(p.header_size for p in manifest.parts)
    tensors = manifest.total_size - headers
    nodes: list[Served] = []
    with FakeHub() as hub:
        hub.publish(REPO, files)
        monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
        try:
            # the first two at one address (two identities of one host), the others at addresses of their own:
            # each loopback address is a source group of its own
            for i, host in enumerate(["127.0.0.1", "127.0.0.1", "127.0.0.2", "127.0.0.3"]):
                monkeypatch.setenv("HF_TOKEN", f"volunteer{i}")
                seed = ["--seed", nodes[0].address] if nodes else []
                # memory for the whole tiny model: each is given all of it, the later ones as replicas
                nodes.append(start_join(*seed, "--listen", f"{host}:0", "--state-dir", str(tmp_path / f"v{i}"),
                                        "--model", f"hf:{REPO}", *VOLUNTEER))
                with trio.fail_after(120):
                    while not served(await mesh_status(peers, nodes[0])).get(nodes[-1].node_id):
                        assert nodes[-1].proc.poll() is None, "a daemon exited"
                        await trio.sleep(0.3)
        finally:
            stop_all(nodes)
        read = [hub.bytes_read(f"volunteer{i}") for i in range(4)]
    print(f"\nread from the hub: {read} B; the set {manifest.total_size} B, its headers {headers} B")
    # the first reads the set once to build the manifest, then its layers
    assert read[0] >= manifest.total_size + tensors
    # the second has the manifest on one member's word alone: every tensor from the hub, checked; so has
    # the third, though two members name it: they are at one address, and a second identity is free
    assert read[1] >= tensors and read[2] >= tensors
    # the fourth has it from two addresses: the members hold every tensor, only the headers come from the hub
    assert read[3] <= 2 * headers
