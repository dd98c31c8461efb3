"""The `meshd` command line: the command the flags name, run, and its failure said in one line."""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence

import trio

from meshd import bench
from meshd.cli.ask import ask
from meshd.cli.failures import UsageError, report_failure
from meshd.cli.parser import build_parser
from meshd.cli.pull import pull
from meshd.cli.serve import join, relay, serve
from meshd.cli.status import credits, models, status
from meshd.client.ask import first_error
from meshd.logs import DEFAULT_LEVEL, LEVELS, level_of, setup_logging

COMMANDS = {"serve": serve, "ask": ask, "join": join, "status": status, "models": models, "credits": credits,
            "relay": relay,
            "pull": pull, "bench": bench.bench}


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
        return trio.run(COMMANDS[args.command], args)
    except BaseExceptionGroup as group:
        return report_failure(args.command, first_error(group))
    except BaseException as exc:
        return report_failure(args.command, exc)
