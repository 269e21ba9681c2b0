"""Prometheus metrics (``GET /metrics``), one registry per app.

Each gunicorn worker process holds one model and one registry, so a scrape sees the worker that answered it.
With ``SAKER_WORKERS=1`` (one model copy per replica, the recommended layout) that is the whole replica; with
more workers per replica scrape each worker's numbers separately or run one replica per worker
(docs/deployment.md). Everything is observed from the request's ``RequestRecord`` when the request is done.
"""

from __future__ import annotations

import time
from typing import Callable, Iterator

from flask import Flask, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.process_collector import ProcessCollector

from app.access_log import RequestRecord

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)
PER_TOKEN_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)
TOKEN_BUCKETS = (1, 4, 16, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)


class _CudaMemory:
    """Allocated/reserved bytes per CUDA device, only once this process has initialised CUDA."""

    def collect(self) -> Iterator[GaugeMetricFamily]:
        try:
            import torch

            if not torch.cuda.is_available() or not torch.cuda.is_initialized():
                return
            allocated = GaugeMetricFamily(
                "saker_gpu_memory_allocated_bytes", "Tensor memory allocated by torch", labels=["device"]
            )
            reserved = GaugeMetricFamily(
                "saker_gpu_memory_reserved_bytes", "Memory held by torch's caching allocator", labels=["device"]
            )
            for i in range(torch.cuda.device_count()):
                allocated.add_metric([str(i)], torch.cuda.memory_allocated(i))
                reserved.add_metric([str(i)], torch.cuda.memory_reserved(i))
        except Exception:
            return
        yield allocated
        yield reserved


_METHODS = frozenset({"GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"})


class _AdmissionCounters:
    """The waiting queue's own counts (429s for a full queue, 503s for a queue timeout) as counters."""

    def __init__(self, metrics: "Metrics"):
        self.metrics = metrics

    def collect(self) -> Iterator[CounterMetricFamily]:
        queue = self.metrics.worker.queue_snapshot()
        yield CounterMetricFamily(
            "saker_requests_rejected", "Requests turned away because the queue was full (429)", value=queue["rejected"]
        )
        yield CounterMetricFamily(
            "saker_requests_queue_timeouts",
            "Requests that waited longer than the queue timeout (503)",
            value=queue["timed_out"],
        )
        yield CounterMetricFamily(
            "saker_preemptions",
            "Requests that gave their KV blocks back to older ones when blocks ran out, and were computed again",
            value=getattr(getattr(self.metrics.worker, "engine", None), "preemptions", 0),
        )
        engine = getattr(self.metrics.worker, "engine", None)
        yield CounterMetricFamily(
            "saker_engine_step_failures",
            "Engine steps that failed: the requests they touched failed (500), what they held was given back, and "
            "the engine served on",
            value=getattr(engine, "failures", 0),
        )
        yield CounterMetricFamily(
            "saker_engine_repairs",
            "KV blocks found held with nothing running and taken back (a leak: report it)",
            value=getattr(engine, "repairs", 0),
        )


class _PrefixCacheCounters:
    """The prefix cache's own counts (app/engine/core/blocks.py), once the model is loaded with one."""

    def __init__(self, metrics: "Metrics"):
        self.metrics = metrics

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        cache = getattr(self.metrics.worker, "prefix_cache", None)
        if cache is None:
            return
        yield CounterMetricFamily(
            "saker_prefix_cache_hits", "Prefills that reused a kept prompt's KV cache", value=cache.hits
        )
        yield CounterMetricFamily(
            "saker_prefix_cache_reused_tokens",
            "Prompt tokens taken from the prefix cache instead of a forward",
            value=cache.reused_tokens,
        )
        yield GaugeMetricFamily(
            "saker_prefix_cache_tokens", "Prompt tokens whose KV the prefix cache holds now", value=cache.cached_tokens
        )


class _SpeculationCounters:
    """Speculative decoding's acceptance (SAKER_SPECULATIVE), under vLLM's ``spec_decode`` names: rows that carried
    guesses into a step, the tokens guessed, those kept, and those kept at each position of a guess."""

    def __init__(self, metrics: "Metrics", model_name: str):
        self.metrics, self.model_name = metrics, model_name

    def collect(self) -> Iterator[CounterMetricFamily]:
        counts = getattr(getattr(self.metrics.worker, "engine", None), "speculation_counts", None)
        if not counts:
            return
        for name, doc, key in (
            ("vllm:spec_decode_num_drafts", "Rows that carried guessed tokens into a step", "drafts"),
            ("vllm:spec_decode_num_draft_tokens", "Tokens guessed", "draft_tokens"),
            ("vllm:spec_decode_num_accepted_tokens", "Guessed tokens kept", "accepted_tokens"),
        ):
            family = CounterMetricFamily(name, doc, labels=["model_name"])
            family.add_metric([self.model_name], counts[key])
            yield family
        per_position = CounterMetricFamily(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Guessed tokens kept, by their position in the guess",
            labels=["model_name", "position"],
        )
        for position, value in enumerate(counts["accepted_per_position"]):
            per_position.add_metric([self.model_name, str(position)], value)
        yield per_position


class _VllmAliases:
    """The gauges and counters routers and autoscalers written for vLLM read (the Gateway API Inference
    Extension's endpoint picker, vLLM's production-stack router, KEDA/HPA rules), under vLLM's names, with its
    ``model_name`` label (SAKER_VLLM_METRICS, on by default)."""

    def __init__(self, metrics: "Metrics", model_name: str, adapters: tuple[str, ...]):
        self.metrics, self.model_name, self.adapters = metrics, model_name, adapters

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        worker = self.metrics.worker
        label = [self.model_name]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(name, doc, labels=["model_name"])
            family.add_metric(label, value)
            return family

        usage = getattr(getattr(worker, "engine", None), "kv_usage", 0.0)
        queue = worker.queue_snapshot()
        yield gauge("vllm:num_requests_waiting", "Requests waiting for the model (saker_queue_depth)", queue["waiting"])
        yield gauge(
            "vllm:num_requests_running", "Requests the model is working on (saker_requests_running)", queue["active"]
        )
        yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage, 0-1 (saker_kv_cache_usage)", usage)
        yield gauge("vllm:gpu_cache_usage_perc", "KV-cache usage, 0-1 (vLLM's older name)", usage)
        preempted = CounterMetricFamily(
            "vllm:num_preemptions",
            "Requests that gave their KV blocks back to older ones and were computed again (saker_preemptions)",
            labels=["model_name"],
        )
        preempted.add_metric(label, getattr(getattr(worker, "engine", None), "preemptions", 0))
        yield preempted
        cache = getattr(worker, "prefix_cache", None)
        if cache is not None:
            for name, doc, value in (
                ("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache", cache.queried_tokens),
                ("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache", cache.reused_tokens),
            ):
                family = CounterMetricFamily(name, doc, labels=["model_name"])
                family.add_metric(label, value)
                yield family
        lora = GaugeMetricFamily(
            "vllm:lora_requests_info",
            "LoRA adapters served (vLLM's shape: the value is the "
            "time of the scrape, the labels carry the information)",
            labels=["running_lora_adapters", "waiting_lora_adapters", "max_lora"],
        )
        lora.add_metric([",".join(self.adapters), "", str(len(self.adapters))], time.time())
        yield lora


class Metrics:
    def __init__(self, worker, *, model_name: str = "", vllm_aliases: bool = False, adapters: tuple[str, ...] = ()):
        self.worker = worker
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            "saker_requests", "HTTP requests by route, method and status", ["route", "method", "status"], registry=r
        )
        self.errors = Counter(
            "saker_request_errors",
            "Error answers (and in-stream error frames) by route and error code",
            ["route", "code"],
            registry=r,
        )
        self.latency = Histogram(
            "saker_request_duration_seconds",
            "End-to-end request time (a stream: until its last frame)",
            ["route"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_wait = Histogram(
            "saker_queue_wait_seconds",
            "Time a generation request waited for the model",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "saker_time_to_first_token_seconds",
            "Time to first token: a stream's first "
            "chunk after the request arrived; a plain request's queue wait plus prefill",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "saker_time_per_output_token_seconds",
            "Decode time divided by the generated tokens of a request (all its choices)",
            buckets=PER_TOKEN_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter("saker_prompt_tokens", "Prompt tokens processed", registry=r)
        self.generation_tokens = Counter("saker_generation_tokens", "Tokens generated", registry=r)
        self.request_prompt_tokens = Histogram(
            "saker_request_prompt_tokens", "Prompt tokens per request", buckets=TOKEN_BUCKETS, registry=r
        )
        self.request_generation_tokens = Histogram(
            "saker_request_generation_tokens", "Generated tokens per request", buckets=TOKEN_BUCKETS, registry=r
        )
        self.in_flight = Gauge(
            "saker_requests_in_flight", "HTTP requests being answered (streams included)", registry=r
        )
        Gauge("saker_queue_depth", "Requests waiting for the model", registry=r).set_function(
            lambda: self.worker.queue_snapshot()["waiting"]
        )
        Gauge("saker_requests_running", "Requests the model is working on", registry=r).set_function(
            lambda: self.worker.queue_snapshot()["active"]
        )
        Gauge(
            "saker_kv_cache_usage",
            "Token positions the running batch holds in its KV cache, as a share of the KV budget (0-1)",
            registry=r,
        ).set_function(lambda: getattr(getattr(self.worker, "engine", None), "kv_usage", 0.0))
        Gauge(
            "saker_kv_cache_budget_tokens",
            "The running batch's KV budget in token positions (SAKER_KV_CACHE_TOKENS, or derived at load)",
            registry=r,
        ).set_function(lambda: getattr(self.worker, "kv_cache_tokens", None) or 0)
        r.register(_AdmissionCounters(self))
        r.register(_PrefixCacheCounters(self))
        r.register(_SpeculationCounters(self, model_name))
        Gauge("saker_model_load_seconds", "Time the model took to load (0 until loaded)", registry=r).set_function(
            lambda: self.worker.load_seconds or 0.0
        )
        Gauge("saker_model_ready", "1 once the model is loaded and serving", registry=r).set_function(
            lambda: 1.0 if self.worker.ready else 0.0
        )
        ProcessCollector(registry=r)
        r.register(_CudaMemory())
        if vllm_aliases:
            r.register(_VllmAliases(self, model_name, adapters))

    # -- per request ----------------------------------------------------------------------------------------
    def started(self) -> None:
        self.in_flight.inc()

    def observe(self, record: RequestRecord) -> None:
        self.in_flight.dec()
        route = record.route
        method = record.method if record.method in _METHODS else "other"  # a label's values stay bounded
        self.requests.labels(route, method, str(record.status)).inc()
        if record.error_code:
            self.errors.labels(route, record.error_code).inc()
        if record.duration_s is not None:
            self.latency.labels(route).observe(record.duration_s)
        if record.queue_s is not None:
            self.queue_wait.observe(record.queue_s)
        if record.ttft_s is not None:
            self.ttft.observe(record.ttft_s)
        if record.prompt_tokens is not None:
            self.prompt_tokens.inc(record.prompt_tokens)
            self.request_prompt_tokens.observe(record.prompt_tokens)
        if record.completion_tokens is not None:
            self.generation_tokens.inc(record.completion_tokens)
            self.request_generation_tokens.observe(record.completion_tokens)
            if record.completion_tokens > 0 and record.decode_s:
                self.tpot.observe(record.decode_s / record.completion_tokens)

    def render(self) -> Response:
        return Response(generate_latest(self.registry), mimetype=None, content_type=CONTENT_TYPE_LATEST)


def install_metrics(app: Flask, metrics: Metrics) -> Callable[[RequestRecord], None]:
    """``GET /metrics`` and the in-flight count; returns the callback that observes a finished request."""

    @app.before_request
    def _count_in_flight():
        metrics.started()

    app.add_url_rule("/metrics", "metrics", metrics.render, methods=["GET"])
    return metrics.observe
