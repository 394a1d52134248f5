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

    num_reserved: int = 0  # blocks taken at admission; later ones grew
    hashes: list[BlockHash] = field(default_factory=list)  # its full blocks' hashes so far
    num_published: int = 0  # leading blocks already published (or taken from the cache)


class KVManager:
    """Blocks for sequences over one BlockPool. Every method runs on the scheduler's thread."""

    def __init__(self, pool: BlockPool) -> None:
        self._pool = pool
        self._held: dict[str, _Held] = {}
        self._pending_copies: list[BlockCopy] = []

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
    def num_free(self) -> int:
        """Blocks available to an allocation: free and cached-free."""
        return self._pool.num_free

    def blocks_for(self, num_positions: int) -> int:
        return self._pool.blocks_for(num_positions)

    def table(self, seq_id: str) -> tuple[int, ...]:
        """The sequence's block table (empty when it holds none)."""
        return self._pool.table(seq_id)

    def num_reserved(self, seq_id: str) -> int:
        """Blocks the sequence took at admission (its table's first ones); the rest grew."""
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
            for block_id in computed.block_ids:
                if cache.is_cached_free(block_id):
                    revived.add(block_id)
            if computed.tail_block is not None and cache.is_cached_free(computed.tail_block):
                revived.add(computed.tail_block)
        return fresh + len(revived)

    @staticmethod
    def fresh_blocks(computed: ComputedBlocks, num_blocks: int) -> int:
        """Blocks `admit` allocates for a table of `num_blocks` given these hits (at least the
        target of a tail copy)."""
        own = max(num_blocks - len(computed.block_ids), 0)
        return max(own, 1) if computed.tail_block is not None else own

    def admit(self, seq: Sequence, computed: ComputedBlocks, num_blocks: int) -> int:
        """Give the sequence its hits and fresh blocks up to `num_blocks` in all (at least
        its hits, and the tail's target when it copies one); returns the positions taken from
        the cache. The caller has checked `admission_cost` against `num_free`."""
        if self.holds(seq.seq_id) or self.table(seq.seq_id):
            raise ValueError(f"{seq.seq_id!r} already holds blocks")
        # Take the hits first: an allocation below may evict cached-free blocks, never these.
        self._pool.share(seq.seq_id, computed.block_ids)
        if computed.tail_block is not None:
            self._pool.share(copy_source_owner(seq.seq_id), [computed.tail_block])
        own = self.fresh_blocks(computed, num_blocks)
        if self._pool.allocate(seq.seq_id, own) is None:
            raise AssertionError("the pool refused an allocation the admission cost allowed")
        if computed.tail_block is not None:
            target = self.table(seq.seq_id)[len(computed.block_ids)]
            self._pending_copies.append(BlockCopy(seq.seq_id, computed.tail_block, target))
        held = _Held(num_reserved=len(self.table(seq.seq_id)))
        if self.cache is not None and seq.tokens_known:
            held.hashes = block_hashes(seq.all_token_ids, self.block_size, seq.salt)
            held.num_published = len(computed.block_ids)
        self._held[seq.seq_id] = held
        return computed.num_tokens(self.block_size)

    def admit_follower(self, seq: Sequence, num_blocks: int) -> None:
        """An n > 1 follower's own blocks, allocated at admission; its prompt's full blocks
        come from the leader at the fork."""
        if self._pool.allocate(seq.seq_id, num_blocks) is None:
            raise AssertionError("the pool refused an allocation the admission cost allowed")
        self._held[seq.seq_id] = _Held(num_reserved=num_blocks)

    # -- growth --------------------------------------------------------------------------------

    def num_missing(self, seq_id: str, num_positions: int) -> int:
        """Blocks the sequence lacks to cover `num_positions`."""
        return max(self.blocks_for(num_positions) - len(self.table(seq_id)), 0)

    def grow(self, seq_id: str, num_positions: int) -> bool:
        """Make the sequence's table cover `num_positions` from the free pool; False (and
        nothing taken) when not enough blocks are available."""
        missing = self.num_missing(seq_id, num_positions)
        return missing == 0 or self._pool.allocate(seq_id, missing) is not None

    def rollback(self, seq: Sequence) -> int:
        """After a verification: free the blocks past the sequence's computed positions that
        its reservation does not hold (grown for guesses that were rejected); returns how many
        went back. Positions past `num_computed` in a kept block are simply overwritten later."""
        keep = max(self.num_reserved(seq.seq_id), self.blocks_for(seq.num_computed))
        return self._pool.truncate(seq.seq_id, keep)

    def coverable(self, seq_id: str) -> int:
        """Positions the sequence could cover with its own blocks plus every available one."""
        return (len(self.table(seq_id)) + self.num_free) * self.block_size

    # -- n > 1 ---------------------------------------------------------------------------------

    def fork(self, leader: Sequence, follower: Sequence) -> None:
        """The leader's prompt is computed: the follower takes its full blocks by reference
        (before its own) and a copy of its partly filled last block, so no sequence writes
        into a block another can read."""
        block_size = self.block_size
        num_full = leader.num_prompt_tokens // block_size
        leader_table = self.table(leader.seq_id)
        self._pool.share(follower.seq_id, leader_table[:num_full], prepend=True)
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
        for index in range(held.num_published, num_full):
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
        self._held.pop(seq.seq_id, None)

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
        """The pool is consistent and the manager tracks exactly the sequences holding tables."""
        owners = {owner for owner in self._pool.owners() if not owner.endswith(":copy-source")}
        return self._pool.check_whole() and owners <= set(self._held)
