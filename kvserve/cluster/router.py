"""Which replica gets a request: prefix affinity first, load when it matters more.

The ingress names a prompt's first blocks by the same chained, salted hashes the engine's prefix
cache uses (`kvserve.core.prefix.block_hashes`), and remembers for each hash the replica it last
sent it to, in a bounded LRU map. A request goes to the replica holding its longest remembered
prefix (when that covers at least `min_match` of its hashed blocks), unless that replica carries `load_threshold` more requests (running + waiting) than the
least loaded one, or no prefix is remembered: then to the least loaded replica (ties taken in
turn, so distinct prompts spread). Ray Serve LLM's PrefixCacheAffinityRouter
decides the same way.

The ingress keeps one router per model, over that model's replicas only: block hashes of
different models never share a map.

Pure bookkeeping over strings and bytes: no HTTP, no Ray, no clock.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = ["Decision", "PrefixRouter", "ReplicaLoad"]

BlockHash = bytes


@dataclass
class ReplicaLoad:
    """What the router knows about one replica's load."""

    replica_id: str
    running: int = 0
    waiting: int = 0
    # Requests the ingress sent there that have not ended: exact, where the replica's own
    # report is up to an announcement old (and late when the machine is busy).
    in_flight: int = 0

    @property
    def load(self) -> int:
        return max(self.running + self.waiting, self.in_flight)


@dataclass(frozen=True)
class Decision:
    """The replicas to try, in order, and why the first was chosen."""

    order: tuple[str, ...]
    reason: str  # "prefix" | "load" | "balance"
    matched_blocks: int = 0


@dataclass
class PrefixRouter:
    """The bounded block-hash -> replica map and the choice it drives."""

    capacity: int = 65536
    load_threshold: int = 4
    # A holder must hold at least this share of the prompt's hashed blocks: one shared block (a
    # model's default system prompt) is not worth sending every conversation to one replica.
    min_match: float = 0.5
    _owner: OrderedDict[BlockHash, str] = field(default_factory=OrderedDict)
    _replicas: dict[str, ReplicaLoad] = field(default_factory=dict)
    _turn: int = 0

    # -- replicas ----------------------------------------------------------------------------

    def report(self, replica_id: str, running: int, waiting: int) -> None:
        """A replica's own numbers (running + waiting), fresh."""
        replica = self._replicas.setdefault(replica_id, ReplicaLoad(replica_id))
        replica.running, replica.waiting = running, waiting

    def forget(self, replica_id: str) -> None:
        """A replica is gone: route nothing more to it, and drop what it held."""
        self._replicas.pop(replica_id, None)
        for block_hash in [h for h, owner in self._owner.items() if owner == replica_id]:
            del self._owner[block_hash]

    def loads(self) -> dict[str, int]:
        return {replica_id: r.load for replica_id, r in self._replicas.items()}

    @property
    def num_remembered(self) -> int:
        """Block hashes in the map."""
        return len(self._owner)

    # -- the choice --------------------------------------------------------------------------

    def choose(self, hashes: Sequence[BlockHash], replica_ids: Sequence[str]) -> Decision:
        """Order `replica_ids` (the living ones) for a prompt whose first blocks are `hashes`.

        The first is the pick; the rest are where a 429 is retried, least loaded first."""
        if not replica_ids:
            return Decision((), "none")
        for replica_id in replica_ids:
            self._replicas.setdefault(replica_id, ReplicaLoad(replica_id))
        by_load = sorted(replica_ids, key=lambda r: (self._replicas[r].load, r))
        least = self._replicas[by_load[0]].load
        living = set(replica_ids)
        matched, owner = 0, None
        # The deepest remembered block wins: it is the longest prefix some replica holds.
        for depth in range(len(hashes), 0, -1):
            candidate = self._owner.get(hashes[depth - 1])
            if candidate is not None and candidate in living:
                matched, owner = depth, candidate
                break
        if owner is not None and matched < self.min_match * len(hashes):
            owner = None
        if owner is not None and self._replicas[owner].load - least <= self.load_threshold:
            first, reason = owner, "prefix"
        else:
            tied = [r for r in by_load if self._replicas[r].load == least]
            first = tied[self._turn % len(tied)]
            self._turn += 1
            reason = "load" if owner is not None else "balance"
        order = (first, *(r for r in by_load if r != first))
        return Decision(order, reason, matched)

    def started(self, replica_id: str) -> None:
        """A request is in flight at `replica_id` (until `ended`)."""
        self._replicas.setdefault(replica_id, ReplicaLoad(replica_id)).in_flight += 1

    def ended(self, replica_id: str) -> None:
        replica = self._replicas.get(replica_id)
        if replica is not None and replica.in_flight > 0:
            replica.in_flight -= 1

    def sent(self, replica_id: str, hashes: Sequence[BlockHash]) -> None:
        """The request was accepted at `replica_id`: its blocks will be cached there."""
        for block_hash in hashes:
            self._owner[block_hash] = replica_id
            self._owner.move_to_end(block_hash)
        while len(self._owner) > self.capacity:
            self._owner.popitem(last=False)
