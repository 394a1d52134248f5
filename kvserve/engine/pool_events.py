"""The KV pool in the engine event stream: every block table in a snapshot, only what changed in
an update, block ids as runs.

A pool of 10^5 blocks held by 64 sequences is 10^5 block ids: sent whole ten times a second that
is 600 kB an update and some 20 ms of the engine loop's time to build and serialize it
(docs/benchmarks.md, `python -m kvserve.bench.events_bench`).
Between two updates only a few tables change (a sequence takes a block every `block_size`
tokens; one ends, one is admitted), so an update carries those changes, and every viewer
applies them to what it has: the snapshot it got on connect and the updates since, in order (a
viewer that falls behind is dropped, never skipped over).

The wire format (`pool` in an event, besides its counts):

- `tables`: `{owner: [num_holes, start, runs]}`: the owner's table is cut to its first `start`
  entries (or padded with holes up to `num_holes`), then `runs` appended; its first `num_holes`
  entries are holes (blocks given back behind a sliding window). A snapshot lists every owner
  with `start == num_holes`; an update lists the owners whose table changed since the previous
  event, a new owner with `start == num_holes`.
- `released`: owners that hold no table any more (updates only).
- `runs`: block ids, an entry `b` for block b and `[first, last]` for the consecutive ids from
  first to last (counting up or down; three or more of them).
- `cached_free`: runs of the cached-free blocks (kept by the prefix cache, nobody holds them), in
  id order: all of them in a snapshot, those that became cached-free in an update;
  `cached_free_removed` (updates): those that stopped being cached-free.
- `shared`: `{block_id: count}` for each block more than one owner holds (whole, every event).
- `reserved`: `{owner: entries}` taken at admission (whole, every event); the rest grew.

Everything here runs on the engine loop's thread. An update costs the changed tables' new
entries plus one comparison of each table with the one last sent (memory compares, no Python
loop over blocks); the shared blocks are looked for among those shared before and those the
changes added (none when the tables' entries add up to the blocks in use).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from itertools import chain
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvserve.core.blocks import BlockPool
    from kvserve.core.kv_manager import KVManager

__all__ = ["PoolMirror", "PoolTracker", "block_runs", "expand_runs"]

Runs = list[int | list[int]]


def block_runs(block_ids: Sequence[int]) -> Runs:
    """`block_ids` as runs: consecutive ids counting up or down by one, three or more, as
    `[first, last]`; every other id as itself."""
    runs: Runs = []
    n = len(block_ids)
    i = 0
    while i < n:
        first = block_ids[i]
        j = i + 1
        if j + 1 < n and block_ids[j] - first in (1, -1):
            step = block_ids[j] - first
            while j < n and block_ids[j] - block_ids[j - 1] == step:
                j += 1
            if j - i >= 3:
                runs.append([first, block_ids[j - 1]])
                i = j
                continue
            j = i + 1
        runs.append(first)
        i = j
    return runs


def expand_runs(runs: Iterable[int | Sequence[int]]) -> list[int]:
    """The block ids `runs` stand for (the inverse of `block_runs`)."""
    ids: list[int] = []
    for run in runs:
        if isinstance(run, int):
            ids.append(run)
        else:
            first, last = run
            ids.extend(range(first, last + 1) if last >= first else range(first, last - 1, -1))
    return ids


class PoolTracker:
    """What the viewers have of the pool's tables and cached-free blocks, and the changes that
    bring them to the pool's state now.

    `snapshot` gives everything (for a viewer that connects) and `update` what changed since
    the previous update; a snapshot taken between two updates is accounted for, so the next
    update brings its viewer to the same state as the others (a table it saw otherwise is sent
    whole; cached-free changes are additions and removals, which commute)."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Forget what was sent (nobody watches: the next snapshot starts afresh)."""
        self._fresh = True
        self._tables: dict[str, tuple[int, ...]] = {}  # as of the last update
        self._holes: dict[str, int] = {}
        self._shared: dict[int, int] = {}  # blocks with more than one
        self._touched: set[str] = set()  # owners a snapshot since showed otherwise
        self._cached_ids: tuple[int, ...] = ()
        self._cached: set[int] = set()
        self._cached_seen: set[int] | None = None  # cached-free in the last update or a snapshot
        self._cached_kept: set[int] | None = None  # cached-free in the last update and each one

    # -- reading the pool ----------------------------------------------------------------------

    @staticmethod
    def _reserved(pool: BlockPool, kv: KVManager, owners: Iterable[str]) -> dict[str, int]:
        return {
            owner: kv.num_reserved(owner) if kv.holds(owner) else len(pool.table(owner))
            for owner in owners
        }

    @staticmethod
    def _cached_free_ids(pool: BlockPool) -> tuple[int, ...]:
        cache = pool.cache
        return cache.cached_free_ids() if cache is not None else ()

    @staticmethod
    def _record(table: tuple[int, ...], holes: int, start: int) -> list[Any]:
        return [holes, start, block_runs(table[max(start, holes) :])]

    # -- events --------------------------------------------------------------------------------

    def snapshot(self, pool: BlockPool, kv: KVManager) -> dict[str, Any]:
        """Every table, the shared and cached-free blocks, for a viewer that connects now."""
        tables: dict[str, tuple[int, ...]] = {}
        holes: dict[str, int] = {}
        for owner in pool.owners():
            tables[owner] = pool.table(owner)
            holes[owner] = pool.num_holes(owner)
        cached_ids = self._cached_free_ids(pool)
        shared = self._count_shared(pool, tables, holes, None)
        if self._fresh:
            # The first viewer: what it gets is what the next update starts from.
            self._fresh = False
            self._tables, self._holes, self._shared = tables, holes, shared
            self._cached_ids, self._cached = cached_ids, set(cached_ids)
        else:
            for owner, table in tables.items():
                if self._tables.get(owner) != table or self._holes.get(owner) != holes[owner]:
                    self._touched.add(owner)
            # Owners the last update had and this viewer does not: listed as released next.
            self._touched.update(owner for owner in self._tables if owner not in tables)
            if cached_ids != self._cached_ids:
                now = set(cached_ids)
                seen = self._cached if self._cached_seen is None else self._cached_seen
                kept = self._cached if self._cached_kept is None else self._cached_kept
                self._cached_seen, self._cached_kept = seen | now, kept & now
        return {
            "tables": {
                owner: self._record(table, holes[owner], holes[owner])
                for owner, table in tables.items()
            },
            "reserved": self._reserved(pool, kv, tables),
            "shared": {str(block): count for block, count in sorted(shared.items())},
            "cached_free": block_runs(sorted(cached_ids)),
        }

    @staticmethod
    def _count_shared(
        pool: BlockPool,
        tables: dict[str, tuple[int, ...]],
        holes: dict[str, int],
        candidates: Iterable[int] | None,
    ) -> dict[int, int]:
        """{block: owners} for the blocks more than one owner holds, looking only at
        `candidates` (every block that may be shared) when given."""
        # References beyond one per used block: none, and nothing is shared (the usual case,
        # found without looking at a block).
        excess = sum(len(table) - holes[owner] for owner, table in tables.items()) - pool.num_used
        if excess == 0:
            return {}
        if candidates is not None:
            shared = {block: count for block in candidates if (count := pool.refcount(block)) > 1}
            if sum(shared.values()) - len(shared) == excess:
                return shared
        refs = Counter(chain.from_iterable(t[holes[o] :] for o, t in tables.items()))
        return {block: count for block, count in refs.items() if count > 1}

    def update(self, pool: BlockPool, kv: KVManager) -> dict[str, Any]:
        """The changes since the previous update (or the first viewer's snapshot)."""
        changed: dict[str, list[Any]] = {}
        # A block becomes shared only by entering a table, so the shared ones now are among
        # those shared before and those that entered a table since.
        candidates: set[int] = set(self._shared)
        new_tables: dict[str, tuple[int, ...]] = {}
        new_holes: dict[str, int] = {}
        for owner in pool.owners():
            table = pool.table(owner)
            holes = pool.num_holes(owner)
            new_tables[owner] = table
            new_holes[owner] = holes
            old = self._tables.get(owner)
            old_holes = self._holes.get(owner, 0)
            if old is None or owner in self._touched:
                start = holes
            elif holes == old_holes and table == old:
                continue
            elif holes < old_holes:
                start = holes  # entries that were holes are held again: all of it anew
            else:
                start = self._first_difference(old, table, holes)
            candidates.update(table[max(start, holes) :])
            changed[owner] = self._record(table, holes, start)
        released = [owner for owner in self._tables if owner not in new_tables]
        released.extend(
            owner
            for owner in self._touched
            if owner not in new_tables and owner not in self._tables
        )
        self._shared = self._count_shared(pool, new_tables, new_holes, candidates)
        self._tables, self._holes = new_tables, new_holes
        self._touched = set()
        cached_free, cached_removed = self._cached_changes(pool)
        return {
            "tables": changed,
            "released": released,
            "reserved": self._reserved(pool, kv, new_tables),
            "shared": {str(block): count for block, count in sorted(self._shared.items())},
            "cached_free": cached_free,
            "cached_free_removed": cached_removed,
        }

    @staticmethod
    def _first_difference(old: tuple[int, ...], new: tuple[int, ...], start: int) -> int:
        """The first index from `start` at which `old` and `new` differ (the shorter one's
        length when one continues the other)."""
        end = min(len(old), len(new))
        if old[start:end] == new[start:end]:
            return end
        # A table whose middle changed (rare: a rollback, then new blocks): find where.
        low, high = start, end  # old[start:low] == new[start:low]; they differ before high
        while high - low > 1:
            middle = (low + high) // 2
            if old[low:middle] == new[low:middle]:
                low = middle
            else:
                high = middle
        return low

    def _cached_changes(self, pool: BlockPool) -> tuple[Runs, Runs]:
        cached_ids = self._cached_free_ids(pool)
        if cached_ids == self._cached_ids and self._cached_seen is None:
            return [], []
        now = set(cached_ids)
        seen = self._cached if self._cached_seen is None else self._cached_seen
        kept = self._cached if self._cached_kept is None else self._cached_kept
        added = sorted(now - kept)
        removed = sorted(seen - now)
        self._cached_ids, self._cached = cached_ids, now
        self._cached_seen = self._cached_kept = None
        return block_runs(added), block_runs(removed)


class PoolMirror:
    """A viewer's picture of the pool, built from the events' `pool` fields (`apply` each event
    in order, starting with a snapshot): the reference reading of the format above."""

    def __init__(self) -> None:
        self.num_blocks = 0
        self.block_size = 0
        self.tables: dict[str, list[int | None]] = {}
        self.reserved: dict[str, int] = {}
        self.shared: dict[int, int] = {}
        self.cached_free: set[int] = set()

    def apply(self, event: dict[str, Any]) -> None:
        pool = event["pool"]
        if event["type"] == "snapshot":
            self.tables = {}
            self.cached_free = set()
        self.num_blocks = pool["num_blocks"]
        self.block_size = pool["block_size"]
        for owner in pool.get("released", ()):
            self.tables.pop(owner, None)
        for owner, (holes, start, runs) in pool["tables"].items():
            table = self.tables.setdefault(owner, [])
            del table[start:]
            table.extend([None] * (holes - len(table)))
            table.extend(expand_runs(runs))
            table[:holes] = [None] * holes
        self.reserved = dict(pool["reserved"])
        self.shared = {int(block): count for block, count in pool["shared"].items()}
        self.cached_free.difference_update(expand_runs(pool.get("cached_free_removed", ())))
        self.cached_free.update(expand_runs(pool["cached_free"]))

    def held(self, owner: str) -> list[int]:
        """The blocks the owner holds (its table without the holes)."""
        return [block for block in self.tables.get(owner, ()) if block is not None]

    def owners_of(self) -> dict[int, list[str]]:
        """Each held block's owners."""
        owners: dict[int, list[str]] = {}
        for owner in self.tables:
            for block in self.held(owner):
                owners.setdefault(block, []).append(owner)
        return owners
