"""Hugging Face model directories: config.json + *.safetensors (sharded or not)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from kvserve.model.config import ModelConfig, RopeScaling, UnsupportedModelError

_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


def _rope_parameters(raw: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """RoPE theta and scaling from either the older (`rope_theta`, `rope_scaling`) or the newer
    (`rope_parameters`) spelling of config.json."""
    params = raw.get("rope_parameters") or {}
    theta = raw.get("rope_theta", params.get("rope_theta", 10000.0))
    scaling = raw.get("rope_scaling") or None
    if scaling is None and params.get("rope_type", "default") != "default":
        scaling = params
    return float(theta), scaling


def config_from_json(raw: dict[str, Any]) -> ModelConfig:
    names = raw.get("architectures") or []
    arch = next((_ARCHITECTURES[n] for n in names if n in _ARCHITECTURES), None)
    if arch is None:
        shown = ", ".join(names) or raw.get("model_type", "unknown")
        raise UnsupportedModelError(
            f"model architecture {shown} is not supported "
            f"(supported: {', '.join(sorted(_ARCHITECTURES))})"
        )
    hidden = int(raw["hidden_size"])
    num_heads = int(raw["num_attention_heads"])
    max_positions = int(raw.get("max_position_embeddings", 2048))
    window = raw.get("sliding_window")
    if (
        window is not None
        and raw.get("use_sliding_window", arch == "llama")
        and window < max_positions
    ):
        # Full attention equals sliding-window attention while the context fits the window.
        max_positions = int(window)
    theta, scaling_raw = _rope_parameters(raw)
    scaling = None
    if scaling_raw:
        kind = scaling_raw.get("rope_type", scaling_raw.get("type"))
        if kind == "llama3":
            scaling = RopeScaling(
                "llama3",
                float(scaling_raw["factor"]),
                float(scaling_raw.get("low_freq_factor", 1.0)),
                float(scaling_raw.get("high_freq_factor", 4.0)),
                int(scaling_raw.get("original_max_position_embeddings", 8192)),
            )
        elif kind == "linear":
            scaling = RopeScaling("linear", float(scaling_raw["factor"]))
        elif kind not in (None, "default"):
            raise UnsupportedModelError(f"RoPE scaling {kind!r} is not supported")
    return ModelConfig(
        architecture=arch,
        vocab_size=int(raw["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(raw["intermediate_size"]),
        num_layers=int(raw["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
        head_dim=int(raw.get("head_dim") or hidden // num_heads),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        max_position_embeddings=max_positions,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        attention_bias=arch == "qwen2" or bool(raw.get("attention_bias", False)),
        qk_norm=arch == "qwen3",
        rope_scaling=scaling,
        name=str(raw.get("_name_or_path", "")),
    )


class SafetensorsCheckpoint:
    """A Hugging Face directory: its config and a name -> tensor source over all shards."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.config = config_from_json(json.loads((path / "config.json").read_text()))
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"{path} has no *.safetensors files")
        self._handles = [safe_open(str(f), framework="pt") for f in files]
        self._where: dict[str, Any] = {}
        for handle in self._handles:
            for key in handle.keys():  # noqa: SIM118 (safe_open handles are not iterable)
                self._where[key] = handle
        self.quantization = sorted({str(self._dtype_of(k)) for k in list(self._where)[:8]})

    def _dtype_of(self, name: str) -> torch.dtype:
        return self._where[name].get_slice(name).get_dtype()

    def get(self, name: str) -> torch.Tensor | None:
        handle = self._where.get(name)
        if handle is None:
            return None
        return handle.get_tensor(name)
