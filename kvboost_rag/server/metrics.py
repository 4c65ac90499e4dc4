"""Server metrics in the Prometheus text exposition format (version 0.0.4), without a client library.

The format is a few lines per metric family::

    # HELP kvboost_prompt_tokens_total Prompt tokens of finished requests.
    # TYPE kvboost_prompt_tokens_total counter
    kvboost_prompt_tokens_total 123

>>> h = Histogram((0.1, 1.0))
>>> h.observe(0.5)
>>> print("\\n".join(h.lines("latency_seconds", {})))
latency_seconds_bucket{le="0.1"} 0
latency_seconds_bucket{le="1"} 1
latency_seconds_bucket{le="+Inf"} 1
latency_seconds_sum 0.5
latency_seconds_count 1
"""

from __future__ import annotations

import math
import threading
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
"""Seconds; from a warm first token on a GPU to a long CPU generation."""

Labels = Mapping[str, str]


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _labels(labels: Labels) -> str:
    if not labels:
        return ""
    return "{" + ",".join(f'{k}="{_escape(str(v))}"' for k, v in labels.items()) + "}"


def _number(value: float) -> str:
    if isinstance(value, bool):
        return str(int(value))
    if isinstance(value, int):
        return str(value)
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if math.isnan(value):
        return "NaN"
    return repr(float(value))


def _le(bound: float) -> str:
    return "+Inf" if math.isinf(bound) else _number(int(bound) if float(bound).is_integer() else bound)


class Histogram:
    """Cumulative buckets, a sum and a count, as Prometheus histograms expose them."""

    def __init__(self, buckets: Sequence[float] = LATENCY_BUCKETS) -> None:
        self.bounds = (*sorted(buckets), math.inf)
        self.counts = [0] * len(self.bounds)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        for i, bound in enumerate(self.bounds):
            if value <= bound:
                self.counts[i] += 1
                break
        self.sum += value
        self.count += 1

    def lines(self, name: str, labels: Labels) -> list[str]:
        out, running = [], 0
        for bound, n in zip(self.bounds, self.counts, strict=True):
            running += n
            out.append(f"{name}_bucket{_labels({**labels, 'le': _le(bound)})} {running}")
        out.append(f"{name}_sum{_labels(labels)} {_number(self.sum)}")
        out.append(f"{name}_count{_labels(labels)} {self.count}")
        return out


def family(name: str, kind: str, help_text: str, samples: Iterable[tuple[Labels, float]]) -> list[str]:
    """One metric family: HELP and TYPE lines, then one line per labelled sample."""
    lines = [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
    lines += [f"{name}{_labels(labels)} {_number(value)}" for labels, value in samples]
    return lines


# engine.stats() fields per tier: (metric suffix, type, help). Counters only grow; the rest are levels.
_STORE_FIELDS = {
    "hits": ("hits_total", "counter", "Chunk lookups served by this tier."),
    "misses": ("misses_total", "counter", "Chunk lookups this tier could not serve."),
    "puts": ("puts_total", "counter", "Chunks written to this tier."),
    "evictions": ("evictions_total", "counter", "Chunks evicted from this tier."),
    "entries": ("entries", "gauge", "Chunks held by this tier."),
    "bytes": ("bytes", "gauge", "Bytes held by this tier."),
    "pinned": ("pinned", "gauge", "Pinned (never evicted) chunks in this tier."),
    "hit_rate": ("hit_ratio", "gauge", "Hits over lookups of this tier since the engine started."),
}


class ServerMetrics:
    """Counters, gauges and histograms of one server, rendered as Prometheus text.

    Updated from the event loop and read by scrapes; a lock keeps each update whole.
    """

    def __init__(self, model: str, queue_capacity: int) -> None:
        self.model = model
        self.queue_capacity = queue_capacity
        self._lock = threading.Lock()
        self.requests: defaultdict[tuple[str, str], int] = defaultdict(int)
        self.durations: dict[str, Histogram] = {}
        self.stream_aborts: defaultdict[tuple[str, str], int] = defaultdict(int)
        self.ttft = Histogram()
        self.tokens: defaultdict[str, int] = defaultdict(int)
        self.cached_by_tier: defaultdict[str, int] = defaultdict(int)
        self.finish_reasons: defaultdict[str, int] = defaultdict(int)

    def record_request(self, endpoint: str, status: int, seconds: float) -> None:
        """A finished HTTP exchange (a stream counts when its last byte is sent)."""
        with self._lock:
            self.requests[(endpoint, str(status))] += 1
            self.durations.setdefault(endpoint, Histogram()).observe(seconds)

    def record_stream_abort(self, endpoint: str, reason: str) -> None:
        """A stream that ended before its result: ``timeout``, ``disconnect`` or ``error``."""
        with self._lock:
            self.stream_aborts[(endpoint, reason)] += 1

    def record_result(self, result: Any) -> None:
        """Token accounting and TTFT of one :class:`~kvboost_rag.GenerationResult`."""
        u = result.usage
        with self._lock:
            self.tokens["prompt"] += u.prompt_tokens
            self.tokens["completion"] += u.completion_tokens
            self.tokens["cached"] += u.cached_tokens
            self.tokens["approx"] += u.approx_tokens
            self.tokens["recomputed"] += u.recomputed_tokens
            self.tokens["stored"] += u.stored_tokens
            for tier, n in u.cached_tokens_by_tier.items():
                self.cached_by_tier[tier] += n
            self.finish_reasons[result.finish_reason] += 1
            self.ttft.observe(result.timings.ttft_s)

    def render(self, *, in_flight: int, waiting: int, draining: bool, store: Mapping[str, Any] | None) -> str:
        """The exposition text; ``store`` is ``engine.stats()`` (None leaves the store families out)."""
        with self._lock:
            lines = family(
                "kvboost_model_info",
                "gauge",
                "The served model (value is always 1).",
                [({"model": self.model}, 1)],
            )
            lines += family(
                "kvboost_http_requests_total",
                "counter",
                "Finished HTTP requests by endpoint and status code.",
                [({"endpoint": e, "status": s}, n) for (e, s), n in sorted(self.requests.items())],
            )
            lines += [
                "# HELP kvboost_http_request_duration_seconds Time from request to last byte, by endpoint.",
                "# TYPE kvboost_http_request_duration_seconds histogram",
            ]
            for endpoint, hist in sorted(self.durations.items()):
                lines += hist.lines("kvboost_http_request_duration_seconds", {"endpoint": endpoint})
            lines += family(
                "kvboost_stream_aborts_total",
                "counter",
                "Streams that ended before their result (timeout, disconnect, error).",
                [({"endpoint": e, "reason": r}, n) for (e, r), n in sorted(self.stream_aborts.items())],
            )
            lines += family(
                "kvboost_requests_in_flight",
                "gauge",
                "Admitted generation requests, waiting or running.",
                [({}, in_flight)],
            )
            lines += family(
                "kvboost_queue_depth",
                "gauge",
                "Admitted generation requests that have not started generating yet.",
                [({}, waiting)],
            )
            lines += family(
                "kvboost_queue_capacity",
                "gauge",
                "Most generation requests admitted at once; more are answered 429.",
                [({}, self.queue_capacity)],
            )
            lines += family(
                "kvboost_draining",
                "gauge",
                "1 while the server shuts down and admits nothing.",
                [({}, int(draining))],
            )
            for kind, help_text in (
                ("prompt", "Prompt tokens of finished requests."),
                ("completion", "Generated tokens of finished requests."),
                ("cached", "Prompt tokens read exactly from the KV store, all tiers."),
                ("approx", "Prompt tokens reused approximately (blend mode)."),
                ("recomputed", "Prompt tokens run through the model."),
                ("stored", "Prompt tokens newly written to the KV store."),
            ):
                lines += family(
                    f"kvboost_{kind}_tokens_total", "counter", help_text, [({}, self.tokens[kind])]
                )
            lines += family(
                "kvboost_cached_tokens_by_tier_total",
                "counter",
                "Prompt tokens read exactly from each store tier.",
                [({"tier": t}, n) for t, n in sorted(self.cached_by_tier.items())],
            )
            lines += family(
                "kvboost_finished_generations_total",
                "counter",
                "Generations by finish reason.",
                [({"reason": r}, n) for r, n in sorted(self.finish_reasons.items())],
            )
            lines += [
                (
                    "# HELP kvboost_ttft_seconds Time to first token, measured by the engine from the call "
                    "(queueing, tokenization, lookup, loading and prefill included)."
                ),
                "# TYPE kvboost_ttft_seconds histogram",
                *self.ttft.lines("kvboost_ttft_seconds", {}),
            ]
        if store is not None:
            lines += _store_lines(store)
        return "\n".join(lines) + "\n"


def _store_lines(stats: Mapping[str, Any]) -> list[str]:
    tiers = {name: s for name, s in stats.items() if isinstance(s, Mapping)}
    lines: list[str] = []
    for field, (suffix, kind, help_text) in _STORE_FIELDS.items():
        samples = [({"tier": t}, s[field]) for t, s in tiers.items() if isinstance(s.get(field), int | float)]
        lines += family(f"kvboost_store_{suffix}", kind, help_text, samples)
    extra = [
        ({"tier": t, "event": k}, v)
        for t, s in tiers.items()
        for k, v in sorted((s.get("extra") or {}).items())
    ]
    lines += family(
        "kvboost_store_events_total", "counter", "Other store events per tier (e.g. corrupt entries).", extra
    )
    if isinstance(stats.get("documents"), int):
        lines += family(
            "kvboost_store_documents",
            "gauge",
            "Registered (pre-warmed) documents.",
            [({}, stats["documents"])],
        )
    return lines
