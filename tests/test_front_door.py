"""The front door under attack and under watch: connection caps, the send timeout, the keyless API's
Host/Origin/content-type rules, /health and /metrics, all over real loopback sockets (Hypercorn
in process, or a real `meshd join --api` daemon where its fds are counted)."""

from __future__ import annotations

import os
import resource
import socket
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import anthropic
import httpx2
import openai
import pytest
import trio
import trio.testing
from api_fakes import NAME, FakeMesh, coverage
from localmesh import start_join, stop_all
from prometheus_client.parser import text_string_to_metric_families

from meshd.front.app import build_app
from meshd.front.connections import MAX_CONNECTIONS, SEND_SECONDS, Connections
from meshd.front.door import FrontDoor
from meshd.front.http import MAX_BODY_BYTES
from meshd.front.server import serve_front

USER = [{"role": "user", "content": "hi"}]
KEY = "front-door-key-5e2a"

# The attack: idle connections from many loopback source addresses, against a real daemon.
ATTACK_SOURCES = [f"127.0.0.{i}" for i in range(2, 22)]
ATTACK_CONNECTIONS = 2000
# Connects in flight at once: enough to be over in a second or two, few enough not to overrun the listen backlog.
CONNECTS_AT_ONCE = 64
# What the keyed client may wait while the attack holds its connections.
SERVED_WITHIN = 1.0
# fds the daemon may open beside the capped connections while attacked (its log, a link to a peer)
FD_SLACK = 32
# The attack's sockets and the test's own (pytest, the daemon's pipes) need this many fds in the test process.
FDS_NEEDED = ATTACK_CONNECTIONS + 512


def parse(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """A scrape by Prometheus' own text parser: each sample's labels and value, by sample name."""
    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append((sample.labels, sample.value))
    return samples


def value(samples: dict[str, list[tuple[dict[str, str], float]]], sample: str, **labels: str) -> float:
    """The sum of `sample` over the series carrying `labels`."""
    return sum(v for got, v in samples.get(sample, []) if labels.items() <= got.items())


@asynccontextmanager
async def served(front: FrontDoor) -> AsyncIterator[str]:
    """`front` served by Hypercorn on a loopback port of its own, its URL with Host localhost."""
    async with trio.open_nursery() as nursery:
        url = await nursery.start(serve_front, build_app(front), "127.0.0.1", 0, front.connections)
        yield url.replace("127.0.0.1", "localhost")
        nursery.cancel_scope.cancel()


# ----- the caps, as the book keeps them


def test_a_full_front_door_closes_an_idle_connection_of_the_source_holding_most() -> None:
    closed: list[tuple[str, int]] = []
    book = Connections(limit=4, per_source=3)

    def admit(host: str, port: int) -> bool:
        return book.admit((host, port), lambda: closed.append((host, port))) is not None

    def busy(*peers: tuple[str, int]) -> None:
        for peer in peers:
            connection = book.find(peer)
            assert connection is not None
            connection.busy = 1

    assert admit("10.0.0.1", 1) and admit("10.0.0.2", 1) and admit("10.0.0.2", 2) and admit("10.0.0.2", 3)
    # full: the lone client keeps its connection, the source holding three gives up its oldest
    assert admit("10.0.0.3", 1) and closed == [("10.0.0.2", 1)] and len(book) == 4
    # the crowd's newcomer is refused; a source holding fewer takes the place of the crowd's oldest
    assert not admit("10.0.0.2", 4) and book.refused == 1
    assert admit("10.0.0.1", 2) and closed[-1] == ("10.0.0.2", 2)
    assert not admit("10.0.0.1", 3) and book.refused == 2
    # a busy connection (a request running) is never closed: the next source holding more gives one up
    busy(("10.0.0.1", 1), ("10.0.0.1", 2))
    assert admit("10.0.0.4", 1) and closed[-1] == ("10.0.0.2", 3) and book.evicted == 3
    busy(("10.0.0.3", 1), ("10.0.0.4", 1))
    assert not admit("10.0.0.5", 1) and book.refused == 3 and len(book) == 4
    # a source at its own cap is refused even with room in all
    book = Connections(limit=100, per_source=2)
    assert admit("10.0.0.5", 1) and admit("10.0.0.5", 2) and not admit("10.0.0.5", 3)


def test_an_ipv6_source_is_its_64() -> None:
    book = Connections(limit=100, per_source=2)
    admitted = [book.admit((f"2001:db8::{i + 1}", 1), lambda: None) is not None for i in range(3)]
    assert admitted == [True, True, False]  # three addresses of one /64: one source
    assert book.admit(("2001:db8:0:1::1", 1), lambda: None) is not None  # the next /64 is another


# ----- the attack on a real daemon


def raise_fd_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < FDS_NEEDED:
        if hard < FDS_NEEDED:
            pytest.skip(f"the attack needs {FDS_NEEDED} fds; the hard limit (ulimit -Hn) is {hard}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (FDS_NEEDED, hard))


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


async def idle_connection(source: str, port: int, half_a_head: bool, held: list[trio.socket.SocketType]) -> None:
    sock = trio.socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    held.append(sock)
    await sock.bind((source, 0))
    await sock.connect(("127.0.0.1", port))
    if half_a_head:
        # a request head that never ends (slowloris): still idle, no request runs
        await sock.send(b"GET /v1/models HTTP/1.1\r\nhost: localhost\r\n")


@pytest.mark.slow
async def test_two_thousand_idle_connections_leave_a_keyed_client_served_and_the_fds_bounded(
        tmp_path: Path) -> None:
    raise_fd_limit()
    (tmp_path / "keys").write_text(KEY + "\n")
    daemon = start_join("--no-model", "--state-dir", str(tmp_path / "state"), "--api", "127.0.0.1:0",
                        "--api-key-file", str(tmp_path / "keys"))
    held: list[trio.socket.SocketType] = []
    try:
        url = next(line.split()[4] for line in daemon.lines if line.startswith("meshd: HTTP API on "))
        port = int(url.rsplit(":", 1)[1])
        async with httpx2.AsyncClient(base_url=url, headers={"authorization": f"Bearer {KEY}"}) as client:
            assert (await client.get("/v1/models")).status_code == 200
            before = open_fds(daemon.proc.pid)
            limiter = trio.CapacityLimiter(CONNECTS_AT_ONCE)

            async def attack(i: int) -> None:
                async with limiter:
                    await idle_connection(ATTACK_SOURCES[i % len(ATTACK_SOURCES)], port, i % 2 == 0, held)

            attack_started = time.monotonic()
            with trio.fail_after(20):
                async with trio.open_nursery() as nursery:
                    for i in range(ATTACK_CONNECTIONS):
                        nursery.start_soon(attack, i)
            took = time.monotonic() - attack_started
            # every attacking socket is still open here: the keyed client comes on a new connection while
            # they are held, queued behind them all (the kernel hands connections over in order)
            async with httpx2.AsyncClient(base_url=url, headers={"authorization": f"Bearer {KEY}"}) as newcomer:
                start = time.monotonic()
                answer = await newcomer.get("/v1/models", timeout=10)
                waited = time.monotonic() - start
                fds = open_fds(daemon.proc.pid)
                scrape = parse((await newcomer.get("/metrics")).text)
    finally:
        for sock in held:
            sock.close()
        stop_all([daemon])
    assert answer.status_code == 200 and waited < SERVED_WITHIN, (answer.status_code, waited)
    bound = before + MAX_CONNECTIONS + FD_SLACK
    assert fds <= bound, f"the daemon held {fds} fds under attack (bound {bound}: {before} before, cap {MAX_CONNECTIONS})"
    # the cap did the work: idle connections were closed to make room, and none is left over the cap
    # the caps did the work: each attacking connection beyond the cap was refused or took an idle one's place
    turned_away = value(scrape, "meshd_connections_refused_total") + value(scrape, "meshd_connections_evicted_total")
    assert turned_away >= ATTACK_CONNECTIONS - MAX_CONNECTIONS, (turned_away, took)
    assert value(scrape, "meshd_connections_open") <= MAX_CONNECTIONS


# ----- a client that stops reading


async def test_a_client_that_stops_reading_is_cut_after_the_send_timeout(mock_clock: trio.testing.MockClock) -> None:
    # the clock jumps only once the loop has been idle a while in real time: loopback I/O lands first
    mock_clock.autojump_threshold = 0.05
    # twice what the server's send buffer can grow to, in 1 KiB tokens: more than the kernel holds for the client
    most_buffered = int(Path("/proc/sys/net/ipv4/tcp_wmem").read_text().split()[2])
    mesh = FakeMesh(pieces=[b"x" * 1024] * (2 * most_buffered // 1024))
    front = FrontDoor(mesh)
    async with served(front) as url:
        port = int(url.rsplit(":", 1)[1])
        # closed however the test ends: a server send that never gives up would wait on it forever
        with trio.socket.socket() as sock:
            # a small receive window, so the kernel stops taking the answer for the client early
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            await sock.connect(("127.0.0.1", port))
            body = b'{"messages": [{"role": "user", "content": "hi"}], "stream": true, "max_tokens": 100000}'
            await sock.send(b"POST /v1/chat/completions HTTP/1.1\r\nhost: localhost\r\n"
                            b"content-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
            await mesh.started.wait()
            start = trio.current_time()
            with trio.fail_after(SEND_SECONDS * 3):
                while mesh.cancelled == 0 or front.asking or len(front.connections):
                    await trio.sleep(1)
    # the ask was cancelled and the connection closed once a send had waited SEND_SECONDS, not before
    assert front.connections.send_timeouts == 1 and mesh.cancelled == 1
    assert SEND_SECONDS <= trio.current_time() - start <= SEND_SECONDS + 2


# ----- the keyless API: this machine's own Host, its own Origin, JSON bodies


async def test_a_keyless_api_refuses_a_foreign_host_a_cross_site_origin_and_a_body_not_json() -> None:
    mesh = FakeMesh()
    front = FrontDoor(mesh)
    async with served(front) as url:
        port = url.rsplit(":", 1)[1]
        local = f"localhost:{port}"
        chat = {"messages": USER}
        async with httpx2.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
            # DNS rebinding: a name of the attacker's pointing at 127.0.0.1
            rebound = await client.get("/v1/models", headers={"host": f"evil.example:{port}"})
            rebound_page = await client.get("/", headers={"host": "evil.example"})
            rebound_claude = await client.post("/v1/messages", json={"max_tokens": 5, "messages": USER},
                                               headers={"host": "evil.example"})
            rebound_count = await client.post("/v1/messages/count_tokens", json={"messages": USER},
                                              headers={"host": "evil.example"})
            # a cross-site request carrying the right Host (a form or fetch from another site)
            cross = await client.post("/v1/chat/completions", json=chat,
                                      headers={"host": local, "origin": "https://evil.example"})
            sandboxed = await client.post("/v1/chat/completions", json=chat, headers={"host": local, "origin": "null"})
            other_port = await client.post("/v1/chat/completions", json=chat,
                                           headers={"host": local, "origin": "http://localhost:1"})
            form = await client.post("/v1/chat/completions", content=b'{"messages": []}',
                                     headers={"host": local, "content-type": "text/plain"})
            # the API's own page and this machine's programs
            same_origin = await client.post("/v1/chat/completions", json=chat,
                                            headers={"host": local, "origin": f"http://{local}"})
            by_address = await client.get("/console/state")
            by_ipv6_name = await client.get("/v1/models", headers={"host": f"[::1]:{port}"})
        answer = await openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) \
            .chat.completions.create(model=NAME, messages=USER)
        with pytest.raises(anthropic.PermissionDeniedError) as claude_refused:
            await anthropic.AsyncAnthropic(base_url=url, api_key="unused", max_retries=0,
                                           default_headers={"origin": "https://evil.example"}) \
                .messages.create(model=NAME, max_tokens=5, messages=USER)
    for refused in (rebound, rebound_page, cross, sandboxed, other_port):
        assert refused.status_code == 403 and refused.json()["error"]["type"] == "permission_error", refused.text
    for claude_refused_too in (rebound_claude, rebound_count):
        assert claude_refused_too.status_code == 403 and claude_refused_too.json()["type"] == "error"
    assert "evil.example" in rebound.json()["error"]["message"] and "no key" in rebound.json()["error"]["message"]
    assert "needs an API key" in cross.json()["error"]["message"]
    assert form.status_code == 415 and "Content-Type: application/json" in form.json()["error"]["message"]
    assert claude_refused.value.status_code == 403 and "needs an API key" in claude_refused.value.message
    assert same_origin.status_code == 200 and by_address.status_code == 200 and by_ipv6_name.status_code == 200
    assert answer.choices[0].message.content == "Hello world"
    # no refused request reached the mesh
    assert len(mesh.asked) == 2


async def test_a_keyed_api_answers_any_host_and_origin_that_carries_the_key() -> None:
    front = FrontDoor(FakeMesh(), [KEY])
    async with served(front) as url, httpx2.AsyncClient(base_url=url) as client:
        keyed = await client.get("/v1/models", headers={"host": "api.example", "origin": "https://app.example",
                                                        "authorization": f"Bearer {KEY}"})
        keyless = await client.get("/v1/models", headers={"host": "api.example"})
        keyless_count = await client.post("/v1/messages/count_tokens", json={"messages": USER})
        # the body bound holds on the new endpoint too, before anything reaches the mesh
        huge = await client.post("/v1/messages/count_tokens", content=b" " * (MAX_BODY_BYTES + 1),
                                 headers={"authorization": f"Bearer {KEY}", "content-type": "application/json"})
    assert keyed.status_code == 200 and keyless.status_code == 401
    assert keyless_count.status_code == 401 and keyless_count.json()["error"]["type"] == "authentication_error"
    assert huge.status_code == 413 and huge.json()["error"]["type"] == "request_too_large"


# ----- /health, /metrics, and paths that are not there


async def test_health_metrics_and_a_plain_404() -> None:
    mesh = FakeMesh(models=[coverage(covered=12, reason="needs 3.0 GiB more memory than the members offer")])
    front = FrontDoor(mesh)
    async with served(front) as url, httpx2.AsyncClient(base_url=url) as client:
        uncovered = await client.get("/health")
        mesh.models = [coverage()]
        healthy = await client.get("/health")
        missing = await client.get("/v1/nothing")
        unlisted = await client.post("/no/such/path", json={})
        await openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) \
            .chat.completions.create(model=NAME, messages=USER)
        stream = await openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) \
            .chat.completions.create(model=NAME, messages=USER, stream=True)
        assert "".join([chunk.choices[0].delta.content or "" async for chunk in stream if chunk.choices])
        await anthropic.AsyncAnthropic(base_url=url, api_key="unused", max_retries=0) \
            .messages.create(model=NAME, max_tokens=2, messages=USER)
        # a count is an ask of the prompt's tokens only: counted as such, its tokens as nobody's work
        await anthropic.AsyncAnthropic(base_url=url, api_key="unused", max_retries=0) \
            .messages.count_tokens(model=NAME, messages=USER)
        with pytest.raises(openai.NotFoundError):
            await openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) \
                .chat.completions.create(model="no such model", messages=USER)
        scraped = await client.get("/metrics")
    assert uncovered.status_code == 503 and uncovered.json() == {
        "status": "unavailable", "reason": f"{NAME}: needs 3.0 GiB more memory than the members offer"}
    assert healthy.status_code == 200 and healthy.json() == {"status": "ok"}
    for absent in (missing, unlisted):
        assert absent.status_code == 404 and absent.json()["error"]["code"] is None, absent.text
        assert absent.json()["error"]["type"] == "not_found_error"
    assert scraped.status_code == 200 and scraped.headers["content-type"].startswith("text/plain; version=")
    samples = parse(scraped.text)
    assert value(samples, "meshd_requests_total", dialect="openai", outcome="answered") == 2
    assert value(samples, "meshd_requests_total", dialect="anthropic", outcome="answered") == 1
    assert value(samples, "meshd_requests_total", dialect="anthropic", outcome="counted") == 1
    assert value(samples, "meshd_completion_tokens_total", dialect="openai") == 8
    assert value(samples, "meshd_completion_tokens_total", dialect="anthropic") == 2
    assert value(samples, "meshd_prompt_tokens_total") == 15
    assert value(samples, "meshd_time_to_first_token_seconds_count") == 3
    assert value(samples, "meshd_decode_tokens_per_second_count") == 3
    assert value(samples, "meshd_verification_total", outcome="verified") == 3
    assert value(samples, "meshd_failovers_total") == 0
    assert value(samples, "meshd_requests_in_flight") == 0
    assert value(samples, "meshd_http_responses_total", code="404") == 3  # two paths and the model
    assert value(samples, "meshd_http_responses_total", code="503") == 1
    assert value(samples, "meshd_model_covered_layers", name=NAME) == 30
    assert value(samples, "meshd_connections_open") >= 1  # this scrape's own


async def test_metrics_need_the_key_and_health_does_not() -> None:
    front = FrontDoor(FakeMesh(), [KEY])
    async with served(front) as url, httpx2.AsyncClient(base_url=url) as client:
        refused = await client.get("/metrics")
        health = await client.get("/health")
        scraped = await client.get("/metrics", headers={"authorization": f"Bearer {KEY}"})
    assert refused.status_code == 401 and health.status_code == 200 and scraped.status_code == 200
    assert "meshd_requests_in_flight" in parse(scraped.text)
