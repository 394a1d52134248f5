"""ModelConfig: the shape of a Llama-family model, read once from the checkpoint's metadata."""

from __future__ import annotations

import math
from dataclasses import dataclass

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3")


def require_tensor(get, name: str):
    """`get(name)` (a checkpoint's tensor by Hugging Face name), or ValueError when absent."""
    tensor = get(name)
    if tensor is None:
        raise ValueError(f"checkpoint is missing tensor {name!r}")
    return tensor


class UnsupportedModelError(ValueError):
    """The checkpoint is of an architecture (or variant) this runtime does not implement."""


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """Llama-3 style frequency scaling ("llama3") or plain position interpolation ("linear")."""

    kind: str  # "llama3" | "linear"
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Hyper-parameters of one Llama-family model. `llama`, `qwen2` and `qwen3` differ only in the
    flags `attention_bias` (q/k/v biases) and `qk_norm` (RMSNorm over each head of q and k)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False
    qk_norm: bool = False
    rope_scaling: RopeScaling | None = None
    name: str = ""

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"architecture {self.architecture!r} is not supported "
                f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
            )
        if self.num_heads % self.num_kv_heads != 0:
            raise UnsupportedModelError(
                f"{self.num_heads} attention heads are not a multiple of {self.num_kv_heads} KV heads"
            )
        if self.head_dim % 2 != 0:
            raise UnsupportedModelError(f"head_dim {self.head_dim} must be even for RoPE")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def num_parameters(self) -> int:
        h, i = self.hidden_size, self.intermediate_size
        per_layer = h * (self.q_size + 2 * self.kv_size) + self.q_size * h + 3 * h * i + 2 * h
        if self.attention_bias:
            per_layer += self.q_size + 2 * self.kv_size
        if self.qk_norm:
            per_layer += 2 * self.head_dim
        embed = self.vocab_size * h
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return embed + head + h + self.num_layers * per_layer

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """Bytes of K and V over all layers for one position."""
        return 2 * self.num_layers * self.kv_size * dtype_bytes

    def inverse_frequencies(self) -> list[float]:
        """RoPE inverse frequencies for the half-rotation form, with scaling applied."""
        dim = self.head_dim
        inv = [1.0 / (self.rope_theta ** (2 * i / dim)) for i in range(dim // 2)]
        scaling = self.rope_scaling
        if scaling is None:
            return inv
        if scaling.kind == "linear":
            return [f / scaling.factor for f in inv]
        # llama3: long wavelengths are divided by `factor`, short ones kept, smooth in between.
        old = scaling.original_max_position_embeddings
        low_wavelen = old / scaling.low_freq_factor
        high_wavelen = old / scaling.high_freq_factor
        out = []
        for f in inv:
            wavelen = 2 * math.pi / f
            if wavelen < high_wavelen:
                out.append(f)
            elif wavelen > low_wavelen:
                out.append(f / scaling.factor)
            else:
                smooth = (old / wavelen - scaling.low_freq_factor) / (
                    scaling.high_freq_factor - scaling.low_freq_factor
                )
                out.append((1 - smooth) * f / scaling.factor + smooth * f)
        return out
