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
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Sequence

from kvserve.core.prefix import BlockHash, PrefixCache


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

    def share(self, owner: str, block_ids: Sequence[int], *, prepend: bool = False) -> None:
        """Add blocks already in use, or cached-free, to `owner`'s table, one reference each.

        They are appended, or with `prepend` put before the blocks the owner already holds (a
        sequence that takes a prompt's blocks after its own answer blocks were reserved).
        Raises ValueError (and changes nothing) for an id out of range, a free block that is
        not cached, a block the owner already holds, or a repeated id.
        """
        table = self._tables.get(owner, [])
        held = set(table)
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
        added = list(block_ids)
        self._tables[owner] = added + table if prepend else table + added

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
        """The owner's block table in allocation order; empty for an unknown owner."""
        return tuple(self._tables.get(owner, ()))

    def release(self, owner: str) -> int:
        """Drop every reference `owner` holds; returns how many blocks nobody references now.

        Idempotent: an unknown (or already released) owner returns 0.
        """
        table = self._tables.pop(owner, None)
        if table is None:
            return 0
        return self._drop(table)

    def truncate(self, owner: str, num_blocks: int) -> int:
        """Drop `owner`'s references to the blocks after its first `num_blocks` (a rollback of
        positions computed past what it keeps); returns how many nobody references now."""
        table = self._tables.get(owner)
        if table is None or len(table) <= num_blocks:
            return 0
        dropped = table[num_blocks:]
        del table[num_blocks:]
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
        references = Counter(block_id for table in self._tables.values() for block_id in table)
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
