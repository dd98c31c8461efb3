"""The `meshd` command line: the command the flags name, run, and its failure said in one line."""

from __future__ import annotations

import argparse
import importlib
import os
from collections.abc import Awaitable, Callable, Sequence
from typing import cast

import trio

from meshd.cli.failures import UsageError, report_failure
from meshd.cli.parser import build_parser
from meshd.client.ask import first_error
from meshd.logs import DEFAULT_LEVEL, LEVELS, level_of, setup_logging

# each command's module:function, imported when that command runs: `serve`'s modules (the daemon's) take
# about half a second of CPU to import, which `meshd status` and `ask`, run often and by scripts, need not pay
COMMANDS = {"serve": "meshd.cli.serve:serve", "ask": "meshd.cli.ask:ask", "join": "meshd.cli.serve:join",
            "status": "meshd.cli.status:status", "models": "meshd.cli.status:models",
            "credits": "meshd.cli.status:credits", "relay": "meshd.cli.serve:relay", "pull": "meshd.cli.pull:pull",
            "bench": "meshd.bench:bench"}


def command(name: str) -> Callable[[argparse.Namespace], Awaitable[int]]:
    module, function = COMMANDS[name].split(":")
    return cast(Callable[[argparse.Namespace], Awaitable[int]], getattr(importlib.import_module(module), function))


def log_setup(args: argparse.Namespace) -> None:
    """Logging as the flags say (join, serve, relay), else as $MESHD_LOG says, else warnings and worse."""
    level = getattr(args, "log_level", None)
    if level is None:
        text = os.environ.get("MESHD_LOG", DEFAULT_LEVEL)
        try:
            level = level_of(text)
        except ValueError:
            raise UsageError(f"MESHD_LOG={text} is not a log level ({', '.join(LEVELS)})") from None
    setup_logging(level, json_lines=getattr(args, "log_json", False))


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except KeyboardInterrupt:
        return report_failure("", KeyboardInterrupt())
    try:
        log_setup(args)
    except UsageError as exc:
        return report_failure(args.command, exc)
    try:
        return trio.run(command(args.command), args)
    except BaseExceptionGroup as group:
        return report_failure(args.command, first_error(group))
    except BaseException as exc:
        return report_failure(args.command, exc)
