"""How meshd logs: one setup for every command, timestamped text or one JSON object per line.

Long-running commands (join, serve, relay) take `--log-level` and `--log-json`;
$MESHD_LOG gives the level where no flag does. Records go to stderr, so stdout
keeps what a command answers (the `ready` line, an answer, a status table).
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import IO, Any

LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}
DEFAULT_LEVEL = "warning"
# The attributes every LogRecord has; anything else on a record came from `extra=` and is logged too.
_STANDARD = frozenset(vars(logging.makeLogRecord({}))) | {"message", "asctime", "taskName"}


def level_of(text: str) -> int:
    """The level a name (any case) stands for; ValueError naming the choices if none."""
    try:
        return LEVELS[text.strip().lower()]
    except KeyError:
        raise ValueError(f"'{text}' is not a log level ({', '.join(LEVELS)})") from None


def utc_time(created: float) -> str:
    """RFC 3339 in UTC with milliseconds: sortable, and the same on every machine of a mesh."""
    whole = int(created)
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(whole)) + f".{int((created - whole) * 1000):03d}Z"


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line = f"{utc_time(record.created)} {record.levelname} {record.name}: {record.getMessage()}"
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line: time, level, logger, message, then any `extra` fields."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {"time": utc_time(record.created), "level": record.levelname.lower(),
                                 "logger": record.name, "message": record.getMessage()}
        for key, value in vars(record).items():
            if key not in _STANDARD and key not in entry:
                entry[key] = value
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        # default=str: an `extra` value JSON cannot hold is logged as its text, never dropped with the record
        return json.dumps(entry, ensure_ascii=False, default=str)


def setup_logging(level: int = logging.WARNING, json_lines: bool = False, stream: IO[str] | None = None) -> None:
    """Routes every logger of the process to `stream` (stderr) at `level`, replacing any earlier setup."""
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(JsonFormatter() if json_lines else TextFormatter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
