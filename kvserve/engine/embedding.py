"""Embeddings: the inputs of many requests batched into forward passes on the device thread.

An `Embedder` owns a bounded queue of embedding jobs (one per HTTP request, each with one or
more inputs of token ids). Its loop, on the event loop's thread, takes the waiting inputs in
arrival order up to a token budget, runs them as one batch on the device thread (where every
forward pass runs, generation steps included: they take turns), and hands each job its vectors
once all of its inputs are done. So inputs of concurrent requests share a forward pass, and a
request with many inputs is spread over several.

The rules of generation's admission apply: a job that finds `max_jobs` unfinished jobs is
refused at once (QueueFull, 429); one whose first input has not started within the wait budget
ends with QueueTimeout (429); a client that leaves cancels its job (its inputs not yet started
never run). A batch that fails fails its jobs, not the embedder.

Two models embed: an encoder (`kvserve.model.bert`, served by an `EmbeddingEngine`, which
generates nothing), and a decoder served by the generation `Engine`, whose final hidden states
are pooled (`DecoderEmbeddings`: the last token's, or the mean of all) and L2-normalized.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from kvserve.config import DeviceConfig, EngineConfig
from kvserve.model import device_thread
from kvserve.request import (
    EngineError,
    EngineStopped,
    InvalidRequest,
    QueueFull,
    QueueTimeout,
    RequestCancelled,
)

if TYPE_CHECKING:
    from kvserve.engine.engine import Engine
    from kvserve.model.bert import LoadedEncoder
    from kvserve.model.llama import LlamaModel

__all__ = [
    "DECODER_POOLING",
    "DecoderEmbeddings",
    "Embedder",
    "EmbeddingEngine",
    "EmbeddingJob",
    "EmbeddingObserver",
    "build_engine",
    "decoder_embedder",
]

log = logging.getLogger("kvserve.engine")

DECODER_POOLING = ("last", "mean")
"""How a decoder's token states become one vector (`--pooling`)."""

MAX_INPUTS_PER_REQUEST = 2048
"""At most this many inputs in one request, as OpenAI allows."""

MAX_BATCH_INPUTS = 256
"""At most this many inputs in one forward pass."""


class EmbeddingObserver:
    """Hooks for the metrics and the dashboard; every method is a no-op here. Called on the
    event loop's thread."""

    def on_embedding_finished(self, job: EmbeddingJob) -> None:
        """A job ended (`job.outcome` says how)."""

    def on_embedding_rejected(self, reason: str) -> None:
        """A job was refused before it was queued (`queue_full`)."""

    def on_embedding_batch(self, num_inputs: int, num_tokens: int, seconds: float) -> None:
        """A forward pass embedded `num_inputs` inputs of `num_tokens` tokens."""


@dataclass(eq=False)
class EmbeddingJob:
    """One request's inputs and, once done, their vectors (`await job.result()`)."""

    request_id: str
    inputs: list[list[int]]
    arrival_time: float
    started_at: float | None = None  # its first input went into a batch
    finished_at: float | None = None
    outcome: str | None = None  # done | cancelled | queue_timeout | error | shutdown
    _taken: int = 0  # inputs handed to batches so far
    _vectors: list[torch.Tensor | None] = field(default_factory=list, repr=False)
    _num_done: int = 0
    _future: asyncio.Future[torch.Tensor] | None = field(default=None, repr=False)

    @property
    def num_tokens(self) -> int:
        return sum(len(ids) for ids in self.inputs)

    async def result(self) -> torch.Tensor:
        """The vectors, [inputs, dimensions] float32 in input order; raises the error that
        ended the job (QueueTimeout, RequestCancelled, EngineStopped, EngineError)."""
        assert self._future is not None
        return await asyncio.shield(self._future)


class Embedder:
    """Batches embedding jobs into forward passes of `encode` (inputs of token ids ->
    [inputs, dimensions] float32), run on the device thread. Create and use on the event
    loop's thread."""

    def __init__(
        self,
        encode: Callable[[list[Sequence[int]]], torch.Tensor],
        *,
        dimensions: int,
        max_input_tokens: int,
        vocab_size: int,
        tokenize: Callable[[str, bool], list[int]],
        max_batch_tokens: int,
        max_jobs: int,
        queue_timeout: float,
        observer: EmbeddingObserver | None = None,
    ) -> None:
        self._encode = encode
        self.dimensions = dimensions
        self.max_input_tokens = max_input_tokens
        self.vocab_size = vocab_size
        self._tokenize = tokenize
        self.max_batch_tokens = max(max_batch_tokens, max_input_tokens)
        self.max_jobs = max_jobs
        self.queue_timeout = queue_timeout
        self.observer = observer or EmbeddingObserver()
        self._jobs: dict[str, EmbeddingJob] = {}
        self._waiting: deque[EmbeddingJob] = deque()  # jobs with inputs not yet taken
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._stopping = False
        self.num_batches = 0

    # -- inputs --------------------------------------------------------------------------------

    def tokenize(self, text: str, *, truncate: bool = False) -> list[int]:
        """The model's input ids for `text` (its special tokens included). Longer than
        `max_input_tokens`: cut to it with `truncate`, else InvalidRequest (400). Thread-safe:
        call it off the event loop for long texts."""
        ids = self._tokenize(text, truncate)
        return self.fit(ids, truncate=truncate)

    def fit(self, token_ids: Sequence[int], *, truncate: bool = False) -> list[int]:
        """Token ids as an input: each in the vocabulary, at most `max_input_tokens` (cut to
        it with `truncate`, else InvalidRequest)."""
        ids = list(token_ids)
        if not ids:
            raise InvalidRequest("an input has no tokens", "input")
        if any(not 0 <= t < self.vocab_size for t in ids):
            raise InvalidRequest(f"token ids must be in [0, {self.vocab_size})", "input")
        if len(ids) > self.max_input_tokens:
            if not truncate:
                raise InvalidRequest(
                    f"an input has {len(ids)} tokens, more than this model's "
                    f"{self.max_input_tokens}; shorten it or ask for truncation",
                    "input",
                )
            ids = ids[: self.max_input_tokens]
        return ids

    # -- lifecycle -----------------------------------------------------------------------------

    async def start(self) -> None:
        if self._task is not None:
            return
        self._wake = asyncio.Event()
        self._stopping = False
        self._task = asyncio.create_task(self._run(), name="kvserve-embedder")

    async def stop(self) -> None:
        """End every job (EngineStopped); let a batch in flight land."""
        if self._task is None:
            return
        self._stopping = True
        assert self._wake is not None
        self._wake.set()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self._task = None

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done() and not self._stopping

    @property
    def num_waiting(self) -> int:
        """Jobs none of whose inputs has started."""
        return sum(1 for job in self._waiting if job.started_at is None)

    @property
    def num_running(self) -> int:
        """Jobs with inputs started and not all done."""
        return len(self._jobs) - self.num_waiting

    def is_idle(self) -> bool:
        return not self._jobs and not self._waiting

    # -- jobs ----------------------------------------------------------------------------------

    def submit(
        self, request_id: str, inputs: Sequence[Sequence[int]], arrival_time: float | None = None
    ) -> EmbeddingJob:
        """Queue a job of inputs (each as `fit` returns them). Raises InvalidRequest (400),
        QueueFull (429) or EngineStopped; nothing is registered when it raises."""
        if not self.running:
            raise EngineStopped("the engine is not running")
        if request_id in self._jobs:
            raise InvalidRequest(f"request id {request_id!r} is already in use", "request_id")
        if len(inputs) > MAX_INPUTS_PER_REQUEST:
            raise InvalidRequest(
                f"at most {MAX_INPUTS_PER_REQUEST} inputs per request, got {len(inputs)}",
                "input",
            )
        checked = [self.fit(ids) for ids in inputs]
        if len(self._jobs) >= self.max_jobs:
            self.observer.on_embedding_rejected("queue_full")
            raise QueueFull(self.queue_timeout)
        job = EmbeddingJob(
            request_id,
            checked,
            time.monotonic() if arrival_time is None else arrival_time,
            _vectors=[None] * len(checked),
        )
        job._future = asyncio.get_running_loop().create_future()
        self._jobs[request_id] = job
        if checked:
            self._waiting.append(job)
            assert self._wake is not None
            self._wake.set()
        else:
            self._finish(job, "done")
        return job

    def cancel(self, request_id: str) -> bool:
        """End a job now: its inputs not yet started never run. False when unknown or over."""
        job = self._jobs.get(request_id)
        if job is None:
            return False
        self._finish(job, "cancelled", RequestCancelled("the client closed the request"))
        return True

    def _finish(self, job: EmbeddingJob, outcome: str, error: EngineError | None = None) -> None:
        """The one release path of a job, however it ends. Idempotent."""
        if self._jobs.get(job.request_id) is not job:
            return
        del self._jobs[job.request_id]
        with contextlib.suppress(ValueError):
            self._waiting.remove(job)
        job.outcome = outcome
        job.finished_at = time.monotonic()
        assert job._future is not None
        if error is not None:
            job._future.set_exception(error)
            job._future.exception()  # mark retrieved: the client may be gone
        else:
            vectors = [v for v in job._vectors if v is not None]
            empty = torch.empty(0, self.dimensions)
            job._future.set_result(torch.stack(vectors) if vectors else empty)
        job._vectors = []
        self.observer.on_embedding_finished(job)

    # -- the loop ------------------------------------------------------------------------------

    async def _run(self) -> None:
        assert self._wake is not None
        try:
            while not self._stopping:
                self._expire(time.monotonic())
                if not self._waiting:
                    self._wake.clear()
                    await self._sleep()
                    continue
                await self._batch()
                # Let the HTTP side take the finished jobs before the next pass starts.
                await asyncio.sleep(0)
        finally:
            for job in list(self._jobs.values()):
                self._finish(job, "shutdown", EngineStopped("the server is shutting down"))

    async def _sleep(self) -> None:
        assert self._wake is not None
        deadlines = [
            job.arrival_time + self.queue_timeout for job in self._waiting if job.started_at is None
        ]
        timeout = None if not deadlines else max(0.0, min(deadlines) - time.monotonic())
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._wake.wait(), timeout)

    def _expire(self, now: float) -> None:
        for job in list(self._waiting):
            if job.started_at is None and now - job.arrival_time >= self.queue_timeout:
                self._finish(job, "queue_timeout", QueueTimeout(self.queue_timeout))

    def _take(self) -> list[tuple[EmbeddingJob, int]]:
        """The next batch: waiting inputs in arrival order, up to the token budget."""
        batch: list[tuple[EmbeddingJob, int]] = []
        tokens = 0
        now = time.monotonic()
        while self._waiting and len(batch) < MAX_BATCH_INPUTS:
            job = self._waiting[0]
            size = len(job.inputs[job._taken])
            if batch and tokens + size > self.max_batch_tokens:
                break
            if job.started_at is None:
                job.started_at = now
            batch.append((job, job._taken))
            tokens += size
            job._taken += 1
            if job._taken == len(job.inputs):
                self._waiting.popleft()
        return batch

    async def _batch(self) -> None:
        batch = self._take()
        inputs = [job.inputs[index] for job, index in batch]
        started = time.monotonic()
        try:
            vectors = await asyncio.get_running_loop().run_in_executor(
                device_thread.executor(), self._encode, inputs
            )
        except Exception as exc:  # a failed batch fails its jobs, not the embedder
            log.exception("an embedding batch failed")
            error = EngineError(f"internal error while embedding: {type(exc).__name__}: {exc}")
            for job, _ in batch:
                self._finish(job, "error", error)
            return
        self.num_batches += 1
        self.observer.on_embedding_batch(
            len(inputs), sum(len(ids) for ids in inputs), time.monotonic() - started
        )
        for (job, index), vector in zip(batch, vectors, strict=True):
            if self._jobs.get(job.request_id) is not job:
                continue  # cancelled meanwhile: its vectors are dropped
            job._vectors[index] = vector
            job._num_done += 1
            if job._num_done == len(job.inputs):
                self._finish(job, "done")


# --------------------------------------------------------------------------------------------
# Decoders


@dataclass(frozen=True, slots=True)
class _Chunk:
    """One input as a prefill chunk of its own (kvserve.model.attention.ChunkLike)."""

    start: int
    num_tokens: int
    block_ids: Sequence[int]
    samples: bool = True


class DecoderEmbeddings:
    """Embeddings from a decoder: each input runs as a prefill chunk of its own (causal
    attention) through a small KV cache of its own, the final norm's output of its rows is
    pooled (`last`: the last token's; `mean`: the average) and L2-normalized. Call on the
    device thread."""

    def __init__(
        self, model: LlamaModel, *, cache_dtype: torch.dtype, block_size: int, pooling: str
    ) -> None:
        if pooling not in DECODER_POOLING:
            raise ValueError(f"unknown pooling {pooling!r} (use {' or '.join(DECODER_POOLING)})")
        self.model = model
        self.cache_dtype = cache_dtype
        self.block_size = block_size
        self.pooling = pooling
        self._cache = None

    def _cache_for(self, num_blocks: int):
        from kvserve.model.kv_cache import KVCache

        # Grown to the largest batch seen, then kept: its memory is a batch's, not a pool's.
        if self._cache is None or self._cache.num_blocks < num_blocks:
            self._cache = KVCache(
                self.model.config, num_blocks, self.block_size, self.cache_dtype, self.model.device
            )
        return self._cache

    def __call__(self, inputs: list[Sequence[int]]) -> torch.Tensor:
        from kvserve.model.attention import build_metadata

        chunks = []
        next_block = 0
        for ids in inputs:
            num_blocks = math.ceil(len(ids) / self.block_size)
            chunks.append(_Chunk(0, len(ids), range(next_block, next_block + num_blocks)))
            next_block += num_blocks
        cache = self._cache_for(next_block)
        device = self.model.device
        token_ids = torch.tensor([t for ids in inputs for t in ids], dtype=torch.long)
        meta = build_metadata(chunks, self.block_size, device, native=self.model.native)
        hidden = self.model.hidden_states(token_ids.to(device), meta, cache)  # [rows, hidden]
        lengths = torch.tensor([len(ids) for ids in inputs])
        if self.pooling == "last":
            vectors = hidden[lengths.cumsum(0) - 1]
        else:
            segments = torch.repeat_interleave(torch.arange(len(inputs)), lengths)
            sums = torch.zeros(len(inputs), hidden.shape[1], dtype=torch.float32)
            sums.index_add_(0, segments.to(hidden.device), hidden.float().cpu())
            vectors = sums / lengths.unsqueeze(-1)
        return F.normalize(vectors.float().cpu(), p=2, dim=-1)


def decoder_embedder(engine: Engine) -> Embedder:
    """The Embedder of a generation engine's model (its `config.embedding.pooling`)."""
    tokenizer = engine.tokenizer
    encode = DecoderEmbeddings(
        engine.loaded.model,
        cache_dtype=engine.kv_cache.kv.dtype,
        block_size=engine.config.cache.block_size,
        pooling=engine.config.embedding.pooling,
    )

    def tokenize(text: str, truncate: bool) -> list[int]:
        return tokenizer.encode(text, add_bos=tokenizer.add_bos)

    return _embedder(
        engine.config,
        encode,
        engine.model_config.hidden_size,
        engine.max_model_len,
        engine.model_config.vocab_size,
        tokenize,
        engine.observer,
    )


def _embedder(
    config: EngineConfig,
    encode: Callable[[list[Sequence[int]]], torch.Tensor],
    dimensions: int,
    max_input_tokens: int,
    vocab_size: int,
    tokenize: Callable[[str, bool], list[int]],
    observer: EmbeddingObserver | None,
) -> Embedder:
    slots = config.scheduler.max_num_seqs
    return Embedder(
        encode,
        dimensions=dimensions,
        max_input_tokens=max_input_tokens,
        vocab_size=vocab_size,
        tokenize=tokenize,
        max_batch_tokens=config.scheduler.max_num_batched_tokens,
        # As many jobs as generation admits: the slots and their waiters.
        max_jobs=slots * (1 + config.queue.max_queue_per_slot),
        queue_timeout=config.queue.queue_timeout,
        observer=observer,
    )


# --------------------------------------------------------------------------------------------
# Encoders: an engine that only embeds


class EmbeddingEngine:
    """The engine of an embedding-only model (a BERT-family encoder): the same lifecycle as
    the generation Engine (`await start()`, `stop()`, `running`) and its `embedder`; it
    generates nothing (`generates` is False), so it has no scheduler, KV pool or queue of
    generation requests."""

    generates = False
    scheduler = None

    def __init__(
        self,
        config: EngineConfig = EngineConfig(),
        loaded: LoadedEncoder | None = None,
        *,
        observer: EmbeddingObserver | None = None,
    ) -> None:
        self.config = config
        self.loaded = loaded or load_encoder_model(config.model, config.device)
        self.tokenizer = self.loaded.tokenizer
        self.model_config = self.loaded.config
        self.max_model_len = self.loaded.config.max_input_tokens
        self.observer = observer
        model, tokenizer = self.loaded.model, self.loaded.tokenizer
        self.embedder = _embedder(
            config,
            model.embed,
            model.dimensions,
            self.max_model_len,
            tokenizer.vocab_size,
            lambda text, truncate: tokenizer.encode(text, truncate=truncate),
            observer,
        )
        self.num_steps = 0

    async def start(self) -> None:
        await self.embedder.start()

    async def stop(self) -> None:
        await self.embedder.stop()

    @property
    def running(self) -> bool:
        return self.embedder.running

    @property
    def num_running(self) -> int:
        return 0

    @property
    def num_waiting(self) -> int:
        return 0

    def is_idle(self) -> bool:
        return self.embedder.is_idle()

    def describe_precision(self) -> str:
        return f"precision: {str(self.loaded.dtype).removeprefix('torch.')} (an encoder)"


def load_encoder_model(model: str | None, device_config: DeviceConfig) -> LoadedEncoder:
    """Load an encoder directory on the device thread (float32 unless a dtype is named: the
    encoders served are small, and their vectors are compared to 4 decimals)."""
    from kvserve.model.bert import load_encoder
    from kvserve.model.loader import configure_threads, resolve_device, resolve_dtype
    from kvserve.model.paths import resolve_model_path

    def load() -> LoadedEncoder:
        path = resolve_model_path(model)
        device = resolve_device(device_config.device)
        dtype = (
            torch.float32
            if device_config.dtype == "auto"
            else resolve_dtype(device_config.dtype, device)
        )
        if device.type == "cpu":
            configure_threads(device_config.num_threads)
        loaded = load_encoder(path, device, dtype)
        log.info(loaded.summary())
        return loaded

    return device_thread.call(load)


def build_engine(
    config: EngineConfig, observer: EmbeddingObserver | None = None, **kwargs
) -> Engine | EmbeddingEngine:
    """The engine for `config.model`: an EmbeddingEngine for an encoder directory, else the
    generation Engine (whose model also embeds)."""
    from kvserve.model.bert import is_encoder_dir
    from kvserve.model.paths import resolve_model_path

    if config.model and is_encoder_dir(resolve_model_path(config.model)):
        return EmbeddingEngine(config, observer=observer)
    from kvserve.engine.engine import Engine

    return Engine(config, observer=observer, **kwargs)
