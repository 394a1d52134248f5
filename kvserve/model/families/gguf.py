"""GGUF metadata -> ModelConfig through the file's family (kvserve/model/families/)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvserve.model.config import ModelConfig, UnsupportedModelError
from kvserve.model.families import Family, gguf_family, supported_gguf_architectures
from kvserve.model.families.rope import RopeError, rope_from_gguf


def family_of(architecture: str | None) -> Family:
    family = gguf_family(architecture)
    if family is None:
        raise UnsupportedModelError(
            f"GGUF architecture {architecture!r} is not supported "
            f"(supported: {', '.join(supported_gguf_architectures())})"
        )
    return family


def config_from_gguf(
    value,
    tensor_names: set[str],
    rope_tensors: Mapping[str, tuple[float, ...]],
) -> ModelConfig:
    """The ModelConfig of a GGUF header. `value(key, default)` reads one metadata key;
    `tensor_names` are the file's tensor names; `rope_tensors` the values of its RoPE factor
    tensors by name without ".weight" (rope_freqs, rope_factors_long, rope_factors_short)."""
    arch = value("general.architecture")
    family = family_of(arch)

    def key(name: str, default: Any = None) -> Any:
        return value(f"{arch}.{name}", default)

    hidden = int(key("embedding_length"))
    num_heads = int(key("attention.head_count"))
    num_layers = int(key("block_count"))
    head_dim = int(key("attention.key_length", hidden // num_heads))
    max_positions = int(key("context_length", 2048))
    vocab = key("vocab_size")
    if vocab is None:
        vocab = len(value("tokenizer.ggml.tokens", []))
    try:
        fields: dict[str, Any] = {
            "architecture": family.architecture,
            "vocab_size": int(vocab),
            "hidden_size": hidden,
            "intermediate_size": int(key("feed_forward_length")),
            "num_layers": num_layers,
            "num_heads": num_heads,
            "num_kv_heads": int(key("attention.head_count_kv", num_heads)),
            "head_dim": head_dim,
            "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon", 1e-6)),
            "rope_theta": float(key("rope.freq_base", family.default_rope_theta)),
            "max_position_embeddings": max_positions,
            "tie_word_embeddings": "output.weight" not in tensor_names,
            "rope_scaling": rope_from_gguf(key, rope_tensors, max_positions=max_positions),
            "name": str(value("general.name", "") or ""),
        }
        dimensions = key("rope.dimension_count")
        if dimensions is not None and int(dimensions) != head_dim:
            raise UnsupportedModelError(
                f"partial rotary embeddings ({dimensions} of {head_dim} dimensions) are not "
                "supported"
            )
        fields |= family.gguf_fields(key, num_layers)
    except RopeError as exc:
        raise UnsupportedModelError(str(exc)) from exc
    fields = {k: v for k, v in fields.items() if v is not None}
    return ModelConfig(**fields)
