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


# Decode steps a sequence rests from guessing after its guesses failed outright at k = 1.
REST_STEPS = 8


@dataclass(slots=True)
class Acceptance:
    """One sequence's speculation record: how many tokens to guess next (`k`), how long to rest,
    and what it drafted and had accepted so far (per position, for the metrics)."""

    max_k: int
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
        guess one more next time; none: halve k (at k = 1, rest `REST_STEPS` steps)."""
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
                self.rest = REST_STEPS
            else:
                self.k = max(self.k // 2, 1)
