"""The simulator drives the real core Scheduler: the default workload's five stories, frames
that obey the engine's rules, a config change in core that changes the run, and termination
(a stuck pool is reported, never a hang)."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.core import scheduler as core_scheduler
from kvserve.sim import (
    CONTINUOUS_RESERVE,
    CONTINUOUS_SLOT_ONLY,
    DEFAULT_WORKLOAD,
    PARTIAL_PREEMPT,
    SCENARIOS,
    RequestSpec,
    Scenario,
    SimulationResult,
    Workload,
    format_table,
    load_workload,
    simulate,
)
from kvserve.sim.simulator import QUEUE_REASONS, default_max_steps


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@pytest.fixture(scope="module")
def runs() -> dict[str, SimulationResult]:
    return {scenario.name: simulate(DEFAULT_WORKLOAD, scenario) for scenario in SCENARIOS}


def check_frames(result: SimulationResult) -> None:
    """Rules every step must obey, read off the frames alone."""
    workload = result.workload
    config = result.config
    held: dict[str, int] = {}
    previous_resuming: tuple[str, ...] = ()
    for index, frame in enumerate(result.frames):
        assert frame.step == index
        assert len(frame.slots) == workload.num_slots
        assert len(frame.block_owners) == workload.num_blocks
        assert frame.num_rows <= config.max_num_batched_tokens
        kinds = [row.is_prefill for row in frame.rows]
        assert kinds == sorted(kinds, reverse=True)  # prefill chunks before decode rows
        running = {slot.request_id: slot for slot in frame.slots if slot is not None}
        assert set(frame.queued_ids).isdisjoint(running)
        assert len(frame.queue_reasons) == len(frame.queued_ids)
        assert set(frame.queue_reasons) <= set(QUEUE_REASONS)
        planned = [row.request_id for row in frame.rows]
        assert len(planned) == len(set(planned))
        assert sorted(planned + list(frame.stalled_ids)) == sorted(running)
        for row in frame.rows:
            assert frame.slots[row.slot] is not None
            assert frame.slots[row.slot].request_id == row.request_id
            if row.is_prefill:
                assert 1 <= row.num_tokens <= config.prefill_chunk
            else:
                assert row.num_tokens == 1 and row.samples
        for block, refs in enumerate(frame.block_refs):
            # A block's count is the number of running requests whose table holds it.
            assert refs == sum(block in slot.block_ids for slot in running.values())
        for request_id, slot in running.items():
            blocks = list(slot.block_ids)
            assert all(frame.block_owners[b] is not None for b in blocks)
            # Written positions live in the request's blocks and nowhere else.
            assert sum(frame.block_fill[b] for b in blocks) == slot.num_computed
            assert len(blocks) * workload.block_size >= slot.num_computed
            spec = next(r for r in workload.requests if r.request_id == request_id)
            growth = [frame.block_growth[b] for b in blocks if frame.block_owners[b] == request_id]
            if result.scenario.policy == "slot-only":
                assert all(growth)  # nothing is reserved: every block was taken as it grew
            elif config.admission == "reserve":
                assert len(blocks) == ceil_div(
                    spec.num_prompt_tokens + spec.budget, workload.block_size
                )
                assert not any(growth)
            else:
                # Reserved: the prompt and the first answer positions (after a preemption: all
                # it had, and the first positions of the rest); then it grows one block at a time.
                assert slot.num_reserved_blocks <= ceil_div(
                    spec.num_prompt_tokens + spec.budget, workload.block_size
                )
                assert len(blocks) * workload.block_size <= max(
                    slot.num_reserved_blocks * workload.block_size,
                    slot.num_computed + 1 + workload.block_size - 1,
                )
            # Blocks are never taken away from a running request (a preempted one gives back
            # all of them and starts afresh when it resumes).
            assert len(blocks) >= held.get(request_id, 0)
            held[request_id] = len(blocks)
        for request_id in frame.preempted_ids:
            assert request_id not in running and request_id in frame.resuming_ids
            held.pop(request_id, None)
        for request_id in frame.resuming_ids:
            assert request_id not in running and request_id not in frame.queued_ids
        still_waiting = set(previous_resuming) - set(frame.resumed_ids)
        if still_waiting:
            # Nobody new is admitted while a preempted request waits to resume.
            assert set(frame.queue_reasons) <= {"preempted", "batch"}
            assert frame.admitted_ids == ()
        previous_resuming = frame.resuming_ids
        for block, owner in enumerate(frame.block_owners):
            if owner is None and not frame.block_cached[block]:
                assert frame.block_fill[block] == 0
            if owner is None:
                assert frame.block_refs[block] == 0
        for request_id in frame.returned_ids:
            slot = running[request_id]
            assert slot.num_output == slot.answer_length
            del held[request_id]


def test_reservation_returns_all_seven_requests(runs: dict[str, SimulationResult]) -> None:
    result = runs["reserve"]
    check_frames(result)
    assert len(result.requests) == 7
    assert [outcome.status for outcome in result.requests] == ["returned"] * 7
    assert result.stuck_step is None and not any(frame.stuck for frame in result.frames)
    last = result.frames[-1]
    assert last.returned_ids and last.queued_ids == ()
    # r1: 15 prompt tokens in chunks of 8 -> its first token comes from the second step, and
    # it holds blocks for 15 + 8 positions from the first.
    r1 = result.outcome("r1")
    assert r1.admitted_step == 0 and r1.first_token_step == 1 and r1.time_to_first_token == 2
    assert result.frames[0].block_owners.count("r1") == ceil_div(15 + 8, 4)


def test_reservation_makes_a_request_wait_for_blocks_not_a_slot(
    runs: dict[str, SimulationResult],
) -> None:
    result = runs["reserve"]
    blocked = [
        (frame.step, request_id)
        for frame in result.frames
        for request_id, reason in zip(frame.queued_ids, frame.queue_reasons, strict=True)
        if reason == "blocks"
    ]
    assert blocked
    for step, _ in blocked:
        assert None in result.frames[step].slots  # a slot was free all along


def test_slot_only_admission_gets_stuck_and_names_the_step(
    runs: dict[str, SimulationResult],
) -> None:
    result = runs["slot-only"]
    check_frames(result)
    assert result.stuck_step is not None
    assert result.stuck_reason is not None and f"step {result.stuck_step}" in result.stuck_reason
    stuck_frame = result.frames[result.stuck_step]
    assert stuck_frame.stuck and stuck_frame.rows == ()
    assert None not in stuck_frame.block_owners  # the pool is exhausted
    running = [slot.request_id for slot in stuck_frame.slots if slot is not None]
    assert running and sorted(stuck_frame.stalled_ids) == sorted(running)
    for slot in stuck_frame.slots:
        assert slot is not None
        # Every written block is full: growing by one position needs a new block.
        assert slot.num_computed % DEFAULT_WORKLOAD.block_size == 0
    # Earlier steps all made progress; the run stopped by detection, not by the step limit.
    assert not any(frame.stuck for frame in result.frames[: result.stuck_step])
    assert result.num_steps < default_max_steps(DEFAULT_WORKLOAD)
    statuses = {outcome.request_id: outcome.status for outcome in result.requests}
    assert "stuck" in statuses.values() and "returned" in statuses.values()
    for outcome in result.requests:
        if outcome.status == "stuck":
            assert outcome.reason and outcome.returned_step is None
    table = format_table(result)
    assert f"stuck at step {result.stuck_step}" in table
    for outcome in result.requests:
        if outcome.status == "stuck":
            assert any(
                line.split()[0] == outcome.request_id and "stuck" in line and outcome.reason in line
                for line in table.splitlines()
                if line.strip()
            )


def test_slot_only_stays_stuck_given_more_steps() -> None:
    # Taking steps after the last arrival changes nothing: the detection is not premature.
    late = RequestSpec("r8", arrival_step=40, num_prompt_tokens=2, answer_length=1)
    workload = replace(DEFAULT_WORKLOAD, requests=(*DEFAULT_WORKLOAD.requests, late))
    result = simulate(workload, CONTINUOUS_SLOT_ONLY)
    first = result.stuck_step
    assert first is not None and result.num_steps == 41
    frozen = result.frames[first]
    for frame in result.frames[first:]:
        assert frame.stuck and frame.block_owners == frozen.block_owners
        assert frame.block_fill == frozen.block_fill
    assert result.outcome("r8").status == "stuck"
    assert result.frames[-1].queued_ids[-1] == "r8"


def test_request_level_batching_delays_requests_that_arrive_while_a_batch_runs(
    runs: dict[str, SimulationResult],
) -> None:
    batched, continuous = runs["request"], runs["reserve"]
    check_frames(batched)
    assert [outcome.status for outcome in batched.requests] == ["returned"] * 7
    during = [outcome for outcome in batched.requests if outcome.arrived_during_batch]
    assert len(during) >= 3
    for outcome in during:
        other = continuous.outcome(outcome.request_id)
        assert outcome.first_token_step > other.first_token_step
        assert outcome.time_to_first_token > other.time_to_first_token
        # It really arrived while others ran that had been admitted before it came.
        arrival = batched.frames[outcome.arrival_step]
        earlier = [
            slot.request_id
            for slot in arrival.slots
            if slot is not None and batched.outcome(slot.request_id).admitted_step < arrival.step
        ]
        assert earlier and outcome.admitted_step > outcome.arrival_step
    for outcome in batched.requests:
        if not outcome.arrived_during_batch:
            assert outcome.admitted_step == outcome.arrival_step
    # Nobody joins a batch once it has run a step: each admission happens at a step where
    # nothing from the previous step is still running.
    for previous, frame in zip(batched.frames, batched.frames[1:], strict=False):
        if frame.admitted_ids:
            still = {s.request_id for s in previous.slots if s is not None}
            assert still <= set(previous.returned_ids)
    table = format_table(batched)
    flagged = {
        line.split()[0] for line in table.splitlines() if "arrived while a batch ran" in line
    }
    assert flagged == {outcome.request_id for outcome in during}


def test_the_simulation_calls_the_core_scheduler(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    original = core_scheduler.Scheduler.schedule

    def spy(self: core_scheduler.Scheduler):  # type: ignore[no-untyped-def]
        plan = original(self)
        calls.append(plan.step)
        return plan

    monkeypatch.setattr(core_scheduler.Scheduler, "schedule", spy)
    result = simulate(DEFAULT_WORKLOAD, CONTINUOUS_RESERVE)
    assert calls == list(range(result.num_steps))


def test_a_rule_changed_in_the_core_config_changes_the_simulation() -> None:
    config = CONTINUOUS_RESERVE.scheduler_config(DEFAULT_WORKLOAD)
    baseline = simulate(DEFAULT_WORKLOAD, CONTINUOUS_RESERVE)
    assert baseline.stuck_step is None

    partial = simulate(
        DEFAULT_WORKLOAD, CONTINUOUS_RESERVE, config=replace(config, admission="partial")
    )
    assert partial.frames == runs_of(PARTIAL_PREEMPT).frames
    assert partial.num_steps < baseline.num_steps

    # Reserving more of the answer at admission leaves no room to preempt anyone here.
    generous = simulate(
        DEFAULT_WORKLOAD,
        PARTIAL_PREEMPT,
        config=replace(PARTIAL_PREEMPT.scheduler_config(DEFAULT_WORKLOAD), reserve_tokens=4),
    )
    assert not any(frame.preempted_ids for frame in generous.frames)
    assert any(frame.preempted_ids for frame in partial.frames)

    small_chunks = simulate(
        DEFAULT_WORKLOAD, CONTINUOUS_RESERVE, config=replace(config, prefill_chunk=3)
    )
    sizes = {row.num_tokens for frame in small_chunks.frames for row in frame.rows}
    assert max(sizes) == 3
    # r1's 15 prompt tokens now take five steps instead of two.
    assert small_chunks.outcome("r1").first_token_step == 4
    assert baseline.outcome("r1").first_token_step == 1


def test_a_scenario_is_nothing_but_its_scheduler_config() -> None:
    custom = Scenario("custom", "custom", policy="slot-only")
    ours = simulate(DEFAULT_WORKLOAD, custom)
    named = simulate(DEFAULT_WORKLOAD, CONTINUOUS_SLOT_ONLY)
    assert ours.frames == named.frames and ours.requests == named.requests


def runs_of(scenario: Scenario) -> SimulationResult:
    return simulate(DEFAULT_WORKLOAD, scenario)


def test_a_policy_changed_in_the_scenario_changes_the_simulation() -> None:
    baseline = simulate(DEFAULT_WORKLOAD, CONTINUOUS_RESERVE)
    slot_only = simulate(DEFAULT_WORKLOAD, replace(CONTINUOUS_RESERVE, policy="slot-only"))
    assert slot_only.stuck_step is not None
    assert any(outcome.status == "stuck" for outcome in slot_only.requests)
    batched = simulate(DEFAULT_WORKLOAD, replace(CONTINUOUS_RESERVE, policy="request"))
    assert any(outcome.arrived_during_batch for outcome in batched.requests)
    assert batched.num_steps > baseline.num_steps


def test_partial_reservation_preempts_the_latest_arrival_and_every_request_returns(
    runs: dict[str, SimulationResult],
) -> None:
    partial, reserve = runs["partial"], runs["reserve"]
    check_frames(partial)
    assert [outcome.status for outcome in partial.requests] == ["returned"] * 7
    assert partial.stuck_step is None and partial.num_steps < reserve.num_steps
    preemptions = [
        (frame.step, frame.preempted_ids) for frame in partial.frames if frame.preempted_ids
    ]
    assert preemptions == [(12, ("r7",))]
    step = 12
    before = partial.frames[step - 1]
    running = sorted(
        (slot for slot in before.slots if slot is not None),
        key=lambda slot: partial.outcome(slot.request_id).arrival_step,
    )
    # The victim is the latest arrival; the oldest running request is never preempted.
    assert running[-1].request_id == "r7" and running[0].request_id != "r7"
    # r5 needed a block: it grew into one r7 held, and got its row.
    frame = partial.frames[step]
    assert "r5" in [row.request_id for row in frame.rows]
    assert frame.resuming_ids == ("r7",) and "r7" not in frame.block_owners
    assert any(frame.block_growth)
    # It resumes at the next admission round, recomputing its prompt and the tokens it had,
    # and the chunk that completes them samples its next token.
    resumed = partial.frames[step + 1]
    assert resumed.resumed_ids == ("r7",)
    r7_before = next(s for s in before.slots if s is not None and s.request_id == "r7")
    row = next(row for row in resumed.rows if row.request_id == "r7")
    assert row.is_prefill and row.start == 0 and row.samples
    assert row.num_tokens == r7_before.num_prompt_tokens + r7_before.num_output
    r7 = next(s for s in resumed.slots if s is not None and s.request_id == "r7")
    assert r7.num_output == r7_before.num_output + 1 and r7.num_preemptions == 1
    # Admission reserves less, so r7 gets in four steps sooner than under full reservation.
    assert partial.outcome("r7").admitted_step < reserve.outcome("r7").admitted_step
    assert partial.outcome("r7").preempted_steps == (12,)
    assert "preempted at step 12" in format_table(partial)


def test_times_count_steps_from_arrival(runs: dict[str, SimulationResult]) -> None:
    for result in runs.values():
        for outcome in result.requests:
            first_events = [
                f.step for f in result.frames if outcome.request_id in f.first_token_ids
            ]
            returned_events = [
                f.step for f in result.frames if outcome.request_id in f.returned_ids
            ]
            admitted_events = [
                f.step for f in result.frames if outcome.request_id in f.admitted_ids
            ]
            assert first_events == (
                [] if outcome.first_token_step is None else [outcome.first_token_step]
            )
            assert returned_events == (
                [] if outcome.returned_step is None else [outcome.returned_step]
            )
            assert admitted_events == (
                [] if outcome.admitted_step is None else [outcome.admitted_step]
            )
            if outcome.returned_step is not None:
                # A token sampled in step s exists after s: one step counts as one.
                assert outcome.time_to_return == outcome.returned_step - outcome.arrival_step + 1
                assert outcome.arrival_step <= outcome.admitted_step <= outcome.first_token_step
                assert outcome.first_token_step <= outcome.returned_step


def test_an_impossible_request_is_refused_and_the_rest_run() -> None:
    workload = Workload(
        requests=(
            RequestSpec("big", arrival_step=0, num_prompt_tokens=30, answer_length=4),
            RequestSpec("ok", arrival_step=1, num_prompt_tokens=5, answer_length=3),
        ),
        num_blocks=6,
        block_size=4,
    )
    result = simulate(workload, CONTINUOUS_RESERVE)
    big = result.outcome("big")
    assert big.status == "refused" and big.reason and "24 tokens" in big.reason
    assert result.outcome("ok").status == "returned"
    assert "big" in result.frames[0].refused_ids


def test_the_step_limit_reports_unfinished_requests(runs: dict[str, SimulationResult]) -> None:
    full = runs["reserve"]
    result = simulate(DEFAULT_WORKLOAD, CONTINUOUS_RESERVE, max_steps=8)
    assert result.num_steps == 8 and result.stuck_step is None
    assert result.frames == full.frames[:8]
    for outcome in result.requests:
        returned_step = full.outcome(outcome.request_id).returned_step
        if returned_step < 8:
            assert outcome.status == "returned"
        else:
            assert outcome.status == "unfinished" and "step limit" in outcome.reason
    assert {outcome.status for outcome in result.requests} == {"returned", "unfinished"}


def test_prefix_caching_lets_the_later_requests_start_sooner(
    runs: dict[str, SimulationResult],
) -> None:
    cached, reserve = runs["prefix"], runs["reserve"]
    check_frames(cached)
    assert [outcome.status for outcome in cached.requests] == ["returned"] * 7
    # r5 and r6 take r4's two blocks of the common prefix instead of computing them.
    for request_id in ("r5", "r6"):
        slots = [
            slot
            for frame in cached.frames
            for slot in frame.slots
            if slot is not None and slot.request_id == request_id
        ]
        assert {slot.num_cached_tokens for slot in slots} == {8}
        first_chunk = next(
            row for frame in cached.frames for row in frame.rows if row.request_id == request_id
        )
        assert first_chunk.start == 8  # its prefill starts after the cached positions
        assert (
            cached.outcome(request_id).time_to_first_token
            < reserve.outcome(request_id).time_to_first_token
        )
    assert cached.outcome("r5").admitted_step < reserve.outcome("r5").admitted_step
    shared = [
        (frame.step, block)
        for frame in cached.frames
        for block, refs in enumerate(frame.block_refs)
        if refs > 1
    ]
    assert shared and all(cached.frames[step].block_cached[block] for step, block in shared)
    # Once nobody holds them, published blocks stay in the pool, cached, with their positions.
    last = cached.frames[-1]
    kept = [b for b, cached_block in enumerate(last.block_cached) if cached_block]
    assert any(last.block_refs[b] == 0 and last.block_fill[b] == 4 for b in kept)
    assert cached.num_steps < reserve.num_steps
    # Without a prefix cache the prompts' tokens change nothing: every other scenario runs as
    # if no request shared anything.
    plain = replace(
        DEFAULT_WORKLOAD,
        requests=tuple(replace(r, shared_prefix=0) for r in DEFAULT_WORKLOAD.requests),
    )
    for name in ("request", "reserve", "slot-only", "partial"):
        assert simulate(plain, runs[name].scenario).requests == runs[name].requests
        assert not any(any(frame.block_cached) for frame in runs[name].frames)


def test_workload_json_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "workload.json"
    path.write_text(json.dumps(DEFAULT_WORKLOAD.to_dict()))
    assert load_workload(path) == DEFAULT_WORKLOAD
    path.write_text(json.dumps({"requests": [{"arrival_step": 0, "num_prompt_tokens": 3}]}))
    with pytest.raises(ValueError):
        load_workload(path)  # no answer_length
    path.write_text(json.dumps({"requests": [], "num_blocks": 4}))
    with pytest.raises(ValueError):
        load_workload(path)
    path.write_text(json.dumps({**DEFAULT_WORKLOAD.to_dict(), "num_blokcs": 4}))
    with pytest.raises(ValueError, match="num_blokcs"):
        load_workload(path)


workloads = st.builds(
    lambda specs, slots, blocks, block_size, chunk, rows, reserve: Workload(
        requests=tuple(
            RequestSpec(f"r{i}", arrival, prompt, answer, shared_prefix=min(shared, prompt))
            for i, (arrival, prompt, answer, shared) in enumerate(specs)
        ),
        num_slots=slots,
        num_blocks=blocks,
        block_size=block_size,
        prefill_chunk=chunk,
        max_num_batched_tokens=rows,
        reserve_tokens=reserve,
    ),
    st.lists(
        st.tuples(st.integers(0, 12), st.integers(1, 24), st.integers(1, 12), st.integers(0, 24)),
        min_size=1,
        max_size=8,
    ),
    st.integers(1, 5),
    st.integers(1, 20),
    st.integers(1, 6),
    st.integers(1, 10),
    st.integers(1, 16),
    st.integers(1, 6),
)


@settings(max_examples=80, deadline=None)
@given(workloads)
def test_every_run_ends_returned_refused_or_reported_stuck(workload: Workload) -> None:
    for scenario in SCENARIOS:
        result = simulate(workload, scenario)
        check_frames(result)
        statuses = {outcome.status for outcome in result.requests}
        assert "unfinished" not in statuses  # the step limit was never what ended a run
        if scenario.policy != "slot-only":
            # Reservation, whole or partial with preemption, never deadlocks.
            assert result.stuck_step is None and statuses <= {"returned", "refused"}
        if result.stuck_step is not None:
            assert "stuck" in statuses and result.frames[-1].stuck
            assert None not in result.frames[-1].block_owners


def test_the_simulator_imports_no_torch() -> None:
    code = (
        "import sys\n"
        "from kvserve.cli import main\n"
        "import kvserve.sim.figure\n"
        "assert main(['simulate', '--quiet']) == 0\n"
        "print('torch' in sys.modules)\n"
    )
    root = Path(__file__).resolve().parents[2]
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "False"
