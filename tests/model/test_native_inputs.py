"""The C kernels defend themselves: every method of kvserve.model.kernels.CpuKernels takes zero rows
without entering C, refuses shapes and dtypes it cannot take (KernelInputError, nothing run),
and a step whose indices point outside the cache or the RoPE tables is refused before its first
kernel, in every configuration. None of these may signal or corrupt memory."""

from __future__ import annotations

import pytest
import torch

from kvserve.model.kernels import DriverStep, KernelInputError, load_kernels
from kvserve.model.kv_cache import KVCache
from kvserve.model.linear.int8 import pack_int8_weight
from tests.configurations import params
from tests.model.helpers import Chunk

CPU = torch.device("cpu")
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 64
WIDTH = (HEADS + 2 * KV_HEADS) * HEAD_DIM
needs_int8_gemm = pytest.mark.skipif(
    not load_kernels().int8_gemm_isa, reason="needs AVX512-VNNI or AVX2"
)


@pytest.fixture(scope="module")
def native(kernels):
    assert kernels.available, "the C kernels must build on this machine"
    return kernels


def tables(rows: int = 0):
    cos = torch.ones(64, HEAD_DIM // 2)
    return cos, torch.zeros(64, HEAD_DIM // 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_zero_rows_reach_no_kernel(dtype, native):
    empty_i64 = torch.empty(0, dtype=torch.int64)
    x = torch.empty(0, 128)
    assert native.add_rmsnorm(x, None, torch.ones(128), 1e-5, dtype).shape == (0, 128)
    assert native.silu_mul(torch.empty(0, 96, dtype=dtype)).shape == (0, 48)
    cos, sin = tables()
    for cache_dtype, scales in ((dtype, None), (torch.int8, torch.zeros(2, KV_HEADS, 4, 32))):
        kv = torch.zeros(2, KV_HEADS, 4, 32, HEAD_DIM, dtype=cache_dtype)
        qkv = torch.empty(0, WIDTH, dtype=dtype)
        native.rope_store(
            qkv, empty_i64, cos, sin, empty_i64, kv, HEADS, KV_HEADS, HEAD_DIM, scales
        )
        q = torch.empty(0, HEADS, HEAD_DIM, dtype=dtype)
        out = torch.empty_like(q)
        native.paged_attention(
            q, kv, torch.zeros(1, 2, dtype=torch.int64), empty_i64, out, 0.1, empty_i64, scales
        )
        assert not kv.any()  # nothing was written
    q8, s = native.quantize_rows(torch.empty(0, 64, dtype=dtype))
    assert q8.shape == (0, 64) and s.shape == (0,)
    q8, s = native.add_rmsnorm_q8(x, None, None, None, 1e-5)
    assert q8.shape == (0, 128)
    acc = torch.empty(0, 128, dtype=torch.int32)
    native.add_rmsnorm_q8(x, acc, torch.empty(0), torch.ones(128), 1e-5, normalize=False)
    q8, s = native.silu_mul_q8(acc, torch.empty(0), torch.ones(128), 16)
    assert q8.shape == (0, 64)
    out = native.dequantize(acc, torch.empty(0), torch.ones(128), None, dtype)
    assert out.shape == (0, 128) and out.dtype == dtype
    assert native.rotate_rows(x, torch.eye(128)).shape == (0, 128)
    assert native.topk_rows(torch.empty(0, 100), 8).shape == (0, 8)
    if native.f32_row_product:
        assert native.f32_gemm(x, torch.ones(5, 128)).shape == (0, 5)
    native.qk_norm(
        torch.empty(0, WIDTH, dtype=dtype), HEADS, HEAD_DIM, torch.ones(HEADS, HEAD_DIM), 1e-5
    )


@needs_int8_gemm
def test_zero_rows_through_the_int8_product_and_the_int8_driver(loaded_int8, native):
    weight = torch.randint(-127, 128, (100, 64), dtype=torch.int8)
    panels, correction = pack_int8_weight(weight)
    out = native.int8_gemm(torch.empty(0, 64, dtype=torch.int8), panels, correction, 100)
    assert out.shape == (0, 100)
    model = loaded_int8.model
    assert model.driver is not None
    cache = KVCache(model.config, 2, 32, model.dtype, CPU)
    meta = model.attention.build_metadata([], 32)
    rope = model.attention.rope
    step = DriverStep(meta, rope.cos_half, rope.sin_half)
    model.driver.run(torch.empty(0, model.config.hidden_size), step, cache, model.dtype)
    assert not cache.kv.any()


def test_shapes_and_dtypes_the_kernels_cannot_take_are_refused(native):
    cos, sin = tables()
    kv = torch.zeros(2, KV_HEADS, 4, 32, HEAD_DIM)
    rows = torch.tensor([0, 1])
    with pytest.raises(KernelInputError, match="qkv"):  # one column short
        native.rope_store(
            torch.zeros(2, WIDTH - 1), rows, cos, sin, rows, kv, HEADS, KV_HEADS, HEAD_DIM
        )
    with pytest.raises(KernelInputError, match="slots"):  # fewer slots than rows
        native.rope_store(
            torch.zeros(2, WIDTH), rows, cos, sin, rows[:1], kv, HEADS, KV_HEADS, HEAD_DIM
        )
    with pytest.raises(KernelInputError, match="kv cache layer must be"):
        native.rope_store(
            torch.zeros(2, WIDTH), rows, cos, sin, rows, kv.bfloat16(), HEADS, KV_HEADS, HEAD_DIM
        )
    q = torch.zeros(2, HEADS, HEAD_DIM)
    with pytest.raises(KernelInputError, match="lengths"):
        native.paged_attention(
            q, kv, torch.zeros(2, 2, dtype=torch.int64), rows[:1] + 1, torch.empty_like(q), 0.1
        )
    with pytest.raises(KernelInputError, match="block tables"):
        native.paged_attention(
            q, kv, torch.zeros(2, 2, dtype=torch.int32), rows + 1, torch.empty_like(q), 0.1
        )
    with pytest.raises(KernelInputError, match="out"):
        native.paged_attention(
            q, kv, torch.zeros(2, 2, dtype=torch.int64), rows + 1, torch.empty(2, HEADS, 32), 0.1
        )
    with pytest.raises(KernelInputError, match="top-k"):
        native.topk_rows(torch.zeros(2, 100), 65)  # the kernel keeps at most 64 per row
    with pytest.raises(KernelInputError, match="delta"):
        native.add_rmsnorm(
            torch.zeros(2, 128), torch.zeros(3, 128), torch.ones(128), 1e-5, torch.float32
        )
    with pytest.raises(KernelInputError, match="rotation block"):
        native.silu_mul_q8(torch.zeros(2, 96, dtype=torch.int32), torch.ones(2), torch.ones(96), 3)
    with pytest.raises(KernelInputError, match="contiguous"):
        native.rotate_rows(torch.zeros(128, 4).t(), torch.eye(128))
    with pytest.raises(KernelInputError, match="q/k norms"):
        native.qk_norm(
            torch.zeros(2, WIDTH), HEADS + KV_HEADS, HEAD_DIM, torch.ones(3, HEAD_DIM), 1e-5
        )
    with pytest.raises(KernelInputError, match="do not fit"):
        native.qk_norm(torch.zeros(2, 64), HEADS, HEAD_DIM, torch.ones(HEADS, HEAD_DIM), 1e-5)
    with pytest.raises(KernelInputError, match="bitmask rows"):
        native.apply_token_bitmask(
            torch.zeros(2, 64), torch.zeros(1, 2, dtype=torch.int32), torch.tensor([2])
        )
    weight = torch.zeros(64, 64, dtype=torch.int8)
    panels, correction = pack_int8_weight(weight)
    with pytest.raises(KernelInputError, match="panels"):  # k of 32 against a 64-wide weight
        native.int8_gemm(torch.zeros(2, 32, dtype=torch.int8), panels, correction, 64)
    if native.f32_row_product:
        with pytest.raises(KernelInputError, match="weight has size 32"):  # k of 64 against 32
            native.f32_gemm(torch.zeros(2, 64), torch.zeros(10, 32))
        with pytest.raises(KernelInputError, match="multiple of 8"):
            native.f32_gemm(torch.zeros(2, 12), torch.zeros(10, 12))
        with pytest.raises(KernelInputError, match="bias"):
            native.f32_gemm(torch.zeros(2, 64), torch.zeros(10, 64), torch.zeros(9))
        with pytest.raises(KernelInputError, match="weight must be torch.float32"):
            native.f32_gemm(torch.zeros(2, 64), torch.zeros(10, 64, dtype=torch.bfloat16))
    with pytest.raises(KernelInputError, match="k % 4"):
        pack_int8_weight(torch.zeros(8, 6, dtype=torch.int8))


@pytest.fixture(params=params())
def configured(request):
    configuration = request.param
    loaded = request.getfixturevalue(configuration.model_fixture)
    dtype = torch.int8 if configuration.kv_cache_dtype == "int8" else loaded.model.dtype
    return loaded.model, KVCache(loaded.model.config, 8, 32, dtype, CPU)


def test_a_prefill_chunk_that_samples_nothing(configured):
    """The first chunk of a long prompt asks for no logits: every path returns [0, vocab]
    (the int8 lm_head once divided by zero here and killed the process)."""
    model, cache = configured
    meta = model.attention.build_metadata([Chunk(0, 40, [0, 1], False)], 32)
    logits = model.forward(torch.arange(100, 140), meta, cache)
    assert logits.shape == (0, model.config.vocab_size)
    meta = model.attention.build_metadata([Chunk(40, 3, [0, 1], True)], 32)
    assert model.forward(torch.arange(140, 143), meta, cache).shape == (1, model.config.vocab_size)


@pytest.mark.parametrize(
    "corrupt, message",
    [
        (lambda m: m.chunk_tables.fill_(8), "block tables"),  # the pool has 8 blocks
        (lambda m: m.slot_mapping.__setitem__(0, -1), "cache slots"),
        (lambda m: m.positions.__setitem__(1, 1 << 20), "positions"),
        (lambda m: m.row_lengths.__setitem__(0, 1000), "row lengths"),
        (lambda m: m.row_tables.__setitem__(0, 5), "row tables"),
        (lambda m: m.logits_indices.__setitem__(0, 99), "logits rows"),
    ],
    ids=["block", "slot", "position", "length", "table", "logits"],
)
def test_a_step_with_indices_outside_the_cache_is_refused(configured, corrupt, message):
    model, cache = configured
    assert model.attention.name == "cpu-paged", "the C kernels must build on this machine"
    before = cache.kv.clone()
    meta = model.attention.build_metadata([Chunk(0, 3, [2], True)], 32)
    corrupt(meta)
    with pytest.raises(KernelInputError, match=message):
        model.forward(torch.tensor([5, 6, 7]), meta, cache)
    assert torch.equal(cache.kv, before)  # refused before the first kernel wrote anything
