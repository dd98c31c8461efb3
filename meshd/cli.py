"""The `meshd` command line.

Every failure a user can cause ends in one line on stderr and a non-zero exit.
"""

from __future__ import annotations

import argparse
import codecs
import logging
import os
import sys
from pathlib import Path
from typing import Sequence

import trio

from meshd.ask import (
    AskRequest, AskResult, RouteError, check_route, describe_route, first_error, run_session, stop_trim,
)
from meshd.engine.chain import parse_ranges
from meshd.engine.supervisor import EngineSupervisor, WorkerStartError
from meshd.models import ModelNotFound, default_model_path
from meshd.peers import PeersConfig, open_peers
from meshd.stage import StageLimits, stage_node
from wire.errors import ProtocolError
from wire.identity import NodeIdentity
from wire.stage import Sampling


class UsageError(Exception):
    pass


def parse_address(text: str, what: str = "address") -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise UsageError(f"{what} '{text}' is not HOST:PORT")
    return host, int(port)


def parse_layers(text: str) -> tuple[int, int]:
    try:
        (layers,) = parse_ranges(text)
    except ValueError as exc:
        raise UsageError(f"--layers: {exc}") from None
    return layers


def parse_size(text: str) -> int:
    units = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    t = text.strip().lower().removesuffix("b").removesuffix("i")
    num, unit = (t[:-1], t[-1]) if t and t[-1] in units else (t, "")
    try:
        value = float(num)
    except ValueError:
        raise UsageError(f"size '{text}' is not a number with an optional K/M/G/T suffix") from None
    if value < 0:
        raise UsageError(f"size '{text}' is negative")
    return int(value * units[unit])


def read_mesh_key(path: Path | None) -> bytes | None:
    if path is None:
        return None
    try:
        key = path.read_bytes().strip()
    except OSError as exc:
        raise UsageError(f"cannot read the mesh key file {path}: {exc.strerror}") from None
    if not key:
        raise UsageError(f"the mesh key file {path} is empty")
    return key


def model_path(arg: Path | None) -> Path:
    path = arg or default_model_path()
    if not path.is_file():
        raise UsageError(f"model file not found: {path}")
    return path


# ----- serve

async def serve(args: argparse.Namespace) -> int:
    host, port = parse_address(args.listen, "--listen")
    path = model_path(args.model)
    layers = parse_layers(args.layers) if args.layers else None
    for name in ("max_sessions", "session_tokens", "threads"):
        if getattr(args, name) < (0 if name == "threads" else 1):
            raise UsageError(f"--{name.replace('_', '-')} must be positive")
    kv_tokens = args.kv_tokens or args.max_sessions * args.session_tokens
    limits = StageLimits(max_sessions=args.max_sessions, max_session_tokens=args.session_tokens,
                         max_total_tokens=kv_tokens, ttl=args.ttl, evict_after=args.evict_after)
    config = PeersConfig(mesh_key=read_mesh_key(args.mesh_key_file))
    async with stage_node(path, layers, limits, NodeIdentity.generate(), config, (host, port), args.threads) as node:
        report = node.service.report
        print(f"meshd: serving layers [{report.layer_begin}, {report.layer_end}) of {path.name} "
              f"({node.service.digest[:12]}) on {node.address} as node {node.peers.node_id[:16]}", flush=True)
        print(f"ready {node.address} pid={os.getpid()} worker={node.engine.pid}", flush=True)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(report_restarts, node.engine)
            await trio.sleep_forever()
    return 0


async def report_restarts(engine: EngineSupervisor) -> None:
    seen = engine.restarts
    while True:
        await trio.sleep(0.5)
        if engine.restarts != seen:
            seen = engine.restarts
            print(f"meshd: engine worker died; restarted (restart {seen}, worker {engine.pid})", file=sys.stderr, flush=True)


# ----- ask

async def ask(args: argparse.Namespace) -> int:
    if not args.route:
        raise UsageError("give --route HOST:PORT,... (automatic routing needs `meshd join`)")
    addresses = [a.strip() for a in args.route.split(",") if a.strip()]
    for a in addresses:
        parse_address(a, "route stage")
    request = build_request(args)
    identity = NodeIdentity.generate()
    config = PeersConfig(mesh_key=read_mesh_key(args.mesh_key_file))
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    out = sys.stdout

    def show(token: int, piece: bytes) -> None:
        out.write(decoder.decode(piece))
        out.flush()

    async with open_peers(identity, config) as peers:
        route = await describe_route(peers, addresses, timeout=args.timeout)
        check_route(route)
        result = AskResult()
        await run_session(peers, route, request, result, on_token=None if args.stop else show,
                          stall_timeout=args.timeout)
    if args.stop:
        out.write(stop_trim(result.text, args.stop))
    else:
        out.write(decoder.decode(b"", final=True))
    out.write("\n")
    out.flush()
    print_figures(result)
    return 0


def build_request(args: argparse.Namespace) -> AskRequest:
    if args.max_tokens < 1:
        raise UsageError("--max-tokens must be at least 1")
    try:
        sampling = Sampling(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    except ValueError as exc:
        raise UsageError(f"bad sampling options: {exc.errors()[0]['loc'][0]} {exc.errors()[0]['msg']}") from None
    if args.raw:
        if args.system:
            raise UsageError("--system needs the chat template; leave out --raw")
        return AskRequest(text=args.prompt, sampling=sampling, max_tokens=args.max_tokens, stop=args.stop or [],
                          wire_dtype=args.wire_dtype)
    messages = ([{"role": "system", "content": args.system}] if args.system else []) + \
        [{"role": "user", "content": args.prompt}]
    return AskRequest(messages=messages, sampling=sampling, max_tokens=args.max_tokens, stop=args.stop or [],
                      wire_dtype=args.wire_dtype)


def print_figures(result: AskResult) -> None:
    ttft = result.ttft
    print(f"[{len(result.prompt_tokens)} prompt tokens, {len(result.tokens)} new tokens, "
          f"first token {ttft * 1000:.0f} ms, {result.decode_rate:.1f} tokens/s, "
          f"stopped by {result.reason or 'error'}]" if ttft is not None else
          f"[{len(result.prompt_tokens)} prompt tokens, no new tokens, stopped by {result.reason}]",
          file=sys.stderr, flush=True)


# ----- parser

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="meshd", description="Run one GGUF model across many machines.")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="serve one layer range by hand")
    s.add_argument("--model", type=Path, help="GGUF file (default: SmolLM2-135M-Instruct Q4_1)")
    s.add_argument("--layers", help="layer range START:END (default: all layers)")
    s.add_argument("--listen", default="127.0.0.1:0", help="HOST:PORT to accept peers on")
    s.add_argument("--threads", type=int, default=0, help="compute threads (default: all cores)")
    s.add_argument("--max-sessions", type=int, default=8, help="sessions served at once (KV sequences)")
    s.add_argument("--session-tokens", type=int, default=2048, help="KV tokens one session may hold")
    s.add_argument("--kv-tokens", type=int, default=0,
                   help="KV tokens of all sessions together (default: max sessions x session tokens)")
    s.add_argument("--ttl", type=float, default=300.0, help="seconds an idle session keeps its KV")
    s.add_argument("--evict-after", type=float, default=2.0,
                   help="seconds idle after which a session may be evicted to make room")
    s.add_argument("--mesh-key-file", type=Path)

    a = sub.add_parser("ask", help="ask a question")
    a.add_argument("prompt")
    a.add_argument("--route", help="stages in order, HOST:PORT,HOST:PORT,...")
    a.add_argument("--max-tokens", type=int, default=256)
    a.add_argument("--temperature", type=float, default=0.0)
    a.add_argument("--top-k", type=int, default=0)
    a.add_argument("--top-p", type=float, default=1.0)
    a.add_argument("--seed", type=int, default=0)
    a.add_argument("--system", help="system message")
    a.add_argument("--raw", action="store_true", help="send the prompt as plain text, without the chat template")
    a.add_argument("--stop", action="append", help="stop string (repeatable)")
    a.add_argument("--wire-dtype", choices=["f32", "f16", "q8_0"], default="f32")
    a.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for a stage before giving up")
    a.add_argument("--mesh-key-file", type=Path)
    return p


COMMANDS = {"serve": serve, "ask": ask}


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=os.environ.get("MESHD_LOG", "WARNING").upper(), format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    try:
        return trio.run(COMMANDS[args.command], args)
    except BaseExceptionGroup as group:
        return report_failure(args.command, first_error(group))
    except BaseException as exc:
        return report_failure(args.command, exc)


def report_failure(command: str, exc: BaseException) -> int:
    """One line for what a user can cause; anything else is a bug and keeps its traceback."""
    if isinstance(exc, KeyboardInterrupt):
        return 130
    if isinstance(exc, (UsageError, RouteError, ModelNotFound, WorkerStartError)):
        message = str(exc)
    elif isinstance(exc, ProtocolError):
        message = f"{exc.code.value}: {exc.message}"
    elif isinstance(exc, trio.TooSlowError):
        message = "timed out waiting for a stage"
    elif isinstance(exc, OSError):
        message = exc.strerror or str(exc)
    else:
        raise exc
    print(f"meshd {command}: {message}", file=sys.stderr)
    return 2 if isinstance(exc, UsageError) else 1


if __name__ == "__main__":
    sys.exit(main())
