"""The int8 KV cache (`--kv-cache-dtype int8`): its kernels, and the model and engine on it."""

from __future__ import annotations

import asyncio

import pytest
import torch
import torch.nn.functional as F

from kvserve.bench.quality import chunk_logits
from kvserve.config import CacheConfig
from kvserve.model.kernels import load_kernels
from kvserve.model.kv_cache import KVCache, bytes_per_block, choose_pool_size
from tests.engine.helpers import collect, make_config, request, run_engine, tokens_of
from tests.engine.test_engine import chat_ids
from tests.model.test_quant import follows_float32

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def native(kernels):
    return kernels


needs_kernels = pytest.mark.skipif(
    not load_kernels().kv_int8, reason="needs the C kernels and AVX512-VNNI"
)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def dequantized(kv: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The float K and V an int8 cache layer holds ([2, kv_heads, blocks, block, head_dim])."""
    k = (kv[0].view(torch.uint8).int() - 128).float()  # K bytes are stored biased by 128
    v = kv[1].float()
    return torch.stack([k, v]) * scales[..., None]


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_store_q8_rotates_like_rope_store_and_quantizes_each_row(dtype, native):
    heads, kv_heads, head_dim, rows = 4, 2, 64, 6
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * head_dim, generator=gen(1)).to(dtype)
    positions = torch.tensor([0, 1, 2, 40, 41, 300])
    slots = torch.tensor([5, 6, 7, 70, 71, 99])
    inv = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    angles = torch.outer(torch.arange(512).float(), inv)
    cos, sin = angles.cos(), angles.sin()

    expect_qkv = qkv.clone()
    reference = torch.zeros(2, kv_heads, 4, 32, head_dim, dtype=dtype)
    native.rope_store(expect_qkv, positions, cos, sin, slots, reference, heads, kv_heads, head_dim)

    kv = torch.zeros(2, kv_heads, 4, 32, head_dim, dtype=torch.int8)
    scales = torch.zeros(2, kv_heads, 4, 32)
    native.rope_store(qkv, positions, cos, sin, slots, kv, heads, kv_heads, head_dim, scales)
    assert torch.equal(qkv, expect_qkv)

    want = reference.float().view(2, kv_heads, 128, head_dim)[:, :, slots]
    got = dequantized(kv, scales).view(2, kv_heads, 128, head_dim)[:, :, slots]
    step = scales.view(2, kv_heads, 128)[:, :, slots]
    assert torch.allclose(step, want.abs().amax(-1) / 127, rtol=1e-6)
    assert bool(((got - want).abs() <= step[..., None] * 0.5 * (1 + 1e-4) + 1e-7).all())
    untouched = torch.ones(128, dtype=torch.bool)
    untouched[slots] = False
    assert kv.view(2, kv_heads, 128, head_dim)[:, :, untouched].abs().max() == 0


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("heads", [8, 6])  # groups of 4 (registers) and of 3
def test_int8_paged_attention_matches_sdpa_on_the_dequantized_cache(dtype, head_dim, heads, native):
    kv_heads, block_size, num_blocks = 2, 32, 12
    kv = torch.randint(-127, 128, (2, kv_heads, num_blocks, block_size, head_dim), dtype=torch.int8)
    scales = torch.rand(2, kv_heads, num_blocks, block_size, generator=gen(2)) / 40
    lengths = torch.tensor([1, 33, 70, 96])
    tables = torch.tensor([[3, 0, 0], [7, 1, 0], [2, 9, 4], [11, 5, 6]])
    q = torch.randn(4, heads, head_dim, generator=gen(3)).to(dtype)
    out = torch.empty_like(q)
    native.paged_attention(q, kv, tables, lengths, out, head_dim**-0.5, kv_scales=scales)
    cache = dequantized(kv, scales)
    for i in range(4):
        n = int(lengths[i])
        keys = cache[:, :, tables[i]].flatten(2, 3)[:, :, :n]  # [2, kv_heads, n, d]
        k = keys[0].repeat_interleave(heads // kv_heads, 0)
        v = keys[1].repeat_interleave(heads // kv_heads, 0)
        expect = F.scaled_dot_product_attention(q[i].float()[:, None], k, v)[:, 0]
        # the query is quantized per head too: scores carry ~1% error
        error = (out[i].float() - expect).abs().max() / expect.abs().max()
        assert error < 0.03, error


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("head_dim", "heads", "kv_heads", "block_size"),
    # block sizes: the default, odd ones, and one past 256 (whose rows go one at a time)
    [
        (64, 9, 3, 32),
        (64, 4, 4, 10),
        (128, 8, 2, 16),
        (64, 16, 1, 3),
        (128, 6, 2, 33),
        (64, 4, 2, 300),
    ],
)
@pytest.mark.parametrize("sharpness", [1.0, 8.0])  # flat and peaked attention
def test_int8_prefill_tiles_match_each_row_alone_and_sdpa(
    dtype, head_dim, heads, kv_heads, block_size, sharpness, native
):
    """Rows of a prefill chunk on the int8 cache are worked on in tiles (kv_int8.c: scores and
    values in VNNI instructions, the softmax weights as 16-bit integers), in the same arithmetic
    as a row alone: every row equals, bit for bit, the same row computed by itself, and causal
    attention over the dequantized cache, for chunks that start and end mid-block and span
    several tiles, next to a decode row of another sequence."""
    start, n = 45, 37
    used = -(-(start + n) // block_size)
    kv = torch.randint(
        -127, 128, (2, kv_heads, used + 5, block_size, head_dim), dtype=torch.int8, generator=gen(4)
    )
    scales = torch.rand(2, kv_heads, used + 5, block_size, generator=gen(5)) / 40 + 1e-3
    tables = torch.zeros(2, used, dtype=torch.long)
    tables[0] = torch.randperm(used + 4, generator=gen(6))[:used]  # scattered, out of order
    tables[1, 0] = used + 4
    lengths = torch.cat([torch.arange(start + 1, start + n + 1), torch.tensor([9])])
    row_tables = torch.tensor([0] * n + [1])
    q = (torch.randn(n + 1, heads, head_dim, generator=gen(7)) * sharpness).to(dtype)
    scale = head_dim**-0.5
    out = torch.empty_like(q)
    native.paged_attention(q, kv, tables, lengths, out, scale, row_tables, kv_scales=scales)

    alone = torch.empty_like(q)
    for i in range(n + 1):
        table = tables[row_tables[i]][None]
        native.paged_attention(
            q[i : i + 1], kv, table, lengths[i : i + 1], alone[i : i + 1], scale, kv_scales=scales
        )
    assert torch.equal(out, alone)  # a row's result does not depend on its tile
    if sharpness > 1:
        return  # the query's own int8 rounding moves peaked scores past SDPA's tolerance

    cache = dequantized(kv, scales)
    group = heads // kv_heads
    keys = cache[:, :, tables[0]].flatten(2, 3)[:, :, : start + n]
    mask = torch.ones(n, start + n, dtype=torch.bool).tril(diagonal=start)
    expect = F.scaled_dot_product_attention(
        q[:n].float().transpose(0, 1),
        keys[0].repeat_interleave(group, 0),
        keys[1].repeat_interleave(group, 0),
        attn_mask=mask,
        scale=scale,
    ).transpose(0, 1)
    # the query is quantized per head too: scores carry ~1% error
    error = (out[:n].float() - expect).abs().max() / expect.abs().max()
    assert error < 0.03, error
    other = cache[:, :, tables[1]].flatten(2, 3)[:, :, :9]
    expect_last = F.scaled_dot_product_attention(
        q[n].float()[:, None],
        other[0].repeat_interleave(group, 0),
        other[1].repeat_interleave(group, 0),
        scale=scale,
    )[:, 0]
    assert (out[n].float() - expect_last).abs().max() / expect_last.abs().max() < 0.03


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_attention_does_not_depend_on_the_block_size(dtype, native):
    """The same positions laid out in blocks of 32, 10, 3 and 300 give bit-identical attention,
    for a prefill chunk of 40 rows after 600 positions (spans of 256 keys, tiles of 32 rows) and
    a decode row."""
    kv_heads, heads, head_dim, length = 2, 6, 64, 640
    positions = torch.randint(
        -127, 128, (2, kv_heads, length, head_dim), dtype=torch.int8, generator=gen(11)
    )
    position_scales = torch.rand(2, kv_heads, length, generator=gen(12)) / 40 + 1e-3
    q = torch.randn(41, heads, head_dim, generator=gen(13)).to(dtype)
    lengths = torch.cat([torch.arange(601, 641), torch.tensor([333])])
    results = []
    for block_size in (32, 10, 3, 300):
        used = -(-length // block_size)
        order = torch.randperm(used + 2, generator=gen(block_size))[:used]  # scattered blocks
        kv = torch.zeros(2, kv_heads, used + 2, block_size, head_dim, dtype=torch.int8)
        scales = torch.zeros(2, kv_heads, used + 2, block_size)
        for position in range(length):
            block, offset = order[position // block_size], position % block_size
            kv[:, :, block, offset] = positions[:, :, position]
            scales[:, :, block, offset] = position_scales[:, :, position]
        tables = order[None].repeat(2, 1)
        row_tables = torch.tensor([0] * 40 + [1])
        out = torch.empty_like(q)
        native.paged_attention(
            q, kv, tables, lengths, out, head_dim**-0.5, row_tables, kv_scales=scales
        )
        results.append(out)
    for other in results[1:]:
        assert torch.equal(results[0], other)


def test_int8_cache_holds_scales_and_counts_them():
    from kvserve.model.config import ModelConfig

    config = ModelConfig(
        architecture="llama",
        vocab_size=10,
        hidden_size=128,
        intermediate_size=256,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        head_dim=64,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    )
    cache = KVCache(config, 3, 32, torch.int8, CPU)
    assert cache.quantized and cache.layer_scales(1).shape == (2, 1, 3, 32)
    assert cache.num_bytes == 3 * bytes_per_block(config, 32, torch.int8)
    # about half of bf16: 64 bytes and a 4-byte scale per row instead of 128 bytes
    assert (
        bytes_per_block(config, 32, torch.int8) * 128
        == bytes_per_block(config, 32, torch.bfloat16) * 68
    )
    sized = choose_pool_size(
        config,
        block_size=32,
        dtype=torch.int8,
        device=CPU,
        max_num_seqs=1,
        max_model_len=64,
        kv_cache_memory=2**20,
    )
    bf16 = choose_pool_size(
        config,
        block_size=32,
        dtype=torch.bfloat16,
        device=CPU,
        max_num_seqs=1,
        max_model_len=64,
        kv_cache_memory=2**20,
    )
    assert sized.num_blocks > 1.8 * bf16.num_blocks
    assert not KVCache(config, 3, 32, torch.bfloat16, CPU).quantized


def test_unknown_kv_cache_dtype_is_refused():
    with pytest.raises(ValueError, match="unknown kv_cache_dtype 'fp8'"):
        CacheConfig(kv_cache_dtype="fp8")


@needs_kernels
def test_bf16_model_on_int8_cache_follows_float32(loaded_bf16, loaded_fp32):
    follows_float32(loaded_bf16, loaded_fp32, torch.int8)


@needs_kernels
def test_int8_model_on_int8_cache_follows_float32(loaded_int8, loaded_fp32):
    follows_float32(loaded_int8, loaded_fp32, torch.int8)


@needs_kernels
def test_engine_on_int8_cache_is_batch_invariant_and_answers(loaded_int8):
    """int8 linear layers on an int8 cache: every row is computed alone, so greedy tokens in a
    batch equal those run alone; and the answer is still right."""
    prompts = [
        chat_ids(loaded_int8, p)
        for p in (
            "What is the capital of France?",
            "Name three colours.",
            "Write a haiku about rain.",
            "What is 12 times 12?",
            "Who wrote Hamlet?",
            "Describe a cat in one sentence.",
        )
    ]
    params = dict(max_tokens=20, temperature=0)

    async def together(engine):
        streams = [engine.submit(request(p, **params)) for p in prompts]
        return [tokens_of(d) for d in await asyncio.gather(*(collect(s) for s in streams))]

    async def alone(engine):
        return [tokens_of(await collect(engine.submit(request(p, **params)))) for p in prompts]

    config = make_config(slots=8, blocks=64, kv_cache_dtype="int8")
    batched = run_engine(loaded_int8, config, together)
    assert batched == run_engine(loaded_int8, config, alone)
    assert "Paris" in loaded_int8.tokenizer.decode(batched[0])


def test_engine_refuses_int8_cache_for_models_without_the_fused_path(tmp_path, loaded_fp32):
    from dataclasses import replace

    from kvserve.engine.engine import Engine
    from kvserve.model.llama import LlamaModel
    from kvserve.model.safetensors import SafetensorsCheckpoint
    from tests.model.test_safetensors import save_tiny, tiny_config

    save_tiny(tmp_path, tiny_config("qwen3"))  # head_dim 32: no C kernels for it
    checkpoint = SafetensorsCheckpoint(tmp_path)
    model = LlamaModel.from_tensors(
        checkpoint.config,
        checkpoint.get,
        dtype=torch.float32,
        device=CPU,
        kernels=loaded_fp32.kernels,
    )
    loaded = replace(loaded_fp32, model=model, config=checkpoint.config, path=tmp_path)
    with pytest.raises(ValueError, match="--kv-cache-dtype int8"):
        Engine(make_config(kv_cache_dtype="int8"), loaded)
    # and the model refuses such a cache if handed one directly
    cache = KVCache(checkpoint.config, 2, 32, torch.int8, CPU)
    with pytest.raises(ValueError, match="--kv-cache-dtype int8"):
        _all_logits_on(model, cache)


@needs_kernels
def test_qk_norm_model_on_an_int8_cache_follows_its_float_cache(tmp_path, kernels):
    """q/k norms (qwen3) run between the qkv product and the int8 cache write."""
    from kvserve.model.llama import LlamaModel
    from kvserve.model.safetensors import SafetensorsCheckpoint
    from tests.model.test_safetensors import save_tiny, tiny_config

    save_tiny(tmp_path, tiny_config("qwen3", head_dim=64))
    checkpoint = SafetensorsCheckpoint(tmp_path)
    model = LlamaModel.from_tensors(
        checkpoint.config, checkpoint.get, dtype=torch.float32, device=CPU, kernels=kernels
    )
    assert model.supports_int8_kv_cache
    ids = list(range(3, 70))
    exact = torch.cat(list(chunk_logits(model, ids)))
    quantized = torch.cat(list(chunk_logits(model, ids, cache_dtype=torch.int8)))
    cosine = F.cosine_similarity(exact, quantized, dim=-1)
    assert float(cosine.min()) > 0.99


def _all_logits_on(model, cache):
    from tests.model.helpers import Chunk

    meta = model.attention.build_metadata([Chunk(0, 3, [0], True)], 32)
    return model.forward(torch.tensor([1, 2, 3]), meta, cache)


def test_cli_flag_reaches_the_cache_config():
    import argparse

    from kvserve.cli import add_engine_arguments, engine_config_from_args

    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    assert engine_config_from_args(parser.parse_args([])).cache.kv_cache_dtype == "auto"
    args = parser.parse_args(["--kv-cache-dtype", "int8"])
    assert engine_config_from_args(args).cache.kv_cache_dtype == "int8"
