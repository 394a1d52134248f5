"""Every family against transformers: Llama 3 (llama3 RoPE scaling), Mistral (sliding window),
Gemma 2, Gemma 3, Phi-3 (longrope), Qwen2 (biases) and Qwen3 (YaRN).

Each family's checkpoint is tiny and random, made here from the family's transformers config,
saved as a Hugging Face directory and written as a GGUF file of the same weights the way
llama.cpp's convert_hf_to_gguf.py writes that architecture (its tensor names by gguf's own
name map, q/k rows permuted for `llama`, Gemma's norms stored as 1 + w, Phi-3's fused
projections, Llama 3's `rope_freqs` and Phi-3's `rope_factors_*` tensors, and its metadata
keys). kvserve loads both; every position's float32 logits stay within 1e-3 of transformers',
over prompts longer than the sliding window, and greedy continuations are identical. The int8
linear method follows float32 (cosine of centered logits > 0.99, as the other int8 tests), as
do the 4-bit blocks where the CPU runs them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from kvserve.config import DeviceConfig
from kvserve.model.attention import int8_cache_refusal
from kvserve.model.kv_cache import KVCache, choose_cache_dtype
from kvserve.model.loader import load_model
from tests.model.helpers import Chunk, greedy_continuation, reference_greedy

CPU = torch.device("cpu")
SHAPES = dict(
    hidden_size=128,
    intermediate_size=192,
    num_hidden_layers=3,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=64,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
)
WINDOW = 16
PHI3_ORIGINAL = 32
PROMPT_LENGTHS = (7, 23, 45, 70)  # beyond every window (16; Phi-3's 48)


@dataclass(frozen=True)
class Case:
    config_class: str
    gguf_arch: str
    options: dict
    layers: int = 3
    # transformers picks Phi-3's short or long factors from the longest position it sees;
    # kvserve picks long for the context it serves: prompts beyond the original context
    min_prompt: int = 0
    features: tuple[str, ...] = field(default=())  # what the one-call drivers lack


def _longrope_factors(offset: float, step: float) -> list[float]:
    return [offset + i * step for i in range(SHAPES["head_dim"] // 2)]


CASES = {
    "llama3": Case(
        "LlamaConfig",
        "llama",
        {
            "rope_theta": 500000.0,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        },
    ),
    "mistral": Case("MistralConfig", "llama", {"sliding_window": WINDOW}, features=("sliding",)),
    "gemma2": Case(
        "Gemma2Config",
        "gemma2",
        {
            "sliding_window": WINDOW,
            "query_pre_attn_scalar": 64,
            # small caps, so that they bite on a tiny model's scores and logits
            "attn_logit_softcapping": 2.0,
            "final_logit_softcapping": 3.0,
        },
        layers=4,
        features=("sliding",),
    ),
    "gemma3": Case(
        "Gemma3TextConfig",
        "gemma3",
        {
            "sliding_window": WINDOW,
            "query_pre_attn_scalar": 64,
            "rope_theta": 1000000.0,
            "rope_local_base_freq": 10000.0,
            "rope_scaling": {"rope_type": "linear", "factor": 2.0},
        },
        layers=6,  # five windowed layers, then a global one
        features=("sliding",),
    ),
    "phi3": Case(
        "Phi3Config",
        "phi3",
        {
            "sliding_window": 48,
            "original_max_position_embeddings": PHI3_ORIGINAL,
            "rope_scaling": {
                "type": "longrope",
                "short_factor": _longrope_factors(1.0, 0.05),
                "long_factor": _longrope_factors(1.5, 0.1),
            },
            "pad_token_id": 2,
        },
        min_prompt=PHI3_ORIGINAL + 1,
        features=("sliding",),
    ),
    "qwen2": Case("Qwen2Config", "qwen2", {}),  # q/k/v biases
    "qwen3": Case(
        "Qwen3Config",
        "qwen3",
        {
            "rope_scaling": {
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 64,
            }
        },
    ),
}


def hf_config(case: Case, vocab: int):
    import transformers

    options = SHAPES | {"num_hidden_layers": case.layers, "vocab_size": vocab} | case.options
    options |= {"bos_token_id": 1, "eos_token_id": 2}
    return getattr(transformers, case.config_class)(**options)


def make_reference(case: Case, vocab: int):
    import transformers

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        hf_config(case, vocab), dtype=torch.float32
    )
    with torch.no_grad():  # random init leaves norms at their identity, biases at 0
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    return model.eval()


# -- a GGUF of the same weights, as llama.cpp's converter writes it ------------------------------


def _permute(weights: torch.Tensor, n_head: int) -> torch.Tensor:
    """convert_hf_to_gguf.py's LlamaModel.permute: q/k rows for interleaved RoPE."""
    return (
        weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def _llama3_rope_factors(cfg) -> list[float]:
    """convert_hf_to_gguf.py's LlamaModel.generate_extra_tensors (rope_freqs)."""
    params = cfg.rope_parameters
    base, dim = params["rope_theta"], cfg.head_dim
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor, low, high = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
    old = params["original_max_position_embeddings"]
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            factors.append(1)
        elif wavelen > old / low:
            factors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return factors


def write_gguf(path: Path, case: Case, reference, tokenizer_fields, qtype=None) -> Path:
    """The reference's weights as convert_hf_to_gguf.py writes them for the case's
    architecture (float32, or `qtype` blocks for the layers' linear weights), with the
    default model's vocabulary (`tokenizer_fields`: its tokenizer.* metadata)."""
    import gguf
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    cfg = reference.config
    arch = case.gguf_arch
    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in tokenizer_fields.items():
        if isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        else:
            writer.add_array(key, value)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_file_type(0)
    params = cfg.rope_parameters.get("full_attention", cfg.rope_parameters)
    writer.add_rope_freq_base(params["rope_theta"])
    extra: dict[str, list[float]] = {}
    kind = params.get("rope_type")
    if kind == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(params["factor"])
    elif kind == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(params["factor"])
        writer.add_rope_scaling_orig_ctx_len(params["original_max_position_embeddings"])
    elif kind == "llama3":
        extra["rope_freqs.weight"] = _llama3_rope_factors(cfg)
    if arch in ("llama", "phi3"):
        writer.add_rope_dimension_count(cfg.head_dim)
    if arch == "llama" and getattr(cfg, "sliding_window", None):
        # llama.cpp's converter drops Mistral's window (llama.cpp attends to the whole
        # context); the key it would read for a window keeps the file faithful to the model
        writer.add_sliding_window(cfg.sliding_window)
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        writer.add_final_logit_softcapping(cfg.final_logit_softcapping)
        writer.add_sliding_window(cfg.sliding_window)
    if arch == "gemma3":
        if cfg.final_logit_softcapping:
            writer.add_final_logit_softcapping(cfg.final_logit_softcapping)
        writer.add_sliding_window(cfg.sliding_window)
    if arch == "phi3":
        original = cfg.original_max_position_embeddings
        writer.add_rope_scaling_orig_ctx_len(original)
        writer.add_sliding_window(cfg.sliding_window or 0)
        scale = cfg.max_position_embeddings / original
        writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)))
        extra["rope_factors_long.weight"] = params["long_factor"]
        extra["rope_factors_short.weight"] = params["short_factor"]

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], cfg.num_hidden_layers)
    tied = cfg.tie_word_embeddings
    for name, tensor in reference.state_dict().items():
        if name == "lm_head.weight" and tied:
            continue
        data = tensor.detach().float()
        if arch.startswith("gemma") and name.endswith("norm.weight"):
            data = data + 1  # Gemma's norms multiply by 1 + w: the converter stores 1 + w
        if arch == "llama" and name.endswith("q_proj.weight"):
            data = _permute(data, cfg.num_attention_heads)
        if arch == "llama" and name.endswith("k_proj.weight"):
            data = _permute(data, cfg.num_key_value_heads)
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, name
        array = data.numpy()
        if qtype is not None and array.ndim == 2 and gguf_name.startswith("blk."):
            qt = GGMLQuantizationType[qtype]
            writer.add_tensor(gguf_name, quantize(array, qt), raw_dtype=qt)
        else:
            writer.add_tensor(gguf_name, np.ascontiguousarray(array))
    for name, values in extra.items():
        writer.add_tensor(name, np.array(values, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# -- the checkpoints, loaded ---------------------------------------------------------------------


@dataclass
class Built:
    name: str
    case: Case
    reference: object
    root: Path
    hf: object  # LoadedModel of the Hugging Face directory
    gguf: object  # LoadedModel of the GGUF file
    prompts: list[list[int]]


@pytest.fixture(scope="module")
def tokenizer_fields(model_path):
    """The default model's tokenizer.* metadata (a GPT-2 BPE vocabulary of 49,152 tokens)."""
    from kvserve.model.gguf import read_header

    fields = read_header(model_path).fields
    return {k: v for k, v in fields.items() if k.startswith("tokenizer.")}


FP32 = DeviceConfig(device="cpu", dtype="float32", quantization="none")


@pytest.fixture(scope="module", params=list(CASES))
def family(request, tmp_path_factory, hf_tokenizer, tokenizer_fields):
    case = CASES[request.param]
    root = tmp_path_factory.mktemp(request.param)
    vocab = len(hf_tokenizer)
    reference = make_reference(case, vocab)
    reference.save_pretrained(root / "hf", safe_serialization=True)
    hf_tokenizer.save_pretrained(root / "hf")
    write_gguf(root / f"{request.param}.gguf", case, reference, tokenizer_fields)
    generator = torch.Generator().manual_seed(7)
    prompts = [
        torch.randint(3, vocab, (max(n, case.min_prompt),), generator=generator).tolist()
        for n in PROMPT_LENGTHS
    ]
    return Built(
        request.param,
        case,
        reference,
        root,
        load_model(str(root / "hf"), FP32),
        load_model(str(root / f"{request.param}.gguf"), FP32),
        prompts,
    )


def all_logits(model, ids: list[int], block_size: int = 16) -> torch.Tensor:
    """Logits at every position of one prefill, the sequence's blocks scattered."""
    num_blocks = -(-len(ids) // block_size)
    table = [num_blocks + 4 - b for b in range(num_blocks)]  # distinct, in reverse order
    cache = KVCache(model.config, num_blocks + 5, block_size, model.dtype, CPU)
    meta = model.attention.build_metadata([Chunk(0, len(ids), table, True)], block_size)
    meta.logits_indices = torch.arange(len(ids))
    return model.forward(torch.tensor(ids), meta, cache)


def reference_logits(built: Built, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return built.reference(torch.tensor([ids])).logits[0].float()


def centered_cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    cosine = F.cosine_similarity(a - a.mean(-1, keepdim=True), b - b.mean(-1, keepdim=True), dim=-1)
    return float(cosine.min())


# -- float32 against transformers ----------------------------------------------------------------


def test_both_files_describe_the_same_model(family):
    hf, gguf_config = family.hf.config, family.gguf.config
    for name in (
        "num_layers",
        "hidden_activation",
        "sandwich_norms",
        "scale_embeddings",
        "qk_norm",
        "attn_logit_softcapping",
        "final_logit_softcapping",
        "sliding_window",
        "layer_windows",
        "attention_scale",
        "local_rope_theta",
        "max_position_embeddings",
    ):
        assert getattr(hf, name) == getattr(gguf_config, name), name
    for local in (False, True):
        (inv_hf, factor_hf), (inv_gguf, factor_gguf) = hf.rope(local), gguf_config.rope(local)
        assert torch.allclose(inv_hf, inv_gguf, rtol=1e-6, atol=0)
        assert factor_hf == pytest.approx(factor_gguf, rel=1e-6)
    if family.case.features:
        assert hf.windowed  # the case exercises sliding windows


@pytest.mark.parametrize("source", ["hf", "gguf"])
def test_logits_match_transformers_at_every_position(family, source):
    model = getattr(family, source).model
    assert model.attention.name == "cpu-paged"
    for ids in family.prompts:
        ours = all_logits(model, ids)
        theirs = reference_logits(family, ids)
        assert (ours - theirs).abs().max().item() <= 1e-3, (source, len(ids))


def test_chunked_prefill_and_decode_rows_on_both_backends_match_transformers(family):
    """One step prefills a prompt's first 30 positions and all but the last of another's; the
    next continues the first prompt (its window has moved past whole blocks) beside the other's
    last position as a decode row. Both backends (the C kernels; torch's masks and explicit
    soft cap) give transformers' logits."""
    model = family.hf.model
    ids, other = family.prompts[-1], family.prompts[1]
    theirs, theirs_other = reference_logits(family, ids), reference_logits(family, other)
    table, other_table = [4, 9, 1, 7, 2], [15, 13, 11, 10, 8][: -(-len(other) // 16)]
    for backend in (model, model.torch_attention()):
        cache = KVCache(model.config, 16, 16, model.dtype, CPU)
        first = [Chunk(0, 30, table, False), Chunk(0, len(other) - 1, other_table, False)]
        meta = backend.attention.build_metadata(first, 16)
        backend.forward(torch.tensor(ids[:30] + other[:-1]), meta, cache)
        chunks = [
            Chunk(30, len(ids) - 30, table, True),
            Chunk(len(other) - 1, 1, other_table, True),
        ]
        meta = backend.attention.build_metadata(chunks, 16)
        meta.logits_indices = torch.arange(len(ids) - 30 + 1)
        ours = backend.forward(torch.tensor(ids[30:] + other[-1:]), meta, cache)
        name = backend.attention.name
        assert (ours[:-1] - theirs[30:]).abs().max().item() <= 1e-3, name
        assert (ours[-1] - theirs_other[-1]).abs().max().item() <= 1e-3, name


def test_blocks_behind_the_window_are_never_read(family):
    """Where every layer is windowed, a sequence gives back the blocks behind its window and its
    table shows a placeholder there that may belong to anyone: both backends must read none of
    them. Here every such entry points at a block full of NaN; prefill chunks (from position 0,
    then from 20) and then single decode rows still give transformers' logits at every
    position. (Gemma's global layers read every position: it gives nothing back.)"""
    model = family.hf.model
    config = model.config
    if config.kv_window is None:
        assert not config.all_layers_windowed  # nothing is given back, nothing to check
        return
    ids = family.prompts[-1]
    theirs = reference_logits(family, ids)
    block_size, poison = 16, 15
    table = [4, 9, 1, 7, 2]
    steps = [(0, 20), (20, 20)] + [(p, 1) for p in range(40, len(ids))]
    for backend in (model, model.torch_attention()):
        cache = KVCache(config, 16, block_size, model.dtype, CPU)
        cache.kv[:, :, :, poison] = float("nan")
        for start, n in steps:
            skip = config.first_attended_position(start) // block_size
            holed = [poison] * skip + table[skip:]
            meta = backend.attention.build_metadata([Chunk(start, n, holed, True)], block_size)
            meta.logits_indices = torch.arange(n)
            ours = backend.forward(torch.tensor(ids[start : start + n]), meta, cache)
            name = backend.attention.name
            assert (ours - theirs[start : start + n]).abs().max().item() <= 1e-3, (name, start)
        assert skip >= 1  # the window left whole blocks behind


@pytest.mark.parametrize("source", ["hf", "gguf"])
def test_greedy_continuations_match_transformers(family, source):
    """From a prompt longer than the window, 16 greedy tokens (decode rows whose window leaves
    whole blocks behind) are transformers' own."""
    ids = family.prompts[2]
    ours = greedy_continuation(getattr(family, source).model, ids, 16)
    assert ours == reference_greedy(family.reference, ids, 16)


# -- the int8 and 4-bit linear methods -----------------------------------------------------------


def test_int8_layers_follow_float32_and_come_back_from_the_weight_cache(family, kernels):
    if not kernels.int8_gemm_isa:
        pytest.skip("int8 products need the C kernels and AVX512-VNNI or AVX2")
    int8 = DeviceConfig(device="cpu", dtype="float32", quantization="int8")
    first = load_model(str(family.root / "hf"), int8)
    again = load_model(str(family.root / "hf"), int8)
    assert (first.weight_cache, again.weight_cache) == ("written", "hit")
    for ids in family.prompts:
        exact = all_logits(family.hf.model, ids)
        quantized = all_logits(first.model, ids)
        assert centered_cosine(exact, quantized) > 0.99, len(ids)
        assert torch.equal(all_logits(again.model, ids), quantized)
    if family.case.features:  # the one-call driver lacks them: the layer loop runs
        assert first.model.driver is None
        assert "does not implement" in first.model.driver_reason
    elif kernels.has("int8_driver"):  # Llama 3's RoPE and Qwen3's q/k norms stay on it
        assert first.model.driver is not None


def test_4bit_blocks_follow_float32(family, kernels, tokenizer_fields):
    if not kernels.q4:
        pytest.skip("4-bit blocks need AVX512-VNNI")
    path = write_gguf(
        family.root / "q4_0.gguf", family.case, family.reference, tokenizer_fields, "Q4_0"
    )
    loaded = load_model(str(path), DeviceConfig(device="cpu", dtype="float32", quantization="q4"))
    assert loaded.model.quantization == "q4"
    # The reference is the same file's blocks dequantized to float32: what is measured is the
    # kernel (its 8-bit activations), not Q4_0's own rounding of random weights (which alone
    # leaves a centered cosine of about 0.91-0.99 to the float32 file on these models).
    exact = load_model(str(path), DeviceConfig(device="cpu", dtype="float32", quantization="none"))
    assert exact.model.quantization == "none"
    for ids in family.prompts:
        assert centered_cosine(all_logits(exact.model, ids), all_logits(loaded.model, ids)) > 0.999


def test_the_int8_kv_cache_refuses_windowed_and_soft_capped_models(family):
    model = family.hf.model
    config = model.config
    refusal = int8_cache_refusal(config)
    if not (config.windowed or config.attn_logit_softcapping):
        assert refusal is None
        return
    assert refusal is not None
    with pytest.raises(ValueError, match="cannot run this model"):
        choose_cache_dtype("int8", model)
    assert choose_cache_dtype("auto", model)[0] == model.dtype


def test_scores_scale_by_query_pre_attn_scalar(tmp_path, kernels):
    """Gemma's scores scale by query_pre_attn_scalar^-1/2 (here 48, not head_dim 64, as the
    27B models' hidden / heads): the Hugging Face directory gives transformers' logits."""
    from kvserve.model.llama import LlamaModel
    from kvserve.model.safetensors import SafetensorsCheckpoint

    case = Case("Gemma2Config", "gemma2", CASES["gemma2"].options | {"query_pre_attn_scalar": 48})
    reference = make_reference(case, 300)
    reference.save_pretrained(tmp_path, safe_serialization=True)
    checkpoint = SafetensorsCheckpoint(tmp_path)
    assert checkpoint.config.attention_scale == 48**-0.5
    model = LlamaModel.from_tensors(
        checkpoint.config, checkpoint.get, dtype=torch.float32, device=CPU, kernels=kernels,
        family=checkpoint.family,
    )  # fmt: skip
    ids = torch.randint(0, 300, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    with torch.no_grad():
        theirs = reference(torch.tensor([ids])).logits[0]
    assert (all_logits(model, ids) - theirs).abs().max().item() <= 1e-3


def test_the_engine_serves_prompts_beyond_the_window(family):
    """Through the engine (continuous batching, prefill in chunks of 16 beside another
    sequence's decode rows), two prompts longer than the window get transformers' greedy
    tokens: the window no longer caps the context."""
    from kvserve import LLM, SamplingParams
    from tests.engine.helpers import make_config

    prompts = family.prompts[2:]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    with LLM(config=make_config(chunk=16, max_model_len=None), loaded=family.gguf) as llm:
        outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], params)
    for ids, output in zip(prompts, outputs, strict=True):
        assert list(output.outputs[0].token_ids) == reference_greedy(family.reference, ids, 8)
