"""Sliding windows: a model whose every layer attends only to the last W positions gives back
the blocks behind each sequence's window as it runs, and admission reserves and the door asks
for the window's blocks only (kvserve/core/kv_manager.py, kvserve/core/scheduler.py)."""

from __future__ import annotations

import pytest

from kvserve.config import SchedulerConfig, SpeculativeConfig
from kvserve.core import (
    BlockPool,
    Infeasible,
    KVManager,
    Prompt,
    Scheduler,
    make_sequences,
)
from kvserve.core.blocks import PLACEHOLDER_BLOCK
from tests.core import helpers
from tests.core.helpers import admit, release_finished, run

WINDOW = 8  # positions; blocks of 4, chunks of 4: a sequence holds at most 4 blocks at once


def make_scheduler(**kwargs: object) -> Scheduler:
    options = dict(
        num_blocks=16,
        block_size=4,
        max_model_len=256,
        window=WINDOW,
        prefill_chunk=4,
        reserve_tokens=4,
    )
    return helpers.make_scheduler(**(options | kwargs))


def check_step(scheduler: Scheduler, plan) -> None:
    """Every chunk's rows have real blocks, every entry before its window's first block is a
    hole, and no sequence holds more than the window's blocks."""
    kv = scheduler.kv
    assert kv.check_whole()
    for chunk in plan.chunks:
        first = kv.first_needed_block(chunk.start)
        holes = kv.pool.num_holes(chunk.request_id)
        assert holes <= first
        assert chunk.block_ids[:holes] == (PLACEHOLDER_BLOCK,) * holes
        assert kv.pool.held(chunk.request_id) == chunk.block_ids[holes:]
        if not chunk.is_speculative:
            assert kv.num_held(chunk.request_id) <= scheduler.window_blocks


def drain(scheduler: Scheduler, token: int | None = 7, limit: int = 1000) -> int:
    """Run steps, releasing what finishes, until nothing runs; returns the steps taken."""
    for steps in range(limit):
        if not scheduler.running and not scheduler.preempted:
            return steps
        plan = run(scheduler, token)
        check_step(scheduler, plan)
        release_finished(scheduler)
        scheduler.resume()
    raise AssertionError("the scheduler did not drain")


def assert_whole(scheduler: Scheduler) -> None:
    kv = scheduler.kv
    assert kv.pool.num_free == kv.num_blocks and kv.num_free == kv.num_blocks
    assert kv.num_spare == 0 and kv.check_whole() and kv.pool.owners() == ()


# -- the block pool's holes ----------------------------------------------------------------------


def test_given_back_blocks_leave_leading_holes_that_take_no_reference() -> None:
    pool = BlockPool(8, 4)
    blocks = pool.allocate("a", 5)
    assert pool.give_back("a", 2) == 2
    assert pool.table("a") == (PLACEHOLDER_BLOCK, PLACEHOLDER_BLOCK, *blocks[2:])
    assert pool.held("a") == blocks[2:] and pool.num_holes("a") == 2 and pool.num_held("a") == 3
    assert pool.num_free == 5 and pool.check_whole()
    assert pool.give_back("a", 1) == 0  # holes already
    assert pool.truncate("a", 4) == 1 and pool.held("a") == blocks[2:4]
    assert pool.truncate("a", 1) == 2 and pool.table("a") == (PLACEHOLDER_BLOCK,)
    assert pool.num_holes("a") == 1 and pool.check_whole()
    assert pool.release("a") == 0 and pool.num_free == 8 and pool.check_whole()


def test_holes_are_shared_only_before_a_table() -> None:
    pool = BlockPool(8, 4)
    leader = pool.allocate("leader", 3)
    pool.allocate("follower", 1)
    pool.share("follower", leader[1:], prepend=True, holes=1)
    assert pool.table("follower")[:3] == (PLACEHOLDER_BLOCK, *leader[1:])
    assert pool.refcount(leader[0]) == 1 and pool.refcount(leader[1]) == 2
    with pytest.raises(ValueError, match="holes"):
        pool.share("follower", [leader[0]], prepend=True)
    with pytest.raises(ValueError, match="holes"):
        pool.share("leader", [], holes=1)  # after blocks
    assert pool.check_whole()
    pool.release("leader")
    pool.release("follower")
    assert pool.num_free == 8 and pool.check_whole()


# -- the rule ------------------------------------------------------------------------------------


@pytest.mark.parametrize("block_size", [4, 32])
@pytest.mark.parametrize("window", [1, 3, 8, 16, 33, 48])
@pytest.mark.parametrize("rows", [1, 4, 17, 512])
def test_window_blocks_is_the_most_any_step_holds(block_size: int, window: int, rows: int) -> None:
    """A step computing `rows` positions from p holds the blocks from that of p - W + 1 to that
    of p + rows - 1: the cap is the largest such count over every p (and is reached)."""
    kv = KVManager(BlockPool(1, block_size), window=window)
    held = [
        kv.blocks_for(p + rows) - kv.first_needed_block(p)
        for p in range(window + 3 * block_size + rows)
    ]
    assert max(held) == kv.window_blocks(rows)
    assert KVManager(BlockPool(1, block_size)).window_blocks(rows) is None


def test_a_sequence_many_windows_long_holds_its_windows_blocks_only() -> None:
    scheduler = make_scheduler()
    kv = scheduler.kv
    assert scheduler.window_blocks == 4  # W - 1 + 4 rows = 11 positions: at most 4 blocks
    seq = admit(scheduler, "a", 30, 60)
    freed = []
    while not seq.is_finished:
        plan = run(scheduler)
        check_step(scheduler, plan)
        freed.append(kv.num_window_freed)
    assert seq.num_output == 60 and scheduler.num_preemptions == 0
    # 89 positions computed, 23 blocks' worth; all but the window's last ones went back.
    assert freed == sorted(freed) and freed[-1] >= kv.blocks_for(89) - scheduler.window_blocks
    assert kv.pool.num_holes("a") == kv.first_needed_block(seq.num_computed)
    scheduler.release("a")
    assert_whole(scheduler)


def test_without_a_window_nothing_is_given_back() -> None:
    scheduler = make_scheduler(window=None, num_blocks=32)
    seq = admit(scheduler, "a", 30, 60)
    while not seq.is_finished:
        run(scheduler)
    assert scheduler.kv.pool.num_holes("a") == 0 and scheduler.kv.num_window_freed == 0
    assert scheduler.kv.num_held("a") == scheduler.kv.blocks_for(89)


# -- the door and admission ----------------------------------------------------------------------


def test_a_prompt_longer_than_the_pool_is_admitted_when_its_window_fits() -> None:
    # 6 blocks of 4 hold 24 positions; the prompt alone has 100.
    scheduler = make_scheduler(num_blocks=6)
    assert scheduler.check(100, 40) == 40
    assert scheduler.resolve_budget(100, None) == 256 - 100  # the context, not the pool
    assert scheduler.max_sequence_tokens == 256
    seq = admit(scheduler, "long", 100, 40)
    assert seq is not None and scheduler.kv.num_held("long") == 4
    assert drain(scheduler) > 0
    assert seq.num_output == 40 and scheduler.num_preemptions == 0
    assert_whole(scheduler)
    # The same pool without a window refuses it at the door.
    plain = make_scheduler(num_blocks=6, window=None)
    with pytest.raises(Infeasible) as refused:
        plain.check(100, 40)
    assert refused.value.param == "prompt"


def test_the_door_refuses_a_window_larger_than_the_pool() -> None:
    scheduler = make_scheduler(num_blocks=3)  # 4 blocks a window, 3 in the pool
    assert scheduler.check(4, 4) == 4  # 8 positions: 2 blocks, the window never fills
    with pytest.raises(Infeasible) as refused:
        scheduler.check(100, 4)
    assert refused.value.param == "prompt" and "sliding window of 8" in refused.value.reason
    with pytest.raises(Infeasible) as refused:
        scheduler.check(6, 20)
    assert refused.value.param == "max_tokens"
    # n answers: each holds its window's blocks.
    wide = make_scheduler(num_blocks=7, max_num_seqs=4)
    assert wide.check(100, 10, n=1) == 10
    with pytest.raises(Infeasible) as refused:
        wide.check(100, 10, n=2)
    assert refused.value.param == "n"


def test_the_cap_counts_a_whole_prefill_chunk_beside_the_window() -> None:
    """Chunks of 16 rows: the first block the window needs is far behind the chunk's end, and
    the reservation covers both, so a long prompt's prefill never preempts."""
    scheduler = make_scheduler(prefill_chunk=16, num_blocks=8)
    assert scheduler.window_blocks == scheduler.kv.blocks_for(WINDOW + 16 - 2) + 1 == 7
    seq = admit(scheduler, "a", 120, 5)
    assert scheduler.kv.num_held("a") == 7
    assert drain(scheduler) > 0 and seq.num_output == 5 and scheduler.num_preemptions == 0
    assert_whole(scheduler)


def test_given_back_blocks_stay_promised_to_their_request() -> None:
    """A long request gives blocks back at its window's start and grows into them again; a
    later arrival is not admitted into them."""
    scheduler = make_scheduler(num_blocks=8)
    kv = scheduler.kv
    long = admit(scheduler, "long", 60, 30)
    assert admit(scheduler, "short", 12, 20, arrival=1) is not None  # 16 positions: 4 blocks
    assert kv.num_free == 0
    for _ in range(6):
        check_step(scheduler, run(scheduler))
    # Both gave blocks back (the short one's answer passes its window too): all promised.
    assert kv.spare("long") >= 1 and kv.pool.num_free == kv.num_spare > 0
    assert kv.num_free == 0 and not helpers.can_admit(scheduler, 2, 1)
    assert drain(scheduler) > 0
    assert long.num_output == 30 and scheduler.num_preemptions == 0
    assert_whole(scheduler)


def test_under_reserve_windowed_requests_never_preempt() -> None:
    scheduler = make_scheduler(num_blocks=10, admission="reserve", max_num_seqs=4)
    kv = scheduler.kv
    pending = [
        helpers.sequences(f"r{i}", prompt, budget, arrival=i)
        for i, (prompt, budget) in enumerate([(70, 40), (5, 6), (50, 9), (3, 30), (90, 2)])
    ]
    for _ in range(500):
        while pending and scheduler.admit(pending[0]):
            pending.pop(0)
        if not pending and not scheduler.running:
            break
        check_step(scheduler, run(scheduler))
        release_finished(scheduler)
    assert not pending and scheduler.num_preemptions == 0
    assert kv.num_window_freed > 0
    assert_whole(scheduler)


# -- the prefix cache, preemption, n > 1 and speculation with holes -----------------------------


def _tokens(request_id: str, num_prompt: int, max_tokens: int, arrival: int = 0, n: int = 1):
    token_ids = tuple(range(1, num_prompt + 1))
    return make_sequences(
        request_id, num_prompt, max_tokens, Prompt(token_ids, n=n), arrival=arrival
    )


def test_cache_hits_behind_the_window_are_holes_from_the_start() -> None:
    scheduler = make_scheduler(caching=True)
    kv = scheduler.kv
    (first,) = _tokens("first", 40, 4)
    assert scheduler.admit([first])
    drain(scheduler)
    # Every full block it computed was published before it went back: all cached-free now.
    assert kv.pool.num_cached_free >= 10
    (again,) = _tokens("again", 40, 4)
    computed = kv.computed_blocks(again)
    assert len(computed.block_ids) == 9  # positions 0..35; the last prompt token is computed
    assert scheduler.admit([again])
    assert again.num_computed == 36 and again.num_cached_tokens == 36
    skipped = kv.first_needed_block(36)  # the window of position 36 starts at 29: block 7
    assert skipped == 7 and kv.pool.num_holes("again") == skipped
    assert kv.table("again")[skipped:9] == computed.block_ids[skipped:]
    assert all(kv.cache.is_cached_free(b) for b in computed.block_ids[:skipped])
    drain(scheduler)
    assert again.num_output == 4
    assert_whole(scheduler)


def test_preempted_windowed_sequences_resume_from_what_the_cache_still_holds() -> None:
    # Budgets: "old" its window (4 blocks), the others 2 (8 positions); they grow past them.
    scheduler = make_scheduler(num_blocks=8, caching=True, max_num_seqs=3)
    seqs = [
        _tokens("old", 40, 30, arrival=0)[0],
        _tokens("mid", 4, 40, arrival=1)[0],
        _tokens("new", 4, 40, arrival=2)[0],
    ]
    for seq in seqs:
        assert scheduler.admit([seq])
    assert drain(scheduler) > 0
    assert scheduler.num_preemptions > 0
    assert [seq.num_output for seq in seqs] == [30, 40, 40]
    assert_whole(scheduler)


def test_n_answers_share_the_prompt_behind_their_holes() -> None:
    scheduler = make_scheduler(caching=True, num_blocks=12)
    kv = scheduler.kv
    leader, follower = _tokens("a", 30, 20, n=2)
    assert scheduler.admit([leader, follower])
    while follower.awaits_fork:
        check_step(scheduler, run(scheduler))
    holes = kv.pool.num_holes("a")
    assert holes > 0 and kv.pool.num_holes("a#1") == holes  # the leader's, as the fork found
    assert kv.table("a#1")[holes : 30 // 4] == kv.table("a")[holes : 30 // 4]
    while not (leader.is_finished and follower.is_finished):
        check_step(scheduler, run(scheduler))
        distinct = set(kv.pool.held("a")) | set(kv.pool.held("a#1"))
        assert len(distinct) <= 2 * scheduler.window_blocks
    assert leader.num_output == follower.num_output == 20
    release_finished(scheduler)
    assert_whole(scheduler)


def test_speculative_rollback_keeps_the_holes() -> None:
    pool = BlockPool(16, 4)
    config = SchedulerConfig(max_num_seqs=2, prefill_chunk=4, reserve_tokens=4)
    spec = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1)
    scheduler = Scheduler(config, KVManager(pool, window=WINDOW), 256, speculative=spec)
    prompt = (1, 2, 3, 4, 5, 6) * 5
    (seq,) = make_sequences("a", len(prompt), 40, Prompt(prompt))
    assert scheduler.admit([seq])
    rejected = 0
    while not seq.is_finished:
        plan = scheduler.schedule()
        check_step(scheduler, plan)
        sampled = {}
        for chunk in plan.chunks:
            if chunk.is_speculative:
                # Keep the first guess, reject the rest: positions roll back every other step.
                sampled[chunk.request_id] = (chunk.draft_token_ids[0], 9)
                rejected += len(chunk.draft_token_ids) - 1
            elif chunk.samples:
                sampled[chunk.request_id] = 1
        scheduler.update_from_output(plan, sampled)
        assert scheduler.kv.check_whole()
        assert pool.num_holes("a") <= scheduler.kv.first_needed_block(seq.num_computed)
    assert rejected > 0 and pool.num_holes("a") > 0
    scheduler.release("a")
    assert_whole(scheduler)
