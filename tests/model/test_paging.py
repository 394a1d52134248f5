"""Paging is invisible: how a sequence is chunked and where its blocks live never changes logits."""

from __future__ import annotations

import random

import pytest
import torch

from kvserve.model.kv_cache import KVCache
from tests.model.helpers import Chunk

CPU = torch.device("cpu")


def backend(model, native: bool):
    """The model as loaded (the C kernels' attention) or attending by torch ops."""
    assert model.attention.name == "cpu-paged", "the C kernels must build on this machine"
    return model if native else model.torch_attention()


def run_chunked(model, ids: list[int], chunk_sizes: list[int], blocks: list[int], native: bool):
    """Feed `ids` in chunks of the given sizes; return the last position's logits."""
    model = backend(model, native)
    cache = KVCache(model.config, 64, 32, model.dtype, CPU)
    start, logits = 0, None
    for size in chunk_sizes:
        meta = model.attention.build_metadata([Chunk(start, size, blocks, True)], 32)
        logits = model.forward(torch.tensor(ids[start : start + size]), meta, cache)
        start += size
    assert start == len(ids)
    return logits[0]


@pytest.fixture(scope="module")
def prompt(loaded_fp32):
    text = (
        "The paged KV cache splits every sequence into fixed blocks of thirty-two positions, "
        "allocated on demand from one shared pool, so that memory is never reserved for "
        "tokens that are never generated. This sentence is long enough to span blocks."
    )
    ids = loaded_fp32.tokenizer.encode(text)
    assert len(ids) > 40
    return ids


@pytest.mark.parametrize("native", [True, False], ids=["c-kernel", "torch"])
def test_one_prefill_chunks_of_seven_and_token_by_token_agree(loaded_fp32, prompt, native):
    model = loaded_fp32.model
    blocks = [17, 3, 40, 9]  # non-contiguous, out of order
    whole = run_chunked(model, prompt, [len(prompt)], blocks, native)
    sevens = [7] * (len(prompt) // 7) + ([len(prompt) % 7] if len(prompt) % 7 else [])
    by_seven = run_chunked(model, prompt, sevens, blocks, native)
    by_token = run_chunked(model, prompt, [1] * len(prompt), blocks, native)
    assert (whole - by_seven).abs().max().item() <= 1e-4
    assert (whole - by_token).abs().max().item() <= 1e-4


def test_block_placement_does_not_matter(loaded_fp32, prompt):
    model = loaded_fp32.model
    a = run_chunked(model, prompt, [len(prompt)], [0, 1, 2, 3], True)
    b = run_chunked(model, prompt, [len(prompt)], [63, 12, 50, 7], True)
    assert (a - b).abs().max().item() <= 1e-5


@pytest.mark.parametrize("native", [True, False], ids=["c-kernel", "torch"])
def test_interleaved_sequences_match_each_alone(loaded_fp32, native):
    """Several sequences in one flat batch — prefill chunks and decode rows mixed, shuffled
    block tables drawn from one pool — give the logits each gives alone."""
    model = loaded_fp32.model
    tokenizer = loaded_fp32.tokenizer
    texts = [
        "A river runs through the old town, past the mill and under seven bridges.",
        "Prime numbers: two, three, five, seven, eleven, thirteen, seventeen, nineteen.",
        "def add(a, b):\n    return a + b\n\nprint(add(2, 3))",
        "Bonjour, je voudrais un café au lait et un croissant, s'il vous plaît.",
    ]
    seqs = [tokenizer.encode(t) for t in texts]
    rng = random.Random(7)
    pool = list(range(48))
    rng.shuffle(pool)
    tables = [[pool.pop() for _ in range(3)] for _ in seqs]

    # Alone: each sequence's final-position logits after feeding it in two pieces.
    alone = []
    for ids, table in zip(seqs, tables, strict=True):
        alone.append(run_chunked(model, ids, [len(ids) - 1, 1], table, native))

    # Together: step 1 prefills all but the last token of every sequence, chunked unevenly and
    # interleaved; step 2 runs the last token of each as a decode row in one flat batch.
    model = backend(model, native)
    cache = KVCache(model.config, 48, 32, model.dtype, CPU)
    done = [0] * len(seqs)
    order = [0, 2, 1, 3]
    while any(done[i] < len(seqs[i]) - 1 for i in order):
        chunks, ids = [], []
        for i in order:
            remaining = len(seqs[i]) - 1 - done[i]
            if remaining <= 0:
                continue
            size = min(remaining, rng.choice([3, 5, 9, 13]))
            chunks.append(Chunk(done[i], size, tables[i], False))
            ids += seqs[i][done[i] : done[i] + size]
            done[i] += size
        meta = model.attention.build_metadata(chunks, 32)
        model.forward(torch.tensor(ids), meta, cache)
    chunks = [Chunk(len(s) - 1, 1, t, True) for s, t in zip(seqs, tables, strict=True)]
    meta = model.attention.build_metadata(chunks, 32)
    together = model.forward(torch.tensor([s[-1] for s in seqs]), meta, cache)
    for i in range(len(seqs)):
        assert (together[i] - alone[i]).abs().max().item() <= 1e-4


def test_prefill_and_decode_rows_mixed_in_one_step(loaded_fp32):
    """A prefill chunk and decode rows of other sequences in the same forward call."""
    model = loaded_fp32.model
    tok = loaded_fp32.tokenizer
    a = tok.encode("The quick brown fox jumps over the lazy dog near the river bank.")
    b = tok.encode("Water boils at one hundred degrees Celsius at sea level.")
    alone_a = run_chunked(model, a, [len(a)], [4, 1], True)
    alone_b = run_chunked(model, b, [len(b) - 1, 1], [9, 2], True)
    cache = KVCache(model.config, 16, 32, model.dtype, CPU)
    meta = model.attention.build_metadata([Chunk(0, len(b) - 1, [9, 2], False)], 32)
    model.forward(torch.tensor(b[:-1]), meta, cache)
    meta = model.attention.build_metadata(
        [Chunk(0, len(a), [4, 1], True), Chunk(len(b) - 1, 1, [9, 2], True)], 32
    )
    both = model.forward(torch.tensor(a + b[-1:]), meta, cache)
    assert (both[0] - alone_a).abs().max().item() <= 1e-4
    assert (both[1] - alone_b).abs().max().item() <= 1e-4
