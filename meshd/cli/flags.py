"""Flag values, each checked by an argparse converter as it is parsed: it returns the value or raises
ArgumentTypeError with what is wrong (argparse then exits 2 with one line).
"""

from __future__ import annotations

import argparse
import errno
import math
import os
import socket
import stat
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from meshd.cli.failures import CommandError, UsageError
from meshd.engine.chain import parse_ranges
from meshd.fetch.hub import HubSpec, HubSpecError, is_spec, parse_spec
from meshd.logs import level_of
from meshd.mesh.models import ModelNotFound, default_model_path
from meshd.mesh.records import is_unspecified, join_address
from meshd.net.identity_store import IdentityError, load_mesh_key
from meshd.store.gguf_header import GGUFError
from meshd.store.split import SplitError, model_files, set_prefix

# llama.cpp's LLAMA_MAX_SEQ: a context holds at most this many sequences (sessions).
MAX_SESSIONS = 256


MAX_TOKENS = 1 << 20


T = TypeVar("T")


def host_port(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        hint = " (the sampling seed is --sampling-seed)" if text.isdigit() else ""
        raise argparse.ArgumentTypeError(f"'{text}' is not HOST:PORT{hint}")
    return host, int(port)


def address(text: str) -> str:
    host, port = host_port(text)
    return f"{host}:{port}"


def model_name(text: str) -> str:
    """--model of ask: a model's name or digest, as the route request carries it."""
    if not 0 < len(text) <= 128:
        raise argparse.ArgumentTypeError("a model name or digest is 1 to 128 characters")
    return text


def dialable_address(text: str) -> str:
    """--advertise: a host others can dial (not 0.0.0.0 or ::) and a port."""
    host, port = host_port(text)
    if is_unspecified(host.strip("[]")) or port == 0:
        raise argparse.ArgumentTypeError(f"'{text}' is not an address others can dial: give this node's host and port")
    return f"{host}:{port}"


def api_address(text: str) -> tuple[str, int]:
    """--api: HOST:PORT, or a port alone on loopback."""
    return ("127.0.0.1", integer(0, 65535)(text)) if text.isdigit() else host_port(text)


def route_addresses(text: str) -> list[str]:
    addresses = [address(a.strip()) for a in text.split(",") if a.strip()]
    if not addresses:
        raise argparse.ArgumentTypeError("give the stages as HOST:PORT,HOST:PORT,...")
    return addresses


def layer_range(text: str) -> tuple[int, int]:
    try:
        layers = parse_ranges(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if len(layers) != 1:
        raise argparse.ArgumentTypeError(f"'{text}' is more than one layer range; a stage serves one START:END")
    [(start, end)] = layers
    if start >= end:
        raise argparse.ArgumentTypeError(f"layer range [{start}, {end}) is empty or inverted")
    return start, end


def size(text: str) -> int:
    units = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    t = text.strip().lower().removesuffix("b").removesuffix("i")
    num, unit = (t[:-1], t[-1]) if t and t[-1] in units else (t, "")
    try:
        value = float(num)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a size (a number with an optional K/M/G/T suffix)") from None
    if not 0 <= value * units[unit] < 1 << 60:
        raise argparse.ArgumentTypeError(f"size '{text}' is out of range")
    return int(value * units[unit])


def model_id(text: str) -> str:
    t = text.strip().lower()
    if len(t) != 64 or any(c not in "0123456789abcdef" for c in t):
        raise argparse.ArgumentTypeError(f"'{text}' is not a model id (64 hex digits)")
    return t


def integer(low: int, high: int) -> Callable[[str], int]:
    def convert(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = low - 1
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be a whole number from {low} to {high}, not '{text}'")
        return value
    return convert


def number(low: float, high: float, *, above_low: bool = False) -> Callable[[str], float]:
    def convert(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not ((low < value) if above_low else (low <= value)) or not value <= high:
            raise argparse.ArgumentTypeError(
                f"must be a number {'above' if above_low else 'from'} {low:g} {'and at most' if above_low else 'to'} "
                f"{high:g}, not '{text}'")
        return value
    return convert


GGUF_MAGIC = b"GGUF"


# magic, version, tensor count and metadata count: the smallest header there is
GGUF_MIN_HEADER = 24


def checked_model(path: Path) -> Path:
    """`path` if it starts as a GGUF does; ModelNotFound, with the reason, if not. A part of a split set
    (named `NAME-00002-of-00003.gguf`, as llama.cpp needs) gives the set's first part, once every part's
    header says it belongs: ModelNotFound names a part missing or not of the set.

    Only the first bytes are read of a file of its own: parsing the whole header takes seconds on a
    busy machine, and the daemon (metadata) and the engine (tensors) check the
    rest, each failing with one line.
    """
    try:
        # Non-blocking, so a FIFO given by mistake is refused instead of waited on.
        with open(os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC), "rb") as file:
            if not stat.S_ISREG(os.fstat(file.fileno()).st_mode):
                raise ModelNotFound(f"{path} is not a regular file")
            head = file.read(GGUF_MIN_HEADER)
    except FileNotFoundError:
        raise ModelNotFound(f"model file not found: {path}") from None
    except OSError as exc:
        raise ModelNotFound(f"cannot read the model file {path}: {exc.strerror}") from None
    if not head.startswith(GGUF_MAGIC):
        raise ModelNotFound(f"{path} is not a GGUF model file (it does not start with GGUF)")
    if len(head) < GGUF_MIN_HEADER:
        raise ModelNotFound(f"{path} is not a GGUF model file (it ends within the header)")
    version = int.from_bytes(head[4:8], "little")
    if version not in (2, 3):
        raise ModelNotFound(f"{path} is GGUF version {version}; llama.cpp reads versions 2 and 3")
    if set_prefix(path) is None:
        return path
    try:
        return model_files(path).first
    except (GGUFError, SplitError, OSError) as exc:
        raise ModelNotFound(f"{path} is not a usable split GGUF set ({exc})") from None


def model_id_or_name(text: str) -> str:
    """join --model-id: a model id (the hex hash of a manifest) or a model name the mesh knows."""
    text = text.strip()
    if not text or len(text) > 256 or not text.isprintable():
        raise argparse.ArgumentTypeError(f"'{text}' is neither a model id (64 hex digits) nor a model name")
    return text


def gguf_file(text: str) -> Path:
    try:
        return checked_model(Path(text))
    except ModelNotFound as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def hub_or(text: str, otherwise: Callable[[str], T]) -> HubSpec | T:
    """A hub model (hf:ORG/REPO[:QUANT][@REV], hf:ORG/REPO/FILE.gguf), else what ``otherwise`` makes of ``text``."""
    if is_spec(text):
        try:
            return parse_spec(text)
        except HubSpecError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    return otherwise(text)


def model_arg(text: str) -> Path | HubSpec:
    """--model of serve and join: a GGUF file, or a hub model."""
    return hub_or(text, gguf_file)


def model_id_or_hub(text: str) -> str | HubSpec:
    """pull's model: an id, or a hub model."""
    return hub_or(text, model_id)


def mesh_key_file(text: str) -> bytes:
    try:
        return load_mesh_key(Path(text), warn=lambda line: print(f"meshd: {line}", file=sys.stderr))
    except IdentityError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def default_state_dir() -> Path:
    base = os.environ.get("XDG_STATE_HOME") or os.path.expanduser("~/.local/state")
    return Path(base) / "meshd"


def model_or_default(arg: Path | None) -> Path:
    return arg if arg is not None else checked_model(default_model_path())


def check_port(where: tuple[str, int], flag: str) -> None:
    """CommandError, naming the port and the flag that sets it, if nothing can listen on `where` now.

    Checked before a daemon joins: a daemon that found its API's port taken only after joining left
    the mesh listing it as dead, and "Address already in use" said neither which port nor which flag.
    """
    host, port = where[0].strip("[]"), where[1]
    if port == 0:
        return  # the kernel picks a free one
    shown = join_address(host, port)
    try:
        found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise UsageError(f"{flag} {shown}: {exc.strerror}") from None
    for family, kind, proto, _, sockaddr in found:
        with socket.socket(family, kind, proto) as probe:
            # as trio's and Hypercorn's listeners: a port whose last connections linger in TIME_WAIT is free
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                probe.bind(sockaddr)
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    raise CommandError(f"port {port} is already in use ({flag} {shown}): stop what listens there, "
                                       f"or give {flag} another port") from None
                raise CommandError(f"cannot listen on {shown} ({flag}): {exc.strerror}") from None


def log_level(text: str) -> int:
    try:
        return level_of(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
