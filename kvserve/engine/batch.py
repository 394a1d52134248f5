"""Batch: the mechanism that turns a StepPlan into one forward pass and samples.

It never decides who runs; the Scheduler did. Given the plan (which carries every row's input
token id, built on the loop thread) and the row states of the sequences that sample, it runs the
plan's block copies, builds the flat inputs (token ids, positions, slots, block tables), runs the
model, and samples one token for every sequence sampling from a chunk's last row. A prefill
chunk whose prompt is to be scored (prompt log-probabilities) has logits computed for every
row, and each prompt token they predict is scored. A speculative chunk (a decode row and the
guesses after it) has logits computed for every row, and its guesses are verified in order
(`Sampler.verify`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from kvserve.core.plan import ChunkPlan, StepPlan
from kvserve.engine.prompt_logprobs import score_rows
from kvserve.engine.sampler import RowState, Sampler, Verified
from kvserve.engine.stream import TokenLogprob
from kvserve.engine.structured import GrammarAfter, start_bitmasks
from kvserve.model.kv_cache import KVCache
from kvserve.model.llama import LlamaModel

ScoredPrompts = Mapping[str, tuple[Sequence[int], int]]
"""Sequences whose prefill chunks score their prompt: id -> (prompt token ids, alternatives)."""


@dataclass(frozen=True, slots=True)
class Sampled:
    token_id: int
    logprob: float | None
    top_logprobs: list[tuple[int, float]] | None


@dataclass(frozen=True, slots=True)
class Speculated:
    """A speculative chunk's outcome: the tokens its sequence keeps (accepted guesses, then the
    token chosen after them), how many it guessed and how many of them were accepted."""

    tokens: tuple[Sampled, ...]
    num_drafted: int
    num_accepted: int


@dataclass(frozen=True, slots=True)
class StepOutput:
    sampled: dict[str, Sampled]  # sequence id -> the token it sampled
    num_rows: int
    # sequence id -> the prompt tokens this step's rows predicted (positions chunk.start + 1
    # onwards, in order), for the chunks of `scored` prompts
    prompt_logprobs: dict[str, list[TokenLogprob]] = field(default_factory=dict)
    # sequence id -> its speculative chunk's outcome (those sequences are not in `sampled`)
    speculated: dict[str, Speculated] = field(default_factory=dict)


class Batch:
    """Executes plans on one model and one KV cache. Called from a single worker thread."""

    def __init__(self, model: LlamaModel, kv_cache: KVCache, sampler: Sampler) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.sampler = sampler
        self.device = model.device
        self.block_size = kv_cache.block_size

    def inputs(
        self, plan: StepPlan, rows: Mapping[str, RowState]
    ) -> tuple[torch.Tensor, list[str], list[RowState], list[int]]:
        """Flat token ids for every row; the sequences sampling one token (speculative chunks
        aside), their row states, and for each the index of the sampling chunk it samples
        from, among those chunks (several sequences share one when n > 1 share a prompt)."""
        token_ids: list[int] = []
        sampling_ids: list[str] = []
        states: list[RowState] = []
        logits_rows: list[int] = []
        num_sampling_chunks = 0
        for chunk in plan.chunks:
            if len(chunk.token_ids) != chunk.num_tokens:
                raise ValueError(f"chunk of {chunk.request_id!r} carries no input tokens")
            token_ids.extend(chunk.token_ids)
            if chunk.samples and not chunk.is_speculative:
                for seq_id in chunk.sampler_ids:
                    sampling_ids.append(seq_id)
                    states.append(rows[seq_id])
                    logits_rows.append(num_sampling_chunks)
                num_sampling_chunks += 1
        ids = torch.tensor(token_ids, dtype=torch.long).to(self.device, non_blocking=True)
        return ids, sampling_ids, states, logits_rows

    def execute(
        self, plan: StepPlan, rows: Mapping[str, RowState], scored: ScoredPrompts | None = None
    ) -> StepOutput:
        """The plan's block copies, one forward pass over its rows, then one sample per
        sampling sequence (`rows`: its row state, by sequence id) and the verification of each
        speculative chunk's guesses. The prefill chunks of the `scored` sequences also score the
        prompt tokens their rows predict."""
        for copy in plan.copies:
            self.kv_cache.copy_block(copy.source, copy.target)
        if plan.num_rows == 0:
            return StepOutput({}, 0)
        token_ids, sampling_ids, states, logits_rows = self.inputs(plan, rows)
        vocab_size = self.model.config.vocab_size
        speculative = [chunk for chunk in plan.chunks if chunk.is_speculative]
        # The grammar masks depend only on the tokens accepted so far: fill them on their own
        # thread while the forward pass runs (the rows that guess first need none, mostly).
        grammars = [
            state.grammar
            for state in states
            if state.grammar is not None and not self.sampler.guesses(state)
        ]
        masks = start_bitmasks(grammars, vocab_size) if grammars else None
        # A speculative chunk's masks walk its matcher through the guesses and back: filled here,
        # on this thread, since nothing else may touch that matcher meanwhile.
        draft_masks = iter(
            [
                rows[chunk.request_id].grammar.draft_bitmasks(chunk.draft_token_ids, vocab_size)
                for chunk in speculative
                if rows[chunk.request_id].grammar is not None
            ]
        )
        meta = self.model.attention.build_metadata(
            plan.chunks, self.block_size, self.kv_cache.kv.dtype
        )
        layout = _logits_layout(plan, scored or {})
        if layout.custom:
            meta.logits_indices = torch.tensor(
                layout.logits_rows, dtype=torch.long, device=self.device
            )
        logits = self.model.forward(token_ids, meta, self.kv_cache)
        prompt_logprobs: dict[str, list[TokenLogprob]] = {}
        for seq_id, first, targets, num_top in layout.scored:
            prompt_logprobs[seq_id] = score_rows(
                logits[first : first + len(targets)], targets, num_top
            )
        verified: dict[str, tuple[ChunkPlan, Verified]] = {}
        if speculative:
            spec_rows: list[int] = []
            spec_states: list[RowState] = []
            for chunk, first in zip(speculative, layout.speculative_rows, strict=True):
                base = rows[chunk.request_id]
                chunk_masks = next(draft_masks) if base.grammar is not None else None
                spec_rows.extend(range(first, first + chunk.num_tokens))
                spec_states.extend(_guess_rows(base, chunk.draft_token_ids, chunk_masks))
            spec_logits = logits.index_select(
                0, torch.tensor(spec_rows, dtype=torch.long, device=logits.device)
            )
            drafts = [chunk.draft_token_ids for chunk in speculative]
            results = self.sampler.verify(spec_logits, spec_states, drafts)
            verified = {
                chunk.request_id: (chunk, result)
                for chunk, result in zip(speculative, results, strict=True)
            }
        sampled: dict[str, Sampled] = {}
        if sampling_ids:
            if layout.custom:
                logits = logits[
                    torch.tensor(layout.sample_rows, dtype=torch.long, device=logits.device)
                ]
            if len(logits_rows) != logits.shape[0]:
                # logits: [sampling chunks, vocab] -> [sampling sequences, vocab]
                index = torch.tensor(logits_rows, dtype=torch.long, device=logits.device)
                logits = logits.index_select(0, index)
            bitmask = None if masks is None else masks.result()
            result = self.sampler.sample(logits, states, bitmask)
            sampled = {
                seq_id: Sampled(token, logprob, top)
                for seq_id, token, logprob, top in zip(
                    sampling_ids,
                    result.token_ids,
                    result.logprobs,
                    result.top_logprobs,
                    strict=True,
                )
            }
        elif masks is not None:
            masks.result()
        speculated = {
            seq_id: Speculated(
                tuple(
                    Sampled(token, logprob, top)
                    for token, logprob, top in zip(
                        result.token_ids, result.logprobs, result.top_logprobs, strict=True
                    )
                ),
                len(chunk.draft_token_ids),
                result.num_accepted,
            )
            for seq_id, (chunk, result) in verified.items()
        }
        return StepOutput(sampled, plan.num_rows, prompt_logprobs, speculated)


def _guess_rows(
    base: RowState, guesses: Sequence[int], masks: torch.Tensor | None
) -> list[RowState]:
    """The row states of a speculative chunk: row j as if its first j guesses were accepted
    (their penalties counted, the grammar's mask after them)."""
    return [
        RowState(
            params=base.params,
            generator=base.generator,
            prompt_token_ids=base.prompt_token_ids,
            output_token_ids=[*base.output_token_ids, *guesses[:j]] if j else base.output_token_ids,
            suppressed_token_ids=base.suppressed_token_ids,
            grammar=None if base.grammar is None else GrammarAfter(base.grammar, guesses[:j]),
            bitmask=None if masks is None else masks[j],
        )
        for j in range(len(guesses) + 1)
    ]


@dataclass(slots=True)
class _LogitsLayout:
    """Which rows of the batch have logits, when more than each sampling chunk's last do."""

    custom: bool = False  # some prefill chunk scores its prompt, or some chunk speculates
    logits_rows: list[int] = field(default_factory=list)  # flat batch rows with logits
    sample_rows: list[int] = field(default_factory=list)  # positions in the logits of the
    # ordinary sampling chunks' last rows
    speculative_rows: list[int] = field(default_factory=list)  # positions in the logits of
    # each speculative chunk's first row
    # (sequence id, position in the logits of its first row, the tokens predicted, top count)
    scored: list[tuple[str, int, Sequence[int], int]] = field(default_factory=list)


def _logits_layout(plan: StepPlan, scored: ScoredPrompts) -> _LogitsLayout:
    """Where the logits of a step come from: every row of a speculative chunk, every row of a
    prefill chunk that scores its prompt, the last row of every other sampling chunk."""
    layout = _LogitsLayout()
    row = 0
    for chunk in plan.chunks:
        last = row + chunk.num_tokens - 1
        if chunk.is_speculative:
            layout.custom = True
            layout.speculative_rows.append(len(layout.logits_rows))
            layout.logits_rows.extend(range(row, last + 1))
        elif chunk.is_prefill and chunk.request_id in scored:
            layout.custom = True
            prompt, num_top = scored[chunk.request_id]
            # Row p predicts position p + 1; the last prompt row predicts nothing yet (its
            # logits are the first sample's).
            targets = prompt[chunk.start + 1 : chunk.end + 1]
            layout.scored.append((chunk.request_id, len(layout.logits_rows), targets, num_top))
            layout.logits_rows.extend(range(row, last + 1))
            if chunk.samples:
                layout.sample_rows.append(len(layout.logits_rows) - 1)
        elif chunk.samples:
            layout.logits_rows.append(last)
            layout.sample_rows.append(len(layout.logits_rows) - 1)
        row = last + 1
    return layout
