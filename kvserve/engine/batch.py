"""Batch: the mechanism that turns a StepPlan into one forward pass and samples.

It never decides who runs; the Scheduler did. Given the plan (which carries every row's input
token id, built on the loop thread) and the row states of the sequences that sample, it runs the
plan's block copies, builds the flat inputs (token ids, positions, slots, block tables), runs the
model, and samples one token for every sequence sampling from a chunk's last row.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from kvserve.core.plan import StepPlan
from kvserve.model.attention import build_metadata
from kvserve.model.kv_cache import KVCache
from kvserve.model.llama import LlamaModel
from kvserve.sampling import RowState, Sampler


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

    def execute(self, plan: StepPlan, rows: Mapping[str, RowState]) -> StepOutput:
        """The plan's block copies, one forward pass over its rows, then one sample per
        sampling sequence (`rows`: its row state, by sequence id)."""
        for copy in plan.copies:
            self.kv_cache.copy_block(copy.source, copy.target)
        if plan.num_rows == 0:
            return StepOutput({}, 0)
        token_ids, sampling_ids, states, logits_rows = self.inputs(plan, rows)
        meta = build_metadata(plan.chunks, self.block_size, self.device, native=self.model.native)
        logits = self.model.forward(token_ids, meta, self.kv_cache)
        if len(logits_rows) != logits.shape[0]:
            # logits: [sampling chunks, vocab] -> [sampling sequences, vocab]
            index = torch.tensor(logits_rows, dtype=torch.long, device=logits.device)
            logits = logits.index_select(0, index)
        result = self.sampler.sample(logits, states)
        sampled = {
            seq_id: Sampled(token, logprob, top)
            for seq_id, token, logprob, top in zip(
                sampling_ids, result.token_ids, result.logprobs, result.top_logprobs, strict=True
            )
        }
        return StepOutput(sampled, plan.num_rows)
