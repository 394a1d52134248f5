"""config.json -> ModelConfig through the checkpoint's family (kvserve/model/families/)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvserve.model.config import ModelConfig, UnsupportedModelError
from kvserve.model.families import Family, hf_family, supported_hf_classes
from kvserve.model.families.rope import RopeError, rope_from_json


def family_of(raw: Mapping[str, Any]) -> Family:
    names = list(raw.get("architectures") or [])
    family = hf_family(names)
    if family is None:
        shown = ", ".join(names) or raw.get("model_type", "unknown")
        raise UnsupportedModelError(
            f"model architecture {shown} is not supported "
            f"(supported: {', '.join(supported_hf_classes())})"
        )
    return family


def _rope(raw: Mapping[str, Any], family: Family, max_positions: int) -> dict[str, Any]:
    """RoPE theta and scaling from either the older (`rope_theta`, `rope_scaling`) or the newer
    (`rope_parameters`) spelling of config.json."""
    params = raw.get("rope_parameters") or {}
    theta = raw.get("rope_theta", params.get("rope_theta", family.default_rope_theta))
    scaling = raw.get("rope_scaling") or None
    if scaling is None and params.get("rope_type", params.get("type", "default")) != "default":
        scaling = params
    return {
        "rope_theta": float(theta),
        "rope_scaling": rope_from_json(
            scaling,
            max_positions=max_positions,
            original_max_positions=raw.get("original_max_position_embeddings"),
        ),
    }


def _partial_rotary(raw: Mapping[str, Any]) -> float:
    """The fraction of head_dim that RoPE rotates, wherever config.json spells it."""
    params = raw.get("rope_parameters") or {}
    found = [raw.get("partial_rotary_factor"), params.get("partial_rotary_factor")]
    found += [p.get("partial_rotary_factor") for p in params.values() if isinstance(p, dict)]
    return min((float(f) for f in found if f is not None), default=1.0)


def config_from_json(raw: Mapping[str, Any]) -> ModelConfig:
    """The ModelConfig of a Hugging Face config.json (as a dict). Raises UnsupportedModelError
    for an architecture or a variant (RoPE scaling, activation) this runtime lacks."""
    family = family_of(raw)
    if _partial_rotary(raw) != 1.0:
        raise UnsupportedModelError(
            "partial rotary embeddings (partial_rotary_factor < 1) are not supported"
        )
    hidden = int(raw["hidden_size"])
    num_heads = int(raw["num_attention_heads"])
    num_layers = int(raw["num_hidden_layers"])
    max_positions = int(raw.get("max_position_embeddings", 2048))
    try:
        fields: dict[str, Any] = {
            "architecture": family.architecture,
            "vocab_size": int(raw["vocab_size"]),
            "hidden_size": hidden,
            "intermediate_size": int(raw["intermediate_size"]),
            "num_layers": num_layers,
            "num_heads": num_heads,
            "num_kv_heads": int(raw.get("num_key_value_heads") or num_heads),
            "head_dim": int(raw.get("head_dim") or hidden // num_heads),
            "rms_norm_eps": float(raw.get("rms_norm_eps", 1e-6)),
            "max_position_embeddings": max_positions,
            "tie_word_embeddings": bool(raw.get("tie_word_embeddings", family.tie_word_embeddings)),
            "name": str(raw.get("_name_or_path", "")),
        }
        fields |= _rope(raw, family, max_positions)
        fields |= family.hf_fields(raw, num_layers)
    except RopeError as exc:
        raise UnsupportedModelError(str(exc)) from exc
    activation = raw.get("hidden_act")
    if fields.get("hidden_activation") is None and activation not in (None, "silu"):
        raise UnsupportedModelError(f"activation {activation!r} is not supported (silu)")
    fields = {k: v for k, v in fields.items() if v is not None}
    return ModelConfig(**fields)
