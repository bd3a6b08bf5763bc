"""Prometheus metrics in the text exposition format (version 0.0.4), kept by hand: a few counters and
histograms need no client library.

    lmforge_requests_total{route,status}            requests answered, by route and HTTP status
    lmforge_request_duration_seconds{route}          histogram: request start to last byte sent
    lmforge_time_to_first_token_seconds{route}       histogram: request start to first generated text
    lmforge_prompt_tokens_total, lmforge_completion_tokens_total
    lmforge_engine_running, lmforge_engine_waiting   requests decoding now / queued for a row
    lmforge_engine_decode_steps_total, lmforge_engine_decoded_rows_total (mean batch = rows / steps)
    lmforge_prefix_cache_hit_tokens_total, lmforge_prefix_cache_miss_tokens_total   prompt tokens
                                                     read from the prefix cache / computed
"""

from __future__ import annotations

import bisect
import threading
import time
from collections import defaultdict

BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class Histogram:
    def __init__(self):
        self.counts = [0] * (len(BUCKETS) + 1)  # the last bucket is +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(BUCKETS, value)] += 1
        self.sum += value

    def lines(self, name: str, labels: str) -> list[str]:
        out, total = [], 0
        for bound, count in zip((*map(_number, BUCKETS), "+Inf"), self.counts):
            total += count
            out.append(f'{name}_bucket{{{labels}{"," if labels else ""}le="{bound}"}} {total}')
        suffix = f"{{{labels}}}" if labels else ""
        return out + [f"{name}_sum{suffix} {self.sum!r}", f"{name}_count{suffix} {total}"]


def _number(x: float) -> str:
    return repr(float(x))


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class Metrics:
    def __init__(self):
        self._lock = threading.Lock()
        self.requests: dict[tuple[str, int], int] = defaultdict(int)
        self.duration: dict[str, Histogram] = defaultdict(Histogram)
        self.ttft: dict[str, Histogram] = defaultdict(Histogram)
        self.prompt_tokens = 0
        self.completion_tokens = 0

    def request_done(self, route: str, status: int, seconds: float) -> None:
        with self._lock:
            self.requests[route, status] += 1
            self.duration[route].observe(seconds)

    def first_token(self, route: str, seconds: float) -> None:
        with self._lock:
            self.ttft[route].observe(seconds)

    def tokens(self, prompt: int, completion: int) -> None:
        with self._lock:
            self.prompt_tokens += prompt
            self.completion_tokens += completion

    def render(self, engine=None) -> str:
        with self._lock:
            lines = [
                "# HELP lmforge_requests_total HTTP requests answered, by route and status.",
                "# TYPE lmforge_requests_total counter",
            ]
            for (route, status), n in sorted(self.requests.items()):
                lines.append(
                    f'lmforge_requests_total{{route="{_escape(route)}",status="{status}"}} {n}'
                )
            for name, what, hists in (
                (
                    "lmforge_request_duration_seconds",
                    "Request start to last byte sent.",
                    self.duration,
                ),
                (
                    "lmforge_time_to_first_token_seconds",
                    "Request start to the first generated text.",
                    self.ttft,
                ),
            ):
                lines += [f"# HELP {name} {what}", f"# TYPE {name} histogram"]
                for route, h in sorted(hists.items()):
                    lines += h.lines(name, f'route="{_escape(route)}"')
            lines += _counter(
                "lmforge_prompt_tokens_total",
                "Prompt tokens of completed requests.",
                self.prompt_tokens,
            )
            lines += _counter(
                "lmforge_completion_tokens_total", "Tokens generated.", self.completion_tokens
            )
        if engine is not None:
            lines += _gauge("lmforge_engine_running", "Requests decoding now.", engine.running)
            lines += _gauge(
                "lmforge_engine_waiting", "Requests waiting for a batch row.", engine.queued
            )
            lines += _gauge("lmforge_engine_max_batch", "Batch rows.", engine.config.max_batch)
            lines += _counter(
                "lmforge_engine_decode_steps_total", "Batched decode steps run.", engine.steps
            )
            lines += _counter(
                "lmforge_engine_decoded_rows_total",
                "Request rows over all decode steps.",
                engine.rows_decoded,
            )
            lines += _counter(
                "lmforge_engine_prefills_total",
                "Prefill forwards run (each prefills waiting requests together).",
                engine.prefills,
            )
            lines += _counter(
                "lmforge_engine_prefilled_rows_total",
                "Requests prefilled over all prefill forwards.",
                engine.rows_prefilled,
            )
            if getattr(engine, "prefix", None) is not None:
                lines += _prefix_cache_lines(engine.prefix)
        return "\n".join(lines) + "\n"


def _prefix_cache_lines(pool) -> list[str]:
    """The prefix cache's counters, in prompt tokens (hit rate = hits / (hits + misses)), as vLLM
    counts its prefix cache queries and hits."""
    return [
        *_counter(
            "lmforge_prefix_cache_hit_tokens_total",
            "Prompt tokens whose keys/values were read from the prefix cache.",
            pool.hit_tokens,
        ),
        *_counter(
            "lmforge_prefix_cache_miss_tokens_total",
            "Prompt tokens computed (not in the prefix cache).",
            pool.miss_tokens,
        ),
        *_counter(
            "lmforge_prefix_cache_evicted_blocks_total",
            "Blocks evicted to keep others.",
            pool.evicted,
        ),
        *_gauge("lmforge_prefix_cache_used_blocks", "Blocks holding a prefix.", pool.used),
        *_gauge(
            "lmforge_prefix_cache_blocks", "Blocks the prefix cache holds at most.", pool.blocks
        ),
    ]


def _counter(name: str, what: str, value: float) -> list[str]:
    return [f"# HELP {name} {what}", f"# TYPE {name} counter", f"{name} {value}"]


def _gauge(name: str, what: str, value: float) -> list[str]:
    return [f"# HELP {name} {what}", f"# TYPE {name} gauge", f"{name} {value}"]


class MetricsMiddleware:
    """ASGI middleware: counts every HTTP request by route and status, and times it to its last byte
    (for a stream, the end of the stream). Unknown paths count as route "other", so a scanner cannot
    grow the label set without bound."""

    def __init__(self, app, metrics: Metrics, routes: set[str]):
        self.app, self.metrics, self.routes = app, metrics, routes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        route = scope["path"] if scope["path"] in self.routes else "other"
        start, status = time.perf_counter(), [500]
        done = [False]

        async def send_wrapper(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)
            if (
                message["type"] == "http.response.body"
                and not message.get("more_body", False)
                and not done[0]
            ):
                done[0] = True
                self.metrics.request_done(route, status[0], time.perf_counter() - start)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            if not done[0]:  # the client left mid-response: still counted, with the status it got
                self.metrics.request_done(route, status[0], time.perf_counter() - start)
