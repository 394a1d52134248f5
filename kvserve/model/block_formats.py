"""GGUF's block formats as the block kernels (csrc/blocks_gemm.c) know them, and the activation
blocks they multiply: plain data, shared by the kernels' checks and the block linear method.

Weights are GGUF blocks repacked into panels of 16 output columns; activations are blocks of
32 int8 values with a float32 scale and the sums of each 16 (`ActivationBlocks`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

PANEL = 16  # output columns per packed panel
ACT_BLOCK = 32  # activation values per scale


@dataclass(frozen=True, slots=True)
class BlockFormat:
    """A GGUF block format as the kernels know it."""

    name: str
    ggml_type: int  # ggml.h's enum ggml_type
    values: int  # inputs per block
    gguf_bytes: int  # bytes per block in the file
    record_bytes: int  # bytes per packed record (one block of 16 columns)


FORMATS = {
    f.name: f
    for f in (
        BlockFormat("Q4_0", 2, 32, 18, 288),
        BlockFormat("Q4_1", 3, 32, 20, 320),
        BlockFormat("Q5_0", 6, 32, 22, 352),
        BlockFormat("Q5_1", 7, 32, 24, 384),
        BlockFormat("Q8_0", 8, 32, 34, 544),
        BlockFormat("Q4_K", 12, 256, 144, 2368),
        BlockFormat("Q5_K", 13, 256, 176, 2880),
        BlockFormat("Q6_K", 14, 256, 210, 3360),
    )
}
SUPPORTED = frozenset(FORMATS)
K_QUANTS = frozenset({"Q4_K", "Q5_K", "Q6_K"})
_BY_TYPE = {f.ggml_type: f for f in FORMATS.values()}

ISAS = {3: "AVX512-VNNI", 2: "AVX-VNNI", 1: "AVX2"}  # kvserve_blocks_isa's answers


def format_of_type(ggml_type: int) -> BlockFormat | None:
    """The format with this GGML type id, or None."""
    return _BY_TYPE.get(ggml_type)


def packed_shape(fmt: BlockFormat, n: int, k: int) -> tuple[int, int, int]:
    """The packed weight's shape: (panels of 16 columns, blocks, record bytes)."""
    return -(-n // PANEL), k // fmt.values, fmt.record_bytes


class ActivationBlocks(NamedTuple):
    """Rows in blocks of 32: values ~= q * scales per block, q in -127..127 (8 bits; a width
    of whole 256s has one scale per 256, repeated over its 8 blocks, as the K-quants' product
    takes it); in the finer form (`rest` given, 12 bits), values ~= (16 q + rest) * scales
    with rest in -8..8.
    `sums` holds the sums of the integer values (q, or 16 q + rest) over each 16 values (the
    kernels' offset terms)."""

    q: torch.Tensor  # [rows, k] int8
    scales: torch.Tensor  # [rows, k / 32] float32
    sums: torch.Tensor  # [rows, k / 16] int32
    rest: torch.Tensor | None = None  # [rows, k] int8, the finer form only

    @property
    def rows(self) -> int:
        return self.q.shape[0]

    @property
    def fine(self) -> bool:
        return self.rest is not None

    def integers(self) -> torch.Tensor:
        """The integer value of each activation, int32 [rows, k]."""
        q = self.q.to(torch.int32)
        return q if self.rest is None else 16 * q + self.rest.to(torch.int32)

    def dequantize(self) -> torch.Tensor:
        """The values the product sees, as float64 [rows, k] (a test reference)."""
        rows, k = self.q.shape
        blocks = self.integers().double().view(rows, k // ACT_BLOCK, ACT_BLOCK)
        return (blocks * self.scales.double()[..., None]).view(rows, k)


class Part(NamedTuple):
    """One packed weight of a product: its format, packed tensor, output columns, bias."""

    qtype: str
    packed: torch.Tensor
    n: int
    bias: torch.Tensor | None = None
