"""Prometheus metrics named `kvserve:*`, shaped like vLLM's `vllm:*` so dashboards carry over.

`ServerMetrics` is an `EngineObserver` (latency histograms, token counters, rejections) plus the
HTTP-level counters the engine cannot see (status codes, clients that left, ignored fields).
Embedding requests are counted apart from generation (`kvserve:embedding_*`): their own
requests, inputs, tokens, latencies, batches, queue and rejections.
Every engine-level series carries the served model's name as `model_name` (vLLM's label), each
model's recorded by its `ModelMetrics`; HTTP-level ones do not. Each instance has its own
`CollectorRegistry`, so several apps in one process do not collide.
Engine hooks run on the event loop thread, as does the scrape, so the gauges read the engine
directly at scrape time.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from kvserve.engine.engine import EngineObserver, RequestState

if TYPE_CHECKING:
    from kvserve.engine.embedding import EmbeddingJob
    from kvserve.engine.engine import Engine
    from kvserve.server.models import ServedModel

__all__ = ["EMBEDDING_REJECTION_REASONS", "REJECTION_REASONS", "ModelMetrics", "ServerMetrics"]

MODEL = "model_name"
"""The label every engine-level series carries: the served model's name (vLLM's)."""

REJECTION_REASONS = (
    "queue_full",
    "queue_timeout",
    "infeasible",
    "client_gone",
    "slow_consumer",
    "shutting_down",
)
"""Every reason a request is turned away or dropped; each is exported from the start at 0."""

EMBEDDING_REJECTION_REASONS = ("queue_full", "queue_timeout", "client_gone", "shutting_down")
"""Every reason an embedding request is turned away or dropped (counted apart)."""

# vLLM's buckets, so that percentiles computed from either server line up.
_TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
_ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
_REQUEST_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
    120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip

# Ignored-field names come from clients; past this many distinct ones they share one label so a
# client cannot grow the registry without bound.
_MAX_FIELD_LABELS = 64


class ServerMetrics(EngineObserver):
    """All `kvserve:*` metrics of one server, in a registry of its own."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self._models: dict[int, ModelMetrics] = {}
        r = self.registry
        self.time_to_first_token = Histogram(
            "kvserve:time_to_first_token_seconds",
            "Time from arrival to the first generated token.",
            buckets=_TTFT_BUCKETS,
            labelnames=(MODEL,),
            registry=r,
        )
        self.inter_token_latency = Histogram(
            "kvserve:inter_token_latency_seconds",
            "Time between two successive tokens of one request.",
            buckets=_ITL_BUCKETS,
            labelnames=(MODEL,),
            registry=r,
        )
        self.e2e_request_latency = Histogram(
            "kvserve:e2e_request_latency_seconds",
            "Time from arrival to the end of the request, however it ended.",
            buckets=_REQUEST_BUCKETS,
            labelnames=(MODEL,),
            registry=r,
        )
        self.request_queue_time = Histogram(
            "kvserve:request_queue_time_seconds",
            "Time from arrival to admission (a slot and KV blocks).",
            buckets=_REQUEST_BUCKETS,
            labelnames=(MODEL,),
            registry=r,
        )
        self.num_requests_running = Gauge(
            "kvserve:num_requests_running",
            "Requests holding a slot.",
            labelnames=(MODEL,),
            registry=r,
        )
        self.num_requests_waiting = Gauge(
            "kvserve:num_requests_waiting",
            "Requests in the admission queue, and preempted sequences waiting to resume.",
            labelnames=(MODEL,),
            registry=r,
        )
        self.kv_cache_usage = Gauge(
            "kvserve:kv_cache_usage_perc",
            "Fraction of KV cache blocks in use (1 = full).",
            labelnames=(MODEL,),
            registry=r,
        )
        self.num_kv_blocks = Gauge(
            "kvserve:num_kv_blocks", "Blocks in the KV cache pool.", labelnames=(MODEL,), registry=r
        )
        self.kv_cache_block_size = Gauge(
            "kvserve:kv_cache_block_size",
            "Token positions per KV block.",
            labelnames=(MODEL,),
            registry=r,
        )
        self.kv_cache_block_bytes = Gauge(
            "kvserve:kv_cache_block_bytes",
            "Bytes of one KV block (K and V of every layer).",
            labelnames=(MODEL,),
            registry=r,
        )
        self.num_free_kv_blocks = Gauge(
            "kvserve:num_free_kv_blocks",
            "Blocks no request holds (free, or cached-free and evictable).",
            labelnames=(MODEL,),
            registry=r,
        )
        self.num_cached_free_kv_blocks = Gauge(
            "kvserve:num_cached_free_kv_blocks",
            "Blocks no request holds that keep a cached prefix until evicted.",
            labelnames=(MODEL,),
            registry=r,
        )
        self.prompt_tokens = Counter(
            "kvserve:prompt_tokens",
            "Prompt tokens of admitted requests.",
            labelnames=(MODEL,),
            registry=r,
        )
        self.generation_tokens = Counter(
            "kvserve:generation_tokens", "Generated tokens.", labelnames=(MODEL,), registry=r
        )
        self.num_preemptions = Counter(
            "kvserve:num_preemptions",
            "Sequences preempted (their blocks given back, resumed later by recompute).",
            labelnames=(MODEL,),
            registry=r,
        )
        self.kv_window_blocks_freed = Counter(
            "kvserve:kv_window_blocks_freed",
            "KV blocks given back to the pool while their sequences ran, because they fell "
            "behind the sliding window of a model whose every layer is windowed.",
            labelnames=(MODEL,),
            registry=r,
        )
        self._window_blocks_seen = 0  # the engine's count at the last step
        self.spec_decode_num_drafts = Counter(
            "kvserve:spec_decode_num_drafts",
            "Speculative verifications (one per sequence per step that guessed).",
            labelnames=(MODEL,),
            registry=r,
        )
        self.spec_decode_num_draft_tokens = Counter(
            "kvserve:spec_decode_num_draft_tokens",
            "Guessed tokens verified.",
            labelnames=(MODEL,),
            registry=r,
        )
        self.spec_decode_num_accepted_tokens = Counter(
            "kvserve:spec_decode_num_accepted_tokens",
            "Guessed tokens accepted.",
            labelnames=(MODEL,),
            registry=r,
        )
        self.spec_decode_num_accepted_tokens_per_pos = Counter(
            "kvserve:spec_decode_num_accepted_tokens_per_pos",
            "Guessed tokens accepted, by their position in the guess (0 = the first).",
            [MODEL, "position"],
            registry=r,
        )
        self.prefix_cache_queries = Counter(
            "kvserve:prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache (admitted requests, cache on).",
            labelnames=(MODEL,),
            registry=r,
        )
        self.prefix_cache_hits = Counter(
            "kvserve:prefix_cache_hits",
            "Prompt tokens found in the prefix cache (their KV was reused, not computed).",
            labelnames=(MODEL,),
            registry=r,
        )
        self.request_success = Counter(
            "kvserve:request_success",
            "Requests that ended, by finish reason.",
            [MODEL, "finished_reason"],
            registry=r,
        )
        self.rejections = Counter(
            "kvserve:request_rejections",
            "Requests refused or dropped for load or by the client, by reason.",
            [MODEL, "reason"],
            registry=r,
        )
        self.http_requests = Counter(
            "kvserve:http_requests",
            "HTTP requests answered, by endpoint and status (499: the client left).",
            ["endpoint", "status"],
            registry=r,
        )
        self.http_server_errors = Counter(
            "kvserve:http_server_errors",
            "HTTP requests answered with a 5xx status (a drain's 503s are rejections).",
            ["endpoint"],
            registry=r,
        )
        self.draining = Gauge(
            "kvserve:server_draining",
            "1 while the server drains to stop: new requests get 503, running ones finish.",
            registry=r,
        )
        self.ignored_fields = Counter(
            "kvserve:ignored_fields",
            "Request fields accepted without effect, by name.",
            ["field"],
            registry=r,
        )
        self._field_labels: set[str] = set()
        self._init_embedding_metrics()
        self.embedding_endpoints: frozenset[str] = frozenset()
        """The HTTP paths of embedding requests: a client that leaves one is counted here."""

    def _init_embedding_metrics(self) -> None:
        r = self.registry
        self.embedding_requests = Counter(
            "kvserve:embedding_requests",
            "Embedding requests that ended, by outcome (done, cancelled, queue_timeout, ...).",
            [MODEL, "outcome"],
            registry=r,
        )
        self.embedding_inputs = Counter(
            "kvserve:embedding_inputs",
            "Inputs of finished embedding requests.",
            labelnames=(MODEL,),
            registry=r,
        )
        self.embedding_prompt_tokens = Counter(
            "kvserve:embedding_prompt_tokens",
            "Tokens of the inputs of finished embedding requests.",
            labelnames=(MODEL,),
            registry=r,
        )
        self.embedding_request_latency = Histogram(
            "kvserve:embedding_request_latency_seconds",
            "Time from arrival to the vectors of a finished embedding request.",
            buckets=_TTFT_BUCKETS,
            labelnames=(MODEL,),
            registry=r,
        )
        self.embedding_queue_time = Histogram(
            "kvserve:embedding_queue_time_seconds",
            "Time from arrival to the first forward pass of an embedding request.",
            buckets=_TTFT_BUCKETS,
            labelnames=(MODEL,),
            registry=r,
        )
        self.embedding_batches = Counter(
            "kvserve:embedding_batches",
            "Forward passes run for embeddings.",
            labelnames=(MODEL,),
            registry=r,
        )
        self.embedding_batch_inputs = Counter(
            "kvserve:embedding_batch_inputs",
            "Inputs embedded by those passes (over batches: the mean batch size).",
            labelnames=(MODEL,),
            registry=r,
        )
        self.embedding_rejections = Counter(
            "kvserve:embedding_rejections",
            "Embedding requests refused or dropped for load or by the client, by reason.",
            [MODEL, "reason"],
            registry=r,
        )
        self.num_embedding_requests_waiting = Gauge(
            "kvserve:num_embedding_requests_waiting",
            "Embedding requests none of whose inputs has started.",
            labelnames=(MODEL,),
            registry=r,
        )
        self.num_embedding_requests_running = Gauge(
            "kvserve:num_embedding_requests_running",
            "Embedding requests with inputs started and not all done.",
            labelnames=(MODEL,),
            registry=r,
        )

    def for_model(self, model: ServedModel) -> ModelMetrics:
        """The observer of `model`'s engines: its samples carry its `model_name` label."""
        observer = self._models.get(id(model))
        if observer is None:
            observer = self._models[id(model)] = ModelMetrics(self, model)
        return observer

    # -- HTTP level ----------------------------------------------------------------------------

    def observe_http(
        self,
        endpoint: str,
        status: int,
        *,
        client_gone: bool = True,
        shutting_down: bool = False,
        model_name: str = "",
    ) -> None:
        """Count one answered request; 499 is counted as such (and, unless `client_gone` is
        False, as a client_gone rejection), never as a server error; so is a 503 refused by a
        drain (`shutting_down`), as a shutting_down rejection (of `model_name`)."""
        self.http_requests.labels(endpoint, str(status)).inc()
        if shutting_down:
            if endpoint in self.embedding_endpoints:
                self.embedding_rejections.labels(model_name, "shutting_down").inc()
            else:
                self.rejections.labels(model_name, "shutting_down").inc()
        elif status == 499:
            if endpoint in self.embedding_endpoints:
                self.embedding_rejections.labels(model_name, "client_gone").inc()
            elif client_gone:
                self.rejections.labels(model_name, "client_gone").inc()
        elif status >= 500:
            self.http_server_errors.labels(endpoint).inc()

    def observe_ignored_fields(self, names: Iterable[str]) -> None:
        for name in names:
            label = name[:64]
            if label not in self._field_labels:
                if len(self._field_labels) >= _MAX_FIELD_LABELS:
                    label = "_other"
                else:
                    self._field_labels.add(label)
            self.ignored_fields.labels(label).inc()

    def render(self) -> tuple[bytes, str]:
        """The exposition text and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class ModelMetrics(EngineObserver):
    """One served model's observer: its engines' hooks recorded under its `model_name`; its
    gauges read whichever engine it has loaded at scrape time (0 while none)."""

    def __init__(self, metrics: ServerMetrics, model: ServedModel) -> None:
        self._m = metrics
        self._model = model
        self._exported: str | None = None
        self._window_blocks_seen = 0  # the engine's count at the last step

    @property
    def label(self) -> str:
        return self._model.name or ""

    @property
    def _engine(self) -> Engine | None:
        return self._model.engine

    def export(self) -> None:
        """Every series of this model from 0 under its name (once it has one): the rejection
        reasons, the counters and the gauges, so /metrics lists a model before it loads."""
        label = self.label
        if self._exported == label or not label:
            return
        self._exported = label
        m = self._m
        for reason in REJECTION_REASONS:
            m.rejections.labels(label, reason)
        for reason in EMBEDDING_REJECTION_REASONS:
            m.embedding_rejections.labels(label, reason)
        for series in (
            m.time_to_first_token,
            m.inter_token_latency,
            m.e2e_request_latency,
            m.request_queue_time,
            m.prompt_tokens,
            m.generation_tokens,
            m.num_preemptions,
            m.kv_window_blocks_freed,
            m.spec_decode_num_drafts,
            m.spec_decode_num_draft_tokens,
            m.spec_decode_num_accepted_tokens,
            m.prefix_cache_queries,
            m.prefix_cache_hits,
            m.embedding_inputs,
            m.embedding_prompt_tokens,
            m.embedding_request_latency,
            m.embedding_queue_time,
            m.embedding_batches,
            m.embedding_batch_inputs,
        ):
            series.labels(label)
        for gauge, read in (
            (m.num_requests_running, lambda engine: engine.num_running),
            (m.num_requests_waiting, lambda engine: engine.num_waiting + engine.num_preempted),
            (m.kv_cache_usage, lambda engine: engine.pool.usage),
            (m.num_kv_blocks, lambda engine: engine.pool.num_blocks),
            (m.kv_cache_block_size, lambda engine: engine.pool.block_size),
            (m.kv_cache_block_bytes, lambda engine: engine.pool_size.bytes_per_block),
            (m.num_free_kv_blocks, lambda engine: engine.pool.num_free),
            (m.num_cached_free_kv_blocks, lambda engine: engine.pool.num_cached_free),
        ):
            gauge.labels(label).set_function(self._reader(read))
        for gauge, read in (
            (m.num_embedding_requests_waiting, lambda embedder: embedder.num_waiting),
            (m.num_embedding_requests_running, lambda embedder: embedder.num_running),
        ):
            gauge.labels(label).set_function(self._embedder_reader(read))

    def _reader(self, read):
        def value() -> float:
            engine = self._engine
            return 0.0 if engine is None or engine.scheduler is None else float(read(engine))

        return value

    def _embedder_reader(self, read):
        def value() -> float:
            embedder = getattr(self._engine, "embedder", None)
            return 0.0 if embedder is None else float(read(embedder))

        return value

    def bind(self, engine: Engine) -> None:
        """A new engine of this model: export its series (and each guess position's
        acceptance from 0 when it speculates)."""
        self.export()
        self._window_blocks_seen = 0
        spec = getattr(getattr(engine, "config", None), "speculative", None)
        if spec is not None:
            for position in range(spec.num_speculative_tokens):
                self._m.spec_decode_num_accepted_tokens_per_pos.labels(self.label, str(position))

    # -- engine hooks (event loop thread) ------------------------------------------------------

    def on_admitted(self, state: RequestState) -> None:
        if state.admitted_at is not None:
            self._m.request_queue_time.labels(self.label).observe(
                state.admitted_at - state.request.arrival_time
            )
        self._m.prompt_tokens.labels(self.label).inc(state.num_prompt_tokens)
        engine = self._engine
        if engine is not None and engine.pool.cache is not None:
            self._m.prefix_cache_queries.labels(self.label).inc(state.num_prompt_tokens)
            self._m.prefix_cache_hits.labels(self.label).inc(state.num_cached_tokens)

    def on_token(self, state: RequestState, now: float, num_tokens: int = 1) -> None:
        if state.last_token_at is None:
            self._m.time_to_first_token.labels(self.label).observe(now - state.request.arrival_time)
        else:
            self._m.inter_token_latency.labels(self.label).observe(now - state.last_token_at)
        self._m.generation_tokens.labels(self.label).inc(num_tokens)

    def on_finished(self, state: RequestState) -> None:
        if state.finished_at is not None:
            self._m.e2e_request_latency.labels(self.label).observe(
                state.finished_at - state.request.arrival_time
            )
        self._m.request_success.labels(self.label, state.finish_reason or "unknown").inc()

    def on_rejected(self, reason: str) -> None:
        self._m.rejections.labels(self.label, reason).inc()

    def on_preempted(self, state: RequestState, num_sequences: int) -> None:
        self._m.num_preemptions.labels(self.label).inc(num_sequences)

    def on_step(self, plan, seconds: float) -> None:
        kv = getattr(self._engine, "kv", None)
        freed = getattr(kv, "num_window_freed", 0)
        if freed < self._window_blocks_seen:  # another engine since (a model loaded again)
            self._window_blocks_seen = 0
        if freed > self._window_blocks_seen:
            self._m.kv_window_blocks_freed.labels(self.label).inc(freed - self._window_blocks_seen)
            self._window_blocks_seen = freed

    def on_speculated(
        self, state: RequestState, num_drafted: int, num_accepted: int, seq_id: str
    ) -> None:
        self._m.spec_decode_num_drafts.labels(self.label).inc()
        self._m.spec_decode_num_draft_tokens.labels(self.label).inc(num_drafted)
        self._m.spec_decode_num_accepted_tokens.labels(self.label).inc(num_accepted)
        for position in range(num_accepted):
            self._m.spec_decode_num_accepted_tokens_per_pos.labels(self.label, str(position)).inc()

    def on_embedding_finished(self, job: EmbeddingJob) -> None:
        outcome = job.outcome or "unknown"
        self._m.embedding_requests.labels(self.label, outcome).inc()
        if outcome == "queue_timeout":
            self._m.embedding_rejections.labels(self.label, "queue_timeout").inc()
        if job.started_at is not None:
            self._m.embedding_queue_time.labels(self.label).observe(
                job.started_at - job.arrival_time
            )
        if outcome == "done" and job.finished_at is not None:
            self._m.embedding_inputs.labels(self.label).inc(len(job.inputs))
            self._m.embedding_prompt_tokens.labels(self.label).inc(job.num_tokens)
            self._m.embedding_request_latency.labels(self.label).observe(
                job.finished_at - job.arrival_time
            )

    def on_embedding_rejected(self, reason: str) -> None:
        self._m.embedding_rejections.labels(self.label, reason).inc()

    def on_embedding_batch(self, num_inputs: int, num_tokens: int, seconds: float) -> None:
        self._m.embedding_batches.labels(self.label).inc()
        self._m.embedding_batch_inputs.labels(self.label).inc(num_inputs)
