"""Speculative decoding's policy: what to guess, how many, and when not to.

A decoding sequence that speculates gets a short chunk instead of its one decode row: the row of
its last sampled token, then one row per guessed token (`ChunkPlan.draft_token_ids`). The Batch
computes logits for every row of that chunk and verifies the guesses in order (kvserve/engine/
sampler.py, `Sampler.verify`): the accepted prefix is kept, plus one token the target model chose
itself (the correction at the first rejection, or a bonus after the last guess). The scheduler
then rolls the sequence's computed positions back to what was kept and frees the blocks the
rejected positions emptied (`KVManager.rollback`).

Guesses never run past the answer budget (at most `num_remaining - 1` guesses, so even the bonus
token fits), hence never past the context; their blocks come only from the sequence's own table
and the free pool, never from preempting anyone, so the reservation rules hold unchanged.

The proposer here is prompt lookup (n-grams): the longest suffix of the sequence's tokens, of
`prompt_lookup_min` .. `prompt_lookup_max` tokens, that occurred earlier in them, and the tokens
that followed its latest earlier occurrence. It costs no model call.

`Acceptance` is the per-sequence step-aside rule: k shrinks when a sequence's guesses fail and
grows back when they all pass; after repeated total failures it rests a while before guessing
again.

`Payoff` is the engine-wide one: whether speculating pays at all at a given number of decoding
sequences, on this machine, with these models, measured. Acceptance alone cannot tell: a draft
model whose guesses are nearly all right still loses when drafting and verifying k + 1 rows take
longer than the k + 1 plain steps they replace (measured on a 2-core AMD EPYC, the 0.5B draft
for the 1.5B target: 92% of guesses accepted on chat prompts, and 0.93x the plain speed).

Integers only: no torch.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass, field


def propose_ngram(token_ids: Seq[int], num_tokens: int, min_n: int, max_n: int) -> tuple[int, ...]:
    """Up to `num_tokens` guesses by prompt lookup: for n from `max_n` down to `min_n`, the
    last n tokens are sought earlier in `token_ids` (latest occurrence first); the tokens that
    followed the first match found are the guesses. Empty when nothing matches."""
    length = len(token_ids)
    if num_tokens <= 0 or length < min_n + 1:
        return ()
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        pattern = list(token_ids[length - n :])
        first = pattern[0]
        # A match ends at most at length - 2 so that at least one token follows it.
        for start in range(length - n - 1, -1, -1):
            if token_ids[start] != first:
                continue
            if list(token_ids[start : start + n]) == pattern:
                follow = token_ids[start + n : start + n + num_tokens]
                return tuple(follow)
    return ()


# Decode steps a sequence rests from guessing after its guesses failed outright at k = 1,
# where a guess costs a draft model's steps. A lookup's guesses cost nothing to make, only their
# verify rows (a 2-row step for k = 1: 1.2x a plain step on the default model), so a sequence
# guessing by lookup rests none: the lookup finding nothing is its rest, and `Payoff` decides
# whether guessing pays at all. The default model's editing bench, k = 4, one stream (Intel
# Xeon, 2 cores, docs/benchmarks.md "2026-12-06 23:12–00:05"): 1.97x with 8 steps of rest,
# 2.01-2.05x with 2, 2.05-2.08x with none.
REST_STEPS = 8
NGRAM_REST_STEPS = 0


@dataclass(slots=True)
class Acceptance:
    """One sequence's speculation record: how many tokens to guess next (`k`), how long to rest,
    and what it drafted and had accepted so far (per position, for the metrics)."""

    max_k: int
    rest_steps: int = REST_STEPS  # rest after an outright failure at k = 1
    k: int = 0
    rest: int = 0  # decode steps left before guessing again
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.k <= 0:
            self.k = self.max_k
        if not self.accepted_per_pos:
            self.accepted_per_pos = [0] * self.max_k

    def wants(self) -> int:
        """Guesses it would like this step (0 while resting); a resting step counts down."""
        if self.rest > 0:
            self.rest -= 1
            return 0
        return self.k

    def record(self, num_drafted: int, num_accepted: int) -> None:
        """A verification landed: `num_accepted` of `num_drafted` guesses were kept. All kept:
        guess one more next time; none: halve k (at k = 1, rest `rest_steps` steps)."""
        if num_drafted <= 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted += num_accepted
        for position in range(min(num_accepted, len(self.accepted_per_pos))):
            self.accepted_per_pos[position] += 1
        if num_accepted >= num_drafted:
            self.k = min(self.k + 1, self.max_k)
        elif num_accepted == 0:
            if self.k <= 1:
                self.rest = self.rest_steps
            else:
                self.k = max(self.k // 2, 1)


# Payoff's measurement: WARMUP_STEPS guessing steps and as many plain ones at a batch size before
# one kind is preferred; then, when the other kind has not been measured for `period` decisions
# (plain steps come by themselves while speculating: a sequence that rests, or finds nothing to
# look up), PROBE_STEPS steps of it. The period starts at PROBE_PERIOD and doubles, up to
# MAX_PROBE_PERIOD, each time a probe leaves the preference as it was. The preference changes
# only when the other kind measures faster by MARGIN, so that two kinds about as fast do not
# alternate (a draft model pays to catch up after each pause); after the warm-up, speculation
# must be faster by MARGIN to be taken. Rates are exponential averages of seconds and tokens
# (their ratio: tokens a second), with weight SMOOTHING for the newest step.
WARMUP_STEPS = 4
PROBE_PERIOD = 48
MAX_PROBE_PERIOD = 384
PROBE_STEPS = 4
MARGIN = 0.05
SMOOTHING = 0.1


@dataclass(slots=True)
class _Rate:
    """Exponential averages of one kind of step's seconds and tokens."""

    seconds: float = 0.0
    tokens: float = 0.0
    samples: int = 0
    seen: int = 0  # the decision count when it was last measured

    def add(self, tokens: int, seconds: float) -> None:
        weight = 1.0 / (self.samples + 1) if self.samples < 1 / SMOOTHING else SMOOTHING
        self.seconds += weight * (seconds - self.seconds)
        self.tokens += weight * (tokens - self.tokens)
        self.samples += 1

    @property
    def per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass(slots=True)
class _SizeRecord:
    """Payoff's record at one batch size."""

    on: _Rate = field(default_factory=_Rate)
    off: _Rate = field(default_factory=_Rate)
    preferred: bool | None = None  # the kind taken between probes (None: in the warm-up)
    period: int = PROBE_PERIOD  # decisions without a measure of the other kind before a probe
    probe: int = 0  # steps of the probe under way left
    decisions: int = 0

    def prefer(self) -> bool:
        """The preferred kind, after the warm-up: changed only for one faster by MARGIN."""
        on, off = self.on.per_second, self.off.per_second
        if self.preferred is None:
            self.preferred = on > off * (1 + MARGIN)
            return self.preferred
        taken, other = (on, off) if self.preferred else (off, on)
        if other > taken * (1 + MARGIN):
            self.preferred = not self.preferred
            self.period, self.probe = PROBE_PERIOD, 0
        return self.preferred

    def choose(self) -> bool:
        if self.on.samples < WARMUP_STEPS:
            return True
        if self.off.samples < WARMUP_STEPS:
            return False
        preferred = self.prefer()
        other = self.off if preferred else self.on
        if self.probe == 0 and self.decisions - other.seen >= self.period:
            self.probe = PROBE_STEPS
        if self.probe == 0:
            return preferred
        self.probe -= 1
        if self.probe == 0:  # the last step of a probe: the next one comes later
            self.period = min(2 * self.period, MAX_PROBE_PERIOD)
        return not preferred


class Payoff:
    """Whether speculation pays, measured per number of decoding sequences (the batch size).

    The scheduler asks `speculates(batch)` when it plans a step of decoding sequences, and the
    engine reports the step's tokens and wall time (planning, which runs a draft model, included)
    through `observe` for the steps of decoding rows only, as what they were: guessing (some
    sequence verified guesses) or plain. The scheduler leaves out the steps in which a draft
    model catches up, a cost of starting rather than of each step. Guessing steps and plain
    steps are measured at each batch size, then the kind with more tokens a second is taken (by
    a MARGIN), with a short probe of the other when it has not been seen for a while. Only wall
    time and tokens are compared, so the rule holds for either method, any acceptance, any
    machine.
    """

    def __init__(self) -> None:
        self._sizes: dict[int, _SizeRecord] = {}

    def speculates(self, batch: int) -> bool:
        """Whether a step of `batch` decoding sequences may speculate (a decision: call it once
        for each step planned)."""
        record = self._sizes.setdefault(batch, _SizeRecord())
        choice = record.choose()
        record.decisions += 1
        return choice

    def observe(self, batch: int, guessed: bool, tokens: int, seconds: float) -> None:
        """A step of `batch` decoding sequences gave `tokens` in `seconds`; `guessed`: some
        sequence in it verified guesses."""
        record = self._sizes.get(batch)
        if record is None or tokens <= 0 or seconds <= 0:
            return
        rate = record.on if guessed else record.off
        rate.add(tokens, seconds)
        rate.seen = record.decisions

    def rates(self, batch: int) -> tuple[float, float]:
        """Tokens a second measured at `batch` with and without guesses (0.0: not yet)."""
        record = self._sizes.get(batch)
        if record is None:
            return 0.0, 0.0
        return record.on.per_second, record.off.per_second
