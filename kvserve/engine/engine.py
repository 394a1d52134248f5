"""The Engine: one loop that owns all serving state and runs steps while there is work.

    plan = scheduler.schedule()                        # loop thread; may preempt
    output = batch.execute(plan, rows, scored)         # device thread
    finished = scheduler.update_from_output(           # loop thread; the one stop check,
        plan, sampled, stopped)                        #   publishes full blocks
    deliver                                            # loop thread; tokens to streams

Bookkeeping (Scheduler, BlockPool, AdmissionQueue, request states, streams) lives on the event
loop's thread and is only touched there: `submit` and `cancel` are plain synchronous methods
called from that thread, and the loop applies cancellations, queue expiry and admission at step
boundaries. The only thing that runs elsewhere is `Batch.execute`, on the device thread, which
reads the plan (immutable, with every row's input token built in) and the sampling rows' states
(built on the loop thread before the step; nothing modifies them while it runs).

A request asks for n answers (`SamplingParams.n`); each is a `kvserve.core.Sequence` (its
tokens, counts, budget and status, created at submit and moved through its statuses by the
scheduler) with an `Answer` here for what delivering needs (detokenizer, generator, grammar
matcher). The prompt is prefilled once for all n (see kvserve/core/scheduler.py).

Each sampled token is first given to its answer's grammar matcher and detokenizer, which say
whether a stop string or a complete grammar ends the answer; the scheduler's update then runs
the one stop check (stop token, that verdict, the budget) and reports the answers that ended.
A preempted sequence keeps its tokens, its generator and its matcher; it resumes by
recomputing the KV of what it had, which samples nothing until its next new token.

Every way a request ends — finish, stop string, cancel, slow consumer, queue timeout, error,
shutdown — sets its sequences' finished status and goes through `_end`, which ends its stream
with a final delta carrying the finish reason and usage; `_release` only frees: slots and blocks
back (Scheduler.release, which also offers the capacity signal) or its place in the queue, and
its grammar states dropped.

A request under structured output whose grammar is not compiled yet waits with its sequences
WAITING_FOR_GRAMMAR: registered (it can be cancelled) but neither queued nor holding a slot. The
grammar compiles on the structured-output worker; when it lands, the request joins admission as
any other (or ends with a 400 if the grammar engine refused it). Each answer has its own matcher.

A request that asks for prompt log-probabilities computes its whole prompt: cached blocks never
stand in for rows whose logits it needs (and a preemption before its first token scores the
prompt again from the start).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Sequence as Seq
from concurrent.futures import Future
from dataclasses import dataclass, replace

import torch

from kvserve.config import EngineConfig
from kvserve.core import (
    AdmissionQueue,
    BlockPool,
    CapacitySignal,
    Infeasible,
    KVManager,
    Outcome,
    Prompt,
    Scheduler,
    Sequence,
    SequenceStatus,
    StepPlan,
    admit_or_enqueue,
    admit_waiting,
    make_sequences,
)
from kvserve.core.spec import propose_ngram
from kvserve.engine.batch import Batch, Sampled, StepOutput
from kvserve.engine.draft import DraftProposer, DraftRequest, check_same_vocabulary
from kvserve.engine.embedding import Embedder, EmbeddingJob, EmbeddingObserver, decoder_embedder
from kvserve.engine.sampler import RowState, Sampler, make_generator
from kvserve.engine.stream import Delta, Stream, TokenLogprob, Usage
from kvserve.engine.structured import GrammarError, GrammarState, StructuredOutputManager
from kvserve.model import device_thread
from kvserve.model.head import GuessHead
from kvserve.model.kv_cache import (
    KVCache,
    PoolSize,
    bytes_per_block,
    choose_cache_dtype,
    choose_pool_size,
)
from kvserve.model.loader import LoadedModel, load_model
from kvserve.params import SamplingParamsError
from kvserve.request import (
    EngineError,
    EngineStopped,
    GenerationRequest,
    InvalidRequest,
    QueueFull,
    QueueTimeout,
    RequestCancelled,
)

log = logging.getLogger("kvserve.engine")


class EngineObserver(EmbeddingObserver):
    """Hooks for metrics and logs (embeddings' too); every method is a no-op here. Called on
    the loop thread."""

    def on_admitted(self, state: RequestState) -> None: ...

    def on_token(self, state: RequestState, now: float, num_tokens: int = 1) -> None:
        """A step delivered `num_tokens` of the request's tokens (one per answer that got one)
        at `now`; `state.last_token_at` is still the previous step's time (None at first)."""

    def on_finished(self, state: RequestState) -> None: ...

    def on_rejected(self, reason: str) -> None: ...

    def on_preempted(self, state: RequestState, num_sequences: int) -> None:
        """A step preempted `num_sequences` of the request's answers (they resume later)."""

    def on_step(self, plan: StepPlan, seconds: float) -> None: ...

    def on_speculated(
        self, state: RequestState, num_drafted: int, num_accepted: int, seq_id: str
    ) -> None:
        """One of the request's answers (the sequence `seq_id`) verified `num_drafted` guesses
        and accepted the first `num_accepted` of them."""


class Observers(EngineObserver):
    """Several observers, each told everything in order."""

    def __init__(self, *observers: EngineObserver) -> None:
        self.observers = observers

    def on_admitted(self, state: RequestState) -> None:
        for observer in self.observers:
            observer.on_admitted(state)

    def on_token(self, state: RequestState, now: float, num_tokens: int = 1) -> None:
        for observer in self.observers:
            observer.on_token(state, now, num_tokens)

    def on_finished(self, state: RequestState) -> None:
        for observer in self.observers:
            observer.on_finished(state)

    def on_rejected(self, reason: str) -> None:
        for observer in self.observers:
            observer.on_rejected(reason)

    def on_preempted(self, state: RequestState, num_sequences: int) -> None:
        for observer in self.observers:
            observer.on_preempted(state, num_sequences)

    def on_step(self, plan: StepPlan, seconds: float) -> None:
        for observer in self.observers:
            observer.on_step(plan, seconds)

    def on_speculated(
        self, state: RequestState, num_drafted: int, num_accepted: int, seq_id: str
    ) -> None:
        for observer in self.observers:
            observer.on_speculated(state, num_drafted, num_accepted, seq_id)

    def on_embedding_finished(self, job: EmbeddingJob) -> None:
        for observer in self.observers:
            observer.on_embedding_finished(job)

    def on_embedding_rejected(self, reason: str) -> None:
        for observer in self.observers:
            observer.on_embedding_rejected(reason)

    def on_embedding_batch(self, num_inputs: int, num_tokens: int, seconds: float) -> None:
        for observer in self.observers:
            observer.on_embedding_batch(num_inputs, num_tokens, seconds)


@dataclass(frozen=True, slots=True)
class StepRecord:
    """Who got which rows in one step (kept by a StepRecorder)."""

    step: int
    started: float
    seconds: float
    chunks: tuple[tuple[str, int, int, bool], ...]  # (sequence id, start, num_tokens, is_prefill)

    @property
    def request_ids(self) -> tuple[str, ...]:
        return tuple(chunk[0] for chunk in self.chunks)


class StepRecorder(EngineObserver):
    """Keeps the last `maxlen` steps' records: which sequence got which rows."""

    def __init__(self, maxlen: int = 10_000) -> None:
        self.records: deque[StepRecord] = deque(maxlen=maxlen)

    def on_step(self, plan: StepPlan, seconds: float) -> None:
        chunks = tuple((c.request_id, c.start, c.num_tokens, c.is_prefill) for c in plan.chunks)
        self.records.append(StepRecord(plan.step, time.monotonic() - seconds, seconds, chunks))


@dataclass(eq=False)
class Answer:
    """One of a request's n answers: its sequence (kvserve.core.Sequence: tokens, counts,
    status) and what delivering its tokens needs."""

    seq: Sequence
    detokenizer: object
    generator: torch.Generator | None
    grammar: GrammarState | None = None  # structured output; dropped on release
    ended: bool = False  # its last delta (with its finish reason) was handed out

    @property
    def index(self) -> int:
        return self.seq.index

    @property
    def seq_id(self) -> str:
        return self.seq.seq_id

    @property
    def output_token_ids(self) -> list[int]:
        return self.seq.output_token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.seq.finish_reason


@dataclass(eq=False)
class RequestState:
    """The engine's view of one request, from submit to release: its answers, its stream, the
    times observers read. Counts and statuses live in the answers' sequences."""

    request: GenerationRequest
    stream: Stream
    answers: list[Answer]
    # One entry per prompt token scored so far (None for the first), when the request asked
    # for prompt logprobs; handed out with the first generated token.
    prompt_logprobs: list[TokenLogprob | None] | None = None
    cancel_reason: str | None = None  # set while admitted; applied at the next step boundary
    ended: bool = False  # the stream has its final delta
    final_index: int = 0  # the answer whose end ended the request
    admitted_at: float | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None
    finished_at: float | None = None

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def sequences(self) -> list[Sequence]:
        return [answer.seq for answer in self.answers]

    @property
    def status(self) -> SequenceStatus:
        """The first answer's status (all answers share it until they are admitted)."""
        return self.answers[0].seq.status

    @property
    def is_admitted(self) -> bool:
        """It has held slots (its answers run, are preempted, or some have finished)."""
        return self.admitted_at is not None

    @property
    def finish_reason(self) -> str | None:
        """Why the request ended (its last answer's reason); None while it has not."""
        return self.answers[self.final_index].finish_reason if self.ended else None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.request.prompt_token_ids)

    @property
    def num_cached_tokens(self) -> int:
        """Prompt tokens taken from the prefix cache (0 before admission)."""
        return self.answers[0].seq.num_cached_tokens

    @property
    def output_token_ids(self) -> list[int]:
        """The first answer's tokens (the only one when n = 1)."""
        return self.answers[0].output_token_ids

    @property
    def num_output_tokens(self) -> int:
        """Tokens sampled over every answer."""
        return sum(len(answer.output_token_ids) for answer in self.answers)

    def usage(self) -> Usage:
        return Usage(self.num_prompt_tokens, self.num_output_tokens, self.num_cached_tokens)

    def row_state(self, answer: Answer) -> RowState:
        return RowState(
            params=self.request.params,
            generator=answer.generator,
            prompt_token_ids=self.request.prompt_token_ids,
            output_token_ids=answer.output_token_ids,
            grammar=answer.grammar,
        )


class _WakingSignal(CapacitySignal):
    """The scheduler's capacity signal, also waking the engine loop when offered."""

    def __init__(self, wake: asyncio.Event) -> None:
        super().__init__()
        self._wake = wake

    def offer(self) -> bool:
        self._wake.set()
        return super().offer()


class Engine:
    """Continuous batching over a shared paged KV pool. Create, `await start()`, then `submit`.
    Its model also embeds: `embedder` (kvserve/engine/embedding.py), once started."""

    generates = True

    def __init__(
        self,
        config: EngineConfig = EngineConfig(),
        loaded: LoadedModel | None = None,
        *,
        observer: EngineObserver | None = None,
        record_steps: bool = False,
        draft: LoadedModel | None = None,
    ) -> None:
        """`draft`: the draft model already loaded (speculative method "draft_model"; by
        default it is loaded from the config's name or path)."""
        self.config = config
        spec = config.speculative
        self.loaded = loaded or load_model(config.model, config.device)
        self.draft: LoadedModel | None = None
        self.guess_head: GuessHead | None = None
        if spec is not None and spec.method == "draft_model":
            if self.loaded.config.kv_window is not None:
                raise ValueError(
                    "speculative decoding by a draft model needs a target without a sliding "
                    "window on every layer (its blocks behind the window are given back)"
                )
            self.draft = draft or load_model(
                spec.model, replace(config.device, requantize=spec.draft_requantize)
            )
            check_same_vocabulary(self.loaded.tokenizer, self.draft.tokenizer, spec.model)
            # Its own 4-bit head where its head is in GGUF blocks (None: its logits' argmax).
            self.guess_head = GuessHead.of(getattr(self.draft.model, "head", None))
        self.tokenizer = self.loaded.tokenizer
        if config.chat_template is not None:
            self.tokenizer = self.tokenizer.with_chat_template(config.chat_template)
        self.model_config = self.loaded.config
        self.recorder = StepRecorder() if record_steps else None
        observers = [o for o in (observer, self.recorder) if o is not None]
        self.observer = Observers(*observers)
        model_len = self.model_config.max_position_embeddings
        if config.scheduler.max_model_len is not None:
            model_len = min(model_len, config.scheduler.max_model_len)
        self.max_model_len = model_len
        cache_dtype, self.cache_dtype_reason = choose_cache_dtype(
            config.cache.kv_cache_dtype, self.loaded.model
        )
        draft_dtype = None
        draft_per_block = 0
        if self.draft is not None:
            draft_dtype, _ = choose_cache_dtype(config.cache.kv_cache_dtype, self.draft.model)
            draft_per_block = bytes_per_block(
                self.draft.config, config.cache.block_size, draft_dtype
            )
        self.pool_size: PoolSize = choose_pool_size(
            self.model_config,
            block_size=config.cache.block_size,
            dtype=cache_dtype,
            device=self.loaded.device,
            max_num_seqs=config.scheduler.max_num_seqs,
            max_model_len=model_len,
            num_kv_blocks=config.cache.num_kv_blocks,
            kv_cache_memory=config.cache.kv_cache_memory,
            draft_bytes_per_block=draft_per_block,
        )
        log.info(self.pool_size.describe())
        log.info("memory plan: %s", self.describe_memory())
        allocating = time.perf_counter()
        self.kv_cache = device_thread.call(
            KVCache,
            self.model_config,
            self.pool_size.num_blocks,
            config.cache.block_size,
            cache_dtype,
            self.loaded.device,
        )
        self.draft_kv_cache: KVCache | None = None
        self.drafter: DraftProposer | None = None
        if self.draft is not None:
            # The draft's own cache: the same block ids and tables as the target's.
            self.draft_kv_cache = device_thread.call(
                KVCache,
                self.draft.config,
                self.pool_size.num_blocks,
                config.cache.block_size,
                draft_dtype,
                self.draft.device,
            )
            self.drafter = DraftProposer(
                self.draft.model,
                self.draft_kv_cache,
                min(self.model_config.vocab_size, self.tokenizer.vocab_size),
                config.scheduler.max_num_batched_tokens,
                self.guess_head,
            )
        self.kv_seconds = time.perf_counter() - allocating
        self.pool = BlockPool(
            self.pool_size.num_blocks,
            config.cache.block_size,
            prefix_caching=config.cache.enable_prefix_caching,
        )
        # A model whose every layer is windowed gives back the blocks behind its windows.
        self.kv = KVManager(self.pool, window=self.model_config.kv_window)
        self._wake: asyncio.Event | None = None
        self._signal: CapacitySignal | None = None
        self.scheduler: Scheduler | None = None
        self.queue = AdmissionQueue.from_config(config.queue, config.scheduler.max_num_seqs)
        self.batch = Batch(
            self.loaded.model,
            self.kv_cache,
            Sampler(seed=config.seed, kernels=self.loaded.kernels),
        )
        self.structured = StructuredOutputManager(self.tokenizer, self.model_config.vocab_size)
        self._requests: dict[str, RequestState] = {}
        self._answers: dict[str, tuple[RequestState, Answer]] = {}  # by sequence id
        self._pending_cancels: list[str] = []
        self._task: asyncio.Task | None = None
        self._stopping = False
        self.num_steps = 0
        self.embedder: Embedder | None = None

    # -- lifecycle -----------------------------------------------------------------------------

    async def start(self) -> None:
        """Start the loop on the running event loop."""
        if self._task is not None:
            return
        self._wake = asyncio.Event()
        self._signal = _WakingSignal(self._wake)
        spec = self.config.speculative
        self.scheduler = Scheduler(
            self.config.scheduler,
            self.kv,
            self.max_model_len,
            capacity=self._signal,
            speculative=spec,
            proposer=self._propose if spec is not None and self.drafter is None else None,
            batch_proposer=self._propose_by_draft if self.drafter is not None else None,
        )
        self._stopping = False
        self._loop = asyncio.get_running_loop()
        self._task = asyncio.create_task(self._run(), name="kvserve-engine")
        self.embedder = decoder_embedder(self)
        await self.embedder.start()

    async def stop(self) -> None:
        """End every request (finish reason "shutdown"), let the step in flight land, stop."""
        if self._task is None:
            return
        self._stopping = True
        self._wake.set()
        try:
            if self.embedder is not None:
                await self.embedder.stop()
            await self._task
        finally:
            self._task = None
            # Its worker thread goes with the engine (a compilation in progress takes ms).
            self.structured.close()

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    def _propose(self, seq: Sequence, num_tokens: int) -> tuple[int, ...]:
        """Guesses for a decoding sequence (called by the scheduler while it plans): prompt
        lookup over its tokens, cut before the first one its grammar forbids (that one could
        never be accepted)."""
        spec = self.config.speculative
        guesses = propose_ngram(
            seq.all_token_ids, num_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max
        )
        return self._grammar_prefix(seq, guesses)

    def _grammar_prefix(self, seq: Sequence, guesses: tuple[int, ...]) -> tuple[int, ...]:
        """The guesses cut before the first one the sequence's grammar forbids (that one could
        never be accepted)."""
        entry = self._answers.get(seq.seq_id)
        if guesses and entry is not None and entry[1].grammar is not None:
            guesses = guesses[: entry[1].grammar.valid_prefix(guesses)]
        return guesses

    def _propose_by_draft(self, wanting: Seq[tuple[Sequence, int]]) -> list[tuple[int, ...]]:
        """Guesses of the draft model for the decoding sequences that want some (called by the
        scheduler while it plans, their blocks already grown): one batched run on the device
        thread, each cut before the first token its grammar forbids."""
        # The draft's own context may be shorter than the target's: beyond it, no guesses.
        context = self.draft.config.max_position_embeddings
        asked = [(seq, limit) for seq, limit in wanting if seq.num_tokens + limit - 1 <= context]
        requests = []
        for seq, limit in asked:
            start = seq.draft_start
            tail = seq.token_slice(start, seq.num_tokens)
            requests.append(DraftRequest(seq.seq_id, start, tail, self.kv.table(seq.seq_id), limit))
        try:
            proposed = device_thread.call(self.drafter.propose, requests) if requests else []
        except Exception:  # a failed draft costs its guesses, not the step
            log.exception("the draft model failed; no guesses this step")
            return [() for _ in wanting]
        guessed: dict[str, tuple[int, ...]] = {}
        for (seq, limit), guesses in zip(asked, proposed, strict=True):
            # It computed every position up to the last guess but one.
            seq.draft_len = seq.num_tokens + limit - 1
            guessed[seq.seq_id] = self._grammar_prefix(seq, guesses)
        return [guessed.get(seq.seq_id, ()) for seq, _ in wanting]

    @property
    def step_log(self) -> deque[StepRecord] | None:
        """The recorded steps (with `record_steps`), oldest first."""
        return None if self.recorder is None else self.recorder.records

    # -- public API ----------------------------------------------------------------------------

    def submit(self, request: GenerationRequest) -> Stream:
        """Validate and queue a request; returns its Stream at once.

        Raises InvalidRequest (400) for a request that is wrong or could never fit, QueueFull
        (429) when the admission queue is full, EngineStopped when not running. Nothing is
        registered when it raises.
        """
        if not self.running or self._stopping:
            raise EngineStopped("the engine is not running")
        request_id = request.request_id
        if request_id in self._requests:
            raise InvalidRequest(f"request id {request_id!r} is already in use", "request_id")
        params = request.params
        vocab = self.model_config.vocab_size
        try:
            params.validate(vocab)
        except SamplingParamsError as exc:
            raise InvalidRequest(str(exc), exc.param) from exc
        prompt = request.prompt_token_ids
        if any(not 0 <= t < vocab for t in prompt):
            raise InvalidRequest(f"prompt token ids must be in [0, {vocab})", "prompt")
        if params.n > self.config.scheduler.max_num_seqs:
            raise InvalidRequest(
                f"n is {params.n}; this server runs at most "
                f"{self.config.scheduler.max_num_seqs} sequences at once",
                "n",
            )
        try:
            budget = self.scheduler.check(len(prompt), params.max_tokens, params.n)
        except Infeasible as exc:
            self.observer.on_rejected("infeasible")
            raise InvalidRequest(exc.reason, exc.param) from exc

        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids |= self.tokenizer.eos_token_ids
        compiled = None if params.structured is None else self.structured.compile(params.structured)
        compiling = compiled is not None and not compiled.done()
        sequences = make_sequences(
            request_id,
            len(prompt),
            budget,
            Prompt(
                prompt,
                request.cache_salt,
                params.n,
                reuse=not request.needs_prompt_logprobs,
                speculate=params.speculative,
            ),
            stop_token_ids=frozenset(stop_ids),
            status=SequenceStatus.WAITING_FOR_GRAMMAR if compiling else SequenceStatus.WAITING,
        )
        state = RequestState(
            request=request,
            stream=Stream(request_id, self.config.stream.buffer_steps * params.n),
            prompt_logprobs=[None] if request.needs_prompt_logprobs else None,
            answers=[
                Answer(
                    seq=seq,
                    detokenizer=self.tokenizer.detokenizer(stop=params.stop),
                    generator=(
                        # Answer i draws from its own stream, derived from the seed, so each
                        # answer is reproducible and answer 0 is the one n = 1 gives.
                        make_generator(params.seed + seq.index, self.loaded.device)
                        if params.seed is not None
                        else None
                    ),
                )
                for seq in sequences
            ],
        )
        if compiling:
            # Waiting for its grammar holds no slot and no queue place; admission follows it.
            self._register(state)
            compiled.add_done_callback(lambda future: self._compiled_soon(state, future))
            return state.stream
        if compiled is not None:
            self._attach_grammars(state, compiled)  # cached: raises InvalidRequest
        self._admit_or_enqueue(state)
        self._register(state)
        self._wake.set()
        return state.stream

    def _register(self, state: RequestState) -> None:
        self._requests[state.request_id] = state
        for answer in state.answers:
            self._answers[answer.seq_id] = (state, answer)

    def _admit_or_enqueue(self, state: RequestState) -> None:
        """Take its slots or a queue place; raises QueueFull (nothing registered by it)."""
        for seq in state.sequences:
            seq.status = SequenceStatus.WAITING
        outcome = admit_or_enqueue(self.scheduler, self.queue, state.sequences, time.monotonic())
        if outcome is Outcome.QUEUE_FULL:
            self.observer.on_rejected("queue_full")
            raise QueueFull(self.config.queue.queue_timeout)
        if outcome is Outcome.ADMITTED:
            self._mark_admitted(state)

    # -- structured output ---------------------------------------------------------------------

    def _attach_grammars(self, state: RequestState, compiled: Future) -> None:
        """A matcher per answer from a finished compilation; InvalidRequest when refused."""
        try:
            grammar = compiled.result()
            for answer in state.answers:
                answer.grammar = self.structured.matcher(grammar)
        except GrammarError as exc:
            raise InvalidRequest(exc.message, exc.param) from None

    def _compiled_soon(self, state: RequestState, compiled: Future) -> None:
        """On the compiling thread: hand the result to the loop thread."""
        with contextlib.suppress(RuntimeError):  # the loop closed: shutdown ended the request
            self._loop.call_soon_threadsafe(self._compiled, state, compiled)

    def _compiled(self, state: RequestState, compiled: Future) -> None:
        """A grammar landed for a request waiting for it: admit it or refuse it."""
        if state.ended or state.status is not SequenceStatus.WAITING_FOR_GRAMMAR:
            return  # cancelled or shut down meanwhile
        try:
            if self._stopping:
                raise EngineStopped("the server is shutting down")
            self._attach_grammars(state, compiled)
            self._admit_or_enqueue(state)
        except QueueFull as exc:  # the queue filled while it compiled: a 429 as at the door
            self._end(state, SequenceStatus.FINISHED_QUEUE_FULL, error=exc)
            return
        except EngineError as exc:
            self._end(state, SequenceStatus.FINISHED_ERROR, error=exc)
            return
        self._wake.set()

    def cancel(self, request_id: str, reason: str = "cancelled") -> bool:
        """Stop a request: at once while it waits for its grammar or in the queue, at the next
        step boundary once admitted. Idempotent; False when the request is unknown or already
        ended. `reason` is a finish reason (kvserve.core.FINISH_REASONS)."""
        state = self._requests.get(request_id)
        if state is None or state.ended:
            return False
        status = SequenceStatus.finished(reason)
        if not state.is_admitted:
            self._end(state, status, error=RequestCancelled("the client closed the request"))
        elif state.cancel_reason is None:
            state.cancel_reason = reason
            self._pending_cancels.append(request_id)
            self._wake.set()
        return True

    def get(self, request_id: str) -> RequestState | None:
        return self._requests.get(request_id)

    # -- introspection -------------------------------------------------------------------------

    def describe_memory(self) -> str:
        """The memory plan, known before the pool is allocated: the weights (against the
        checkpoint's size), the KV pool, and about what a full step's activations take."""
        model = self.loaded.model
        scheduler = self.config.scheduler
        working = model.working_bytes(scheduler.max_num_batched_tokens, scheduler.max_num_seqs)
        weights = model.num_bytes
        file_bytes = self.loaded.file_bytes
        against = (
            f" ({weights / file_bytes:.2f}x the file's {_mib(file_bytes)})" if file_bytes else ""
        )
        pool = f"KV pool {_mib(self.pool_size.num_bytes)}"
        total = weights + self.pool_size.num_bytes + working
        if self.draft is not None:
            draft_weights = self.draft.model.num_bytes
            if self.guess_head is not None:
                draft_weights += self.guess_head.num_bytes
            total += draft_weights
            against += f" + draft weights {_mib(draft_weights)}"
            pool += " (target + draft caches)"
        return (
            f"weights {_mib(weights)}{against} + {pool} + "
            f"working buffers about {_mib(working)} = {_mib(total)}"
        )

    def describe_start(self) -> str:
        """Where the start's seconds went: the model's load, then the KV pool's allocation."""
        loaded = self.loaded
        return (
            f"started in {loaded.load_seconds + self.kv_seconds:.1f} s: {loaded.describe_load()}, "
            f"KV pool {self.kv_seconds:.1f} s"
        )

    def describe_precision(self) -> str:
        """One line: what the linear layers and the KV cache run in, and why."""
        model = self.loaded.model
        linear = {
            "int8": "int8",
            "q4": "4-bit blocks (q4)",
            "gguf": f"the file's blocks ({', '.join(self.loaded.quantization)})",
        }.get(model.quantization, str(model.dtype).removeprefix("torch."))
        cache = str(self.kv_cache.kv.dtype).removeprefix("torch.")
        return (
            f"precision: linear layers {linear} ({self.loaded.quantization_reason}); "
            f"KV cache {cache} ({self.cache_dtype_reason})"
        )

    @property
    def num_running(self) -> int:
        return self.scheduler.num_running if self.scheduler else 0

    @property
    def num_waiting(self) -> int:
        return len(self.queue)

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    @property
    def num_preempted(self) -> int:
        """Sequences preempted and waiting to resume."""
        return self.scheduler.num_preempted if self.scheduler else 0

    @property
    def num_preemptions(self) -> int:
        """Sequences preempted since the start."""
        return self.scheduler.num_preemptions if self.scheduler else 0

    def is_idle(self) -> bool:
        """No request, every slot and block free, nothing queued: the leak check."""
        return (
            not self._requests
            and not self._answers
            and self.num_running == 0
            and self.num_preempted == 0
            and len(self.queue) == 0
            and self.pool.num_free == self.pool.num_blocks
            and self.pool.check_whole()
            and self.kv.check_whole()
            and (
                self.scheduler is None
                or self.scheduler.num_free_slots == self.scheduler.config.max_num_seqs
            )
        )

    # -- the loop ------------------------------------------------------------------------------

    async def _run(self) -> None:
        try:
            while True:
                self._boundary()
                if self._stopping:
                    break
                if self.scheduler.num_running == 0 or not await self.step():
                    # Nothing runs, or every running sequence waits: only an event changes that.
                    await self._idle_wait()
                    continue
                # Let the stream consumers (SSE writers) take this step's deltas now, before
                # the next forward pass starts: on a small CPU their work would otherwise run
                # beside the pass and stall its threads.
                await asyncio.sleep(0)
        finally:
            self._shutdown_requests()

    async def step(self) -> bool:
        """One step: plan, execute on the device thread, update, deliver. False: no rows.

        A step that raises fails the requests it touched through the one release path; the
        scheduler publishes nothing from it.
        """
        planning = time.monotonic()
        plan = self.scheduler.schedule()
        self._preempted(plan)
        if plan.num_rows == 0 and not plan.copies:
            self.scheduler.abort(plan)
            return False
        rows = self._sampling_rows(plan)
        scored = self._scored_prompts(plan)
        started = time.monotonic()
        try:
            output = await asyncio.get_running_loop().run_in_executor(
                device_thread.executor(), self.batch.execute, plan, rows, scored
            )
        except Exception as exc:  # a failed step fails its requests, not the server
            log.exception("step %d failed", plan.step)
            self.scheduler.abort(plan)
            self._fail(plan, exc)
            return True
        self._update(plan, output)
        self.num_steps += 1
        now = time.monotonic()
        self.scheduler.observe_step(plan, now - planning)
        self.observer.on_step(plan, now - started)
        return plan.num_rows > 0

    def _preempted(self, plan: StepPlan) -> None:
        """The plan preempted these sequences: tell observers; a prompt being scored is scored
        again from its start when it resumes."""
        counts: dict[str, int] = {}
        for seq_id in plan.preempted_ids:
            entry = self._answers.get(seq_id)
            if entry is None:
                continue
            state, answer = entry
            counts[state.request_id] = counts.get(state.request_id, 0) + 1
            if state.prompt_logprobs is not None and answer.seq.num_output == 0:
                state.prompt_logprobs = [None]
        for request_id, count in counts.items():
            self.observer.on_preempted(self._requests[request_id], count)

    def _sampling_rows(self, plan: StepPlan) -> dict[str, RowState]:
        """Row states of the sequences sampling this step, built here on the loop thread."""
        rows: dict[str, RowState] = {}
        for chunk in plan.chunks:
            for seq_id in chunk.sampler_ids:
                state, answer = self._answers[seq_id]
                rows[seq_id] = state.row_state(answer)
        return rows

    def _scored_prompts(self, plan: StepPlan) -> dict[str, tuple[Seq[int], int]]:
        """The prefill chunks whose rows score their prompt (prompt logprobs were asked for and
        its first token is still to come): sequence id -> (the prompt's tokens, how many
        alternatives per position)."""
        scored: dict[str, tuple[Seq[int], int]] = {}
        for chunk in plan.chunks:
            if not chunk.is_prefill:
                continue
            entry = self._answers.get(chunk.request_id)
            if entry is None or entry[0].prompt_logprobs is None or entry[1].seq.num_output:
                continue
            request = entry[0].request
            scored[chunk.request_id] = (request.prompt_token_ids, request.params.prompt_logprobs)
        return scored

    async def _idle_wait(self) -> None:
        """Sleep until something happens: an arrival, a cancel, a release, a queue deadline."""
        self._wake.clear()
        if self._pending_cancels or self._stopping:
            return
        deadline = self.queue.next_deadline
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._wake.wait(), timeout)

    def _boundary(self) -> None:
        """Between steps: apply cancellations, expire waits, run the admission round."""
        if self._pending_cancels:
            pending, self._pending_cancels = self._pending_cancels, []
            for request_id in pending:
                state = self._requests.get(request_id)
                if state is not None and not state.ended:
                    reason = state.cancel_reason or "cancelled"
                    error = RequestCancelled("the client closed the request")
                    self._end(
                        state,
                        SequenceStatus.finished(reason),
                        error=error if reason == "cancelled" else None,
                    )
        for waiter in self.queue.expire(time.monotonic()):
            state = self._requests.get(waiter.request_id)
            if state is not None:
                self.observer.on_rejected("queue_timeout")
                self._end(
                    state,
                    SequenceStatus.FINISHED_QUEUE_TIMEOUT,
                    error=QueueTimeout(self.config.queue.queue_timeout),
                )
        for waiter in admit_waiting(self.scheduler, self.queue):
            state = self._requests.get(waiter.request_id)
            if state is not None:
                self._mark_admitted(state)

    def _mark_admitted(self, state: RequestState) -> None:
        state.admitted_at = time.monotonic()
        state.stream.mark_admitted()
        self.observer.on_admitted(state)

    # -- update and delivery -------------------------------------------------------------------

    def _update(self, plan: StepPlan, output: StepOutput) -> None:
        """Give each sampled token to its answer's matcher and detokenizer, let the scheduler
        apply the step and run the stop check, then hand out the deltas and end what ended.

        A request whose cancel is pending ends at this boundary: its last token is neither
        delivered nor kept (nor counted in its usage)."""
        now = time.monotonic()
        for seq_id, scored in output.prompt_logprobs.items():
            entry = self._answers.get(seq_id)
            if entry is not None and entry[0].prompt_logprobs is not None:
                entry[0].prompt_logprobs.extend(scored)
        arrived: list[tuple[RequestState, Answer, list[Sampled], str]] = []
        stopped: set[str] = set()
        failed: dict[str, RequestState] = {}
        kept: dict[str, int | tuple[int, ...]] = {}
        for chunk in plan.chunks:
            for seq_id in chunk.sampler_ids:
                speculated = output.speculated.get(seq_id) if chunk.is_speculative else None
                sampled = speculated.tokens if speculated else output.sampled.get(seq_id)
                entry = self._answers.get(seq_id)
                if sampled is None or entry is None:
                    continue
                state, answer = entry
                if state.ended or state.cancel_reason is not None:
                    continue
                if answer.seq.status is not SequenceStatus.RUNNING:
                    continue
                if speculated is not None:
                    self.observer.on_speculated(
                        state, speculated.num_drafted, speculated.num_accepted, seq_id
                    )
                tokens, text, ended = self._take_tokens(
                    answer, sampled if speculated else (sampled,)
                )
                if tokens is None:
                    failed[state.request_id] = state
                    continue
                if ended:
                    stopped.add(seq_id)
                arrived.append((state, answer, tokens, text))
                ids = tuple(token.token_id for token in tokens)
                kept[seq_id] = ids if speculated else ids[0]
        self.scheduler.update_from_output(plan, kept, stopped)
        by_request: dict[str, int] = {}
        for state, _, tokens, _ in arrived:
            by_request[state.request_id] = by_request.get(state.request_id, 0) + len(tokens)
        for request_id, count in by_request.items():
            state = self._requests[request_id]
            self.observer.on_token(state, now, count)  # sees the previous step's time
            if state.first_token_at is None:
                state.first_token_at = now
            state.last_token_at = now
        for state, answer, sampled, text in arrived:
            if state.ended or state.request_id in failed:
                continue
            self._deliver(state, answer, sampled, text, now)
        for state in failed.values():
            grammar = next((a.grammar for a in state.answers if a.grammar is not None), None)
            error = EngineError(f"structured output failed: {grammar and grammar.error}")
            self._end(state, SequenceStatus.FINISHED_ERROR, error=error)

    @staticmethod
    def _take_tokens(
        answer: Answer, sampled: Seq[Sampled]
    ) -> tuple[list[Sampled] | None, str, bool]:
        """Give a step's tokens for one answer (one, or a verification's kept tokens) to its
        matcher and detokenizer, up to the first that ends it (a stop token, a stop string, a
        complete grammar). Returns the tokens taken (None: the grammar refused one, a grammar
        engine failure), their text, and whether a stop string or the grammar ended it."""
        taken: list[Sampled] = []
        text = ""
        detok = answer.detokenizer
        for item in sampled:
            token = item.token_id
            if answer.grammar is not None and not answer.grammar.accept(token):
                # The mask allowed only grammar tokens; this is a grammar engine failure.
                return None, "", False
            taken.append(item)
            if token in answer.seq.stop_token_ids:
                return taken, text + detok.flush(), False  # a stop token adds no text
            text += detok.add(token)
            # A stop string, or a grammar that is complete and allows nothing more (ending
            # without the step that would only draw the end-of-sequence token).
            if detok.stopped or (answer.grammar is not None and answer.grammar.is_stopped):
                return taken, text, True
        return taken, text, False

    def _deliver(
        self,
        state: RequestState,
        answer: Answer,
        sampled: Seq[Sampled],
        text: str,
        now: float,
    ) -> None:
        """One step's delta for one answer (one token, or a verification's kept tokens); the
        answer's last one when its sequence finished."""
        logprobs = tuple(
            TokenLogprob(item.token_id, item.logprob, tuple(item.top_logprobs or ()))
            for item in sampled
            if item.logprob is not None
        )
        prompt_logprobs = None
        if state.prompt_logprobs is not None and len(answer.output_token_ids) == len(sampled):
            prompt_logprobs = tuple(state.prompt_logprobs)
        delta = Delta(
            text=text,
            token_ids=tuple(item.token_id for item in sampled),
            logprobs=logprobs,
            timestamp=now,
            index=answer.index,
            prompt_logprobs=prompt_logprobs,
        )
        if answer.seq.is_finished:
            delta = replace(
                delta,
                text=text + answer.detokenizer.flush(),
                finish_reason=answer.finish_reason,
                stop_sequence=answer.detokenizer.stop_reason,
            )
            self._finish_answer(state, answer, delta)
        elif not state.stream.offer(delta):
            self._drop_slow_consumer(state)

    def _finish_answer(self, state: RequestState, answer: Answer, delta: Delta) -> None:
        """An answer ended by itself: its last delta, and the request's end with its last
        (answers that finished in the same step each hand out theirs first)."""
        answer.ended = True
        if all(other.ended for other in state.answers):
            state.final_index = answer.index
            self._end(state, answer.seq.status, delta=delta)
            return
        self._release(state, [answer])
        if not state.stream.offer(delta):
            self._drop_slow_consumer(state)

    def _drop_slow_consumer(self, state: RequestState) -> None:
        log.info(
            "%s: client fell %d steps behind; dropping it", state.request_id, state.stream.capacity
        )
        self.observer.on_rejected("slow_consumer")
        self._end(state, SequenceStatus.FINISHED_SLOW_CONSUMER)

    def _fail(self, plan: StepPlan, exc: Exception) -> None:
        error = EngineError(f"internal error while generating: {type(exc).__name__}: {exc}")
        for seq_id in plan.touched_ids:
            entry = self._answers.get(seq_id)
            if entry is not None:
                self._end(entry[0], SequenceStatus.FINISHED_ERROR, error=error)

    def _shutdown_requests(self) -> None:
        for state in list(self._requests.values()):
            self._end(
                state,
                SequenceStatus.FINISHED_SHUTDOWN,
                error=EngineStopped("the server is shutting down"),
            )

    # -- the end of a request, and the one release path ----------------------------------------

    def _end(
        self,
        state: RequestState,
        status: SequenceStatus,
        *,
        error: EngineError | None = None,
        delta: Delta | None = None,
    ) -> None:
        """End the request however it ends: every answer not finished yet gets `status`, the
        resources go back (`_release`), the stream gets its final delta (`delta`, the last
        answer's, completed with the usage) and observers are told. Idempotent."""
        if state.ended:
            return
        now = time.monotonic()
        for answer in state.answers:
            if not answer.seq.is_finished:
                answer.seq.status = status
        if delta is None:
            final = next((a for a in state.answers if a.seq.status is status), state.answers[0])
            state.final_index = final.index
            delta = Delta(finish_reason=status.finish_reason, index=final.index)
        self._release(state, state.answers)
        state.ended = True
        state.finished_at = now
        del self._requests[state.request_id]
        state.stream.finish(replace(delta, usage=state.usage(), error=error, timestamp=now))
        self.observer.on_finished(state)

    def _release(self, state: RequestState, answers: list[Answer]) -> None:
        """Free what these answers hold: slots and blocks (or their place in the queue, or in
        the line to resume) and their grammar states. Only frees; idempotent."""
        for answer in answers:
            self.scheduler.release(answer.seq_id)
            answer.grammar = None
            self._answers.pop(answer.seq_id, None)
        if all(answer.seq.is_finished for answer in state.answers):
            self.queue.cancel(state.request_id)


def _mib(num_bytes: int) -> str:
    return f"{num_bytes / 2**20:,.0f} MiB"
