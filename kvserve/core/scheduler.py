"""Whom to admit and what each step computes: slots, blocks, chunked prefill, decode rows.

The scheduler owns every running sequence's `SeqState` (its tokens, counts, slot and, through
the pool, its blocks). One loop drives it, three calls per step:

    plan = scheduler.schedule()                      # what to compute
    output = ...                                     # the engine runs the plan and samples
    scheduler.update_from_output(plan, sampled)      # what was computed; publishes full blocks
    scheduler.release(request_id)                    # each finished / cancelled / failed one
    admit_waiting(scheduler, queue)                  # between steps: the admission round

Prefix caching (a pool built with `prefix_caching=True`, kvserve/core/prefix.py): a sequence
admitted with its prompt's token ids takes the longest published prefix of its prompt, in whole
blocks, capped so the last prompt token is computed (its logits are sampled). Reused blocks take
a reference; the reservation counts only the blocks still to fill. A full block is published
only in `update_from_output`, after the step that wrote it has landed.

A released sequence also publishes its partly filled last block (its tail: in a chat, the end
of the answer the next turn resends). A prompt that continues past its full-block hits with
some of a tail's tokens copies that block into its own next block (`StepPlan.copies`, before the
next forward pass) and starts computing after the positions it shares. Until the step carrying
the copy lands (or fails), the source block is held by a reference of its own
(`copy_source_owner`), so no allocation can evict and overwrite it first.

n > 1 (`Prompt.n`): one request, n sequences admitted all or nothing. The first (the leader)
prefills; the others wait. The chunk that completes the prompt samples n tokens from its last
row; then each follower takes the prompt's full blocks by reference and a copy of the partly
filled last block (`StepPlan.copies`, run before the next forward pass), so no sequence writes
into a block another can read.

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
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from kvserve.config import SchedulerConfig
from kvserve.core.blocks import BlockPool
from kvserve.core.plan import BlockCopy, ChunkPlan, StepPlan
from kvserve.core.prefix import BlockHash, block_hashes, root_hash
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


def copy_source_owner(request_id: str) -> str:
    """The pool owner holding a tail block `request_id` copies from, until the copy has run."""
    return f"{request_id}:copy-source"


@dataclass(frozen=True, slots=True)
class _Hits:
    """What a prompt takes from the prefix cache: whole blocks by reference, then perhaps the
    first `tail_tokens` positions of a published tail (`tail_block`) by copy."""

    block_ids: list[int]
    tail_block: int | None = None
    tail_tokens: int = 0


def choice_id(request_id: str, index: int) -> str:
    """The sequence id of choice `index` of a request (choice 0 is the request id itself)."""
    return request_id if index == 0 else f"{request_id}#{index}"


@dataclass(frozen=True, slots=True)
class Prompt:
    """What admission needs beyond counts: the prompt's tokens (for prefix lookups), the
    tenant's cache salt, and the number of answers sampled from it."""

    token_ids: tuple[int, ...] = ()
    salt: str | None = None
    n: int = 1
    # False when every prompt row must be computed (its logits are wanted, e.g. for prompt
    # log-probabilities): cached blocks never stand in for them. Its blocks are still published.
    reuse: bool = True


@dataclass(slots=True)
class SeqState:
    """A running sequence: its tokens and counts, kept in this one place.

    `prompt_token_ids` is empty when the caller admitted by counts only (the simulator, policy
    tests); such a sequence is never looked up in or published to the prefix cache.
    """

    request_id: str
    num_prompt_tokens: int
    max_tokens: int  # the resolved answer budget (the reserve)
    arrival: int
    slot: int
    num_computed: int = 0  # positions whose KV has been computed
    num_output: int = 0  # tokens sampled so far
    prompt_token_ids: tuple[int, ...] = ()
    output_token_ids: list[int] = field(default_factory=list)
    salt: str | None = None
    num_cached_tokens: int = 0  # prompt positions taken from the prefix cache at admission
    index: int = 0  # which of the request's n answers
    leader_id: str | None = None  # n > 1: the sequence prefilling for this one, until forked
    follower_ids: tuple[str, ...] = ()  # n > 1, on the leader: the sequences it prefills for
    block_hashes: list[BlockHash] = field(default_factory=list)  # full blocks known so far
    num_published: int = 0  # leading blocks already published (or taken from the cache)

    @property
    def tokens_known(self) -> bool:
        """Whether every prompt and sampled token id is held (required for prefix caching)."""
        return (
            len(self.prompt_token_ids) == self.num_prompt_tokens
            and len(self.output_token_ids) == self.num_output
        )

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt then sampled tokens."""
        return [*self.prompt_token_ids, *self.output_token_ids]

    @property
    def awaits_fork(self) -> bool:
        """A follower whose leader has not finished the shared prompt yet."""
        return self.leader_id is not None

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
        self._pending_copies: list[BlockCopy] = []  # for the next plan
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

    def check(self, num_prompt_tokens: int, max_tokens: int | None, n: int = 1) -> int:
        """Return the reserve, or raise Infeasible when the request could never run (with
        `n` answers: the prompt's blocks once, each answer's blocks n times, n slots)."""
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
        if n > 1:
            if n > self.config.max_num_seqs:
                raise Infeasible(
                    "n", f"n is {n}; at most {self.config.max_num_seqs} sequences run at once"
                )
            needed = self._pool.blocks_for(total) + (n - 1) * self._follower_blocks(
                num_prompt_tokens, reserve
            )
            if self.config.admission == "reserve" and needed > self._pool.num_blocks:
                raise Infeasible(
                    "n",
                    f"{n} answers of up to {reserve} tokens to a {num_prompt_tokens}-token "
                    f"prompt need {needed} KV blocks; the cache has {self._pool.num_blocks}",
                )
        return reserve

    # -- admission -----------------------------------------------------------------------------

    def _num_blocks_to_reserve(self, num_prompt_tokens: int, reserve: int) -> int:
        if self.config.admission == "slot-only":
            return 0
        return self._pool.blocks_for(num_prompt_tokens + reserve)

    def _prefix_hits(self, num_prompt_tokens: int, prompt: Prompt | None) -> _Hits:
        """What the prompt can reuse: whole blocks, then some positions of a published tail,
        always leaving its last token to compute."""
        if prompt is None or not prompt.reuse or len(prompt.token_ids) != num_prompt_tokens:
            return _Hits([])
        if self._pool.cache is None:
            return _Hits([])
        block_size = self._pool.block_size
        max_blocks = (num_prompt_tokens - 1) // block_size
        token_ids = prompt.token_ids[: max_blocks * block_size]
        hashes = block_hashes(token_ids, block_size, prompt.salt)
        hits = self._pool.lookup(hashes)
        if self.config.admission != "reserve":
            # A tail is copied into the prompt's next block, which only a reservation holds
            # at admission.
            return _Hits(hits)
        # The rest of the prompt's next block, short of its last token.
        start = len(hits) * block_size
        rest = prompt.token_ids[start : min(start + block_size, num_prompt_tokens - 1)]
        parent = hashes[len(hits) - 1] if hits else root_hash(prompt.salt)
        tail = self._pool.lookup_tail(parent, rest)
        if tail is None or tail[1] == 0:
            return _Hits(hits)
        return _Hits(hits, tail[0], tail[1])

    def _admission_cost(
        self, num_prompt_tokens: int, reserve: int, prompt: Prompt | None
    ) -> tuple[_Hits, int, int]:
        """(prefix hits, fresh blocks to allocate, blocks that must be available) for admission.

        Available blocks are free and cached-free ones, less the cached-free hits this very
        admission takes back (they stop being evictable), the tail it copies from included.
        """
        hits = self._prefix_hits(num_prompt_tokens, prompt)
        n = 1 if prompt is None else prompt.n
        fresh = max(
            self._num_blocks_to_reserve(num_prompt_tokens, reserve) - len(hits.block_ids), 0
        )
        if n > 1:
            fresh += (n - 1) * self._follower_blocks(num_prompt_tokens, reserve)
        cache = self._pool.cache
        revived = sum(
            1 for block_id in hits.block_ids if cache is not None and cache.is_cached_free(block_id)
        )
        needed = fresh + revived
        if hits.tail_block is not None and cache.is_cached_free(hits.tail_block):
            if self._pool.num_free < needed + 1:
                # Holding the tail would cost the block that admission needs: compute instead.
                return _Hits(hits.block_ids), fresh, needed
            needed += 1
        return hits, fresh, needed

    def _follower_blocks(self, num_prompt_tokens: int, reserve: int) -> int:
        """Blocks a follower owns: all but the prompt's full blocks (taken by reference), or
        under slot-only admission just the copy of the partly filled last block."""
        shared = num_prompt_tokens // self._pool.block_size
        partial = 1 if num_prompt_tokens % self._pool.block_size else 0
        if self.config.admission == "slot-only":
            return partial
        return self._pool.blocks_for(num_prompt_tokens + reserve) - shared

    def can_admit(self, num_prompt_tokens: int, reserve: int, prompt: Prompt | None = None) -> bool:
        """Whether `admit` would succeed now."""
        n = 1 if prompt is None else prompt.n
        if not self.batch_open or len(self._free_slots) < n:
            return False
        _, _, needed = self._admission_cost(num_prompt_tokens, reserve, prompt)
        return self._pool.num_free >= needed

    def admit(
        self,
        request_id: str,
        num_prompt_tokens: int,
        reserve: int,
        arrival: int,
        prompt: Prompt | None = None,
    ) -> SeqState | None:
        """Give the request a slot (and under "reserve" its blocks) or nothing: None.

        With `prompt`, the longest cached prefix is reused, and `prompt.n` sequences are
        admitted together (ids from `choice_id`); the leader (choice 0) is returned.
        """
        n = 1 if prompt is None else prompt.n
        ids = [choice_id(request_id, index) for index in range(n)]
        if any(seq_id in self._by_id for seq_id in ids):
            raise ValueError(f"{request_id!r} is already running")
        if num_prompt_tokens < 1 or reserve < 1 or n < 1:
            raise ValueError("a sequence needs a prompt token and an answer budget")
        if not self.can_admit(num_prompt_tokens, reserve, prompt):
            return None
        hits, _, _ = self._admission_cost(num_prompt_tokens, reserve, prompt)
        # Take the hits first: an allocation below may evict cached-free blocks, never these.
        self._pool.share(request_id, hits.block_ids)
        if hits.tail_block is not None:
            self._pool.share(copy_source_owner(request_id), [hits.tail_block])
        own = max(self._num_blocks_to_reserve(num_prompt_tokens, reserve) - len(hits.block_ids), 0)
        if self._pool.allocate(request_id, own) is None:
            raise AssertionError("the pool refused an allocation can_admit allowed")
        if hits.tail_block is not None:
            target = self._pool.table(request_id)[len(hits.block_ids)]
            self._pending_copies.append(BlockCopy(request_id, hits.tail_block, target))
        for seq_id in ids[1:]:
            if (
                self._pool.allocate(seq_id, self._follower_blocks(num_prompt_tokens, reserve))
                is None
            ):
                raise AssertionError("the pool refused an allocation can_admit allowed")
        token_ids = () if prompt is None else prompt.token_ids
        salt = None if prompt is None else prompt.salt
        num_cached = len(hits.block_ids) * self._pool.block_size + hits.tail_tokens
        hashes: list[BlockHash] = []
        if self._pool.cache is not None and len(token_ids) == num_prompt_tokens:
            hashes = block_hashes(token_ids, self._pool.block_size, salt)
        seqs = []
        for index, seq_id in enumerate(ids):
            seq = SeqState(
                request_id=seq_id,
                num_prompt_tokens=num_prompt_tokens,
                max_tokens=reserve,
                arrival=arrival,
                slot=heapq.heappop(self._free_slots),
                prompt_token_ids=token_ids,
                salt=salt,
                num_cached_tokens=num_cached,
                index=index,
                leader_id=None if index == 0 else request_id,
            )
            if index == 0:
                seq.num_computed = num_cached
                seq.block_hashes = hashes
                seq.num_published = len(hits.block_ids)
                seq.follower_ids = tuple(ids[1:])
            bisect.insort(self._running, seq, key=lambda s: (s.arrival, s.index))
            self._by_id[seq_id] = seq
            seqs.append(seq)
        return seqs[0]

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
            if seq.awaits_fork:
                waiting_ids.append(seq.request_id)
                continue
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
            if seq.is_prefilling or seq.awaits_fork:
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
        # A follower released since its fork needs no copy (its block may belong to another).
        copies = tuple(c for c in self._pending_copies if c.request_id in self._by_id)
        self._pending_copies = []
        return StepPlan(
            step=step,
            chunks=tuple(prefill_chunks + decode_chunks),
            waiting_ids=tuple(waiting_ids),
            copies=copies,
        )

    def _chunk(self, seq: SeqState, num_tokens: int, samples: bool) -> ChunkPlan:
        sample_ids: tuple[str, ...] = ()
        if samples:
            # The chunk completing a leader's prompt samples every answer from its last row.
            sample_ids = (seq.request_id, *seq.follower_ids) if seq.is_prefilling else ()
        token_ids: tuple[int, ...] = ()
        if seq.tokens_known:
            end = seq.num_computed + num_tokens
            prompt_part = seq.prompt_token_ids[seq.num_computed : end]
            output_part = seq.output_token_ids[
                max(seq.num_computed - seq.num_prompt_tokens, 0) : max(
                    end - seq.num_prompt_tokens, 0
                )
            ]
            token_ids = (*prompt_part, *output_part)
        return ChunkPlan(
            request_id=seq.request_id,
            slot=seq.slot,
            start=seq.num_computed,
            num_tokens=num_tokens,
            block_ids=self._pool.table(seq.request_id),
            is_prefill=seq.is_prefilling,
            samples=samples,
            sample_ids=sample_ids,
            token_ids=token_ids,
        )

    def update(self, plan: StepPlan) -> None:
        """Record that `plan` ran, without token ids (the simulator, policy tests)."""
        self.update_from_output(plan, None)

    def update_from_output(self, plan: StepPlan, sampled: Mapping[str, int] | None) -> None:
        """Record that `plan` ran and landed: advance each sequence's computed positions, append
        the tokens sampled for it (`sampled`: sequence id -> token id; None counts samples
        without ids), fork the followers of a leader whose prompt is done, and publish every
        block the step completed.

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
            if not chunk.samples:
                self._publish(seq)
                continue
            for seq_id in chunk.sampler_ids:
                target = self._by_id.get(seq_id)
                if target is None:
                    continue
                if target.awaits_fork:
                    self._fork(seq, target)
                target.num_output += 1
                if sampled is not None and seq_id in sampled:
                    target.output_token_ids.append(sampled[seq_id])
            self._publish(seq)
        self._drop_copy_sources(plan)
        self._pending_step = None

    def abort(self, plan: StepPlan) -> None:
        """The step failed: nothing it planned counts and nothing is published. The caller
        releases every sequence the step touched (`plan.touched_ids`)."""
        if plan.step != self._pending_step:
            raise ValueError(f"step {plan.step} is not the pending step ({self._pending_step})")
        self._drop_copy_sources(plan)
        self._pending_step = None

    def _drop_copy_sources(self, plan: StepPlan) -> None:
        """The step carrying the plan's copies is over: their tail sources may go back."""
        for copy in plan.copies:
            self._pool.release(copy_source_owner(copy.request_id))

    def _fork(self, leader: SeqState, follower: SeqState) -> None:
        """The leader's prompt is computed: the follower takes its full blocks by reference and
        a copy of its partly filled last block, and continues from the end of the prompt."""
        block_size = self._pool.block_size
        num_full = leader.num_prompt_tokens // block_size
        leader_table = self._pool.table(leader.request_id)
        self._pool.share(follower.request_id, leader_table[:num_full], prepend=True)
        if leader.num_prompt_tokens % block_size:
            own = self._pool.table(follower.request_id)
            self._pending_copies.append(
                BlockCopy(follower.request_id, leader_table[num_full], own[num_full])
            )
        follower.num_computed = leader.num_prompt_tokens
        follower.block_hashes = list(leader.block_hashes[:num_full])
        follower.num_published = num_full  # the leader publishes the shared blocks
        follower.leader_id = None

    def _publish(self, seq: SeqState) -> None:
        """Publish the sequence's full blocks that are computed and not yet published."""
        if self._pool.cache is None or not seq.tokens_known:
            return
        block_size = self._pool.block_size
        num_full = seq.num_computed // block_size
        if num_full <= seq.num_published:
            return
        if len(seq.block_hashes) < num_full:
            tokens = seq.all_token_ids[: num_full * block_size]
            seq.block_hashes = block_hashes(tokens, block_size, seq.salt, known=seq.block_hashes)
        table = self._pool.table(seq.request_id)
        for index in range(seq.num_published, num_full):
            self._pool.publish(table[index], seq.block_hashes[index])
        seq.num_published = num_full

    def _publish_tail(self, seq: SeqState) -> None:
        """Publish the partly filled last block of a sequence being released: the positions it
        computed in steps that landed, after its last full block."""
        if self._pool.cache is None or not seq.tokens_known or seq.awaits_fork:
            return
        block_size = self._pool.block_size
        num_full, num_tail = divmod(seq.num_computed, block_size)
        table = self._pool.table(seq.request_id)
        if num_tail == 0 or len(table) <= num_full or len(seq.block_hashes) < num_full:
            return
        parent = seq.block_hashes[num_full - 1] if num_full else root_hash(seq.salt)
        tokens = seq.all_token_ids[num_full * block_size : seq.num_computed]
        self._pool.publish_tail(table[num_full], parent, tokens)

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
        # Followers still waiting for this leader's prompt could never start without it.
        for follower_id in seq.follower_ids:
            follower = self._by_id.get(follower_id)
            if follower is not None and follower.awaits_fork:
                self.release(follower_id)
        index = bisect.bisect_left(self._running, seq.arrival, key=lambda s: s.arrival)
        while self._running[index] is not seq:
            index += 1
        del self._running[index]
        heapq.heappush(self._free_slots, seq.slot)
        self._publish_tail(seq)
        self._pool.release(request_id)
        # Released before the step carrying its tail copy was planned: the copy never runs.
        self._pool.release(copy_source_owner(request_id))
        if not self._running:
            self._batch_open = True
        self._capacity.offer()
        return True


def admit_waiting(
    scheduler: Scheduler,
    queue: AdmissionQueue,
    prompts: Callable[[str], Prompt | None] | None = None,
) -> list[Waiter]:
    """The admission round: take any pending capacity signal and run one pass over the queue.

    `prompts` gives a waiter's Prompt (tokens, salt, n) by request id, when the caller has them.
    The pass runs even without a signal, because a new arrival can be admissible without any
    release. Afterwards no waiter is left that the queue's rules and the free capacity would
    admit (a second pass would admit nobody).
    """
    scheduler.capacity.take()
    return queue.drive(
        lambda waiter: (
            scheduler.admit(
                waiter.request_id,
                waiter.num_prompt_tokens,
                waiter.reserve,
                waiter.arrival,
                None if prompts is None else prompts(waiter.request_id),
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
    prompt: Prompt | None = None,
) -> Outcome | Waiter:
    """A new request at the door: admit it at once if nobody waits and it fits, else queue it.

    Returns Outcome.ADMITTED (the sequence is running: `scheduler.get(request_id)`),
    Outcome.QUEUE_FULL (refused: 429), or the Waiter now in the queue. Nobody is overtaken:
    the direct path is taken only when the queue is empty.
    """
    if len(queue) == 0 and scheduler.can_admit(num_prompt_tokens, reserve, prompt):
        seq = scheduler.admit(request_id, num_prompt_tokens, reserve, queue.next_arrival(), prompt)
        if seq is not None:
            return Outcome.ADMITTED
    waiter = queue.offer(request_id, num_prompt_tokens, reserve, now)
    return Outcome.QUEUE_FULL if waiter is None else waiter
