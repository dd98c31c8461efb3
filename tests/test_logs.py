"""Logs: timestamped text or one JSON object per line, at the level `--log-level` (or $MESHD_LOG) says."""

from __future__ import annotations

import io
import json
import logging
import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from localmesh import Served, start_join

from meshd.cli.main import main
from meshd.cli.parser import build_parser
from meshd.logs import level_of, setup_logging, utc_time

STAMP = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z"


@pytest.fixture
def restore_logging() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def test_text_lines_start_with_a_utc_timestamp_and_respect_the_level(restore_logging: None) -> None:
    out = io.StringIO()
    setup_logging(logging.INFO, stream=out)
    logging.getLogger("meshd.test").debug("hidden")
    logging.getLogger("meshd.test").info("seed %s answered", "10.0.0.1:7000")
    assert re.fullmatch(STAMP + r" INFO meshd\.test: seed 10\.0\.0\.1:7000 answered\n", out.getvalue())


def test_json_lines_parse_one_object_each_with_extra_fields_and_tracebacks(restore_logging: None) -> None:
    out = io.StringIO()
    setup_logging(logging.DEBUG, json_lines=True, stream=out)
    log = logging.getLogger("meshd.test")
    log.warning("multi\nline \"quoted\" é", extra={"peer": "ab" * 8, "odd": object()})
    try:
        raise ValueError("boom")
    except ValueError:
        log.exception("failed")
    lines = out.getvalue().splitlines()
    assert len(lines) == 2
    first, second = (json.loads(line) for line in lines)
    assert re.fullmatch(STAMP, first["time"])
    assert first["level"] == "warning" and first["logger"] == "meshd.test"
    assert first["message"] == "multi\nline \"quoted\" é" and first["peer"] == "ab" * 8
    assert first["odd"].startswith("<object object")
    assert second["level"] == "error" and "ValueError: boom" in second["exception"]


def test_a_second_setup_replaces_the_first(restore_logging: None) -> None:
    first, second = io.StringIO(), io.StringIO()
    setup_logging(logging.INFO, stream=first)
    setup_logging(logging.ERROR, json_lines=True, stream=second)
    logging.getLogger("meshd.test").warning("dropped")
    logging.getLogger("meshd.test").error("kept")
    assert first.getvalue() == ""
    assert json.loads(second.getvalue())["message"] == "kept"


def test_utc_time_is_rfc3339_with_milliseconds() -> None:
    assert utc_time(0.25) == "1970-01-01T00:00:00.250Z"
    assert utc_time(1_800_000_000.9999) == "2027-01-15T08:00:00.999Z"


def test_levels_by_name_in_any_case_and_nothing_else() -> None:
    assert level_of("DEBUG") == logging.DEBUG and level_of(" error ") == logging.ERROR
    for bad in ("chatty", "10", ""):
        with pytest.raises(ValueError, match="is not a log level"):
            level_of(bad)


@pytest.mark.parametrize("command", ["join", "serve", "relay"])
def test_every_long_running_command_takes_the_log_flags(command: str) -> None:
    args = build_parser().parse_args([command, "--log-level", "debug", "--log-json"])
    assert args.log_level == logging.DEBUG and args.log_json


def test_a_bad_log_level_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["relay", "--log-level", "chatty"])
    assert exited.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "'chatty' is not a log level (debug, info, warning, error)" in err[0]


def logged_lines(served: Served, match: str) -> list[str]:
    """The daemon's output lines, polled until one contains `match`."""
    assert served.log is not None
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        lines = Path(served.log).read_text().splitlines()
        if any(match in line for line in lines):
            return lines
        time.sleep(0.1)
    raise AssertionError(f"no line with {match!r} in:\n" + Path(served.log).read_text())


@pytest.mark.slow
@pytest.mark.parametrize("json_lines", [False, True], ids=["text", "json"])
def test_a_daemon_logs_as_the_flags_say(tmp_path: Path, json_lines: bool) -> None:
    # a first node elects itself tracker within a few seconds, and logs it at info
    served = start_join("--no-model", "--state-dir", str(tmp_path / "state"),
                        "--log-level", "info", *(["--log-json"] if json_lines else []))
    try:
        lines = logged_lines(served, "tracker is now")
    finally:
        served.stop()
    records = [line for line in lines if not line.startswith(("meshd:", "ready "))]
    assert records
    if json_lines:
        parsed = [json.loads(line) for line in records]
        assert all(re.fullmatch(STAMP, p["time"]) and p["level"] in ("info", "warning") for p in parsed)
        assert any(p["logger"] == "meshd.daemon" and "tracker is now" in p["message"] for p in parsed)
    else:
        assert all(re.match(STAMP + r" (INFO|WARNING) meshd\.", line) for line in records), records
