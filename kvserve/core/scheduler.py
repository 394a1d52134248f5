"""Whom to admit and what each step computes: slots, blocks, chunked prefill, decode rows.

The scheduler owns every running sequence's `SeqState`, its slot and (through the pool) its
blocks. One loop drives it, three calls per step:

    plan = scheduler.schedule()     # what to compute
    ...                             # the engine runs the plan and samples
    scheduler.update(plan)          # what was computed
    scheduler.release(request_id)   # for each finished / cancelled / failed sequence
    admit_waiting(scheduler, queue) # between steps: the admission round

Admission policies (`SchedulerConfig.admission`):

- "reserve": a sequence is admitted with a slot and `ceil((prompt + reserve) / block_size)`
  blocks together, so every admitted sequence can run to its answer budget. It never deadlocks.
- "slot-only": a free slot is enough; blocks are allocated as rows need them. When the pool runs
  dry no sequence can grow and nothing finishes (`is_stuck`). Kept to show why reservation exists.

Batching policies (`SchedulerConfig.batching`):

- "continuous": sequences join and leave at every step.
- "request": a batch forms only while nothing runs and closes at the first step it runs; it
  reopens when its last member is released. The admission round is therefore the span between
  two `schedule()` calls; the driver needs no extra call, `can_admit` answers False while the
  batch is closed.
"""

from __future__ import annotations

import bisect
import heapq
from dataclasses import dataclass

from kvserve.config import SchedulerConfig
from kvserve.core.blocks import BlockPool
from kvserve.core.plan import ChunkPlan, StepPlan
from kvserve.core.queue import AdmissionQueue, CapacitySignal, Outcome, Waiter


class Infeasible(ValueError):
    """A request that could never run, refused at the door (HTTP 400).

    `param` names the request field to change: "prompt" when the prompt alone leaves no room
    for an answer (the server reports it as "messages" for chat requests), "max_tokens" when the
    prompt fits but the answer budget does not.
    """

    def __init__(self, param: str, reason: str) -> None:
        super().__init__(reason)
        self.param = param
        self.reason = reason


@dataclass(slots=True)
class SeqState:
    """A running sequence as the scheduler sees it: counts only, no tokens."""

    request_id: str
    num_prompt_tokens: int
    max_tokens: int  # the resolved answer budget (the reserve)
    arrival: int
    slot: int
    num_computed: int = 0  # positions whose KV has been computed
    num_output: int = 0  # tokens sampled so far

    @property
    def is_prefilling(self) -> bool:
        """Prompt positions remain to be computed."""
        return self.num_computed < self.num_prompt_tokens

    @property
    def num_tokens(self) -> int:
        """Prompt plus sampled tokens."""
        return self.num_prompt_tokens + self.num_output

    @property
    def has_reached_max_tokens(self) -> bool:
        """The answer budget is spent; the sequence gets no more rows and should be released."""
        return self.num_output >= self.max_tokens


class Scheduler:
    """Slots, blocks and step composition for continuous batching over a paged KV cache.

    `max_model_len` is the context length resolved by the engine (the model's, or the user's
    smaller override). `capacity` is offered on every release; pass a subclass to hook a wake-up.
    """

    def __init__(
        self,
        config: SchedulerConfig,
        pool: BlockPool,
        max_model_len: int,
        capacity: CapacitySignal | None = None,
    ) -> None:
        if max_model_len <= 0:
            raise ValueError("max_model_len must be positive")
        self.config = config
        self._pool = pool
        self._max_model_len = max_model_len
        self._capacity = capacity if capacity is not None else CapacitySignal()
        self._free_slots = list(range(config.max_num_seqs))  # a heap: lowest slot first
        self._running: list[SeqState] = []  # sorted by arrival
        self._by_id: dict[str, SeqState] = {}
        self._num_steps = 0
        self._pending_step: int | None = None  # the planned step awaiting update()
        self._batch_open = True

    # -- introspection -------------------------------------------------------------------------

    @property
    def pool(self) -> BlockPool:
        """The block pool this scheduler allocates from."""
        return self._pool

    @property
    def capacity(self) -> CapacitySignal:
        """Offered on every release."""
        return self._capacity

    @property
    def max_model_len(self) -> int:
        """The resolved context length."""
        return self._max_model_len

    @property
    def max_sequence_tokens(self) -> int:
        """The most positions one sequence can ever hold: the context, capped by the pool."""
        return min(self._max_model_len, self._pool.num_blocks * self._pool.block_size)

    @property
    def running(self) -> list[SeqState]:
        """Running sequences in arrival order (a copy)."""
        return list(self._running)

    def get(self, request_id: str) -> SeqState | None:
        """The running sequence `request_id`, or None."""
        return self._by_id.get(request_id)

    @property
    def num_running(self) -> int:
        """Sequences holding a slot."""
        return len(self._running)

    @property
    def num_free_slots(self) -> int:
        """Slots nobody holds."""
        return len(self._free_slots)

    @property
    def num_steps(self) -> int:
        """Plans handed out so far."""
        return self._num_steps

    @property
    def batch_open(self) -> bool:
        """Whether admission is allowed by the batching policy (always True for "continuous")."""
        return self.config.batching == "continuous" or self._batch_open

    # -- at the door ---------------------------------------------------------------------------

    def resolve_reserve(self, num_prompt_tokens: int, max_tokens: int | None) -> int:
        """The answer budget: `max_tokens`, or when None the rest of the context after the prompt.

        The context is capped by what the whole pool can hold, so a request that names no
        budget is never refused for a budget it did not ask for.
        """
        if max_tokens is not None:
            return max_tokens
        return max(self.max_sequence_tokens - num_prompt_tokens, 0)

    def check(self, num_prompt_tokens: int, max_tokens: int | None) -> int:
        """Return the reserve, or raise Infeasible when the request could never run."""
        context = self._max_model_len
        pool_tokens = self._pool.num_blocks * self._pool.block_size
        if num_prompt_tokens < 1:
            raise Infeasible("prompt", "the prompt is empty")
        if max_tokens is not None and max_tokens < 1:
            raise Infeasible("max_tokens", f"max_tokens must be at least 1, got {max_tokens}")
        if num_prompt_tokens + 1 > context:
            raise Infeasible(
                "prompt",
                f"the prompt has {num_prompt_tokens} tokens; the maximum context length is "
                f"{context} tokens, which leaves no room for an answer",
            )
        if num_prompt_tokens + 1 > pool_tokens:
            raise Infeasible(
                "prompt",
                f"the prompt has {num_prompt_tokens} tokens; the KV cache holds at most "
                f"{pool_tokens} tokens, which leaves no room for an answer",
            )
        reserve = self.resolve_reserve(num_prompt_tokens, max_tokens)
        total = num_prompt_tokens + reserve
        if total > context:
            raise Infeasible(
                "max_tokens",
                f"the maximum context length is {context} tokens; {total} were requested "
                f"({num_prompt_tokens} in the prompt, {reserve} for the answer)",
            )
        if total > pool_tokens:
            raise Infeasible(
                "max_tokens",
                f"the KV cache holds at most {pool_tokens} tokens; {total} were requested "
                f"({num_prompt_tokens} in the prompt, {reserve} for the answer)",
            )
        return reserve

    # -- admission -----------------------------------------------------------------------------

    def _num_blocks_to_reserve(self, num_prompt_tokens: int, reserve: int) -> int:
        if self.config.admission == "slot-only":
            return 0
        return self._pool.blocks_for(num_prompt_tokens + reserve)

    def can_admit(self, num_prompt_tokens: int, reserve: int) -> bool:
        """Whether `admit` would succeed now."""
        return (
            self.batch_open
            and bool(self._free_slots)
            and self._pool.num_free >= self._num_blocks_to_reserve(num_prompt_tokens, reserve)
        )

    def admit(
        self, request_id: str, num_prompt_tokens: int, reserve: int, arrival: int
    ) -> SeqState | None:
        """Give the request a slot (and under "reserve" its blocks) or nothing: None."""
        if request_id in self._by_id:
            raise ValueError(f"{request_id!r} is already running")
        if num_prompt_tokens < 1 or reserve < 1:
            raise ValueError("a sequence needs a prompt token and an answer budget")
        if not self.can_admit(num_prompt_tokens, reserve):
            return None
        num_blocks = self._num_blocks_to_reserve(num_prompt_tokens, reserve)
        if self._pool.allocate(request_id, num_blocks) is None:
            return None
        seq = SeqState(
            request_id=request_id,
            num_prompt_tokens=num_prompt_tokens,
            max_tokens=reserve,
            arrival=arrival,
            slot=heapq.heappop(self._free_slots),
        )
        bisect.insort(self._running, seq, key=lambda s: s.arrival)
        self._by_id[request_id] = seq
        return seq

    # -- the step ------------------------------------------------------------------------------

    def _grow_to(self, seq: SeqState, num_positions: int) -> bool:
        """Make `seq`'s table cover `num_positions`, allocating on demand; False if it cannot."""
        missing = self._pool.blocks_for(num_positions) - len(self._pool.table(seq.request_id))
        return missing <= 0 or self._pool.allocate(seq.request_id, missing) is not None

    def _coverable(self, seq: SeqState) -> int:
        """Positions `seq` could cover with its own blocks plus every free one."""
        num_blocks = len(self._pool.table(seq.request_id)) + self._pool.num_free
        return num_blocks * self._pool.block_size

    def schedule(self) -> StepPlan:
        """Plan the next step: prefill chunks first, then one decode row per decoding sequence.

        Each group is in arrival order. A prefill chunk takes at most `prefill_chunk` tokens and
        is cut to the rows left in `max_num_batched_tokens` (and, under "slot-only", to the
        blocks left in the pool); a decode row fits or waits. Sequences without rows are listed
        in `waiting_ids`; nobody is evicted.
        """
        budget = self.config.max_num_batched_tokens
        prefill_chunks: list[ChunkPlan] = []
        decode_chunks: list[ChunkPlan] = []
        waiting_ids: list[str] = []
        for seq in self._running:
            if not seq.is_prefilling:
                continue
            num_tokens = min(
                self.config.prefill_chunk,
                seq.num_prompt_tokens - seq.num_computed,
                budget,
                self._coverable(seq) - seq.num_computed,
            )
            if num_tokens <= 0 or not self._grow_to(seq, seq.num_computed + num_tokens):
                waiting_ids.append(seq.request_id)
                continue
            budget -= num_tokens
            end = seq.num_computed + num_tokens
            prefill_chunks.append(self._chunk(seq, num_tokens, end == seq.num_prompt_tokens))
        for seq in self._running:
            if seq.is_prefilling:
                continue
            # A spent answer budget means the engine has not released a finished sequence
            # yet; another row would sample past max_tokens and then outgrow the reservation.
            if seq.has_reached_max_tokens or budget < 1:
                waiting_ids.append(seq.request_id)
                continue
            if not self._grow_to(seq, seq.num_computed + 1):
                waiting_ids.append(seq.request_id)
                continue
            budget -= 1
            decode_chunks.append(self._chunk(seq, 1, True))
        if self._running:
            self._batch_open = False
        step = self._num_steps
        self._num_steps += 1
        self._pending_step = step
        order = {seq.request_id: index for index, seq in enumerate(self._running)}
        waiting_ids.sort(key=order.__getitem__)
        return StepPlan(
            step=step,
            chunks=tuple(prefill_chunks + decode_chunks),
            waiting_ids=tuple(waiting_ids),
        )

    def _chunk(self, seq: SeqState, num_tokens: int, samples: bool) -> ChunkPlan:
        return ChunkPlan(
            request_id=seq.request_id,
            slot=seq.slot,
            start=seq.num_computed,
            num_tokens=num_tokens,
            block_ids=self._pool.table(seq.request_id),
            is_prefill=seq.is_prefilling,
            samples=samples,
        )

    def update(self, plan: StepPlan) -> None:
        """Record that `plan` ran: advance each sequence's computed positions and outputs.

        Chunks of sequences released while the step ran are skipped. A plan other than the
        last one handed out, or one already applied, raises ValueError.
        """
        if plan.step != self._pending_step:
            raise ValueError(f"step {plan.step} is not the pending step ({self._pending_step})")
        for chunk in plan.chunks:
            seq = self._by_id.get(chunk.request_id)
            if seq is None:
                continue
            if chunk.start != seq.num_computed or chunk.slot != seq.slot:
                raise ValueError(f"chunk for {chunk.request_id!r} does not match its sequence")
        for chunk in plan.chunks:
            seq = self._by_id.get(chunk.request_id)
            if seq is None:
                continue
            seq.num_computed += chunk.num_tokens
            if chunk.samples:
                seq.num_output += 1
        self._pending_step = None

    def is_stuck(self, plan: StepPlan) -> bool:
        """Sequences are running but `plan` has no rows: nothing can progress or finish."""
        return bool(self._running) and plan.num_rows == 0

    # -- the one release path ------------------------------------------------------------------

    def release(self, request_id: str) -> bool:
        """Return the sequence's slot and blocks and offer the capacity signal.

        Finish, cancel, slow consumer, error and shutdown all end here. Idempotent: False when
        `request_id` is not running.
        """
        seq = self._by_id.pop(request_id, None)
        if seq is None:
            return False
        index = bisect.bisect_left(self._running, seq.arrival, key=lambda s: s.arrival)
        while self._running[index] is not seq:
            index += 1
        del self._running[index]
        heapq.heappush(self._free_slots, seq.slot)
        self._pool.release(request_id)
        if not self._running:
            self._batch_open = True
        self._capacity.offer()
        return True


def admit_waiting(scheduler: Scheduler, queue: AdmissionQueue) -> list[Waiter]:
    """The admission round: take any pending capacity signal and run one pass over the queue.

    The pass runs even without a signal, because a new arrival can be admissible without any
    release. Afterwards no waiter is left that the queue's rules and the free capacity would
    admit (a second pass would admit nobody).
    """
    scheduler.capacity.take()
    return queue.drive(
        lambda waiter: (
            scheduler.admit(
                waiter.request_id, waiter.num_prompt_tokens, waiter.reserve, waiter.arrival
            )
            is not None
        )
    )


def admit_or_enqueue(
    scheduler: Scheduler,
    queue: AdmissionQueue,
    request_id: str,
    num_prompt_tokens: int,
    reserve: int,
    now: float,
) -> Outcome | Waiter:
    """A new request at the door: admit it at once if nobody waits and it fits, else queue it.

    Returns Outcome.ADMITTED (the sequence is running: `scheduler.get(request_id)`),
    Outcome.QUEUE_FULL (refused: 429), or the Waiter now in the queue. Nobody is overtaken:
    the direct path is taken only when the queue is empty.
    """
    if len(queue) == 0 and scheduler.can_admit(num_prompt_tokens, reserve):
        seq = scheduler.admit(request_id, num_prompt_tokens, reserve, queue.next_arrival())
        if seq is not None:
            return Outcome.ADMITTED
    waiter = queue.offer(request_id, num_prompt_tokens, reserve, now)
    return Outcome.QUEUE_FULL if waiter is None else waiter
