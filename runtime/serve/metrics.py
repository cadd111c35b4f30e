"""The server's Prometheus metrics, in a registry of its own (no process-global state:
two servers in one process, as in the tests, do not mix their counts)."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# Seconds; from a fast decode step on a GPU (~1 ms) to a slow CPU prefill (~1 min).
LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)  # fmt: skip


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = self._latency("time_to_first_token", "Arrival to first generated token")
        self.itl = self._latency("inter_token_latency", "Time between tokens of a request")
        self.e2e = self._latency("e2e_request_latency", "Arrival to last token")
        self.generation_tokens = Counter(
            "deinfer_generation_tokens", "Tokens generated", registry=r
        )
        self.prompt_tokens = Counter(
            "deinfer_prompt_tokens", "Prompt tokens of finished requests", registry=r
        )
        self.requests = Counter(
            "deinfer_requests",
            "Requests ended, by finish reason (length, stop, abort, error)",
            ["finish_reason"],
            registry=r,
        )
        self.rejected = Counter(
            "deinfer_requests_rejected",
            "Requests refused before they reached the engine, by HTTP status",
            ["status"],
            registry=r,
        )

    def _latency(self, name: str, doc: str) -> Histogram:
        return Histogram(
            f"deinfer_{name}_seconds", doc, buckets=LATENCY_BUCKETS, registry=self.registry
        )

    def watch_load(self, load: Callable[[], object]) -> None:
        """Gauges read at scrape time from ``load()`` (an ``engine_loop.Load``)."""
        for name, doc, attr in (
            ("deinfer_requests_running", "Requests in the running batch", "running"),
            ("deinfer_requests_waiting", "Requests queued for the engine", "waiting"),
            ("deinfer_kv_blocks_used", "KV-cache blocks held by requests", "blocks_used"),
            ("deinfer_kv_blocks_total", "KV-cache blocks in the pool", "blocks_total"),
        ):
            gauge = Gauge(name, doc, registry=self.registry)
            gauge.set_function(lambda attr=attr: getattr(load(), attr))

    def render(self) -> bytes:
        return generate_latest(self.registry)
