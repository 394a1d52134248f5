"""Batch: the mechanism that turns a StepPlan into one forward pass and samples.

It never decides who runs; the Scheduler did. Given the plan (which carries every row's input
token id, built on the loop thread) and the row states of the sequences that sample, it runs the
plan's block copies, builds the flat inputs (token ids, positions, slots, block tables), runs the
model, and samples one token for every sequence sampling from a chunk's last row. A prefill
chunk whose prompt is to be scored (prompt log-probabilities) has logits computed for every
row, and each prompt token they predict is scored.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from kvserve.core.plan import StepPlan
from kvserve.engine.prompt_logprobs import score_rows
from kvserve.engine.sampler import RowState, Sampler
from kvserve.engine.stream import TokenLogprob
from kvserve.engine.structured import start_bitmasks
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
class StepOutput:
    sampled: dict[str, Sampled]  # sequence id -> the token it sampled
    num_rows: int
    # sequence id -> the prompt tokens this step's rows predicted (positions chunk.start + 1
    # onwards, in order), for the chunks of `scored` prompts
    prompt_logprobs: dict[str, list[TokenLogprob]] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class _Scoring:
    """Which logits rows score which prompt tokens, in a step with scored prefill chunks."""

    logits_rows: list[int]  # flat batch rows whose logits the model returns
    sample_rows: list[int]  # positions in those logits of the sampling chunks' rows
    # (sequence id, position in the logits of its first row, the tokens predicted, top count)
    chunks: list[tuple[str, int, Sequence[int], int]]


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
        """Flat token ids for every row; the sampling sequences, their row states, and for each
        the index of the logits row it samples from (several when n > 1 share a prompt)."""
        token_ids: list[int] = []
        sampling_ids: list[str] = []
        states: list[RowState] = []
        logits_rows: list[int] = []
        num_sampling_chunks = 0
        for chunk in plan.chunks:
            if len(chunk.token_ids) != chunk.num_tokens:
                raise ValueError(f"chunk of {chunk.request_id!r} carries no input tokens")
            token_ids.extend(chunk.token_ids)
            if chunk.samples:
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
        sampling sequence (`rows`: its row state, by sequence id). The prefill chunks of the
        `scored` sequences also score the prompt tokens their rows predict."""
        for copy in plan.copies:
            self.kv_cache.copy_block(copy.source, copy.target)
        if plan.num_rows == 0:
            return StepOutput({}, 0)
        token_ids, sampling_ids, states, logits_rows = self.inputs(plan, rows)
        # The grammar masks depend only on the tokens accepted so far: fill them on their own
        # thread while the forward pass runs (the rows that guess first need none, mostly).
        grammars = [
            state.grammar
            for state in states
            if state.grammar is not None and not self.sampler.guesses(state)
        ]
        masks = start_bitmasks(grammars, self.model.config.vocab_size) if grammars else None
        meta = self.model.attention.build_metadata(plan.chunks, self.block_size)
        scoring = _scoring(plan, scored) if scored else None
        if scoring is not None:
            meta.logits_indices = torch.tensor(
                scoring.logits_rows, dtype=torch.long, device=self.device
            )
        logits = self.model.forward(token_ids, meta, self.kv_cache)
        prompt_logprobs: dict[str, list[TokenLogprob]] = {}
        if scoring is not None:
            for seq_id, first, targets, num_top in scoring.chunks:
                prompt_logprobs[seq_id] = score_rows(
                    logits[first : first + len(targets)], targets, num_top
                )
            logits = logits[
                torch.tensor(scoring.sample_rows, dtype=torch.long, device=logits.device)
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
                sampling_ids, result.token_ids, result.logprobs, result.top_logprobs, strict=True
            )
        }
        return StepOutput(sampled, plan.num_rows, prompt_logprobs)


def _scoring(plan: StepPlan, scored: ScoredPrompts) -> _Scoring | None:
    """The logits rows of a step where some prefill chunk scores its prompt; None (only the
    sampling rows, the usual case) when none does."""
    wanted = [chunk.is_prefill and chunk.request_id in scored for chunk in plan.chunks]
    if not any(wanted):
        return None
    scoring = _Scoring([], [], [])
    row = 0
    for chunk, scores in zip(plan.chunks, wanted, strict=True):
        last = row + chunk.num_tokens - 1
        if scores:
            prompt, num_top = scored[chunk.request_id]
            # Row p predicts position p + 1; the last prompt row predicts nothing yet (its
            # logits are the first sample's).
            targets = prompt[chunk.start + 1 : chunk.end + 1]
            scoring.chunks.append((chunk.request_id, len(scoring.logits_rows), targets, num_top))
            scoring.logits_rows.extend(range(row, last + 1))
            if chunk.samples:
                scoring.sample_rows.append(len(scoring.logits_rows) - 1)
        elif chunk.samples:
            scoring.logits_rows.append(last)
            scoring.sample_rows.append(len(scoring.logits_rows) - 1)
        row = last + 1
    return scoring
