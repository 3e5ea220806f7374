"""Prometheus metrics of the server (``pagedserve serve``).

Served over HTTP at ``/metrics``: on ``--metrics-port`` by prometheus_client's own server
(a thread of this process), apart from the gRPC port, as gRPC servers such as Triton do,
and on the HTTP API's port (``--http-port``) as OpenAI-compatible servers do. Two kinds:

- the server's own, counted as calls end: calls by API and outcome (a gRPC status name,
  for HTTP calls too: ``call_errors.py`` maps them), calls running, outputs by finish
  reason, prompt and generated tokens (in all, and histograms per call), and histograms of
  time queued (the scheduler's), time to first token, time per output token and call
  duration;
- the engine's, read at scrape time (one ``GetStats`` round trip to the scheduler, on
  the event loop): queue lengths, free and total KV blocks on device and host, the KV
  cache's usage, and as counters preemptions, prefix-cache queries and hits, and the
  scheduler's other counts (``COUNTER_STATS``).

With ``--vllm-metric-names`` the series vLLM also has are exposed a second time under its
names (``vllm:prompt_tokens_total``, ``vllm:e2e_request_latency_seconds``,
``vllm:num_requests_running``, ``vllm:kv_cache_usage_perc``, ...) with its ``model_name``
label, so an operator's vLLM dashboards and alerts read this server unchanged.

Each registry is private to its ``ServerMetrics``, so several servers (tests) can live in
one process.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    start_http_server,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import Collector

from pagedserve.frontend.outputs import EmbeddingRequestOutput
from pagedserve.scheduler.engine_core import ACCEPTED_PER_POSITION, COUNTER_STATS

if TYPE_CHECKING:
    from pagedserve.frontend.outputs import RequestOutput
    from pagedserve.scheduler.engine_messages import EngineStats

logger = logging.getLogger(__name__)

PREFIX = "pagedserve"
# How long a scrape waits for the scheduler's counters before it reports without them.
ENGINE_STATS_TIMEOUT_S = 2.0
# Latency buckets (seconds): from a decode step on a GPU to a long generation on a CPU.
_TOKEN_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
_REQUEST_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
# Time queued: none at all (an idle server admits at once) to minutes (an overloaded one).
_QUEUE_BUCKETS_S = tuple(sorted(set(_TOKEN_BUCKETS_S) | set(_REQUEST_BUCKETS_S)))
# Tokens per call (prompt, or generated over all outputs): 1-2-5 steps up to 100k.
_TOKEN_COUNT_BUCKETS = tuple(m * 10**e for e in range(6) for m in (1, 2, 5))


# vLLM's names for the same series (``--vllm-metric-names``): what its Grafana dashboards
# and alerts read, each with vLLM's model_name label. Ours -> vLLM's.
_VLLM_NAMES = {
    f"{PREFIX}_prompt_tokens": "vllm:prompt_tokens",
    f"{PREFIX}_generation_tokens": "vllm:generation_tokens",
    f"{PREFIX}_request_success": "vllm:request_success",
    f"{PREFIX}_request_prompt_tokens": "vllm:request_prompt_tokens",
    f"{PREFIX}_request_generation_tokens": "vllm:request_generation_tokens",
    f"{PREFIX}_time_to_first_token_seconds": "vllm:time_to_first_token_seconds",
    f"{PREFIX}_time_per_output_token_seconds": "vllm:time_per_output_token_seconds",
    f"{PREFIX}_request_queue_time_seconds": "vllm:request_queue_time_seconds",
    f"{PREFIX}_request_duration_seconds": "vllm:e2e_request_latency_seconds",
    f"{PREFIX}_engine_num_running": "vllm:num_requests_running",
    f"{PREFIX}_engine_num_waiting": "vllm:num_requests_waiting",
    f"{PREFIX}_engine_num_swapped": "vllm:num_requests_swapped",
    f"{PREFIX}_engine_num_preemptions": "vllm:num_preemptions",
    f"{PREFIX}_engine_num_drafts": "vllm:spec_decode_num_drafts",
    f"{PREFIX}_engine_num_draft_tokens": "vllm:spec_decode_num_draft_tokens",
    f"{PREFIX}_engine_num_accepted_tokens": "vllm:spec_decode_num_accepted_tokens",
    f"{PREFIX}_engine_num_accepted_tokens_per_pos": "vllm:spec_decode_num_accepted_tokens_per_pos",
    f"{PREFIX}_engine_prefix_cache_queries": "vllm:prefix_cache_queries",
    f"{PREFIX}_engine_prefix_cache_hits": "vllm:prefix_cache_hits",
    # vLLM's current name, and the one its older dashboards read.
    f"{PREFIX}_engine_kv_cache_usage": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
}
_VLLM_LABELS = {"finish_reason": "finished_reason"}


def _vllm_families(family: Metric, model_name: str) -> Iterator[Metric]:
    """``family`` again under each of vLLM's names for it (none if it has none)."""
    names = _VLLM_NAMES.get(family.name, ())
    for name in (names,) if isinstance(names, str) else names:
        renamed = Metric(name, family.documentation, family.type, family.unit)
        for sample in family.samples:
            labels = {_VLLM_LABELS.get(k, k): v for k, v in sample.labels.items()}
            labels["model_name"] = model_name
            suffix = sample.name[len(family.name) :]  # _total, _bucket, _sum, _created ...
            renamed.add_sample(name + suffix, labels, sample.value, sample.timestamp)
        yield renamed


class _VllmNames(Collector):
    """The server's own series under vLLM's names too (the engine's are renamed where
    they are read, in ``_EngineCollector``: one round trip per scrape)."""

    def __init__(self, sources: list[Collector], model_name: str) -> None:
        self._sources = sources
        self._model_name = model_name

    def collect(self) -> Iterator[Metric]:
        for source in self._sources:
            for family in source.collect():
                yield from _vllm_families(family, self._model_name)


class _EngineCollector(Collector):
    """The scheduler's counters, asked for at each scrape; with ``vllm_model_name``, also
    under vLLM's names."""

    def __init__(
        self, read_stats: Callable[[], EngineStats | None], vllm_model_name: str | None = None
    ) -> None:
        self._read_stats = read_stats
        self._vllm_model_name = vllm_model_name

    def collect(self) -> Iterator[Metric]:
        for family in self._families():
            yield family
            if self._vllm_model_name is not None:
                yield from _vllm_families(family, self._vllm_model_name)

    def _families(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        up = GaugeMetricFamily(
            f"{PREFIX}_engine_up", "1 when the engine answered this scrape, else 0"
        )
        stats = self._read_stats()
        up.add_metric([], 0.0 if stats is None else 1.0)
        yield up
        if stats is None:
            return
        per_position = CounterMetricFamily(
            f"{PREFIX}_engine_num_accepted_tokens_per_pos",
            "speculation's accepted draft tokens by their position in their step's drafts",
            labels=["position"],
        )
        for name, value in sorted(stats.stats.items()):
            if name.startswith(ACCEPTED_PER_POSITION):
                per_position.add_metric([name[len(ACCEPTED_PER_POSITION) :]], float(value))
                continue
            metric_name = f"{PREFIX}_engine_{re.sub(r'[^a-zA-Z0-9_]', '_', name)}"
            # Counters as counters (exposed with _total), so rate() and resets read right.
            kind = CounterMetricFamily if name in COUNTER_STATS else GaugeMetricFamily
            family = kind(metric_name, f"the scheduler's {name}")
            family.add_metric([], float(value))
            yield family
        if per_position.samples:
            yield per_position
        total = stats.stats.get("num_total_blocks", 0)
        if total:
            # vLLM's kv_cache_usage_perc: what an operator alerts on.
            usage = GaugeMetricFamily(
                f"{PREFIX}_engine_kv_cache_usage",
                "fraction of the device KV cache blocks in use (0 to 1)",
            )
            usage.add_metric([], 1.0 - stats.stats["num_free_blocks"] / total)
            yield usage


class ServerMetrics:
    """``vllm_model_name``: also expose vLLM's names for the series vLLM has (labelled
    ``model_name`` with it); None: ours only."""

    def __init__(self, vllm_model_name: str | None = None) -> None:
        self.registry = CollectorRegistry()
        self._vllm_model_name = vllm_model_name
        self.calls = Counter(
            f"{PREFIX}_requests",
            "generation calls that ended, by API (grpc, http, batch) and status (gRPC's names)",
            ["api", "code"],
            registry=self.registry,
        )
        self.running = Gauge(
            f"{PREFIX}_requests_running", "generation calls in flight", registry=self.registry
        )
        self.prompt_tokens = Counter(
            f"{PREFIX}_prompt_tokens", "prompt tokens of admitted calls", registry=self.registry
        )
        self.generation_tokens = Counter(
            f"{PREFIX}_generation_tokens",
            "tokens generated (all outputs of a call)",
            registry=self.registry,
        )
        self.finished_outputs = Counter(
            f"{PREFIX}_request_success",
            "outputs that ended, by finish reason (stop, length, tool_calls; vLLM's "
            "request_success by output)",
            ["finish_reason"],
            registry=self.registry,
        )
        self.prompt_tokens_per_call = Histogram(
            f"{PREFIX}_request_prompt_tokens",
            "prompt tokens of each call that ended",
            buckets=_TOKEN_COUNT_BUCKETS,
            registry=self.registry,
        )
        self.generation_tokens_per_call = Histogram(
            f"{PREFIX}_request_generation_tokens",
            "tokens each call that ended generated (all its outputs)",
            buckets=_TOKEN_COUNT_BUCKETS,
            registry=self.registry,
        )
        self.time_to_first_token_s = Histogram(
            f"{PREFIX}_time_to_first_token_seconds",
            "from admission to the first generated token of a call",
            buckets=_REQUEST_BUCKETS_S,
            registry=self.registry,
        )
        self.time_per_output_token_s = Histogram(
            f"{PREFIX}_time_per_output_token_seconds",
            "after the first token, seconds per further token of output 0",
            buckets=_TOKEN_BUCKETS_S,
            registry=self.registry,
        )
        self.queue_time_s = Histogram(
            f"{PREFIX}_request_queue_time_seconds",
            "from arrival to the scheduler's first step of a call (time queued)",
            buckets=_QUEUE_BUCKETS_S,
            registry=self.registry,
        )
        self.duration_s = Histogram(
            f"{PREFIX}_request_duration_seconds",
            "from admission to the end of a call",
            buckets=_REQUEST_BUCKETS_S,
            registry=self.registry,
        )
        self._http_server = None
        if vllm_model_name is not None:
            sources = [
                self.prompt_tokens,
                self.generation_tokens,
                self.finished_outputs,
                self.prompt_tokens_per_call,
                self.generation_tokens_per_call,
                self.time_to_first_token_s,
                self.time_per_output_token_s,
                self.queue_time_s,
                self.duration_s,
            ]
            self.registry.register(_VllmNames(sources, vllm_model_name))

    def observe_finished(
        self,
        output: RequestOutput | EmbeddingRequestOutput,
        first_token_s: float | None,
        duration_s: float,
    ) -> None:
        """A call that ran to its end (``*_s``: seconds since its admission)."""
        self.prompt_tokens.inc(len(output.prompt_token_ids))
        self.prompt_tokens_per_call.observe(len(output.prompt_token_ids))
        self.duration_s.observe(duration_s)
        if output.queue_time_s is not None:
            self.queue_time_s.observe(output.queue_time_s)
        if isinstance(output, EmbeddingRequestOutput):
            return  # prompt only: no generated tokens, no first token
        num_generated = sum(len(c.token_ids) for c in output.outputs)
        self.generation_tokens.inc(num_generated)
        self.generation_tokens_per_call.observe(num_generated)
        for completion in output.outputs:
            if completion.finish_reason is not None:
                self.finished_outputs.labels(completion.finish_reason).inc()
        if first_token_s is not None:
            self.time_to_first_token_s.observe(first_token_s)
            num_tokens = len(output.outputs[0].token_ids) if output.outputs else 0
            if num_tokens > 1:
                self.time_per_output_token_s.observe(
                    (duration_s - first_token_s) / (num_tokens - 1)
                )

    def attach_engine(
        self, engine_stats: Callable[[], asyncio.Future], loop: asyncio.AbstractEventLoop
    ) -> None:
        """Report the scheduler's counters at each scrape: ``engine_stats`` is a coroutine
        function run on ``loop``; scrapes run on other threads (``render``, ``serve``)."""

        def read_stats() -> EngineStats | None:
            try:
                future = asyncio.run_coroutine_threadsafe(engine_stats(), loop)
                return future.result(ENGINE_STATS_TIMEOUT_S)
            except Exception as error:  # engine down or slow: say so, serve the rest
                logger.warning("metrics: no engine stats for this scrape: %r", error)
                return None

        self.registry.register(_EngineCollector(read_stats, self._vllm_model_name))

    def serve(self, host: str, port: int) -> int:
        """Serve ``/metrics`` on ``host:port`` (0: any free port) from a thread of its
        own; returns the port."""
        self._http_server, _thread = start_http_server(port, host, registry=self.registry)
        return self._http_server.server_port

    def render(self, accept: str | None = None) -> tuple[bytes, str]:
        """The exposition and its content type, in the format the ``Accept`` header asks
        (OpenMetrics for ``application/openmetrics-text``, else Prometheus text), as the
        metrics port's own server chooses it. It blocks while it asks the engine (see
        ``attach_engine``): call it off the event loop."""
        encoder, content_type = choose_encoder(accept or "")
        return encoder(self.registry), content_type

    def close(self) -> None:
        if self._http_server is not None:
            self._http_server.shutdown()
            self._http_server.server_close()
            self._http_server = None
