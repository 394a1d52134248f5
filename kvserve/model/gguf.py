"""GGUF checkpoints through ggml-org's `gguf` reader: metadata to ModelConfig, tensors dequantized.

GGUF names tensors llama.cpp's way (`blk.3.attn_q.weight`); they are handed to the model under
Hugging Face names. For the `llama` architecture llama.cpp's converter permutes the rows of q and
k so that RoPE rotates interleaved pairs; we undo that permutation at load and use the
half-rotation RoPE everywhere (qwen2/qwen3 files are stored unpermuted).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, ReaderTensor
from gguf.quants import dequantize

from kvserve.model.config import (
    SUPPORTED_ARCHITECTURES,
    ModelConfig,
    RopeScaling,
    UnsupportedModelError,
)

_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK = re.compile(r"blk\.(\d+)\.(.+)")


def field_value(fields: Any, key: str, default: Any = None) -> Any:
    """A scalar, string or array metadata value, or `default` when absent."""
    field = fields.get(key)
    if field is None:
        return default
    return field.contents()


def hf_name(gguf_name: str) -> str | None:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`; None for unknown."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _BLOCK.fullmatch(gguf_name)
    if match and match.group(2) in _LAYER_NAMES:
        return f"model.layers.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}"
    return None


def config_from_fields(fields: Any, tensor_names: set[str]) -> ModelConfig:
    arch = field_value(fields, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"GGUF architecture {arch!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )

    def key(name: str, default: Any = None) -> Any:
        return field_value(fields, f"{arch}.{name}", default)

    hidden = int(key("embedding_length"))
    num_heads = int(key("attention.head_count"))
    num_kv_heads = int(key("attention.head_count_kv", num_heads))
    head_dim = int(key("attention.key_length", hidden // num_heads))
    vocab = key("vocab_size")
    if vocab is None:
        vocab = len(fields["tokenizer.ggml.tokens"].data)
    scaling = None
    scaling_type = key("rope.scaling.type")
    if scaling_type == "linear":
        scaling = RopeScaling("linear", float(key("rope.scaling.factor", 1.0)))
    elif scaling_type not in (None, "none"):
        raise UnsupportedModelError(f"RoPE scaling {scaling_type!r} is not supported")
    return ModelConfig(
        architecture=arch,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length")),
        num_layers=int(key("block_count")),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        max_position_embeddings=int(key("context_length", 2048)),
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias=arch == "qwen2",
        qk_norm=arch == "qwen3",
        rope_scaling=scaling,
        name=str(field_value(fields, "general.name", "") or ""),
    )


def unpermute_rope_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k permutation: per head, rows [r0, r_half, r1, r_half+1, ...]
    (interleaved pairs) back to [first half | second half] (Hugging Face layout)."""
    rest = weight.shape[1:]
    head_dim = weight.shape[0] // num_heads
    return (
        weight.reshape(num_heads, head_dim // 2, 2, *rest)
        .transpose(1, 2)
        .reshape(weight.shape)
        .contiguous()
    )


def dequantize_tensor(tensor: ReaderTensor) -> torch.Tensor:
    """A GGUF tensor as float32 (or its native float type for F16/BF16), shape [rows, cols]."""
    qtype = tensor.tensor_type
    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    # F32/F16 data are read-only views of the mapped file: copy them (they are small: norms).
    if qtype == GGMLQuantizationType.F32:
        array = np.array(tensor.data, dtype=np.float32)
    elif qtype == GGMLQuantizationType.F16:
        array = np.array(tensor.data).view(np.float16)
    elif qtype == GGMLQuantizationType.BF16:
        raw = np.asarray(tensor.data).view(np.int16)
        return torch.from_numpy(raw.copy()).view(torch.bfloat16).reshape(shape)
    else:
        array = dequantize(tensor.data, qtype)
    return torch.from_numpy(np.ascontiguousarray(array)).reshape(shape)


class GGUFCheckpoint:
    """An opened GGUF file: its metadata, config and a name -> tensor source for the model."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.reader = GGUFReader(path)
        self.fields = self.reader.fields
        self.tensors: dict[str, ReaderTensor] = {}
        for tensor in self.reader.tensors:
            name = hf_name(tensor.name)
            if name is not None:
                self.tensors[name] = tensor
        self.config = config_from_fields(self.fields, {t.name for t in self.reader.tensors})
        self.rope_freqs = next(
            (t for t in self.reader.tensors if t.name == "rope_freqs.weight"), None
        )
        if self.rope_freqs is not None:
            raise UnsupportedModelError(
                "GGUF files with a rope_freqs tensor (Llama 3.1 long-context scaling) are not "
                "supported yet; use the Hugging Face directory of the model instead"
            )
        self.quantization = sorted({t.tensor_type.name for t in self.reader.tensors})

    def get(self, name: str) -> torch.Tensor | None:
        tensor = self.tensors.get(name)
        if tensor is None:
            return None
        weight = dequantize_tensor(tensor)
        if self.config.architecture == "llama":
            if name.endswith(("self_attn.q_proj.weight", "self_attn.q_proj.bias")):
                weight = unpermute_rope_rows(weight, self.config.num_heads)
            elif name.endswith(("self_attn.k_proj.weight", "self_attn.k_proj.bias")):
                weight = unpermute_rope_rows(weight, self.config.num_kv_heads)
        return weight
