"""Our forward pass against transformers loading the same GGUF file (the independent reference)."""

from __future__ import annotations

import pytest
import torch

from kvserve.model.kv_cache import KVCache
from tests.model.helpers import Chunk, greedy_continuation, reference_greedy

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in one sentence why the sky is blue.",
    "List three prime numbers.",
    "def fibonacci(n):",
]


def test_logits_match_transformers_at_every_position(loaded_fp32, hf_reference):
    tokenizer = loaded_fp32.tokenizer
    messages = [
        {"role": "system", "content": "You are a concise assistant who answers in English."},
        {
            "role": "user",
            "content": "Name two rivers that flow through Paris, and explain briefly why each matters.",
        },
    ]
    ids = tokenizer.encode_chat(messages)
    assert len(ids) >= 37
    model = loaded_fp32.model
    cache = KVCache(model.config, 8, 32, torch.float32, torch.device("cpu"))
    meta = model.attention.build_metadata([Chunk(0, len(ids), [5, 2, 7], True)], 32)
    meta.logits_indices = torch.arange(len(ids))  # every position, not only the last
    ours = model.forward(torch.tensor(ids), meta, cache)
    with torch.no_grad():
        theirs = hf_reference(torch.tensor([ids])).logits[0].float()
    assert ours.shape == theirs.shape
    assert (ours - theirs).abs().max().item() <= 1e-3


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_64_tokens_match_transformers(loaded_fp32, hf_reference, prompt):
    tokenizer = loaded_fp32.tokenizer
    ids = tokenizer.encode_chat([{"role": "user", "content": prompt}])
    ours = greedy_continuation(loaded_fp32.model, ids, 64)
    theirs = reference_greedy(hf_reference, ids, 64)
    assert ours == theirs
