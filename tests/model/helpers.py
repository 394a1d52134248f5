"""Small drivers for the model alone (no scheduler): a chunk record, a greedy loop, and a
check that a kernel gives the same results on any number of threads."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kvserve.model.kv_cache import KVCache


@dataclass
class Chunk:
    start: int
    num_tokens: int
    block_ids: list[int]
    samples: bool


def greedy_continuation(model, prompt_ids: list[int], num_tokens: int) -> list[int]:
    """Greedy tokens from our model: one prefill, then one decode row per token (no EOS stop)."""
    device = model.device
    blocks = list(range(-(-(len(prompt_ids) + num_tokens) // 32)))
    cache = KVCache(model.config, len(blocks), 32, model.dtype, device)
    meta = model.attention.build_metadata([Chunk(0, len(prompt_ids), blocks, True)], 32)
    logits = model.forward(torch.tensor(prompt_ids, device=device), meta, cache)
    out = [int(logits[0].argmax())]
    while len(out) < num_tokens:
        pos = len(prompt_ids) + len(out) - 1
        meta = model.attention.build_metadata([Chunk(pos, 1, blocks, True)], 32)
        logits = model.forward(torch.tensor([out[-1]], device=device), meta, cache)
        out.append(int(logits[0].argmax()))
    return out


def reference_greedy(reference, prompt_ids: list[int], num_tokens: int) -> list[int]:
    """Greedy tokens from a transformers model with its own KV cache (never stopping at EOS)."""
    out: list[int] = []
    with torch.no_grad():
        result = reference(torch.tensor([prompt_ids]), use_cache=True)
        while True:
            out.append(int(result.logits[0, -1].argmax()))
            if len(out) == num_tokens:
                return out
            result = reference(
                torch.tensor([[out[-1]]]), past_key_values=result.past_key_values, use_cache=True
            )


def assert_the_same_on_any_number_of_threads(
    compute: Callable[[], Sequence[torch.Tensor]], counts=(2, 3, 8), repeats: int = 3
) -> Sequence[torch.Tensor]:
    """compute()'s tensors on each of `counts` threads, `repeats` times, equal to one thread's,
    bit for bit; returns one thread's. With more threads than cores some wait for a core and the
    others take over their share of the work (csrc/task_ranges.h); compute() should give tensors
    of two inputs in turn, so that a share left out would keep the other input's results."""
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = compute()
        for count in counts:
            torch.set_num_threads(count)
            for _ in range(repeats):
                for got, expect in zip(compute(), alone, strict=True):
                    assert torch.equal(got, expect), count
    finally:
        torch.set_num_threads(threads)
    return alone
