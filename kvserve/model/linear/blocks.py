"""Weights kept in GGUF's block formats and multiplied in their blocks.

The files people download (Q4_K_M and its kin) hold most weights as Q4_K and Q6_K, with Q5_0,
Q8_0 (and Q4_0, Q4_1, Q5_1, Q5_K) where a width does not suit the K-quants. A decode step reads
every weight once, so at one or a few rows its time is the bytes it reads: keeping the file's
4.5-6.6 bits a weight, rather than an int8 copy, is what makes it fast, and the memory is the
file's. Each weight is repacked once, at load, into the kernel's layout (panels of 16 output
columns, kvserve/model/csrc/blocks_gemm.c): the same bits rearranged, 0-3% more bytes than the
file, never a dequantized copy. The packed tensors are plain uint8 tensors, saved and memory-
mapped by the prepared-weight cache (`to_tensors` / `from_tensors`).

Activations are quantized per block of 32 values to int8 with a float32 scale (llama.cpp's
Q8_0, `quantize`), or by the fused `add_rmsnorm` (residual add, RMS norm, quantize) and
`silu_mul` kernels; where the width is whole 256s, one scale per 256 (llama.cpp's Q8_K), so
that the K-quants' sub-block scales multiply integer sums (csrc/blocks_gemm.c). Measured on
Qwen2.5-Coder-0.5B's Q4_K_M file, 8 bits are enough: every layer's products run by the
kernels, perplexity -0.08% and 98.9% of next tokens as the float32 model of the same weights
(kvserve/bench/blocks_bench.py --quality). Small models can need more: on SmolLM2-135M the
"capital of France" answer turns from "Paris" to "L'Etoile..." (a near tie). `fine=True` gives
12 bits (a coarse int8 and a 4-bit rest, as the q4 path), for a second multiply per weight and
input.

The product's integer sums are exact and its float work one fixed sequence per output: a row's
result does not depend on the other rows of the call, the thread count or the instruction set
(AVX2, AVX-VNNI, AVX512-VNNI).

As a linear method (kvserve/model/linear/__init__.py) a `BlockLinear` is one product of one
or several weights with the same inputs (q|k|v, gate|up), each part kept in its own format and
all multiplied in one call; its input format `BlockActivations` makes the activation blocks
(fused with the residual add and the norm, or with silu * up).

Typical use::

    w = BlockWeight.from_checkpoint(checkpoint, "model.layers.0.mlp.down_proj.weight", kernels)
    y = w.apply(x)                       # x [rows, in] float32 -> [rows, out] float32
    qkv = fused_from_checkpoint(checkpoint, [q, k, v], kernels, biases=[qb, kb, vb])
    y = qkv.apply(qkv.input.normed(residual, delta, norm_weight, eps))
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from kvserve.config import REQUANTIZE_TYPES
from kvserve.model.block_formats import (
    FORMATS,
    K_QUANTS,
    SUPPORTED,
    ActivationBlocks,
    BlockFormat,
    Part,
    format_of_type,
    packed_shape,
)
from kvserve.model.kernels import CpuKernels, block_format
from kvserve.model.linear.float import add_post_norm

__all__ = [
    "FORMATS",
    "K_QUANTS",
    "REQUANTIZE_TYPES",
    "SUPPORTED",
    "ActivationBlocks",
    "BlockActivations",
    "BlockFormat",
    "BlockLinear",
    "BlockWeight",
    "UnsupportedBlockFormat",
    "fused_from_checkpoint",
    "read_gguf",
]


class UnsupportedBlockFormat(ValueError):
    """A tensor whose type the block kernels do not take (a float type, IQ*, Q2_K, Q3_K...)."""


def read_gguf(checkpoint, name: str) -> tuple[str, np.ndarray]:
    """(type, raw rows) of a block-quantized weight of a `GGUFCheckpoint` by Hugging Face name:
    raw is uint8 [out, row bytes], rows in Hugging Face order (a view of the mapped file where
    no reordering is needed). KeyError for an absent tensor, UnsupportedBlockFormat for a type
    the kernels lack."""
    qtype = checkpoint.tensor_type(name)
    if qtype is None:
        raise KeyError(f"the checkpoint has no tensor {name}")
    if qtype not in SUPPORTED:
        raise UnsupportedBlockFormat(f"{name} is {qtype}, not one of {', '.join(FORMATS)}")
    return qtype, checkpoint.raw_rows(name)


def _float_bias(bias: torch.Tensor | None, n: int) -> torch.Tensor | None:
    if bias is None:
        return None
    bias = bias.detach().to(torch.float32).contiguous()
    if bias.shape != (n,):
        raise ValueError(f"a bias of shape {tuple(bias.shape)} does not fit {n} outputs")
    return bias


class BlockActivations:
    """The block product's input: activations in blocks of 32, 8 bits a value (llama.cpp's
    Q8_0), or 12 with `fine`; made by the fused kernels of csrc/blocks_gemm.c. `activation`
    is the gate of `gated` ("silu" or "gelu_tanh")."""

    __slots__ = ("kernels", "fine", "activation")

    def __init__(self, kernels: CpuKernels, fine: bool = False, activation: str = "silu") -> None:
        self.kernels = kernels
        self.fine = fine
        self.activation = activation

    def normed(
        self, x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor | None, eps: float
    ) -> ActivationBlocks:
        return self.kernels.blocks_add_rmsnorm(x, delta, weight, eps, fine=self.fine)

    def add_normed(
        self, x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> None:
        """x += rmsnorm(delta) * weight for a float32 product (a post-norm)."""
        add_post_norm(x, delta, weight, eps, torch.float32, self.kernels)

    def rows(self, t: torch.Tensor) -> ActivationBlocks:
        return self.kernels.blocks_quantize(t, self.fine)

    def gated(self, gate_up: torch.Tensor) -> ActivationBlocks:
        if self.activation == "silu":
            return self.kernels.blocks_silu_mul(gate_up, self.fine)
        gate, up = gate_up.chunk(2, dim=-1)  # GeGLU: its gate in float32, then the blocks
        return self.kernels.blocks_quantize(
            F.gelu(gate, approximate="tanh").mul_(up).contiguous(), self.fine
        )


@dataclass(slots=True)
class BlockWeight:
    """One weight [out_features, in_features] packed for the block product, with its bias."""

    qtype: str  # "Q4_K", "Q6_K", ...
    out_features: int
    in_features: int
    packed: torch.Tensor  # uint8 [ceil(out / 16), in / block, record bytes]
    bias: torch.Tensor | None = None  # [out] float32
    kernels: CpuKernels | None = None

    def __post_init__(self) -> None:
        want = packed_shape(block_format(self.qtype), self.out_features, self.in_features)
        if (
            self.packed.dtype != torch.uint8
            or tuple(self.packed.shape) != want
            or not self.packed.is_contiguous()
        ):
            raise ValueError(
                f"a packed {self.qtype} [{self.out_features}, {self.in_features}] weight is "
                f"uint8 {want}, not {self.packed.dtype} {tuple(self.packed.shape)}"
            )
        self.bias = _float_bias(self.bias, self.out_features)

    @classmethod
    def from_raw(
        cls,
        qtype: str,
        raw: np.ndarray | torch.Tensor,
        kernels: CpuKernels,
        bias: torch.Tensor | None = None,
    ) -> BlockWeight:
        """Pack GGUF rows of blocks (uint8 [out, row bytes]) of type `qtype`."""
        fmt = block_format(qtype)
        n, row_bytes = raw.shape
        packed = kernels.blocks_pack(fmt, raw)
        return cls(qtype, n, row_bytes // fmt.gguf_bytes * fmt.values, packed, bias, kernels)

    @classmethod
    def from_checkpoint(
        cls, checkpoint, name: str, kernels: CpuKernels, bias_name: str | None = None
    ) -> BlockWeight:
        """The weight `name` of a GGUF checkpoint (see `read_gguf`), with the float bias
        `bias_name` where given."""
        qtype, raw = read_gguf(checkpoint, name)
        bias = None
        if bias_name is not None:
            bias = checkpoint.get(bias_name)
            if bias is None:
                raise KeyError(f"the checkpoint has no tensor {bias_name}")
        return cls.from_raw(qtype, raw, kernels, bias)

    @property
    def format(self) -> BlockFormat:
        return FORMATS[self.qtype]

    @property
    def part(self) -> Part:
        return Part(self.qtype, self.packed, self.out_features, self.bias)

    @property
    def num_bytes(self) -> int:
        tensors = [self.packed, self.bias]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    def dequantize(self) -> torch.Tensor:
        """The weight as float32 [out, in], as ggml dequantizes its blocks (bias apart)."""
        return self.kernels.blocks_unpack(
            self.format, self.packed, self.out_features, self.in_features
        )

    def apply_blocks(self, x: ActivationBlocks) -> torch.Tensor:
        """Activation blocks [rows, in] times the weight's transpose (+ bias): [rows, out]."""
        return self.kernels.blocks_gemm(x, [self.part])

    def apply(self, x: torch.Tensor, fine: bool = False) -> torch.Tensor:
        """x [rows, in] (float32 or bfloat16) quantized per block of 32 (8 bits, or 12 with
        `fine`), then `apply_blocks`."""
        return self.apply_blocks(self.kernels.blocks_quantize(x, fine))

    def requantized(
        self,
        qtype: str,
        rows_of: Callable[[torch.Tensor], torch.Tensor] | None = None,
        chunk_rows: int = 8192,
    ) -> BlockWeight:
        """This weight in `qtype` (REQUANTIZE_TYPES) where its blocks take more bytes a value
        and its inputs are whole blocks of it, else itself: the file's values (as ggml
        dequantizes them) rounded again by ggml's reference quantizer. For a draft model, whose
        rounding only changes which guesses are accepted (kvserve/engine/draft.py).
        `rows_of(rows)`: the float32 values [len(rows), in] of output rows `rows` ([n] int64),
        read `chunk_rows` at a time (a large head: no float copy of it whole); default, this
        weight dequantized at once."""
        if qtype not in REQUANTIZE_TYPES:
            raise ValueError(
                f"requantizing to {qtype!r} is not supported (use {' or '.join(REQUANTIZE_TYPES)})"
            )
        fmt, target = self.format, block_format(qtype)
        if (
            target.gguf_bytes * fmt.values >= fmt.gguf_bytes * target.values
            or self.in_features % target.values
        ):
            return self
        quantize = self.kernels.blocks_quantize_q4_0
        if rows_of is None:
            raw = quantize(self.dequantize())
        else:
            n = self.out_features
            raw = np.concatenate(
                [
                    quantize(rows_of(torch.arange(first, min(first + chunk_rows, n))))
                    for first in range(0, n, chunk_rows)
                ]
            )
        return BlockWeight.from_raw(qtype, raw, self.kernels, self.bias)

    def to_tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        """The tensors this weight is made of, named `prefix.field` (for the weight cache):
        `packed`, `shape` (int64 [GGML type, out, in]) and, where present, `bias`."""
        tensors = {
            f"{prefix}.packed": self.packed,
            f"{prefix}.shape": torch.tensor(
                [self.format.ggml_type, self.out_features, self.in_features], dtype=torch.int64
            ),
        }
        if self.bias is not None:
            tensors[f"{prefix}.bias"] = self.bias
        return tensors

    @classmethod
    def from_tensors(
        cls, tensors: dict[str, torch.Tensor], prefix: str, kernels: CpuKernels | None = None
    ) -> BlockWeight:
        """The inverse of `to_tensors`; the tensors are used where they lie (memory-mapped).
        KeyError for a missing tensor, ValueError for ones that do not fit together."""
        shape = tensors[f"{prefix}.shape"]
        if shape.dtype != torch.int64 or tuple(shape.shape) != (3,):
            raise ValueError(f"{prefix}.shape is not int64 [3]")
        ggml_type, n, k = (int(v) for v in shape)
        fmt = format_of_type(ggml_type)
        if fmt is None:
            raise ValueError(f"{prefix} has GGML type {ggml_type}, not a block format")
        packed, bias = tensors[f"{prefix}.packed"], tensors.get(f"{prefix}.bias")
        return cls(fmt.name, n, k, packed, bias, kernels)


@dataclass(slots=True)
class BlockLinear:
    """The linear method of GGUF blocks: weights with the same inputs (q|k|v, gate|up, or one
    weight alone), each kept in its own format, multiplied in one call; the output is the
    parts' columns side by side, float32, biases added."""

    parts: tuple[BlockWeight, ...]
    kernels: CpuKernels | None = None
    input: BlockActivations | None = None

    def __post_init__(self) -> None:
        self.parts = tuple(self.parts)
        if not self.parts:
            raise ValueError("a fused weight needs at least one part")
        widths = {p.in_features for p in self.parts}
        if len(widths) != 1:
            raise ValueError(f"fused parts must share their inputs, not {sorted(widths)}")
        if self.kernels is None:
            self.kernels = self.parts[0].kernels
        if self.input is None and self.kernels is not None:
            self.input = BlockActivations(self.kernels)

    @property
    def in_features(self) -> int:
        return self.parts[0].in_features

    @property
    def out_features(self) -> int:
        return sum(p.out_features for p in self.parts)

    @property
    def splits(self) -> list[int]:
        """Each part's output columns, in order (for `torch.split` of the product)."""
        return [p.out_features for p in self.parts]

    @property
    def qtypes(self) -> tuple[str, ...]:
        return tuple(p.qtype for p in self.parts)

    @property
    def num_bytes(self) -> int:
        return sum(p.num_bytes for p in self.parts)

    def dequantize(self) -> torch.Tensor:
        return torch.cat([p.dequantize() for p in self.parts])

    def apply(self, x: ActivationBlocks) -> torch.Tensor:
        """Activation blocks [rows, in] times every part: [rows, sum of out] float32."""
        return self.kernels.blocks_gemm(x, [p.part for p in self.parts])

    def dense(self, y: torch.Tensor) -> torch.Tensor:
        return y

    def requantized(self, qtype: str) -> BlockLinear:
        """The same product with each part `BlockWeight.requantized`."""
        parts = tuple(p.requantized(qtype) for p in self.parts)
        if all(new is old for new, old in zip(parts, self.parts, strict=True)):
            return self
        return BlockLinear(parts, self.kernels, self.input)

    def to_tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        """`prefix.parts` (int64 [count]) and each part's tensors under `prefix.<index>`."""
        tensors = {f"{prefix}.parts": torch.tensor([len(self.parts)], dtype=torch.int64)}
        for index, part in enumerate(self.parts):
            tensors |= part.to_tensors(f"{prefix}.{index}")
        return tensors

    @classmethod
    def from_tensors(
        cls,
        tensors: dict[str, torch.Tensor],
        prefix: str,
        kernels: CpuKernels | None = None,
        input: BlockActivations | None = None,
    ) -> BlockLinear:
        count = int(tensors[f"{prefix}.parts"][0])
        parts = tuple(
            BlockWeight.from_tensors(tensors, f"{prefix}.{i}", kernels) for i in range(count)
        )
        return cls(parts, kernels, input)


def fused_from_checkpoint(
    checkpoint,
    names: Sequence[str],
    kernels: CpuKernels,
    biases: Sequence[str | None] | None = None,
    input: BlockActivations | None = None,
) -> BlockLinear:
    """The weights `names` of a GGUF checkpoint as one product (with the biases named in
    `biases`), each part in its own format."""
    biases = list(biases) if biases is not None else [None] * len(names)
    if len(biases) != len(names):
        raise ValueError("one bias name (or None) per weight")
    parts = [
        BlockWeight.from_checkpoint(checkpoint, n, kernels, b)
        for n, b in zip(names, biases, strict=True)
    ]
    return BlockLinear(tuple(parts), kernels, input)


def unsupported(checkpoint, config, kernels: CpuKernels | None, device=None) -> str | None:
    """Why the GGUF block path (`--quantization gguf`) cannot run this checkpoint here, or
    None when it can: a GGUF file whose layers, embedding and head are in block formats the
    kernels take, on a CPU where the block product was built."""
    if device is not None and device.type != "cpu":
        return "not on the CPU"
    if not hasattr(checkpoint, "raw_rows"):
        return "the checkpoint is not a GGUF file"
    parts = [n for names in checkpoint.family.projections().values() for n in names]
    names = [f"model.layers.{i}.{part}.weight" for i in range(config.num_layers) for part in parts]
    names.append("model.embed_tokens.weight")
    if not config.tie_word_embeddings:
        names.append("lm_head.weight")
    types = {checkpoint.tensor_type(name) for name in names}
    if not types <= SUPPORTED:
        other = sorted(str(t) for t in types - SUPPORTED)
        return f"its weights include {'/'.join(other)}, which the block kernels do not take"
    if kernels is None or not kernels.blocks_isa:
        return "the block product is not built here (it needs a C compiler and AVX2)"
    return None


def holds_k_quants(tensor_types) -> bool:
    """Whether a file's tensor types include the K-quants (Q4_K_M and its kin)."""
    return bool(set(tensor_types) & K_QUANTS)
