"""Whom to admit and what each step computes: door checks, admission order, step composition,
update and release. Which blocks a sequence holds is the KV manager's (kvserve/core/kv_manager.py);
the scheduler asks it and never touches blocks itself.

One loop drives it, three calls per step:

    plan = scheduler.schedule()                                # what to compute; may preempt
    output = ...                                               # the engine runs the plan, samples
    finished = scheduler.update_from_output(plan, sampled, stopped)   # the one stop check
    scheduler.release(seq_id)                                  # each finished / cancelled one
    admit_waiting(scheduler, queue)                            # between steps: the admission round

Admission (`SchedulerConfig.admission`):

- "partial" (the default): a request is admitted with a slot per answer and blocks for its
  prompt plus the first `reserve_tokens` positions of its answer (at most its budget). A
  sequence takes further blocks from the free pool as it grows (cached-free blocks count as
  free). When none is left, the scheduler preempts by recompute: the running request that
  arrived last (all its answers together) publishes its full blocks to the prefix cache, gives
  its slots and blocks back and goes to the head of the waiting line, ahead of every new
  arrival. The oldest running request is never preempted and can always grow (it may preempt
  every other; the door checked that it fits the pool alone), so it always finishes; preempted
  requests resume in arrival order before anyone else is admitted, so nothing starves.
  A resumed sequence recomputes its prompt and the answer so far (taking back from the prefix
  cache whatever is still there) and samples its next token from the chunk that completes
  them: no token is sampled twice.
- "reserve": a request is admitted with blocks for its prompt and its whole answer budget, so
  nothing ever grows or is preempted; with no max_tokens that is the rest of the context.

Sliding windows (a KV manager built with a window: a model whose every layer attends only to
the last W positions): each step, before a sequence's rows get their blocks, it gives back the
blocks wholly behind the window of its next row (`KVManager.slide`). A sequence then never holds
more than `window_blocks` blocks at once (the window and one step's rows: W - 1 + the prefill
chunk positions, at the worst alignment), so every reservation above is capped at that many
blocks, counted from the first block its window needs, and the door asks only that one
request's windows fit the pool: a prompt longer than the pool is served when its window fits.
The reservation's blocks stay promised to the request as it moves on (the KV manager's spare),
so it grows back into them without preempting anyone, except where a block it gave back was
shared (an n > 1 prompt, another request's cache hit): then it may grow from the free pool and
preempt, under "reserve" too; the door gives no credit for shared prompts with a window, so each
answer resumes on its own.

Priority is the order of arrival at the door (`Sequence.arrival`): it orders the prefill and
decode groups of a step, decides who grows first, and picks the victims of preemption (the
latest arrivals first).

Step composition: prefill chunks first (in arrival order, each at most `prefill_chunk` positions
and cut to the rows left in `max_num_batched_tokens`), then one decode row per decoding
sequence (in arrival order) while rows are left; a sequence without rows waits for the next
step with its slot and blocks. Rows are counted as each sequence gets its blocks: those a
sequence does not get (it cannot grow and waits, or is preempted, its own growth's victim as
the latest arrival) go to the next ones: a prefill that preempts itself (a windowed prompt
growing past its reservation) never leaves an empty plan while an older sequence could run.

Speculative decoding (`speculative`, kvserve/core/spec.py): once every decode row has its
block, each decoding sequence that speculates (in arrival order, while rows are left, and only
while the step has at most `disable_by_batch_size` decoding sequences) may add guessed tokens
after its decode row: at most its `Acceptance.k`, at most `num_remaining - 1` (the budget holds
the bonus token too), only with blocks its table has or the free pool gives (guesses never
preempt). The update keeps the accepted prefix and the one token chosen after it, and rolls
back the rest (`KVManager.rollback`). Under that cap, with `disable_when_slower`, a step
speculates only where it pays: `Payoff` (kvserve/core/spec.py) measures tokens a second with
and without speculation at each batch size, from the wall time the engine reports for each
step of decoding rows only (`observe_step`), and takes the faster kind.

n > 1 (`Prompt.n`): one request, n sequences admitted all or nothing. The first (the leader)
prefills; the others wait. The chunk that completes the prompt samples n tokens from its last
row; then each follower takes the prompt's full blocks by reference and a copy of the partly
filled last block (`StepPlan.copies`, run before the next forward pass), so no sequence writes
into a block another can read. The answers of a request are preempted and resumed together.

Policies other than these (request-level batching, admission on a free slot alone) exist only
to be shown by the simulator: kvserve/sim/policies.py, as subclasses using the hooks below.
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Callable, Collection, Iterable, Mapping
from collections.abc import Sequence as Seq

from kvserve.config import SchedulerConfig, SpeculativeConfig
from kvserve.core.kv_manager import NO_HITS, ComputedBlocks, KVManager
from kvserve.core.plan import ChunkPlan, StepPlan
from kvserve.core.queue import AdmissionQueue, CapacitySignal, Outcome, Waiter
from kvserve.core.sequence import Sequence, SequenceStatus
from kvserve.core.spec import (
    NGRAM_REST_STEPS,
    REST_STEPS,
    Acceptance,
    Payoff,
    propose_ngram,
)

Proposer = Callable[[Sequence, int], Seq[int]]
"""Guesses for a decoding sequence: (the sequence, at most how many) -> the guessed tokens."""

BatchProposer = Callable[[Seq[tuple[Sequence, int]]], Seq[Seq[int]]]
"""Guesses for several decoding sequences at once (a draft model batches them): [(the sequence,
how many)] -> the guessed tokens of each. Their blocks are grown before it is called, since it
writes KV (the draft's) at the guessed positions."""

RUNNING = SequenceStatus.RUNNING
PREEMPTED = SequenceStatus.PREEMPTED


class Infeasible(ValueError):
    """A request that could never run, refused at the door (HTTP 400).

    `param` names the request field to change: "prompt" when the prompt alone leaves no room
    for an answer (the server reports it as "messages" for chat requests), "max_tokens" when the
    prompt fits but the answer budget does not, "n" when the answers together do not.
    """

    def __init__(self, param: str, reason: str) -> None:
        super().__init__(reason)
        self.param = param
        self.reason = reason


def _priority(seq: Sequence) -> tuple[int, int]:
    return (seq.arrival, seq.index)


class Scheduler:
    """Door checks, admission order, step composition, update and release over a KV manager.

    `max_model_len` is the context length resolved by the engine (the model's, or the user's
    smaller override). `capacity` is offered on every release; pass a subclass to hook a wake-up.
    """

    # Whether a sequence that cannot grow preempts later arrivals (a policy shown by the
    # simulator turns it off and waits instead).
    preempts = True

    def __init__(
        self,
        config: SchedulerConfig,
        kv: KVManager,
        max_model_len: int,
        capacity: CapacitySignal | None = None,
        *,
        speculative: SpeculativeConfig | None = None,
        proposer: Proposer | None = None,
        batch_proposer: BatchProposer | None = None,
    ) -> None:
        if max_model_len <= 0:
            raise ValueError("max_model_len must be positive")
        self.config = config
        self._kv = kv
        self._max_model_len = max_model_len
        self._capacity = capacity if capacity is not None else CapacitySignal()
        self._free_slots = list(range(config.max_num_seqs))  # a heap: lowest slot first
        self._running: list[Sequence] = []  # by priority
        self._preempted: list[list[Sequence]] = []  # the requests waiting to resume, by priority
        self._by_id: dict[str, Sequence] = {}  # running (finished ones until released), preempted
        self._num_steps = 0
        self._pending_step: int | None = None  # the planned step awaiting update()
        self.num_preemptions = 0  # sequences preempted so far
        self._spec = speculative
        self.payoff = (
            Payoff() if speculative is not None and speculative.disable_when_slower else None
        )
        # The pending step's measurement, when it has decoding rows only: (step, batch size,
        # tokens it gave).
        self._measured: tuple[int, int, int] | None = None
        # With a window: the most blocks a sequence holds at once (None: no cap).
        self._window_blocks = kv.window_blocks(
            min(config.prefill_chunk, config.max_num_batched_tokens)
        )
        if proposer is None and speculative is not None and speculative.method == "ngram":
            proposer = self._ngram
        self._propose = proposer
        self._propose_batch = batch_proposer

    def _ngram(self, seq: Sequence, num_tokens: int) -> tuple[int, ...]:
        """Prompt lookup over the sequence's known tokens (nothing when only counts are known)."""
        if not seq.tokens_known:
            return ()
        spec = self._spec
        return propose_ngram(
            seq.all_token_ids, num_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max
        )

    # -- introspection -------------------------------------------------------------------------

    @property
    def speculative(self) -> SpeculativeConfig | None:
        """The speculative decoding configuration (None: off)."""
        return self._spec

    @property
    def kv(self) -> KVManager:
        """The KV manager holding the sequences' blocks."""
        return self._kv

    @property
    def pool(self):
        """The block pool under the KV manager (kvserve.core.blocks.BlockPool)."""
        return self._kv.pool

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
        """The most positions one sequence can ever hold: the context, capped by the pool (not
        for a window that fits the pool: such a sequence holds its window's blocks only)."""
        if self._window_blocks is not None and self._window_blocks <= self._kv.num_blocks:
            return self._max_model_len
        return min(self._max_model_len, self._kv.num_blocks * self._kv.block_size)

    @property
    def window_blocks(self) -> int | None:
        """With a sliding window, the most blocks one sequence holds at once (None: no cap)."""
        return self._window_blocks

    def blocks_needed(self, num_positions: int) -> int:
        """The most blocks a sequence of `num_positions` positions holds at once: all of them,
        or with a window at most `window_blocks`."""
        needed = self._kv.blocks_for(num_positions)
        if self._window_blocks is None:
            return needed
        return min(needed, self._window_blocks)

    @property
    def running(self) -> list[Sequence]:
        """Sequences holding a slot, by priority (a copy)."""
        return list(self._running)

    @property
    def preempted(self) -> list[Sequence]:
        """Preempted sequences in the order they resume (a copy)."""
        return [seq for group in self._preempted for seq in group]

    def get(self, seq_id: str) -> Sequence | None:
        """The running or preempted sequence `seq_id`, or None."""
        return self._by_id.get(seq_id)

    @property
    def num_running(self) -> int:
        """Sequences holding a slot."""
        return len(self._running)

    @property
    def num_preempted(self) -> int:
        """Sequences waiting to resume."""
        return sum(len(group) for group in self._preempted)

    @property
    def num_free_slots(self) -> int:
        """Slots nobody holds."""
        return len(self._free_slots)

    @property
    def num_steps(self) -> int:
        """Plans handed out so far."""
        return self._num_steps

    # -- at the door ---------------------------------------------------------------------------

    def _shared_prompt_blocks(self, num_prompt_tokens: int) -> int:
        """Blocks n answers are sure to share when they fill the pool alone: the prompt's full
        ones under "reserve"; none under "partial", where answers preempted after their fork
        may resume on separate copies of the prompt (once the prefix cache evicted it), nor
        with a window: there the shared blocks fall behind the answers' windows, each answer
        grows blocks of its own in their place (perhaps preempted for them, under "reserve"
        too) and resumes on its own copy."""
        if self.config.admission == "reserve" and self._window_blocks is None:
            return num_prompt_tokens // self._kv.block_size
        return 0

    def resolve_budget(self, num_prompt_tokens: int, max_tokens: int | None, n: int = 1) -> int:
        """The answer budget: `max_tokens`, or when None the rest of the context after the
        prompt, capped by what the pool holds for `n` answers (the blocks they share once, the
        rest of each answer n times), so a request that names no budget is never refused for
        a budget it did not ask for."""
        if max_tokens is not None:
            return max_tokens
        windows = self._window_blocks
        if windows is not None and max(n, 1) * windows <= self._kv.num_blocks:
            # Every answer's window fits at once, however long it runs.
            return max(self._max_model_len - num_prompt_tokens, 0)
        block_size = self._kv.block_size
        shared = self._shared_prompt_blocks(num_prompt_tokens) if n > 1 else 0
        per_answer = (self._kv.num_blocks - shared) // max(n, 1)
        pool_limit = block_size * (shared + per_answer) - num_prompt_tokens
        return max(min(self._max_model_len - num_prompt_tokens, pool_limit), 0)

    def check(self, num_prompt_tokens: int, max_tokens: int | None, n: int = 1) -> int:
        """Return the answer budget, or raise Infeasible when the request could never run:
        alone in the pool it must fit with its whole budget (the prompt's blocks once, each
        answer's blocks n times, n slots; with a window, the blocks each answer holds at once),
        which is what lets the oldest request always grow."""
        context = self._max_model_len
        pool_tokens = self._kv.num_blocks * self._kv.block_size
        num_blocks = self._kv.num_blocks
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
        if self.blocks_needed(num_prompt_tokens + 1) > num_blocks:
            raise Infeasible(
                "prompt",
                f"the prompt has {num_prompt_tokens} tokens; the KV cache holds at most "
                f"{pool_tokens} tokens{self._window_note()}, which leaves no room for an answer",
            )
        if n > self.config.max_num_seqs:
            raise Infeasible(
                "n", f"n is {n}; at most {self.config.max_num_seqs} sequences run at once"
            )
        budget = self.resolve_budget(num_prompt_tokens, max_tokens, n)
        if budget < 1:
            raise Infeasible(
                "n",
                f"{n} answers to a {num_prompt_tokens}-token prompt leave no room for an answer "
                f"in the KV cache of {self._kv.num_blocks} blocks",
            )
        total = num_prompt_tokens + budget
        if total > context:
            raise Infeasible(
                "max_tokens",
                f"the maximum context length is {context} tokens; {total} were requested "
                f"({num_prompt_tokens} in the prompt, {budget} for the answer)",
            )
        if self.blocks_needed(total) > num_blocks:
            raise Infeasible(
                "max_tokens",
                f"the KV cache holds at most {pool_tokens} tokens{self._window_note()}; {total} "
                f"were requested ({num_prompt_tokens} in the prompt, {budget} for the answer)",
            )
        if n > 1:
            shared = self._shared_prompt_blocks(num_prompt_tokens)
            needed = shared + n * (self._kv.blocks_for(total) - shared)
            # With a window, each answer holds at most its window's blocks at once.
            needed = min(needed, n * self.blocks_needed(total))
            if needed > self._kv.num_blocks:
                raise Infeasible(
                    "n",
                    f"{n} answers of up to {budget} tokens to a {num_prompt_tokens}-token "
                    f"prompt need {needed} KV blocks; the cache has {self._kv.num_blocks}",
                )
        return budget

    def _window_note(self) -> str:
        if self._window_blocks is None:
            return ""
        return (
            f" (a sequence of this model holds at most {self._window_blocks} blocks at once: its "
            f"sliding window of {self._kv.window} positions and one step's rows)"
        )

    # -- admission -----------------------------------------------------------------------------

    def reserved_positions(self, seq: Sequence) -> int:
        """Positions the sequence holds blocks for when it is admitted or resumed: its known
        tokens and, under "partial", the first `reserve_tokens` positions of what remains of
        its answer, under "reserve" all of it."""
        if self.config.admission == "reserve":
            return seq.num_prompt_tokens + seq.max_tokens
        return seq.num_tokens + min(self.config.reserve_tokens, seq.num_remaining)

    def _table_blocks(self, seq: Sequence, computed: ComputedBlocks) -> int:
        """The table a sequence is admitted with: blocks for its reserved positions, with a
        window capped at `window_blocks` held ones after the holes its cache hits leave."""
        num_blocks = self._kv.blocks_for(self.reserved_positions(seq))
        if self._window_blocks is None:
            return num_blocks
        return min(num_blocks, self._kv.first_taken(computed) + self._window_blocks)

    def _follower_blocks(self, seq: Sequence) -> int:
        """Blocks an n > 1 follower owns before its fork: its reservation less the prompt's full
        blocks (taken from the leader by reference), at least the copy of the partial one; with
        a window, at most `window_blocks` less the shared ones its window still needs after the
        prompt (so that it too never holds more than `window_blocks`)."""
        block_size = self._kv.block_size
        shared = seq.num_prompt_tokens // block_size
        partial = 1 if seq.num_prompt_tokens % block_size else 0
        own = self._kv.blocks_for(self.reserved_positions(seq)) - shared
        if self._window_blocks is not None:
            in_window = shared - self._kv.first_needed_block(seq.num_prompt_tokens)
            own = min(own, self._window_blocks - in_window)
        return max(own, partial)

    def _admission_open(self) -> bool:
        """Whether the policy admits anyone now (a policy shown by the simulator closes it)."""
        return True

    def _admission_plan(
        self, group: Seq[Sequence]
    ) -> list[tuple[Sequence, ComputedBlocks, int]] | None:
        """How `group` (one request's sequences) would be admitted: each with its cache hits
        and the blocks of its table; None when the slots or the blocks are not there."""
        if len(self._free_slots) < len(group) or not self._admission_open():
            return None
        for with_tails in (True, False):
            plan = []
            for seq in group:
                if seq.awaits_fork:
                    plan.append((seq, NO_HITS, self._follower_blocks(seq)))
                    continue
                computed = self._kv.computed_blocks(seq, with_tail=with_tails)
                num_blocks = self._table_blocks(seq, computed)
                if computed.tail_block is not None and num_blocks <= len(computed.block_ids):
                    # A tail is copied into the block after the hits, which only a reservation
                    # holds at admission.
                    computed = computed.without_tail()
                    num_blocks = self._table_blocks(seq, computed)
                plan.append((seq, computed, num_blocks))
            cost = self._kv.admission_cost(
                (
                    computed,
                    num_blocks if seq.awaits_fork else self._kv.fresh_blocks(computed, num_blocks),
                )
                for seq, computed, num_blocks in plan
            )
            if cost <= self._kv.num_free:
                return plan
            if not any(computed.tail_block is not None for _, computed, _ in plan):
                return None
            # Holding a tail would cost a block the admission needs: compute instead.
        return None

    def can_admit(self, seqs: Seq[Sequence]) -> bool:
        """Whether `admit(seqs)` would succeed now (never while a preempted request waits)."""
        return not self._preempted and self._admission_plan(seqs) is not None

    def admit(self, seqs: Seq[Sequence]) -> bool:
        """Admit one request's waiting sequences together (n > 1: the leader first): slots and
        blocks, or nothing (False). The longest cached prefix of each is reused."""
        for seq in seqs:
            if seq.seq_id in self._by_id:
                raise ValueError(f"{seq.seq_id!r} is already running")
            if seq.num_prompt_tokens < 1 or seq.max_tokens < 1:
                raise ValueError("a sequence needs a prompt token and an answer budget")
        if self._preempted:
            return False
        plan = self._admission_plan(seqs)
        if plan is None:
            return False
        self._place(plan, first=True)
        return True

    def resume(self) -> list[Sequence]:
        """Resume preempted requests in order while they fit; returns the sequences resumed."""
        resumed: list[Sequence] = []
        while self._preempted:
            plan = self._admission_plan(self._preempted[0])
            if plan is None:
                break
            self._preempted.pop(0)
            self._place(plan, first=False)
            resumed.extend(seq for seq, _, _ in plan)
        return resumed

    def _place(self, plan: list[tuple[Sequence, ComputedBlocks, int]], *, first: bool) -> None:
        leader_cached = 0
        for seq, computed, num_blocks in plan:
            if seq.awaits_fork:
                self._kv.admit_follower(seq, num_blocks)
                seq.num_computed = 0
                if first:
                    seq.num_cached_tokens = leader_cached
            else:
                seq.num_computed = self._kv.admit(seq, computed, num_blocks)
                if first:
                    seq.num_cached_tokens = min(seq.num_computed, seq.num_prompt_tokens)
                    leader_cached = seq.num_cached_tokens
            seq.slot = heapq.heappop(self._free_slots)
            seq.status = RUNNING
            bisect.insort(self._running, seq, key=_priority)
            self._by_id[seq.seq_id] = seq

    # -- the step ------------------------------------------------------------------------------

    def schedule(self) -> StepPlan:
        """Plan the next step: prefill chunks first, then one decode row per decoding sequence,
        each group by priority; blocks for the rows are found oldest first, preempting the
        latest arrivals when the pool runs dry (`StepPlan.preempted_ids`). Sequences without
        rows are listed in `waiting_ids`."""
        budget = self.config.max_num_batched_tokens
        preempted_ids: list[str] = []
        granted: dict[str, int] = {}
        # Blocks in plan order: prefill chunks (whose positions admission reserved, except under
        # a policy that reserves nothing, or with a window past the reservation), then decode
        # rows, the oldest first. Rows a sequence does not get (it waits, or it was preempted,
        # perhaps by its own growth) go to the next ones.
        for prefill in (True, False):
            for seq in list(self._running):
                if budget < 1:
                    break
                if seq.status is not RUNNING or seq.is_finished or seq.awaits_fork:
                    continue  # preempted for an earlier row of this plan, or not its turn
                if seq.is_prefilling != prefill:
                    continue
                num_tokens = 1
                if prefill:
                    remaining = seq.num_tokens - seq.num_computed
                    num_tokens = min(self.config.prefill_chunk, remaining, budget)
                    if num_tokens < 1:
                        continue
                self._kv.slide(seq)  # blocks behind its window go back before it grows
                num_tokens = self._cover(seq, num_tokens, preempted_ids)
                if num_tokens > 0:
                    granted[seq.seq_id] = num_tokens
                    budget -= num_tokens
        drafts = self._speculate(granted, budget)
        chunks = [
            self._chunk(seq, granted[seq.seq_id], drafts.get(seq.seq_id, ()))
            for prefill in (True, False)
            for seq in self._running
            if seq.seq_id in granted and seq.is_prefilling == prefill
        ]
        waiting_ids = tuple(seq.seq_id for seq in self._running if seq.seq_id not in granted)
        self._on_schedule()
        step = self._num_steps
        self._num_steps += 1
        self._pending_step = step
        return StepPlan(
            step=step,
            chunks=tuple(chunks),
            waiting_ids=waiting_ids,
            copies=self._kv.take_copies(seq.seq_id for seq in self._running),
            preempted_ids=tuple(preempted_ids),
        )

    def _speculate(self, granted: Mapping[str, int], budget: int) -> dict[str, tuple[int, ...]]:
        """Guesses for the decoding sequences that got their row (the rule in the module
        docstring); `budget` is the rows left in the step."""
        spec = self._spec
        if spec is None or (self._propose is None and self._propose_batch is None):
            return {}
        decoding = [
            seq
            for seq in self._running
            if seq.seq_id in granted and seq.status is RUNNING and not seq.is_prefilling
        ]
        if not decoding or len(decoding) > spec.disable_by_batch_size:
            return {}
        if self.payoff is not None:
            if len(decoding) == len(granted):  # decoding rows only: a step to measure
                self._measured = (self._num_steps, len(decoding), 0)
            if not self.payoff.speculates(len(decoding)):
                return {}
        drafts: dict[str, tuple[int, ...]] = {}
        wanting: list[tuple[Sequence, int]] = []
        for seq in decoding:
            if budget < 1:
                break
            if not seq.speculate:
                continue
            if seq.acceptance is None:
                rest = NGRAM_REST_STEPS if spec.method == "ngram" else REST_STEPS
                seq.acceptance = Acceptance(spec.num_speculative_tokens, rest_steps=rest)
            # Blocks for the guesses come from its table and the free pool only.
            fit = self._kv.coverable(seq.seq_id) - seq.num_computed - 1
            limit = min(
                seq.acceptance.wants(),
                seq.num_remaining - 1,
                self._max_model_len - seq.num_tokens,
                budget,
                fit,
            )
            if limit < 1:
                continue
            if self._propose_batch is not None:
                # Blocks first: the proposer writes (the draft's KV) there.
                if not self._kv.grow(seq.seq_id, seq.num_computed + 1 + limit):
                    continue
                wanting.append((seq, limit))
                budget -= limit
                if seq.num_tokens - seq.draft_start > 2:
                    # The draft catches up on more than the last guess and the bonus token (a
                    # new answer's prompt, or the tokens it missed while nobody guessed): a
                    # cost of starting, not of each step.
                    self._measured = None
                continue
            guesses = tuple(self._propose(seq, limit))[:limit]
            if not guesses or not self._kv.grow(seq.seq_id, seq.num_computed + 1 + len(guesses)):
                continue
            drafts[seq.seq_id] = guesses
            budget -= len(guesses)
        if wanting:
            proposed = self._propose_batch(wanting)
            for (seq, limit), guesses in zip(wanting, proposed, strict=True):
                guesses = tuple(guesses)[:limit]
                if guesses:
                    drafts[seq.seq_id] = guesses
                if len(guesses) < limit:  # the blocks grown for guesses that did not come
                    self._kv.rollback(seq, seq.num_computed + 1 + len(guesses))
        return drafts

    def _on_schedule(self) -> None:
        """Called once a plan is made (a policy shown by the simulator closes its batch)."""

    def _cover(self, seq: Sequence, num_tokens: int, preempted_ids: list[str]) -> int:
        """Blocks for `num_tokens` rows of `seq`: grown from the free pool, else by preempting
        the latest arrival (perhaps `seq`'s own request). Returns the rows it can have (0: it
        waits, or it was preempted)."""
        while not self._kv.grow(seq.seq_id, seq.num_computed + num_tokens):
            if self.preempts:
                victims = self._victims()
                if victims is None:
                    return 0  # nothing is younger than the oldest; it waits (not reached)
                self._preempt(victims, preempted_ids)
                if seq.status is not RUNNING:
                    return 0
                continue
            # Without preemption a prefill chunk shrinks to what the pool still holds.
            fit = self._kv.coverable(seq.seq_id) - seq.num_computed
            if not seq.is_prefilling or fit <= 0:
                return 0
            num_tokens = min(num_tokens, fit)
        return num_tokens

    def _victims(self) -> list[Sequence] | None:
        """The running sequences of the latest arrival, unless it is the oldest request."""
        if not self._running:
            return None
        oldest = self._running[0].request_id
        for seq in reversed(self._running):
            if seq.request_id != oldest and seq.status is RUNNING:
                return [s for s in self._running if s.request_id == seq.request_id]
        return None

    def _preempt(self, group: list[Sequence], preempted_ids: list[str]) -> None:
        """Give back the group's slots and blocks (publishing what they computed) and put it
        first in line to resume, among the preempted by priority."""
        resumable = []
        for seq in group:
            self._running.remove(seq)
            heapq.heappush(self._free_slots, seq.slot)
            self._kv.free(seq)
            seq.slot = None
            if seq.is_finished:  # ended in the last update, not released yet: nothing to resume
                self._by_id.pop(seq.seq_id, None)
                continue
            seq.status = PREEMPTED
            seq.num_computed = 0
            seq.draft_len = 0
            seq.num_preemptions += 1
            preempted_ids.append(seq.seq_id)
            resumable.append(seq)
        self.num_preemptions += len(resumable)
        if resumable:
            keys = [_priority(g[0]) for g in self._preempted]
            self._preempted.insert(bisect.bisect(keys, _priority(resumable[0])), resumable)

    def _chunk(self, seq: Sequence, num_tokens: int, drafts: tuple[int, ...] = ()) -> ChunkPlan:
        end = seq.num_computed + num_tokens
        samples = end == seq.num_tokens
        sample_ids: tuple[str, ...] = ()
        if samples and seq.num_output == 0 and seq.follower_ids:
            # The chunk completing a leader's prompt samples every answer from its last row.
            followers = tuple(
                follower_id
                for follower_id in seq.follower_ids
                if (f := self._by_id.get(follower_id)) is not None
                and f.status is RUNNING
                and f.awaits_fork
            )
            if followers:
                sample_ids = (seq.seq_id, *followers)
        token_ids: tuple[int, ...] = ()
        if seq.tokens_known:
            token_ids = seq.token_slice(seq.num_computed, end) + drafts
        return ChunkPlan(
            request_id=seq.seq_id,
            slot=seq.slot,
            start=seq.num_computed,
            num_tokens=num_tokens + len(drafts),
            block_ids=self._kv.table(seq.seq_id),
            is_prefill=seq.is_prefilling,
            samples=samples,
            sample_ids=sample_ids,
            token_ids=token_ids,
            draft_token_ids=drafts,
        )

    def update(self, plan: StepPlan, stopped: Collection[str] = ()) -> list[Sequence]:
        """Record that `plan` ran, without token ids (the simulator, policy tests)."""
        return self.update_from_output(plan, None, stopped)

    def update_from_output(
        self,
        plan: StepPlan,
        sampled: Mapping[str, int | Seq[int]] | None,
        stopped: Collection[str] = (),
    ) -> list[Sequence]:
        """Record that `plan` ran and landed: advance each sequence's computed positions,
        append the tokens sampled for it (`sampled`: sequence id -> token id, or for a
        speculative chunk the tokens it kept, in order; None counts samples without ids; a
        sequence missing from it had its token dropped by the caller, which ends it), fork the
        followers of a leader whose prompt is done, publish every block the step completed, and
        run the one stop check on each new token (`stopped`: the sequences whose stop string or
        grammar ended with their last token). A speculative chunk's sequence keeps its tokens up
        to the first that ends it, has its positions rolled back to them and the blocks freed
        that this empties.

        Returns the sequences that finished (their status says why); the caller releases them.
        Chunks of sequences released while the step ran are skipped. A plan other than the
        last one handed out, or one already applied, raises ValueError.
        """
        if plan.step != self._pending_step:
            raise ValueError(f"step {plan.step} is not the pending step ({self._pending_step})")
        for chunk in plan.chunks:
            seq = self._by_id.get(chunk.request_id)
            if seq is None or seq.status is not RUNNING:
                continue
            if chunk.start != seq.num_computed or chunk.slot != seq.slot:
                raise ValueError(f"chunk for {chunk.request_id!r} does not match its sequence")
        finished: list[Sequence] = []
        emitted = 0  # tokens the decoding rows gave (what `Payoff` measures)
        for chunk in plan.chunks:
            seq = self._by_id.get(chunk.request_id)
            if seq is None or seq.status is not RUNNING:
                continue
            if chunk.is_speculative:
                before = seq.num_output
                if self._verified(seq, chunk, sampled, seq.seq_id in stopped):
                    finished.append(seq)
                emitted += seq.num_output - before
                continue
            if not chunk.is_prefill:
                emitted += len(chunk.sampler_ids)
            seq.num_computed += chunk.num_tokens
            for seq_id in chunk.sampler_ids:
                target = self._by_id.get(seq_id)
                if target is None or target.status is not RUNNING:
                    continue
                if target.awaits_fork:
                    self._kv.fork(seq, target)
                    target.num_computed = seq.num_prompt_tokens
                    target.leader_id = None
                token = None if sampled is None else sampled.get(seq_id)
                target.num_output += 1
                if token is not None:
                    target.output_token_ids.append(token)
                elif sampled is not None:
                    continue  # its token was dropped (the request ends at this boundary)
                status = target.stop_status(token, seq_id in stopped)
                if status is not None:
                    target.status = status
                    finished.append(target)
            self._kv.publish(seq)
        self._kv.drop_copy_sources(plan)
        self._pending_step = None
        if self._measured is not None and self._measured[0] == plan.step:
            self._measured = (*self._measured[:2], emitted)
        return finished

    def observe_step(self, plan: StepPlan, seconds: float) -> None:
        """`plan`, updated, took `seconds` of wall time from its planning on (a draft model's
        guesses included): the speculation rule measures the steps of decoding rows only."""
        measured, self._measured = self._measured, None
        if self.payoff is None or measured is None or measured[0] != plan.step:
            return
        _, batch, tokens = measured
        self.payoff.observe(batch, plan.num_draft_rows > 0, tokens, seconds)

    def _verified(
        self,
        seq: Sequence,
        chunk: ChunkPlan,
        sampled: Mapping[str, int | Seq[int]] | None,
        stopped: bool,
    ) -> bool:
        """Apply a speculative chunk's outcome to its sequence; True when the sequence ended.
        Without ids (counts only) the chunk counts as one token kept, no guess accepted."""
        drafts = chunk.draft_token_ids
        tokens: Seq[int | None]
        if sampled is None:
            tokens = (None,)
        else:
            got = sampled.get(seq.seq_id)
            tokens = () if got is None else (got,) if isinstance(got, int) else tuple(got)
        if seq.acceptance is not None:
            accepted = 0
            while accepted < min(len(drafts), len(tokens)) and tokens[accepted] == drafts[accepted]:
                accepted += 1
            seq.acceptance.record(len(drafts), accepted)
        ended = False
        if not tokens:  # its token was dropped (the request ends at this boundary)
            seq.num_output += 1
            seq.num_computed = chunk.start + 1
        else:
            kept = 0
            for index, token in enumerate(tokens):
                seq.num_output += 1
                kept += 1
                if token is not None:
                    seq.output_token_ids.append(token)
                status = seq.stop_status(token, stopped and index == len(tokens) - 1)
                if status is not None:
                    seq.status = status
                    ended = True
                    break
            # The KV of the last sampled token and of each kept guess was computed; the token
            # chosen last is computed by the next step.
            seq.num_computed = chunk.start + kept
        self._kv.rollback(seq)
        self._kv.publish(seq)
        return ended

    def abort(self, plan: StepPlan) -> None:
        """The step failed: nothing it planned counts and nothing is published. The caller
        releases every sequence the step touched (`plan.touched_ids`)."""
        if plan.step != self._pending_step:
            raise ValueError(f"step {plan.step} is not the pending step ({self._pending_step})")
        self._kv.drop_copy_sources(plan)
        self._pending_step = None

    def is_stuck(self, plan: StepPlan) -> bool:
        """Sequences are running but `plan` has no rows: nothing can progress or finish."""
        return bool(self._running) and plan.num_rows == 0

    # -- the one release path ------------------------------------------------------------------

    def release(self, seq_id: str) -> bool:
        """Return the sequence's slot and blocks (or its place in the line to resume) and offer
        the capacity signal. Finish, cancel, slow consumer, error and shutdown all end here; the
        caller has set its finished status. Idempotent: False when `seq_id` is not held."""
        seq = self._by_id.pop(seq_id, None)
        if seq is None:
            return False
        # Followers still waiting for this leader's prompt could never start without it.
        for follower_id in seq.follower_ids:
            follower = self._by_id.get(follower_id)
            if follower is not None and follower.awaits_fork:
                self.release(follower_id)
        if seq.status is PREEMPTED or seq.slot is None:
            for group in self._preempted:
                if seq in group:
                    group.remove(seq)
            self._preempted = [group for group in self._preempted if group]
        else:
            self._running.remove(seq)
            heapq.heappush(self._free_slots, seq.slot)
            self._kv.free(seq)
            seq.slot = None
        self._on_release()
        self._capacity.offer()
        return True

    def _on_release(self) -> None:
        """Called after every release (a policy shown by the simulator reopens its batch)."""


def admit_waiting(scheduler: Scheduler, queue: AdmissionQueue) -> list[Waiter]:
    """The admission round: take any pending capacity signal, resume preempted requests in
    order, then (when none is left waiting to resume) run one pass over the queue.

    The pass runs even without a signal, because a new arrival can be admissible without any
    release. Afterwards no waiter is left that the queue's rules and the free capacity would
    admit (a second pass would admit nobody). Returns the waiters admitted.
    """
    scheduler.capacity.take()
    scheduler.resume()
    if scheduler.num_preempted:
        return []  # nobody passes a preempted request
    return queue.drive(lambda waiter: scheduler.admit(waiter.sequences))


def admit_or_enqueue(
    scheduler: Scheduler,
    queue: AdmissionQueue,
    seqs: Seq[Sequence],
    now: float,
) -> Outcome | Waiter:
    """A new request (its sequences) at the door: admit it at once if nobody waits and it fits,
    else queue it. Each sequence gets the request's arrival number.

    Returns Outcome.ADMITTED (the sequences are running), Outcome.QUEUE_FULL (refused: 429), or
    the Waiter now in the queue. Nobody is overtaken: the direct path is taken only when the
    queue is empty and no preempted request waits.
    """
    request_id = seqs[0].request_id
    if len(queue) == 0 and scheduler.can_admit(seqs):
        _set_arrival(seqs, queue.next_arrival())
        if scheduler.admit(seqs):
            return Outcome.ADMITTED
    waiter = queue.offer(request_id, now, seqs)
    if waiter is None:
        return Outcome.QUEUE_FULL
    _set_arrival(seqs, waiter.arrival)
    return waiter


def _set_arrival(seqs: Iterable[Sequence], arrival: int) -> None:
    for seq in seqs:
        seq.arrival = arrival
