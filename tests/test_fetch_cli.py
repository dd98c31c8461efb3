"""`meshd pull`: a range by hand from a member; every mistake one line, no traceback."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fetchnet import SourceProcess, start_source_process
from localmesh import run_meshd, stop_process

from meshd.cli.main import main
from meshd.store.manifest import CHUNK_SIZE, compute
from meshd.store.ranges import range_chunks
from meshd.store.sparse import SparseFile

pytestmark = pytest.mark.slow  # a source process and `meshd pull` processes


@pytest.fixture(scope="module")
def tiny(tiny_models: dict[str, Path]) -> Path:
    return tiny_models["llama-gqa-tied"]


@pytest.fixture(scope="module")
def source(tiny: Path) -> Iterator[SourceProcess]:
    served = start_source_process("whole", tiny)
    try:
        yield served
    finally:
        stop_process(served.proc)


def one_line(result: object, code: int) -> str:
    assert result.returncode == code, result.stderr  # type: ignore[attr-defined]
    lines = result.stderr.strip().splitlines()  # type: ignore[attr-defined]
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr  # type: ignore[attr-defined]
    return lines[0]


def test_pull_fetches_the_range_into_a_sparse_file_and_a_second_pull_fetches_nothing(
    tiny: Path, source: SourceProcess, tmp_path: Path
) -> None:
    model_id = compute(tiny, CHUNK_SIZE).model_id
    out = tmp_path / "part.gguf"
    result = run_meshd("pull", model_id, "--layers", "4:6", "--seed", source.address, "--out", str(out))
    assert result.returncode == 0, result.stderr
    assert f"layers 4:6 of {model_id[:16]} in {out}" in result.stdout and "1 source" in result.stdout
    sparse = SparseFile.resume(out, model_id)
    wanted = range_chunks(sparse.manifest, 6, 4, 6)
    assert sparse.missing(wanted) == [] and sparse.verified_bytes() == sum(c.size for c in wanted)
    sparse.close()
    again = run_meshd("pull", model_id, "--layers", "4:6", "--seed", source.address, "--out", str(out))
    assert again.returncode == 0 and "0 MiB fetched (0 chunks" in again.stdout, again.stdout + again.stderr


@pytest.mark.parametrize(
    ("args", "code", "says"),
    [
        (["nothex", "--layers", "0:2", "--seed", "127.0.0.1:1"], 2, "is not a model id"),
        (["ab" * 32, "--seed", "127.0.0.1:1"], 2, "--layers"),
        (["ab" * 32, "--layers", "0:2"], 2, "--seed"),
        (["ab" * 32, "--layers", "2:1", "--seed", "127.0.0.1:1"], 2, "empty or inverted"),
        (["ab" * 32, "--layers", "0:2", "--seed", "nowhere"], 2, "is not HOST:PORT"),
    ],
)
def test_a_mistake_in_the_flags_is_one_line(args: list[str], code: int, says: str,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    # (argparse exits on what it checks; what pull checks itself, with an id and not a hub model, it returns)
    try:
        exited = main(["pull", *args])
    except SystemExit as exc:
        exited = exc.code
    assert exited == code
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and says in lines[0]


def test_a_seed_nobody_listens_on_is_one_line(tmp_path: Path, refusing_address: str) -> None:
    line = one_line(run_meshd("pull", "ab" * 32, "--layers", "0:2", "--seed", refusing_address,
                              "--out", str(tmp_path / "x.gguf"), "--timeout", "5"), 1)
    assert "no seed gave model abababababababab" in line and "cannot reach" in line


def test_a_model_the_seed_lacks_and_layers_the_model_lacks_are_one_line(
    tiny: Path, source: SourceProcess, tmp_path: Path
) -> None:
    line = one_line(run_meshd("pull", "cd" * 32, "--layers", "0:2", "--seed", source.address,
                              "--out", str(tmp_path / "x.gguf")), 1)
    assert "holds no model" in line
    model_id = compute(tiny, CHUNK_SIZE).model_id
    line = one_line(run_meshd("pull", model_id, "--layers", "4:9", "--seed", source.address,
                              "--out", str(tmp_path / "y.gguf")), 2)
    assert "layers 4:9 are not a range of a 6-layer model" in line


def test_an_out_file_that_is_not_a_partial_download_is_left_alone(
    tiny: Path, source: SourceProcess, tmp_path: Path
) -> None:
    mine = tmp_path / "mine.gguf"
    mine.write_bytes(b"my own file")
    model_id = compute(tiny, CHUNK_SIZE).model_id
    line = one_line(run_meshd("pull", model_id, "--layers", "0:2", "--seed", source.address, "--out", str(mine)), 1)
    assert "is not a partial download of this model" in line
    assert mine.read_bytes() == b"my own file"
