"""The Engine: one loop that owns all serving state and runs steps while there is work.

    plan = scheduler.schedule()                        # loop thread
    output = batch.execute(plan, rows, scored)         # device thread
    scheduler.update_from_output(plan, output)         # loop thread; publishes full blocks
    deliver                                            # loop thread; tokens to streams

Bookkeeping (Scheduler, BlockPool, AdmissionQueue, request states, streams) lives on the event
loop's thread and is only touched there: `submit` and `cancel` are plain synchronous methods
called from that thread, and the loop applies cancellations, queue expiry and admission at step
boundaries. The only thing that runs elsewhere is `Batch.execute`, on the device thread, which
reads the plan (immutable, with every row's input token built in) and the sampling rows' states
(built on the loop thread before the step; nothing modifies them while it runs).

A request asks for n answers (`SamplingParams.n`); each is a scheduler sequence (`SeqState`,
which holds its tokens and counts) with a `Choice` here for what delivering needs (detokenizer,
generator, stop ids). The prompt is prefilled once for all n (see kvserve/core/scheduler.py).

Every way a request ends — finish, stop string, cancel, slow consumer, queue timeout, error,
shutdown — goes through `_release`, which returns its slot and blocks (Scheduler.release, which
also offers the capacity signal) or removes it from the queue, drops its grammar states, and
ends its stream with a final delta carrying the finish reason and usage.

A request under structured output whose grammar is not compiled yet waits in the "compiling"
state: registered (it can be cancelled) but neither queued nor holding a slot. The grammar
compiles on the structured-output worker; when it lands, the request joins admission as any
other (or ends with a 400 if the grammar engine refused it). Each answer has its own matcher.

A request that asks for prompt log-probabilities computes its whole prompt: cached blocks never
stand in for rows whose logits it needs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from kvserve.config import EngineConfig
from kvserve.core import (
    AdmissionQueue,
    BlockPool,
    CapacitySignal,
    Infeasible,
    Outcome,
    Prompt,
    Scheduler,
    SeqState,
    StepPlan,
    choice_id,
)
from kvserve.core.scheduler import admit_or_enqueue, admit_waiting
from kvserve.engine.batch import Batch, Sampled, StepOutput
from kvserve.engine.embedding import Embedder, EmbeddingJob, EmbeddingObserver, decoder_embedder
from kvserve.engine.sampler import RowState, Sampler, make_generator
from kvserve.engine.stream import Delta, Stream, TokenLogprob, Usage
from kvserve.engine.structured import GrammarError, GrammarState, StructuredOutputManager
from kvserve.model import device_thread
from kvserve.model.kv_cache import KVCache, PoolSize, choose_cache_dtype, choose_pool_size
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

    def on_step(self, plan: StepPlan, seconds: float) -> None: ...


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

    def on_step(self, plan: StepPlan, seconds: float) -> None:
        for observer in self.observers:
            observer.on_step(plan, seconds)

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
class Choice:
    """One of a request's n answers: what delivering its tokens needs. Its tokens and counts
    live in the scheduler's sequence (`seq`, attached at admission)."""

    index: int
    seq_id: str
    detokenizer: object
    generator: torch.Generator | None
    seq: SeqState | None = None
    grammar: GrammarState | None = None  # structured output; dropped on release
    finish_reason: str | None = None

    @property
    def output_token_ids(self) -> list[int]:
        return [] if self.seq is None else self.seq.output_token_ids


@dataclass(eq=False)
class RequestState:
    """The engine's view of one request, from submit to release."""

    request: GenerationRequest
    stream: Stream
    max_tokens: int  # resolved answer budget (per answer)
    stop_token_ids: frozenset[int]
    choices: list[Choice]
    reserve: int = 0  # KV positions reserved at admission beyond the prompt
    # One entry per prompt token scored so far (None for the first), when the request asked
    # for prompt logprobs; handed out with the first generated token.
    prompt_logprobs: list[TokenLogprob | None] | None = None
    status: str = "queued"  # compiling | queued | running | finished
    finish_reason: str | None = None
    cancel_reason: str | None = None  # set while running; applied at the next step boundary
    admitted_at: float | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None
    finished_at: float | None = None

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def prompt(self) -> Prompt:
        """What admission needs: tokens (for prefix lookups), salt and n."""
        return Prompt(
            self.request.prompt_token_ids,
            self.request.cache_salt,
            len(self.choices),
            reuse=not self.request.needs_prompt_logprobs,
        )

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.request.prompt_token_ids)

    @property
    def num_cached_tokens(self) -> int:
        """Prompt tokens taken from the prefix cache (0 before admission)."""
        seq = self.choices[0].seq
        return 0 if seq is None else seq.num_cached_tokens

    @property
    def output_token_ids(self) -> list[int]:
        """The first answer's tokens (the only one when n = 1)."""
        return self.choices[0].output_token_ids

    @property
    def num_output_tokens(self) -> int:
        """Tokens sampled over every answer."""
        return sum(len(choice.output_token_ids) for choice in self.choices)

    def usage(self) -> Usage:
        return Usage(self.num_prompt_tokens, self.num_output_tokens, self.num_cached_tokens)

    def row_state(self, choice: Choice) -> RowState:
        return RowState(
            params=self.request.params,
            generator=choice.generator,
            prompt_token_ids=self.request.prompt_token_ids,
            output_token_ids=choice.output_token_ids,
            grammar=choice.grammar,
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
    ) -> None:
        self.config = config
        self.loaded = loaded or load_model(config.model, config.device)
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
        self.pool_size: PoolSize = choose_pool_size(
            self.model_config,
            block_size=config.cache.block_size,
            dtype=cache_dtype,
            device=self.loaded.device,
            max_num_seqs=config.scheduler.max_num_seqs,
            max_model_len=model_len,
            num_kv_blocks=config.cache.num_kv_blocks,
            kv_cache_memory=config.cache.kv_cache_memory,
        )
        log.info(self.pool_size.describe())
        self.kv_cache = device_thread.call(
            KVCache,
            self.model_config,
            self.pool_size.num_blocks,
            config.cache.block_size,
            cache_dtype,
            self.loaded.device,
        )
        self.pool = BlockPool(
            self.pool_size.num_blocks,
            config.cache.block_size,
            prefix_caching=config.cache.enable_prefix_caching,
        )
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
        self._choices: dict[str, tuple[RequestState, Choice]] = {}  # by sequence id
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
        self.scheduler = Scheduler(
            self.config.scheduler, self.pool, self.max_model_len, capacity=self._signal
        )
        self._stopping = False
        self._loop = asyncio.get_running_loop()
        self.structured.warm()
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
            reserve = self.scheduler.check(len(prompt), params.max_tokens, params.n)
        except Infeasible as exc:
            self.observer.on_rejected("infeasible")
            raise InvalidRequest(exc.reason, exc.param) from exc

        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids |= self.tokenizer.eos_token_ids
        state = RequestState(
            request=request,
            stream=Stream(request_id, self.config.stream.buffer_steps * params.n),
            max_tokens=reserve,
            reserve=reserve,
            prompt_logprobs=[None] if request.needs_prompt_logprobs else None,
            stop_token_ids=frozenset(stop_ids),
            choices=[
                Choice(
                    index=index,
                    seq_id=choice_id(request_id, index),
                    detokenizer=self.tokenizer.detokenizer(stop=params.stop),
                    generator=(
                        # Answer i draws from its own stream, derived from the seed, so each
                        # answer is reproducible and answer 0 is the one n = 1 gives.
                        make_generator(params.seed + index, self.loaded.device)
                        if params.seed is not None
                        else None
                    ),
                )
                for index in range(params.n)
            ],
        )
        if params.structured is not None:
            compiled = self.structured.compile(params.structured)
            if not compiled.done():
                # Compiling holds no slot and no queue place; admission follows it.
                state.status = "compiling"
                self._requests[request_id] = state
                compiled.add_done_callback(lambda future: self._compiled_soon(state, future))
                return state.stream
            self._attach_grammars(state, compiled)  # cached: raises InvalidRequest
        self._admit_or_enqueue(state)
        self._requests[request_id] = state
        self._wake.set()
        return state.stream

    def _admit_or_enqueue(self, state: RequestState) -> None:
        """Take a slot or a queue place; raises QueueFull (nothing registered by it)."""
        outcome = admit_or_enqueue(
            self.scheduler,
            self.queue,
            state.request_id,
            state.num_prompt_tokens,
            state.reserve,
            time.monotonic(),
            state.prompt,
        )
        if outcome is Outcome.QUEUE_FULL:
            self.observer.on_rejected("queue_full")
            raise QueueFull(self.config.queue.queue_timeout)
        state.status = "queued"
        if outcome is Outcome.ADMITTED:
            self._mark_admitted(state)

    # -- structured output ---------------------------------------------------------------------

    def _attach_grammars(self, state: RequestState, compiled: Future) -> None:
        """A matcher per answer from a finished compilation; InvalidRequest when refused."""
        try:
            grammar = compiled.result()
            for choice in state.choices:
                choice.grammar = self.structured.matcher(grammar)
        except GrammarError as exc:
            raise InvalidRequest(exc.message, exc.param) from None

    def _compiled_soon(self, state: RequestState, compiled: Future) -> None:
        """On the compiling thread: hand the result to the loop thread."""
        with contextlib.suppress(RuntimeError):  # the loop closed: shutdown ended the request
            self._loop.call_soon_threadsafe(self._compiled, state, compiled)

    def _compiled(self, state: RequestState, compiled: Future) -> None:
        """A grammar landed for a request waiting in "compiling": admit it or refuse it."""
        if state.status != "compiling":
            return  # cancelled or shut down meanwhile
        try:
            if self._stopping:
                raise EngineStopped("the server is shutting down")
            self._attach_grammars(state, compiled)
            self._admit_or_enqueue(state)
        except QueueFull as exc:  # the queue filled while it compiled: a 429 as at the door
            self._release(state, "queue_full", error=exc)
            return
        except EngineError as exc:
            self._release(state, "error", error=exc)
            return
        self._wake.set()

    def cancel(self, request_id: str, reason: str = "cancelled") -> bool:
        """Stop a request: at once while queued, at the next step boundary while running.
        Idempotent; False when the request is unknown or already ended."""
        state = self._requests.get(request_id)
        if state is None or state.status == "finished":
            return False
        if state.status in ("queued", "compiling"):
            self._release(state, reason, error=RequestCancelled("the client closed the request"))
        elif state.cancel_reason is None:
            state.cancel_reason = reason
            self._pending_cancels.append(request_id)
            self._wake.set()
        return True

    def get(self, request_id: str) -> RequestState | None:
        return self._requests.get(request_id)

    # -- introspection -------------------------------------------------------------------------

    def describe_precision(self) -> str:
        """One line: what the linear layers and the KV cache run in, and why."""
        model = self.loaded.model
        linear = {"int8": "int8", "q4": "4-bit blocks (q4)"}.get(
            model.quantization, str(model.dtype).removeprefix("torch.")
        )
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

    def is_idle(self) -> bool:
        """No request, every slot and block free, nothing queued: the leak check."""
        return (
            not self._requests
            and self.num_running == 0
            and len(self.queue) == 0
            and self.pool.num_free == self.pool.num_blocks
            and self.pool.check_whole()
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
                    # Nothing runs, or every running sequence waits (possible only under
                    # slot-only admission with an exhausted pool): only an event changes that.
                    await self._idle_wait()
                    continue
                # Let the stream consumers (SSE writers) take this step's deltas now, before
                # the next forward pass starts: on a small CPU their work would otherwise run
                # beside the pass and stall its threads.
                await asyncio.sleep(0)
        finally:
            self._shutdown_requests()

    async def step(self) -> bool:
        """One step: plan, execute on the device thread, record, deliver. False: no rows.

        A step that raises fails the requests it touched through the one release path; the
        scheduler publishes nothing from it.
        """
        plan = self.scheduler.schedule()
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
        # A request whose cancel is pending ends at this boundary: its last token is neither
        # delivered nor kept (nor counted in its usage).
        sampled = {
            seq_id: s.token_id
            for seq_id, s in output.sampled.items()
            if seq_id in self._choices and self._choices[seq_id][0].cancel_reason is None
        }
        self.scheduler.update_from_output(plan, sampled)
        self.num_steps += 1
        self._deliver(plan, output)
        self.observer.on_step(plan, time.monotonic() - started)
        return plan.num_rows > 0

    def _sampling_rows(self, plan: StepPlan) -> dict[str, RowState]:
        """Row states of the sequences sampling this step, built here on the loop thread."""
        rows: dict[str, RowState] = {}
        for chunk in plan.chunks:
            for seq_id in chunk.sampler_ids:
                state, choice = self._choices[seq_id]
                rows[seq_id] = state.row_state(choice)
        return rows

    def _scored_prompts(self, plan: StepPlan) -> dict[str, tuple[Sequence[int], int]]:
        """The prefill chunks whose rows score their prompt (prompt logprobs were asked for):
        sequence id -> (the prompt's tokens, how many alternatives per position)."""
        scored: dict[str, tuple[Sequence[int], int]] = {}
        for chunk in plan.chunks:
            if not chunk.is_prefill:
                continue
            entry = self._choices.get(chunk.request_id)
            if entry is None or entry[0].prompt_logprobs is None:
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
                if state is not None and state.status != "finished":
                    reason = state.cancel_reason or "cancelled"
                    error = RequestCancelled("the client closed the request")
                    self._release(state, reason, error=error if reason == "cancelled" else None)
        for waiter in self.queue.expire(time.monotonic()):
            state = self._requests.get(waiter.request_id)
            if state is not None:
                self.observer.on_rejected("queue_timeout")
                self._release(
                    state,
                    "queue_timeout",
                    error=QueueTimeout(self.config.queue.queue_timeout),
                    queued=False,
                )
        for waiter in admit_waiting(self.scheduler, self.queue, self._prompt_of):
            state = self._requests.get(waiter.request_id)
            if state is not None:
                self._mark_admitted(state)

    def _prompt_of(self, request_id: str) -> Prompt | None:
        state = self._requests.get(request_id)
        return None if state is None else state.prompt

    def _mark_admitted(self, state: RequestState) -> None:
        for choice in state.choices:
            choice.seq = self.scheduler.get(choice.seq_id)
            self._choices[choice.seq_id] = (state, choice)
        state.status = "running"
        state.admitted_at = time.monotonic()
        state.stream.mark_admitted()
        self.observer.on_admitted(state)

    def _deliver(self, plan: StepPlan, output: StepOutput) -> None:
        """Decide for each sampled token whether its answer is done, hand out deltas."""
        now = time.monotonic()
        for seq_id, scored in output.prompt_logprobs.items():
            entry = self._choices.get(seq_id)
            if entry is not None and entry[0].prompt_logprobs is not None:
                entry[0].prompt_logprobs.extend(scored)
        arrived: dict[str, list[tuple[Choice, Sampled]]] = {}
        for chunk in plan.chunks:
            for seq_id in chunk.sampler_ids:
                sampled = output.sampled.get(seq_id)
                entry = self._choices.get(seq_id)
                if sampled is None or entry is None:
                    continue
                state, choice = entry
                if state.status != "running" or choice.finish_reason is not None:
                    continue
                if state.cancel_reason is not None:
                    continue  # ends at this boundary; the token is not delivered
                arrived.setdefault(state.request_id, []).append((choice, sampled))
        for request_id, tokens in arrived.items():
            state = self._requests[request_id]
            self.observer.on_token(state, now, len(tokens))  # sees the previous step's time
            if state.first_token_at is None:
                state.first_token_at = now
            state.last_token_at = now
            for choice, sampled in tokens:
                if state.status == "running":
                    self._deliver_token(state, choice, sampled, now)

    def _deliver_token(
        self, state: RequestState, choice: Choice, sampled: Sampled, now: float
    ) -> None:
        token = sampled.token_id
        if choice.grammar is not None and not choice.grammar.accept(token):
            # The mask allowed only grammar tokens; this is a grammar engine failure.
            error = EngineError(f"structured output failed: {choice.grammar.error}")
            self._release(state, "error", error=error)
            return
        logprobs = ()
        if sampled.logprob is not None:
            logprobs = (TokenLogprob(token, sampled.logprob, tuple(sampled.top_logprobs or ())),)
        prompt_logprobs = None
        if state.prompt_logprobs is not None and len(choice.output_token_ids) == 1:
            prompt_logprobs = tuple(state.prompt_logprobs)
        detok = choice.detokenizer
        reason = None
        if token in state.stop_token_ids:
            reason = "stop"
            text = detok.flush()
        else:
            text = detok.add(token)
            if detok.stopped:
                reason = "stop"
            elif choice.grammar is not None and choice.grammar.is_stopped:
                # The grammar is complete and allows nothing more: end without the step that
                # would only draw the end-of-sequence token.
                reason = "stop"
                text += detok.flush()
            elif len(choice.output_token_ids) >= state.max_tokens:
                reason = "length"
                text += detok.flush()
        if reason is not None:
            self._release(
                state,
                reason,
                choice=choice,
                text=text,
                token_ids=(token,),
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                stop_sequence=detok.stop_reason,
            )
        elif not state.stream.offer(
            Delta(
                text=text,
                token_ids=(token,),
                logprobs=logprobs,
                timestamp=now,
                index=choice.index,
                prompt_logprobs=prompt_logprobs,
            )
        ):
            self._drop_slow_consumer(state)

    def _drop_slow_consumer(self, state: RequestState) -> None:
        log.info(
            "%s: client fell %d steps behind; dropping it", state.request_id, state.stream.capacity
        )
        self.observer.on_rejected("slow_consumer")
        self._release(state, "slow_consumer")

    def _fail(self, plan: StepPlan, exc: Exception) -> None:
        error = EngineError(f"internal error while generating: {type(exc).__name__}: {exc}")
        for seq_id in plan.touched_ids:
            entry = self._choices.get(seq_id)
            if entry is not None:
                self._release(entry[0], "error", error=error)

    def _shutdown_requests(self) -> None:
        for state in list(self._requests.values()):
            self._release(state, "shutdown", error=EngineStopped("the server is shutting down"))

    # -- the one release path ------------------------------------------------------------------

    def _release(
        self,
        state: RequestState,
        reason: str,
        *,
        choice: Choice | None = None,
        text: str = "",
        token_ids: tuple[int, ...] = (),
        logprobs: tuple[TokenLogprob, ...] = (),
        prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None,
        error: EngineError | None = None,
        queued: bool = True,
        stop_sequence: str | None = None,
    ) -> None:
        """End a request however it ends, or with `choice` one of its answers (the request
        ends with its last answer): slots and blocks back (or out of the queue), the stream
        told the reason, and at the end the usage; observers told. Idempotent."""
        if state.status == "finished":
            return
        now = time.monotonic()
        if choice is not None:
            choice.finish_reason = reason
            choice.grammar = None
            self.scheduler.release(choice.seq_id)
            if any(other.finish_reason is None for other in state.choices):
                delta = Delta(
                    text=text,
                    token_ids=token_ids,
                    logprobs=logprobs,
                    finish_reason=reason,
                    timestamp=now,
                    index=choice.index,
                    prompt_logprobs=prompt_logprobs,
                    stop_sequence=stop_sequence,
                )
                if not state.stream.offer(delta):
                    self._drop_slow_consumer(state)
                return
        if state.status == "running":
            for other in state.choices:
                self.scheduler.release(other.seq_id)
                self._choices.pop(other.seq_id, None)
        elif queued and state.status == "queued":
            self.queue.cancel(state.request_id)
        for other in state.choices:
            other.grammar = None
        state.status = "finished"
        state.finish_reason = reason
        state.finished_at = now
        del self._requests[state.request_id]
        state.stream.finish(
            Delta(
                text=text,
                token_ids=token_ids,
                logprobs=logprobs,
                finish_reason=reason,
                usage=state.usage(),
                error=error,
                timestamp=now,
                index=0 if choice is None else choice.index,
                prompt_logprobs=prompt_logprobs,
                stop_sequence=stop_sequence,
            )
        )
        self.observer.on_finished(state)
