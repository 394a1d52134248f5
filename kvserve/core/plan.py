"""What one step computes: the boundary between scheduling policy and the model.

Everything here is integers and strings, so a plan can be built by hand in a test and
executed by the engine without either side knowing how the other works.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ChunkPlan:
    """One sequence's rows in a step: consecutive positions `start .. start + num_tokens - 1`.

    `block_ids` is the sequence's whole block table at planning time; it covers at least
    `start + num_tokens` positions. `samples` is True when the chunk's last row needs logits:
    every decode row, and the prefill chunk that completes the prompt.
    """

    request_id: str
    slot: int
    start: int
    num_tokens: int
    block_ids: tuple[int, ...]
    is_prefill: bool
    samples: bool
    # The sequences sampling from this chunk's last row when that is more than the chunk's own:
    # the chunk completing an n > 1 prompt samples each answer (empty: just `request_id`).
    sample_ids: tuple[str, ...] = ()
    # The input token ids of the chunk's rows, built on the loop thread at planning time
    # (empty when the scheduler was given counts only).
    token_ids: tuple[int, ...] = ()
    # A decode chunk that speculates: the guessed tokens after the last sampled one (the last
    # `len(draft_token_ids)` entries of `token_ids`). Every row of such a chunk has logits;
    # the guesses are verified in order and the accepted prefix kept (kvserve/core/spec.py).
    draft_token_ids: tuple[int, ...] = ()

    @property
    def is_speculative(self) -> bool:
        """A decode chunk carrying guesses to verify."""
        return bool(self.draft_token_ids)

    @property
    def sampler_ids(self) -> tuple[str, ...]:
        """The sequences that get a token from this chunk (none when it does not sample)."""
        if not self.samples:
            return ()
        return self.sample_ids or (self.request_id,)

    @property
    def end(self) -> int:
        """One past the last position computed by this chunk."""
        return self.start + self.num_tokens


@dataclass(frozen=True, slots=True)
class BlockCopy:
    """Copy block `source`'s KV into block `target`, for sequence `request_id`, before the
    forward pass: an n > 1 prompt's partly filled last block (one copy per answer but the
    first), or a published tail a sequence continues."""

    request_id: str
    source: int
    target: int


@dataclass(frozen=True, slots=True)
class StepPlan:
    """The rows of one forward pass.

    `chunks` holds prefill chunks first, then decode rows, each group in arrival order.
    `waiting_ids` names the running sequences that got no rows this step, in arrival order;
    they keep their slot and blocks and are planned again next step. `copies` are block copies
    to run before the forward pass. `preempted_ids` names the sequences this plan preempted to
    find blocks for the others: they hold nothing now and resume later by recomputing.
    """

    step: int
    chunks: tuple[ChunkPlan, ...]
    waiting_ids: tuple[str, ...] = ()
    copies: tuple[BlockCopy, ...] = ()
    preempted_ids: tuple[str, ...] = ()

    @property
    def num_rows(self) -> int:
        """Rows in the batch: every chunk's tokens."""
        return sum(chunk.num_tokens for chunk in self.chunks)

    @property
    def num_prefill_rows(self) -> int:
        """Rows that compute prompt positions."""
        return sum(chunk.num_tokens for chunk in self.chunks if chunk.is_prefill)

    @property
    def num_draft_rows(self) -> int:
        """Rows that verify guessed tokens."""
        return sum(len(chunk.draft_token_ids) for chunk in self.chunks)

    @property
    def num_decode_rows(self) -> int:
        """Rows that compute the position of the last sampled token."""
        return sum(chunk.num_tokens for chunk in self.chunks if not chunk.is_prefill)

    @property
    def request_ids(self) -> tuple[str, ...]:
        """The sequences that get rows, in plan order."""
        return tuple(chunk.request_id for chunk in self.chunks)

    @property
    def touched_ids(self) -> tuple[str, ...]:
        """Every sequence whose KV or output this step writes: rows, samples and copies."""
        ids = dict.fromkeys(self.request_ids)
        for chunk in self.chunks:
            ids.update(dict.fromkeys(chunk.sampler_ids))
        ids.update(dict.fromkeys(copy.request_id for copy in self.copies))
        return tuple(ids)
