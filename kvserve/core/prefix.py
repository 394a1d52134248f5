"""Automatic prefix caching: chained, salted block hashes and the cache of published blocks.

A full KV block is named by a hash chained from its parent: SHA-256 over the parent's hash and
the block's token ids, the root seeded by the request's salt. Two sequences whose first k blocks
hold the same tokens (and carry the same salt) therefore name those blocks alike, and the second
can take the first's KV instead of computing it. The hash is cryptographic on purpose: a
collision would hand one request another's KV.

`PrefixCache` maps published hashes to block ids and keeps the blocks nobody references any
more (cached-free) in least-recently-freed order. The BlockPool consults it: a released block
that is published goes to the cache's LRU instead of the free list, and is evicted (its hash
forgotten) only when a fresh block is needed and the free list is empty.

A finished sequence's last block is usually partly filled: the end of its answer (a chat's next
turn resends it), whose full blocks are published as any other. That tail is published too,
under its parent's hash and its tokens, never as a full block: a later prompt that continues
the same chain can copy the block and take as many of its positions as it shares, instead of
recomputing them. Only a released sequence publishes its tail, so no one writes into it any
more; its positions are those the sequence computed in steps that landed.

Integers and bytes only: no torch, no clock.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Sequence

BlockHash = bytes


def root_hash(salt: str | None) -> BlockHash:
    """The parent of a sequence's first block: different salts never share a chain."""
    seed = b"kvserve-prefix\x00" + (b"" if salt is None else b"salt\x00" + salt.encode())
    return hashlib.sha256(seed).digest()


def chain_hash(parent: BlockHash, token_ids: Sequence[int]) -> BlockHash:
    """One block's hash: SHA-256 over its parent's hash and its token ids (little-endian u32)."""
    return hashlib.sha256(parent + struct.pack(f"<{len(token_ids)}I", *token_ids)).digest()


def block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    salt: str | None = None,
    *,
    known: Sequence[BlockHash] = (),
) -> list[BlockHash]:
    """The hashes of every full block of `token_ids`; `known` is a prefix already computed."""
    hashes = list(known)
    parent = hashes[-1] if hashes else root_hash(salt)
    for index in range(len(hashes), len(token_ids) // block_size):
        parent = chain_hash(parent, token_ids[index * block_size : (index + 1) * block_size])
        hashes.append(parent)
    return hashes


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading token ids `a` and `b` share."""
    count = 0
    for x, y in zip(a, b, strict=False):  # the shorter one bounds the prefix
        if x != y:
            break
        count += 1
    return count


TailKey = tuple[BlockHash, int]  # (parent hash, first token id)


class PrefixCache:
    """Published block hashes and the cached-free LRU. Driven by the BlockPool."""

    def __init__(self) -> None:
        self._block_of: dict[BlockHash, int] = {}
        self._hash_of: dict[int, BlockHash] = {}
        # Published tails (partly filled last blocks of released sequences): block id -> its
        # key and tokens, and by key the blocks to compare a prompt against.
        self._tail_of: dict[int, tuple[TailKey, tuple[int, ...]]] = {}
        self._tails: dict[TailKey, dict[int, tuple[int, ...]]] = {}
        # Published blocks with no reference, least recently freed first: evicted in this order.
        self._lru: OrderedDict[int, None] = OrderedDict()

    @property
    def num_cached(self) -> int:
        """Published blocks (full blocks and tails), in use or not."""
        return len(self._hash_of) + len(self._tail_of)

    @property
    def num_cached_free(self) -> int:
        """Published blocks nobody references: reusable by a hit, evictable for a fresh block."""
        return len(self._lru)

    def lookup(self, hashes: Sequence[BlockHash]) -> list[int]:
        """Block ids of the longest published prefix of `hashes` (whole blocks)."""
        found: list[int] = []
        for block_hash in hashes:
            block_id = self._block_of.get(block_hash)
            if block_id is None:
                break
            found.append(block_id)
        return found

    def lookup_tail(self, parent: BlockHash, token_ids: Sequence[int]) -> tuple[int, int] | None:
        """The published tail under `parent` sharing the most leading tokens with `token_ids`:
        (block id, how many positions of it to take), or None when none shares any."""
        if not token_ids:
            return None
        best: tuple[int, int] | None = None
        for block_id, tokens in self._tails.get((parent, token_ids[0]), {}).items():
            count = common_prefix(tokens, token_ids)
            if best is None or count > best[1]:
                best = (block_id, count)
        return best

    def hash_of(self, block_id: int) -> BlockHash | None:
        """The hash `block_id` is published under as a full block, or None."""
        return self._hash_of.get(block_id)

    def num_positions(self, block_id: int, block_size: int) -> int:
        """Positions of a published block that hold KV: a tail's tokens, else the whole block."""
        tail = self._tail_of.get(block_id)
        return block_size if tail is None else len(tail[1])

    def is_published(self, block_id: int) -> bool:
        """Published as a full block or as a tail."""
        return block_id in self._hash_of or block_id in self._tail_of

    def is_cached_free(self, block_id: int) -> bool:
        return block_id in self._lru

    def publish(self, block_id: int, block_hash: BlockHash) -> bool:
        """Publish a full, computed block. False (nothing changes) when the hash is already
        published by another block or the block is already published."""
        if block_hash in self._block_of or self.is_published(block_id):
            return False
        self._block_of[block_hash] = block_id
        self._hash_of[block_id] = block_hash
        return True

    def publish_tail(self, block_id: int, parent: BlockHash, token_ids: Sequence[int]) -> bool:
        """Publish a released sequence's partly filled last block: its first `len(token_ids)`
        positions hold the KV of `token_ids` following the chain `parent`. False (nothing
        changes) when empty, already published, or a published tail already covers them."""
        if not token_ids or self.is_published(block_id):
            return False
        key = (parent, token_ids[0])
        tokens = tuple(token_ids)
        tails = self._tails.setdefault(key, {})
        if any(other[: len(tokens)] == tokens for other in tails.values()):
            return False
        tails[block_id] = tokens
        self._tail_of[block_id] = (key, tokens)
        return True

    def on_free(self, block_id: int) -> bool:
        """The block's last reference went away. True: it is published and stays cached-free."""
        if not self.is_published(block_id):
            return False
        self._lru[block_id] = None
        return True

    def on_reuse(self, block_id: int) -> None:
        """A cached-free block got a reference again (a hit): it is no longer evictable."""
        self._lru.pop(block_id, None)

    def evict(self) -> int | None:
        """Forget the least recently freed cached-free block; returns its id (None if none)."""
        if not self._lru:
            return None
        block_id, _ = self._lru.popitem(last=False)
        tail = self._tail_of.pop(block_id, None)
        if tail is None:
            del self._block_of[self._hash_of.pop(block_id)]
            return block_id
        tails = self._tails[tail[0]]
        del tails[block_id]
        if not tails:
            del self._tails[tail[0]]
        return block_id

    def cached_free_ids(self) -> tuple[int, ...]:
        """Cached-free blocks, next to be evicted first."""
        return tuple(self._lru)

    def check_whole(self) -> bool:
        """The maps agree with each other and every cached-free block is published."""
        return (
            len(self._block_of) == len(self._hash_of)
            and all(self._block_of.get(h) == b for b, h in self._hash_of.items())
            and not set(self._hash_of) & set(self._tail_of)
            and sum(len(tails) for tails in self._tails.values()) == len(self._tail_of)
            and all(self._tails[key].get(b) == t for b, (key, t) in self._tail_of.items())
            and all(self.is_published(b) for b in self._lru)
        )
