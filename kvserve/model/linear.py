"""Matrix products of activations with fixed weights, in the fastest form the device offers.

On CPUs with bf16 weights, oneDNN runs much faster (about 2x for the small row counts of decode)
when the weight is reordered once into its blocked layout instead of on every call, which is
what `F.linear` does. torch exposes that through its mkldnn ops; they are checked against
`F.linear` once at start-up and not used if they disagree or are missing.

With float32 weights on the CPU, products of up to ROW_PRODUCT_ROWS rows (decode steps, short
chunks) go to kvserve's own row product (kvserve/model/csrc/f32_gemm.c): the BLAS streams the
weights at a tenth to a third of the memory's speed for so few rows, and its result for a row
changes with the number of rows beside it (1-3 rows against 4 or more), where the kernel's does
not. Larger products keep the BLAS.
"""

from __future__ import annotations

import logging
from functools import cache

import torch
import torch.nn.functional as F

from kvserve.model import native

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


def can_use_row_product(weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and weight.dim() == 2
        and weight.is_contiguous()
        and weight.shape[1] > 0
        and weight.shape[1] % 8 == 0
        and (bias is None or (bias.dtype == torch.float32 and bias.is_contiguous()))
        and native.f32_gemm_available()
    )


def can_pack(weight: torch.Tensor) -> bool:
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.bfloat16
        and torch.backends.mkldnn.is_available()
        and _packing_works()
    )


class Linear:
    """`y = x @ weight.T + bias` with the weight prepared once. `weight` stays available
    (unpacked) for code that indexes it."""

    __slots__ = ("weight", "bias", "_packed", "_row_product")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.weight = weight
        self.bias = bias
        self._packed = (
            torch.ops.mkldnn._reorder_linear_weight(weight, 64) if can_pack(weight) else None
        )
        self._row_product = can_use_row_product(weight, bias)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if (
            self._row_product
            and x.dim() == 2
            and x.shape[0] <= ROW_PRODUCT_ROWS
            and x.dtype == torch.float32
            and x.device.type == "cpu"
        ):
            return native.f32_gemm(x.contiguous(), self.weight, self.bias)
        if self._packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self._packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)
