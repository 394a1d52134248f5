"""The int8 linear path (`--quantization int8`): rotations, kernels, and the model it gives."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from kvserve.bench.quality import chunk_logits, score_tokens
from kvserve.model.kernels import KernelInputError, load_kernels
from kvserve.model.kv_cache import KVCache
from kvserve.model.linear import int8 as quant
from kvserve.model.llama import LlamaModel
from kvserve.model.safetensors import SafetensorsCheckpoint
from tests.model.helpers import (
    Chunk,
    assert_the_same_on_any_number_of_threads,
    greedy_continuation,
)
from tests.model.test_safetensors import save_tiny, tiny_config

CPU = torch.device("cpu")

needs_kernels = pytest.mark.skipif(
    not load_kernels().int8_gemm_isa, reason="needs the C kernels and AVX512-VNNI or AVX2"
)


@pytest.fixture(scope="module")
def native(kernels):
    return kernels


TEXT = (
    "The history of the printing press begins in the fifteenth century, when Johannes "
    "Gutenberg combined movable metal type, oil-based ink and a wooden screw press into a "
    "system that could produce books quickly and cheaply. Within a few decades, printing "
    "shops had spread to more than two hundred cities across Europe. The new technology "
    "lowered the cost of books, encouraged literacy, and allowed scholars to share ideas "
    "far more widely than before. Scientists could compare observations, reformers could "
    "spread their arguments, and merchants could print price lists and contracts. Historians "
    "often describe the period that followed as a communications revolution, comparable in "
    "its effects to the arrival of the internet in our own time."
)


# -- rotations ----------------------------------------------------------------------------------


def test_hadamard_is_symmetric_and_orthogonal():
    for n in (1, 2, 16, 64, 512):
        h = quant.hadamard(n)
        assert torch.allclose(h, h.t())
        assert torch.allclose(h @ h.t(), torch.eye(n, dtype=torch.float64), atol=1e-12)


@pytest.mark.parametrize("hidden", [576, 64, 96, 4096])
def test_residual_rotation_is_orthogonal_and_applies_as_its_matrix(hidden):
    rotation = quant.residual_rotation(hidden)
    matrix = rotation.matrix()
    assert matrix.shape == (hidden, hidden)
    assert torch.allclose(matrix @ matrix.t(), torch.eye(hidden), atol=1e-5)
    w = torch.randn(7, hidden)
    assert torch.allclose(rotation.right(w), w @ matrix, atol=1e-4)
    w = torch.randn(hidden, 5)
    assert torch.allclose(rotation.left_transposed(w), matrix.t() @ w, atol=1e-4)
    # fixed: the same checkpoint always quantizes the same way
    assert torch.equal(quant.residual_rotation(hidden).matrix(), matrix)


def test_block_hadamard_and_down_block():
    assert quant.down_block(1536) == 512
    assert quant.down_block(14336) == 2048
    assert quant.down_block(112) == 16
    assert quant.down_block(99) == 1
    rotation = quant.block_hadamard(1536, 512)
    dense = torch.block_diag(*[quant.hadamard(512).float()] * 3)
    w = torch.randn(4, 1536)
    assert torch.allclose(rotation.right(w), w @ dense, atol=1e-4)


def _random_layer(config, bias: bool) -> SimpleNamespace:
    g = torch.Generator().manual_seed(1)
    h, q, kv, i = config.hidden_size, config.q_size, config.kv_size, config.intermediate_size
    return SimpleNamespace(
        attn_norm=1 + 0.3 * torch.randn(h, generator=g),
        qkv=torch.randn(q + 2 * kv, h, generator=g),
        qkv_bias=torch.randn(q + 2 * kv, generator=g) if bias else None,
        qk_norm=None,
        o=torch.randn(h, q, generator=g),
        mlp_norm=1 + 0.3 * torch.randn(h, generator=g),
        gate_up=torch.randn(2 * i, h, generator=g),
        down=torch.randn(h, i, generator=g),
    )


@pytest.mark.parametrize("bias", [False, True])
def test_rotated_layer_computes_the_same_function(bias):
    """Every product of a rotated layer, fed rotated inputs, gives the original product's output
    (q and k unchanged, values rotated per head, residual writes rotated by R)."""
    config = SimpleNamespace(
        hidden_size=96, head_dim=16, num_heads=6, num_kv_heads=2, intermediate_size=192
    )
    config.q_size, config.kv_size = 6 * 16, 2 * 16
    layer = _random_layer(config, bias)
    residual = quant.residual_rotation(96)
    block = quant.down_block(192)
    rotated = quant.rotate_layer(
        config,
        layer.qkv,
        layer.qkv_bias,
        layer.o,
        layer.gate_up,
        layer.down,
        layer.attn_norm,
        layer.mlp_norm,
        residual,
        block,
    )
    r = residual.matrix()
    per_head = torch.block_diag(*[quant.hadamard(16).float()] * 2)
    x = torch.randn(5, 96)

    normed = F.rms_norm(x, (96,), layer.attn_norm, 1e-6)
    expect = F.linear(normed, layer.qkv, layer.qkv_bias)
    got = F.linear(F.rms_norm(x @ r, (96,), None, 1e-6), rotated.qkv, rotated.qkv_bias)
    split = config.q_size + config.kv_size
    assert torch.allclose(got[:, :split], expect[:, :split], atol=1e-3)
    assert torch.allclose(got[:, split:], expect[:, split:] @ per_head, atol=1e-3)

    a = torch.randn(5, config.q_size)  # attention output, before and after the value rotation
    a_rotated = a @ torch.block_diag(*[quant.hadamard(16).float()] * 6)
    assert torch.allclose(a_rotated @ rotated.o.t(), (a @ layer.o.t()) @ r, atol=1e-3)

    normed = F.rms_norm(x, (96,), layer.mlp_norm, 1e-6)
    got = F.rms_norm(x @ r, (96,), None, 1e-6) @ rotated.gate_up.t()
    assert torch.allclose(got, normed @ layer.gate_up.t(), atol=1e-3)

    m = torch.randn(5, 192)
    m_rotated = m @ torch.block_diag(*[quant.hadamard(block).float()] * (192 // block))
    assert torch.allclose(m_rotated @ rotated.down.t(), (m @ layer.down.t()) @ r, atol=1e-3)


def test_weight_quantization_is_per_output_channel(native):
    w = torch.randn(10, 32) * torch.linspace(0.01, 10, 10)[:, None]
    w[3] = 0
    q = quant.Int8Linear.quantize(w, kernels=native)
    scale = q.scale
    assert q.out_features == 10 and scale[3] == 1.0
    weight = q.weight if q.panels is None else None
    if weight is not None:
        assert weight.abs().max() == 127
        assert torch.allclose(weight.float() * scale[:, None], w, atol=float(scale.max()) / 2)
    x = torch.randint(-127, 128, (3, 32), dtype=torch.int8)
    expect = x.long() @ torch.round(w / scale[:, None]).long().t()
    assert torch.equal(q.matmul(x).long(), expect)


# -- kernels ------------------------------------------------------------------------------------


def _check_quantized(q, scales, expect):
    """q * scale reproduces `expect` within half a step, every row's largest value is +-127."""
    assert q.dtype == torch.int8 and scales.dtype == torch.float32
    top = expect.abs().amax(dim=1)
    assert torch.allclose(scales, top / 127, rtol=1e-5, atol=1e-12)
    error = (q.float() * scales[:, None] - expect).abs()
    assert bool((error <= scales[:, None] * 0.5 * (1 + 1e-4) + 1e-6).all())
    nonzero = top > 0
    assert bool((q.abs().amax(dim=1)[nonzero] == 127).all())


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_rows(dtype, native):
    x = torch.randn(9, 576).to(dtype)
    x[4] = 0
    q, scales = native.quantize_rows(x)
    _check_quantized(q, scales, x.float())
    assert scales[4] == 0 and not q[4].any()
    strided = torch.randn(9, 700).to(dtype)[:, :576]
    q, scales = native.quantize_rows(strided)
    _check_quantized(q, scales, strided.float())


@needs_kernels
def test_add_rmsnorm_q8(native):
    x = torch.randn(10, 576)
    acc = torch.randint(-(2**20), 2**20, (10, 576), dtype=torch.int32)
    rows, cols = torch.rand(10) * 1e-6, torch.rand(576)
    expect_x = x + acc.float() * rows[:, None] * cols
    q, scales = native.add_rmsnorm_q8(x, acc, rows, cols, 1e-5)
    assert torch.allclose(x, expect_x, rtol=1e-6, atol=1e-6)
    _check_quantized(q, scales, F.rms_norm(expect_x, (576,), None, 1e-5))
    before = x.clone()
    assert native.add_rmsnorm_q8(x, None, None, None, 1e-5, normalize=False) is None
    assert torch.equal(x, before)


@needs_kernels
@pytest.mark.parametrize("block", [1, 16, 64, 512])
def test_silu_mul_q8_rotates_by_hadamard_blocks(block, native):
    rows, width = 11, 1536
    acc = torch.randint(-(2**16), 2**16, (rows, 2 * width), dtype=torch.int32)
    row_scales, col_scales = torch.rand(rows) * 1e-3, torch.rand(2 * width)
    values = acc.float() * row_scales[:, None] * col_scales
    gate, up = values[:, :width], values[:, width:]
    expect = (F.silu(gate) * up).view(rows, -1, block) @ quant.hadamard(block).float()
    q, scales = native.silu_mul_q8(acc, row_scales, col_scales, block)
    _check_quantized(q, scales, expect.reshape(rows, width))


@needs_kernels
@pytest.mark.parametrize("block", [1, 16, 512])
def test_gelu_tanh_mul_q8_is_geglu_rotated_by_hadamard_blocks(block, native):
    rows, width = 11, 1536
    acc = torch.randint(-(2**16), 2**16, (rows, 2 * width), dtype=torch.int32)
    row_scales, col_scales = torch.rand(rows) * 1e-4, torch.rand(2 * width)
    values = acc.float() * row_scales[:, None] * col_scales
    gate, up = values[:, :width], values[:, width:]
    geglu = F.gelu(gate, approximate="tanh") * up
    expect = geglu.view(rows, -1, block) @ quant.hadamard(block).float()
    q, scales = native.silu_mul_q8(acc, row_scales, col_scales, block, activation="gelu_tanh")
    _check_quantized(q, scales, expect.reshape(rows, width))
    silu, _ = native.silu_mul_q8(acc, row_scales, col_scales, block)
    assert not torch.equal(silu, q)  # another activation, not silu's


@needs_kernels
@pytest.mark.parametrize("structured", [False, True])
def test_add_post_norm_q8_adds_the_rotated_normed_product(structured, native):
    """x += (rmsnorm(y) * w) R: Gemma's post-norm on an int8 product, into the rotated
    residual basis (R: signs then Hadamard blocks; the identity without them)."""
    rows, hidden = 9, 576
    acc = torch.randint(-(2**20), 2**20, (rows, hidden), dtype=torch.int32)
    row_scales, col_scales = torch.rand(rows) * 1e-6, torch.rand(hidden)
    weight = 1 + 0.3 * torch.randn(hidden)
    x = torch.randn(rows, hidden)
    y = acc.float() * row_scales[:, None] * col_scales
    normed = F.rms_norm(y, (hidden,), weight, 1e-6)
    if structured:
        rotation = quant.structured_rotation(hidden)
        signs, block = rotation.signs, quant.down_block(hidden)
        expect = x + normed @ rotation.matrix()
    else:
        signs, block = None, 1
        expect = x + normed
    native.add_post_norm_q8(x, acc, row_scales, col_scales, weight, 1e-6, signs, block)
    assert torch.allclose(x, expect, atol=2e-5)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantize(dtype, native):
    acc = torch.randint(-(2**20), 2**20, (6, 960), dtype=torch.int32)
    rows, cols, bias = torch.rand(6), torch.rand(960) * 1e-4, torch.randn(960)
    for b in (None, bias):
        expect = acc.float() * rows[:, None] * cols + (0 if b is None else b)
        got = native.dequantize(acc, rows, cols, b, dtype)
        assert got.dtype == dtype
        assert torch.allclose(got.float(), expect, rtol=1e-2 if dtype == torch.bfloat16 else 1e-6)


@needs_kernels
def test_rotate_rows_is_a_product_that_ignores_batch_mates(native):
    x, m = torch.randn(37, 576), torch.randn(576, 576) / 24
    got = native.rotate_rows(x, m)
    assert torch.allclose(got, x @ m, atol=1e-4)
    for i in (0, 17, 36):
        assert torch.equal(native.rotate_rows(x[i : i + 1].contiguous(), m)[0], got[i])


@needs_kernels
@pytest.mark.parametrize(
    ("rows", "n", "k"),
    [
        (1, 960, 576),
        (5, 100, 64),
        (12, 576, 1536),
        (13, 576, 576),
        (64, 3072, 576),
        (7, 64, 4),
        # the tile unit's (where the CPU has one): whole and partial groups of 16 rows, an odd
        # number of column blocks cut by rows, inner sizes that are not a multiple of 64
        (2, 960, 576),
        (16, 192, 64),
        (37, 576, 1536),
        (50, 100, 128),
        (21, 64, 96),
    ],
)
def test_int8_gemm_is_exact(rows, n, k, native):
    g = torch.Generator().manual_seed(rows * n + k)
    w = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    a = torch.randint(-127, 128, (rows, k), generator=g, dtype=torch.int8)
    panels, correction = quant.pack_int8_weight(w)
    got = native.int8_gemm(a, panels, correction, n)
    assert torch.equal(got.long(), a.long() @ w.long().t())
    # a row's result does not depend on the rows beside it
    assert torch.equal(native.int8_gemm(a[-1:].contiguous(), panels, correction, n)[0], got[-1])


def test_int8_gemm_is_the_same_on_any_number_of_threads(native):
    """The threads share the column blocks out (csrc/task_ranges.h); with more threads than
    cores, some wait and the others take over their blocks: every block is computed once (two
    inputs in turn, so that a block left out would keep the other's results)."""
    g = torch.Generator().manual_seed(11)
    w = torch.randint(-127, 128, (16384, 512), generator=g, dtype=torch.int8)
    inputs = [torch.randint(-127, 128, (9, 512), generator=g, dtype=torch.int8) for _ in range(2)]
    panels, correction = quant.pack_int8_weight(w)
    alone = assert_the_same_on_any_number_of_threads(
        lambda: [native.int8_gemm(a, panels, correction, 16384).long() for a in inputs]
    )
    for got, a in zip(alone, inputs, strict=True):
        assert torch.equal(got, a.long() @ w.long().t())


@needs_kernels
def test_the_int8_products_vector_path_beside_its_tile_path(native, tmp_path, monkeypatch):
    """Where the CPU has AMX-INT8, products of 2 rows and more run on the tile unit (the banner
    says from how many rows); the vector path they leave (int8_gemm.c built again with
    KVSERVE_AMX=0 when it first asks) gives the same integers for the same cases, so both stay
    tested on such a machine. Elsewhere the threshold is 0 and the banner says nothing of it."""
    import ctypes
    import subprocess

    from kvserve.model import kernel_build

    rows = native.int8_amx_rows
    assert rows in ((2,) if kernel_build.cpu_has_amx() and native.int8_gemm_isa == "AVX512-VNNI"
                    and os.environ.get("KVSERVE_AMX") != "0" else (0,))  # fmt: skip
    assert ("int8 products by AVX512-VNNI, AMX-INT8 from 2 rows" in native.describe()) == (rows > 0)
    assert native.as_dict()["int8_amx_rows"] == rows
    source = Path(kernel_build.__file__).parent / "csrc" / "int8_gemm.c"
    library = tmp_path / "int8_vectors.so"
    built = subprocess.run(
        [kernel_build.find_compiler(), "-O2", *kernel_build.compile_flags()[1:], "-shared",
         str(source), "-o", str(library)],
        capture_output=True, text=True,
    )  # fmt: skip
    assert built.returncode == 0, built.stderr
    lib = ctypes.CDLL(str(library))
    for symbol in next(f for f in kernel_build.FAMILIES if f.name == "int8_gemm").symbols:
        symbol.bind(lib)
    monkeypatch.setenv("KVSERVE_AMX", "0")
    assert lib.kvserve_int8_gemm_amx() == 0
    for m, n, k in [(2, 960, 576), (5, 100, 64), (16, 192, 64), (37, 576, 1536), (50, 100, 128)]:
        g = torch.Generator().manual_seed(m * n + k)
        w = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
        a = torch.randint(-127, 128, (m, k), generator=g, dtype=torch.int8)
        panels, correction = quant.pack_int8_weight(w)
        vectors = torch.empty(m, n, dtype=torch.int32)
        lib.kvserve_int8_gemm(a.data_ptr(), m, k, panels.data_ptr(), correction.data_ptr(), n,
                              vectors.data_ptr(), 2)  # fmt: skip
        assert torch.equal(vectors.long(), a.long() @ w.long().t())
        assert torch.equal(native.int8_gemm(a, panels, correction, n), vectors)


@needs_kernels
def test_int8_gemm_is_exact_at_the_extremes(native):
    """The largest products either kernel can meet: rows of +-127 against weights of -128 and
    127 (the AVX2 product's 16-bit pair sums are closest to saturating there)."""
    k, n = 256, 72
    g = torch.Generator().manual_seed(1)
    w = torch.where(torch.rand(n, k, generator=g) < 0.5, -128, 127).to(torch.int8)
    w[0], w[1] = -128, 127
    a = torch.where(torch.rand(3, k, generator=g) < 0.5, -127, 127).to(torch.int8)
    a[0] = -127
    panels, correction = quant.pack_int8_weight(w)
    assert torch.equal(native.int8_gemm(a, panels, correction, n).long(), a.long() @ w.long().t())


@needs_kernels
def test_int8_gemm_refuses_rows_holding_minus_128(native):
    panels, correction = quant.pack_int8_weight(torch.ones(64, 8, dtype=torch.int8))
    rows = torch.zeros(2, 8, dtype=torch.int8)
    rows[1, 3] = -128
    with pytest.raises(KernelInputError, match="-127..127"):
        native.int8_gemm(rows, panels, correction, 64)


@needs_kernels
def test_topk_rows(native):
    x = torch.randn(5, 1000)
    x[1, 500:510] = 10.0  # ties: the lower columns first
    x[2, 7] = float("nan")  # never selected
    got = native.topk_rows(x, 16)
    for r in (0, 3, 4):
        assert torch.equal(x[r, got[r]], x[r].topk(16).values)
    assert got[1, :10].tolist() == list(range(500, 510))
    assert 7 not in got[2].tolist()
    assert torch.equal(native.topk_rows(x, 1)[:, 0], torch.nan_to_num(x, nan=-1e9).argmax(1))


# -- the model ----------------------------------------------------------------------------------


def _all_logits(model, ids: list[int]) -> torch.Tensor:
    """Float32 logits of every position, through the paged forward (one chunk up to 512)."""
    return torch.cat(list(chunk_logits(model, ids)))


def follows_float32(loaded, loaded_fp32, cache_dtype: torch.dtype | None = None) -> None:
    """On English text the model predicts nearly what the float32 model does: the same next
    token at >= 90% of positions and a perplexity within 3%."""
    ids = loaded_fp32.tokenizer.encode(TEXT)
    assert len(ids) >= 120
    exact = score_tokens(loaded_fp32.model, ids)
    got = score_tokens(loaded.model, ids, cache_dtype=cache_dtype)
    agree = got.agreement(exact)
    assert agree >= 0.9, agree
    ratio = got.perplexity / exact.perplexity
    assert ratio < 1.03, ratio


@needs_kernels
def test_int8_model_follows_float32(loaded_fp32, loaded_int8):
    follows_float32(loaded_int8, loaded_fp32)


@needs_kernels
def test_int8_model_answers_paris(loaded_int8):
    tokenizer = loaded_int8.tokenizer
    ids = tokenizer.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    text = tokenizer.decode(greedy_continuation(loaded_int8.model, ids, 16))
    assert "Paris" in text


@needs_kernels
def test_int8_model_is_smaller_and_says_so(loaded_bf16, loaded_int8):
    assert loaded_int8.model.quantization == "int8"
    assert loaded_int8.model.num_bytes < loaded_bf16.model.num_bytes
    assert "+ int8" in loaded_int8.summary()


@needs_kernels
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_int8_tiny_checkpoints_follow_float32(tmp_path, arch, kernels):
    """Other shapes (hidden 128, one KV head, q/k/v biases for qwen2, q/k norms for qwen3, a
    112-wide MLP whose down_proj input rotates in blocks of 16): int8 logits stay close to
    float32's."""
    config = tiny_config(
        arch, hidden_size=128, num_attention_heads=2, num_key_value_heads=1, head_dim=64
    )
    save_tiny(tmp_path, config)
    checkpoint = SafetensorsCheckpoint(tmp_path)
    ids = list(range(3, 60))
    logits = {}
    for quantization in ("none", "int8"):
        model = LlamaModel.from_tensors(
            checkpoint.config,
            checkpoint.get,
            dtype=torch.float32,
            device=CPU,
            quantization=quantization,
            kernels=kernels,
        )
        logits[quantization] = _all_logits(model, ids)
    exact, int8 = logits["none"], logits["int8"]
    cosine = F.cosine_similarity(
        exact - exact.mean(-1, keepdim=True), int8 - int8.mean(-1, keepdim=True), dim=-1
    )
    assert float(cosine.min()) > 0.99


def test_int8_refuses_models_without_the_fused_path(tmp_path, kernels):
    config = tiny_config("qwen3")  # head_dim 32: no C kernels for it
    save_tiny(tmp_path, config)
    checkpoint = SafetensorsCheckpoint(tmp_path)
    with pytest.raises(ValueError, match="--quantization int8"):
        LlamaModel.from_tensors(
            checkpoint.config,
            checkpoint.get,
            dtype=torch.float32,
            device=CPU,
            quantization="int8",
            kernels=kernels,
        )


@needs_kernels
def test_auto_picks_int8_for_the_quantized_default_model(loaded_default, native):
    """No flags: the default Q4_1 file runs int8 linear layers here, and says why."""
    assert loaded_default.model.quantization == "int8"
    assert loaded_default.quantization_reason.startswith("auto: the checkpoint is quantized")
    assert "Q4_1" in loaded_default.quantization_reason
    assert loaded_default.quantization_reason.endswith(f"int8 products by {native.int8_gemm_isa}")


def test_auto_keeps_the_float_path_where_the_int8_product_is_not_built(loaded_default, kernels):
    """Without kvserve's int8 kernel only torch._int_mm is left, slower than float on such
    CPUs (docs/serving.md): auto keeps the float path and says why."""
    import copy

    from kvserve.model.loader import choose_quantization

    without = copy.copy(kernels)
    without.int8_gemm_isa = None  # as a CPU with neither AVX512-VNNI nor AVX2 reports
    choice, reason = choose_quantization(
        "auto", ["F32", "Q4_1"], loaded_default.config, CPU, torch.float32, kernels=without
    )
    assert choice == "none"
    assert "int8 product kernel does not run on this CPU" in reason and "Q4_1" in reason


def test_auto_keeps_a_float_checkpoint_float(tmp_path):
    from kvserve.model.loader import choose_quantization

    save_tiny(tmp_path, tiny_config("llama", head_dim=64, hidden_size=128))
    checkpoint = SafetensorsCheckpoint(tmp_path)
    choice, reason = choose_quantization(
        "auto", checkpoint.quantization, checkpoint.config, CPU, torch.float32
    )
    assert choice == "none"
    assert reason.startswith("auto: the checkpoint is float (")


def test_auto_reasons_where_the_cpu_kernels_cannot_run(kernels):
    from kvserve.model.loader import choose_quantization
    from kvserve.model.safetensors import config_from_json

    config = config_from_json(
        {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
         "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
         "head_dim": 32, "vocab_size": 100, "max_position_embeddings": 64}
    )  # fmt: skip
    choice, reason = choose_quantization(
        "auto", ["F32", "Q4_0"], config, CPU, torch.float32, kernels=kernels
    )
    assert choice == "none" and "head_dim 32" in reason  # the kernels take 64 and 128
    assert choose_quantization("none", ["Q4_0"], config, CPU, torch.float32) == (
        "none",
        "asked for",
    )


def test_auto_keeps_a_dtype_asked_for_by_name(loaded_default):
    """`--dtype float32` asks for the float path: auto keeps it, and says so."""
    from kvserve.model.loader import choose_quantization

    choice = choose_quantization(
        "auto", ["F32", "Q4_1"], loaded_default.config, CPU, torch.float32, dtype_asked=True
    )
    assert choice == ("none", "auto: --dtype float32 asked for, kept")


def test_unknown_quantization_is_refused():
    from kvserve.config import DeviceConfig

    with pytest.raises(ValueError, match="unknown quantization 'fp4'"):
        DeviceConfig(quantization="fp4")


def test_cli_flag_reaches_the_device_config():
    import argparse

    from kvserve.cli import add_engine_arguments, engine_config_from_args

    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    args = parser.parse_args(["--quantization", "int8"])
    assert engine_config_from_args(args).device.quantization == "int8"
    assert engine_config_from_args(parser.parse_args([])).device.quantization == "auto"
    with pytest.raises(SystemExit):
        parser.parse_args(["--quantization", "int4"])


@needs_kernels
@pytest.mark.parametrize("cache_dtype", [None, torch.int8])
def test_layers_in_one_c_call_match_the_python_loop(loaded_int8, cache_dtype, native):
    """The C driver runs the same kernels in the same order as the Python loop: identical
    logits, for a prefill and a decode row, on either cache."""
    model = loaded_int8.model
    ids = loaded_int8.tokenizer.encode(TEXT)[:70]
    if cache_dtype is not None and not native.kv_int8:
        pytest.skip("needs the int8 KV cache kernels")
    results = []
    assert model.driver is not None
    for twin in (model, model.with_driver(False)):
        cache = KVCache(model.config, 4, 32, cache_dtype or model.dtype, CPU)
        meta = twin.attention.build_metadata([Chunk(0, 69, [2, 0, 3], True)], 32)
        prefill = twin.forward(torch.tensor(ids[:69]), meta, cache)
        meta = twin.attention.build_metadata([Chunk(69, 1, [2, 0, 3], True)], 32)
        decode = twin.forward(torch.tensor(ids[69:70]), meta, cache)
        results.append((prefill, decode, cache.kv.clone()))
    (p1, d1, kv1), (p2, d2, kv2) = results
    assert torch.equal(p1, p2) and torch.equal(d1, d2) and torch.equal(kv1, kv2)
