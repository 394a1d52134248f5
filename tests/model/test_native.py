"""The C kernels against the torch ops they replace, and the fused forward against the plain one."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvserve.model.kernels import load_kernels
from kvserve.model.kv_cache import KVCache
from kvserve.model.linear.float import ROW_PRODUCT_ROWS, FloatLinear
from tests.model.helpers import Chunk, assert_the_same_on_any_number_of_threads

CPU = torch.device("cpu")
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


@pytest.fixture(scope="module")
def native(kernels):
    assert kernels.available, "the C kernels must build on this machine"
    return kernels


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 40])
def test_add_rmsnorm_matches_torch(dtype, rows, native):
    x = torch.randn(rows, 576, generator=gen(0)) * 3
    delta = (torch.randn(rows, 576, generator=gen(1)) * 2).to(dtype)
    weight = torch.rand(576, generator=gen(2)) + 0.5
    expect_x = x + delta.float()
    expect = F.rms_norm(expect_x, (576,), weight, 1e-5).to(dtype)
    got = native.add_rmsnorm(x, delta, weight, 1e-5, dtype)
    assert torch.equal(x, expect_x)  # the residual was updated in place
    assert (got.float() - expect.float()).abs().max() <= TOLERANCE[dtype] * 4
    plain = native.add_rmsnorm(x.clone(), None, weight, 1e-5, dtype)
    assert (plain.float() - expect.float()).abs().max() <= TOLERANCE[dtype] * 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_matches_torch(dtype, native):
    gate_up = (torch.randn(17, 2 * 96, generator=gen(3)) * 4).to(dtype)
    gate, up = gate_up.float().chunk(2, dim=-1)
    expect = F.silu(gate) * up
    got = native.silu_mul(gate_up).float()
    assert (got - expect).abs().max() <= TOLERANCE[dtype] * expect.abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gelu_tanh_mul_matches_torch(dtype, native):
    gate_up = (torch.randn(17, 2 * 96, generator=gen(13)) * 4).to(dtype)
    gate, up = gate_up.float().chunk(2, dim=-1)
    expect = F.gelu(gate, approximate="tanh") * up
    got = native.silu_mul(gate_up, activation="gelu_tanh").float()
    assert (got - expect).abs().max() <= TOLERANCE[dtype] * expect.abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_store_matches_torch(dtype, native):
    heads, kv_heads, head_dim, rows = 4, 2, 64, 6
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * head_dim, generator=gen(4)).to(dtype)
    positions = torch.tensor([0, 1, 2, 40, 41, 300])
    slots = torch.tensor([5, 6, 7, 70, 71, 99])
    inv = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    angles = torch.outer(torch.arange(512).float(), inv)
    cos, sin = angles.cos(), angles.sin()
    kv = torch.zeros(2, kv_heads, 4, 32, head_dim, dtype=dtype)

    x = qkv.float().view(rows, heads + 2 * kv_heads, head_dim)[:, : heads + kv_heads]
    c = torch.cat([cos, cos], -1)[positions][:, None]
    s = torch.cat([sin, sin], -1)[positions][:, None]
    rotated = x * c + torch.cat([-x[..., 32:], x[..., :32]], -1) * s
    v = qkv.float().view(rows, heads + 2 * kv_heads, head_dim)[:, heads + kv_heads :]

    native.rope_store(qkv, positions, cos, sin, slots, kv, heads, kv_heads, head_dim)
    got = qkv.float().view(rows, heads + 2 * kv_heads, head_dim)
    tolerance = TOLERANCE[dtype] * 8
    assert (got[:, : heads + kv_heads] - rotated).abs().max() <= tolerance
    flat = kv.float().view(2, kv_heads, 4 * 32, head_dim)
    assert (flat[0][:, slots].transpose(0, 1) - rotated[:, heads:]).abs().max() <= tolerance
    assert torch.equal(flat[1][:, slots].transpose(0, 1), v)
    untouched = torch.ones(4 * 32, dtype=torch.bool)
    untouched[slots] = False
    assert flat[:, :, untouched].abs().max() == 0  # nothing written elsewhere


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("heads", [8, 12, 14, 16])  # groups of 4, 6, 7 and 8 query heads
def test_paged_decode_matches_sdpa(dtype, head_dim, heads, native):
    """Decode rows (lengths 1 to 96: whole and partial runs of 16 keys, partial blocks) against
    SDPA, for the group sizes whose bf16 values keep their sums in registers in different
    shapes (paged_attention.c's bf16_block_values)."""
    kv_heads, block_size, num_blocks = 2, 32, 12
    kv = torch.randn(2, kv_heads, num_blocks, block_size, head_dim, generator=gen(5)).to(dtype)
    lengths = torch.tensor([1, 33, 70, 96])
    tables = torch.tensor([[3, 0, 0], [7, 1, 0], [2, 9, 4], [11, 5, 6]])
    q = torch.randn(4, heads, head_dim, generator=gen(6)).to(dtype)
    out = torch.empty_like(q)
    native.paged_attention(q, kv, tables, lengths, out, head_dim**-0.5)
    for i in range(4):
        n = int(lengths[i])
        keys = kv[:, :, tables[i]].flatten(2, 3)[:, :, :n].float()  # [2, kv_heads, n, d]
        k = keys[0].repeat_interleave(heads // kv_heads, 0)
        v = keys[1].repeat_interleave(heads // kv_heads, 0)
        expect = F.scaled_dot_product_attention(q[i].float()[:, None], k, v)[:, 0]
        assert (out[i].float() - expect).abs().max() <= TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [32, 10])
def test_prefill_rows_share_a_table_and_are_causal_by_length(dtype, block_size, native):
    """Rows of a prefill chunk (one table, lengths start+1, start+2, ...) next to a decode row
    of another sequence: each row equals causal attention over its own sequence."""
    heads, kv_heads, head_dim = 9, 3, 64
    used = -(-70 // block_size)  # blocks for positions 0..69
    kv = torch.randn(2, kv_heads, used + 7, block_size, head_dim, generator=gen(7)).to(dtype)
    first = torch.randperm(used + 6, generator=gen(9))[:used]  # scattered, out of order
    tables = torch.zeros(2, used, dtype=torch.long)
    tables[0], tables[1, 0] = first, used + 6
    start, n = 20, 50  # prefill rows at positions 20..69 of sequence 0
    lengths = torch.cat([torch.arange(start + 1, start + n + 1), torch.tensor([9])])
    row_tables = torch.tensor([0] * n + [1])
    q = torch.randn(n + 1, heads, head_dim, generator=gen(8)).to(dtype)
    out = torch.empty_like(q)
    native.paged_attention(q, kv, tables, lengths, out, 0.125, row_tables)
    keys = kv[:, :, tables[0]].flatten(2, 3)[:, :, : start + n].float()
    mask = torch.ones(n, start + n, dtype=torch.bool).tril(diagonal=start)
    expect = F.scaled_dot_product_attention(
        q[:n].float().transpose(0, 1),
        keys[0].repeat_interleave(3, 0),
        keys[1].repeat_interleave(3, 0),
        attn_mask=mask,
        scale=0.125,
    ).transpose(0, 1)
    assert (out[:n].float() - expect).abs().max() <= TOLERANCE[dtype]
    other = kv[:, :, tables[1]].flatten(2, 3)[:, :, :9].float()
    expect_last = F.scaled_dot_product_attention(
        q[n].float()[:, None],
        other[0].repeat_interleave(3, 0),
        other[1].repeat_interleave(3, 0),
        scale=0.125,
    )[:, 0]
    assert (out[n].float() - expect_last).abs().max() <= TOLERANCE[dtype]


def laid_out(positions: torch.Tensor, block_size: int, seed: int):
    """[2, kv_heads, length, head_dim] positions laid out in scattered blocks of `block_size`:
    (the cache layer, the table)."""
    _, kv_heads, length, head_dim = positions.shape
    used = -(-length // block_size)
    order = torch.randperm(used + 2, generator=gen(seed))[:used]
    kv = torch.zeros(2, kv_heads, used + 2, block_size, head_dim, dtype=positions.dtype)
    for position in range(length):
        kv[:, :, order[position // block_size], position % block_size] = positions[:, :, position]
    return kv, order


@pytest.mark.parametrize(
    "head_dim, heads, kv_heads", [(64, 9, 3), (128, 8, 2), (64, 16, 1), (128, 4, 4)]
)
@pytest.mark.parametrize("sharpness", [1.0, 8.0])  # flat and peaked attention
def test_float32_rows_are_the_same_alone_in_a_tile_and_in_any_block_size(
    head_dim, heads, kv_heads, sharpness, native
):
    """In float32 a row's attention is computed in one arithmetic whatever its company
    (csrc/paged_attention.c): the rows of a prefill chunk, worked on in tiles, equal bit for bit
    the same rows computed one at a time, and the same positions laid out in blocks of 32, 10, 3
    and 300 give identical results; for a chunk that starts and ends mid-block after 600
    positions and spans several tiles, next to a decode row of another sequence."""
    start, n, length = 600, 37, 640
    positions = torch.randn(2, kv_heads, length, head_dim, generator=gen(20))
    q = torch.randn(n + 1, heads, head_dim, generator=gen(21)) * sharpness
    lengths = torch.cat([torch.arange(start + 1, start + n + 1), torch.tensor([333])])
    row_tables = torch.tensor([0] * n + [1])
    scale = head_dim**-0.5
    results = []
    for block_size in (32, 10, 3, 300):
        kv, order = laid_out(positions, block_size, block_size)
        tables = order[None].repeat(2, 1)
        out = torch.empty_like(q)
        native.paged_attention(q, kv, tables, lengths, out, scale, row_tables)
        alone = torch.empty_like(q)
        for i in range(n + 1):
            native.paged_attention(
                q[i : i + 1], kv, order[None], lengths[i : i + 1], alone[i : i + 1], scale
            )
        assert torch.equal(out, alone)  # a row's result does not depend on its tile
        results.append(out)
    for other in results[1:]:
        assert torch.equal(results[0], other)  # nor on the block size

    group = heads // kv_heads
    keys = positions[:, :, :length].repeat_interleave(group, 1)
    mask = torch.ones(n, start + n, dtype=torch.bool).tril(diagonal=start)
    expect = F.scaled_dot_product_attention(
        q[:n].transpose(0, 1),
        keys[0, :, : start + n],
        keys[1, :, : start + n],
        attn_mask=mask,
        scale=scale,
    ).transpose(0, 1)
    # peaked scores are larger, and so is their rounding
    tolerance = TOLERANCE[torch.float32] * sharpness
    assert (results[0][:n] - expect).abs().max() <= tolerance
    expect_last = F.scaled_dot_product_attention(
        q[n][:, None], keys[0, :, :333], keys[1, :, :333], scale=scale
    )[:, 0]
    assert (results[0][n] - expect_last).abs().max() <= tolerance


@pytest.mark.parametrize("head_dim, heads, kv_heads", [(64, 9, 3), (128, 12, 2), (64, 14, 2)])
@pytest.mark.parametrize("guesses", [1, 4, 16])
def test_bf16_verify_chunk_rows_equal_decode_rows(head_dim, heads, kv_heads, guesses, native):
    """A speculative verify chunk (the last sampled token and its guesses) gets, row for row,
    the bits of decode rows computed one at a time, in bf16 too, where the CPU's bf16 dot
    product sums a tile of several rows in another order than a row alone: the CPU backend's
    metadata gives each verify row a table of its own (`rows_alone_in_verify_chunks`), so
    verification accepts exactly what decoding would have produced. In the same call: a decode
    row of another sequence and a 40-row prefill chunk, which keeps its tiles (close to the rows
    alone; exactly so in float32)."""
    from types import SimpleNamespace

    from kvserve.model.attention import flatten_chunks
    from kvserve.model.attention.cpu import rows_alone_in_verify_chunks

    start, n, long_rows, block = 600, guesses + 1, 40, 32
    length = start + long_rows
    positions = torch.randn(2, kv_heads, length, head_dim, generator=gen(30)).to(torch.bfloat16)
    kv, order = laid_out(positions, block, block)
    table = tuple(order.tolist())
    chunks = [
        SimpleNamespace(start=start, num_tokens=n, block_ids=table, samples=True,
                        draft_token_ids=(7,) * guesses),
        SimpleNamespace(start=332, num_tokens=1, block_ids=table, samples=True),
        SimpleNamespace(start=start, num_tokens=long_rows, block_ids=table, samples=True),
    ]  # fmt: skip
    _, rows_at, row_tables, tables, _ = flatten_chunks(chunks, block)
    row_tables, tables = rows_alone_in_verify_chunks(chunks, tables, block)
    assert row_tables[:n] == list(range(n)) and len(set(row_tables[n + 1 :])) == 1
    width = max(len(t) for t in tables)
    padded = torch.tensor([list(t) + [0] * (width - len(t)) for t in tables])
    lengths = torch.tensor(rows_at) + 1
    q = torch.randn(len(lengths), heads, head_dim, generator=gen(31)).to(torch.bfloat16)
    scale = head_dim**-0.5
    out = torch.empty_like(q)
    native.paged_attention(q, kv, padded, lengths, out, scale, torch.tensor(row_tables))
    alone = torch.empty_like(q)
    for i in range(len(q)):
        native.paged_attention(
            q[i : i + 1], kv, order[None], lengths[i : i + 1], alone[i : i + 1], scale
        )
    assert torch.equal(out[: n + 1], alone[: n + 1])
    assert (out.float() - alone.float()).abs().max() <= TOLERANCE[torch.bfloat16]


@pytest.mark.parametrize(
    "cache_dtype, alone", [(torch.int8, False), (torch.float32, False), (torch.bfloat16, True)]
)
def test_a_verify_chunk_keeps_its_tile_where_the_caches_tiles_are_rows_alone(
    cache_dtype, alone, loaded_fp32
):
    """Over an int8 or a float32 cache the kernels compute a tile's rows exactly as rows alone
    (test_int8_prefill_tiles_match_each_row_alone_and_sdpa, test_float32_rows_are_the_same_
    alone_in_a_tile_and_in_any_block_size): a verify chunk keeps one table for its rows and reads
    the cache once for all of them. Over a bf16 cache each verify row gets a table of its own
    (test_bf16_verify_chunk_rows_equal_decode_rows), and so with no cache dtype said."""
    from types import SimpleNamespace

    attention = loaded_fp32.model.attention
    table = (3, 1, 4)
    chunks = [
        SimpleNamespace(start=40, num_tokens=5, block_ids=table, samples=True,
                        draft_token_ids=(7, 8, 9, 10)),
        SimpleNamespace(start=70, num_tokens=1, block_ids=table, samples=True),
    ]  # fmt: skip
    for given in (cache_dtype, None):
        meta = attention.build_metadata(chunks, 32, given)
        tables_of_verify_rows = set(meta.row_tables[:5].tolist())
        expect_alone = alone or given is None
        assert len(tables_of_verify_rows) == (5 if expect_alone else 1), given
        assert meta.row_lengths.tolist() == [41, 42, 43, 44, 45, 71]


needs_row_product = pytest.mark.skipif(
    not load_kernels().f32_row_product, reason="the float32 row product needs AVX2 and FMA"
)


@needs_row_product
@pytest.mark.parametrize("n, k", [(960, 576), (7, 576), (4099, 1536), (5, 8)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_float32_row_product_matches_float64_and_each_row_is_the_same_in_any_batch(
    n, k, with_bias, native
):
    g = gen(n + k)
    weight = torch.randn(n, k, generator=g)
    bias = torch.randn(n, generator=g) if with_bias else None
    x = torch.randn(33, k, generator=g)
    together = native.f32_gemm(x, weight, bias)
    reference = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    assert (together.double() - reference).abs().max() <= 1e-5 * k**0.5 * reference.abs().max()
    # A row's result does not depend on the rows beside it, nor on the number of threads.
    for first, count in ((0, 1), (5, 2), (7, 3), (1, 32)):
        part = native.f32_gemm(x[first : first + count].contiguous(), weight, bias)
        assert torch.equal(part, together[first : first + count])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert torch.equal(native.f32_gemm(x, weight, bias), together)
    finally:
        torch.set_num_threads(threads)


@needs_row_product
def test_float32_row_product_is_the_same_on_any_number_of_threads(native):
    """Its panels shared out among the threads (csrc/task_ranges.h), more threads than cores
    included: each panel computed once, the same floats as on one thread (two inputs in turn,
    so that a panel left out would keep the other's results)."""
    g = gen(17)
    weight, bias = torch.randn(3000, 64, generator=g), torch.randn(3000, generator=g)
    inputs = [torch.randn(3, 64, generator=g) for _ in range(2)]
    assert_the_same_on_any_number_of_threads(
        lambda: [native.f32_gemm(x, weight, bias) for x in inputs]
    )


@needs_row_product
def test_float32_linear_layers_take_the_row_product_up_to_its_row_count(native):
    g = gen(3)
    weight, bias = torch.randn(100, 64, generator=g), torch.randn(100, generator=g)
    layer = FloatLinear(weight, bias, native)
    few = torch.randn(ROW_PRODUCT_ROWS, 64, generator=g)
    assert torch.equal(layer(few), native.f32_gemm(few, weight, bias))
    many = torch.randn(ROW_PRODUCT_ROWS + 1, 64, generator=g)
    assert torch.equal(layer(many), F.linear(many, weight, bias))
    strided = torch.randn(64, 8, generator=g).t()  # rows that are not contiguous
    assert torch.equal(layer(strided), native.f32_gemm(strided.contiguous(), weight, bias))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_kernel_forward_matches_the_torch_ops_forward(
    loaded_fp32, loaded_bf16, loaded_fp32_torch_ops, loaded_bf16_torch_ops, dtype
):
    """The model on the C kernels (fused layer ops, paged attention, row product) against the
    same weights loaded with no kernels at all: the torch ops a machine without a C compiler
    (or a CUDA device) runs."""
    if dtype == "float32":
        loaded, plain_loaded = loaded_fp32, loaded_fp32_torch_ops
    else:
        loaded, plain_loaded = loaded_bf16, loaded_bf16_torch_ops
    ids = loaded.tokenizer.encode("The fused path and the plain path compute the same layer.")
    assert loaded.model.attention.name == "cpu-paged"
    assert plain_loaded.model.attention.name == "torch-sdpa"

    def run(model):
        cache = KVCache(model.config, 8, 32, model.dtype, CPU)
        meta = model.attention.build_metadata([Chunk(0, len(ids) - 1, [4, 2], True)], 32)
        first = model.forward(torch.tensor(ids[:-1]), meta, cache)
        meta = model.attention.build_metadata([Chunk(len(ids) - 1, 1, [4, 2], True)], 32)
        return first, model.forward(torch.tensor(ids[-1:]), meta, cache)

    plain, fused = run(plain_loaded.model), run(loaded.model)
    for a, b in zip(plain, fused, strict=True):
        if dtype == "float32":
            assert (a - b).abs().max() <= 1e-4
        else:  # bf16 rounds at different points; the prediction is what must agree
            assert (a - b).abs().max() <= 1.0
            assert a.argmax(-1).tolist() == b.argmax(-1).tolist()


def test_native_attention_matches_torch_attention_in_prefill_and_decode(loaded_fp32):
    """The C kernel (every row, causality by length) against torch SDPA (segments + padded
    decode), across a step that mixes a fresh prefill, a continued prefill and decode rows."""
    model = loaded_fp32.model
    tok = loaded_fp32.tokenizer
    a = tok.encode("Attention reads each sequence through its own block table, nothing else.")
    b = tok.encode("A second sequence continues its prompt in the middle of a chunk here.")
    c = tok.encode("The third one is decoding.")

    def run(model):
        cache = KVCache(model.config, 16, 32, model.dtype, CPU)
        first = [Chunk(0, 10, [7, 1], False), Chunk(0, len(c) - 1, [3], False)]
        meta = model.attention.build_metadata(first, 32)
        model.forward(torch.tensor(b[:10] + c[:-1]), meta, cache)
        chunks = [
            Chunk(0, len(a), [9, 12], True),
            Chunk(10, len(b) - 10, [7, 1], True),
            Chunk(len(c) - 1, 1, [3], True),
        ]
        meta = model.attention.build_metadata(chunks, 32)
        return model.forward(torch.tensor(a + b[10:] + c[-1:]), meta, cache)

    assert model.attention.name == "cpu-paged"
    assert (run(model) - run(model.torch_attention())).abs().max() <= 1e-4


def _reference_rows(q, positions, lengths, scale, window=None, softcap=None):
    """Each row's attention over its own positions (the last `window` of them), scores capped
    as C tanh(s / C): q [rows, heads, d]; positions [2, kv_heads, length, d] float32."""
    heads, kv_heads = q.shape[1], positions.shape[1]
    keys = positions.repeat_interleave(heads // kv_heads, 1)
    out = torch.empty(q.shape, dtype=torch.float64)
    for i, length in enumerate(lengths.tolist()):
        first = max(0, length - window) if window else 0
        k, v = keys[0, :, first:length].double(), keys[1, :, first:length].double()
        scores = torch.einsum("hd,hjd->hj", q[i].double(), k) * scale
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        out[i] = torch.einsum("hj,hjd->hd", scores.softmax(-1), v)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "window, softcap", [(16, None), (50, None), (None, 20.0), (7, 5.0), (1, None)]
)
def test_sliding_window_and_soft_cap_rows_match_the_reference_alone_and_in_a_tile(
    dtype, window, softcap, native
):
    """A windowed row attends to the last `window` positions of its sequence only, a capped
    score is C tanh(s / C); rows of a prefill chunk (windows starting mid-block, blocks wholly
    outside every window skipped) equal the same rows alone, bit for bit, in any block size."""
    heads, kv_heads, head_dim = 6, 2, 64
    start, n, length = 40, 37, 77
    positions = torch.randn(2, kv_heads, length, head_dim, generator=gen(30)).to(dtype)
    q = (torch.randn(n + 1, heads, head_dim, generator=gen(31)) * 3).to(dtype)
    lengths = torch.cat([torch.arange(start + 1, start + n + 1), torch.tensor([9])])
    row_tables = torch.tensor([0] * n + [1])
    scale = head_dim**-0.5
    expect = _reference_rows(q.float(), positions.float(), lengths, scale, window, softcap)
    results = []
    for block_size in (32, 10, 3):
        kv, order = laid_out(positions, block_size, block_size)
        # positions wholly before every window hold garbage: they must never be read
        if window is not None:
            dead = max(0, (start + 1 - window) // block_size)
            kv[:, :, order[:dead]] = float("nan")
        tables = order[None].repeat(2, 1)
        out = torch.empty_like(q)
        native.paged_attention(
            q, kv, tables, lengths, out, scale, row_tables, window=window, softcap=softcap
        )
        alone = torch.empty_like(q)
        for i in range(n if window is not None else n + 1):
            native.paged_attention(
                q[i : i + 1], kv, order[None], lengths[i : i + 1], alone[i : i + 1], scale,
                window=window, softcap=softcap,
            )  # fmt: skip
        rows = n if window is not None else n + 1  # the last row's sequence is the NaN-free one
        assert torch.equal(out[:rows], alone[:rows])
        if dtype == torch.float32:
            assert (out[:n].double() - expect[:n]).abs().max() <= 1e-5
        else:
            assert (out[:n].double() - expect[:n]).abs().max() <= 2e-2
        results.append(out[:n])
    if dtype == torch.float32:
        for other in results[1:]:
            assert torch.equal(results[0], other)


def test_attention_refuses_a_window_on_the_int8_cache_and_nonsense_values(native):
    q = torch.randn(1, 2, 64)
    kv = torch.zeros(2, 1, 1, 16, 64)
    tables, lengths, out = (
        torch.zeros(1, 1, dtype=torch.long),
        torch.tensor([3]),
        torch.empty(1, 2, 64),
    )
    for kwargs in ({"window": 0}, {"softcap": -1.0}):
        with pytest.raises(ValueError):
            native.paged_attention(q, kv, tables, lengths, out, 0.125, **kwargs)
    scales = torch.zeros(2, 1, 1, 16)
    with pytest.raises(ValueError, match="int8"):
        native.paged_attention(
            q, kv.to(torch.int8), tables, lengths, out, 0.125, kv_scales=scales, window=4
        )
