"""RoPE variants and family configs: config.json and GGUF metadata to ModelConfig.

The inverse frequencies and cos/sin factor of every scheme equal, bit for bit, the ones
transformers' modeling_rope_utils computes for the same config."""

from __future__ import annotations

import math

import pytest
import torch

from kvserve.model.config import UnsupportedModelError
from kvserve.model.families import every_other, gguf_window_pattern
from kvserve.model.families.rope import rope_from_gguf
from kvserve.model.safetensors import config_from_json

SHAPES = dict(
    hidden_size=128,
    intermediate_size=192,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    vocab_size=100,
)
HALF = 32  # head_dim 64: 32 frequency pairs
SCHEMES = {
    "default": ("LlamaConfig", {}, 256),
    "linear": ("LlamaConfig", {"rope_scaling": {"rope_type": "linear", "factor": 4.0}}, 256),
    "llama3": (
        "LlamaConfig",
        {
            "rope_theta": 500000.0,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        },
        256,
    ),
    "yarn": (
        "Qwen2Config",
        {
            "rope_theta": 1000000.0,
            "rope_scaling": {
                "type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        },
        256,
    ),
    "yarn-betas-attention-factor": (
        "Qwen2Config",
        {
            "rope_scaling": {
                "rope_type": "yarn",
                "factor": 8.0,
                "original_max_position_embeddings": 32,
                "beta_fast": 16,
                "beta_slow": 2,
                "attention_factor": 1.25,
            },
        },
        256,
    ),
    "yarn-mscale": (
        "Qwen2Config",
        {
            "rope_scaling": {
                "rope_type": "yarn",
                "factor": 40.0,
                "original_max_position_embeddings": 32,
                "mscale": 1.0,
                "mscale_all_dim": 0.707,
            },
        },
        256,
    ),
    "longrope-long": (
        "Phi3Config",
        {
            "original_max_position_embeddings": 32,
            "rope_scaling": {
                "type": "longrope",
                "short_factor": [1.0 + i / 40 for i in range(HALF)],
                "long_factor": [1.5 + i / 9 for i in range(HALF)],
            },
        },
        256,
    ),
    "longrope-short": (
        "Phi3Config",
        {
            "original_max_position_embeddings": 256,
            "rope_scaling": {
                "type": "longrope",
                "short_factor": [1.0 + i / 40 for i in range(HALF)],
                "long_factor": [1.5 + i / 9 for i in range(HALF)],
            },
        },
        256,
    ),
}


def _hf(config_class: str, options: dict, max_positions: int):
    import transformers

    cls = getattr(transformers, config_class)
    arch = config_class.removesuffix("Config") + "ForCausalLM"
    options = SHAPES | {"max_position_embeddings": max_positions, "pad_token_id": 0} | options
    return cls(architectures=[arch], **options)


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_rope_matches_transformers(scheme):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = _hf(*SCHEMES[scheme])
    raw = hf.to_dict()
    if scheme == "longrope-short":  # Phi-3's first configs spelled it "su"
        raw["rope_parameters"] |= {"type": "su", "rope_type": "su"}
    ours = config_from_json(raw)
    inverse, factor = ours.rope()
    kind = hf.rope_parameters["rope_type"]
    if kind == "default":
        dim = ours.head_dim
        theirs = 1.0 / (hf.rope_parameters["rope_theta"] ** (torch.arange(0, dim, 2).float() / dim))
        their_factor = 1.0
    else:
        # transformers picks longrope's factors by the longest position of a call: the
        # served context, as kvserve fixes them
        theirs, their_factor = ROPE_INIT_FUNCTIONS[kind](
            hf, None, seq_len=hf.max_position_embeddings
        )
    assert torch.equal(inverse, theirs)
    assert factor == their_factor


def test_a_llama3_gguf_rope_freqs_tensor_gives_the_llama3_frequencies():
    """llama.cpp's converter writes Llama 3's scaling as per-pair divisors (rope_freqs):
    they give transformers' frequencies to float32 rounding."""
    from tests.model.test_families import _llama3_rope_factors

    hf = _hf(*SCHEMES["llama3"])
    expected, _ = config_from_json(hf.to_dict()).rope()
    factors = _llama3_rope_factors(hf)
    scaling = rope_from_gguf(lambda name, d=None: d, {"rope_freqs": factors}, max_positions=256)
    base = 1.0 / (500000.0 ** (torch.arange(0, 64, 2).float() / 64))
    assert scaling.kind == "factors"
    from kvserve.model.families.rope import rope_frequencies

    inverse, factor = rope_frequencies(500000.0, 64, scaling, 256)
    assert torch.allclose(inverse, expected, rtol=2e-6, atol=0)
    assert not torch.allclose(inverse, base)  # the factors did scale it
    assert factor == 1.0


@pytest.mark.parametrize(
    "options, message",
    [
        ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "dynamic"),
        ({"partial_rotary_factor": 0.5}, "partial"),
        ({"hidden_act": "gelu"}, "gelu"),
    ],
)
def test_variants_without_an_implementation_are_refused_by_name(options, message):
    raw = _hf("LlamaConfig", {}, 256).to_dict() | options
    if "partial_rotary_factor" in options:
        raw["rope_parameters"] = raw["rope_parameters"] | {"partial_rotary_factor": 0.5}
    with pytest.raises(UnsupportedModelError, match=message):
        config_from_json(raw)


def test_a_mistral_window_is_a_window_not_the_context_length():
    """A 16-position window with 512 positions serves 512 positions, every layer attending to
    its last 16 (it used to be served as a 16-position model)."""
    config = config_from_json(_hf("MistralConfig", {"sliding_window": 16}, 512).to_dict())
    assert config.max_position_embeddings == 512
    assert config.sliding_window == 16 and config.layer_windows == (16, 16)
    assert config.all_layers_windowed
    # what a scheduler may drop: positions before the window of the next row
    assert config.first_attended_position(40) == 25
    assert config.first_attended_position(10) == 0
    assert config.kv_window == 16  # the KV manager gives back the blocks behind it
    full = config_from_json(_hf("MistralConfig", {"sliding_window": None}, 512).to_dict())
    assert not full.windowed and full.first_attended_position(400) == 0
    assert full.kv_window is None


def test_interleaved_windows_keep_every_position():
    """Gemma's global layers read the whole context: nothing can be dropped, though most
    layers attend to a window."""
    raw = _hf("Gemma3TextConfig", {"sliding_window": 16, "num_hidden_layers": 12}, 256).to_dict()
    raw["architectures"] = ["Gemma3ForCausalLM"]
    config = config_from_json(raw)
    assert config.sliding_layers == every_other(12, 6)
    assert config.layer_windows.count(None) == 2
    assert config.windowed and not config.all_layers_windowed
    assert config.first_attended_position(200) == 0 and config.kv_window is None
    assert [config.layer_uses_local_rope(i) for i in range(6)] == [True] * 5 + [False]


def test_gemma3_config_json_in_both_spellings_gives_one_config():
    """The Hub's config.json (rope_theta, rope_local_base_freq, rope_scaling for the global
    layers, sliding_window_pattern) and transformers 5's (nested rope_parameters, layer_types)
    describe the same model."""
    hf = _hf(
        "Gemma3TextConfig",
        {
            "sliding_window": 16,
            "num_hidden_layers": 6,
            "rope_scaling": {"rope_type": "linear", "factor": 8.0},
            "rope_local_base_freq": 10000.0,
            "rope_theta": 1000000.0,
        },
        256,
    )
    new = hf.to_dict() | {"architectures": ["Gemma3ForCausalLM"]}
    old = {k: v for k, v in new.items() if k not in ("rope_parameters", "layer_types")}
    old |= {
        "rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0},
        "sliding_window_pattern": 6,
    }
    a, b = config_from_json(new), config_from_json(old)
    assert a == b
    assert a.rope_scaling.kind == "linear" and a.local_rope_scaling is None
    assert a.local_rope_theta == 10000.0 and a.rope_theta == 1000000.0
    global_inverse, _ = a.rope()
    local_inverse, _ = a.rope(local=True)
    assert global_inverse[0] == pytest.approx(1 / 8) and local_inverse[0] == 1.0


def test_qwen_windows_start_at_max_window_layers():
    raw = _hf("Qwen2Config", {"num_hidden_layers": 4}, 256).to_dict()
    raw.pop("layer_types")
    raw |= {"use_sliding_window": True, "sliding_window": 32, "max_window_layers": 2}
    assert config_from_json(raw).layer_windows == (None, None, 32, 32)
    raw["use_sliding_window"] = False
    assert not config_from_json(raw).windowed


def test_gguf_window_patterns():
    assert gguf_window_pattern(None, 4) is None
    assert gguf_window_pattern(2, 4) == (True, False, True, False)
    assert gguf_window_pattern([True, True, False], 3) == (True, True, False)


def test_yarn_attention_factor_scales_cos_and_sin():
    hf = _hf(*SCHEMES["yarn"])
    config = config_from_json(hf.to_dict())
    _, factor = config.rope()
    assert factor == pytest.approx(0.1 * math.log(4.0) + 1.0)
    from kvserve.model.attention import LayerRopes

    tables = LayerRopes.build(config, torch.device("cpu")).rope
    assert tables.cos_half[0, 0] == pytest.approx(factor)  # position 0: cos 1 times the factor
