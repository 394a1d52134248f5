"""Gemma 2 and Gemma 3 (text).

A Gemma layer is Llama's with: embeddings times sqrt(hidden) (in the model dtype, as
transformers rounds it), GeGLU (gelu-tanh) instead of SwiGLU, an RMSNorm on the attention
output and one on the MLP output before each joins the residual ("sandwich" norms), norms that
compute rmsnorm(x) * (1 + w) (the Hugging Face files store w; GGUF files 1 + w), attention
scores scaled by query_pre_attn_scalar^-1/2, and sliding-window layers interleaved with global
ones (every other layer for Gemma 2; five of every six for Gemma 3). Gemma 2 soft-caps the
attention scores and the logits (tanh(s / cap) * cap); Gemma 3 instead has per-head q/k norms
and its own RoPE base (and no scaling) for the windowed layers.

GGUF files carry no query_pre_attn_scalar: llama.cpp uses hidden / heads for the 27B models
(46 layers for Gemma 2, 62 for Gemma 3) and head_dim otherwise, and so does this reader.
"""

from __future__ import annotations

from kvserve.model.families import (
    Family,
    every_other,
    gguf_window_pattern,
    windows_from_layer_types,
)
from kvserve.model.families.rope import rope_from_json

GEMMA_GGUF_NAMES = {
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
_ACTIVATIONS = {"gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}


def _common(raw, num_layers: int, period: int) -> dict:
    activation = raw.get("hidden_activation") or raw.get("hidden_act") or "gelu_pytorch_tanh"
    window = raw.get("sliding_window", 4096)  # transformers' default
    layers = windows_from_layer_types(raw.get("layer_types"))
    if layers is None:
        layers = every_other(num_layers, int(raw.get("sliding_window_pattern", period)))
    fields = {
        "hidden_activation": _ACTIVATIONS.get(activation, activation),
        "sandwich_norms": True,
        "scale_embeddings": True,
        "query_pre_attn_scalar": float(raw.get("query_pre_attn_scalar", 256)),
        "attn_logit_softcapping": raw.get("attn_logit_softcapping"),
        "final_logit_softcapping": raw.get("final_logit_softcapping"),
    }
    if window is not None and any(layers):
        fields |= {"sliding_window": int(window), "sliding_layers": layers}
    return fields


def _gemma2(raw, num_layers: int) -> dict:
    # transformers' defaults where config.json says nothing (an explicit null turns them off)
    return _common(raw, num_layers, 2) | {
        "attn_logit_softcapping": raw.get("attn_logit_softcapping", 50.0),
        "final_logit_softcapping": raw.get("final_logit_softcapping", 30.0),
    }


def _gemma3(raw, num_layers: int) -> dict:
    fields = _common(raw, num_layers, 6) | {"qk_norm": True}
    max_positions = int(raw.get("max_position_embeddings", 131072))
    params = raw.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:  # transformers >= 5
        full = params.get("full_attention") or {}
        local = params.get("sliding_attention") or {}
        fields["rope_theta"] = float(full.get("rope_theta", raw.get("rope_theta", 1e6)))
        fields["rope_scaling"] = rope_from_json(full, max_positions=max_positions)
        fields["local_rope_theta"] = float(local.get("rope_theta", 10000.0))
        fields["local_rope_scaling"] = rope_from_json(local, max_positions=max_positions)
    else:  # rope_theta, rope_scaling (global layers) and rope_local_base_freq
        fields["rope_theta"] = float(raw.get("rope_theta", 1e6))
        fields["rope_scaling"] = rope_from_json(
            raw.get("rope_scaling"), max_positions=max_positions
        )
        fields["local_rope_theta"] = float(raw.get("rope_local_base_freq", 10000.0))
    return fields


def _gguf(key, num_layers: int, period: int, large_layers: int) -> dict:
    hidden = int(key("embedding_length"))
    heads = int(key("attention.head_count"))
    head_dim = int(key("attention.key_length", hidden // heads))
    window = int(key("attention.sliding_window", 0) or 0)
    layers = gguf_window_pattern(key("attention.sliding_window_pattern"), num_layers)
    fields = {
        "hidden_activation": "gelu_tanh",
        "sandwich_norms": True,
        "scale_embeddings": True,
        "query_pre_attn_scalar": float(hidden // heads if num_layers == large_layers else head_dim),
        "attn_logit_softcapping": key("attn_logit_softcapping"),
        "final_logit_softcapping": key("final_logit_softcapping"),
    }
    layers = layers if layers is not None else every_other(num_layers, period)
    if window > 0 and any(layers):
        fields |= {"sliding_window": window, "sliding_layers": layers}
    return fields


def _gguf_gemma3(key, num_layers: int) -> dict:
    # llama.cpp: the windowed layers rotate with base 10000, unscaled
    fields = _gguf(key, num_layers, 6, 62) | {"qk_norm": True}
    return fields | {"local_rope_theta": float(key("rope.freq_base_swa", 10000.0))}


FAMILIES = (
    Family(
        "gemma2",
        ("Gemma2ForCausalLM",),
        "gemma2",
        mlp_norm="pre_feedforward_layernorm",
        post_attention_norm="post_attention_layernorm",
        post_mlp_norm="post_feedforward_layernorm",
        hf_norm_offset=1.0,
        gguf_layer_names=GEMMA_GGUF_NAMES,
        tie_word_embeddings=True,
        hf_fields=_gemma2,
        gguf_fields=lambda key, n: _gguf(key, n, 2, 46),
    ),
    Family(
        "gemma3",
        ("Gemma3ForCausalLM",),
        "gemma3",
        mlp_norm="pre_feedforward_layernorm",
        post_attention_norm="post_attention_layernorm",
        post_mlp_norm="post_feedforward_layernorm",
        hf_norm_offset=1.0,
        gguf_layer_names=GEMMA_GGUF_NAMES,
        tie_word_embeddings=True,
        default_rope_theta=1e6,
        hf_fields=_gemma3,
        gguf_fields=_gguf_gemma3,
    ),
)
