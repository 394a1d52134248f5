"""Whole workloads through the real Scheduler, KV manager and AdmissionQueue with a fake step loop.

Each step every planned chunk "runs"; a sequence finishes when it samples its end-of-sequence
token (at its answer length) or spends its budget. Time is the step number. The property tests
draw arrivals, prompt and answer lengths, pool sizes, cancels, n > 1 and shared prefixes, and
check under both admissions: every admitted request finishes or is cancelled by its client, no
block is leaked, the pool is never overdrawn, the oldest running request is never preempted,
and nobody waits behind more overtakes than the queue allows.
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
    KVManager,
    Outcome,
    Prompt,
    Scheduler,
    Sequence,
    SequenceStatus,
    StepPlan,
    admit_or_enqueue,
    admit_waiting,
    make_sequences,
)
from kvserve.sim.policies import SlotOnlyScheduler

EOS = 0


@dataclass(frozen=True)
class Job:
    request_id: str
    num_prompt_tokens: int
    max_tokens: int | None
    answer_length: int  # it samples its end-of-sequence token here (unless its budget ends first)
    arrival_step: int
    cancel_step: int | None = None  # the client goes away at this step
    n: int = 1
    prefix: int = 0  # which shared prefix its prompt starts with (0: none)
    salt: str | None = None

    def prompt_token_ids(self) -> tuple[int, ...]:
        shared = {0: (), 1: tuple(range(100, 109)), 2: (7,) * 13}[self.prefix]
        own = tuple(1000 + 37 * int(self.request_id[1:]) + i for i in range(self.num_prompt_tokens))
        return (shared + own)[: self.num_prompt_tokens]


@dataclass
class Run:
    scheduler: Scheduler
    queue: AdmissionQueue
    outcomes: dict[str, str] = field(default_factory=dict)
    num_steps: int = 0
    num_stuck_steps: int = 0
    first_stuck_step: int | None = None
    # request id -> later arrivals admitted while it was first in line at the door
    overtakes: dict[str, int] = field(default_factory=dict)


def check_plan(scheduler: Scheduler, plan: StepPlan, oldest: str | None) -> None:
    """What every plan must satisfy, whatever the workload. `oldest`: the request that was
    the oldest running one when the plan was made."""
    config = scheduler.config
    pool = scheduler.pool
    block_size = pool.block_size
    order = {seq.seq_id: index for index, seq in enumerate(scheduler.running)}
    assert plan.num_rows <= config.max_num_batched_tokens
    kinds = [chunk.is_prefill for chunk in plan.chunks]
    assert kinds == sorted(kinds, reverse=True)  # prefill chunks first
    for is_prefill in (True, False):
        group = [order[c.request_id] for c in plan.chunks if c.is_prefill == is_prefill]
        assert group == sorted(group)  # arrival order within each group
    planned = [chunk.request_id for chunk in plan.chunks]
    assert sorted(planned + list(plan.waiting_ids)) == sorted(order)  # nobody lost
    waiting = [order[seq_id] for seq_id in plan.waiting_ids]
    assert waiting == sorted(waiting)
    assert len(set(planned)) == len(planned)
    for seq_id in plan.preempted_ids:
        seq = scheduler.get(seq_id)
        assert seq_id not in order and seq is not None and seq.status is SequenceStatus.PREEMPTED
        assert seq.request_id != oldest  # the oldest running request is never preempted
        assert pool.table(seq_id) == ()
    if oldest is not None and plan.preempted_ids:
        assert any(scheduler.get(s).request_id == oldest for s in order)
    slots = [seq.slot for seq in scheduler.running]
    assert len(set(slots)) == len(slots) and None not in slots
    for chunk in plan.chunks:
        seq = scheduler.get(chunk.request_id)
        assert seq is not None
        assert chunk.start == seq.num_computed and chunk.slot == seq.slot
        assert len(chunk.block_ids) * block_size >= chunk.end
        assert chunk.end <= seq.num_tokens
        assert chunk.samples == (chunk.end == seq.num_tokens)
        if chunk.is_prefill:
            assert 1 <= chunk.num_tokens <= config.prefill_chunk
        else:
            assert chunk.num_tokens == 1 and chunk.samples
            assert seq.num_output < seq.max_tokens
        if chunk.token_ids:
            assert chunk.token_ids == tuple(seq.all_token_ids[chunk.start : chunk.end])
    # Blocks held never exceed the pool, and every reference is accounted for.
    assert pool.check_whole() and scheduler.kv.check_whole()
    assert pool.num_used <= pool.num_blocks
    kv = scheduler.kv
    if kv.window is not None:
        # Behind each chunk's window only holes; never more than the window's blocks held.
        for chunk in plan.chunks:
            assert pool.num_holes(chunk.request_id) <= kv.first_needed_block(chunk.start)
            if not chunk.is_speculative:
                assert kv.num_held(chunk.request_id) <= scheduler.window_blocks
        return
    if config.admission == "reserve" and type(scheduler) is Scheduler:
        reserved = sum(
            pool.blocks_for(seq.num_prompt_tokens + seq.max_tokens) for seq in scheduler.running
        )
        shared = sum(pool.refcount(b) - 1 for b in range(pool.num_blocks) if pool.refcount(b))
        assert pool.num_used == reserved - shared
        assert plan.preempted_ids == ()


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
    caching: bool = False,
    policy: type[Scheduler] = Scheduler,
    window: int | None = None,
) -> Run:
    pool = BlockPool(num_blocks, block_size, prefix_caching=caching)
    scheduler = policy(config, KVManager(pool, window=window), max_model_len)
    queue = AdmissionQueue(max_waiters=len(jobs), timeout=timeout, max_overtakes=max_overtakes)
    run = Run(scheduler, queue)
    by_id = {job.request_id: job for job in jobs}
    requests: dict[str, list[Sequence]] = {}
    for step in range(max_steps):
        run.num_steps = step
        now = float(step)
        for job in jobs:
            if job.arrival_step == step:
                try:
                    budget = scheduler.check(job.num_prompt_tokens, job.max_tokens, job.n)
                except Infeasible as refused:
                    run.outcomes[job.request_id] = f"refused:{refused.param}"
                    continue
                prompt = Prompt(job.prompt_token_ids(), job.salt, job.n)
                seqs = make_sequences(
                    job.request_id,
                    job.num_prompt_tokens,
                    budget,
                    prompt if caching else Prompt(n=job.n),
                    stop_token_ids=frozenset({EOS}),
                )
                requests[job.request_id] = seqs
                result = admit_or_enqueue(scheduler, queue, seqs, now)
                if result is Outcome.QUEUE_FULL:
                    run.outcomes[job.request_id] = "queue-full"
            departs = job.cancel_step == step and job.request_id not in run.outcomes
            # The client may leave while queued, running or preempted; each ends the request.
            if departs and job.request_id in requests:
                queue.cancel(job.request_id)
                for seq in requests[job.request_id]:
                    if not seq.is_finished:
                        seq.status = SequenceStatus.FINISHED_CANCELLED
                    scheduler.release(seq.seq_id)
                run.outcomes[job.request_id] = "cancelled"
        for waiter in queue.expire(now):
            run.outcomes[waiter.request_id] = "timed-out"
            for seq in waiter.sequences:
                seq.status = SequenceStatus.FINISHED_QUEUE_TIMEOUT
        head = queue.waiters[0] if queue.waiters and not scheduler.num_preempted else None
        preempted_before = scheduler.num_preempted
        admitted = admit_waiting(scheduler, queue)
        if head is not None:
            later = sum(waiter.arrival > head.arrival for waiter in admitted)
            if head not in admitted:
                run.overtakes[head.request_id] = run.overtakes.get(head.request_id, 0) + later
        if scheduler.num_preempted:
            assert admitted == []  # nobody passes a preempted request
        if preempted_before and admitted:
            assert scheduler.num_preempted == 0
        oldest = scheduler.running[0].request_id if scheduler.running else None
        plan = scheduler.schedule()
        check_plan(scheduler, plan, oldest)
        if scheduler.is_stuck(plan):
            run.num_stuck_steps += 1
            if run.first_stuck_step is None:
                run.first_stuck_step = step
        sampled = {}
        for chunk in plan.chunks:
            for seq_id in chunk.sampler_ids:
                seq = scheduler.get(seq_id)
                job = by_id[seq.request_id]
                sampled[seq_id] = EOS if seq.num_output + 1 >= job.answer_length else 5
        for seq in scheduler.update_from_output(plan, sampled):
            assert seq.finish_reason in ("stop", "length")
            assert scheduler.release(seq.seq_id)
            group = requests[seq.request_id]
            if all(s.is_finished for s in group):
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
        SchedulerConfig(**FIGURE),
        num_blocks=8,
        block_size=4,
        max_model_len=64,
        max_steps=60,
        policy=SlotOnlyScheduler,
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


def test_reservation_whole_or_partial_completes_the_same_workload() -> None:
    for admission in ("reserve", "partial"):
        run = run_workload(
            FIGURE_JOBS,
            SchedulerConfig(admission=admission, reserve_tokens=2, **FIGURE),
            num_blocks=8,
            block_size=4,
            max_model_len=64,
            max_steps=200,
        )
        assert run.num_stuck_steps == 0
        assert run.outcomes == {job.request_id: "finished" for job in FIGURE_JOBS}
        assert run.scheduler.num_running == 0 and run.scheduler.pool.num_free == 8
        assert run.scheduler.pool.check_whole()
        # Partial admission takes all four in at once and preempts to let the oldest grow.
        assert (run.scheduler.num_preemptions > 0) == (admission == "partial")


# -- random workloads ----------------------------------------------------------------------------


@st.composite
def workloads(draw: st.DrawFn, with_departures: bool, rich: bool = False) -> tuple:
    block_size = draw(st.integers(min_value=1, max_value=8))
    num_blocks = draw(st.integers(min_value=1, max_value=40))
    max_model_len = draw(st.integers(min_value=2, max_value=64))
    config = SchedulerConfig(
        max_num_seqs=draw(st.integers(min_value=1, max_value=6)),
        max_num_batched_tokens=draw(st.integers(min_value=1, max_value=24)),
        prefill_chunk=draw(st.integers(min_value=1, max_value=16)),
        admission=draw(st.sampled_from(["partial", "reserve"])),
        reserve_tokens=draw(st.integers(min_value=1, max_value=12)),
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
                n=draw(st.sampled_from([1, 1, 2, 3])) if rich else 1,
                prefix=draw(st.integers(0, 2)) if rich else 0,
                salt=draw(st.sampled_from([None, None, "s"])) if rich else None,
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


def max_steps_for(jobs: list[Job], slack: int) -> int:
    # Every non-stuck step computes a row; a preempted request computes its rows again, at
    # most once per older request's growth.
    rows = sum(job.n * (job.num_prompt_tokens + job.answer_length) for job in jobs)
    return rows * (1 + len(jobs)) + slack


@settings(max_examples=150, deadline=None)
@given(workloads(with_departures=False))
def test_reservation_always_completes_random_workloads(workload: tuple) -> None:
    config, num_blocks, block_size, max_model_len, jobs, max_overtakes = workload
    run = run_workload(
        jobs,
        config,
        num_blocks=num_blocks,
        block_size=block_size,
        max_model_len=max_model_len,
        max_steps=max_steps_for(jobs, 22),
        max_overtakes=max_overtakes,
    )
    assert run.num_stuck_steps == 0
    for job in jobs:
        refusal = expected_refusal(job, num_blocks, block_size, max_model_len)
        assert run.outcomes.get(job.request_id) == (refusal or "finished")
    assert run.scheduler.num_running == 0 and len(run.queue) == 0
    assert run.scheduler.pool.num_free == num_blocks and run.scheduler.pool.check_whole()
    assert run.scheduler.num_free_slots == config.max_num_seqs
    assert all(count <= max_overtakes for count in run.overtakes.values())


@settings(max_examples=150, deadline=None)
@given(workloads(with_departures=True), st.integers(min_value=1, max_value=15))
def test_any_mix_of_finish_cancel_and_timeout_leaves_the_pool_whole(
    workload: tuple, timeout: int
) -> None:
    config, num_blocks, block_size, max_model_len, jobs, max_overtakes = workload
    run = run_workload(
        jobs,
        config,
        num_blocks=num_blocks,
        block_size=block_size,
        max_model_len=max_model_len,
        max_steps=max_steps_for(jobs, 62),
        timeout=float(timeout),
        max_overtakes=max_overtakes,
    )
    assert run.num_stuck_steps == 0
    assert set(run.outcomes) == {job.request_id for job in jobs}  # one outcome each
    assert run.scheduler.num_running == 0 and len(run.queue) == 0
    assert run.scheduler.num_preempted == 0
    assert run.scheduler.pool.num_free == num_blocks and run.scheduler.pool.check_whole()
    assert run.scheduler.num_free_slots == config.max_num_seqs
    assert run.scheduler.pool.owners() == ()


@st.composite
def tight_workloads(draw: st.DrawFn) -> tuple:
    """Workloads that outgrow their pool: long answers, mostly without max_tokens, more
    requests than the pool holds at their full length, a first part of 1 to 8 positions."""
    block_size = draw(st.integers(min_value=1, max_value=4))
    max_model_len = draw(st.integers(min_value=8, max_value=48))
    context_blocks = -(-max_model_len // block_size)
    num_blocks = draw(st.integers(min_value=context_blocks, max_value=context_blocks + 12))
    config = SchedulerConfig(
        max_num_seqs=draw(st.integers(min_value=2, max_value=6)),
        max_num_batched_tokens=draw(st.integers(min_value=1, max_value=24)),
        prefill_chunk=draw(st.integers(min_value=1, max_value=16)),
        admission="partial",
        reserve_tokens=draw(st.integers(min_value=1, max_value=8)),
    )
    jobs = [
        Job(
            request_id=f"r{index}",
            num_prompt_tokens=draw(st.integers(min_value=1, max_value=16)),
            max_tokens=draw(st.none() | st.none() | st.integers(min_value=1, max_value=40)),
            answer_length=draw(st.integers(min_value=1, max_value=40)),
            arrival_step=draw(st.integers(min_value=0, max_value=12)),
            cancel_step=draw(st.none() | st.none() | st.integers(min_value=0, max_value=80)),
            n=draw(st.sampled_from([1, 1, 2, 3])),
            prefix=draw(st.integers(0, 2)),
            salt=draw(st.sampled_from([None, None, "s"])),
        )
        for index in range(draw(st.integers(min_value=2, max_value=10)))
    ]
    max_overtakes = draw(st.integers(min_value=0, max_value=4))
    return config, num_blocks, block_size, max_model_len, jobs, max_overtakes


def assert_admitted_requests_finish(run, jobs: list[Job]) -> None:
    """No step stood still, and every admitted request finished or was cancelled (no timeouts
    in these workloads, and the queue holds all of them)."""
    assert run.num_stuck_steps == 0
    for job in jobs:
        outcome = run.outcomes.get(job.request_id)
        assert outcome is not None and outcome.split(":")[0] in ("finished", "cancelled", "refused")
        if job.cancel_step is None and not outcome.startswith("refused"):
            assert outcome == "finished"


@settings(max_examples=200, deadline=None)
@given(tight_workloads())
def test_partial_reservation_with_preemption_finishes_every_admitted_request(
    workload: tuple,
) -> None:
    """Shared prefixes and salts (so preempted blocks are published and taken back), n > 1,
    cancels, pools smaller than the demand: nothing waits forever, nothing leaks, the oldest
    is never preempted (check_plan), no waiter is overtaken more than K times while first in
    line, and preempted requests pass before any new one."""
    config, num_blocks, block_size, max_model_len, jobs, max_overtakes = workload
    run = run_workload(
        jobs,
        config,
        num_blocks=num_blocks,
        block_size=block_size,
        max_model_len=max_model_len,
        max_steps=max_steps_for(jobs, 62),
        max_overtakes=max_overtakes,
        caching=True,
    )
    assert_admitted_requests_finish(run, jobs)
    assert run.scheduler.num_running == 0 and run.scheduler.num_preempted == 0
    assert len(run.queue) == 0
    pool = run.scheduler.pool
    assert pool.num_free == num_blocks and pool.check_whole()
    assert pool.owners() == () and pool.num_cached_free == pool.cache.num_cached_free
    assert run.scheduler.num_free_slots == config.max_num_seqs
    assert all(count <= max_overtakes for count in run.overtakes.values())


# -- sliding windows -----------------------------------------------------------------------------


def expected_windowed_refusal(
    job: Job, config: SchedulerConfig, window: int, **sizes
) -> str | None:
    """The door of a model whose every layer is windowed: the context, and the most blocks one
    sequence holds at once (the window, plus one step's rows, at the worst alignment)."""
    num_blocks, block_size, max_model_len = (
        sizes["num_blocks"], sizes["block_size"], sizes["max_model_len"]
    )  # fmt: skip
    rows = min(config.prefill_chunk, config.max_num_batched_tokens)
    window_blocks = -(-(window + rows - 2) // block_size) + 1

    def needed(positions: int) -> int:
        return min(-(-positions // block_size), window_blocks)

    if job.num_prompt_tokens >= max_model_len or needed(job.num_prompt_tokens + 1) > num_blocks:
        return "refused:prompt"
    if job.max_tokens is None:
        return None  # the rest of the context, capped by the pool unless the window fits it
    total = job.num_prompt_tokens + job.max_tokens
    if total > max_model_len or needed(total) > num_blocks:
        return "refused:max_tokens"
    return None


@settings(max_examples=150, deadline=None)
@given(workloads(with_departures=False), st.integers(min_value=1, max_value=24))
def test_windowed_requests_finish_within_their_windows(workload: tuple, window: int) -> None:
    """A model whose every layer attends to the last `window` positions: requests longer than
    the pool are served when their windows fit, each sequence holds at most its window's blocks
    (check_plan), everything finishes and the pool is whole; under "reserve" nothing is ever
    preempted (no request here shares a block with another)."""
    config, num_blocks, block_size, max_model_len, jobs, max_overtakes = workload
    sizes = dict(num_blocks=num_blocks, block_size=block_size, max_model_len=max_model_len)
    run = run_workload(
        jobs,
        config,
        max_steps=max_steps_for(jobs, 22),
        max_overtakes=max_overtakes,
        window=window,
        **sizes,
    )
    assert run.num_stuck_steps == 0
    for job in jobs:
        refusal = expected_windowed_refusal(job, config, window, **sizes)
        assert run.outcomes.get(job.request_id) == (refusal or "finished")
    if config.admission == "reserve":
        assert run.scheduler.num_preemptions == 0
    kv = run.scheduler.kv
    assert run.scheduler.num_running == 0 and len(run.queue) == 0
    assert kv.pool.num_free == num_blocks and kv.num_spare == 0 and kv.check_whole()


@settings(max_examples=150, deadline=None)
@given(tight_workloads(), st.integers(min_value=1, max_value=24), st.booleans())
def test_windowed_workloads_with_sharing_and_preemption_leave_the_pool_whole(
    workload: tuple, window: int, reserve: bool
) -> None:
    """Windows with everything that shares blocks (prefix hits taken behind holes, n > 1 forks
    of a prompt the leader's window has passed, preemption and resumption), cancels, both
    admissions: admitted requests finish or are cancelled, nothing leaks, the oldest is never
    preempted."""
    config, num_blocks, block_size, max_model_len, jobs, max_overtakes = workload
    if reserve:
        config = SchedulerConfig(
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            prefill_chunk=config.prefill_chunk,
            admission="reserve",
        )
    run = run_workload(
        jobs,
        config,
        num_blocks=num_blocks,
        block_size=block_size,
        max_model_len=max_model_len,
        max_steps=max_steps_for(jobs, 62),
        max_overtakes=max_overtakes,
        caching=True,
        window=window,
    )
    assert_admitted_requests_finish(run, jobs)
    kv = run.scheduler.kv
    assert run.scheduler.num_running == 0 and run.scheduler.num_preempted == 0
    assert kv.pool.num_free == num_blocks and kv.num_spare == 0 and kv.check_whole()
    assert kv.pool.owners() == ()


def test_the_windowed_property_tests_see_blocks_given_back_and_preemptions() -> None:
    jobs = [
        Job(f"r{i}", 12, None, 40, arrival_step=i, n=1 + i % 2, prefix=1 + i % 2) for i in range(6)
    ]
    run = run_workload(
        jobs,
        SchedulerConfig(max_num_seqs=6, prefill_chunk=4, admission="partial", reserve_tokens=2),
        num_blocks=16,
        block_size=4,
        max_model_len=64,
        max_steps=max_steps_for(jobs, 10),
        caching=True,
        window=6,
    )
    assert run.outcomes == {job.request_id: "finished" for job in jobs}
    assert run.scheduler.num_preemptions >= 2 and run.scheduler.kv.num_window_freed > 20


def test_the_property_test_sees_preemptions() -> None:
    """The workloads above are tight enough to preempt: the guarantees are not vacuous."""
    jobs = [
        Job(f"r{i}", 6, None, 20, arrival_step=i, n=1 + i % 2, prefix=1 + i % 2) for i in range(6)
    ]
    run = run_workload(
        jobs,
        SchedulerConfig(max_num_seqs=6, prefill_chunk=8, admission="partial", reserve_tokens=2),
        num_blocks=16,
        block_size=4,
        max_model_len=64,
        max_steps=max_steps_for(jobs, 10),
        caching=True,
    )
    assert run.outcomes == {job.request_id: "finished" for job in jobs}
    assert run.scheduler.num_preemptions >= 3
