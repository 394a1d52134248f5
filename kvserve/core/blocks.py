"""The paged KV cache's bookkeeping: fixed-size blocks in one shared pool.

Block ids are `0 .. num_blocks - 1`; the engine maps them onto its KV tensors. A block may be
referenced by several owners (prefix sharing); it returns to the free list when its last
reference is released.

Freed blocks are reused FIFO: the block freed longest ago is handed out first. A cached prefix
that has just been released therefore survives as long as possible before being overwritten,
which is what a prefix cache layered on this pool wants (least recently freed is evicted first).

With a `PrefixCache` (kvserve/core/prefix.py), a released block that was published keeps its
KV: it becomes cached-free (count 0, in the cache's LRU) instead of free, a later request with
the same prefix takes it back with `reuse`, and it is evicted only when `allocate` finds the
free list empty. Cached-free blocks count as available: `num_free` includes them.

A table keeps its positional meaning: entry i holds positions `i * block_size ..`. A sequence of
a model whose every layer attends to a sliding window gives back the blocks that fell wholly
behind its window (`give_back`): their entries stay in the table as holes, shown as
`PLACEHOLDER_BLOCK`, and take no reference. Holes always lead a table (a window only ever moves
forward), so an owner's table is `num_holes` placeholders, then the blocks it holds (`held`).
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Sequence

from kvserve.core.prefix import BlockHash, PrefixCache

PLACEHOLDER_BLOCK = 0
"""The id a table shows at a hole (a block its owner gave back). The block is not the owner's:
another sequence may hold it and write into it, so no attention backend reads it for the owner.
A hole lies wholly before the first position any of the owner's rows attends to, and both
backends start there: the CPU kernels at the block of a row's window start
(kvserve/model/csrc/paged_attention.c), the torch path's gathers at the block of
`ModelConfig.first_attended_position` (kvserve/model/attention/sdpa.py). It is a valid id so
that every index a step hands the attention stays in the pool (the CPU backend checks each)."""


class BlockPool:
    """A fixed pool of KV blocks with a free list, reference counts and per-owner block tables."""

    def __init__(self, num_blocks: int, block_size: int, *, prefix_caching: bool = False) -> None:
        if num_blocks <= 0:
            raise ValueError("num_blocks must be positive")
        if block_size <= 0:
            raise ValueError("block_size must be positive")
        self._num_blocks = num_blocks
        self._block_size = block_size
        self._refcounts = [0] * num_blocks
        # An OrderedDict as the free list: FIFO pop and O(1) membership.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._tables: dict[str, list[int]] = {}
        self._holes: dict[str, int] = {}  # leading entries of a table that are holes
        self._cache: PrefixCache | None = PrefixCache() if prefix_caching else None

    @property
    def cache(self) -> PrefixCache | None:
        """The prefix cache, or None when prefix caching is off."""
        return self._cache

    @property
    def num_blocks(self) -> int:
        """Blocks in the pool, free or not."""
        return self._num_blocks

    @property
    def block_size(self) -> int:
        """Token positions per block."""
        return self._block_size

    @property
    def num_free(self) -> int:
        """Blocks nobody references: the free list plus the cached-free blocks."""
        return len(self._free) + self.num_cached_free

    @property
    def num_cached_free(self) -> int:
        """Published blocks nobody references (kept for reuse, evicted when space is needed)."""
        return 0 if self._cache is None else self._cache.num_cached_free

    @property
    def num_used(self) -> int:
        """Blocks referenced by at least one owner."""
        return self._num_blocks - self.num_free

    @property
    def usage(self) -> float:
        """Fraction of the pool in use, 0.0 .. 1.0."""
        return self.num_used / self._num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold `num_tokens` positions."""
        if num_tokens < 0:
            raise ValueError("num_tokens must be >= 0")
        return -(-num_tokens // self._block_size)

    def allocate(self, owner: str, num_blocks: int) -> tuple[int, ...] | None:
        """Take `num_blocks` free blocks and append them to `owner`'s table.

        All or nothing: returns the new block ids, or None (and changes nothing) when fewer
        than `num_blocks` are free. An owner may allocate several times; its table grows.
        """
        if num_blocks < 0:
            raise ValueError("num_blocks must be >= 0")
        if num_blocks > self.num_free:
            return None
        # Never-cached blocks first; a cached prefix is evicted only when nothing else is left.
        block_ids = tuple(
            self._free.popitem(last=False)[0] if self._free else self._cache.evict()
            for _ in range(num_blocks)
        )
        for block_id in block_ids:
            self._refcounts[block_id] = 1
        self._tables.setdefault(owner, []).extend(block_ids)
        return block_ids

    def share(
        self,
        owner: str,
        block_ids: Sequence[int],
        *,
        prepend: bool = False,
        holes: int = 0,
    ) -> None:
        """Add blocks already in use, or cached-free, to `owner`'s table, one reference each.

        They are appended, or with `prepend` put before the blocks the owner already holds (a
        sequence that takes a prompt's blocks after its own answer blocks were reserved).
        `holes` puts that many holes before them (positions whose blocks were given back, or
        need not be taken: they lie behind a sliding window); holes always lead a table, so
        they need an empty table or `prepend` before a table without holes.
        Raises ValueError (and changes nothing) for an id out of range, a free block that is
        not cached, a block the owner already holds, a repeated id, or misplaced holes.
        """
        table = self._tables.get(owner, [])
        held = set(table[self._holes.get(owner, 0) :])
        if holes < 0:
            raise ValueError("holes must be >= 0")
        if self._holes.get(owner, 0) and (prepend or holes):
            raise ValueError(f"{owner!r} has holes: nothing goes before them")
        if holes and table and not prepend:
            raise ValueError("holes lead a table: they cannot be appended after blocks")
        for block_id in block_ids:
            if not 0 <= block_id < self._num_blocks:
                raise ValueError(f"block {block_id} is not in the pool")
            if self._refcounts[block_id] == 0 and not (
                self._cache is not None and self._cache.is_cached_free(block_id)
            ):
                raise ValueError(f"block {block_id} is free; only blocks in use can be shared")
            if block_id in held:
                raise ValueError(f"{owner!r} already holds block {block_id}")
            held.add(block_id)
        for block_id in block_ids:
            if self._refcounts[block_id] == 0:
                self._cache.on_reuse(block_id)
            self._refcounts[block_id] += 1
        added = [PLACEHOLDER_BLOCK] * holes + list(block_ids)
        self._tables[owner] = added + table if prepend else table + added
        if holes:
            self._holes[owner] = holes

    def lookup(self, hashes: Sequence[BlockHash]) -> list[int]:
        """Blocks of the longest published prefix of `hashes`; empty without a cache."""
        return [] if self._cache is None else self._cache.lookup(hashes)

    def publish(self, block_id: int, block_hash: BlockHash) -> bool:
        """Publish a held block whose KV is complete; False when not cached (see PrefixCache)."""
        if self._cache is None or self._refcounts[block_id] == 0:
            return False
        return self._cache.publish(block_id, block_hash)

    def publish_tail(self, block_id: int, parent: BlockHash, token_ids: Sequence[int]) -> bool:
        """Publish a partly filled block its only owner is about to release (see
        PrefixCache.publish_tail); False when not cached or another owner still holds it."""
        if self._cache is None or self._refcounts[block_id] != 1:
            return False
        return self._cache.publish_tail(block_id, parent, token_ids)

    def lookup_tail(self, parent: BlockHash, token_ids: Sequence[int]) -> tuple[int, int] | None:
        """(block, shared positions) of the best published tail under `parent`; None without a
        cache or a match."""
        return None if self._cache is None else self._cache.lookup_tail(parent, token_ids)

    def table(self, owner: str) -> tuple[int, ...]:
        """The owner's block table, by position (`PLACEHOLDER_BLOCK` at its holes); empty for
        an unknown owner."""
        return tuple(self._tables.get(owner, ()))

    def held(self, owner: str) -> tuple[int, ...]:
        """The blocks the owner references: its table after the holes."""
        return tuple(self._tables.get(owner, ())[self._holes.get(owner, 0) :])

    def num_held(self, owner: str) -> int:
        """How many blocks the owner references (its table less the holes)."""
        return len(self._tables.get(owner, ())) - self._holes.get(owner, 0)

    def num_holes(self, owner: str) -> int:
        """Leading entries of the owner's table whose blocks it gave back."""
        return self._holes.get(owner, 0)

    def release(self, owner: str) -> int:
        """Drop every reference `owner` holds; returns how many blocks nobody references now.

        Idempotent: an unknown (or already released) owner returns 0.
        """
        table = self._tables.pop(owner, None)
        holes = self._holes.pop(owner, 0)
        if table is None:
            return 0
        return self._drop(table[holes:])

    def truncate(self, owner: str, num_blocks: int) -> int:
        """Drop `owner`'s references to the blocks after its first `num_blocks` (a rollback of
        positions computed past what it keeps); returns how many nobody references now."""
        table = self._tables.get(owner)
        if table is None or len(table) <= num_blocks:
            return 0
        holes = self._holes.get(owner, 0)
        dropped = table[max(num_blocks, holes) :]
        del table[num_blocks:]
        if holes > num_blocks:
            self._holes[owner] = num_blocks
        return self._drop(dropped)

    def give_back(self, owner: str, num_blocks: int) -> int:
        """Drop `owner`'s references to the blocks of its first `num_blocks` table entries,
        leaving holes in their place (positions it will never read again: they fell behind its
        sliding window); returns how many blocks nobody references now. Entries that are
        holes already stay so."""
        table = self._tables.get(owner)
        holes = self._holes.get(owner, 0)
        end = min(num_blocks, 0 if table is None else len(table))
        if end <= holes:
            return 0
        dropped = table[holes:end]
        table[holes:end] = [PLACEHOLDER_BLOCK] * (end - holes)
        self._holes[owner] = end
        return self._drop(dropped)

    def _drop(self, blocks: list[int]) -> int:
        """One reference less on each of `blocks`; those nobody references now go to the
        prefix cache or the free list. Returns how many that is."""
        num_freed = 0
        # The tail goes back first: with FIFO reuse it is overwritten before the head, and a
        # sequence's head blocks are the ones a prefix cache can share.
        for block_id in reversed(blocks):
            self._refcounts[block_id] -= 1
            if self._refcounts[block_id] == 0:
                if self._cache is None or not self._cache.on_free(block_id):
                    self._free[block_id] = None
                num_freed += 1
        return num_freed

    def refcount(self, block_id: int) -> int:
        """How many owners reference `block_id` (0 = free)."""
        if not 0 <= block_id < self._num_blocks:
            raise ValueError(f"block {block_id} is not in the pool")
        return self._refcounts[block_id]

    def owners(self) -> tuple[str, ...]:
        """Owners holding a table, in first-allocation order."""
        return tuple(self._tables)

    def check_whole(self) -> bool:
        """True when free + cached-free + used == total and every refcount equals the tables'
        references."""
        references = Counter(
            block_id
            for owner, table in self._tables.items()
            for block_id in table[self._holes.get(owner, 0) :]
        )
        if any(holes > len(self._tables.get(owner, ())) for owner, holes in self._holes.items()):
            return False
        if any(not 0 <= block_id < self._num_blocks for block_id in references):
            return False
        for block_id in range(self._num_blocks):
            count = self._refcounts[block_id]
            if count != references.get(block_id, 0):
                return False
            cached_free = self._cache is not None and self._cache.is_cached_free(block_id)
            if block_id in self._free and cached_free:
                return False
            if (count == 0) != (block_id in self._free or cached_free):
                return False
        if self._cache is not None and not self._cache.check_whole():
            return False
        return self.num_free + sum(1 for count in self._refcounts if count > 0) == (
            self._num_blocks
        )

    def __repr__(self) -> str:
        return (
            f"BlockPool(num_blocks={self._num_blocks}, block_size={self._block_size}, "
            f"num_free={self.num_free}, owners={len(self._tables)})"
        )
