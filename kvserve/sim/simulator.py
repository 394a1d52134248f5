"""The scheduling simulator: the real `core/` Scheduler, KV manager and BlockPool driven by a
simulated step.

Each simulated step is the engine's loop with the forward pass left out:

    arrivals at the door       scheduler.check, make_sequences, admit_or_enqueue
    the admission round        admit_waiting (preempted requests resume first)
    plan                       scheduler.schedule() (may preempt)
    "compute" the plan         scheduler.update(plan, stopped): every planned row is taken as
                               done, and a request that reached its answer length stops
    finished requests leave    scheduler.release(seq_id)

Every rule (whom to admit, which rows a step holds, when the pool runs dry, whom to preempt) is
the core's; this module only supplies arrivals, says when a request has produced its whole
answer, and records what the scheduler did. The scenarios differ only in the `SchedulerConfig`
they hand to the core, the policy (the core Scheduler, or one of the two of
kvserve/sim/policies.py) and whether the pool caches prefixes: there each request's prompt
is a list of token ids (the `shared_prefix` leading ones common to every request that has
them), its full blocks are published once computed, and a later prompt that starts the same
way takes them by reference instead of computing them.

Time is counted in steps. A request arriving at step `a` is at the door before step `a` plans;
a token sampled in step `s` exists once step `s` ends. Its time to first token is therefore
`first_token_step + 1 - a` steps, and likewise its time to return.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from collections.abc import Sequence as Seq
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from kvserve.config import Admission, SchedulerConfig
from kvserve.core import (
    AdmissionQueue,
    BlockPool,
    Infeasible,
    KVManager,
    Outcome,
    Prompt,
    Scheduler,
    Sequence,
    StepPlan,
    Waiter,
    admit_or_enqueue,
    admit_waiting,
    make_sequences,
)
from kvserve.sim.policies import POLICIES, RequestLevelScheduler

Status = Literal["returned", "stuck", "refused", "unfinished"]
Policy = Literal["continuous", "request", "slot-only"]

# Why a request still waits at the door after the admission round, as the Scheduler answers it.
QUEUE_REASONS = {
    "batch": "the running batch admits nobody until its last request returns",
    "slot": "every slot is taken",
    "blocks": "a slot is free, but not the blocks its admission reserves",
    "order": "it may not overtake the head of the queue again",
    "preempted": "a preempted request resumes before anyone new is admitted",
    "resume": "preempted: it resumes, recomputing, once blocks for what it had are free",
}


@dataclass(frozen=True, slots=True)
class RequestSpec:
    """One simulated request.

    `answer_length` is how many tokens it produces before it stops by itself; `max_tokens` is
    the answer budget it names (the reserve), `answer_length` when None. Its first
    `shared_prefix` prompt tokens are the workload's common prefix (a system prompt every such
    request repeats); the rest are its own.
    """

    request_id: str
    arrival_step: int
    num_prompt_tokens: int
    answer_length: int
    max_tokens: int | None = None
    shared_prefix: int = 0

    def __post_init__(self) -> None:
        if self.arrival_step < 0:
            raise ValueError(f"{self.request_id}: arrival_step must be >= 0")
        if self.num_prompt_tokens < 1:
            raise ValueError(f"{self.request_id}: num_prompt_tokens must be >= 1")
        if self.answer_length < 1:
            raise ValueError(f"{self.request_id}: answer_length must be >= 1")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"{self.request_id}: max_tokens must be >= 1")
        if not 0 <= self.shared_prefix <= self.num_prompt_tokens:
            raise ValueError(f"{self.request_id}: shared_prefix must be in [0, num_prompt_tokens]")

    @property
    def budget(self) -> int:
        """The answer budget handed to the scheduler."""
        return self.answer_length if self.max_tokens is None else self.max_tokens


@dataclass(frozen=True, slots=True)
class Workload:
    """Requests plus the engine constants they run under (scaled down so a step can be watched)."""

    requests: tuple[RequestSpec, ...]
    num_slots: int = 4
    num_blocks: int = 16
    block_size: int = 4
    prefill_chunk: int = 8
    max_num_batched_tokens: int = 12
    reserve_tokens: int = 2  # answer positions "partial" admission reserves
    description: str = ""

    def __post_init__(self) -> None:
        if not self.requests:
            raise ValueError("a workload needs at least one request")
        request_ids = [request.request_id for request in self.requests]
        if len(set(request_ids)) != len(request_ids):
            raise ValueError("request ids must be unique")
        for name in (
            "num_slots",
            "num_blocks",
            "block_size",
            "prefill_chunk",
            "max_num_batched_tokens",
            "reserve_tokens",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive")

    @property
    def max_model_len(self) -> int:
        """The context length the simulated engine resolves: what the whole pool holds."""
        return self.num_blocks * self.block_size

    def to_dict(self) -> dict[str, Any]:
        """The workload as plain JSON-ready data (the format `load_workload` reads)."""
        data = asdict(self)
        data["requests"] = [
            {
                key: value
                for key, value in asdict(request).items()
                if value is not None and not (key == "shared_prefix" and value == 0)
            }
            for request in self.requests
        ]
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Workload:
        """Build a workload from `to_dict`'s format; unknown keys raise ValueError."""
        known = {
            "requests",
            "num_slots",
            "num_blocks",
            "block_size",
            "prefill_chunk",
            "max_num_batched_tokens",
            "reserve_tokens",
            "description",
        }
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown workload keys: {', '.join(sorted(unknown))}")
        if "requests" not in data:
            raise ValueError("a workload needs a 'requests' list")
        requests = []
        for index, raw in enumerate(data["requests"]):
            if not isinstance(raw, Mapping):
                raise ValueError(f"request {index} is not an object")
            fields = dict(raw)
            fields.setdefault("request_id", f"r{index + 1}")
            try:
                requests.append(RequestSpec(**fields))
            except TypeError as error:
                raise ValueError(f"request {index}: {error}") from None
        rest = {key: value for key, value in data.items() if key != "requests"}
        return cls(requests=tuple(requests), **rest)


# The default workload: seven requests arriving one after another into four slots and a pool of
# 12 blocks of 4 positions (48 positions). Every request fits the pool on its own; together they
# do not, so the scenarios part ways:
# - request-level batching: r1 (a long prompt) is alone at step 0 and forms a batch of one;
#   r2-r4 arrive while it runs and wait for it to finish, then r5-r7 wait for r2-r4.
# - continuous batching with reservation: each request is admitted once a slot and blocks for
#   its prompt plus its whole answer are free; r4 and r7 wait a few steps for blocks, nobody
#   waits for a batch, and all seven return.
# - continuous batching on a free slot alone: every request is admitted at once; at step 11 the
#   pool is empty, four half-done sequences each need one more block, and none can ever finish.
# - reservation with prefix caching: r4, r5 and r6 start with the same 8 tokens (two blocks, a
#   shared system prompt). Once r4 has computed them, r5 and r6 take those two blocks by
#   reference: each reserves two blocks fewer and prefills only the rest, so r5 is admitted a
#   step sooner and both get their first token sooner; r7 finds room four steps sooner.
# - partial reservation with preemption (no prefix cache, to compare with the second): each
#   request is admitted with blocks for its prompt and the first 2 answer positions, so r5 is
#   admitted a step sooner and r7 four. At step 12 r5 needs a block and none is free: r7, the
#   latest arrival, is preempted, and at step 13 it resumes by recomputing its prompt and its
#   first tokens. All seven return, the last three steps sooner than under full reservation.
DEFAULT_WORKLOAD = Workload(
    requests=(
        RequestSpec("r1", arrival_step=0, num_prompt_tokens=15, answer_length=8),
        RequestSpec("r2", arrival_step=2, num_prompt_tokens=6, answer_length=5),
        RequestSpec("r3", arrival_step=4, num_prompt_tokens=4, answer_length=4),
        RequestSpec("r4", arrival_step=6, num_prompt_tokens=10, answer_length=6, shared_prefix=8),
        RequestSpec("r5", arrival_step=7, num_prompt_tokens=10, answer_length=4, shared_prefix=8),
        RequestSpec("r6", arrival_step=8, num_prompt_tokens=9, answer_length=6, shared_prefix=8),
        RequestSpec("r7", arrival_step=10, num_prompt_tokens=4, answer_length=10),
    ),
    num_slots=4,
    num_blocks=12,
    block_size=4,
    prefill_chunk=8,
    max_num_batched_tokens=12,
    description=(
        "Seven requests arrive one after another into four slots sharing 12 blocks of "
        "4 positions; prefill chunks of 8 tokens, at most 12 rows per step. r4, r5 and r6 "
        "begin with the same 8 tokens."
    ),
)


def load_workload(path: str | Path) -> Workload:
    """Read a workload from a JSON file in `Workload.to_dict`'s format."""
    with open(path, encoding="utf-8") as file:
        data = json.load(file)
    if not isinstance(data, Mapping):
        raise ValueError(f"{path}: a workload is a JSON object")
    return Workload.from_dict(data)


@dataclass(frozen=True, slots=True)
class Scenario:
    """A scheduling policy: the core config's admission rule, the scheduler class (the core's
    own, or one of kvserve/sim/policies.py) and whether the pool caches prefixes."""

    name: str
    title: str
    admission: Admission = "reserve"
    policy: Policy = "continuous"
    summary: str = ""
    prefix_caching: bool = False  # the pool publishes full computed blocks for later prompts

    def scheduler_config(self, workload: Workload) -> SchedulerConfig:
        """The core's config for this policy under `workload`'s constants."""
        return SchedulerConfig(
            max_num_seqs=workload.num_slots,
            max_model_len=workload.max_model_len,
            max_num_batched_tokens=workload.max_num_batched_tokens,
            prefill_chunk=workload.prefill_chunk,
            admission=self.admission,
            reserve_tokens=workload.reserve_tokens,
        )

    def make_scheduler(self, config: SchedulerConfig, kv: KVManager, max_model_len: int):
        """The scheduler this policy runs (kvserve.core.Scheduler or a subclass)."""
        return POLICIES[self.policy](config, kv, max_model_len)


REQUEST_LEVEL = Scenario(
    name="request",
    title="Request-level batching",
    admission="reserve",
    policy="request",
    summary="A batch forms while nothing runs and runs to completion; then the next one forms.",
)
CONTINUOUS_RESERVE = Scenario(
    name="reserve",
    title="Continuous batching, reserve at admission",
    admission="reserve",
    summary=(
        "Requests join and leave at every step; admission takes a slot and blocks for the "
        "prompt and the whole answer budget together."
    ),
)
CONTINUOUS_SLOT_ONLY = Scenario(
    name="slot-only",
    title="Continuous batching, free slot alone",
    policy="slot-only",
    summary=(
        "Requests join as soon as a slot is free; blocks are taken only as positions need "
        "them, so the pool can run dry with every sequence half done."
    ),
)
PREFIX_CACHING = Scenario(
    name="prefix",
    title="Continuous batching, reserve at admission, prefix caching",
    admission="reserve",
    prefix_caching=True,
    summary=(
        "As with reservation, and a prompt's full blocks are published once computed: a later "
        "prompt that starts with the same tokens takes them by reference (their count goes "
        "up), reserves only the blocks still to fill, and computes only the rest. Published "
        "blocks nobody holds stay cached until a fresh block is needed."
    ),
)
PARTIAL_PREEMPT = Scenario(
    name="partial",
    title="Continuous batching, reserve part of the answer, preempt by recompute",
    admission="partial",
    summary=(
        "Admission takes a slot and blocks for the prompt and the first positions of the "
        "answer; a sequence takes more blocks from the free pool as it grows. When none is "
        "left, the request that arrived last is preempted: its slot and blocks are freed and "
        "it waits first in line, then resumes by recomputing what it had (the engine's prefix "
        "cache keeps its full blocks for that). The oldest request is never preempted, so it "
        "always finishes."
    ),
)
SCENARIOS: tuple[Scenario, ...] = (
    REQUEST_LEVEL,
    CONTINUOUS_RESERVE,
    CONTINUOUS_SLOT_ONLY,
    PREFIX_CACHING,
    PARTIAL_PREEMPT,
)


def scenario_by_name(name: str) -> Scenario:
    """One of `SCENARIOS` by its name; ValueError for an unknown name."""
    for scenario in SCENARIOS:
        if scenario.name == name:
            return scenario
    names = ", ".join(scenario.name for scenario in SCENARIOS)
    raise ValueError(f"unknown scenario {name!r} (choose from {names})")


@dataclass(frozen=True, slots=True)
class SlotView:
    """A slot's sequence after a step computed (before finished requests leave)."""

    slot: int
    request_id: str
    num_prompt_tokens: int
    num_computed: int  # positions whose KV exists
    num_output: int  # tokens sampled so far
    answer_length: int
    num_cached_tokens: int = 0  # prompt positions taken from the prefix cache at admission
    block_ids: tuple[int, ...] = ()  # its block table, shared blocks included
    num_reserved_blocks: int = 0  # the table's first blocks, taken at admission; the rest grew
    num_preemptions: int = 0  # times it was preempted so far


@dataclass(frozen=True, slots=True)
class RowView:
    """One sequence's rows in a step: a prefill chunk, or one decode row."""

    request_id: str
    slot: int
    is_prefill: bool
    start: int
    num_tokens: int
    samples: bool


@dataclass(frozen=True, slots=True)
class Frame:
    """Everything one step did and left behind, as the core reported it.

    Slots, blocks and counts are taken after the step computed and before finished requests
    are released, so a request returned in this step is still drawn in its slot.
    `stalled_ids` are running sequences that got no rows; `queued_ids` wait at the door, each
    for the reason (a key of `QUEUE_REASONS`) at the same index of `queue_reasons`; before them
    `resuming_ids` are the preempted requests, first in line. `preempted_ids` were preempted by
    this step's plan, `resumed_ids` resumed in its admission round. A block a request took
    after its admission (it grew) is marked in `block_growth`.
    A block held by several requests (a shared prefix) names the first of them in
    `block_owners` and counts them all in `block_refs`; a cached block nobody holds has no
    owner, a count of 0, and keeps its positions (`block_fill`) for the next prompt.
    """

    step: int
    slots: tuple[SlotView | None, ...]
    block_owners: tuple[str | None, ...]
    block_fill: tuple[int, ...]  # positions holding KV in each block
    queued_ids: tuple[str, ...]
    queue_reasons: tuple[str, ...]
    rows: tuple[RowView, ...]
    stalled_ids: tuple[str, ...]
    arrived_ids: tuple[str, ...]
    admitted_ids: tuple[str, ...]
    refused_ids: tuple[str, ...]
    first_token_ids: tuple[str, ...]
    returned_ids: tuple[str, ...]
    stuck: bool
    block_refs: tuple[int, ...] = ()  # how many running requests hold each block
    block_cached: tuple[bool, ...] = ()  # published in the prefix cache (held or not)
    block_growth: tuple[bool, ...] = ()  # its owner took it after admission, as it grew
    resuming_ids: tuple[str, ...] = ()
    preempted_ids: tuple[str, ...] = ()
    resumed_ids: tuple[str, ...] = ()

    @property
    def num_rows(self) -> int:
        """Rows in this step's forward pass."""
        return sum(row.num_tokens for row in self.rows)

    @property
    def num_used_blocks(self) -> int:
        """Blocks held by some request."""
        return sum(owner is not None for owner in self.block_owners)


@dataclass(frozen=True, slots=True)
class RequestOutcome:
    """What happened to one request, in steps."""

    request_id: str
    arrival_step: int
    num_prompt_tokens: int
    answer_length: int
    status: Status
    admitted_step: int | None = None
    first_token_step: int | None = None
    returned_step: int | None = None
    arrived_during_batch: bool = False  # a closed request-level batch was running at arrival
    reason: str | None = None  # why it is stuck, refused or unfinished
    preempted_steps: tuple[int, ...] = ()  # the steps whose plans preempted it

    @property
    def time_to_first_token(self) -> int | None:
        """Steps from arrival until the first token exists; None without one."""
        if self.first_token_step is None:
            return None
        return self.first_token_step + 1 - self.arrival_step

    @property
    def time_to_return(self) -> int | None:
        """Steps from arrival until the whole answer exists; None when it never returned."""
        if self.returned_step is None:
            return None
        return self.returned_step + 1 - self.arrival_step


@dataclass(frozen=True, slots=True)
class SimulationResult:
    """One scenario run over one workload: a frame per step and an outcome per request."""

    scenario: Scenario
    workload: Workload
    config: SchedulerConfig
    frames: tuple[Frame, ...]
    requests: tuple[RequestOutcome, ...]
    stuck_step: int | None = None  # the first step whose plan had no rows while requests ran
    stuck_reason: str | None = None

    @property
    def num_steps(self) -> int:
        """Steps simulated."""
        return len(self.frames)

    def outcome(self, request_id: str) -> RequestOutcome:
        """The outcome of `request_id`; KeyError when the workload has no such request."""
        for outcome in self.requests:
            if outcome.request_id == request_id:
                return outcome
        raise KeyError(request_id)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready data: scenario, workload, frames and per-request outcomes."""
        requests = []
        for outcome in self.requests:
            data = asdict(outcome)
            data["time_to_first_token"] = outcome.time_to_first_token
            data["time_to_return"] = outcome.time_to_return
            requests.append(data)
        return {
            "scenario": asdict(self.scenario),
            "workload": self.workload.to_dict(),
            "frames": [asdict(frame) for frame in self.frames],
            "requests": requests,
            "stuck_step": self.stuck_step,
            "stuck_reason": self.stuck_reason,
        }


@dataclass
class _Progress:
    """The simulator's own record of a request while it runs."""

    spec: RequestSpec
    answer_length: int = 0  # capped by the budget the scheduler resolved
    sequences: list[Sequence] = field(default_factory=list)
    admitted_step: int | None = None
    first_token_step: int | None = None
    returned_step: int | None = None
    arrived_during_batch: bool = False
    refusal: str | None = None
    done: bool = False
    preempted_steps: list[int] = field(default_factory=list)


@dataclass
class _StepEvents:
    arrived_ids: list[str] = field(default_factory=list)
    admitted_ids: list[str] = field(default_factory=list)
    refused_ids: list[str] = field(default_factory=list)
    first_token_ids: list[str] = field(default_factory=list)
    returned_ids: list[str] = field(default_factory=list)
    resumed_ids: list[str] = field(default_factory=list)


def default_max_steps(workload: Workload) -> int:
    """A bound no run that makes progress can reach: after the last arrival every step that
    is not stuck computes at least one row, and there are only so many rows to compute. A
    preemption makes its victim compute its rows again, and each happens at a row that grows
    an older request, so the rows are counted once more per request that could be preempted."""
    last_arrival = max(request.arrival_step for request in workload.requests)
    num_rows = sum(r.num_prompt_tokens + r.answer_length for r in workload.requests)
    return last_arrival + num_rows * len(workload.requests) + 1


def simulate(
    workload: Workload,
    scenario: Scenario,
    *,
    config: SchedulerConfig | None = None,
    max_steps: int | None = None,
) -> SimulationResult:
    """Run `workload` through the core's Scheduler under `scenario` (or an explicit `config`).

    The run ends when every request has returned or been refused, or when the scheduler is
    stuck (running sequences, a plan without rows) and no request is still to arrive: nothing
    can finish then, so nothing can ever be released. `max_steps` is a safety bound (default:
    `default_max_steps`); requests left when it is reached are reported as unfinished.
    """
    config = scenario.scheduler_config(workload) if config is None else config
    pool = BlockPool(
        workload.num_blocks, workload.block_size, prefix_caching=scenario.prefix_caching
    )
    prompts = (
        {spec.request_id: Prompt(prompt_token_ids(workload, spec)) for spec in workload.requests}
        if scenario.prefix_caching
        else {}
    )
    scheduler = scenario.make_scheduler(config, KVManager(pool), workload.max_model_len)
    # Nobody is turned away or times out at the door here; the figure is about the step loop.
    queue = AdmissionQueue(
        max_waiters=len(workload.requests), timeout=math.inf, max_overtakes=config.max_num_seqs
    )
    progress = {request.request_id: _Progress(request) for request in workload.requests}
    last_arrival = max(request.arrival_step for request in workload.requests)
    limit = default_max_steps(workload) if max_steps is None else max_steps
    frames: list[Frame] = []
    stuck_step: int | None = None
    stuck_reason: str | None = None
    for step in range(limit):
        events = _StepEvents()
        for request in workload.requests:
            if request.arrival_step == step:
                prompt = prompts.get(request.request_id)
                _arrive(scheduler, queue, progress[request.request_id], step, events, prompt)
        for seq in scheduler.resume():
            events.resumed_ids.append(seq.seq_id)
        for waiter in admit_waiting(scheduler, queue):
            progress[waiter.request_id].admitted_step = step
            events.admitted_ids.append(waiter.request_id)
        # Asked before schedule(): under request-level batching planning closes the batch.
        queue_reasons = tuple(_queue_reason(scheduler, waiter) for waiter in queue.waiters)
        plan = scheduler.schedule()
        stuck = scheduler.is_stuck(plan)
        if stuck and stuck_step is None:
            stuck_step = step
            stuck_reason = _stuck_reason(scheduler, step)
        for seq_id in plan.preempted_ids:
            progress[seq_id].preempted_steps.append(step)
        # A request stops by itself (as at an end-of-sequence token) at its answer length.
        stopped = {
            seq_id
            for chunk in plan.chunks
            for seq_id in chunk.sampler_ids
            if scheduler.get(seq_id).num_output + 1 >= progress[seq_id].answer_length
        }
        if prompts:
            # Token ids are known, so computed blocks are published: every sample is token 0.
            sampled = {seq_id: 0 for chunk in plan.chunks for seq_id in chunk.sampler_ids}
            finished = scheduler.update_from_output(plan, sampled, stopped)
        else:
            finished = scheduler.update(plan, stopped)
        for chunk in plan.chunks:
            seq = scheduler.get(chunk.request_id)
            record = progress[chunk.request_id]
            if seq is not None and chunk.samples and record.first_token_step is None:
                record.first_token_step = step
                events.first_token_ids.append(chunk.request_id)
        for seq in finished:
            record = progress[seq.seq_id]
            record.returned_step = step
            record.done = True
            events.returned_ids.append(seq.seq_id)
        frames.append(_frame(scheduler, queue_reasons, queue, plan, step, stuck, events, progress))
        for seq in finished:
            scheduler.release(seq.seq_id)
        if all(record.done for record in progress.values()):
            break
        if stuck and step >= last_arrival:
            break
    final_stuck = bool(frames) and frames[-1].stuck
    outcomes = tuple(
        _outcome(record, scheduler, queue, final_stuck, len(frames)) for record in progress.values()
    )
    return SimulationResult(
        scenario=scenario,
        workload=workload,
        config=config,
        frames=tuple(frames),
        requests=outcomes,
        stuck_step=stuck_step if final_stuck else None,
        stuck_reason=stuck_reason if final_stuck else None,
    )


def simulate_all(
    workload: Workload, scenarios: Seq[Scenario] = SCENARIOS
) -> list[SimulationResult]:
    """`simulate` for each scenario, in order."""
    return [simulate(workload, scenario) for scenario in scenarios]


def prompt_token_ids(workload: Workload, spec: RequestSpec) -> tuple[int, ...]:
    """The simulated prompt of `spec`: the workload's common prefix (ids 1, 2, ...) for its
    first `shared_prefix` tokens, then ids of its own."""
    own = 1000 * (1 + workload.requests.index(spec))
    return tuple(range(1, spec.shared_prefix + 1)) + tuple(
        own + i for i in range(spec.num_prompt_tokens - spec.shared_prefix)
    )


def _arrive(
    scheduler: Scheduler,
    queue: AdmissionQueue,
    record: _Progress,
    step: int,
    events: _StepEvents,
    prompt: Prompt | None = None,
) -> None:
    spec = record.spec
    events.arrived_ids.append(spec.request_id)
    try:
        budget = scheduler.check(spec.num_prompt_tokens, spec.budget)
    except Infeasible as refused:
        record.refusal = refused.reason
        record.done = True
        events.refused_ids.append(spec.request_id)
        return
    record.answer_length = min(spec.answer_length, budget)
    record.arrived_during_batch = (
        isinstance(scheduler, RequestLevelScheduler) and not scheduler.batch_open
    )
    record.sequences = make_sequences(spec.request_id, spec.num_prompt_tokens, budget, prompt)
    result = admit_or_enqueue(scheduler, queue, record.sequences, float(step))
    if result is Outcome.ADMITTED:
        record.admitted_step = step
        events.admitted_ids.append(spec.request_id)
    elif result is Outcome.QUEUE_FULL:  # the queue holds every request; kept for safety
        record.refusal = "the admission queue is full"
        record.done = True
        events.refused_ids.append(spec.request_id)


def _queue_reason(scheduler: Scheduler, waiter: Waiter) -> str:
    if isinstance(scheduler, RequestLevelScheduler) and not scheduler.batch_open:
        return "batch"
    if scheduler.num_preempted:
        return "preempted"
    if scheduler.num_free_slots == 0:
        return "slot"
    if not scheduler.can_admit(waiter.sequences):
        return "blocks"
    return "order"


def _frame(
    scheduler: Scheduler,
    queue_reasons: tuple[str, ...],
    queue: AdmissionQueue,
    plan: StepPlan,
    step: int,
    stuck: bool,
    events: _StepEvents,
    progress: Mapping[str, _Progress],
) -> Frame:
    pool = scheduler.pool
    block_size = pool.block_size
    slots: list[SlotView | None] = [None] * scheduler.config.max_num_seqs
    owners: list[str | None] = [None] * pool.num_blocks
    fill = [0] * pool.num_blocks
    cache = pool.cache
    for block_id in () if cache is None else cache.cached_free_ids():
        # A cached block nobody holds keeps its KV (a published tail, only its first positions).
        fill[block_id] = cache.num_positions(block_id, block_size)
    growth = [False] * pool.num_blocks
    for seq in scheduler.running:
        table = pool.table(seq.seq_id)
        num_reserved = scheduler.kv.num_reserved(seq.seq_id)
        slots[seq.slot] = SlotView(
            slot=seq.slot,
            request_id=seq.seq_id,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_computed=seq.num_computed,
            num_output=seq.num_output,
            answer_length=progress[seq.seq_id].answer_length,
            num_cached_tokens=seq.num_cached_tokens,
            block_ids=table,
            num_reserved_blocks=num_reserved,
            num_preemptions=seq.num_preemptions,
        )
        for index, block_id in enumerate(table):
            if owners[block_id] is None:
                owners[block_id] = seq.seq_id
                growth[block_id] = index >= num_reserved
            written = min(max(seq.num_computed - index * block_size, 0), block_size)
            fill[block_id] = max(fill[block_id], written)
    rows = tuple(
        RowView(
            request_id=chunk.request_id,
            slot=chunk.slot,
            is_prefill=chunk.is_prefill,
            start=chunk.start,
            num_tokens=chunk.num_tokens,
            samples=chunk.samples,
        )
        for chunk in plan.chunks
    )
    return Frame(
        step=step,
        slots=tuple(slots),
        block_owners=tuple(owners),
        block_fill=tuple(fill),
        queued_ids=tuple(waiter.request_id for waiter in queue.waiters),
        queue_reasons=queue_reasons,
        rows=rows,
        stalled_ids=tuple(plan.waiting_ids),
        arrived_ids=tuple(events.arrived_ids),
        admitted_ids=tuple(events.admitted_ids),
        refused_ids=tuple(events.refused_ids),
        first_token_ids=tuple(events.first_token_ids),
        returned_ids=tuple(events.returned_ids),
        stuck=stuck,
        block_refs=tuple(pool.refcount(block_id) for block_id in range(pool.num_blocks)),
        block_cached=tuple(
            cache is not None and cache.is_published(block_id)
            for block_id in range(pool.num_blocks)
        ),
        block_growth=tuple(growth),
        resuming_ids=tuple(seq.seq_id for seq in scheduler.preempted),
        preempted_ids=tuple(plan.preempted_ids),
        resumed_ids=tuple(events.resumed_ids),
    )


def _stuck_reason(scheduler: Scheduler, step: int) -> str:
    pool = scheduler.pool
    held = ", ".join(f"{seq.seq_id} {len(pool.table(seq.seq_id))}" for seq in scheduler.running)
    return (
        f"stuck at step {step}: {pool.num_used} of {pool.num_blocks} blocks are held ({held}), "
        f"{pool.num_free} free; no running sequence can grow, so none can finish and free "
        "its blocks"
    )


def _outcome(
    record: _Progress,
    scheduler: Scheduler,
    queue: AdmissionQueue,
    stuck: bool,
    num_steps: int,
) -> RequestOutcome:
    spec = record.spec
    status: Status
    reason: str | None = None
    if record.refusal is not None:
        status, reason = "refused", record.refusal
    elif record.returned_step is not None:
        status = "returned"
    elif not stuck:
        status, reason = "unfinished", f"not done after {num_steps} steps (the step limit)"
    else:
        status = "stuck"
        seq = scheduler.get(spec.request_id)
        if seq is not None and seq.is_prefilling:
            reason = (
                f"prefill stopped at {seq.num_computed}/{seq.num_prompt_tokens} prompt "
                "positions: the next chunk needs a block and none is free"
            )
        elif seq is not None:
            reason = (
                f"stopped after {seq.num_output}/{record.answer_length} answer tokens: "
                "the next position needs a block and none is free"
            )
        else:
            reason = "queued: no running request can finish to free a slot or blocks"
    return RequestOutcome(
        request_id=spec.request_id,
        arrival_step=spec.arrival_step,
        num_prompt_tokens=spec.num_prompt_tokens,
        answer_length=spec.answer_length,
        status=status,
        admitted_step=record.admitted_step,
        first_token_step=record.first_token_step,
        returned_step=record.returned_step,
        arrived_during_batch=record.arrived_during_batch,
        reason=reason,
        preempted_steps=tuple(record.preempted_steps),
    )


def format_table(result: SimulationResult) -> str:
    """The terminal table of one scenario: per request arrival, admission, first token, return,
    TTFT and time to return in steps, or the reason it never returned."""
    header = (
        "request",
        "arrives",
        "prompt",
        "answer",
        "admitted",
        "first token",
        "returned",
        "TTFT",
        "to return",
        "note",
    )

    def cell(value: int | None) -> str:
        return "-" if value is None else str(value)

    rows: list[tuple[str, ...]] = []
    for outcome in result.requests:
        if outcome.status == "returned":
            notes = ["arrived while a batch ran"] if outcome.arrived_during_batch else []
            if outcome.preempted_steps:
                steps = ", ".join(str(step) for step in outcome.preempted_steps)
                notes.append(f"preempted at step {steps}")
            note = "; ".join(notes)
            returned = cell(outcome.returned_step)
        else:
            note = outcome.reason or ""
            returned = outcome.status
        rows.append(
            (
                outcome.request_id,
                str(outcome.arrival_step),
                str(outcome.num_prompt_tokens),
                str(outcome.answer_length),
                cell(outcome.admitted_step),
                cell(outcome.first_token_step),
                returned,
                cell(outcome.time_to_first_token),
                cell(outcome.time_to_return),
                note,
            )
        )
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header) - 1)]

    def line(row: tuple[str, ...]) -> str:
        cells = [row[0].ljust(widths[0])]
        cells += [value.rjust(width) for value, width in zip(row[1:-1], widths[1:], strict=True)]
        return ("  ".join(cells) + "  " + row[-1]).rstrip()

    scenario = result.scenario
    title = f"{scenario.title} ({scenario.name}): {result.num_steps} steps"
    lines = [title, "  " + scenario.summary] if scenario.summary else [title]
    lines += ["", "  " + line(header)]
    lines += ["  " + line(row) for row in rows]
    if result.stuck_reason is not None:
        lines += ["", "  " + result.stuck_reason]
    return "\n".join(lines)
