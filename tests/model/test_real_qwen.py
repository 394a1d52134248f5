"""The real qwen2.5-coder:0.5b (Q4_K_M: Q4_K, Q6_K, Q5_0 and Q8_0 tensors) in float32, held to
transformers loading the same GGUF file dequantized: logits at every position and greedy
continuations; and chat answers that make sense."""

from __future__ import annotations

import re

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.model.attention import build_metadata
from kvserve.model.kv_cache import KVCache
from tests.engine.helpers import make_config
from tests.model.helpers import Chunk, reference_greedy

pytestmark = pytest.mark.slow

PROMPTS = [
    "What is the capital of France?",
    "Write a Python function that reverses a string.",
    "Explain in one sentence what a hash table is.",
]


@pytest.fixture(scope="module")
def qwen05_reference(qwen05_path):
    """transformers' model for the same file in float32 (about 2.5 GB), for this module only."""
    import gguf
    from transformers import AutoModelForCausalLM

    # transformers opens the file twice (its config, then its weights), and each GGUFReader
    # parses the 300k strings of the tokenizer again (half a minute here): one reader serves
    # both.
    readers = {}
    real_reader = gguf.GGUFReader

    def reader(path, *args, **kwargs):
        key = (str(path), args, tuple(sorted(kwargs.items())))
        if key not in readers:
            readers[key] = real_reader(path, *args, **kwargs)
        return readers[key]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf, "GGUFReader", reader)
        model = AutoModelForCausalLM.from_pretrained(
            str(qwen05_path.parent), gguf_file=qwen05_path.name, dtype=torch.float32
        )
    model.eval()
    return model


def test_logits_match_transformers_at_every_position(qwen05_fp32, qwen05_reference):
    messages = [
        {"role": "system", "content": "You are a helpful coding assistant."},
        {
            "role": "user",
            "content": "Why does Python's sort keep equal elements in their original order, "
            "and when does that matter for sorting records by two keys?",
        },
    ]
    ids = qwen05_fp32.tokenizer.encode_chat(messages)
    assert len(ids) > 32  # more than one KV block
    model = qwen05_fp32.model
    cache = KVCache(model.config, 4, 32, torch.float32, torch.device("cpu"))
    meta = build_metadata([Chunk(0, len(ids), [3, 0], True)], 32, torch.device("cpu"))
    meta.logits_indices = torch.arange(len(ids))  # every position, not only the last
    ours = model.forward(torch.tensor(ids), meta, cache)
    with torch.no_grad():
        theirs = qwen05_reference(torch.tensor([ids])).logits[0].float()
    assert ours.shape == theirs.shape == (len(ids), qwen05_fp32.config.vocab_size)
    assert (ours - theirs).abs().max().item() <= 1e-3


def batched_greedy(model, prompts: list[list[int]], num_tokens: int) -> list[list[int]]:
    """Greedy tokens from our model for several sequences at once: one prefill of all the
    prompts, then one decode row per sequence per step (each weight is read once a step)."""
    device = model.device
    tables, start = [], 0
    for ids in prompts:
        count = -(-(len(ids) + num_tokens) // 32)
        tables.append(list(range(start, start + count)))
        start += count
    cache = KVCache(model.config, start, 32, model.dtype, device)
    chunks = [Chunk(0, len(ids), table, True) for ids, table in zip(prompts, tables, strict=True)]
    flat = torch.tensor([t for ids in prompts for t in ids], device=device)
    logits = model.forward(flat, build_metadata(chunks, 32, device), cache)
    out = [[int(row.argmax())] for row in logits]  # logits: [sequences, vocab]
    while len(out[0]) < num_tokens:
        chunks = [
            Chunk(len(ids) + len(tokens) - 1, 1, table, True)
            for ids, tokens, table in zip(prompts, out, tables, strict=True)
        ]
        last = torch.tensor([tokens[-1] for tokens in out], device=device)
        logits = model.forward(last, build_metadata(chunks, 32, device), cache)
        for tokens, row in zip(out, logits, strict=True):
            tokens.append(int(row.argmax()))
    return out


def test_greedy_32_tokens_match_transformers(qwen05_fp32, qwen05_reference):
    prompts = [
        qwen05_fp32.tokenizer.encode_chat([{"role": "user", "content": prompt}])
        for prompt in PROMPTS
    ]
    ours = batched_greedy(qwen05_fp32.model, prompts, 32)
    for prompt, ids, tokens in zip(PROMPTS, prompts, ours, strict=True):
        assert tokens == reference_greedy(qwen05_reference, ids, 32), prompt


def test_chat_answers_are_sensible(qwen05_fp32):
    with LLM(config=make_config(slots=2, blocks=32, max_model_len=512), loaded=qwen05_fp32) as llm:
        capital, square = llm.chat(
            [
                [{"role": "user", "content": "What is the capital of France?"}],
                [
                    {
                        "role": "user",
                        "content": "Write a Python function square(x) that returns x squared.",
                    }
                ],
            ],
            SamplingParams(max_tokens=40),
        )
    assert "Paris" in capital.outputs[0].text
    code = square.outputs[0].text
    assert re.search(r"def square\(x\)", code), code
    assert re.search(r"return x \*\* ?2|return x \* x", code), code
