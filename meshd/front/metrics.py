"""What the front door counts, in Prometheus' text format (the `prometheus_client` library), kept in a
registry of each front door's own: never the process-wide one, where two front doors (or a test's
many) would count into each other or be refused as duplicates.

Counted as each ask ends (`FrontDoor.ask`): asks by dialect and outcome, prompt and new tokens, time
to the first token, each answer's decode rate, failovers, and what output verification found;
counted as each HTTP response starts: responses by status (refusals included). Read at each scrape
(`Figures`): asks in flight, what the connection caps did, and from the console's snapshot (shared,
so scrapes and viewers together poll the mesh once a second) each model's coverage, the members by
state, and each serving member's stage figures: sessions, KV tokens, tok/s, step time, worker up.
"""

from __future__ import annotations

from collections import Counter as Tally
from collections.abc import Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from meshd.client.ask import AskResult
from meshd.front.connections import Connections

# Seconds to the first token: a short prompt on a warm local mesh takes tens of ms, a long prefill
# across slow links a minute or more.
TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
# One answer's decode tokens a second: from a crawl across continents to a fast single machine.
RATE_BUCKETS = (0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0)
# The stage figures a scrape shows, as the console's snapshot names them, with what each means.
STAGE_FIGURES = {
    "sessions": ("meshd_stage_sessions", "Sessions open on the member's stage"),
    "kv_tokens": ("meshd_stage_kv_tokens", "Tokens of KV the member's stage holds for its sessions"),
    "tok_s": ("meshd_stage_tokens_per_second", "Tokens a second the member's stage decoded since the last reading"),
    "step_ms_p50": ("meshd_stage_step_milliseconds_p50", "Median time of the member's stage's recent steps"),
    "cache_tokens": ("meshd_stage_cache_tokens", "Tokens of KV the member's stage keeps in its prefix cache"),
    "cache_hit_rate": ("meshd_stage_cache_hit_ratio", "Of the prompt tokens looked up in the member's stage's "
                       "prefix cache, the share it held"),
}


class FrontMetrics:
    """What this front door's asks and responses did."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("meshd_requests", "Asks this front door ran, by dialect and outcome (answered, "
                                "counted: a prompt's tokens only, cancelled, or the failure's kind)",
                                ["dialect", "outcome"], registry=self.registry)
        self.prompt_tokens = Counter("meshd_prompt_tokens", "Prompt tokens of the asks", ["dialect"],
                                     registry=self.registry)
        self.cached_tokens = Counter("meshd_cached_prompt_tokens", "Prompt tokens the stages' prefix caches gave, "
                                     "not run again", ["dialect"], registry=self.registry)
        self.completion_tokens = Counter("meshd_completion_tokens", "New tokens of the answers", ["dialect"],
                                         registry=self.registry)
        self.ttft = Histogram("meshd_time_to_first_token_seconds", "Seconds from an ask to its first new token",
                              buckets=TTFT_BUCKETS, registry=self.registry)
        self.decode_rate = Histogram("meshd_decode_tokens_per_second", "An answer's new tokens a second after "
                                     "its first", buckets=RATE_BUCKETS, registry=self.registry)
        self.failovers = Counter("meshd_failovers", "Times an answer moved to a new route", registry=self.registry)
        self.verification = Counter("meshd_verification", "Answers by what output verification found: verified "
                                    "(a replica checked every range), unchecked (a range went unchecked), off (no "
                                    "spot checks ran)", ["outcome"], registry=self.registry)
        self.responses = Counter("meshd_http_responses", "HTTP responses by status code", ["code"],
                                 registry=self.registry)
        self.key_tokens = Counter("meshd_api_key_tokens", "Tokens of each API key's asks (the key's short hash), "
                                  "prompt and completion: every key's usage counts against this member's credit",
                                  ["key", "kind"], registry=self.registry)
        self.key_share = Gauge("meshd_api_key_share", "The share of this member's priority at the stages each API "
                               "key's last ask ranked with: an equal part of what the member earned, less what the "
                               "key's own asks spent (meshd.mesh.credit.key_share)", ["key"], registry=self.registry)

    def asked(self, dialect: str, result: AskResult, outcome: str, key: str = "", share: float | None = None) -> None:
        """Counts one ask that ended with `outcome`, with what it made before it ended; `key` is the API
        key's label (door.key_label) where the front door takes keys, `share` the share of the member's
        priority its voucher gave it."""
        self.requests.labels(dialect, outcome).inc()
        if outcome == "counted":
            # a count of a prompt's tokens (count_tokens): the head tokenized it, nothing ran
            return
        if key and share is not None:
            self.key_share.labels(key).set(share)
        if key:
            self.key_tokens.labels(key, "prompt").inc(len(result.prompt_tokens))
            self.key_tokens.labels(key, "completion").inc(len(result.tokens))
        self.prompt_tokens.labels(dialect).inc(len(result.prompt_tokens))
        self.cached_tokens.labels(dialect).inc(result.cached_tokens)
        self.completion_tokens.labels(dialect).inc(len(result.tokens))
        self.failovers.inc(result.failovers)
        if result.ttft is not None:
            self.ttft.observe(result.ttft)
        if result.decode_rate > 0:
            self.decode_rate.observe(result.decode_rate)
        if outcome == "answered":
            self.verification.labels("verified" if result.verified else "unchecked" if result.checked else "off").inc()


class Figures(Collector):
    """The figures of one scrape: `view` is the console's snapshot (`console.snapshot`)."""

    def __init__(self, view: dict[str, Any], in_flight: int, connections: Connections) -> None:
        self.view = view
        self.in_flight = in_flight
        self.connections = connections

    def collect(self) -> Iterable[Metric]:
        yield GaugeMetricFamily("meshd_requests_in_flight", "Asks this front door runs now", value=self.in_flight)
        yield GaugeMetricFamily("meshd_connections_open", "HTTP connections open now", value=len(self.connections))
        yield CounterMetricFamily("meshd_connections_refused", "Connections closed unread: their source held its "
                                  "share of the connections", value=self.connections.refused)
        yield CounterMetricFamily("meshd_connections_evicted", "Idle connections closed to make room for another",
                                  value=self.connections.evicted)
        yield CounterMetricFamily("meshd_send_timeouts", "Connections ended because the client took nothing sent "
                                  "in time", value=self.connections.send_timeouts)
        members = GaugeMetricFamily("meshd_members", "Members this node knows, by state", labels=["state"])
        for state, count in sorted(Tally(row["state"] for row in self.view["members"]).items()):
            members.add_metric([state], count)
        yield members
        layers = GaugeMetricFamily("meshd_model_layers", "A model's layers", labels=["model", "name"])
        covered = GaugeMetricFamily("meshd_model_covered_layers", "A model's layers live members serve",
                                    labels=["model", "name"])
        for model in self.view["models"]:
            layers.add_metric([model["digest"], model["name"]], model["n_layers"])
            covered.add_metric([model["digest"], model["name"]], model["covered_layers"])
        yield layers
        yield covered
        stages = {key: GaugeMetricFamily(name, text, labels=["node"]) for key, (name, text) in STAGE_FIGURES.items()}
        up = GaugeMetricFamily("meshd_stage_worker_up", "Whether the member's engine worker runs", labels=["node"])
        for row in self.view["members"]:
            figures = row["stage"]
            if figures is None:
                continue
            for key, family in stages.items():
                if figures[key] is not None:
                    family.add_metric([row["node_id"]], figures[key])
            up.add_metric([row["node_id"]], 1.0 if figures["worker_up"] else 0.0)
        yield from stages.values()
        yield up
        credit = GaugeMetricFamily("meshd_member_credit", "A member's credit in this node's ledger (layers x tokens "
                                   "served to members who pay, less what it asked, decayed)", labels=["node"])
        for row in self.view["members"]:
            if row.get("credit") is not None:
                credit.add_metric([row["node_id"]], row["credit"])
        yield credit


def exposition(metrics: FrontMetrics, figures: Figures) -> bytes:
    """The text a scrape gets: the counts, then this scrape's figures (their names never overlap)."""
    return generate_latest(metrics.registry) + generate_latest(figures)
