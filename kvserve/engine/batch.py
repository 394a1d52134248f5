"""Batch: the mechanism that turns a StepPlan into one forward pass and samples.

It never decides who runs; the Scheduler did. Given the plan and each request's tokens so far,
it builds the flat inputs (token ids, positions, slots, block tables), runs the model, and
samples one token for every chunk whose last row needs logits.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from kvserve.core.plan import StepPlan
from kvserve.engine.sampler import RowState, Sampler
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
        logits = self.model.forward(token_ids, meta, self.kv_cache)
        result = self.sampler.sample(logits, rows)
        sampled = {
            request_id: Sampled(token, logprob, top)
            for request_id, token, logprob, top in zip(
                sampling_ids, result.token_ids, result.logprobs, result.top_logprobs, strict=True
            )
        }
        return StepOutput(sampled, plan.num_rows)
