"""One record per sequence: its tokens, counts, place and status, from submit to release.

A request asks for n answers; each answer is a `Sequence` (ids from `sequence_id`: answer 0 is
the request id itself). The record is created at the door and lives until the sequence is
released. The scheduler moves it through its statuses and keeps its counts; the engine reads
them and adds only what delivering needs (stream, detokenizer, grammar matcher).

    WAITING_FOR_GRAMMAR ──▶ WAITING ──admit──▶ RUNNING ──stop check──▶ FINISHED_STOPPED / _LENGTH
                                                 │  ▲
                                        preempt  ▼  │ resume (recompute)
                                               PREEMPTED

Any status can also end in one of the other FINISHED_* statuses (cancelled, slow consumer,
queue timeout or full, error, shutdown). The finish reason the API reports is the finished
status's value: nothing else stores it.

Integers and strings only: no torch, no clock.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from kvserve.core.spec import Acceptance


class SequenceStatus(enum.Enum):
    """Where a sequence is. Each finished status's value is the finish reason reported."""

    WAITING_FOR_GRAMMAR = "waiting_for_grammar"  # its grammar compiles; holds nothing
    WAITING = "waiting"  # at the door (the admission queue), holds nothing
    RUNNING = "running"  # holds a slot and blocks
    PREEMPTED = "preempted"  # gave its slot and blocks back; first in line to resume
    FINISHED_STOPPED = "stop"  # end-of-sequence token, stop string, or a complete grammar
    FINISHED_LENGTH = "length"  # the answer budget is spent
    FINISHED_CANCELLED = "cancelled"  # the client went away
    FINISHED_SLOW_CONSUMER = "slow_consumer"  # the client fell too far behind
    FINISHED_QUEUE_TIMEOUT = "queue_timeout"  # waited its whole budget at the door
    FINISHED_QUEUE_FULL = "queue_full"  # the queue filled while its grammar compiled
    FINISHED_ERROR = "error"  # a failed step or grammar
    FINISHED_SHUTDOWN = "shutdown"  # the engine stopped

    @property
    def is_finished(self) -> bool:
        return self.name.startswith("FINISHED_")

    @property
    def finish_reason(self) -> str | None:
        """The reason the API reports ("stop", "length", ...); None while not finished."""
        return self.value if self.is_finished else None

    @classmethod
    def finished(cls, reason: str) -> SequenceStatus:
        """The finished status whose reason is `reason`; ValueError for an unknown one."""
        status = cls(reason)
        if not status.is_finished:
            raise ValueError(f"{reason!r} is not a finish reason")
        return status


FINISH_REASONS = tuple(status.value for status in SequenceStatus if status.is_finished)


def sequence_id(request_id: str, index: int) -> str:
    """The sequence id of answer `index` of a request (answer 0 is the request id itself)."""
    return request_id if index == 0 else f"{request_id}#{index}"


@dataclass(eq=False, slots=True)
class Sequence:
    """One answer of a request: what it was asked, what it has produced, where it stands.

    `prompt_token_ids` may be empty when the caller admits by counts only (the simulator,
    policy tests); such a sequence is never looked up in or published to the prefix cache.
    `max_tokens` is its answer budget, resolved at the door: the only place it is kept.
    """

    seq_id: str
    num_prompt_tokens: int
    max_tokens: int
    prompt_token_ids: tuple[int, ...] = ()
    stop_token_ids: frozenset[int] = frozenset()
    salt: str | None = None  # the tenant's prefix-cache salt
    # False when every prompt row must be computed (their logits are wanted, e.g. for prompt
    # log-probabilities): cached blocks never stand in for them until its first token exists.
    reuse: bool = True
    request_id: str = ""  # the request it answers; "" = `seq_id`
    index: int = 0  # which of the request's answers
    status: SequenceStatus = SequenceStatus.WAITING
    arrival: int = -1  # order of arrival at the door: the scheduler's priority (lower first)
    slot: int | None = None  # while running
    num_computed: int = 0  # positions whose KV has been computed (reset by a preemption)
    num_output: int = 0  # tokens sampled so far
    output_token_ids: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0  # prompt positions taken from the prefix cache at admission
    leader_id: str | None = None  # n > 1: the sequence prefilling for this one, until forked
    follower_ids: tuple[str, ...] = ()  # n > 1, on the leader: the sequences it prefills for
    num_preemptions: int = 0
    speculate: bool = True  # False: the request opted out of speculative decoding
    acceptance: Acceptance | None = None  # its speculation record, once it first speculates
    # Positions whose KV the draft model has computed (speculative decoding by a draft model;
    # valid below `num_computed`, reset by a preemption: kvserve/engine/draft.py).
    draft_len: int = 0

    def __post_init__(self) -> None:
        if not self.request_id:
            self.request_id = self.seq_id

    # -- counts --------------------------------------------------------------------------------

    @property
    def num_tokens(self) -> int:
        """Prompt plus sampled tokens."""
        return self.num_prompt_tokens + self.num_output

    @property
    def draft_start(self) -> int:
        """The first position a draft model computes for this sequence's next guesses: what it
        holds that is still valid, and at least the last token (it gives the first guess)."""
        return min(self.draft_len, self.num_computed, self.num_tokens - 1)

    @property
    def tokens_known(self) -> bool:
        """Whether every prompt and sampled token id is held (required for prefix caching)."""
        return (
            len(self.prompt_token_ids) == self.num_prompt_tokens
            and len(self.output_token_ids) == self.num_output
        )

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt then sampled tokens."""
        return [*self.prompt_token_ids, *self.output_token_ids]

    def token_slice(self, start: int, end: int) -> tuple[int, ...]:
        """`all_token_ids[start:end]` without copying the whole sequence (a decode row's one
        token is read every step)."""
        prompt = self.prompt_token_ids
        split = len(prompt)
        if end <= split:
            return tuple(prompt[start:end])
        if start >= split:
            return tuple(self.output_token_ids[start - split : end - split])
        return (*prompt[start:], *self.output_token_ids[: end - split])

    @property
    def awaits_fork(self) -> bool:
        """A follower whose leader has not finished the shared prompt yet."""
        return self.leader_id is not None

    @property
    def is_prefilling(self) -> bool:
        """Known positions remain to be computed before the next sample: the prompt, or after
        a preemption the prompt and the answer so far (a decode row computes just the last
        sampled token's position)."""
        return self.num_output == 0 or self.num_computed < self.num_tokens - 1

    @property
    def is_recomputing(self) -> bool:
        """Computing again the positions of tokens it already sampled (after a preemption)."""
        return self.num_output > 0 and self.num_computed < self.num_tokens - 1

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> str | None:
        return self.status.finish_reason

    @property
    def num_remaining(self) -> int:
        """Tokens it may still sample within its budget."""
        return max(self.max_tokens - self.num_output, 0)

    # -- the stop check ------------------------------------------------------------------------

    def stop_status(
        self, token_id: int | None, matched_stop: bool = False
    ) -> SequenceStatus | None:
        """The one stop check, run once per sampled token after it is appended: a stop token
        (end of sequence, `stop_token_ids`), a stop string or a complete grammar (`matched_stop`,
        decided by whoever holds the text and the matcher), or a spent budget. None: go on."""
        if token_id is not None and token_id in self.stop_token_ids:
            return SequenceStatus.FINISHED_STOPPED
        if matched_stop:
            return SequenceStatus.FINISHED_STOPPED
        if self.num_output >= self.max_tokens:
            return SequenceStatus.FINISHED_LENGTH
        return None


@dataclass(frozen=True, slots=True)
class Prompt:
    """What the records of a request's answers share: its prompt's tokens (for prefix lookups),
    the tenant's cache salt, how many answers, whether cached KV may stand in for rows, and
    whether its answers may speculate."""

    token_ids: tuple[int, ...] = ()
    salt: str | None = None
    n: int = 1
    reuse: bool = True
    speculate: bool = True


def make_sequences(
    request_id: str,
    num_prompt_tokens: int,
    max_tokens: int,
    prompt: Prompt | None = None,
    *,
    stop_token_ids: frozenset[int] = frozenset(),
    status: SequenceStatus = SequenceStatus.WAITING,
    arrival: int = -1,
) -> list[Sequence]:
    """The records of one request's `prompt.n` answers (one without a prompt), all waiting."""
    prompt = prompt or Prompt()
    if num_prompt_tokens < 1 or max_tokens < 1 or prompt.n < 1:
        raise ValueError("a sequence needs a prompt token, an answer budget and n >= 1")
    if prompt.token_ids and len(prompt.token_ids) != num_prompt_tokens:
        raise ValueError("the prompt's token ids do not match its length")
    ids = [sequence_id(request_id, index) for index in range(prompt.n)]
    # n > 1: the first answer prefills the shared prompt for the others (kvserve/core/scheduler.py).
    return [
        Sequence(
            seq_id=seq_id,
            num_prompt_tokens=num_prompt_tokens,
            max_tokens=max_tokens,
            prompt_token_ids=tuple(prompt.token_ids),
            stop_token_ids=stop_token_ids,
            salt=prompt.salt,
            reuse=prompt.reuse,
            speculate=prompt.speculate,
            request_id=request_id,
            index=index,
            status=status,
            arrival=arrival,
            leader_id=None if index == 0 else ids[0],
            follower_ids=tuple(ids[1:]) if index == 0 else (),
        )
        for index, seq_id in enumerate(ids)
    ]
