"""Phi-3 (mini, medium; 4k and 128k): the Llama layout with fused projections.

Its checkpoints store q|k|v as one `qkv_proj` and gate|up as one `gate_up_proj` (GGUF:
`attn_qkv`, and `ffn_up` holding both halves), which are the products' own layouts. The 128k
models use longrope (kvserve/model/families/rope.py): config.json's `rope_scaling` with
`short_factor` / `long_factor`, GGUF's `rope_factors_short` / `rope_factors_long` tensors and
`rope.scaling.attn_factor`. A `sliding_window` applies to every layer (0 in GGUF: none).
"""

from __future__ import annotations

from kvserve.model.families import Family
from kvserve.model.families.rope import rope_from_json


def _phi3(raw, num_layers: int) -> dict:
    max_positions = int(raw.get("max_position_embeddings", 4096))
    scaling = raw.get("rope_scaling") or raw.get("rope_parameters")
    fields = {
        "rope_scaling": rope_from_json(
            scaling,
            max_positions=max_positions,
            original_max_positions=raw.get("original_max_position_embeddings"),
        ),
        "sliding_window": raw.get("sliding_window"),
    }
    return fields


def _gguf_phi3(key, num_layers: int) -> dict:
    window = int(key("attention.sliding_window", 0) or 0)
    return {"sliding_window": window} if window > 0 else {}


FAMILIES = (
    Family(
        "phi3",
        ("Phi3ForCausalLM",),
        "phi3",
        qkv=("self_attn.qkv_proj",),
        gate_up=("mlp.gate_up_proj",),
        gguf_layer_names={
            "attn_qkv.weight": "self_attn.qkv_proj.weight",
            "ffn_up.weight": "mlp.gate_up_proj.weight",
        },
        hf_fields=_phi3,
        gguf_fields=_gguf_phi3,
    ),
)
