"""Prometheus metrics of the serving process, exported on the HTTP port at `/metrics`.

Every name is documented in docs/metrics.md; tests/test_serve_metrics.py holds the two together.
Engine gauges and counters are read from `engine.stats()` at scrape time (so they are never stale);
latency histograms and request counters are observed by the engine client as requests flow.
One registry per server, no module-level state.

With several API processes (`--api-server-count`, see api_server_process) PROMETHEUS_MULTIPROC_DIR is
set before this module is imported: the request counters and histograms then live in per-process
files, and a scrape sums every process's through `MultiProcessCollector`, beside the engine stats
that every process receives.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest, multiprocess
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_fastapi_instrumentator import Instrumentator

from pagoda.service.engine.messages import STEP_SECONDS_BUCKETS
from pagoda.service.outputs import RequestMetrics, RequestOutput

logger = logging.getLogger(__name__)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
FINISH_REASONS = ("stop", "length", "abort")
ERROR_KINDS = ("invalid_request", "not_found", "queue_full", "unavailable", "internal")

# Seconds. TTFT spans a cached-prefix hit on a GPU (~10 ms) to a long prefill on the CPU (~minutes).
_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 60.0, 120.0, 300.0)
OUTPUT_STAGES = ("core_to_api", "api_process", "stream_wait")  # see AsyncEngine.observe_delay
# The routes the platform calls rather than users (kubelet probes, the scrape itself, the router's load
# polls): left out of the per-route HTTP series, as vLLM leaves out its probes. Regexes, searched.
UNCOUNTED_ROUTES = ("^/metrics$", "^/health$", "^/v1/health/", "^/get_load$", "^/version$")
# Seconds, for `http_request_duration_seconds` by route: a generation takes seconds to minutes, so the
# library's default (0.1, 0.5, 1) would put nearly every completion past its last bucket.
_HTTP_BUCKETS = (0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.2, 0.5, 1.0, 2.5, 5.0)


class _EngineCollector:
    """Reads the engine's counters and gauges at scrape time; yields nothing before the model loads."""

    def __init__(self, stats_source: Callable[[], Any | None], model_name: Callable[[], str]) -> None:
        self._stats_source = stats_source
        self._model_name = model_name

    def collect(self) -> Iterator[Metric]:
        stats = self._stats_source()
        if stats is None:
            return
        queries = stats.prefix_cache_queries_total
        hit_ratio = stats.prefix_cache_hits_total / queries if queries else 0.0
        gauges = [
            (
                "pagoda_requests_waiting",
                "Requests waiting for a slot in the running batch.",
                stats.num_waiting,
            ),
            ("pagoda_requests_running", "Requests in the running batch.", stats.num_running),
            (
                "pagoda_kv_cache_usage_ratio",
                "Fraction of KV cache blocks in use, 0 to 1.",
                stats.kv_cache_usage,
            ),
            (
                "pagoda_prefix_cache_hit_ratio",
                "Prompt tokens served from the prefix cache over prompt tokens looked up, since start.",
                hit_ratio,
            ),
        ]
        for name, doc, value in gauges:
            yield GaugeMetricFamily(name, doc, value=value)
        counters = [
            ("pagoda_prompt_tokens_total", "Prompt tokens processed.", stats.prompt_tokens_total),
            ("pagoda_generation_tokens_total", "Tokens generated.", stats.generation_tokens_total),
            (
                "pagoda_preemptions_total",
                "Running requests preempted for KV cache space.",
                stats.num_preemptions_total,
            ),
            (
                "pagoda_prefix_cache_queries_total",
                "Prompt tokens looked up in the prefix cache.",
                stats.prefix_cache_queries_total,
            ),
            (
                "pagoda_prefix_cache_hits_total",
                "Prompt tokens found in the prefix cache.",
                stats.prefix_cache_hits_total,
            ),
        ]
        for name, doc, value in counters:
            yield CounterMetricFamily(name, doc, value=value)
        yield CounterMetricFamily(
            "pagoda_engine_gc_pause_seconds",
            "Time the engine core's step loop stood still in Python garbage collections.",
            value=stats.gc_pause_seconds_total,
        )
        yield CounterMetricFamily(
            "pagoda_engine_gc_collections",
            "Python garbage collections in the engine core since it turned ready.",
            value=stats.gc_collections_total,
        )
        steps = HistogramMetricFamily(
            "pagoda_engine_step_duration_seconds",
            "Wall time of one engine-core step, by kind (decode: one token per sequence; mixed: a prefill "
            "chunk in it).",
            labels=["kind"],
        )
        for kind, counts in stats.step_bucket_counts.items():
            bounds = [*map(str, STEP_SECONDS_BUCKETS), "+Inf"]
            cumulative = [float(sum(counts[: i + 1])) for i in range(len(counts))]
            steps.add_metric([kind], list(zip(bounds, cumulative, strict=True)), stats.step_seconds_sum[kind])
        yield steps
        yield InfoMetricFamily(
            "pagoda_kv_cache",
            "The KV cache's shape: tokens per block and blocks allocated.",
            value={"block_size": str(stats.block_size), "num_blocks": str(stats.num_kv_blocks)},
        )
        # vLLM's names, read by the Gateway API Inference Extension endpoint picker and vLLM dashboards.
        model = self._model_name()
        for name, doc, value in [
            ("vllm:num_requests_waiting", "Requests waiting (vLLM name).", stats.num_waiting),
            ("vllm:num_requests_running", "Requests running (vLLM name).", stats.num_running),
            ("vllm:kv_cache_usage_perc", "KV cache usage, 0 to 1 (vLLM name).", stats.kv_cache_usage),
        ]:
            family = GaugeMetricFamily(name, doc, labels=["model_name"])
            family.add_metric([model], value)
            yield family
        if stats.spec_num_drafts_total is not None:
            yield from _spec_decode_metrics(stats, model)
        if stats.max_loras:
            yield from _lora_metrics(stats, model)
        yield InfoMetricFamily(
            "vllm:cache_config",
            "KV cache configuration (vLLM name).",
            value={"block_size": str(stats.block_size), "num_gpu_blocks": str(stats.num_kv_blocks)},
        )


def _spec_decode_metrics(stats: Any, model: str) -> Iterator[Metric]:
    """vLLM's speculative-decoding counters, only when `--speculative-config` is set."""
    for name, doc, value in [
        ("vllm:spec_decode_num_drafts", "Sequences that drafted, per step.", stats.spec_num_drafts_total),
        ("vllm:spec_decode_num_draft_tokens", "Draft tokens proposed.", stats.spec_num_draft_tokens_total),
        ("vllm:spec_decode_num_accepted_tokens", "Draft tokens kept.", stats.spec_num_accepted_tokens_total),
    ]:
        family = CounterMetricFamily(name, doc, labels=["model_name"])
        family.add_metric([model], value)
        yield family
    per_position = CounterMetricFamily(
        "vllm:spec_decode_num_accepted_tokens_per_pos",
        "Draft tokens accepted, by their position in the draft (0: the first).",
        labels=["model_name", "position"],
    )
    for position, value in enumerate(stats.spec_accepted_per_position_total):
        per_position.add_metric([model, str(position)], value)
    yield per_position


def _lora_metrics(stats: Any, model: str) -> Iterator[Metric]:
    """With --enable-lora: vLLM's `lora_requests_info` and Pagoda's per-adapter counters."""
    info = GaugeMetricFamily(
        "vllm:lora_requests_info",
        "Adapters of running and waiting requests and the slot count; the value is the time (vLLM name).",
        labels=["running_lora_adapters", "waiting_lora_adapters", "max_lora"],
    )
    info.add_metric(
        [",".join(stats.lora_running), ",".join(stats.lora_waiting), str(stats.max_loras)], time.time()
    )
    yield info
    for name, doc, values in [
        ("pagoda_lora_requests", "Requests under each LoRA adapter.", stats.lora_requests_total),
        (
            "pagoda_lora_generation_tokens",
            "Tokens generated under each adapter.",
            stats.lora_generation_tokens_total,
        ),
        ("pagoda_lora_loads", "Adapter loads: its files read and checked.", stats.lora_loads_total),
        ("pagoda_lora_load_seconds", "Seconds spent loading each adapter.", stats.lora_load_seconds_total),
        (
            "pagoda_lora_slot_loads",
            "Placements of each adapter into a GPU slot.",
            stats.lora_slot_loads_total,
        ),
    ]:
        family = CounterMetricFamily(name, doc, labels=["model_name", "lora_name"])
        for adapter, value in sorted(values.items()):
            family.add_metric([model, adapter], value)
        yield family


class _GpuCollector:
    """Device utilisation and memory through NVML. Registered only when NVML finds a GPU."""

    def __init__(self, pynvml: Any, num_devices: int) -> None:
        self._nvml = pynvml
        self._num_devices = num_devices

    @classmethod
    def create(cls) -> _GpuCollector | None:
        try:
            import pynvml

            pynvml.nvmlInit()
            num_devices = pynvml.nvmlDeviceGetCount()
        except Exception:  # no driver, no library, no device: the metrics are absent, not faked
            return None
        return cls(pynvml, num_devices) if num_devices else None

    def collect(self) -> Iterator[Metric]:
        util = GaugeMetricFamily(
            "pagoda_gpu_utilization_ratio", "GPU busy time fraction (NVML).", labels=["gpu"]
        )
        used = GaugeMetricFamily("pagoda_gpu_memory_used_bytes", "GPU memory in use (NVML).", labels=["gpu"])
        total = GaugeMetricFamily(
            "pagoda_gpu_memory_total_bytes", "GPU memory installed (NVML).", labels=["gpu"]
        )
        for index in range(self._num_devices):
            try:
                handle = self._nvml.nvmlDeviceGetHandleByIndex(index)
                rates = self._nvml.nvmlDeviceGetUtilizationRates(handle)
                memory = self._nvml.nvmlDeviceGetMemoryInfo(handle)
            except Exception as exc:  # a device lost mid-run must not break the scrape
                logger.warning("NVML read of GPU %d failed: %s", index, exc)
                continue
            util.add_metric([str(index)], rates.gpu / 100.0)
            used.add_metric([str(index)], memory.used)
            total.add_metric([str(index)], memory.total)
        yield from (util, used, total)


class ServerMetrics:
    """The server's registry. `stats_source()` returns the engine's EngineStats, or None while loading."""

    def __init__(
        self,
        stats_source: Callable[[], Any | None],
        model_name: Callable[[], str],
        enable_gpu: bool = True,
    ) -> None:
        self.registry = CollectorRegistry()  # what a scrape reads
        self._request_registry = self.registry  # where this process's request metrics live
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):  # their values are files, summed at a scrape
            self._request_registry = CollectorRegistry()
            multiprocess.MultiProcessCollector(self.registry)
        self.registry.register(_EngineCollector(stats_source, model_name))
        gpu = _GpuCollector.create() if enable_gpu else None
        if gpu is not None:
            self.registry.register(gpu)
        self.requests_finished = Counter(
            "pagoda_requests_finished",
            "Requests finished, by the reason the (first) completion ended.",
            ["finish_reason"],
            registry=self._request_registry,
        )
        self.request_errors = Counter(
            "pagoda_request_errors",
            "Requests refused or failed, by kind of error.",
            ["error"],
            registry=self._request_registry,
        )
        for reason in FINISH_REASONS:
            self.requests_finished.labels(reason)
        for kind in ERROR_KINDS:
            self.request_errors.labels(kind)

        def histogram(name: str, doc: str, buckets: tuple[float, ...] = _LATENCY_BUCKETS) -> Histogram:
            return Histogram(name, doc, buckets=buckets, registry=self._request_registry)

        self.time_to_first_token = histogram(
            "pagoda_time_to_first_token_seconds", "From arrival to the first generated token."
        )
        self.inter_token_latency = histogram(
            "pagoda_inter_token_latency_seconds", "Between consecutive generated tokens.", _ITL_BUCKETS
        )
        self.e2e_request_latency = histogram(
            "pagoda_e2e_request_latency_seconds", "From arrival to the last token (finished requests)."
        )
        self.request_queue_time = histogram(
            "pagoda_request_queue_time_seconds", "From arrival to the first time the request was scheduled."
        )

        self.output_delay = Histogram(
            "pagoda_output_delay_seconds",
            "Where generated tokens wait between the engine core and the request's handler, by stage.",
            ["stage"],
            buckets=_ITL_BUCKETS,
            registry=self._request_registry,
        )
        # The children, looked up once: this is observed per step and per chunk sent.
        self._output_delay = {stage: self.output_delay.labels(stage) for stage in OUTPUT_STAGES}

    def observe_output_delay(self, stage: str, seconds: float) -> None:
        self._output_delay[stage].observe(max(seconds, 0.0))

    def instrument_http(self, app: Any) -> None:
        """Per-route HTTP series on `app` (a Starlette app), through the library vLLM's server uses, under
        its names: `http_requests_total{method, status, handler}` (status by class: 2xx, 4xx, 5xx; a path no
        route matches is the handler `none`), the request and response sizes, the latency by route and
        without labels. Call it after the app's other middleware: outermost, it counts their refusals too."""
        Instrumentator(excluded_handlers=list(UNCOUNTED_ROUTES), registry=self._request_registry).instrument(
            app, latency_lowr_buckets=_HTTP_BUCKETS
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def count_error(self, kind: str) -> None:
        self.request_errors.labels(kind).inc()


class RequestTracker:
    """Turns one request's stream of RequestOutputs into latency observations and a finish count."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self._metrics = metrics
        self._last_token_time: float | None = None
        self._done = False

    def observe(self, out: RequestOutput) -> None:
        timing: RequestMetrics = out.metrics
        # Tokens this output added to the completion that grew most: n completions decode side by
        # side, so one step is one inter-token gap whatever n is.
        new_tokens = max((len(c.token_ids_delta) for c in out.outputs), default=0)
        if new_tokens > 0 and timing.last_token_time is not None:
            if self._last_token_time is None:
                if timing.first_token_time is not None:
                    self._metrics.time_to_first_token.observe(timing.first_token_time - timing.arrival_time)
                if timing.scheduled_time is not None:
                    self._metrics.request_queue_time.observe(timing.scheduled_time - timing.arrival_time)
                gap_start, new_tokens = timing.first_token_time, new_tokens - 1
            else:
                gap_start = self._last_token_time
            if new_tokens > 0 and gap_start is not None:
                gap = max(timing.last_token_time - gap_start, 0.0) / new_tokens
                for _ in range(new_tokens):
                    self._metrics.inter_token_latency.observe(gap)
            self._last_token_time = timing.last_token_time
        if out.finished and not self._done:
            self._done = True
            end = timing.finished_time or timing.last_token_time
            if end is not None:
                self._metrics.e2e_request_latency.observe(end - timing.arrival_time)
            reasons = [c.finish_reason for c in out.outputs]
            self._metrics.requests_finished.labels(
                "abort" if "abort" in reasons else reasons[0] or "abort"
            ).inc()

    def close(self) -> None:
        """The stream ended early (client gone, error): count it as aborted."""
        if not self._done:
            self._done = True
            self._metrics.requests_finished.labels("abort").inc()
