"""ModelConfig: the shape of a decoder model, read once from the checkpoint's metadata.

Every family (kvserve/model/families/) runs the same layer loop; what differs between them is
data here: the activation, the norms around attention and the MLP, the scales and soft caps,
which layers attend only to a sliding window of recent positions, and the RoPE of each layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.model.families.rope import RopeError, RopeScaling, rope_frequencies

__all__ = [
    "ACTIVATIONS",
    "SUPPORTED_ARCHITECTURES",
    "ModelConfig",
    "RopeScaling",
    "UnsupportedModelError",
    "require_tensor",
]

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma2", "gemma3", "phi3")
ACTIVATIONS = ("silu", "gelu_tanh")  # of the gated MLP: act(gate) * up


def require_tensor(get, name: str):
    """`get(name)` (a checkpoint's tensor by Hugging Face name), or ValueError when absent."""
    tensor = get(name)
    if tensor is None:
        raise ValueError(f"checkpoint is missing tensor {name!r}")
    return tensor


class UnsupportedModelError(ValueError):
    """The checkpoint is of an architecture (or variant) this runtime does not implement."""


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Hyper-parameters of one decoder model.

    The Llama layout (pre-norm attention and SiLU-gated MLP, RoPE) with, per family:
    `attention_bias` (q/k/v biases: qwen2), `qk_norm` (RMSNorm over each head of q and k: qwen3,
    gemma3), `hidden_activation` ("gelu_tanh": gemma), `sandwich_norms` (an RMSNorm on the
    attention and MLP outputs before they join the residual: gemma2/3), `scale_embeddings`
    (embeddings times sqrt(hidden) in the model dtype: gemma), `query_pre_attn_scalar`
    (attention scores scaled by its -1/2 power instead of head_dim's: gemma),
    `attn_logit_softcapping` / `final_logit_softcapping` (tanh(s / cap) * cap on the attention
    scores / the logits: gemma2), and sliding windows: with `sliding_window` W, a windowed layer
    attends, for a row at position p, only to positions p - W + 1 .. p; `sliding_layers` says
    which layers are windowed (None: all of them, as Mistral and Phi-3). Windowed layers use
    `local_rope_theta` / `local_rope_scaling` when given (gemma3), else the model's RoPE.
    """

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
    hidden_activation: str = "silu"
    sandwich_norms: bool = False
    scale_embeddings: bool = False
    query_pre_attn_scalar: float | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    sliding_window: int | None = None
    sliding_layers: tuple[bool, ...] | None = None
    local_rope_theta: float | None = None
    local_rope_scaling: RopeScaling | None = None

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
        if self.hidden_activation not in ACTIVATIONS:
            raise UnsupportedModelError(
                f"activation {self.hidden_activation!r} is not supported "
                f"(supported: {', '.join(ACTIVATIONS)})"
            )
        if self.sliding_window is not None and self.sliding_window < 1:
            raise UnsupportedModelError(f"sliding window {self.sliding_window} must be positive")
        if self.sliding_layers is not None and len(self.sliding_layers) != self.num_layers:
            raise UnsupportedModelError(
                f"{len(self.sliding_layers)} sliding-window flags for {self.num_layers} layers"
            )
        for cap in (self.attn_logit_softcapping, self.final_logit_softcapping):
            if cap is not None and not cap > 0:
                raise UnsupportedModelError(f"soft-capping value {cap} must be positive")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def attention_scale(self) -> float:
        """What q.k is multiplied by before the softmax."""
        scalar = self.query_pre_attn_scalar or self.head_dim
        return float(scalar) ** -0.5

    # -- sliding windows ------------------------------------------------------------------------

    def layer_window(self, layer: int) -> int | None:
        """The window of `layer` (positions a row attends to, itself included), None: all."""
        if self.sliding_window is None:
            return None
        if self.sliding_layers is not None and not self.sliding_layers[layer]:
            return None
        return self.sliding_window

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        return tuple(self.layer_window(i) for i in range(self.num_layers))

    @property
    def windowed(self) -> bool:
        """Whether any layer attends to a sliding window only."""
        return any(w is not None for w in self.layer_windows)

    @property
    def all_layers_windowed(self) -> bool:
        """Whether every layer attends to a sliding window only: a position more than
        `sliding_window - 1` behind a sequence's next position is then never read again."""
        return self.num_layers > 0 and all(w is not None for w in self.layer_windows)

    @property
    def kv_window(self) -> int | None:
        """The window behind which a sequence's KV blocks may go back to the pool: the sliding
        window where every layer is windowed (`first_attended_position`), else None (a global
        layer reads every position; Gemma 2/3 keep all their blocks)."""
        return self.sliding_window if self.all_layers_windowed else None

    def first_attended_position(self, position: int) -> int:
        """The first position some layer reads for a row at `position`: position - W + 1 where
        every layer is windowed, else 0. A sequence whose next row is at `position` never reads
        a KV block that ends before it (the scheduler may free such blocks)."""
        if not self.all_layers_windowed:
            return 0
        return max(0, position - self.sliding_window + 1)

    # -- RoPE -----------------------------------------------------------------------------------

    def layer_uses_local_rope(self, layer: int) -> bool:
        """Whether `layer` rotates with the local RoPE (windowed layers of gemma3)."""
        return self.local_rope_theta is not None and self.layer_window(layer) is not None

    def rope(self, local: bool = False) -> tuple[torch.Tensor, float]:
        """(inverse frequencies [head_dim / 2] float32, factor on cos and sin) of the model's
        RoPE, or of its windowed layers' with `local`. Raises UnsupportedModelError for a
        scheme (or its parameters) this runtime does not implement."""
        theta, scaling = self.rope_theta, self.rope_scaling
        if local and self.local_rope_theta is not None:
            theta, scaling = self.local_rope_theta, self.local_rope_scaling
        try:
            return rope_frequencies(theta, self.head_dim, scaling, self.max_position_embeddings)
        except RopeError as exc:
            raise UnsupportedModelError(str(exc)) from exc

    def inverse_frequencies(self) -> list[float]:
        """RoPE inverse frequencies for the half-rotation form, with scaling applied."""
        return self.rope()[0].tolist()

    # -- sizes ----------------------------------------------------------------------------------

    def num_parameters(self) -> int:
        h, i = self.hidden_size, self.intermediate_size
        per_layer = h * (self.q_size + 2 * self.kv_size) + self.q_size * h + 3 * h * i + 2 * h
        if self.attention_bias:
            per_layer += self.q_size + 2 * self.kv_size
        if self.qk_norm:
            per_layer += 2 * self.head_dim
        if self.sandwich_norms:
            per_layer += 2 * h
        embed = self.vocab_size * h
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return embed + head + h + self.num_layers * per_layer

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """Bytes of K and V over all layers for one position."""
        return 2 * self.num_layers * self.kv_size * dtype_bytes
