"""The GGUF block path (`--quantization gguf`, auto for K-quant files): a real Q4_K_M file
(qwen2.5-coder:0.5b) kept in its blocks follows the float32 model of the same dequantized
weights, answers sensibly, holds about the file's bytes, caches its prepared blocks, and a row's
result never depends on its batch mates; the default model's Q4_1 file runs the same path."""

from __future__ import annotations

import pytest
import torch

from kvserve.bench.quality import quality_text, score_tokens
from kvserve.config import DeviceConfig
from kvserve.model.gguf import GGUFCheckpoint
from kvserve.model.kernels import load_kernels
from kvserve.model.kv_cache import KVCache
from kvserve.model.loader import load_model
from tests.model.helpers import Chunk, greedy_continuation

pytestmark = pytest.mark.skipif(
    not load_kernels().blocks_isa, reason="the block product needs the C kernels and AVX2"
)

CPU = torch.device("cpu")


def test_auto_keeps_a_k_quant_file_in_its_blocks(qwen05_gguf):
    assert qwen05_gguf.model.quantization == "gguf"
    assert qwen05_gguf.quantization_reason.startswith("auto: the file's blocks kept (")
    assert "Q4_K" in qwen05_gguf.quantization_reason
    assert "+ gguf" in qwen05_gguf.summary()


def test_the_blocks_follow_the_float32_model_of_the_same_weights(qwen05_gguf, qwen05_fp32):
    """On held-out English text (the quality bench's): perplexity within 1% of the float32
    model of the dequantized file, the same next token at >= 95% of positions."""
    ids = qwen05_fp32.tokenizer.encode(quality_text())[:1024]
    exact = score_tokens(qwen05_fp32.model, ids)
    got = score_tokens(qwen05_gguf.model, ids)
    assert abs(got.perplexity / exact.perplexity - 1) < 0.01, (got.perplexity, exact.perplexity)
    assert got.agreement(exact) >= 0.95, got.agreement(exact)


@pytest.mark.parametrize(
    ("question", "answer"),
    [("What is the capital of France?", "Paris"), ("What is 2+2?", "4")],
)
def test_chat_answers_are_sensible(qwen05_gguf, question, answer):
    tokenizer = qwen05_gguf.tokenizer
    ids = tokenizer.encode_chat([{"role": "user", "content": question}])
    text = tokenizer.decode(greedy_continuation(qwen05_gguf.model, ids, 16))
    assert answer in text, text


def test_the_weights_in_memory_are_the_files(qwen05_gguf, qwen05_path):
    """Layers and head packed at about the file's bytes, the embedding table left in the file:
    no dequantized copy of anything but the norms and biases."""
    checkpoint = GGUFCheckpoint(qwen05_path)
    file_bytes = sum(t.nbytes for t in checkpoint.header.tensors)
    assert qwen05_gguf.model.num_bytes <= 1.1 * file_bytes
    assert qwen05_gguf.model.lm_head is None


def test_the_prepared_blocks_are_cached_and_mapped(qwen05_path, tmp_path):
    """First start packs and writes; the next maps the file: identical logits."""
    options = DeviceConfig(device="cpu", weight_cache_dir=str(tmp_path), quantization="gguf")
    first = load_model(str(qwen05_path), options)
    second = load_model(str(qwen05_path), options)
    assert (first.weight_cache, second.weight_cache) == ("written", "hit")
    (cached,) = tmp_path.glob("*.safetensors")
    with open("/proc/self/maps") as maps:
        assert str(cached) in maps.read()
    ids = first.tokenizer.encode("def square(x):\n    return")
    assert torch.equal(_prompt_logits(first.model, ids), _prompt_logits(second.model, ids))


def _prompt_logits(model, ids: list[int]) -> torch.Tensor:
    blocks = list(range(-(-len(ids) // 32)))
    cache = KVCache(model.config, len(blocks), 32, model.dtype, CPU)
    meta = model.attention.build_metadata([Chunk(0, len(ids), blocks, True)], 32)
    meta.logits_indices = torch.arange(len(ids))
    return model.forward(torch.tensor(ids), meta, cache)


def test_a_row_does_not_depend_on_its_batch_mates(qwen05_gguf):
    """A sequence's decode logits are the same, bit for bit, alone and beside other rows (the
    block product, attention and the head's exact recompute each work a row alone)."""
    model, tokenizer = qwen05_gguf.model, qwen05_gguf.tokenizer
    a = tokenizer.encode(quality_text())[:70]
    b = tokenizer.encode(quality_text())[200:240]
    cache = KVCache(model.config, 6, 32, model.dtype, CPU)
    prefill = model.attention.build_metadata(
        [Chunk(0, 69, [2, 0, 1], False), Chunk(0, 39, [3, 4], False)], 32
    )
    model.forward(torch.tensor(a[:69] + b[:39]), prefill, cache)
    meta = model.attention.build_metadata([Chunk(69, 1, [2, 0, 1], True)], 32)
    alone = model.forward(torch.tensor(a[69:70]), meta, cache)
    rows = [Chunk(39, 1, [3, 4], True), Chunk(69, 1, [2, 0, 1], True)]
    meta = model.attention.build_metadata(rows, 32)
    together = model.forward(torch.tensor([b[39], a[69]]), meta, cache)
    assert torch.equal(alone[0], together[1])


def test_the_default_models_q4_1_file_on_its_blocks_answers_as_float32(tmp_path):
    """The 576-wide default model takes 12-bit activation blocks (8 bits turn its near tie
    "Paris" into another answer): the fidelity answer of the float32 model."""
    loaded = load_model(
        None, DeviceConfig(device="cpu", quantization="gguf", weight_cache_dir=str(tmp_path))
    )
    assert loaded.model.quantization == "gguf"
    assert loaded.model.layers[0].qkv.input.fine
    tokenizer = loaded.tokenizer
    ids = tokenizer.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    assert "Paris" in tokenizer.decode(greedy_continuation(loaded.model, ids, 12))


def test_gguf_asked_for_where_it_cannot_run_is_refused_with_the_reason(tmp_path, kernels):
    from kvserve.model.linear import blocks
    from kvserve.model.loader import choose_quantization
    from kvserve.model.safetensors import SafetensorsCheckpoint
    from tests.model.test_safetensors import save_tiny, tiny_config

    save_tiny(tmp_path, tiny_config("llama", head_dim=64, hidden_size=128))
    checkpoint = SafetensorsCheckpoint(tmp_path)
    why = blocks.unsupported(checkpoint, checkpoint.config, kernels)
    assert why == "the checkpoint is not a GGUF file"
    with pytest.raises(ValueError, match="--quantization gguf cannot run this model here: the"):
        choose_quantization(
            "gguf", ["F32"], checkpoint.config, CPU, torch.float32, gguf_unsupported=why
        )


def test_layers_in_one_c_call_match_the_python_loop(qwen05_gguf):
    """The block driver (csrc/forward_blocks.c) runs the layer loop's kernels in its order:
    identical logits and cache, for a prefill and a decode row."""
    model = qwen05_gguf.model
    assert model.driver is not None and model.driver.name == "blocks"
    ids = qwen05_gguf.tokenizer.encode(quality_text())[:70]
    results = []
    for twin in (model, model.with_driver(False)):
        assert (twin.driver is None) == (twin is not model)
        cache = KVCache(model.config, 4, 32, model.dtype, CPU)
        meta = twin.attention.build_metadata([Chunk(0, 69, [2, 0, 3], True)], 32)
        prefill = twin.forward(torch.tensor(ids[:69]), meta, cache)
        meta = twin.attention.build_metadata([Chunk(69, 1, [2, 0, 3], True)], 32)
        decode = twin.forward(torch.tensor(ids[69:70]), meta, cache)
        results.append((prefill, decode, cache.kv.clone()))
    (p1, d1, kv1), (p2, d2, kv2) = results
    assert torch.equal(p1, p2) and torch.equal(d1, d2) and torch.equal(kv1, kv2)


def test_a_drafts_guess_head_is_4_bit_and_picks_the_models_best_tokens(qwen05_gguf):
    """A draft's head (kvserve/model/head.py, GuessHead): the first GUESS_VOCAB rows of the
    0.5B's Q8_0 lm_head requantized to Q4_0, about half their bytes; on the residual rows of
    real text its best token is the model's own (exact head's) best at most positions, and where
    not, the model's two best were nearly tied; a head already in 4-bit blocks is read where it
    lies."""
    from kvserve.core.plan import ChunkPlan
    from kvserve.model.head import GUESS_VOCAB, BlockHead, GuessHead
    from kvserve.model.linear.blocks import BlockLinear, BlockWeight

    model = qwen05_gguf.model
    guess = GuessHead.of(model.head)
    assert GuessHead.of(model.head) is guess  # made once per loaded head
    assert model.head.qtype == "Q8_0" and guess.product.qtypes == ("Q4_0",)
    vocab = model.config.vocab_size
    assert guess.product.out_features == GUESS_VOCAB < vocab
    assert 0.5 < guess.num_bytes / (model.head.num_bytes * GUESS_VOCAB / vocab) < 0.6
    ids = qwen05_gguf.tokenizer.encode(quality_text())[:256]
    cache = KVCache(model.config, 8, 32, model.dtype, CPU)
    chunk = ChunkPlan("text", 0, 0, len(ids), tuple(range(8)), is_prefill=True, samples=True)
    meta = model.attention.build_metadata([chunk], 32)
    meta.logits_indices = torch.arange(len(ids))
    with torch.inference_mode():
        rows = model.sampled_rows(torch.tensor(ids), meta, cache)
        logits = model.head.logits(rows)
        exact = logits.argmax(-1)
        best = guess.best(rows, model.config.vocab_size)
        assert int(best.max()) < GUESS_VOCAB
        # below a smaller vocabulary (a target's), no token at or past it; no rows, no tokens
        assert int(guess.best(rows, 1000).max()) < 1000
        assert guess.best(rows[:0], model.config.vocab_size).shape == (0,)
    # 88.9% on the AVX512 machine (Q5_0: 94.7%, Q8_0 without the exact recompute: 98.8%), and
    # where they differ, the exact head's two best were nearly tied: a coin flip for a guess.
    differ = best != exact
    assert float(differ.double().mean()) <= 0.2, float(differ.double().mean())
    top2 = logits[differ].topk(2, dim=-1).values
    assert float((top2[:, 0] - top2[:, 1]).median()) < 0.5
    # A head already in Q4_0 blocks is read where it lies: nothing copied (its first rows are
    # a view), and within them the same choices.
    head = BlockHead(guess.product, model.head.norm, "Q4_0", None, model.head.eps, model.kernels)
    again = GuessHead.of(head)
    assert again.product is guess.product and again.num_bytes == 0
    (part,) = guess.product.parts
    packed = part.packed.repeat(2, 1, 1)  # rows past GUESS_VOCAB: copies of the first ones
    wider = BlockWeight("Q4_0", 2 * GUESS_VOCAB, part.in_features, packed, None, model.kernels)
    head = BlockHead(
        BlockLinear((wider,)), model.head.norm, "Q4_0", None, model.head.eps, model.kernels
    )
    view = GuessHead.of(head)
    assert view.num_bytes == 0 and view.product.out_features == GUESS_VOCAB
    with torch.inference_mode():
        assert torch.equal(view.best(rows, 2 * GUESS_VOCAB), best)


def test_q4_0_rows_round_as_ggml_rounds_them(kernels):
    """The requantizer's Q4_0 blocks are gguf-py's (ggml's reference rounding), byte for byte,
    on ordinary rows and on the blocks where rounding is decided: zeros, a negative extreme,
    values at half steps, tiny and huge scales."""
    import numpy as np
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    rng = np.random.default_rng(7)
    x = rng.standard_normal((64, 256)).astype(np.float32)
    x[0] = 0.0
    x[1, :32] = -3.0
    x[2, :32] = np.linspace(-8, 7, 32, dtype=np.float32) / 8  # halves of a step
    x[3] *= np.float32(1e-7)  # a scale below float16's normal range
    x[4] *= np.float32(6e4)  # one at its top
    x[5, 7] = 1.0e5  # a scale past float16's range
    ours = kernels.blocks_quantize_q4_0(torch.from_numpy(x))
    assert ours.dtype == np.uint8 and ours.shape == (64, 256 // 32 * 18)
    assert np.array_equal(ours, quantize(x, GGMLQuantizationType.Q4_0))
    with pytest.raises(ValueError, match="whole blocks of 32"):
        kernels.blocks_quantize_q4_0(torch.zeros(2, 48))
    with pytest.raises(ValueError):
        kernels.blocks_quantize_q4_0(torch.zeros(2, 64, dtype=torch.bfloat16))


def test_a_drafts_layers_are_requantized_to_q4_0_and_guess_as_the_file_does(
    qwen05_gguf, qwen05_draft, qwen05_path
):
    """`DeviceConfig.requantize` (a draft's layers, SpeculativeConfig.draft_requantize): every
    layer weight in larger blocks than Q4_0 is Q4_0, each the file's values rounded again as
    ggml rounds them; the file's Q4_K stays; the layers take about a fifth fewer bytes; and the
    model's greedy next tokens on real text are mostly the file's."""
    import numpy as np
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    from kvserve.model.head import GuessHead

    file_model, model = qwen05_gguf.model, qwen05_draft.model
    types = {q for layer in model.layers for p in _products(layer) for q in p.qtypes}
    assert types == {"Q4_0", "Q4_K"}
    assert "layers requantized to Q4_0" in qwen05_draft.summary()
    assert 0.75 < model.layer_bytes / file_model.layer_bytes < 0.85
    checkpoint = GGUFCheckpoint(qwen05_path)
    down = checkpoint.tensor_type("model.layers.3.mlp.down_proj.weight")
    rows = np.asarray(checkpoint.raw_rows("model.layers.3.mlp.down_proj.weight"))
    values = dequantize(rows, GGMLQuantizationType[down])
    again = dequantize(quantize(values, GGMLQuantizationType.Q4_0), GGMLQuantizationType.Q4_0)
    (part,) = model.layers[3].down.parts
    assert down == "Q6_K" and part.qtype == "Q4_0"
    assert torch.equal(part.dequantize(), torch.from_numpy(np.ascontiguousarray(again)))
    # Greedy next tokens over real text: the requantized draft's best against the file's.
    ids = qwen05_gguf.tokenizer.encode(quality_text())[:256]
    best = {}
    for name, loaded in (("file", qwen05_gguf), ("draft", qwen05_draft)):
        m = loaded.model
        cache = KVCache(m.config, 8, 32, m.dtype, CPU)
        meta = m.attention.build_metadata([Chunk(0, len(ids), tuple(range(8)), True)], 32)
        meta.logits_indices = torch.arange(len(ids))
        with torch.inference_mode():
            rows_out = m.sampled_rows(torch.tensor(ids), meta, cache)
            best[name] = GuessHead.of(m.head).best(rows_out, m.config.vocab_size)
    agreement = float((best["file"] == best["draft"]).double().mean())
    assert agreement >= 0.8, agreement


def _products(layer):
    return (layer.qkv, layer.o, layer.gate_up, layer.down)
