"""Model families: what differs between Llama, Mistral, Qwen, Gemma and Phi-3, as data.

Every family runs the one layer loop of kvserve/model/llama.py. A family is a `Family` record
(this module) and, for what its configuration files spell their own way, two small functions in
its module (llama.py, gemma.py, phi3.py here) that turn a config.json or a GGUF header into the
fields of kvserve.model.config.ModelConfig (activation, norms, scales, soft caps, sliding
windows, RoPE). The loaders (kvserve/model/safetensors.py, kvserve/model/gguf.py) read a
checkpoint through its family:

- `qkv` / `gate_up`: the tensors fused into the q|k|v and gate|up products (Phi-3 stores them
  fused already), by Hugging Face name without ".weight";
- `mlp_norm`, `post_attention_norm`, `post_mlp_norm`: which norm tensors a layer has where
  (Gemma's "post_attention_layernorm" is the norm on the attention output, Llama's the norm
  before the MLP);
- `hf_norm_offset`: added to every norm weight of a Hugging Face checkpoint, so that a norm is
  always `rmsnorm(x) * weight` (Gemma stores w for 1 + w; its GGUF files store 1 + w, as
  llama.cpp's converter writes them);
- `gguf_layer_names`: the family's GGUF tensor names where they differ from Llama's;
- `gguf_permuted_rope`: llama.cpp's converter permutes the q/k rows of `llama` files only.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

LLAMA_QKV = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
LLAMA_GATE_UP = ("mlp.gate_proj", "mlp.up_proj")

# GGUF layer tensor names (llama.cpp's) -> Hugging Face names, for the Llama layout.
GGUF_LAYER_NAMES = {
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
# Tensors beside the layers: the RoPE factors of Llama 3 (rope_freqs) and Phi-3 (long/short).
GGUF_ROPE_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")

# (config.json as a dict, number of layers) -> ModelConfig fields of the family
HFFields = Callable[[Mapping[str, Any], int], dict[str, Any]]
# (key(name, default) reading "{arch}.name", number of layers) -> ModelConfig fields
GGUFFields = Callable[[Callable[..., Any], int], dict[str, Any]]


def _no_fields(*_: Any) -> dict[str, Any]:
    return {}


@dataclass(frozen=True, slots=True)
class Family:
    """One family's checkpoints: names, fused tensors, norm conventions, config readers."""

    architecture: str  # ModelConfig.architecture
    hf_classes: tuple[str, ...]  # the config.json "architectures" it reads
    gguf_architecture: str | None = None  # general.architecture of its GGUF files
    qkv: tuple[str, ...] = LLAMA_QKV
    gate_up: tuple[str, ...] = LLAMA_GATE_UP
    mlp_norm: str = "post_attention_layernorm"
    post_attention_norm: str | None = None
    post_mlp_norm: str | None = None
    hf_norm_offset: float = 0.0
    gguf_layer_names: Mapping[str, str] = field(default_factory=dict)
    gguf_permuted_rope: bool = False
    tie_word_embeddings: bool = False  # when config.json does not say
    default_rope_theta: float = 10000.0
    hf_fields: HFFields = _no_fields
    gguf_fields: GGUFFields = _no_fields

    def gguf_name(self, name: str) -> str | None:
        """A GGUF layer tensor name (after `blk.N.`) as its Hugging Face name, None if unknown."""
        return self.gguf_layer_names.get(name, GGUF_LAYER_NAMES.get(name))

    def layer_tensors(self) -> tuple[str, ...]:
        """The linear weights of a layer (Hugging Face names without ".weight")."""
        return (*self.qkv, "self_attn.o_proj", *self.gate_up, "mlp.down_proj")

    def projections(self) -> dict[str, tuple[str, ...]]:
        """The tensors of each of the four products of a layer."""
        return {
            "qkv": self.qkv,
            "o": ("self_attn.o_proj",),
            "gate_up": self.gate_up,
            "down": ("mlp.down_proj",),
        }


def _registry() -> tuple[Family, ...]:
    from kvserve.model.families import gemma, llama, phi3

    return (*llama.FAMILIES, *gemma.FAMILIES, *phi3.FAMILIES)


def hf_family(class_names: list[str]) -> Family | None:
    """The family of a config.json's `architectures`, None when none is supported."""
    for name in class_names:
        for family in FAMILIES:
            if name in family.hf_classes:
                return family
    return None


def gguf_family(architecture: str | None) -> Family | None:
    for family in FAMILIES:
        if family.gguf_architecture is not None and family.gguf_architecture == architecture:
            return family
    return None


def family_for(architecture: str) -> Family:
    """The (first) family of a ModelConfig.architecture: its tensor names and conventions."""
    for family in FAMILIES:
        if family.architecture == architecture:
            return family
    raise KeyError(f"no family for architecture {architecture!r}")


def supported_hf_classes() -> list[str]:
    return sorted(name for family in FAMILIES for name in family.hf_classes)


def supported_gguf_architectures() -> list[str]:
    return sorted({f.gguf_architecture for f in FAMILIES if f.gguf_architecture})


def every_other(num_layers: int, period: int) -> tuple[bool, ...]:
    """Windowed layers of a repeating pattern: all but every `period`-th layer (gemma2: 2,
    gemma3: 6; llama.cpp's `set_swa_pattern`)."""
    return tuple((i + 1) % period != 0 for i in range(num_layers))


def windows_from_layer_types(layer_types) -> tuple[bool, ...] | None:
    """A config.json's `layer_types` as windowed-layer flags, None when absent."""
    if not layer_types:
        return None
    return tuple(kind == "sliding_attention" for kind in layer_types)


def gguf_window_pattern(value, num_layers: int) -> tuple[bool, ...] | None:
    """`{arch}.attention.sliding_window_pattern`: a period (llama.cpp's set_swa_pattern) or one
    flag per layer; None when absent."""
    if value is None:
        return None
    if isinstance(value, (list, tuple)):
        return tuple(bool(v) for v in value)
    return every_other(num_layers, int(value))


FAMILIES: tuple[Family, ...] = _registry()
