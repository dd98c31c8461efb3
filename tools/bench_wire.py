"""Benchmark the peer wire against bare trio-websocket and raw TCP, in one run.

Round-trip latency of one decode-size activation (f32, hidden 576 and 8192)
through the whole stack (envelope, codec, mux, Noise, WebSocket on loopback),
and the throughput of a 64 MiB prefill activation; each next to a bare
trio-websocket echo and a raw TCP echo of the same bytes, with ratios. The
bare trio-websocket runs twice: as shipped, and with the faster WebSocket
masking that our links install (meshd.net.wsmask), so the stack's own overhead
shows apart from that gain.

The full-stack echo server decodes every activation (validation, CRC, numpy
view) and answers with a fresh activation built from the received array, as
a stage would. The bare WebSocket and TCP servers echo the encoded bytes.
Client and servers share one trio loop unless ``--processes`` puts the servers
in a child process.

    python tools/bench_wire.py [--rounds 3000] [--json out.json] [--processes]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import multiprocessing
import os
import statistics
import struct
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import trio
from benchlib.result import parser, publish
from trio_websocket import WebSocketRequest, WebSocketServer, open_websocket_url, serve_websocket

from meshd.net.peers import PeersConfig, open_peers
from meshd.net.stream import Stream
from meshd.net.transport import WS_RECEIVE_BUFFER
from meshd.net.wsmask import stock_masking
from wire.identity import NodeIdentity
from wire.message import Message
from wire.mux_config import MuxConfig
from wire.tensors import Activation, encode_activation, tensor_fields

PREFILL_SHAPE = (16384, 1024)  # 64 MiB of f32
# A peer may make a node hold only so much of unfinished messages (32 MiB by
# default); the 64 MiB prefill needs a budget that admits it, as a stage of a
# model that large would be given.
PEERS = PeersConfig(mux=MuxConfig(max_held=96 << 20), max_held_bytes=96 << 20)
BARE_WS_MAX_MESSAGE = 256 << 20
_LEN = struct.Struct(">I")
_BULK = 1 << 20  # echo servers answer messages this large with a small ack
STOCK_PATH = "/stock"
SETUPS = {"stack": "stack", "ws": "trio-websocket", "ws_word": "ws+word masker", "tcp": "raw tcp"}


def activation(array: np.ndarray, step: int) -> bytes:
    """An encoded activation, built the way a stage sends one (no model)."""
    return encode_activation(
        session="bench",
        epoch=0,
        step=step,
        pos=step,
        n_tokens=array.shape[0],
        tensors=[tensor_fields("hidden_states", array)],
    )


def as_activation(message: Message) -> Activation:
    assert isinstance(message, Activation), f"unexpected {message.type}"
    return message


# ----- servers


async def serve_stage(stream: Stream) -> None:
    # A receive loop like the stage service's own (meshd.stage.service), not the
    # async generator ``stream.messages()``, which costs a few µs a message.
    while True:
        try:
            received = as_activation(await stream.receive_message())
        except trio.EndOfChannel:
            return
        array = received.array()
        if array.shape[0] > 1:
            # Prefill: acknowledge with a one-token activation of the last row.
            array = array[-1:]
        await stream.send_all(activation(array, received.step))


async def serve_ws(request: WebSocketRequest) -> None:
    ws = await request.accept()
    masking = stock_masking() if request.path == STOCK_PATH else contextlib.nullcontext()
    try:
        with masking:
            while True:
                message = await ws.get_message()
                await ws.send_message(message if len(message) < _BULK else b"k")
    except Exception:
        return


async def serve_tcp(stream: trio.SocketStream) -> None:
    buffer = bytearray()
    try:
        while True:
            while len(buffer) < 4 or len(buffer) < 4 + _LEN.unpack_from(buffer)[0]:
                chunk = await stream.receive_some()
                if not chunk:
                    return
                buffer += chunk
            length = 4 + _LEN.unpack_from(buffer)[0]
            message = bytes(buffer[:length])
            del buffer[:length]
            await stream.send_all(message if length < _BULK else _LEN.pack(1) + b"k")
    except trio.BrokenResourceError:
        return


async def _run_peers_server(identity: NodeIdentity, task_status: trio.TaskStatus[int]) -> None:
    async with open_peers(identity, PEERS) as peers:
        peers.handle("stage", serve_stage)
        task_status.started(await peers.listen("127.0.0.1", 0))
        await trio.sleep_forever()


async def _run_ws_server(task_status: trio.TaskStatus[WebSocketServer]) -> None:
    await serve_websocket(
        serve_ws,
        "127.0.0.1",
        0,
        None,
        max_message_size=BARE_WS_MAX_MESSAGE,
        receive_buffer_size=WS_RECEIVE_BUFFER,
        task_status=task_status,
    )


async def start_servers(nursery: trio.Nursery, identity: NodeIdentity) -> dict[str, int]:
    stack_port: int = await nursery.start(_run_peers_server, identity)
    ws_server: WebSocketServer = await nursery.start(_run_ws_server)
    listeners = await nursery.start(
        functools.partial(trio.serve_tcp, serve_tcp, 0, host="127.0.0.1")
    )
    return {"stack": stack_port, "ws": ws_server.port, "tcp": listeners[0].socket.getsockname()[1]}


def _server_process(identity_bytes: bytes, ports: Any) -> None:
    async def main() -> None:
        async with trio.open_nursery() as nursery:
            ports.put(await start_servers(nursery, NodeIdentity.from_private_bytes(identity_bytes)))

    trio.run(main)


# ----- clients


def _summary(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {
        "median_us": statistics.median(ordered) * 1e6,
        "p99_us": ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))] * 1e6,
    }


async def _timed(rounds: int, warmup: int, once: Callable[[int], Awaitable[None]]) -> list[float]:
    for step in range(warmup):
        await once(step)
    samples = []
    clock = time.perf_counter
    for step in range(rounds):
        start = clock()
        await once(step)
        samples.append(clock() - start)
    return samples


async def bench_stack(
    port: int, node_id: str, data: np.ndarray, rounds: int, warmup: int
) -> list[float]:
    async with open_peers(NodeIdentity.generate(), PEERS) as peers:
        stream = await peers.open_stream(f"127.0.0.1:{port}", "stage", node_id=node_id)
        expected_rows = 1 if data.shape[0] > 1 else data.shape[0]

        async def once(step: int) -> None:
            await stream.send_all(activation(data, step))
            reply = as_activation(await stream.receive_message())
            assert reply.step == step and reply.n_tokens == expected_rows

        samples = await _timed(rounds, warmup, once)
        await stream.send_all(activation(data, 0))
        echoed = as_activation(await stream.receive_message()).array()
        assert np.array_equal(echoed, data[-expected_rows:]), "f32 must cross bit exact"
        await stream.aclose()
    return samples


async def bench_ws(
    port: int, payload: bytes, rounds: int, warmup: int, stock: bool = True
) -> list[float]:
    """Bare trio-websocket; ``stock``: with wsproto's own masking, as shipped,
    else with the word masker our links install (meshd.net.wsmask)."""
    path = STOCK_PATH if stock else "/"
    with stock_masking() if stock else contextlib.nullcontext():
        async with open_websocket_url(
            f"ws://127.0.0.1:{port}{path}",
            max_message_size=BARE_WS_MAX_MESSAGE,
            receive_buffer_size=WS_RECEIVE_BUFFER,
        ) as ws:

            async def once(step: int) -> None:
                await ws.send_message(payload)
                await ws.get_message()

            return await _timed(rounds, warmup, once)


async def bench_tcp(port: int, payload: bytes, rounds: int, warmup: int) -> list[float]:
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    framed = _LEN.pack(len(payload)) + payload
    reply_size = len(framed) if len(framed) < _BULK else 5

    async def once(step: int) -> None:
        await stream.send_all(framed)
        received = 0
        while received < reply_size:
            received += len(await stream.receive_some())

    try:
        return await _timed(rounds, warmup, once)
    finally:
        await stream.aclose()


async def compare(
    ports: dict[str, int], node_id: str, data: np.ndarray, rounds: int, warmup: int, passes: int
) -> dict[str, Any]:
    """The same activation through the stack, and its encoded bytes through bare ws and tcp.

    The rounds are split over ``passes``, each running every setup in turn in
    a rotated order, so drift of a shared machine hits all setups alike.
    """
    payload = activation(data, 0)[4:]
    runs: dict[str, Callable[[int], Awaitable[list[float]]]] = {
        "stack": lambda n: bench_stack(ports["stack"], node_id, data, n, warmup),
        "ws": lambda n: bench_ws(ports["ws"], payload, n, warmup),
        "ws_word": lambda n: bench_ws(ports["ws"], payload, n, warmup, stock=False),
        "tcp": lambda n: bench_tcp(ports["tcp"], payload, n, warmup),
    }
    samples: dict[str, list[float]] = {name: [] for name in runs}
    names = list(runs)
    per_pass = max(1, rounds // passes)
    for index in range(passes):
        for name in names[index % len(names) :] + names[: index % len(names)]:
            samples[name] += await runs[name](per_pass)
    return {"message_bytes": len(payload) + 4, **samples}


async def run(args: argparse.Namespace) -> dict[str, Any]:
    server_identity = NodeIdentity.generate()
    results: dict[str, Any] = {"latency": {}, "throughput": {}}
    async with trio.open_nursery() as nursery:
        if args.processes:
            context = multiprocessing.get_context("spawn")
            queue = context.Queue()
            process = context.Process(
                target=_server_process, args=(server_identity.private_bytes(), queue), daemon=True
            )
            process.start()
            ports = await trio.to_thread.run_sync(queue.get)
        else:
            ports = await start_servers(nursery, server_identity)
        node_id = server_identity.node_id
        rng = np.random.default_rng(1)
        for hidden in args.hidden:
            data = rng.standard_normal((1, hidden), dtype=np.float32)
            row = await compare(ports, node_id, data, args.rounds, args.warmup, args.passes)
            results["latency"][hidden] = {
                "message_bytes": row["message_bytes"],
                **{name: _summary(row[name]) for name in SETUPS},
            }
        prefill = rng.standard_normal(PREFILL_SHAPE, dtype=np.float32)
        bulk = await compare(ports, node_id, prefill, args.bulk_rounds, 1, args.bulk_rounds)
        results["throughput"] = {"message_bytes": bulk["message_bytes"]}
        for name in SETUPS:
            seconds = statistics.median(bulk[name])
            results["throughput"][name] = {
                "seconds": seconds,
                "MiB_per_s": bulk["message_bytes"] / seconds / (1 << 20),
            }
        if args.processes:
            process.kill()
        nursery.cancel_scope.cancel()
    return results


def render(results: dict[str, Any]) -> str:
    setup = results["setup"]
    lines = [
        f"python {setup['python']}, {setup['cpus']} cpus, load average {setup['load']:.2f}, "
        f"servers {'in a child process' if setup['processes'] else 'in the same process'}",
        "",
        "round trip of one activation (f32), loopback; median / p99 in microseconds",
        f"{'hidden':>6} {'bytes':>7} | "
        + " | ".join(f"{label:>17}" for label in SETUPS.values())
        + " | stack/ws stack/ws+word stack/tcp",
    ]
    for hidden, row in results["latency"].items():
        cells = " | ".join(
            f"{row[name]['median_us']:8.1f} / {row[name]['p99_us']:6.1f}" for name in SETUPS
        )
        stack = row["stack"]["median_us"]
        lines.append(
            f"{hidden:>6} {row['message_bytes']:>7} | {cells} | "
            f"{stack / row['ws']['median_us']:8.2f} {stack / row['ws_word']['median_us']:13.2f} "
            f"{stack / row['tcp']['median_us']:9.2f}"
        )
    bulk = results["throughput"]
    lines += [
        "",
        f"prefill activation of {bulk['message_bytes'] / (1 << 20):.1f} MiB, "
        "one way + small reply; median",
        f"{'':>17} {'seconds':>8} {'MiB/s':>8} {'stack time / this':>18}",
    ]
    for name, label in SETUPS.items():
        lines.append(
            f"{label:>17} {bulk[name]['seconds']:8.3f} {bulk[name]['MiB_per_s']:8.1f} "
            f"{bulk['stack']['seconds'] / bulk[name]['seconds']:18.2f}"
        )
    lines += [
        "",
        "trio-websocket: as shipped (wsproto's masking); ws+word masker: with the masker",
        "our links install (meshd.net.wsmask). Target: stack within 1.5x of trio-websocket.",
    ]
    return "\n".join(lines)


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--rounds", type=int, default=3000)
    ap.add_argument("--warmup", type=int, default=100, help="untimed rounds per pass")
    ap.add_argument("--passes", type=int, default=5, help="rounds are split over this many passes")
    ap.add_argument("--bulk-rounds", type=int, default=5)
    ap.add_argument("--hidden", type=int, nargs="+", default=[576, 8192])
    ap.add_argument(
        "--processes", action="store_true", help="run the echo servers in a child process"
    )
    args = ap.parse_args()
    if args.smoke:  # the smallest run through every stack
        args.rounds, args.warmup, args.passes, args.bulk_rounds, args.hidden = 20, 2, 1, 1, [576]
    load = os.getloadavg()[0]
    results = trio.run(run, args)
    results["setup"] = {
        "rounds": args.rounds,
        "processes": args.processes,
        "cpus": os.cpu_count(),
        "load": load,
        "python": sys.version.split()[0],
    }
    publish("wire", args, results, render(results))


if __name__ == "__main__":
    main()
