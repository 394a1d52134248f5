"""Scheduler rules, one at a time: the door, step composition, update and the stop check,
release, partial reservation and preemption by recompute."""

from __future__ import annotations

import pytest

from kvserve.config import SchedulerConfig
from kvserve.core import (
    AdmissionQueue,
    Infeasible,
    Outcome,
    Prompt,
    Scheduler,
    SequenceStatus,
    admit_or_enqueue,
    admit_waiting,
    make_sequences,
)
from tests.core import helpers
from tests.core.helpers import admit, can_admit


def make_scheduler(*, admission: str = "reserve", **kwargs: object) -> Scheduler:
    return helpers.make_scheduler(admission=admission, **kwargs)


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
    assert scheduler.resolve_budget(10, None) == 54


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
    admit(scheduler, "a", 20, 4, 0)
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
    admit(scheduler, "a", 10, 4, 0)
    admit(scheduler, "b", 10, 4, 1)
    plan = scheduler.schedule()
    assert [(c.request_id, c.num_tokens) for c in plan.chunks] == [("a", 8), ("b", 4)]
    assert plan.num_rows == 12
    assert plan.waiting_ids == ()


def test_prefill_chunks_come_before_decode_rows() -> None:
    scheduler = make_scheduler(prefill_chunk=8, max_num_batched_tokens=100)
    admit(scheduler, "early", 4, 8, 0)
    run_plan(scheduler)  # "early" is now decoding
    admit(scheduler, "late", 6, 8, 1)
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
    admit(scheduler, "decoder", 3, 8, 0)
    run_plan(scheduler)
    blocks_before = scheduler.pool.table("decoder")
    admit(scheduler, "long", 16, 4, 1)
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
        admit(scheduler, request_id, 2, 4, arrival)
    run_plan(scheduler)
    plan = scheduler.schedule()
    assert [c.request_id for c in plan.chunks] == ["first", "second", "third"]
    assert all(not c.is_prefill for c in plan.chunks)
    assert [s.request_id for s in scheduler.running] == ["first", "second", "third"]


def test_block_tables_cover_every_planned_row() -> None:
    scheduler = make_scheduler(block_size=4, prefill_chunk=5, max_num_batched_tokens=100)
    admit(scheduler, "a", 9, 6, 0)
    for _ in range(8):
        plan = run_plan(scheduler)
        for chunk in plan.chunks:
            assert len(chunk.block_ids) * 4 >= chunk.start + chunk.num_tokens
            assert chunk.block_ids == scheduler.pool.table(chunk.request_id)


def test_a_sequence_that_spent_its_budget_finishes_at_update_and_gets_no_rows() -> None:
    scheduler = make_scheduler(prefill_chunk=8, max_num_batched_tokens=100)
    admit(scheduler, "a", 4, 2, 0)
    plan = scheduler.schedule()
    assert scheduler.update(plan) == []  # output 1
    plan = scheduler.schedule()
    finished = scheduler.update(plan)  # output 2 = max_tokens
    seq = scheduler.get("a")
    assert finished == [seq] and seq.status is SequenceStatus.FINISHED_LENGTH
    assert seq.finish_reason == "length"
    blocks = scheduler.pool.table("a")
    plan = scheduler.schedule()  # not released yet: it waits, holding what it had
    assert plan.chunks == () and plan.waiting_ids == ("a",)
    assert scheduler.pool.table("a") == blocks


def test_update_refuses_a_stale_or_repeated_plan() -> None:
    scheduler = make_scheduler()
    admit(scheduler, "a", 4, 4, 0)
    old = scheduler.schedule()
    scheduler.update(old)
    with pytest.raises(ValueError):
        scheduler.update(old)
    scheduler.schedule()
    with pytest.raises(ValueError):
        scheduler.update(old)


def test_update_skips_a_sequence_released_during_the_step() -> None:
    scheduler = make_scheduler()
    admit(scheduler, "a", 4, 4, 0)
    admit(scheduler, "b", 4, 4, 1)
    plan = scheduler.schedule()
    scheduler.release("a")
    scheduler.update(plan)
    b = scheduler.get("b")
    assert b is not None and b.num_computed == 4
    assert scheduler.get("a") is None


# -- admission and release -----------------------------------------------------------------------


def test_reserve_admission_needs_a_slot_and_every_block() -> None:
    scheduler = make_scheduler(num_blocks=10, block_size=4, max_num_seqs=2)
    assert can_admit(scheduler, 10, 10)  # 5 blocks
    first = admit(scheduler, "a", 10, 10, 0)
    assert first is not None and len(scheduler.pool.table("a")) == 5
    assert not can_admit(scheduler, 10, 11)  # 6 blocks > 5 free
    assert admit(scheduler, "b", 10, 11, 1) is None
    assert scheduler.pool.num_free == 5
    assert admit(scheduler, "b", 10, 10, 1) is not None
    assert scheduler.num_free_slots == 0
    assert not can_admit(scheduler, 1, 1)  # blocks aside, no slot


def test_release_returns_slot_and_blocks_and_offers_capacity_once_per_call() -> None:
    scheduler = make_scheduler(num_blocks=10, block_size=4, max_num_seqs=2)
    seq = admit(scheduler, "a", 10, 10, 0)
    assert seq is not None
    slot = seq.slot
    assert scheduler.release("a")
    assert scheduler.capacity.num_offered == 1 and scheduler.capacity.pending
    assert not scheduler.release("a")
    assert scheduler.capacity.num_offered == 1
    assert scheduler.num_free_slots == 2 and scheduler.pool.num_free == 10
    assert scheduler.pool.check_whole()
    again = admit(scheduler, "b", 1, 1, 1)
    assert again is not None and again.slot == slot and seq.slot is None


def test_admit_refuses_a_duplicate_request_id() -> None:
    scheduler = make_scheduler()
    admit(scheduler, "a", 4, 4, 0)
    with pytest.raises(ValueError):
        admit(scheduler, "a", 4, 4, 1)


def test_admission_refuses_nobody_new_while_a_request_waits_in_the_queue() -> None:
    scheduler = make_scheduler(num_blocks=10, block_size=4, max_num_seqs=4)
    queue = AdmissionQueue(max_waiters=4, timeout=1e9, max_overtakes=0)
    big = make_sequences("big", 30, 10)
    assert admit_or_enqueue(scheduler, queue, make_sequences("a", 4, 4), 0.0).value == "admitted"
    waiter = admit_or_enqueue(scheduler, queue, big, 0.0)
    assert waiter.sequences == tuple(big) and big[0].arrival == waiter.arrival == 1
    # A small one fits but the queue is not empty: it waits behind the head.
    small = admit_or_enqueue(scheduler, queue, make_sequences("small", 1, 1), 0.0)
    assert small.request_id == "small" and len(queue) == 2


# -- the stop check ------------------------------------------------------------------------------


def test_a_stop_token_or_a_matched_stop_ends_a_sequence_at_update() -> None:
    scheduler = make_scheduler(prefill_chunk=8, max_num_batched_tokens=100)
    eos = make_sequences("eos", 4, 10, Prompt((1, 2, 3, 4)), stop_token_ids=frozenset({2}))
    text = make_sequences("text", 4, 10, Prompt((1, 2, 3, 4)), arrival=1)
    assert scheduler.admit(eos) and scheduler.admit(text)
    plan = scheduler.schedule()
    assert scheduler.update_from_output(plan, {"eos": 5, "text": 2}) == []
    plan = scheduler.schedule()
    finished = scheduler.update_from_output(plan, {"eos": 2, "text": 9}, stopped={"text"})
    assert [seq.seq_id for seq in finished] == ["eos", "text"]
    assert {seq.finish_reason for seq in finished} == {"stop"}
    assert eos[0].output_token_ids == [5, 2]  # the stop token is the answer's last token


# -- partial reservation and preemption ----------------------------------------------------------


def partial_scheduler(**kwargs: object) -> Scheduler:
    config = {"block_size": 4, "max_num_batched_tokens": 100, "prefill_chunk": 64}
    config.update(kwargs)
    return make_scheduler(admission="partial", **config)


def test_partial_admission_reserves_the_prompt_and_the_first_part_of_the_answer() -> None:
    scheduler = partial_scheduler(num_blocks=20, reserve_tokens=4, max_num_seqs=4)
    seq = admit(scheduler, "a", 10, 40, 0)  # 10 + 4 positions: 4 blocks, not 13
    assert seq is not None and len(scheduler.pool.table("a")) == 4
    assert scheduler.kv.num_reserved("a") == 4
    short = admit(scheduler, "b", 3, 2, 1)  # a budget below the first part: all of it
    assert short is not None and len(scheduler.pool.table("b")) == 2
    # It grows from the free pool as it decodes, one block at a time.
    run_plan(scheduler)
    for _ in range(8):
        run_plan(scheduler)
    assert seq.num_computed == 18 and len(scheduler.pool.table("a")) == 5
    assert scheduler.kv.num_reserved("a") == 4 and scheduler.num_preemptions == 0


def test_the_latest_arrival_is_preempted_and_resumes_by_recompute() -> None:
    # 6 blocks of 4. a (oldest) and b each reserve 2 blocks; c takes the last 2.
    scheduler = partial_scheduler(num_blocks=6, reserve_tokens=2, max_num_seqs=3, caching=True)
    queue = AdmissionQueue(max_waiters=4, timeout=1e9, max_overtakes=3)
    prompts = {name: tuple(range(10 * i + 1, 10 * i + 7)) for i, name in enumerate("abc")}
    seqs = {name: make_sequences(name, 6, 12, Prompt(prompts[name])) for name in "abc"}
    for name in "abc":
        assert admit_or_enqueue(scheduler, queue, seqs[name], 0.0).value == "admitted"
    assert scheduler.pool.num_free == 0
    tokens = {"a": 100, "b": 200, "c": 300}

    def step():
        plan = scheduler.schedule()
        sampled = {
            s: tokens[s] + scheduler.get(s).num_output for c in plan.chunks for s in c.sampler_ids
        }
        for seq in scheduler.update_from_output(plan, sampled):
            scheduler.release(seq.seq_id)
        admit_waiting(scheduler, queue)
        return plan

    c = seqs["c"][0]
    plan = step()
    # Prompt (6) and 2 answer positions fill 2 blocks each: nobody grows for 3 steps.
    for _ in range(3):
        assert plan.preempted_ids == ()
        answer = list(c.output_token_ids)
        plan = step()
    # Position 8 needs a third block for each: c, the latest arrival, goes; a and b take its.
    assert plan.preempted_ids == ("c",)
    assert "c" not in plan.request_ids and c.status is SequenceStatus.PREEMPTED
    assert {"a", "b"} <= set(plan.request_ids)
    assert c.slot is None and scheduler.pool.table("c") == () and c.num_computed == 0
    assert scheduler.preempted == [c] and scheduler.num_preemptions == 1
    assert c.output_token_ids == answer  # what it had sampled is kept
    # New arrivals wait behind a preempted request.
    late = make_sequences("late", 1, 1)
    assert not scheduler.can_admit(late)
    assert admit_or_enqueue(scheduler, queue, late, 0.0) is not Outcome.ADMITTED
    # Once a and b have finished, c resumes before "late", recomputing what it had.
    while c.status is SequenceStatus.PREEMPTED:
        assert late[0].status is SequenceStatus.WAITING  # behind c at the door
        step()
    assert seqs["a"][0].is_finished and seqs["b"][0].is_finished
    assert c.status is SequenceStatus.RUNNING and c.num_preemptions == 1
    assert c.output_token_ids == answer
    plan = scheduler.schedule()
    chunk = next(ch for ch in plan.chunks if ch.request_id == "c")
    # Its full blocks went to the prefix cache at preemption; it takes back what is left and
    # computes the rest, up to and including its last sampled token, then samples once.
    assert chunk.is_prefill and chunk.samples and chunk.end == c.num_tokens
    assert chunk.token_ids == tuple(c.all_token_ids[chunk.start : chunk.end])
    before = c.num_output
    scheduler.update_from_output(plan, {s: 7 for ch in plan.chunks for s in ch.sampler_ids})
    assert c.num_output == before + 1  # one new token, none sampled twice


def test_the_oldest_request_is_never_preempted_and_can_take_the_whole_pool() -> None:
    scheduler = partial_scheduler(num_blocks=8, reserve_tokens=1, max_num_seqs=4)
    for index, name in enumerate("abcd"):
        assert admit(scheduler, name, 4, 28, index) is not None  # 2 blocks each: the pool
    oldest = scheduler.get("a")
    preempted: list[str] = []
    while not oldest.is_finished:
        plan = scheduler.schedule()
        assert "a" in plan.request_ids and "a" not in plan.preempted_ids
        preempted += plan.preempted_ids
        scheduler.update(plan)
    # Youngest first: d, then c, then b, as a grew into their blocks.
    assert preempted[:3] == ["d", "c", "b"]
    assert len(scheduler.pool.table("a")) == 8 and oldest.num_output == 28
    scheduler.release("a")
    queue = AdmissionQueue(max_waiters=1, timeout=1e9, max_overtakes=0)
    admit_waiting(scheduler, queue)
    resumed = [seq.seq_id for seq in scheduler.running]
    left = [seq.seq_id for seq in scheduler.preempted]
    assert resumed and resumed + left == ["b", "c", "d"]  # in order, while they fit


def test_n_answers_are_preempted_and_resumed_together() -> None:
    scheduler = partial_scheduler(num_blocks=12, reserve_tokens=1, max_num_seqs=4)
    assert admit(scheduler, "old", 4, 40, 0) is not None
    group = make_sequences("pair", 4, 20, Prompt(n=2), arrival=1)
    assert scheduler.admit(group)
    while group[0].status is SequenceStatus.RUNNING:
        plan = scheduler.schedule()
        scheduler.update(plan)
    assert plan.preempted_ids == ("pair", "pair#1")
    assert all(seq.status is SequenceStatus.PREEMPTED for seq in group)
    assert scheduler.num_free_slots == 3
    # Releasing one of them (its client went away) leaves the other in line.
    group[1].status = SequenceStatus.FINISHED_CANCELLED
    assert scheduler.release("pair#1")
    assert scheduler.preempted == [group[0]]
    assert scheduler.release("pair") and scheduler.preempted == []
    assert scheduler.kv.check_whole()


def test_a_request_without_max_tokens_gets_the_context_under_partial_admission() -> None:
    scheduler = partial_scheduler(num_blocks=16, reserve_tokens=4, max_model_len=64)
    budget = scheduler.check(10, None)
    assert budget == 54
    seq = admit(scheduler, "a", 10, budget, 0)
    assert len(scheduler.pool.table("a")) == 4  # 14 positions reserved, not 64
    # n answers share the pool: each budget is what n of them leave, each counting the prompt
    # (answers preempted after their fork may resume on separate copies of it).
    assert scheduler.check(10, None, n=2) == 4 * (16 // 2) - 10
    assert seq is not None


def test_n_answers_must_fit_the_pool_together_under_both_admissions() -> None:
    # 10 + 5 positions: 4 blocks, 2 of them the prompt's full ones.
    for admission, fits in (("reserve", 2 + 2 * 2), ("partial", 2 * 4)):
        scheduler = make_scheduler(admission=admission, num_blocks=fits, max_num_seqs=4)
        assert scheduler.check(10, 5, n=2) == 5
        with pytest.raises(Infeasible) as refused:
            make_scheduler(admission=admission, num_blocks=fits - 1).check(10, 5, n=2)
        assert refused.value.param == "n"


def test_unknown_admission_is_refused() -> None:
    with pytest.raises(ValueError):
        SchedulerConfig(admission="slot-only")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        SchedulerConfig(reserve_tokens=0)
