"""Whole workloads through the real Scheduler and AdmissionQueue with a fake step loop.

Each step every planned chunk "runs"; a sequence finishes when its output reaches its answer
length (an end-of-sequence token can come before max_tokens). Time is the step number.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.config import SchedulerConfig
from kvserve.core import (
    AdmissionQueue,
    BlockPool,
    Infeasible,
    Outcome,
    Scheduler,
    StepPlan,
    admit_or_enqueue,
    admit_waiting,
)


@dataclass(frozen=True)
class Job:
    request_id: str
    num_prompt_tokens: int
    max_tokens: int | None
    answer_length: int  # outputs before the sequence stops by itself (capped by its reserve)
    arrival_step: int
    cancel_step: int | None = None  # the client goes away at this step


@dataclass
class Run:
    scheduler: Scheduler
    queue: AdmissionQueue
    outcomes: dict[str, str] = field(default_factory=dict)
    num_steps: int = 0
    num_stuck_steps: int = 0
    first_stuck_step: int | None = None


def check_plan(scheduler: Scheduler, plan: StepPlan) -> None:
    """What every plan must satisfy, whatever the workload."""
    config = scheduler.config
    block_size = scheduler.pool.block_size
    order = {seq.request_id: index for index, seq in enumerate(scheduler.running)}
    assert plan.num_rows <= config.max_num_batched_tokens
    kinds = [chunk.is_prefill for chunk in plan.chunks]
    assert kinds == sorted(kinds, reverse=True)  # prefill chunks first
    for is_prefill in (True, False):
        group = [order[c.request_id] for c in plan.chunks if c.is_prefill == is_prefill]
        assert group == sorted(group)  # arrival order within each group
    planned = [chunk.request_id for chunk in plan.chunks]
    assert sorted(planned + list(plan.waiting_ids)) == sorted(order)  # nobody lost or evicted
    waiting = [order[request_id] for request_id in plan.waiting_ids]
    assert waiting == sorted(waiting)
    assert len(set(planned)) == len(planned)
    slots = [seq.slot for seq in scheduler.running]
    assert len(set(slots)) == len(slots)
    for chunk in plan.chunks:
        seq = scheduler.get(chunk.request_id)
        assert seq is not None
        assert chunk.start == seq.num_computed and chunk.slot == seq.slot
        assert len(chunk.block_ids) * block_size >= chunk.start + chunk.num_tokens
        if chunk.is_prefill:
            assert 1 <= chunk.num_tokens <= config.prefill_chunk
            assert chunk.start + chunk.num_tokens <= seq.num_prompt_tokens
            assert chunk.samples == (chunk.start + chunk.num_tokens == seq.num_prompt_tokens)
        else:
            assert chunk.num_tokens == 1 and chunk.samples
            assert seq.num_output < seq.max_tokens
    assert scheduler.pool.check_whole()
    if config.admission == "reserve":
        reserved = sum(
            scheduler.pool.blocks_for(seq.num_prompt_tokens + seq.max_tokens)
            for seq in scheduler.running
        )
        assert scheduler.pool.num_used == reserved


def run_workload(
    jobs: list[Job],
    config: SchedulerConfig,
    *,
    num_blocks: int,
    block_size: int,
    max_model_len: int,
    max_steps: int,
    timeout: float = 1e9,
    max_overtakes: int = 4,
) -> Run:
    scheduler = Scheduler(config, BlockPool(num_blocks, block_size), max_model_len)
    queue = AdmissionQueue(max_waiters=len(jobs), timeout=timeout, max_overtakes=max_overtakes)
    run = Run(scheduler, queue)
    by_id = {job.request_id: job for job in jobs}
    answer_lengths: dict[str, int] = {}
    for step in range(max_steps):
        run.num_steps = step
        now = float(step)
        for job in jobs:
            if job.arrival_step == step:
                try:
                    reserve = scheduler.check(job.num_prompt_tokens, job.max_tokens)
                except Infeasible as refused:
                    run.outcomes[job.request_id] = f"refused:{refused.param}"
                    continue
                answer_lengths[job.request_id] = min(job.answer_length, reserve)
                result = admit_or_enqueue(
                    scheduler, queue, job.request_id, job.num_prompt_tokens, reserve, now
                )
                if result is Outcome.QUEUE_FULL:
                    run.outcomes[job.request_id] = "queue-full"
            departs = job.cancel_step == step and job.request_id not in run.outcomes
            # The client may leave while queued or while running; both end the request.
            if departs and (
                queue.cancel(job.request_id) is not None or scheduler.release(job.request_id)
            ):
                run.outcomes[job.request_id] = "cancelled"
        for waiter in queue.expire(now):
            run.outcomes[waiter.request_id] = "timed-out"
        admit_waiting(scheduler, queue)
        plan = scheduler.schedule()
        check_plan(scheduler, plan)
        if scheduler.is_stuck(plan):
            run.num_stuck_steps += 1
            if run.first_stuck_step is None:
                run.first_stuck_step = step
        scheduler.update(plan)
        for chunk in plan.chunks:
            seq = scheduler.get(chunk.request_id)
            if seq is not None and seq.num_output >= answer_lengths[seq.request_id]:
                assert scheduler.release(seq.request_id)
                run.outcomes[seq.request_id] = "finished"
        if len(run.outcomes) == len(by_id):
            break
    return run


# -- reservation against slot-only admission -----------------------------------------------------

# The design text's scaled-down figure: 4 positions per block, prefill chunks of 8, 12 rows per
# step, four slots. Eight blocks hold two whole answers but four prompts.
FIGURE = {"max_num_seqs": 4, "prefill_chunk": 8, "max_num_batched_tokens": 12}
FIGURE_JOBS = [Job(f"r{index}", 6, 8, 8, arrival_step=0) for index in range(4)]


def test_slot_only_admission_exhausts_the_pool_and_stops_making_progress() -> None:
    run = run_workload(
        FIGURE_JOBS,
        SchedulerConfig(admission="slot-only", **FIGURE),
        num_blocks=8,
        block_size=4,
        max_model_len=64,
        max_steps=60,
    )
    scheduler = run.scheduler
    assert run.first_stuck_step is not None
    assert run.num_stuck_steps == run.num_steps - run.first_stuck_step + 1  # never recovers
    assert run.outcomes == {}  # nobody finished
    assert scheduler.num_running == 4 and scheduler.pool.num_free == 0
    frozen = [(s.num_computed, s.num_output) for s in scheduler.running]
    plan = scheduler.schedule()
    assert scheduler.is_stuck(plan) and set(plan.waiting_ids) == {j.request_id for j in FIGURE_JOBS}
    scheduler.update(plan)
    assert [(s.num_computed, s.num_output) for s in scheduler.running] == frozen


def test_reservation_completes_the_same_workload() -> None:
    run = run_workload(
        FIGURE_JOBS,
        SchedulerConfig(admission="reserve", **FIGURE),
        num_blocks=8,
        block_size=4,
        max_model_len=64,
        max_steps=60,
    )
    assert run.num_stuck_steps == 0
    assert run.outcomes == {job.request_id: "finished" for job in FIGURE_JOBS}
    assert run.scheduler.num_running == 0 and run.scheduler.pool.num_free == 8
    assert run.scheduler.pool.check_whole()


# -- random workloads ----------------------------------------------------------------------------


@st.composite
def workloads(draw: st.DrawFn, with_departures: bool) -> tuple:
    block_size = draw(st.integers(min_value=1, max_value=8))
    num_blocks = draw(st.integers(min_value=1, max_value=40))
    max_model_len = draw(st.integers(min_value=2, max_value=64))
    config = SchedulerConfig(
        max_num_seqs=draw(st.integers(min_value=1, max_value=6)),
        max_num_batched_tokens=draw(st.integers(min_value=1, max_value=24)),
        prefill_chunk=draw(st.integers(min_value=1, max_value=16)),
        batching=draw(st.sampled_from(["continuous", "request"])),
    )
    jobs = []
    for index in range(draw(st.integers(min_value=1, max_value=10))):
        jobs.append(
            Job(
                request_id=f"r{index}",
                num_prompt_tokens=draw(st.integers(min_value=1, max_value=40)),
                max_tokens=draw(st.none() | st.integers(min_value=1, max_value=30)),
                answer_length=draw(st.integers(min_value=1, max_value=30)),
                arrival_step=draw(st.integers(min_value=0, max_value=20)),
                cancel_step=(
                    draw(st.none() | st.integers(min_value=0, max_value=60))
                    if with_departures
                    else None
                ),
            )
        )
    max_overtakes = draw(st.integers(min_value=0, max_value=4))
    return config, num_blocks, block_size, max_model_len, jobs, max_overtakes


def expected_refusal(job: Job, num_blocks: int, block_size: int, max_model_len: int) -> str | None:
    limit = min(max_model_len, num_blocks * block_size)
    if job.num_prompt_tokens >= limit:
        return "refused:prompt"
    if job.max_tokens is not None and job.num_prompt_tokens + job.max_tokens > limit:
        return "refused:max_tokens"
    return None


@settings(max_examples=150, deadline=None)
@given(workloads(with_departures=False))
def test_reservation_always_completes_random_workloads(workload: tuple) -> None:
    config, num_blocks, block_size, max_model_len, jobs, max_overtakes = workload
    # Every non-stuck step computes a row; a step with nothing running only waits for arrivals.
    max_steps = sum(job.num_prompt_tokens + job.answer_length for job in jobs) + 22
    run = run_workload(
        jobs,
        config,
        num_blocks=num_blocks,
        block_size=block_size,
        max_model_len=max_model_len,
        max_steps=max_steps,
        max_overtakes=max_overtakes,
    )
    assert run.num_stuck_steps == 0
    for job in jobs:
        refusal = expected_refusal(job, num_blocks, block_size, max_model_len)
        assert run.outcomes.get(job.request_id) == (refusal or "finished")
    assert run.scheduler.num_running == 0 and len(run.queue) == 0
    assert run.scheduler.pool.num_free == num_blocks and run.scheduler.pool.check_whole()
    assert run.scheduler.num_free_slots == config.max_num_seqs


@settings(max_examples=150, deadline=None)
@given(workloads(with_departures=True), st.integers(min_value=1, max_value=15))
def test_any_mix_of_finish_cancel_and_timeout_leaves_the_pool_whole(
    workload: tuple, timeout: int
) -> None:
    config, num_blocks, block_size, max_model_len, jobs, max_overtakes = workload
    max_steps = sum(job.num_prompt_tokens + job.answer_length for job in jobs) + 62
    run = run_workload(
        jobs,
        config,
        num_blocks=num_blocks,
        block_size=block_size,
        max_model_len=max_model_len,
        max_steps=max_steps,
        timeout=float(timeout),
        max_overtakes=max_overtakes,
    )
    assert run.num_stuck_steps == 0
    assert set(run.outcomes) == {job.request_id for job in jobs}  # one outcome each
    assert run.scheduler.num_running == 0 and len(run.queue) == 0
    assert run.scheduler.pool.num_free == num_blocks and run.scheduler.pool.check_whole()
    assert run.scheduler.num_free_slots == config.max_num_seqs
    assert run.scheduler.pool.owners() == ()
