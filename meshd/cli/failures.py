"""What a command fails with, and the one line a user gets for it.

Every failure a user can cause ends in one line on stderr and a non-zero exit: flag values are checked
by argparse converters as they are parsed (exit 2), what goes wrong later is one line too (exit 1),
Ctrl-C is one line (exit 130).
"""

from __future__ import annotations

import sys
import warnings
from typing import TypeVar

import trio

from wire.errors import ErrorCode, ProtocolError
from wire.message import Message

ReplyT = TypeVar("ReplyT", bound=Message)


class UsageError(Exception):
    """A mistake in how meshd was asked to run (exit 2)."""


class CommandError(Exception):
    """The command could not do its work, for a reason outside meshd (exit 1)."""


def expect(reply: Message, kind: type[ReplyT], what: str) -> ReplyT:
    """`reply` if it is a `kind`, else the typed error a peer's wrong answer is."""
    if not isinstance(reply, kind):
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"{what} answered {reply.type!r}, not {kind.__name__}")
    return reply


def user_errors() -> tuple[type[Exception], ...]:
    """The other modules' errors a user can cause (a wrong route, model, control socket, offer).

    Imported when a command fails, not when this module loads: every command imports this module, and
    these modules (the daemon's among them) cost a second of CPU to import, which `meshd status`, `ask`
    and `--version` would otherwise pay on every run.
    """
    from meshd.client.ask import RouteError
    from meshd.daemon.volunteer import CannotVolunteer
    from meshd.engine.supervisor import WorkerStartError
    from meshd.mesh.models import ModelNotFound
    from meshd.net.control import ControlError

    return RouteError, ModelNotFound, WorkerStartError, ControlError, CannotVolunteer


def report_failure(command: str, exc: BaseException) -> int:
    """One line for what a user can cause; anything else is a bug and keeps its traceback."""
    prefix = f"meshd {command}".strip()
    if isinstance(exc, KeyboardInterrupt):
        print(f"{prefix}: interrupted", file=sys.stderr)
        # The interrupt abandons trio's run: a task started but not yet run has a coroutine that is
        # never awaited, and Python says so at exit (seen once in a CI run: three lines where one is
        # promised). That is the interrupt's doing, not something to tell the user.
        warnings.filterwarnings("ignore", "coroutine .* was never awaited", RuntimeWarning)
        return 130
    if isinstance(exc, (UsageError, CommandError)):
        message = str(exc)
    elif isinstance(exc, ProtocolError):
        message = f"{exc.code.value}: {exc.message}"
        if command == "ask" and "chat template" in exc.message:
            # a chat template llama.cpp's renderer cannot apply: a prompt still goes in as plain text
            message += "; ask with --raw to send the prompt as plain text"
    elif isinstance(exc, trio.TooSlowError):
        message = "timed out waiting for a stage"
    elif isinstance(exc, OSError):
        message = exc.strerror or str(exc)
    elif isinstance(exc, user_errors()):
        message = str(exc)
    else:
        raise exc
    print(f"{prefix}: {message}", file=sys.stderr)
    return 2 if isinstance(exc, UsageError) else 1
