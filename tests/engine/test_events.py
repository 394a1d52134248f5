"""The engine event stream without a model (kvserve/engine/events.py, pool_events.py): a pool of
10^5 blocks is sent whole once and by its changes after, every viewer's picture (a late one's
too) is the pool's, and a viewer that connects after requests ended gets their history."""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from types import SimpleNamespace

import pytest

from kvserve.bench.events_bench import SyntheticEngine
from kvserve.engine.events import EngineEvents, History
from kvserve.engine.pool_events import PoolMirror, block_runs, expand_runs

NUM_BLOCKS = 100_000
NUM_SLOTS = 64


def truth(engine: SyntheticEngine) -> dict:
    """The pool as a viewer should picture it: tables with holes as None, shared counts,
    cached-free ids."""
    pool = engine.pool
    tables = {}
    for owner in pool.owners():
        holes = pool.num_holes(owner)
        tables[owner] = [None] * holes + list(pool.table(owner)[holes:])
    held = Counter(block for table in tables.values() for block in table if block is not None)
    assert all(pool.refcount(block) == count for block, count in held.items() if count > 1)
    return {
        "tables": tables,
        "shared": {block: count for block, count in held.items() if count > 1},
        "cached_free": set(pool.cache.cached_free_ids()),
        "used": pool.num_used,
    }


def picture(mirror: PoolMirror) -> dict:
    return {
        "tables": mirror.tables,
        "shared": mirror.shared,
        "cached_free": mirror.cached_free,
        "used": len({block for owner in mirror.tables for block in mirror.held(owner)}),
    }


def full_engine(seed: int = 0) -> tuple[SyntheticEngine, int]:
    engine = SyntheticEngine(NUM_BLOCKS, NUM_SLOTS)
    prompt_tokens = int(0.9 * NUM_BLOCKS / NUM_SLOTS) * 16 - 64
    for _ in range(NUM_SLOTS):
        engine.admit(prompt_tokens)
    return engine, prompt_tokens


def test_runs_round_trip() -> None:
    rng = random.Random(3)
    for _ in range(200):
        ids = []
        while len(ids) < rng.randrange(0, 60):
            start, length, step = rng.randrange(0, 500), rng.randrange(1, 8), rng.choice((1, -1))
            ids.extend(start + step * k for k in range(length))
        assert expand_runs(block_runs(ids)) == ids
    assert block_runs([5, 6, 7, 8, 20, 19, 18, 3, 4]) == [[5, 8], [20, 18], 3, 4]
    assert expand_runs(json.loads(json.dumps(block_runs(list(range(1000)))))) == list(range(1000))


def test_a_large_pool_goes_whole_once_then_by_its_changes() -> None:
    """10^5 blocks in use by 64 sequences: the snapshot decodes to the pool (each block's
    owner), and an update with a few blocks taken, a sequence ended and one admitted carries
    those, not the pool: its size is independent of the pool's."""

    async def main() -> None:
        engine, prompt_tokens = full_engine()
        events = EngineEvents(max_rate=1e-3, heartbeat=1e6)
        events.bind(engine)  # type: ignore[arg-type]
        viewer = events.connect()
        (text,) = await viewer.next_batch()
        snapshot = json.loads(text)
        mirror = PoolMirror()
        mirror.apply(snapshot)
        assert picture(mirror) == truth(engine)
        assert truth(engine)["used"] > 0.89 * NUM_BLOCKS
        owners = mirror.owners_of()
        for owner in engine.pool.owners():
            assert all(owners[block] == [owner] for block in engine.pool.table(owner))
        sizes = []
        for index in range(30):
            engine.decode(5)
            engine.finish(engine.sequences[0])
            engine.admit(prompt_tokens - 16 * (index % 4))
            events.flush()
            (text,) = await viewer.next_batch()
            sizes.append(len(text))
            mirror.apply(json.loads(text))
            if index % 10 == 9:
                assert picture(mirror) == truth(engine)
        # One new table of ~1,400 blocks (as runs) and the slots: far from the pool's 10^5 ids.
        assert max(sizes) < 30_000
        events.close_all()

    asyncio.run(main())


def test_every_viewer_sees_the_pool_whatever_changed_and_whenever_it_connected() -> None:
    """Random growth, ends, admissions, rollbacks, windows sliding, prefix sharing and
    cached-free blocks taken back, with viewers connecting between updates: after each update
    every viewer's picture is the pool."""

    async def main() -> None:
        rng = random.Random(11)
        engine = SyntheticEngine(4096, 16)
        pool = engine.pool
        for _ in range(12):
            engine.admit(rng.randrange(16, 2000))
        events = EngineEvents(max_rate=1e-3, heartbeat=1e6)
        events.bind(engine)  # type: ignore[arg-type]
        mirrors = {}

        async def join() -> None:
            viewer = events.connect()
            mirror = PoolMirror()
            mirror.apply(json.loads((await viewer.next_batch())[0]))
            assert picture(mirror) == truth(engine)
            mirrors[viewer] = mirror

        await join()
        num_shared = num_holes = 0  # updates that had shared blocks, tables with holes
        for _ in range(150):
            for _ in range(rng.randrange(1, 4)):
                seqs = engine.sequences
                action = rng.random()
                if action < 0.3:
                    engine.decode(rng.randrange(1, 40))
                elif action < 0.45 and seqs:
                    engine.finish(rng.choice(seqs))
                elif action < 0.6:
                    engine.admit(rng.randrange(16, 1500))
                elif action < 0.7 and seqs:
                    seq = rng.choice(seqs)  # a rollback, then fresh blocks
                    kept = max(pool.num_holes(seq.seq_id), len(pool.table(seq.seq_id)) - 2)
                    pool.truncate(seq.seq_id, kept)
                    pool.allocate(seq.seq_id, min(2, pool.num_free))
                elif action < 0.8 and seqs:
                    seq = rng.choice(seqs)  # its window slid past its first blocks
                    table = pool.table(seq.seq_id)
                    pool.give_back(seq.seq_id, pool.num_holes(seq.seq_id) + rng.randrange(0, 3))
                    assert len(pool.table(seq.seq_id)) == len(table)
                elif action < 0.92 and seqs:
                    # A new sequence shares another's first blocks (a prefix hit).
                    source = rng.choice(seqs)
                    held = pool.held(source.seq_id)[:4]
                    seq = engine.admit(16)
                    if seq is not None and held:
                        pool.share(seq.seq_id, held, prepend=True)
                        engine.kv.reserved[seq.seq_id] += len(held)
                else:
                    # A cached-free block taken back by a new sequence.
                    seq = engine.admit(16)
                    cached = pool.cache.cached_free_ids()
                    if seq is not None and cached:
                        pool.share(seq.seq_id, [rng.choice(cached)], prepend=True)
                        engine.kv.reserved[seq.seq_id] += 1
            if rng.random() < 0.15:
                await join()  # between two updates, after some changes
            events.flush()
            expected = truth(engine)
            num_shared += bool(expected["shared"])
            num_holes += any(table and table[0] is None for table in expected["tables"].values())
            for viewer, mirror in mirrors.items():
                (text,) = await viewer.next_batch()
                mirror.apply(json.loads(text))
                assert picture(mirror) == expected
        assert len(mirrors) > 5 and pool.check_whole()
        assert num_shared > 20 and num_holes > 20
        events.close_all()

    asyncio.run(main())


def state(arrival: float, last: float | None) -> SimpleNamespace:
    return SimpleNamespace(last_token_at=last, request=SimpleNamespace(arrival_time=arrival))


def test_a_viewer_that_connects_after_requests_ended_gets_their_history() -> None:
    async def main() -> None:
        engine, _ = full_engine()
        events = EngineEvents()
        events.bind(engine)  # type: ignore[arg-type]
        start = time.monotonic() - 30.0  # the engine's clock
        # Nobody watches: three requests, first tokens after 120, 250 and 400 ms, then 9
        # more tokens each, 50 ms apart, in the seconds that follow.
        for k, wait in enumerate((0.12, 0.25, 0.4)):
            arrival = start + 3 * k
            first = arrival + wait
            events.on_token(state(arrival, None), first)
            for n in range(1, 10):
                events.on_token(state(arrival, first + 0.05 * (n - 1)), first + 0.05 * n)
        viewer = events.connect()
        snapshot = json.loads((await viewer.next_batch())[0])
        history = snapshot["history"]
        assert [ms for _, ms in history["ttft_ms"]] == [120, 250, 400]
        assert all(start <= when <= snapshot["time"] for when, _ in history["ttft_ms"])
        assert sum(n for _, n in history["tokens"]) == 30
        # One point per second from the first with tokens to the last whole one: zeros between.
        seconds = [t for t, _ in history["tokens"]]
        assert seconds == list(range(int(start + 0.12) + 1, int(snapshot["time"]) + 1))
        assert history["itl_ms"]
        assert all(mean == pytest.approx(50, abs=0.01) for _, mean, _ in history["itl_ms"])
        events.close_all()

    asyncio.run(main())


def test_the_history_is_bounded() -> None:
    history = History(seconds=120, max_ttft=100)
    for k in range(100_000):
        now = k * 0.01  # 1,000 s of tokens, one first token each 10 ms
        history.add_tokens(now, 2, None if k % 3 else 0.01)
        history.add_first_token(now, 5)
    assert len(history._buckets) == 120 and len(history._ttft) == 100
    drawn = history.to_json(1000.0)
    assert len(drawn["tokens"]) == 120 and {n for _, n in drawn["tokens"]} == {200}
    assert len(drawn["ttft_ms"]) == 100
