"""Prompt log-probabilities: how likely the model found each prompt token, given those before it.

The logits of prompt row `p` predict the token at position `p + 1`. They come from the model's
raw distribution (no logit_bias, penalties or temperature), as vLLM computes them: the figure a
perplexity or a loglikelihood benchmark reads.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvserve.engine.stream import TokenLogprob


def score_rows(logits: torch.Tensor, target_ids: Sequence[int], num_top: int) -> list[TokenLogprob]:
    """Each row's log-probability of its target token, its rank, and the `num_top` most likely
    alternatives. logits: [rows, vocab] (any float dtype); `target_ids`: one token per row."""
    if not target_ids:
        return []
    # log_probs: [rows, vocab]
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    targets = torch.tensor(target_ids, dtype=torch.long, device=log_probs.device).unsqueeze(1)
    chosen = log_probs.gather(1, targets)  # [rows, 1]
    # 1 + how many tokens are strictly more likely (ties share the better rank)
    ranks = (log_probs > chosen).sum(dim=-1).add_(1).tolist()
    chosen_values = chosen.squeeze(1).tolist()
    top_ids: list[list[int]] = [[] for _ in target_ids]
    top_values: list[list[float]] = [[] for _ in target_ids]
    if num_top > 0:
        values, ids = log_probs.topk(min(num_top, log_probs.shape[1]), dim=-1, sorted=True)
        top_ids, top_values = ids.tolist(), values.tolist()
    return [
        TokenLogprob(
            token_id,
            chosen_values[row],
            tuple(zip(top_ids[row], top_values[row], strict=True)),
            ranks[row],
        )
        for row, token_id in enumerate(target_ids)
    ]
