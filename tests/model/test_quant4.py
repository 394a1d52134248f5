"""The 4-bit path (`--quantization q4`): the file's blocks, the kernels, and the model it gives."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from kvserve.bench.big_model import TINY, generate
from kvserve.config import DeviceConfig
from kvserve.model.gguf import GGUFCheckpoint
from kvserve.model.kernels import KernelInputError, load_kernels
from kvserve.model.kv_cache import KVCache
from kvserve.model.linear import q4 as quant4
from kvserve.model.linear.q4 import Blocks
from kvserve.model.loader import choose_quantization, load_model
from tests.model.helpers import (
    Chunk,
    assert_the_same_on_any_number_of_threads,
    greedy_continuation,
)
from tests.model.test_quant import TEXT, follows_float32

CPU = torch.device("cpu")

needs_kernels = pytest.mark.skipif(
    not load_kernels().q4, reason="needs the C kernels and AVX512-VNNI"
)


@pytest.fixture(scope="module")
def native(kernels):
    return kernels


def random_blocks(n: int, k: int, qtype: str, seed: int = 0) -> Blocks:
    """Random GGUF blocks: random nibbles, scales and (Q4_1) offsets of realistic sizes."""
    rng = np.random.default_rng(seed)
    width = quant4.BLOCK_BYTES[qtype]
    raw = rng.integers(0, 256, (n, k // 32, width), dtype=np.uint8)
    raw[:, :, 0:2] = (
        (rng.standard_normal((n, k // 32)) * 0.01).astype(np.float16)[..., None].view(np.uint8)
    )
    if qtype == "Q4_1":
        m = (rng.standard_normal((n, k // 32)) * 0.05).astype(np.float16)
        raw[:, :, 2:4] = m[..., None].view(np.uint8)
    return Blocks(qtype, raw.reshape(n, -1))


def test_blocks_dequantize_as_gguf_does():
    """Our reading of the blocks is the gguf package's."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    for qtype in ("Q4_0", "Q4_1"):
        blocks = random_blocks(40, 96, qtype)
        expected = dequantize(blocks.raw, GGMLQuantizationType[qtype])
        assert np.array_equal(blocks.dequantize().numpy(), expected.reshape(40, 96))


def test_mixed_parts_fuse_as_q4_1_exactly():
    q4_0, q4_1 = random_blocks(8, 64, "Q4_0", seed=1), random_blocks(6, 64, "Q4_1", seed=2)
    fused = quant4.fuse([q4_0, q4_1])
    assert fused.qtype == "Q4_1" and fused.shape == (14, 64)
    expected = torch.cat([q4_0.dequantize(), q4_1.dequantize()])
    assert torch.equal(fused.dequantize(), expected)


@needs_kernels
def test_block_quantization_of_activations(native):
    x = torch.randn(5, 96) * torch.linspace(0.1, 30, 96)
    x[2, 32:64] = 0  # a block of zeros: scale 0, values 0
    q, scales, sums = native.quantize_blocks(x)
    assert q.shape == (2, 5, 96) and scales.shape == sums.shape == (5, 3)
    blocks = x.view(5, 3, 32)
    assert torch.allclose(scales, blocks.abs().amax(-1) / 127 / 16)
    assert scales[2, 1] == 0 and not q[:, 2, 32:64].any()
    # the first part is llama.cpp's Q8_0 of the block (to the rounding of v * (127 / max))
    coarse = torch.nan_to_num(blocks / (scales[..., None] * 16))  # the zero block: 0
    assert ((q[0].float().view(5, 3, 32) - coarse).abs() <= 0.5 + 1e-4).all()
    whole = (16 * q[0].double() + q[1].double()).view(5, 3, 32)
    restored = whole * scales[..., None].double()
    # within one unit of e / 16 (half a unit; a rest clamped to 8 may miss by one)
    assert ((restored - blocks).abs() <= scales[..., None] * 1.001 + 1e-7).all()
    assert torch.allclose(sums.double(), scales.double() * whole.sum(-1))


@needs_kernels
@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1"])
@pytest.mark.parametrize(("rows", "n", "k"), [(1, 576, 576), (7, 100, 64), (13, 3072, 576),
                                              (64, 576, 1536), (3, 31, 32)])  # fmt: skip
def test_product_matches_the_dequantized_reference(qtype, rows, n, k, native):
    """The kernel's product equals the float64 product of the dequantized weight and the
    dequantized activations (to float32 rounding), for any row count and column count."""
    blocks = random_blocks(n, k, qtype, seed=rows)
    weight = quant4.Q4Linear.from_blocks(blocks, kernels=native)
    x = torch.randn(rows, k)
    q, scales, sums = native.quantize_blocks(x)
    out = weight.apply((q, scales, sums))
    whole = 16 * q[0].double() + q[1].double()
    activations = (whole.view(rows, -1, 32) * scales[..., None].double()).view(rows, k)
    reference = activations.double() @ blocks.dequantize().double().T
    assert out.shape == (rows, n)
    assert float((out - reference).abs().max()) <= 1e-5 * float(reference.abs().max())


@needs_kernels
def test_a_row_does_not_depend_on_its_batch_mates(native):
    weight = quant4.Q4Linear.from_blocks(random_blocks(200, 256, "Q4_1"), kernels=native)
    x = torch.randn(33, 256)
    together = weight.apply(native.quantize_blocks(x))
    for row in (0, 5, 32):
        alone = weight.apply(native.quantize_blocks(x[row : row + 1]))
        assert torch.equal(alone[0], together[row])


@needs_kernels
def test_a_product_is_the_same_on_any_number_of_threads(native):
    """Its panels shared out among the threads (csrc/task_ranges.h), more threads than cores
    included: each panel computed once, the same floats as on one thread (two inputs in turn,
    so that a panel left out would keep the other's results)."""
    weight = quant4.Q4Linear.from_blocks(random_blocks(2000, 256, "Q4_1", seed=3), kernels=native)
    inputs = [native.quantize_blocks(torch.randn(5, 256)) for _ in range(2)]
    assert_the_same_on_any_number_of_threads(lambda: [weight.apply(act) for act in inputs])


@needs_kernels
def test_the_kernels_refuse_what_they_cannot_take(native):
    weight = quant4.Q4Linear.from_blocks(random_blocks(64, 64, "Q4_0"), kernels=native)
    q, scales, sums = native.quantize_blocks(torch.randn(2, 64))
    with pytest.raises(KernelInputError, match="whole blocks"):
        native.quantize_blocks(torch.randn(2, 40))
    with pytest.raises(KernelInputError, match="packed weight"):
        native.q4_gemm(q, scales, sums, weight.packed, 64, asym=True)  # Q4_0 is not Q4_1
    with pytest.raises(KernelInputError, match="packed weight"):
        native.q4_gemm(q, scales, sums, weight.packed, 100, asym=False)
    with pytest.raises(KernelInputError, match="scales"):
        native.q4_gemm(q, scales[:1], sums, weight.packed, 64, asym=False)
    empty = native.q4_gemm(q[:, :0], scales[:0], sums[:0], weight.packed, 64, asym=False)
    assert empty.shape == (0, 64)


@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory):
    """The tiny model as Q4_0 and Q8_0 (the same float weights rounded two ways)."""
    return generate(TINY, ("Q4_0", "Q8_0"), tmp_path_factory.mktemp("tiny4"))


def _prompt_logits(model, ids: list[int]) -> torch.Tensor:
    cache = KVCache(model.config, -(-len(ids) // 32), 32, model.dtype, CPU)
    blocks = list(range(-(-len(ids) // 32)))
    meta = model.attention.build_metadata([Chunk(0, len(ids), blocks, True)], 32)
    meta.logits_indices = torch.arange(len(ids))
    return model.forward(torch.tensor(ids), meta, cache)


@needs_kernels
def test_q4_0_and_q8_0_files_of_one_model_load_and_answer(tiny_files, tmp_path):
    """The Q4_0 file keeps its blocks (q4), the Q8_0 file runs on int8 (auto); both answer, and
    the 4-bit path follows the float computation over the same Q4_0 weights."""
    options = {"device": "cpu", "weight_cache_dir": str(tmp_path)}
    q4 = load_model(str(tiny_files["Q4_0"]), DeviceConfig(**options, quantization="q4"))
    q8 = load_model(str(tiny_files["Q8_0"]), DeviceConfig(**options))
    assert q4.model.quantization == "q4"
    assert q8.model.quantization == "int8"
    with pytest.raises(ValueError, match="not all Q4_0/Q4_1"):
        load_model(str(tiny_files["Q8_0"]), DeviceConfig(**options, quantization="q4"))
    reference = load_model(
        str(tiny_files["Q4_0"]), DeviceConfig(**options, dtype="float32", quantization="none")
    )
    ids = q4.tokenizer.encode("The capital of France is")
    for loaded in (q4, q8):
        answer = greedy_continuation(loaded.model, ids, 8)
        assert len(answer) == 8 and all(0 <= t < loaded.config.vocab_size for t in answer)
    exact, got = _prompt_logits(reference.model, ids), _prompt_logits(q4.model, ids)
    cosine = F.cosine_similarity(
        exact - exact.mean(-1, keepdim=True), got - got.mean(-1, keepdim=True), dim=-1
    )
    assert float(cosine.min()) > 0.99
    # 4-bit blocks in memory: the layers hold about half the bytes of int8's
    layers = sum(
        w.num_bytes
        for layer in q4.model.layers
        for w in (layer.qkv, layer.o, layer.gate_up, layer.down)
    )
    checkpoint = GGUFCheckpoint(tiny_files["Q4_0"])
    file_bytes = sum(
        t.nbytes for name, t in checkpoint.tensors.items() if name.endswith("proj.weight")
    )
    assert layers <= file_bytes * 1.02


@needs_kernels
def test_the_default_model_on_4_bit_blocks_follows_float32(loaded_fp32, loaded_q4):
    follows_float32(loaded_q4, loaded_fp32)


@needs_kernels
@pytest.mark.parametrize(
    ("question", "answer"),
    [
        ("What is the capital of France?", "Paris"),
        ("What is the capital of Japan?", "Tokyo"),
        ("What is 2+2?", "4"),
    ],
)
def test_the_default_model_on_4_bit_blocks_gives_the_fidelity_answers(loaded_q4, question, answer):
    tokenizer = loaded_q4.tokenizer
    ids = tokenizer.encode_chat([{"role": "user", "content": question}])
    text = tokenizer.decode(greedy_continuation(loaded_q4.model, ids, 24))
    assert answer.lower() in text.lower(), text


@needs_kernels
def test_the_default_model_on_4_bit_blocks_says_so_and_is_smaller(loaded_q4, loaded_int8):
    assert loaded_q4.model.quantization == "q4"
    assert loaded_q4.quantization_reason == "asked for"
    assert "+ q4" in loaded_q4.summary()
    # the layers at 5 bits a weight (Q4_1) against 8; both keep an int8 head
    assert loaded_q4.model.weight_bytes_per_step < 0.75 * loaded_int8.model.weight_bytes_per_step


def test_q4_asked_for_where_it_cannot_run_is_refused_with_the_reason(loaded_default):
    with pytest.raises(ValueError, match="--quantization q4 cannot run this model here: why"):
        choose_quantization(
            "q4", ["Q8_0"], loaded_default.config, CPU, torch.float32, q4_unsupported="why"
        )
    # auto never picks it (twice int8's multiplies: see choose_quantization)
    assert choose_quantization("auto", ["Q4_1"], loaded_default.config, CPU, torch.bfloat16)[0] in (
        "int8",
        "none",
    )


def test_only_files_whose_layers_are_4_bit_blocks_qualify(tiny_files, kernels):
    q4_0 = GGUFCheckpoint(tiny_files["Q4_0"])
    q8_0 = GGUFCheckpoint(tiny_files["Q8_0"])
    if kernels.q4:
        assert quant4.unsupported(q4_0, q4_0.config, kernels) is None
    else:
        assert "AVX512-VNNI" in quant4.unsupported(q4_0, q4_0.config, kernels)
    assert "not all Q4_0/Q4_1" in quant4.unsupported(q8_0, q8_0.config, kernels)


@needs_kernels
@pytest.mark.parametrize("cache_dtype", [None, torch.int8])
def test_a_decode_row_does_not_depend_on_its_batch_mates(loaded_q4, cache_dtype):
    """A sequence's decode logits are the same alone and beside another sequence's row (to the
    float32 rounding of the exact recomputation of the best candidates, a batched product)."""
    model = loaded_q4.model
    ids = loaded_q4.tokenizer.encode(TEXT)[:70]
    other = loaded_q4.tokenizer.encode(TEXT)[70:110]
    cache = KVCache(model.config, 6, 32, cache_dtype or model.dtype, CPU)
    prefills = [Chunk(0, 69, [2, 0, 1], False), Chunk(0, 39, [3, 4], False)]
    meta = model.attention.build_metadata(prefills, 32)
    model.forward(torch.tensor(ids[:69] + other[:39]), meta, cache)
    meta = model.attention.build_metadata([Chunk(69, 1, [2, 0, 1], True)], 32)
    alone = model.forward(torch.tensor(ids[69:70]), meta, cache)
    rows = [Chunk(39, 1, [3, 4], True), Chunk(69, 1, [2, 0, 1], True)]
    meta = model.attention.build_metadata(rows, 32)
    together = model.forward(torch.tensor([other[39], ids[69]]), meta, cache)
    assert torch.allclose(alone[0], together[1], rtol=0, atol=1e-4)
    assert int(alone[0].argmax()) == int(together[1].argmax())


@needs_kernels
def test_the_weight_cache_keeps_q4_weights(tiny_files, tmp_path):
    """A q4 model is cached at its first start and memory-mapped at the next, with the same
    logits; the int8 preparation of the same file is a different entry."""
    options = {"device": "cpu", "weight_cache_dir": str(tmp_path), "quantization": "q4"}
    first = load_model(str(tiny_files["Q4_0"]), DeviceConfig(**options))
    second = load_model(str(tiny_files["Q4_0"]), DeviceConfig(**options))
    assert (first.weight_cache, second.weight_cache) == ("written", "hit")
    (cached,) = tmp_path.glob("*.safetensors")
    with open("/proc/self/maps") as maps:
        assert str(cached) in maps.read()
    ids = first.tokenizer.encode("The capital of France is")
    assert torch.equal(_prompt_logits(first.model, ids), _prompt_logits(second.model, ids))
    int8 = load_model(str(tiny_files["Q4_0"]), DeviceConfig(**options | {"quantization": "int8"}))
    assert int8.weight_cache == "written" and int8.weight_cache_written.result() is not None
    assert len(list(tmp_path.glob("*.safetensors"))) == 2


def test_the_cli_takes_q4():
    import argparse

    from kvserve.cli import add_engine_arguments, engine_config_from_args

    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    args = parser.parse_args(["--quantization", "q4"])
    assert engine_config_from_args(args).device.quantization == "q4"


@needs_kernels
def test_auto_keeps_the_cache_in_the_model_dtype_beside_4_bit_weights(loaded_q4):
    from kvserve.model.kv_cache import choose_cache_dtype

    dtype, reason = choose_cache_dtype("auto", loaded_q4.model)
    assert dtype == loaded_q4.model.dtype and "beside 4-bit weights" in reason
    assert choose_cache_dtype("int8", loaded_q4.model) == (torch.int8, "asked for")


@needs_kernels
@pytest.mark.parametrize("cache_dtype", [None, torch.int8])
def test_layers_in_one_c_call_match_the_python_loop(loaded_q4, cache_dtype):
    """The 4-bit driver (csrc/forward_q4.c) runs the layer loop's kernels in its order: the
    same logits and cache, for a prefill and a decode row, on either cache."""
    model = loaded_q4.model
    assert model.driver is not None
    ids = loaded_q4.tokenizer.encode(TEXT)[:70]
    results = []
    for twin in (model, model.with_driver(False)):
        cache = KVCache(model.config, 4, 32, cache_dtype or model.dtype, CPU)
        meta = twin.attention.build_metadata([Chunk(0, 69, [2, 0, 3], True)], 32)
        prefill = twin.forward(torch.tensor(ids[:69]), meta, cache)
        meta = twin.attention.build_metadata([Chunk(69, 1, [2, 0, 3], True)], 32)
        decode = twin.forward(torch.tensor(ids[69:70]), meta, cache)
        results.append((prefill, decode, cache.kv.float()))
    (p1, d1, kv1), (p2, d2, kv2) = results
    # the same kernels; the q/k norm's sum may vectorize otherwise in its own kernel
    for a, b in ((p1, p2), (d1, d2), (kv1, kv2)):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-4)
    assert int(d1.argmax()) == int(d2.argmax())
