"""Which blocks each sequence holds: the block pool, the prefix cache, published tails, forks,
growth, and the blocks of preempted sequences. The Scheduler asks this; it never touches
blocks itself (vLLM's KVCacheManager plays the same part).

    computed = kv.computed_blocks(seq)          # what the prefix cache already holds for it
    kv.admission_cost(...)                      # blocks that must be available to admit
    kv.admit(seq, computed, num_blocks)         # take the hits, allocate the rest
    kv.grow(seq, num_positions)                 # more blocks from the free pool, or False
    kv.fork(leader, follower)                   # n > 1: share the prompt, copy its last block
    kv.publish(seq)                             # full computed blocks become reusable
    kv.free(seq)                                # publish its tail, drop every reference

Prefix caching (a pool built with `prefix_caching=True`, kvserve/core/prefix.py): a sequence
takes the longest published prefix of its known tokens, in whole blocks, capped so that its
last known token is computed (its logits are sampled). Reused blocks take a reference. A full
block is published only once the step that wrote it has landed (`publish`, from the
scheduler's update).

A freed sequence also publishes its partly filled last block (its tail: in a chat, the end of
the answer the next turn resends; after a preemption, the end of what it will recompute). A
sequence that continues past its full-block hits with some of a tail's tokens copies that block
into its own next block (`BlockCopy`, before the next forward pass) and starts computing after
the positions it shares. Until the step carrying the copy lands (or fails), the source block is
held by a reference of its own (`copy_source_owner`), so no allocation can evict and overwrite
it first.

Sliding windows (a manager built with `window`, for a model whose every layer attends only to
the last `window` positions): a sequence whose next row is at position p never reads a
position before p - window + 1 again, so the blocks wholly before it go back to the pool
(`slide`, from the scheduler once per step, before the sequence's rows get their blocks): its
table keeps them as holes (kvserve/core/blocks.py), so entry i still covers positions
`i * block_size ..`. Nothing else changes for a hole: a full block was published when the step
that wrote it landed, so it stays in the prefix cache as cached-free; a sequence admitted with
cache hits takes only those inside the window of its first row (the rest are holes from the
start); a fork shares the leader's holes as holes. At most `window_blocks(rows)` blocks are held
at once by a sequence that computes at most `rows` positions a step: the cap the scheduler puts
on a windowed reservation.

A windowed sequence's reservation is a number of blocks held at once (its `budget`), no longer
a stretch of positions. The blocks it gives back while it holds fewer than that stay promised to
its request (spare, not counted in `num_free`), and it grows back into them first: a request
admitted with its window's blocks grows from then on without preempting anyone. A block it gave
back that another sequence still holds (a sibling's shared prompt, a prefix hit another request
holds) returns to the pool only with the last holder, and only then becomes spare (for that
holder's request, if it has room), so a sequence that shared may grow from the free pool again.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from kvserve.core.blocks import BlockPool
from kvserve.core.plan import BlockCopy, StepPlan
from kvserve.core.prefix import BlockHash, PrefixCache, block_hashes, root_hash
from kvserve.core.sequence import Sequence


def copy_source_owner(seq_id: str) -> str:
    """The pool owner holding a tail block `seq_id` copies from, until the copy has run."""
    return f"{seq_id}:copy-source"


@dataclass(frozen=True, slots=True)
class ComputedBlocks:
    """What a sequence takes from the prefix cache: whole blocks by reference, then perhaps the
    first `tail_tokens` positions of a published tail (`tail_block`) by copy."""

    block_ids: tuple[int, ...] = ()
    tail_block: int | None = None
    tail_tokens: int = 0

    def num_tokens(self, block_size: int) -> int:
        """Positions whose KV is taken instead of computed."""
        return len(self.block_ids) * block_size + self.tail_tokens

    def without_tail(self) -> ComputedBlocks:
        return ComputedBlocks(self.block_ids)


NO_HITS = ComputedBlocks()


@dataclass(slots=True)
class _Held:
    """The manager's own record of a sequence holding blocks."""

    num_reserved: int = 0  # table entries taken at admission; later ones grew
    hashes: list[BlockHash] = field(default_factory=list)  # its full blocks' hashes so far
    num_published: int = 0  # leading blocks already published (or taken from the cache)
    request_id: str = ""
    num_budget: int = 0  # with a window: blocks its reservation holds at once


class KVManager:
    """Blocks for sequences over one BlockPool. Every method runs on the scheduler's thread."""

    def __init__(self, pool: BlockPool, *, window: int | None = None) -> None:
        if window is not None and window < 1:
            raise ValueError("a sliding window must be positive")
        self._pool = pool
        self._window = window
        self._held: dict[str, _Held] = {}
        self._pending_copies: list[BlockCopy] = []
        # With a window: blocks promised to a request (given back below its budget), and the
        # sequences of each request holding blocks.
        self._spare: dict[str, int] = {}
        self._num_spare = 0
        self._members: dict[str, list[str]] = {}
        self.num_window_freed = 0  # blocks back in the pool because every holder slid past

    # -- introspection -------------------------------------------------------------------------

    @property
    def pool(self) -> BlockPool:
        return self._pool

    @property
    def cache(self) -> PrefixCache | None:
        return self._pool.cache

    @property
    def block_size(self) -> int:
        return self._pool.block_size

    @property
    def num_blocks(self) -> int:
        return self._pool.num_blocks

    @property
    def window(self) -> int | None:
        """Positions every layer attends to, ending at the row's own (None: all of them)."""
        return self._window

    @property
    def num_free(self) -> int:
        """Blocks available to an admission or to a sequence growing past its spare: free and
        cached-free, less the spare promised to windowed requests."""
        return self._pool.num_free - self._num_spare

    @property
    def num_spare(self) -> int:
        """Free blocks promised to windowed requests (their reservations' blocks given back)."""
        return self._num_spare

    def spare(self, request_id: str) -> int:
        """Free blocks promised to the request."""
        return self._spare.get(request_id, 0)

    def first_needed_block(self, position: int) -> int:
        """The first table entry a sequence whose next row is at `position` still reads: the
        block of position - window + 1 (0 without a window)."""
        if self._window is None:
            return 0
        return max(position - self._window + 1, 0) // self.block_size

    def window_blocks(self, num_rows: int) -> int | None:
        """The most blocks a sequence holds at once when a step computes at most `num_rows` of
        its positions (None without a window): a step from position p holds the blocks of
        p - window + 1 .. p + num_rows - 1, window + num_rows - 1 positions, which span at most
        ceil((window + num_rows - 2) / block_size) + 1 blocks."""
        if self._window is None:
            return None
        if num_rows < 1:
            raise ValueError("num_rows must be positive")
        return self.blocks_for(self._window + num_rows - 2) + 1

    def blocks_for(self, num_positions: int) -> int:
        return self._pool.blocks_for(num_positions)

    def table(self, seq_id: str) -> tuple[int, ...]:
        """The sequence's block table by position (empty when it holds none); entries behind
        its window are `PLACEHOLDER_BLOCK` (kvserve/core/blocks.py)."""
        return self._pool.table(seq_id)

    def num_held(self, seq_id: str) -> int:
        """Blocks the sequence references (its table less the holes)."""
        return self._pool.num_held(seq_id)

    def num_reserved(self, seq_id: str) -> int:
        """Table entries the sequence took at admission (its table's first ones, holes
        included); the rest grew."""
        held = self._held.get(seq_id)
        return 0 if held is None else held.num_reserved

    def holds(self, seq_id: str) -> bool:
        return seq_id in self._held

    # -- admission -----------------------------------------------------------------------------

    def computed_blocks(self, seq: Sequence, *, with_tail: bool = True) -> ComputedBlocks:
        """The longest cached prefix of the sequence's known tokens (prompt, then any answer it
        sampled before a preemption), always leaving its last token to compute; then, with
        `with_tail`, some positions of a published tail. Nothing when caching is off, the
        tokens are not known, or the sequence must compute its prompt rows (`reuse` False
        before its first token)."""
        if self.cache is None or not seq.tokens_known:
            return NO_HITS
        if not seq.reuse and seq.num_output == 0:
            return NO_HITS
        block_size = self.block_size
        token_ids = seq.all_token_ids
        num_known = len(token_ids)
        max_blocks = (num_known - 1) // block_size
        hashes = block_hashes(token_ids[: max_blocks * block_size], block_size, seq.salt)
        hits = tuple(self._pool.lookup(hashes))
        if not with_tail:
            return ComputedBlocks(hits)
        # The rest of the next block, short of the last token.
        start = len(hits) * block_size
        rest = token_ids[start : min(start + block_size, num_known - 1)]
        parent = hashes[len(hits) - 1] if hits else root_hash(seq.salt)
        tail = self._pool.lookup_tail(parent, rest)
        if tail is None or tail[1] == 0:
            return ComputedBlocks(hits)
        return ComputedBlocks(hits, tail[0], tail[1])

    def admission_cost(self, entries: Iterable[tuple[ComputedBlocks, int]]) -> int:
        """Blocks that must be available to admit sequences together, each given as (its
        cache hits, the fresh blocks it allocates): every fresh block, plus each cached-free
        block a hit takes back (it stops being evictable, so it no longer counts as
        available), a tail's source included; a block several take back counts once."""
        cache = self.cache
        revived: set[int] = set()
        fresh = 0
        for computed, num_fresh in entries:
            fresh += num_fresh
            if cache is None:
                continue
            for block_id in computed.block_ids[self.first_taken(computed) :]:
                if cache.is_cached_free(block_id):
                    revived.add(block_id)
            if computed.tail_block is not None and cache.is_cached_free(computed.tail_block):
                revived.add(computed.tail_block)
        return fresh + len(revived)

    def first_taken(self, computed: ComputedBlocks) -> int:
        """How many of the hits lie wholly behind the window of the row after them: they are
        not taken (the table starts with that many holes). 0 without a window."""
        return self.first_needed_block(computed.num_tokens(self.block_size))

    @staticmethod
    def fresh_blocks(computed: ComputedBlocks, num_blocks: int) -> int:
        """Blocks `admit` allocates for a table of `num_blocks` given these hits (at least the
        target of a tail copy)."""
        own = max(num_blocks - len(computed.block_ids), 0)
        return max(own, 1) if computed.tail_block is not None else own

    def admit(self, seq: Sequence, computed: ComputedBlocks, num_blocks: int) -> int:
        """Give the sequence its hits and fresh blocks up to a table of `num_blocks` entries
        (at least its hits, and the tail's target when it copies one; with a window, the hits
        behind the window of its first row are holes); returns the positions taken from the
        cache. The caller has checked `admission_cost` against `num_free`."""
        if self.holds(seq.seq_id) or self.table(seq.seq_id):
            raise ValueError(f"{seq.seq_id!r} already holds blocks")
        # Take the hits first: an allocation below may evict cached-free blocks, never these.
        first = self.first_taken(computed)
        self._pool.share(seq.seq_id, computed.block_ids[first:], holes=first)
        if computed.tail_block is not None:
            self._pool.share(copy_source_owner(seq.seq_id), [computed.tail_block])
        own = self.fresh_blocks(computed, num_blocks)
        if self._pool.allocate(seq.seq_id, own) is None:
            raise AssertionError("the pool refused an allocation the admission cost allowed")
        if computed.tail_block is not None:
            target = self.table(seq.seq_id)[len(computed.block_ids)]
            self._pending_copies.append(BlockCopy(seq.seq_id, computed.tail_block, target))
        held = self._hold(seq, len(self.table(seq.seq_id)))
        if self.cache is not None and seq.tokens_known:
            held.hashes = block_hashes(seq.all_token_ids, self.block_size, seq.salt)
            held.num_published = len(computed.block_ids)
        return computed.num_tokens(self.block_size)

    def admit_follower(self, seq: Sequence, num_blocks: int) -> None:
        """An n > 1 follower's own blocks, allocated at admission; its prompt's full blocks
        come from the leader at the fork."""
        if self._pool.allocate(seq.seq_id, num_blocks) is None:
            raise AssertionError("the pool refused an allocation the admission cost allowed")
        self._hold(seq, num_blocks)

    def _hold(self, seq: Sequence, num_reserved: int) -> _Held:
        held = _Held(
            num_reserved=num_reserved,
            request_id=seq.request_id,
            num_budget=self.num_held(seq.seq_id),
        )
        self._held[seq.seq_id] = held
        if self._window is not None:
            self._members.setdefault(seq.request_id, []).append(seq.seq_id)
        return held

    # -- growth --------------------------------------------------------------------------------

    def num_missing(self, seq_id: str, num_positions: int) -> int:
        """Blocks the sequence lacks to cover `num_positions`."""
        return max(self.blocks_for(num_positions) - len(self.table(seq_id)), 0)

    def grow(self, seq_id: str, num_positions: int) -> bool:
        """Make the sequence's table cover `num_positions` from the free pool; False (and
        nothing taken) when not enough blocks are available."""
        missing = self.num_missing(seq_id, num_positions)
        if missing == 0:
            return True
        if self._window is None:
            return self._pool.allocate(seq_id, missing) is not None
        # A windowed request grows into its spare first, then into what nobody is promised.
        request_id = self._request_of(seq_id)
        own = min(self._spare.get(request_id, 0), missing)
        if missing - own > self.num_free or self._pool.allocate(seq_id, missing) is None:
            return False
        self._take_spare(request_id, own)
        return True

    def slide(self, seq: Sequence) -> int:
        """With a window: give back the blocks wholly behind the window of the sequence's next
        row (position `num_computed`); they become holes of its table and spare of its request
        while it holds fewer than its reservation's. Returns how many blocks went back to the
        pool (a block another sequence holds goes back with the last one). The sequence's full
        blocks are published before (`publish`, at each update), so a freed block stays in the
        prefix cache as cached-free."""
        if self._window is None or seq.seq_id not in self._held:
            return 0
        first = self.first_needed_block(seq.num_computed)
        if first <= self._pool.num_holes(seq.seq_id):
            return 0
        returned = self._pool.give_back(seq.seq_id, first)
        self.num_window_freed += returned
        self._credit(self._request_of(seq.seq_id), returned)
        return returned

    def rollback(self, seq: Sequence, num_positions: int | None = None) -> int:
        """After a verification: free the blocks past the sequence's computed positions (or
        past its first `num_positions`, while a step is planned) that its reservation does not
        hold (grown for guesses that were rejected, or never made); returns how many went back.
        Positions past them in a kept block are simply overwritten later."""
        upto = seq.num_computed if num_positions is None else num_positions
        keep = max(self.num_reserved(seq.seq_id), self.blocks_for(upto))
        returned = self._pool.truncate(seq.seq_id, keep)
        if self._window is not None and seq.seq_id in self._held:
            self._credit(self._request_of(seq.seq_id), returned)
        return returned

    def coverable(self, seq_id: str) -> int:
        """Positions the sequence could cover with its own blocks (its table, holes included:
        they cover positions it has passed), its request's spare and every available block."""
        spare = self._spare.get(self._request_of(seq_id), 0) if self._window is not None else 0
        return (len(self.table(seq_id)) + spare + self.num_free) * self.block_size

    # -- spare (windowed requests) -------------------------------------------------------------

    def _request_of(self, seq_id: str) -> str:
        held = self._held.get(seq_id)
        return seq_id if held is None else held.request_id

    def _deficit(self, request_id: str) -> int:
        """Blocks the request's sequences hold short of their budgets."""
        return sum(
            max(self._held[seq_id].num_budget - self.num_held(seq_id), 0)
            for seq_id in self._members.get(request_id, ())
        )

    def _credit(self, request_id: str, returned: int) -> None:
        """`returned` blocks went back to the pool from the request: they become its spare,
        as far as its sequences hold fewer than their budgets."""
        if returned <= 0:
            return
        spare = self._spare.get(request_id, 0)
        gained = min(returned, max(self._deficit(request_id) - spare, 0))
        if gained:
            self._spare[request_id] = spare + gained
            self._num_spare += gained

    def _take_spare(self, request_id: str, num_blocks: int) -> None:
        if num_blocks <= 0:
            return
        left = self._spare[request_id] - num_blocks
        self._num_spare -= num_blocks
        if left:
            self._spare[request_id] = left
        else:
            del self._spare[request_id]

    def _forget(self, seq_id: str, request_id: str) -> None:
        """The sequence holds nothing now: its request keeps spare only for the others."""
        members = self._members.get(request_id)
        if members is None:
            return
        if seq_id in members:
            members.remove(seq_id)
        if not members:
            del self._members[request_id]
        spare = self._spare.get(request_id, 0)
        self._take_spare(request_id, max(spare - self._deficit(request_id), 0))

    # -- n > 1 ---------------------------------------------------------------------------------

    def fork(self, leader: Sequence, follower: Sequence) -> None:
        """The leader's prompt is computed: the follower takes its full blocks by reference
        (before its own) and a copy of its partly filled last block, so no sequence writes
        into a block another can read."""
        block_size = self.block_size
        num_full = leader.num_prompt_tokens // block_size
        leader_table = self.table(leader.seq_id)
        # The leader's holes (behind its window) are the follower's too.
        holes = min(self._pool.num_holes(leader.seq_id), num_full)
        self._pool.share(follower.seq_id, leader_table[holes:num_full], prepend=True, holes=holes)
        if leader.num_prompt_tokens % block_size:
            own = self.table(follower.seq_id)
            self._pending_copies.append(
                BlockCopy(follower.seq_id, leader_table[num_full], own[num_full])
            )
        held = self._held.setdefault(follower.seq_id, _Held())
        held.num_reserved += num_full
        leader_held = self._held.get(leader.seq_id)
        if leader_held is not None:
            held.hashes = list(leader_held.hashes[:num_full])
        held.num_published = num_full  # the leader publishes the shared blocks

    # -- the prefix cache ----------------------------------------------------------------------

    def publish(self, seq: Sequence) -> None:
        """Publish the sequence's full blocks that are computed and not yet published."""
        held = self._held.get(seq.seq_id)
        if self.cache is None or held is None or not seq.tokens_known:
            return
        block_size = self.block_size
        num_full = seq.num_computed // block_size
        if num_full <= held.num_published:
            return
        if len(held.hashes) < num_full:
            tokens = seq.all_token_ids[: num_full * block_size]
            held.hashes = block_hashes(tokens, block_size, seq.salt, known=held.hashes)
        table = self.table(seq.seq_id)
        # A hole was given back after it was published (or never taken: a cache hit).
        for index in range(max(held.num_published, self._pool.num_holes(seq.seq_id)), num_full):
            self._pool.publish(table[index], held.hashes[index])
        held.num_published = num_full

    def _publish_tail(self, seq: Sequence) -> None:
        """Publish the partly filled last block of a sequence being freed: the positions it
        computed in steps that landed, after its last full block."""
        held = self._held.get(seq.seq_id)
        if self.cache is None or held is None or not seq.tokens_known or seq.awaits_fork:
            return
        block_size = self.block_size
        num_full, num_tail = divmod(seq.num_computed, block_size)
        table = self.table(seq.seq_id)
        if num_tail == 0 or len(table) <= num_full or len(held.hashes) < num_full:
            return
        if num_full < self._pool.num_holes(seq.seq_id):
            return
        parent = held.hashes[num_full - 1] if num_full else root_hash(seq.salt)
        tokens = seq.all_token_ids[num_full * block_size : seq.num_computed]
        self._pool.publish_tail(table[num_full], parent, tokens)

    # -- the one way blocks go back ------------------------------------------------------------

    def free(self, seq: Sequence) -> None:
        """Publish what the sequence computed (full blocks, then its tail) and drop every
        reference it holds, its pending tail copy's source included. Idempotent."""
        self.publish(seq)
        self._publish_tail(seq)
        self._pool.release(seq.seq_id)
        # Freed before the step carrying its tail copy was planned: the copy never runs.
        self._pool.release(copy_source_owner(seq.seq_id))
        held = self._held.pop(seq.seq_id, None)
        if held is not None and self._window is not None:
            self._forget(seq.seq_id, held.request_id)

    # -- block copies --------------------------------------------------------------------------

    def take_copies(self, live: Iterable[str]) -> tuple[BlockCopy, ...]:
        """The copies pending for the next plan, for sequences in `live` (one freed since needs
        none: its target may belong to another now)."""
        alive = set(live)
        copies = tuple(copy for copy in self._pending_copies if copy.request_id in alive)
        self._pending_copies = []
        return copies

    def drop_copy_sources(self, plan: StepPlan) -> None:
        """The step carrying the plan's copies is over: their tail sources may go back."""
        for copy in plan.copies:
            self._pool.release(copy_source_owner(copy.request_id))

    def check_whole(self) -> bool:
        """The pool is consistent, the manager tracks exactly the sequences holding tables,
        and the spare is free and promised to requests short of their budgets."""
        owners = {owner for owner in self._pool.owners() if not owner.endswith(":copy-source")}
        spare_ok = (
            self._num_spare == sum(self._spare.values())
            and self._num_spare <= self._pool.num_free
            and all(0 < spare <= self._deficit(rid) for rid, spare in self._spare.items())
            and all(
                self._held.get(seq_id) is not None and self._held[seq_id].request_id == rid
                for rid, members in self._members.items()
                for seq_id in members
            )
        )
        return self._pool.check_whole() and owners <= set(self._held) and spare_ok
