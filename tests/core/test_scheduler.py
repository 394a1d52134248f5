"""Scheduler rules, one at a time: the door, step composition, update, release, batching modes."""

from __future__ import annotations

import pytest

from kvserve.config import SchedulerConfig
from kvserve.core import AdmissionQueue, BlockPool, Infeasible, Scheduler, admit_waiting


def make_scheduler(
    *,
    num_blocks: int = 64,
    block_size: int = 4,
    max_model_len: int = 64,
    **config: object,
) -> Scheduler:
    return Scheduler(SchedulerConfig(**config), BlockPool(num_blocks, block_size), max_model_len)


def run_plan(scheduler: Scheduler):
    """One step where every chunk runs."""
    plan = scheduler.schedule()
    scheduler.update(plan)
    return plan


# -- the door ------------------------------------------------------------------------------------


def test_check_returns_the_named_budget() -> None:
    scheduler = make_scheduler(max_model_len=64)
    assert scheduler.check(10, 20) == 20


def test_check_without_max_tokens_reserves_the_rest_of_the_context() -> None:
    scheduler = make_scheduler(num_blocks=64, block_size=4, max_model_len=64)
    assert scheduler.check(10, None) == 54
    assert scheduler.resolve_reserve(10, None) == 54


def test_check_without_max_tokens_is_capped_by_the_pool_instead_of_refused() -> None:
    scheduler = make_scheduler(num_blocks=5, block_size=4, max_model_len=64)
    assert scheduler.check(10, None) == 20 - 10


@pytest.mark.parametrize(
    ("prompt", "max_tokens", "param"),
    [
        (0, 5, "prompt"),  # empty
        (64, 1, "prompt"),  # fills the context alone
        (80, None, "prompt"),  # longer than the context
        (10, 55, "max_tokens"),  # 65 > 64
        (63, 2, "max_tokens"),
        (10, 0, "max_tokens"),
    ],
)
def test_check_refuses_what_could_never_fit_the_context(
    prompt: int, max_tokens: int | None, param: str
) -> None:
    scheduler = make_scheduler(num_blocks=64, block_size=4, max_model_len=64)
    with pytest.raises(Infeasible) as refused:
        scheduler.check(prompt, max_tokens)
    assert refused.value.param == param
    assert refused.value.reason == str(refused.value)
    assert isinstance(refused.value, ValueError)


def test_check_refuses_what_could_never_fit_the_whole_pool() -> None:
    # 6 blocks of 4 = 24 positions, though the context allows 64.
    scheduler = make_scheduler(num_blocks=6, block_size=4, max_model_len=64)
    assert scheduler.check(10, 14) == 14
    with pytest.raises(Infeasible) as too_much_answer:
        scheduler.check(10, 15)
    assert too_much_answer.value.param == "max_tokens"
    with pytest.raises(Infeasible) as too_long_prompt:
        scheduler.check(30, 1)
    assert too_long_prompt.value.param == "prompt"


# -- step composition ----------------------------------------------------------------------------


def test_prefill_is_chunked_per_sequence_and_only_the_last_chunk_samples() -> None:
    scheduler = make_scheduler(prefill_chunk=8, max_num_batched_tokens=100)
    scheduler.admit("a", 20, 4, arrival=0)
    chunks = [run_plan(scheduler).chunks for _ in range(3)]
    assert [(c[0].start, c[0].num_tokens, c[0].samples) for c in chunks] == [
        (0, 8, False),
        (8, 8, False),
        (16, 4, True),
    ]
    seq = scheduler.get("a")
    assert seq is not None
    assert (seq.num_computed, seq.num_output, seq.is_prefilling) == (20, 1, False)


def test_rows_per_step_limit_cuts_a_prefill_chunk() -> None:
    scheduler = make_scheduler(prefill_chunk=8, max_num_batched_tokens=12)
    scheduler.admit("a", 10, 4, arrival=0)
    scheduler.admit("b", 10, 4, arrival=1)
    plan = scheduler.schedule()
    assert [(c.request_id, c.num_tokens) for c in plan.chunks] == [("a", 8), ("b", 4)]
    assert plan.num_rows == 12
    assert plan.waiting_ids == ()


def test_prefill_chunks_come_before_decode_rows() -> None:
    scheduler = make_scheduler(prefill_chunk=8, max_num_batched_tokens=100)
    scheduler.admit("early", 4, 8, arrival=0)
    run_plan(scheduler)  # "early" is now decoding
    scheduler.admit("late", 6, 8, arrival=1)
    plan = scheduler.schedule()
    assert [(c.request_id, c.is_prefill) for c in plan.chunks] == [
        ("late", True),
        ("early", False),
    ]
    assert (plan.num_prefill_rows, plan.num_decode_rows) == (6, 1)
    decode = plan.chunks[1]
    assert (decode.start, decode.num_tokens, decode.samples) == (4, 1, True)


def test_decode_row_that_does_not_fit_waits_and_keeps_its_resources() -> None:
    scheduler = make_scheduler(prefill_chunk=8, max_num_batched_tokens=8)
    scheduler.admit("decoder", 3, 8, arrival=0)
    run_plan(scheduler)
    blocks_before = scheduler.pool.table("decoder")
    scheduler.admit("long", 16, 4, arrival=1)
    plan = run_plan(scheduler)
    assert [c.request_id for c in plan.chunks] == ["long"]
    assert plan.waiting_ids == ("decoder",)
    decoder = scheduler.get("decoder")
    assert decoder is not None
    assert (decoder.num_computed, decoder.num_output) == (3, 1)
    assert scheduler.pool.table("decoder") == blocks_before
    # The prompt's last chunk leaves no room either; then the decoder runs again.
    assert run_plan(scheduler).waiting_ids == ("decoder",)
    plan = run_plan(scheduler)
    assert [(c.request_id, c.is_prefill) for c in plan.chunks] == [
        ("decoder", False),
        ("long", False),
    ]


def test_decode_rows_follow_arrival_order_not_admission_order() -> None:
    scheduler = make_scheduler(prefill_chunk=8, max_num_batched_tokens=100)
    for request_id, arrival in (("third", 7), ("first", 2), ("second", 5)):
        scheduler.admit(request_id, 2, 4, arrival=arrival)
    run_plan(scheduler)
    plan = scheduler.schedule()
    assert [c.request_id for c in plan.chunks] == ["first", "second", "third"]
    assert all(not c.is_prefill for c in plan.chunks)
    assert [s.request_id for s in scheduler.running] == ["first", "second", "third"]


def test_block_tables_cover_every_planned_row() -> None:
    scheduler = make_scheduler(block_size=4, prefill_chunk=5, max_num_batched_tokens=100)
    scheduler.admit("a", 9, 6, arrival=0)
    for _ in range(8):
        plan = run_plan(scheduler)
        for chunk in plan.chunks:
            assert len(chunk.block_ids) * 4 >= chunk.start + chunk.num_tokens
            assert chunk.block_ids == scheduler.pool.table(chunk.request_id)


def test_a_sequence_that_spent_its_budget_gets_no_rows() -> None:
    scheduler = make_scheduler(prefill_chunk=8, max_num_batched_tokens=100)
    scheduler.admit("a", 4, 2, arrival=0)
    run_plan(scheduler)  # output 1
    run_plan(scheduler)  # output 2 = max_tokens
    seq = scheduler.get("a")
    assert seq is not None and seq.has_reached_max_tokens
    blocks = scheduler.pool.table("a")
    plan = scheduler.schedule()
    assert plan.chunks == () and plan.waiting_ids == ("a",)
    assert scheduler.pool.table("a") == blocks


def test_slot_only_sequence_waits_for_a_block_and_is_not_evicted() -> None:
    scheduler = make_scheduler(
        num_blocks=2, block_size=4, admission="slot-only", max_num_batched_tokens=100
    )
    assert scheduler.admit("a", 4, 8, arrival=0) is not None
    assert scheduler.admit("b", 4, 8, arrival=1) is not None
    assert scheduler.pool.num_used == 0  # nothing reserved at admission
    run_plan(scheduler)  # both prompts fill one block each
    plan = scheduler.schedule()
    assert plan.chunks == ()
    assert plan.waiting_ids == ("a", "b")
    assert scheduler.is_stuck(plan)
    assert scheduler.num_running == 2
    scheduler.update(plan)
    scheduler.release("a")
    plan = scheduler.schedule()
    assert [c.request_id for c in plan.chunks] == ["b"]
    assert not scheduler.is_stuck(plan)


def test_update_refuses_a_stale_or_repeated_plan() -> None:
    scheduler = make_scheduler()
    scheduler.admit("a", 4, 4, arrival=0)
    old = scheduler.schedule()
    scheduler.update(old)
    with pytest.raises(ValueError):
        scheduler.update(old)
    scheduler.schedule()
    with pytest.raises(ValueError):
        scheduler.update(old)


def test_update_skips_a_sequence_released_during_the_step() -> None:
    scheduler = make_scheduler()
    scheduler.admit("a", 4, 4, arrival=0)
    scheduler.admit("b", 4, 4, arrival=1)
    plan = scheduler.schedule()
    scheduler.release("a")
    scheduler.update(plan)
    b = scheduler.get("b")
    assert b is not None and b.num_computed == 4
    assert scheduler.get("a") is None


# -- admission and release -----------------------------------------------------------------------


def test_reserve_admission_needs_a_slot_and_every_block() -> None:
    scheduler = make_scheduler(num_blocks=10, block_size=4, max_num_seqs=2)
    assert scheduler.can_admit(10, 10)  # 5 blocks
    first = scheduler.admit("a", 10, 10, arrival=0)
    assert first is not None and len(scheduler.pool.table("a")) == 5
    assert not scheduler.can_admit(10, 11)  # 6 blocks > 5 free
    assert scheduler.admit("b", 10, 11, arrival=1) is None
    assert scheduler.pool.num_free == 5
    assert scheduler.admit("b", 10, 10, arrival=1) is not None
    assert scheduler.num_free_slots == 0
    assert not scheduler.can_admit(1, 1)  # blocks aside, no slot


def test_release_returns_slot_and_blocks_and_offers_capacity_once_per_call() -> None:
    scheduler = make_scheduler(num_blocks=10, block_size=4, max_num_seqs=2)
    seq = scheduler.admit("a", 10, 10, arrival=0)
    assert seq is not None
    assert scheduler.release("a")
    assert scheduler.capacity.num_offered == 1 and scheduler.capacity.pending
    assert not scheduler.release("a")
    assert scheduler.capacity.num_offered == 1
    assert scheduler.num_free_slots == 2 and scheduler.pool.num_free == 10
    assert scheduler.pool.check_whole()
    again = scheduler.admit("b", 1, 1, arrival=1)
    assert again is not None and again.slot == seq.slot


def test_admit_refuses_a_duplicate_request_id() -> None:
    scheduler = make_scheduler()
    scheduler.admit("a", 4, 4, arrival=0)
    with pytest.raises(ValueError):
        scheduler.admit("a", 4, 4, arrival=1)


# -- batching modes ------------------------------------------------------------------------------


def drive_until_done(batching: str, arrivals: dict[int, list[str]], answer: int) -> dict[str, int]:
    """Run a fake step loop; returns the step at which each request was admitted."""
    scheduler = make_scheduler(
        num_blocks=64,
        max_num_seqs=4,
        prefill_chunk=8,
        max_num_batched_tokens=100,
        batching=batching,
    )
    queue = AdmissionQueue(max_waiters=16, timeout=1e9, max_overtakes=4)
    admitted_at: dict[str, int] = {}
    total = sum(len(ids) for ids in arrivals.values())
    finished: set[str] = set()
    for step in range(100):
        for request_id in arrivals.get(step, []):
            queue.offer(request_id, 4, answer, now=float(step))
        for waiter in admit_waiting(scheduler, queue):
            admitted_at[waiter.request_id] = step
        plan = scheduler.schedule()
        scheduler.update(plan)
        for seq in scheduler.running:
            if seq.num_output >= answer:
                scheduler.release(seq.request_id)
                finished.add(seq.request_id)
        if len(finished) == total:
            return admitted_at
    raise AssertionError("workload did not finish")


def test_request_level_batching_holds_arrivals_until_the_whole_batch_is_done() -> None:
    arrivals = {0: ["a", "b"], 2: ["c"], 3: ["d"]}
    request = drive_until_done("request", arrivals, answer=5)
    # a and b: prefill at step 0 (first output), four decode steps 1..4, released after step 4.
    assert request["a"] == request["b"] == 0
    assert request["c"] == request["d"] == 5
    continuous = drive_until_done("continuous", arrivals, answer=5)
    assert (continuous["c"], continuous["d"]) == (2, 3)


def test_request_level_batch_closes_at_its_first_step_and_reopens_when_empty() -> None:
    scheduler = make_scheduler(batching="request")
    assert scheduler.admit("a", 4, 4, arrival=0) is not None
    assert scheduler.admit("b", 4, 4, arrival=1) is not None  # same admission round
    scheduler.update(scheduler.schedule())
    assert not scheduler.batch_open
    assert scheduler.admit("c", 4, 4, arrival=2) is None
    scheduler.release("a")
    assert scheduler.admit("c", 4, 4, arrival=2) is None
    scheduler.release("b")
    assert scheduler.batch_open
    assert scheduler.admit("c", 4, 4, arrival=2) is not None


def test_unknown_batching_mode_is_refused() -> None:
    with pytest.raises(ValueError):
        SchedulerConfig(batching="sometimes")  # type: ignore[arg-type]
