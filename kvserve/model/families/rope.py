"""RoPE variants: the inverse frequencies (and the factor on cos/sin) of each scaling scheme.

Every function mirrors transformers' `modeling_rope_utils` operation for operation, in float32
torch ops, so the tables a checkpoint gets here are the ones transformers builds for it:

- default: theta^(-2i/d);
- `linear` (position interpolation): default / factor;
- `llama3` (Llama 3.1-3.3): long wavelengths divided by `factor`, short ones kept, a smooth ramp
  between `original / low_freq_factor` and `original / high_freq_factor`;
- `yarn` (Qwen's long context, DeepSeek): interpolation and extrapolation blended per dimension
  by a ramp between the dimensions that turn `beta_fast` and `beta_slow` times over the original
  context, cos/sin times an attention factor (0.1 ln(factor) + 1 unless given);
- `longrope` (Phi-3 "su"): default divided per dimension by `short_factor` or `long_factor`,
  cos/sin times sqrt(1 + ln(factor) / ln(original)). transformers picks the set per forward
  call from the longest position in it, which changes the rotation of positions already cached;
  here the set is fixed at load from the context the model serves, as llama.cpp does: `long`
  when it exceeds the original context, else `short`;
- `factors` (a GGUF `rope_freqs` / `rope_factors_*` tensor, llama.cpp's form of the above):
  default divided by the file's per-dimension factors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

ROPE_KINDS = ("linear", "llama3", "yarn", "longrope", "factors")


class RopeError(ValueError):
    """A RoPE configuration this runtime does not implement (kvserve refuses the model)."""


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """One RoPE scaling scheme and its parameters (unused fields keep their defaults)."""

    kind: str  # one of ROPE_KINDS
    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    original_max_position_embeddings: int = 8192  # llama3, yarn, longrope
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    attention_factor: float | None = None  # yarn, longrope: None derives it from `factor`
    mscale: float | None = None  # yarn (DeepSeek's form of the attention factor)
    mscale_all_dim: float | None = None
    truncate: bool = True  # yarn: round the ramp's ends to whole dimensions
    short_factor: tuple[float, ...] | None = None  # longrope, per dimension pair
    long_factor: tuple[float, ...] | None = None
    freq_factors: tuple[float, ...] | None = None  # factors: per dimension pair

    def __post_init__(self) -> None:
        if self.kind not in ROPE_KINDS:
            raise RopeError(f"RoPE scaling {self.kind!r} is not supported")


def default_frequencies(theta: float, dim: int) -> torch.Tensor:
    """theta^(-2i/dim) for i < dim / 2, float32 (transformers' default RoPE)."""
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim
    return 1.0 / (theta**exponents)


def rope_frequencies(
    theta: float, dim: int, scaling: RopeScaling | None, max_positions: int
) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [dim / 2] float32, the factor on cos and sin) of one RoPE.
    `max_positions` is the context the model serves (config.max_position_embeddings)."""
    if scaling is None:
        return default_frequencies(theta, dim), 1.0
    kind = scaling.kind
    if kind == "linear":
        return default_frequencies(theta, dim) / scaling.factor, 1.0
    if kind == "llama3":
        return _llama3(theta, dim, scaling), 1.0
    if kind == "yarn":
        return _yarn(theta, dim, scaling)
    if kind == "longrope":
        return _longrope(theta, dim, scaling, max_positions)
    factors = _pairs(scaling.freq_factors, dim, "rope frequency factors")
    return default_frequencies(theta, dim) / factors, _given(scaling.attention_factor)


def _given(value: float | None) -> float:
    return 1.0 if value is None else float(value)


def _pairs(values, dim: int, what: str) -> torch.Tensor:
    if values is None or len(values) != dim // 2:
        count = "none" if values is None else len(values)
        raise RopeError(f"{what}: {count} values for head_dim {dim} (needs {dim // 2})")
    return torch.tensor(values, dtype=torch.float32)


def _llama3(theta: float, dim: int, s: RopeScaling) -> torch.Tensor:
    inv_freq = default_frequencies(theta, dim)
    old = s.original_max_position_embeddings
    low_freq_wavelen = old / s.low_freq_factor
    high_freq_wavelen = old / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (old / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


def _mscale(scale: float, mscale: float = 1.0) -> float:
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def _yarn(theta: float, dim: int, s: RopeScaling) -> tuple[torch.Tensor, float]:
    factor = s.factor
    original = s.original_max_position_embeddings
    attention = s.attention_factor
    if attention is None:
        if s.mscale and s.mscale_all_dim:
            attention = float(_mscale(factor, s.mscale) / _mscale(factor, s.mscale_all_dim))
        else:
            attention = _mscale(factor)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (factor * pos_freqs)
    extrapolation_factor = 1 - ramp
    inv_freq = interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor
    return inv_freq, float(attention)


def _longrope(
    theta: float, dim: int, s: RopeScaling, max_positions: int
) -> tuple[torch.Tensor, float]:
    original = s.original_max_position_embeddings
    factor = s.factor
    attention = s.attention_factor
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    chosen = s.long_factor if max_positions > original else s.short_factor
    extension = _pairs(chosen, dim, "longrope factors")
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return 1.0 / (extension * theta**exponents), float(attention)


# -- reading the schemes from checkpoints ------------------------------------------------------


def rope_from_json(
    params: dict | None, *, max_positions: int, original_max_positions: int | None = None
) -> RopeScaling | None:
    """The scaling of one `rope_scaling` / `rope_parameters` dict of a config.json (None for
    the default RoPE). `original_max_positions` is a top-level `original_max_position_embeddings`
    (Phi-3 keeps it there, and transformers lets it win)."""
    if not params:
        return None
    kind = params.get("rope_type", params.get("type")) or "default"
    if kind == "default":
        return None
    if kind in ("su", "yarn") and params.get("short_factor") is not None:
        kind = "longrope"  # Phi-3's older spellings of longrope
    if float(params.get("partial_rotary_factor", 1.0) or 1.0) != 1.0:
        raise RopeError("partial rotary embeddings (partial_rotary_factor < 1) are not supported")
    original = params.get("original_max_position_embeddings")
    if kind == "longrope" and original_max_positions is not None:
        original = original_max_positions
    if original is None:
        original = original_max_positions or max_positions
    original = int(original)
    if kind == "linear":
        return RopeScaling("linear", float(params["factor"]))
    if kind == "llama3":
        return RopeScaling(
            "llama3",
            float(params["factor"]),
            float(params["low_freq_factor"]),
            float(params["high_freq_factor"]),
            original,
        )
    if kind == "yarn":
        factor = params.get("factor")
        return RopeScaling(
            "yarn",
            float(factor) if factor is not None else max_positions / original,
            original_max_position_embeddings=original,
            beta_fast=float(params.get("beta_fast") or 32),
            beta_slow=float(params.get("beta_slow") or 1),
            attention_factor=_optional_float(params.get("attention_factor")),
            mscale=_optional_float(params.get("mscale")),
            mscale_all_dim=_optional_float(params.get("mscale_all_dim")),
            truncate=bool(params.get("truncate", True)),
        )
    if kind == "longrope":
        factor = params.get("factor")
        return RopeScaling(
            "longrope",
            float(factor) if factor is not None else max_positions / original,
            original_max_position_embeddings=original,
            attention_factor=_optional_float(params.get("attention_factor")),
            short_factor=tuple(float(v) for v in params["short_factor"]),
            long_factor=tuple(float(v) for v in params["long_factor"]),
        )
    raise RopeError(f"RoPE scaling {kind!r} is not supported")


def _optional_float(value) -> float | None:
    return None if value is None else float(value)


def rope_from_gguf(key, tensors: dict, *, max_positions: int) -> RopeScaling | None:
    """The scaling a GGUF file describes: `key(name, default)` reads `{arch}.name`; `tensors`
    maps the file's rope tensor names (rope_freqs, rope_factors_long, rope_factors_short) to
    float32 values. llama.cpp's converter writes Llama 3's scaling as a `rope_freqs` tensor and
    Phi-3's longrope as the two factor tensors with their attention factor."""
    kind = key("rope.scaling.type")
    factor = float(key("rope.scaling.factor", 1.0) or 1.0)
    original = int(key("rope.scaling.original_context_length", 0) or 0) or max_positions
    if "rope_factors_long" in tensors and "rope_factors_short" in tensors:
        attention = key("rope.scaling.attn_factor")
        return RopeScaling(
            "longrope",
            max_positions / original,
            original_max_position_embeddings=original,
            attention_factor=None if attention is None else float(attention),
            short_factor=tuple(tensors["rope_factors_short"]),
            long_factor=tuple(tensors["rope_factors_long"]),
        )
    if kind == "yarn":
        attention = key("rope.scaling.yarn_attn_factor")
        return RopeScaling(
            "yarn",
            factor,
            original_max_position_embeddings=original,
            beta_fast=float(key("rope.scaling.yarn_beta_fast", 32.0)),
            beta_slow=float(key("rope.scaling.yarn_beta_slow", 1.0)),
            attention_factor=None if attention is None else float(attention),
        )
    if kind == "linear":
        scaling = RopeScaling("linear", factor)
    elif kind in (None, "none"):
        scaling = None
    else:
        raise RopeError(f"RoPE scaling {kind!r} is not supported")
    if "rope_freqs" in tensors:
        if scaling is not None:
            raise RopeError("a rope_freqs tensor beside another RoPE scaling is not supported")
        return RopeScaling("factors", freq_factors=tuple(tensors["rope_freqs"]))
    return scaling
