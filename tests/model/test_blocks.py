"""Weights kept in GGUF block formats (kvserve/model/linear/blocks.py, csrc/blocks_gemm.c): decoding
equal to the gguf package's, products equal to a float64 reference, rows independent of their
batch mates and of the thread count, inputs refused before C runs, every instruction-set path
built, and the AMX-INT8 path giving the vector tiles' floats."""

from __future__ import annotations

import copy
import ctypes
import os
import shutil
import subprocess

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from kvserve.model import block_formats as blocks
from kvserve.model import kernel_build
from kvserve.model.gguf import GGUFCheckpoint
from kvserve.model.kernels import (
    BlocksWeightStruct,
    KernelInputError,
    block_format,
    load_kernels,
)
from kvserve.model.linear.blocks import (
    BlockLinear,
    BlockWeight,
    UnsupportedBlockFormat,
    fused_from_checkpoint,
    read_gguf,
)
from tests.model.helpers import assert_the_same_on_any_number_of_threads

FORMATS = list(blocks.FORMATS)
LEGACY = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"]  # the types gguf.quants can quantize
K_QUANTS = ["Q4_K", "Q5_K", "Q6_K"]
KERNELS = load_kernels()

needs_product = pytest.mark.skipif(not KERNELS.blocks_isa, reason="needs the C kernels and AVX2")


@pytest.fixture(scope="module", autouse=True)
def built():
    assert KERNELS.has("blocks"), "the C kernels must build on this machine"


def act_blocks(x, fine=False):
    return KERNELS.blocks_quantize(x, fine)


def pack(qtype, raw):
    return KERNELS.blocks_pack(block_format(qtype), raw)


def from_raw(qtype, raw, bias=None):
    return BlockWeight.from_raw(qtype, raw, KERNELS, bias)


def random_raw(qtype: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    """Random valid GGUF blocks [n, row bytes]: every byte random (all integer codes, Q8_0's
    -128 included), the float16 scales of realistic sizes."""
    f = blocks.FORMATS[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (n, k // f.values, f.gguf_bytes), dtype=np.uint8)

    def put(offset: int, size: float) -> None:
        values = (rng.standard_normal((n, k // f.values)) * size).astype(np.float16)
        raw[:, :, offset : offset + 2] = values[..., None].view(np.uint8)

    if qtype == "Q6_K":
        put(208, 0.002)
    else:
        put(0, 0.01 if f.values == 32 else 0.002)
        if qtype in ("Q4_1", "Q5_1"):
            put(2, 0.05)
        elif qtype in ("Q4_K", "Q5_K"):
            put(2, 0.002)
    return raw.reshape(n, -1)


def gguf_decoded(qtype: str, raw: np.ndarray) -> np.ndarray:
    n = raw.shape[0]
    return dequantize(raw, GGMLQuantizationType[qtype]).reshape(n, -1)


# -- decoding and packing -------------------------------------------------------------------------


@pytest.mark.parametrize("qtype", FORMATS)
@pytest.mark.parametrize(("n", "k"), [(16, 256), (37, 512), (3, 768)])
def test_packed_weights_decode_as_gguf_does(qtype, n, k):
    raw = random_raw(qtype, n, k, seed=n + k)
    weight = from_raw(qtype, raw)
    assert (weight.out_features, weight.in_features) == (n, k)
    assert np.array_equal(weight.dequantize().numpy(), gguf_decoded(qtype, raw))


@pytest.mark.parametrize("qtype", LEGACY)
def test_blocks_quantized_by_gguf_decode_as_gguf_does(qtype):
    values = np.random.default_rng(3).standard_normal((21, 256)).astype(np.float32)
    raw = quantize(values, GGMLQuantizationType[qtype])
    weight = from_raw(qtype, raw)
    assert np.array_equal(weight.dequantize().numpy(), gguf_decoded(qtype, raw))


@pytest.mark.parametrize("qtype", FORMATS)
def test_packed_weights_hold_about_the_files_bytes(qtype):
    """Whole panels hold exactly the file's bytes, or 3% more for Q4_K / Q5_K's scales."""
    raw = random_raw(qtype, 64, 512)
    weight = from_raw(qtype, raw)
    ratio = weight.num_bytes / raw.nbytes
    assert ratio == 1.0 or (qtype in ("Q4_K", "Q5_K") and ratio <= 1.03), ratio


def test_packing_reads_a_read_only_map_without_copying_it_whole(tmp_path):
    raw = random_raw("Q4_K", 40, 512)
    path = tmp_path / "blocks.bin"
    raw.tofile(path)
    mapped = np.memmap(path, dtype=np.uint8, mode="r", shape=raw.shape)
    assert torch.equal(pack("Q4_K", mapped), pack("Q4_K", raw))


# -- activations ----------------------------------------------------------------------------------


def test_activation_blocks_are_q8_0_with_float_scales_and_sums_of_16():
    x = torch.randn(5, 96) * torch.linspace(0.1, 30, 96)
    x[2, 32:64] = 0  # a block of zeros: scale 0, values 0
    act = act_blocks(x)
    assert act.q.shape == (5, 96) and act.scales.shape == (5, 3) and act.sums.shape == (5, 6)
    view = x.view(5, 3, 32)
    assert torch.equal(act.scales, view.abs().amax(-1) / 127)
    assert act.scales[2, 1] == 0 and not act.q[2, 32:64].any()
    assert int(act.q.min()) >= -127 and int(act.q.max()) <= 127
    steps = act.scales.double()[..., None]
    assert ((act.dequantize().view(5, 3, 32) - view.double()).abs() <= steps * 0.5001).all()
    assert torch.equal(act.sums, act.q.view(5, 6, 16).sum(-1, dtype=torch.int32))


def test_eight_bit_blocks_of_whole_256s_share_one_scale_per_256():
    """A k of whole 256s: one scale per 256 values (llama.cpp's Q8_K), written for each of its
    8 blocks; the finer form keeps its blocks of 32."""
    x = torch.randn(3, 512) * torch.linspace(0.1, 4, 512)
    act = act_blocks(x)
    wide = x.view(3, 2, 256).abs().amax(-1) / 127
    assert torch.equal(act.scales, wide.repeat_interleave(8, dim=1))
    assert int(act.q.abs().amax()) == 127 and act.q.abs().view(3, 2, 256).amax(-1).min() == 127
    assert torch.equal(act.sums, act.q.to(torch.int32).view(3, 32, 16).sum(-1))
    steps = act.scales.double().repeat_interleave(32, dim=1)
    assert ((act.dequantize() - x.double()).abs() <= steps * 0.5001).all()
    fine = act_blocks(x, fine=True)
    assert torch.equal(fine.scales * 16, x.view(3, 16, 32).abs().amax(-1) / 127)


def test_the_finer_form_adds_a_4_bit_rest():
    x = torch.randn(5, 96) * torch.linspace(0.1, 30, 96)
    x[2, 32:64] = 0
    coarse, fine = act_blocks(x), act_blocks(x, fine=True)
    assert torch.equal(fine.q, coarse.q)  # the first part is the 8-bit form
    assert torch.equal(fine.scales, coarse.scales / 16)
    assert int(fine.rest.abs().max()) <= 8 and not fine.rest[2, 32:64].any()
    view = x.view(5, 3, 32).double()
    steps = fine.scales.double()[..., None]
    # within one step (half a step; a rest clamped to 8 may miss by one)
    assert ((fine.dequantize().view(5, 3, 32) - view).abs() <= steps * 1.001).all()
    assert torch.equal(fine.sums, fine.integers().view(5, 6, 16).sum(-1, dtype=torch.int32))
    coarse_error = (coarse.dequantize() - x.double()).abs().mean()
    assert (fine.dequantize() - x.double()).abs().mean() < coarse_error / 8


def test_activation_blocks_of_bfloat16_and_strided_rows():
    x = torch.randn(4, 128)
    wide = torch.randn(4, 200)
    wide[:, 40:168] = x
    for source in (x.to(torch.bfloat16), wide[:, 40:168]):
        for fine in (False, True):
            got = act_blocks(source, fine)
            want = act_blocks(source.float().contiguous(), fine)
            assert all(
                (a is None and b is None) or torch.equal(a, b)
                for a, b in zip(got, want, strict=True)
            )


def test_add_rmsnorm_adds_normalizes_and_quantizes():
    x, delta, weight = torch.randn(6, 128), torch.randn(6, 128), torch.rand(128) + 0.5
    expected_x = x + delta
    h = expected_x.double()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * weight.double()
    act = KERNELS.blocks_add_rmsnorm(x, delta, weight, 1e-6)
    assert torch.allclose(x, expected_x, rtol=0, atol=0)
    steps = act.scales.double().repeat_interleave(32, dim=1)
    assert ((act.dequantize() - h).abs() <= steps * 0.5 + 1e-5 * h.abs()).all()
    # the last layer: only the addition
    assert KERNELS.blocks_add_rmsnorm(x, delta, weight, 1e-6, normalize=False) is None
    assert torch.allclose(x, expected_x + delta, rtol=1e-6, atol=1e-6)
    # the finer form of the same normalized rows
    again = x.clone()
    fine = KERNELS.blocks_add_rmsnorm(again, None, weight, 1e-6, fine=True)
    assert torch.equal(again, x)
    h = x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-6)
    h = h * weight.double()
    steps = fine.scales.double().repeat_interleave(32, dim=1)
    assert ((fine.dequantize() - h).abs() <= steps * 1.001 + 1e-5 * h.abs()).all()


def test_silu_mul_quantizes_silu_of_gate_times_up():
    gate_up = torch.randn(3, 256) * 3
    gate, up = gate_up.double().chunk(2, dim=-1)
    m = torch.nn.functional.silu(gate) * up
    for fine, slack in ((False, 0.5), (True, 1.001)):
        act = KERNELS.blocks_silu_mul(gate_up, fine)
        steps = act.scales.double().repeat_interleave(32, dim=1)
        assert ((act.dequantize() - m).abs() <= steps * slack + 1e-5 * m.abs() + 1e-7).all()


# -- products -------------------------------------------------------------------------------------


def assert_matches_reference(out: torch.Tensor, act, weight: torch.Tensor, bias=None) -> None:
    """out equals the float64 product of the dequantized activations and weight to float32
    rounding: per output, within (blocks + 8) float32 roundings of the sum of |terms|."""
    a, w = act.dequantize(), weight.double()
    reference = a @ w.T
    if bias is not None:
        reference = reference + bias.double()
    magnitude = a.abs() @ w.abs().T + (0 if bias is None else bias.double().abs())
    bound = (a.shape[1] / 32 + 8) * 2.0**-24 * magnitude + 1e-30
    assert out.shape == reference.shape
    assert ((out.double() - reference).abs() <= bound).all(), float(
        ((out.double() - reference).abs() / bound).max()
    )


@needs_product
@pytest.mark.parametrize("fine", [False, True], ids=["8-bit", "12-bit"])
@pytest.mark.parametrize("qtype", FORMATS)
@pytest.mark.parametrize(("rows", "n", "k"), [(1, 48, 256), (5, 37, 512), (13, 100, 768)])
def test_product_matches_the_dequantized_reference(qtype, rows, n, k, fine):
    raw = random_raw(qtype, n, k, seed=rows)
    bias = torch.randn(n) if rows == 5 else None
    weight = from_raw(qtype, raw, bias)
    act = act_blocks(torch.randn(rows, k) * 2, fine)
    out = weight.apply_blocks(act)
    assert_matches_reference(out, act, torch.from_numpy(gguf_decoded(qtype, raw)), bias)


@needs_product
def test_extreme_codes_and_activations_stay_exact():
    """Every weight code at its largest (and Q8_0 at -128) against activations of +-127 and
    the largest sums: the bounds that keep vpmaddubsw from saturating (100 rows: the K-quants'
    8-bit form of 32 rows and more goes record by record on AVX2, of 96 and more on AVX512,
    with its own sums)."""
    k, n = 512, 32
    x = torch.full((100, k), 3.0)
    x[1::2, ::2] = -3.0
    act = act_blocks(x)
    assert int(act.q.abs().min()) == 127
    # and the finer form at its extremes: 16 * 127 + 8
    fine = blocks.ActivationBlocks(
        act.q, act.scales / 16, act.sums * 16 + 8 * 16, torch.full_like(act.q, 8)
    )
    for qtype in FORMATS:
        f = blocks.FORMATS[qtype]
        raw = random_raw(qtype, n, k, seed=9).reshape(n, k // f.values, f.gguf_bytes)
        if qtype == "Q6_K":
            raw[:, :, :192] = 0xFF  # every 6-bit code 63
        elif qtype == "Q8_0":
            raw[:, :, 2:] = 0x80  # every weight -128
        else:
            start = {"Q4_0": 2, "Q4_1": 4, "Q5_0": 2, "Q5_1": 4, "Q4_K": 16, "Q5_K": 16}[qtype]
            raw[:, :, start:] = 0xFF  # 15s and 31s (qh too), and the largest 6-bit scales
        raw = raw.reshape(n, -1)
        weight = from_raw(qtype, raw)
        decoded = torch.from_numpy(gguf_decoded(qtype, raw))
        assert_matches_reference(weight.apply_blocks(act), act, decoded)
        assert_matches_reference(weight.apply_blocks(fine), fine, decoded)


@needs_product
def test_fused_parts_keep_their_formats_and_equal_separate_products():
    k = 512
    parts = [
        from_raw(qtype, random_raw(qtype, n, k, seed=i), torch.randn(n))
        for i, (qtype, n) in enumerate([("Q4_K", 64), ("Q6_K", 21), ("Q5_0", 48), ("Q8_0", 16)])
    ]
    fused = BlockLinear(parts)
    assert fused.qtypes == ("Q4_K", "Q6_K", "Q5_0", "Q8_0") and fused.splits == [64, 21, 48, 16]
    act = act_blocks(torch.randn(9, k))
    together = fused.apply(act)
    assert together.shape == (9, fused.out_features)
    assert torch.equal(together, torch.cat([p.apply_blocks(act) for p in parts], dim=1))
    assert torch.equal(fused.apply(act), together)
    with pytest.raises(ValueError, match="share their inputs"):
        BlockLinear([parts[0], from_raw("Q4_0", random_raw("Q4_0", 16, 256))])


@needs_product
def test_every_panel_is_computed_once_whatever_the_threads_and_their_speeds():
    """The threads share a product's panels out (csrc/task_ranges.h: each its own range, the
    ones that finish first taking groups from the ends of the others'). With more threads than
    cores some wait for a core and the others take over their ranges: the results stay the
    same floats as on one thread, for the tiles (1, 8 and 37 rows) and record by record (130
    rows), a product of several formats and one of a single K-quant (two inputs in turn, so
    that a panel left out would keep the other's results)."""
    generator = torch.Generator().manual_seed(5)
    products = [
        BlockLinear([from_raw("Q4_K", random_raw("Q4_K", 1000, 512, seed=1))]),
        BlockLinear([
            from_raw(qtype, random_raw(qtype, n, 512, seed=i), torch.randn(n, generator=generator))
            for i, (qtype, n) in enumerate([("Q4_K", 300), ("Q6_K", 96), ("Q8_0", 40)])
        ]),
    ]  # fmt: skip
    inputs = [torch.randn(130, 512, generator=generator) * 3 for _ in range(2)]
    for product in products:
        for rows in (1, 8, 37, 130):
            acts = [act_blocks(x[:rows]) for x in inputs]
            assert_the_same_on_any_number_of_threads(
                lambda product=product, acts=acts: [product.apply(a) for a in acts]
            )


@needs_product
@pytest.mark.parametrize("fine", [False, True], ids=["8-bit", "12-bit"])
@pytest.mark.parametrize("qtype", FORMATS)
def test_a_row_does_not_depend_on_its_batch_mates_or_the_threads(qtype, fine):
    """Rows alone, in a batch of 37 (tiles of several rows, rows cut in chunks over few
    panels, the last rows padded to a tile) or of 101 (the K-quants record by record) and on
    one thread give the same floats."""
    k = 512
    weight = from_raw(qtype, random_raw(qtype, 40, k), torch.randn(40))
    wide = from_raw(qtype, random_raw(qtype, 300, k))
    x = torch.randn(101, k)
    act = act_blocks(x, fine)
    for w in (weight, wide):
        together = w.apply_blocks(act)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            single = w.apply_blocks(act)
        finally:
            torch.set_num_threads(threads)
        assert torch.equal(single, together)
        for row in (0, 4, 5, 36, 100):
            assert torch.equal(w.apply(x[row : row + 1], fine)[0], together[row])
        assert torch.equal(w.apply_blocks(act_blocks(x[3:9], fine)), together[3:9])
        # rows left after whole tiles go as one tile with zero rows after them (3 -> 4, 5-7 -> 8)
        for count in (3, 5, 7, 13, 37):
            assert torch.equal(w.apply_blocks(act_blocks(x[:count], fine)), together[:count])


@needs_product
def test_the_prepared_weight_cache_round_trip(tmp_path):
    from safetensors.torch import load_file, save_file

    fused = BlockLinear(
        [
            from_raw("Q4_K", random_raw("Q4_K", 32, 256), torch.randn(32)),
            from_raw("Q6_K", random_raw("Q6_K", 16, 256)),
        ]
    )
    save_file(fused.to_tensors("layers.0.qkv"), tmp_path / "w.safetensors")
    loaded = BlockLinear.from_tensors(
        load_file(tmp_path / "w.safetensors"), "layers.0.qkv", KERNELS
    )
    assert loaded.qtypes == fused.qtypes and loaded.splits == fused.splits
    act = act_blocks(torch.randn(3, 256))
    assert torch.equal(loaded.apply(act), fused.apply(act))
    tensors = fused.parts[0].to_tensors("w")
    tensors["w.shape"] = torch.tensor([12, 48, 256])  # more columns than the packed panels
    with pytest.raises(ValueError, match="packed Q4_K"):
        BlockWeight.from_tensors(tensors, "w")
    tensors["w.shape"] = torch.tensor([99, 32, 256])
    with pytest.raises(ValueError, match="GGML type 99"):
        BlockWeight.from_tensors(tensors, "w")


# -- the default model's real Q4_1 tensors --------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoint(model_path):
    return GGUFCheckpoint(model_path)


@needs_product
def test_a_real_tensor_of_the_default_model(checkpoint):
    name = "model.layers.0.mlp.down_proj.weight"
    assert checkpoint.tensor_type(name) == "Q4_1"
    weight = BlockWeight.from_checkpoint(checkpoint, name, KERNELS)
    decoded = weight.dequantize()
    assert torch.equal(decoded, checkpoint.get(name))
    assert weight.num_bytes == checkpoint.tensors[name].nbytes
    act = act_blocks(torch.randn(4, weight.in_features))
    assert_matches_reference(weight.apply_blocks(act), act, decoded)


@needs_product
def test_the_default_models_q_k_v_fused_with_their_biases(checkpoint):
    prefix = "model.layers.1.self_attn."
    names = [prefix + f"{p}_proj.weight" for p in "qkv"]
    qkv = fused_from_checkpoint(checkpoint, names, KERNELS)
    assert qkv.out_features == sum(checkpoint.get(n).shape[0] for n in names)
    act = act_blocks(torch.randn(3, qkv.in_features))
    reference = torch.cat([checkpoint.get(n) for n in names])
    assert_matches_reference(qkv.apply(act), act, reference)
    with pytest.raises(UnsupportedBlockFormat, match="F32"):
        read_gguf(checkpoint, "model.layers.1.input_layernorm.weight")
    with pytest.raises(KeyError):
        read_gguf(checkpoint, "model.layers.1.nothing.weight")


# -- refusals -------------------------------------------------------------------------------------


@needs_product
def test_the_kernels_refuse_what_they_cannot_take():
    weight = from_raw("Q4_K", random_raw("Q4_K", 32, 512))
    act = act_blocks(torch.randn(2, 512))
    part = weight.part
    gemm = KERNELS.blocks_gemm
    with pytest.raises(KernelInputError, match="whole blocks"):
        act_blocks(torch.randn(2, 40))
    with pytest.raises(KernelInputError, match="no block kernel"):
        pack("IQ4_XS", random_raw("Q4_0", 4, 64))
    with pytest.raises(KernelInputError, match="not whole blocks"):
        pack("Q4_K", np.zeros((4, 100), np.uint8))
    with pytest.raises(KernelInputError, match="uint8"):
        pack("Q4_K", np.zeros((4, 144), np.int8))
    with pytest.raises(KernelInputError, match="packed Q6_K"):  # another format's panels
        gemm(act, [part._replace(qtype="Q6_K")])
    with pytest.raises(KernelInputError, match="packed Q4_K"):  # more columns than packed
        gemm(act, [part._replace(n=48)])
    with pytest.raises(KernelInputError, match="whole Q4_K blocks"):  # k of 480
        gemm(act_blocks(torch.randn(2, 480)), [part])
    with pytest.raises(KernelInputError, match="packed Q4_K"):  # k of 768
        gemm(act_blocks(torch.randn(2, 768)), [part])
    with pytest.raises(KernelInputError, match="contiguous"):
        gemm(
            act, [part._replace(packed=weight.packed.transpose(0, 1).contiguous().transpose(0, 1))]
        )
    with pytest.raises(KernelInputError, match="bias"):
        gemm(act, [part._replace(bias=torch.zeros(31))])
    with pytest.raises(KernelInputError, match="activation scales"):
        gemm(act._replace(scales=act.scales[:, :-1].contiguous()), [part])
    with pytest.raises(KernelInputError, match="activation sums"):
        gemm(act._replace(sums=act.sums.to(torch.int64)), [part])
    with pytest.raises(KernelInputError, match="activation values"):
        gemm(act._replace(q=act.q.to(torch.int16)), [part])
    bad = act.q.clone()
    bad[1, 7] = -128
    with pytest.raises(KernelInputError, match="-127..127"):
        gemm(act._replace(q=bad), [part])
    with pytest.raises(KernelInputError, match="activation rests"):
        gemm(act._replace(rest=act.q[:, :256].contiguous()), [part])
    with pytest.raises(KernelInputError, match="rests must lie"):
        gemm(act._replace(rest=bad), [part])
    with pytest.raises(KernelInputError, match="at least one"):
        gemm(act, [])
    uneven = act.scales.clone()
    uneven[0, 3] *= 2  # the K-quants' 8-bit form shares one scale per 256 values
    with pytest.raises(KernelInputError, match="one scale per 256"):
        gemm(act._replace(scales=uneven), [part])
    with pytest.raises(KernelInputError, match="norm weight"):
        KERNELS.blocks_add_rmsnorm(torch.randn(2, 64), None, torch.ones(32), 1e-6)
    with pytest.raises(KernelInputError, match="even"):
        KERNELS.blocks_silu_mul(torch.randn(2, 63))

    # zero rows: the empty result, and no kernel entered
    def entered(*args):
        raise AssertionError("a call with zero rows entered C")

    guarded = copy.copy(KERNELS)
    guarded._fn = {name: (entered if "blocks" in name else fn) for name, fn in KERNELS._fn.items()}
    empty = guarded.blocks_quantize(torch.randn(0, 512))
    assert guarded.blocks_gemm(empty, [part]).shape == (0, 32)
    assert empty.q.shape == (0, 512)
    normed = guarded.blocks_add_rmsnorm(torch.randn(0, 64), None, torch.ones(64), 1e-6)
    assert normed.q.shape == (0, 64)
    assert guarded.blocks_silu_mul(torch.randn(0, 64)).q.shape == (0, 32)


# -- instruction sets -----------------------------------------------------------------------------

SOURCE = kernel_build.CSRC / "blocks_gemm.c"


def _compiler() -> str:
    compiler = shutil.which("cc") or shutil.which("gcc")
    assert compiler, "the C kernels need a compiler"
    return compiler


def _blocks_library(library, *flags: str) -> ctypes.CDLL:
    """blocks_gemm.c built at -O2 with `flags` into the shared object `library`, its family's
    symbols bound."""
    result = subprocess.run(
        [_compiler(), "-O2", *flags, "-shared", str(SOURCE), "-o", str(library), "-lm"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    lib = ctypes.CDLL(str(library))
    for symbol in next(f for f in kernel_build.FAMILIES if f.name == "blocks").symbols:
        symbol.bind(lib)
    return lib


@pytest.mark.parametrize(
    ("march", "vnni"), [("sapphirerapids", "zmm"), ("icelake-server", "zmm"), ("alderlake", "ymm")]
)
def test_the_vnni_paths_compile(tmp_path, march, vnni):
    """AVX512-VNNI (16 columns a vector; with AMX-INT8, and without as Ice Lake or Zen 4) and
    AVX-VNNI (8) build, with vpdpbusd in the product and every symbol the family loads
    defined; this CPU cannot run them, and they share every line but the vector helpers.
    (-O1: the same code is checked in half the time of the library's -O3.)"""
    out = tmp_path / "blocks.s"
    result = subprocess.run(
        [_compiler(), "-O1", f"-march={march}", "-fopenmp", "-std=c11", *kernel_build.FLAGS[2:4],
         "-Werror=implicit-function-declaration", "-S", str(SOURCE), "-o", str(out)],
        capture_output=True, text=True,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assembly = out.read_text()
    assert f"vpdpbusd\t%{vnni}" in assembly and "vpmaddubsw" not in assembly
    family = next(f for f in kernel_build.FAMILIES if f.name == "blocks")
    missing = [s.name for s in family.symbols if f"\n{s.name}:" not in assembly]
    assert not missing, missing


def test_without_avx2_the_product_says_so_and_packing_still_works(tmp_path):
    """Built for plain x86-64 the family reports no product (the caller keeps a float path);
    its packing gives the same bytes as this machine's build."""
    lib = _blocks_library(tmp_path / "blocks.so", "-march=x86-64", "-fopenmp", "-std=c11", "-fPIC")
    assert lib.kvserve_blocks_isa() == 0 and lib.kvserve_blocks_amx() == 0
    assert lib.kvserve_blocks_many_rows() == 0
    raw = random_raw("Q5_K", 20, 512)
    weight = from_raw("Q5_K", raw)
    packed = torch.empty_like(weight.packed)
    assert lib.kvserve_blocks_pack(13, raw.ctypes.data, 20, 512, packed.data_ptr(), 1) == 0
    assert torch.equal(packed, weight.packed)
    act = act_blocks(torch.randn(1, 512))
    out = torch.empty(1, 20)
    table = (BlocksWeightStruct * 1)(BlocksWeightStruct(packed.data_ptr(), None, 20, 13))
    status = lib.kvserve_blocks_gemm(
        act.q.data_ptr(), None, act.scales.data_ptr(), act.sums.data_ptr(), 1, 512,
        ctypes.addressof(table), 1, out.data_ptr(), 20, 1,
    )  # fmt: skip
    assert status == -2


@needs_product
def test_the_avx2_product_gives_this_machines_floats(tmp_path):
    """Built for AVX2 without VNNI (vpmaddubsw's int16 pair sums, the sub-block scales applied
    by vpmaddwd), the product gives the same float32 results as this machine's build, bit for
    bit, in both activation forms and tiles of 1, 2, 4 and 8 rows (and 7 = 4 + 2 + 1, 15 = 8 +
    4 + 2 + 1: this machine's AVX512 tiles take 8 rows, AVX2's 4), and from 32 rows on, where
    AVX2 takes the K-quants' 8-bit form record by record (33, 40: tiles of 4, 2 and 1; 101:
    AVX512 too, in tiles of 8, 4 and 1)."""
    lib = _blocks_library(tmp_path / "blocks_avx2.so", "-march=haswell", *kernel_build.FLAGS[2:])
    assert lib.kvserve_blocks_isa() == 1 and lib.kvserve_blocks_amx() == 0
    assert lib.kvserve_blocks_many_rows() == 32
    k, n = 512, 40
    x = torch.randn(101, k) * 3
    for fine in (False, True):
        act = act_blocks(x, fine)
        for qtype in FORMATS:
            weight = from_raw(qtype, random_raw(qtype, n, k, seed=3), torch.randn(n))
            table = (BlocksWeightStruct * 1)(
                BlocksWeightStruct(weight.packed.data_ptr(), weight.bias.data_ptr(), n,
                                   block_format(qtype).ggml_type)
            )  # fmt: skip
            for rows in (1, 2, 4, 7, 8, 15, 33, 40, 101):
                out = torch.empty(rows, n)
                status = lib.kvserve_blocks_gemm(
                    act.q.data_ptr(), None if act.rest is None else act.rest.data_ptr(),
                    act.scales.data_ptr(), act.sums.data_ptr(), rows, k,
                    ctypes.addressof(table), 1, out.data_ptr(), n, 1,
                )  # fmt: skip
                assert status == 0
                mine = weight.apply_blocks(blocks.ActivationBlocks(*(
                    None if t is None else t[:rows] for t in act
                )))  # fmt: skip
                assert torch.equal(out, mine), (qtype, fine, rows)


# -- AMX-INT8 -------------------------------------------------------------------------------------

HAS_AMX = kernel_build.cpu_has_amx()


def test_the_amx_path_runs_where_the_cpu_has_it_unless_turned_off():
    """kvserve_blocks_amx: 0 on a CPU without AMX-INT8 (or with KVSERVE_AMX=0), the rows from
    which on it takes the tile unit on one with it; the banner says so."""
    turned_off = os.environ.get("KVSERVE_AMX") == "0"
    assert KERNELS.blocks_amx == (
        HAS_AMX and KERNELS.blocks_isa == "AVX512-VNNI" and not turned_off
    )
    assert ("AMX-INT8 from 13 rows" in KERNELS.describe()) == KERNELS.blocks_amx
    assert KERNELS.as_dict()["blocks_amx"] == KERNELS.blocks_amx


def test_avx2_and_avx512_say_from_which_rows_they_go_record_by_record():
    """The AVX2 build without VNNI takes the K-quants' products of 32 rows and more record by
    record, the AVX512 one of 96 and more (where the tile unit does not take them), and the
    banner says so; the AVX-VNNI build never."""
    expected = {"AVX2": 32, "AVX512-VNNI": 0 if KERNELS.blocks_amx else 96}.get(
        KERNELS.blocks_isa, 0
    )
    assert KERNELS.blocks_many_rows == expected
    assert (f"record by record from {expected} rows" in KERNELS.describe()) == bool(expected)
    assert KERNELS.as_dict()["blocks_many_rows"] == expected


@pytest.mark.skipif(
    not KERNELS.blocks_amx, reason="needs a CPU with AMX-INT8 (and KVSERVE_AMX unset)"
)
def test_the_amx_product_gives_the_vector_tiles_floats(tmp_path, monkeypatch):
    """The K-quants' 8-bit products of 13 rows and more on the tile unit (this process's
    kernels) equal the vector tiles' (the same source built again, KVSERVE_AMX=0 when it first
    asks), bit for bit: row counts not a multiple of 16 or 32, columns not a multiple of 16,
    biases, fused parts with other formats between them, an output large enough to be
    streamed past the caches, one and two threads."""
    lib = _blocks_library(tmp_path / "blocks_tiles.so", *kernel_build.compile_flags()[1:])
    monkeypatch.setenv("KVSERVE_AMX", "0")
    assert lib.kvserve_blocks_amx() == 0
    monkeypatch.delenv("KVSERVE_AMX")
    assert lib.kvserve_blocks_amx() == 0  # read once

    def tiles_product(act, parts, rows, threads):
        table = (BlocksWeightStruct * len(parts))(*(
            BlocksWeightStruct(p.packed.data_ptr(), None if p.bias is None else p.bias.data_ptr(),
                               p.out_features, block_format(p.qtype).ggml_type)
            for p in parts
        ))  # fmt: skip
        columns = sum(p.out_features for p in parts)
        out = torch.empty(rows, columns)
        status = lib.kvserve_blocks_gemm(
            act.q.data_ptr(), None, act.scales.data_ptr(), act.sums.data_ptr(), rows,
            act.q.shape[1], ctypes.addressof(table), len(parts), out.data_ptr(), columns, threads,
        )  # fmt: skip
        assert status == 0
        return out

    generator = torch.Generator().manual_seed(5)
    cases = [
        [from_raw(qtype, random_raw(qtype, n, k, seed=n), torch.randn(n, generator=generator))]
        for qtype in K_QUANTS
        for n, k in ((40, 512), (300, 768))
    ]
    cases.append([from_raw("Q6_K", random_raw("Q6_K", 37, 256))])  # no bias
    # 130 rows of 16,400 columns: an output past AMX_STREAM_BYTES, written around the caches
    # (but its last unit, of one panel)
    cases.append([from_raw("Q4_K", random_raw("Q4_K", 16400, 256), torch.randn(16400))])
    cases.append([
        from_raw(qtype, random_raw(qtype, n, 512, seed=i), torch.randn(n, generator=generator))
        for i, (qtype, n) in enumerate(
            [("Q4_K", 70), ("Q5_0", 48), ("Q6_K", 21), ("Q8_0", 16), ("Q5_K", 64), ("Q4_K", 9)]
        )
    ])  # fmt: skip
    threads = torch.get_num_threads()
    try:
        for parts in cases:
            k = parts[0].in_features
            fused = BlockLinear(parts)
            x = torch.randn(130, k, generator=generator) * 3
            act = act_blocks(x)
            for rows in (13, 16, 17, 31, 32, 33, 47, 64, 130):
                rows_act = blocks.ActivationBlocks(*(None if t is None else t[:rows] for t in act))
                for count in (1, 2):
                    torch.set_num_threads(count)
                    mine = fused.apply(rows_act)
                    theirs = tiles_product(rows_act, parts, rows, count)
                    assert torch.equal(mine, theirs), (fused.qtypes, rows, count)
    finally:
        torch.set_num_threads(threads)
