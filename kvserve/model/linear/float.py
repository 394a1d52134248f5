"""Float linear layers (fp32/bf16 weights) and the float activation format.

On CPUs with bf16 weights, oneDNN runs much faster (about 2x for the small row counts of decode)
when the weight is reordered once into its blocked layout instead of on every call, which is
what `F.linear` does. torch exposes that through its mkldnn ops; they are checked against
`F.linear` once at start-up and not used if they disagree or are missing.

With float32 weights on the CPU, products of up to ROW_PRODUCT_ROWS rows (decode steps, short
chunks) go to kvserve's own row product (kvserve/model/csrc/f32_gemm.c): the BLAS streams the
weights at a tenth to a third of the memory's speed for so few rows, and its result for a row
changes with the number of rows beside it (1-3 rows against 4 or more), where the kernel's does
not. Larger products keep the BLAS.

The activation format is rows of the model dtype. On the CPU its steps are the fused C layer
ops (add + rmsnorm + cast in one pass, silu * up in one pass); without kernels (CUDA, or no C
compiler) they are torch ops.
"""

from __future__ import annotations

import logging
from functools import cache

import torch
import torch.nn.functional as F

from kvserve.model.kernels import CpuKernels

log = logging.getLogger("kvserve.model")


@cache
def _packing_works() -> bool:
    try:
        ops = torch.ops.mkldnn
        generator = torch.Generator().manual_seed(0)
        weight = torch.randn(48, 64, generator=generator).to(torch.bfloat16)
        bias = torch.randn(48, generator=generator).to(torch.bfloat16)
        packed = ops._reorder_linear_weight(weight, 8)
        for rows in (1, 5, 33):
            x = torch.randn(rows, 64, generator=generator).to(torch.bfloat16)
            expect = F.linear(x.float(), weight.float(), bias.float())
            got = ops._linear_pointwise(x, packed, bias, "none", [], "").float()
            if got.shape != expect.shape or (got - expect).abs().max() > 0.05 * expect.abs().max():
                return False
        return True
    except (AttributeError, RuntimeError) as exc:
        log.info("oneDNN weight packing unavailable (%s); using F.linear", exc)
        return False


# Up to this many rows the float32 row product beats the BLAS (docs/benchmarks.md).
ROW_PRODUCT_ROWS = 32


def can_use_row_product(
    weight: torch.Tensor, bias: torch.Tensor | None, kernels: CpuKernels | None
) -> bool:
    return (
        kernels is not None
        and kernels.f32_row_product
        and weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and weight.dim() == 2
        and weight.is_contiguous()
        and weight.shape[1] > 0
        and weight.shape[1] % 8 == 0
        and (bias is None or (bias.dtype == torch.float32 and bias.is_contiguous()))
    )


def can_pack(weight: torch.Tensor) -> bool:
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.bfloat16
        and torch.backends.mkldnn.is_available()
        and _packing_works()
    )


class FloatFormat:
    """Rows in the model dtype: the fused C layer ops where `kernels` has them, else torch.
    `activation` is the gate of `gated` ("silu", or "gelu_tanh" for GeGLU)."""

    __slots__ = ("dtype", "kernels", "activation")

    def __init__(
        self, dtype: torch.dtype, kernels: CpuKernels | None, activation: str = "silu"
    ) -> None:
        self.dtype = dtype
        self.kernels = kernels if kernels is not None and kernels.has("layer_ops") else None
        self.activation = activation

    def normed(
        self, x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor | None, eps: float
    ) -> torch.Tensor:
        if self.kernels is not None and x.device.type == "cpu" and weight is not None:
            if delta is not None and (delta.dtype != self.dtype or not delta.is_contiguous()):
                delta = delta.to(self.dtype).contiguous()
            return self.kernels.add_rmsnorm(x, delta, weight, eps, self.dtype)
        if delta is not None:
            x.add_(delta)
        return F.rms_norm(x, (x.shape[-1],), weight, eps).to(self.dtype)

    def add_normed(
        self, x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> None:
        add_post_norm(x, delta, weight, eps, self.dtype, self.kernels)

    def rows(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def gated(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self.kernels is not None and gate_up.device.type == "cpu" and gate_up.is_contiguous():
            return self.kernels.silu_mul(gate_up, self.activation)
        gate, up = gate_up.chunk(2, dim=-1)
        if self.activation == "gelu_tanh":
            return F.gelu(gate, approximate="tanh") * up
        return F.silu(gate) * up


def add_post_norm(
    x: torch.Tensor,
    delta: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    dtype: torch.dtype,
    kernels: CpuKernels | None,
) -> None:
    """x += rmsnorm(delta) * weight, the normed rows cast to `dtype` first (as transformers
    casts a post-norm's output to the activations' dtype). x: [rows, hidden] float32."""
    delta = delta.float().contiguous()
    if kernels is not None and delta.device.type == "cpu":
        normed = kernels.add_rmsnorm(delta, None, weight, eps, dtype)
    else:
        normed = F.rms_norm(delta, (delta.shape[-1],), weight, eps).to(dtype)
    x.add_(normed)


class FloatLinear:
    """`y = x @ weight.T + bias` with the weight prepared once. `weight` stays available
    (unpacked) for code that indexes it."""

    __slots__ = ("weight", "bias", "input", "_packed", "_kernels")

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        kernels: CpuKernels | None = None,
        input_format: FloatFormat | None = None,
    ) -> None:
        self.weight = weight  # [out, in]
        self.bias = bias  # [out] or None
        self.input = input_format or FloatFormat(weight.dtype, kernels)
        self._packed = (
            torch.ops.mkldnn._reorder_linear_weight(weight, 64) if can_pack(weight) else None
        )
        self._kernels = kernels if can_use_row_product(weight, bias, kernels) else None

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        if (
            self._kernels is not None
            and x.dim() == 2
            and x.shape[0] <= ROW_PRODUCT_ROWS
            and x.dtype == torch.float32
            and x.device.type == "cpu"
        ):
            return self._kernels.f32_gemm(x.contiguous(), self.weight, self.bias)
        if self._packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self._packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    __call__ = apply

    def dense(self, y: torch.Tensor) -> torch.Tensor:
        return y

    @property
    def num_bytes(self) -> int:
        tensors = [self.weight] + ([] if self.bias is None else [self.bias])
        return sum(t.numel() * t.element_size() for t in tensors)

    def to_tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        tensors = {f"{prefix}.weight": self.weight}
        if self.bias is not None:
            tensors[f"{prefix}.bias"] = self.bias
        return tensors
