"""The policies the simulator shows (kvserve/sim/policies.py): admission on a free slot alone
deadlocks, request-level batching holds arrivals until the whole batch is done."""

from __future__ import annotations

from kvserve.core import AdmissionQueue, Scheduler, admit_waiting
from kvserve.sim.policies import POLICIES, RequestLevelScheduler, SlotOnlyScheduler
from tests.core import helpers
from tests.core.helpers import admit, sequences


def make_scheduler(**kwargs: object) -> Scheduler:
    return helpers.make_scheduler(admission="reserve", **kwargs)


def run_plan(scheduler: Scheduler):
    plan = scheduler.schedule()
    scheduler.update(plan)
    return plan


def test_slot_only_sequence_waits_for_a_block_and_is_not_evicted() -> None:
    scheduler = make_scheduler(
        num_blocks=2, block_size=4, policy=SlotOnlyScheduler, max_num_batched_tokens=100
    )
    assert admit(scheduler, "a", 4, 8, 0) is not None
    assert admit(scheduler, "b", 4, 8, 1) is not None
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


def drive_until_done(policy: str, arrivals: dict[int, list[str]], answer: int) -> dict[str, int]:
    """Run a fake step loop; returns the step at which each request was admitted."""
    scheduler = make_scheduler(
        num_blocks=64,
        max_num_seqs=4,
        prefill_chunk=8,
        max_num_batched_tokens=100,
        policy=POLICIES[policy],
    )
    queue = AdmissionQueue(max_waiters=16, timeout=1e9, max_overtakes=4)
    admitted_at: dict[str, int] = {}
    total = sum(len(ids) for ids in arrivals.values())
    finished: set[str] = set()
    for step in range(100):
        for request_id in arrivals.get(step, []):
            queue.offer(request_id, float(step), sequences(request_id, 4, answer))
        for waiter in admit_waiting(scheduler, queue):
            admitted_at[waiter.request_id] = step
        plan = scheduler.schedule()
        for seq in scheduler.update(plan):
            scheduler.release(seq.seq_id)
            finished.add(seq.seq_id)
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
    scheduler = make_scheduler(policy=RequestLevelScheduler)
    assert admit(scheduler, "a", 4, 4, 0) is not None
    assert admit(scheduler, "b", 4, 4, 1) is not None  # same admission round
    scheduler.update(scheduler.schedule())
    assert not scheduler.batch_open
    assert admit(scheduler, "c", 4, 4, 2) is None
    scheduler.release("a")
    assert admit(scheduler, "c", 4, 4, 2) is None
    scheduler.release("b")
    assert scheduler.batch_open
    assert admit(scheduler, "c", 4, 4, 2) is not None
