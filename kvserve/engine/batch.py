"""Batch: the mechanism that turns a StepPlan into one forward pass and samples.

It never decides who runs; the Scheduler did. Given the plan and each request's tokens so far,
it builds the flat inputs (token ids, positions, slots, block tables), runs the model, and
samples one token for every chunk whose last row needs logits. A prefill chunk of a request that
asked for prompt logprobs has logits computed for every row, and each prompt token they predict
is scored.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from kvserve.core.plan import StepPlan
from kvserve.engine.prompt_logprobs import score_rows
from kvserve.engine.sampler import RowState, Sampler
from kvserve.engine.stream import TokenLogprob
from kvserve.model.attention import build_metadata
from kvserve.model.kv_cache import KVCache
from kvserve.model.llama import LlamaModel


class SequenceTokens(Protocol):
    """What the Batch reads from a request: its tokens and how to sample it."""

    @property
    def all_token_ids(self) -> Sequence[int]: ...  # prompt then output

    def row_state(self) -> RowState: ...


@dataclass(frozen=True, slots=True)
class Sampled:
    token_id: int
    logprob: float | None
    top_logprobs: list[tuple[int, float]] | None


@dataclass(frozen=True, slots=True)
class StepOutput:
    sampled: dict[str, Sampled]  # request_id -> the token its sampling chunk produced
    num_rows: int
    # request_id -> the prompt tokens this step's rows predicted (positions chunk.start + 1
    # onwards, in order), for requests that asked for prompt logprobs
    prompt_logprobs: dict[str, list[TokenLogprob]] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class _Scoring:
    """Which logits rows score which prompt tokens, in a step with prompt-logprob chunks."""

    logits_rows: list[int]  # flat batch rows whose logits the model returns
    sample_rows: list[int]  # positions in those logits of the sampling chunks' rows
    # (request_id, position in the logits of its first row, the tokens predicted, top count)
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
        self, plan: StepPlan, sequences: Mapping[str, SequenceTokens]
    ) -> tuple[torch.Tensor, list[str], list[RowState]]:
        """Flat token ids for every row, and the sampling chunks' request ids and row states."""
        token_ids: list[int] = []
        sampling_ids: list[str] = []
        rows: list[RowState] = []
        for chunk in plan.chunks:
            seq = sequences[chunk.request_id]
            tokens = seq.all_token_ids
            token_ids.extend(tokens[chunk.start : chunk.start + chunk.num_tokens])
            if chunk.samples:
                sampling_ids.append(chunk.request_id)
                rows.append(seq.row_state())
        ids = torch.tensor(token_ids, dtype=torch.long).to(self.device, non_blocking=True)
        return ids, sampling_ids, rows

    def execute(self, plan: StepPlan, sequences: Mapping[str, SequenceTokens]) -> StepOutput:
        """One forward pass over the plan's rows, then one sample per sampling chunk."""
        if plan.num_rows == 0:
            return StepOutput({}, 0)
        token_ids, sampling_ids, rows = self.inputs(plan, sequences)
        meta = build_metadata(plan.chunks, self.block_size, self.device, native=self.model.native)
        scoring = _scoring(plan, sequences)
        if scoring is not None:
            meta.logits_indices = torch.tensor(
                scoring.logits_rows, dtype=torch.long, device=self.device
            )
        logits = self.model.forward(token_ids, meta, self.kv_cache)
        prompt_logprobs: dict[str, list[TokenLogprob]] = {}
        if scoring is not None:
            for request_id, first, targets, num_top in scoring.chunks:
                scored = logits[first : first + len(targets)]
                prompt_logprobs[request_id] = score_rows(scored, targets, num_top)
            logits = logits[
                torch.tensor(scoring.sample_rows, dtype=torch.long, device=logits.device)
            ]
        result = self.sampler.sample(logits, rows)
        sampled = {
            request_id: Sampled(token, logprob, top)
            for request_id, token, logprob, top in zip(
                sampling_ids, result.token_ids, result.logprobs, result.top_logprobs, strict=True
            )
        }
        return StepOutput(sampled, plan.num_rows, prompt_logprobs)


def _scoring(plan: StepPlan, sequences: Mapping[str, SequenceTokens]) -> _Scoring | None:
    """The logits rows of a step where some prefill chunk wants its prompt scored; None (only
    the sampling rows, the usual case) when none does."""
    wanted = [
        chunk.is_prefill
        and sequences[chunk.request_id].row_state().params.prompt_logprobs is not None
        for chunk in plan.chunks
    ]
    if not any(wanted):
        return None
    scoring = _Scoring([], [], [])
    row = 0
    for chunk, scores in zip(plan.chunks, wanted, strict=True):
        last = row + chunk.num_tokens - 1
        if scores:
            seq = sequences[chunk.request_id]
            # Row p predicts position p + 1; during prefill the tokens are the prompt, so the
            # last prompt row predicts nothing yet (its logits are the first sample's).
            targets = seq.all_token_ids[chunk.start + 1 : chunk.end + 1]
            num_top = seq.row_state().params.prompt_logprobs
            scoring.chunks.append((chunk.request_id, len(scoring.logits_rows), targets, num_top))
            scoring.logits_rows.extend(range(row, last + 1))
            if chunk.samples:
                scoring.sample_rows.append(len(scoring.logits_rows) - 1)
        elif chunk.samples:
            scoring.logits_rows.append(last)
            scoring.sample_rows.append(len(scoring.logits_rows) - 1)
        row = last + 1
    return scoring
