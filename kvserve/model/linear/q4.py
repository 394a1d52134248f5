"""Weights kept in their 4-bit blocks (`--quantization q4`): GGUF's Q4_0 and Q4_1 as they are.

A decode step reads every weight once, so at small batch sizes its time is the bytes it reads.
The int8 path (kvserve/model/linear/int8.py) rotates and re-quantizes the weights to int8: twice the
bytes of a 4-bit file. Here the file's blocks are kept, exactly, only reordered for the VNNI
kernel (kvserve/model/csrc/q4_gemm.c), which unpacks them in registers: 32 weights of one output
column share a float16 scale d (and for Q4_1 an offset m), w = d * q + m with q in 0..15.

Activations are quantized per block of 32 as llama.cpp's Q8_0 (a scale per block, not per row),
so no rotation is needed to contain outliers: each block's error stays within its own range.
The weights are exactly the file's, so the only rounding the path adds is that of the
activations, as in llama.cpp.

The lm_head (the tied embedding, a float tensor here) is rotated and quantized to int8 per output
channel to pick each row's best candidates, which are then recomputed exactly in float32 (as on
the int8 path, kvserve/model/linear/int8.py; kvserve/model/head.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvserve.model.kernels import Q4_BLOCK as BLOCK
from kvserve.model.kernels import Q4_NIBBLE_BYTES as NIBBLE_BYTES
from kvserve.model.kernels import Q4_PANEL as PANEL
from kvserve.model.kernels import CpuKernels, check_q4_packed
from kvserve.model.linear.float import add_post_norm

# GGUF block sizes in bytes: Q4_0 = d (float16) + 16 bytes of nibbles; Q4_1 adds m (float16).
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20}
FORMATS = frozenset(BLOCK_BYTES)


@dataclass(frozen=True, slots=True)
class Blocks:
    """A weight [n, k] as GGUF 4-bit blocks: `raw` is uint8 [n, k / 32 * block bytes]."""

    qtype: str  # "Q4_0" | "Q4_1"
    raw: np.ndarray

    @property
    def shape(self) -> tuple[int, int]:
        n, row_bytes = self.raw.shape
        return n, row_bytes // BLOCK_BYTES[self.qtype] * BLOCK

    def fields(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(d [n, blocks] float16, m [n, blocks] float16, q [n, blocks, 32] uint8 in 0..15);
        for Q4_0, m = -8 d (exact in float16)."""
        n, k = self.shape
        width = BLOCK_BYTES[self.qtype]
        blocks = np.ascontiguousarray(self.raw).reshape(n, k // BLOCK, width)
        d = blocks[:, :, 0:2].copy().view(np.float16)[:, :, 0]
        if self.qtype == "Q4_1":
            m = blocks[:, :, 2:4].copy().view(np.float16)[:, :, 0]
        else:
            m = (d.astype(np.float32) * -8).astype(np.float16)
        packed = blocks[:, :, width - 16 :]
        q = np.concatenate([packed & 0x0F, packed >> 4], axis=2)  # element j, then j + 16
        return d, m, q

    def dequantize(self) -> torch.Tensor:
        """The weight as float32 [n, k] (the reference the kernel is tested against)."""
        d, m, q = self.fields()
        w = (
            q.astype(np.float32) * d.astype(np.float32)[:, :, None]
            + m.astype(np.float32)[..., None]
        )
        return torch.from_numpy(w.reshape(self.shape[0], -1))


def fuse(parts: list[Blocks]) -> Blocks:
    """Blocks of several weights with the same inputs stacked by output rows (q|k|v, gate|up).
    Mixed Q4_0 and Q4_1 parts become Q4_1 (Q4_0's offset written out, exactly)."""
    if len({p.qtype for p in parts}) == 1:
        return Blocks(parts[0].qtype, np.concatenate([p.raw for p in parts]))
    return Blocks("Q4_1", np.concatenate([as_q4_1(p).raw for p in parts]))


def as_q4_1(blocks: Blocks) -> Blocks:
    if blocks.qtype == "Q4_1":
        return blocks
    n, k = blocks.shape
    source = np.ascontiguousarray(blocks.raw).reshape(n, k // BLOCK, 18)
    d, m, _ = blocks.fields()
    out = np.empty((n, k // BLOCK, 20), dtype=np.uint8)
    out[:, :, 0:2] = d[..., None].view(np.uint8)
    out[:, :, 2:4] = m[..., None].view(np.uint8)
    out[:, :, 4:] = source[:, :, 2:]
    return Blocks("Q4_1", out.reshape(n, -1))


def pack(blocks: Blocks) -> torch.Tensor:
    """The layout of kvserve/model/csrc/q4_gemm.c: uint8 [panels, k / 32, record bytes]."""
    n, k = blocks.shape
    d, m, q = blocks.fields()
    panels, num_blocks = -(-n // PANEL), k // BLOCK
    padded = panels * PANEL
    if padded != n:  # zero columns past n (d = m = 0: they add nothing)
        q = np.concatenate([q, np.zeros((padded - n, num_blocks, BLOCK), np.uint8)])
        d = np.concatenate([d, np.zeros((padded - n, num_blocks), np.float16)])
        m = np.concatenate([m, np.zeros((padded - n, num_blocks), np.float16)])
    # q [col, block, 32] -> [col, block, quarter h, low/high, byte b]: k = 8 h + 4 * high + b
    q = q.reshape(padded, num_blocks, 4, 2, 4)
    nibbles = q[:, :, :, 0, :] | (q[:, :, :, 1, :] << 4)  # [col, block, h, b]
    # -> [panel, block, half j, h, column c, b]
    nibbles = nibbles.reshape(panels, 2, 16, num_blocks, 4, 4).transpose(0, 3, 1, 4, 2, 5)
    parts = [
        nibbles.reshape(panels, num_blocks, NIBBLE_BYTES),
        d.reshape(panels, PANEL, num_blocks).transpose(0, 2, 1).copy().view(np.uint8),
    ]
    if blocks.qtype == "Q4_1":
        parts.append(m.reshape(panels, PANEL, num_blocks).transpose(0, 2, 1).copy().view(np.uint8))
    return torch.from_numpy(np.ascontiguousarray(np.concatenate(parts, axis=2)))


class Q4Format:
    """Activations in two-part int8 blocks of 32 (about 12 bits a value; csrc/q4_gemm.c).
    `activation` is the gate of `gated` ("silu" or "gelu_tanh")."""

    __slots__ = ("kernels", "activation")

    def __init__(self, kernels: CpuKernels, activation: str = "silu") -> None:
        self.kernels = kernels
        self.activation = activation

    def normed(
        self, x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor | None, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.kernels.add_rmsnorm_qb(x, delta, weight, eps)

    def add_normed(
        self, x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> None:
        """x += rmsnorm(delta) * weight for a float32 product (a post-norm)."""
        add_post_norm(x, delta, weight, eps, torch.float32, self.kernels)

    def rows(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.kernels.quantize_blocks(t)

    def gated(self, gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.kernels.silu_mul_qb(gate_up, self.activation)


@dataclass(slots=True)
class Q4Linear:
    """A weight kept in its GGUF 4-bit blocks, packed for csrc/q4_gemm.c. Its products are
    float32 ([rows, out]); `dense` adds the bias (in float32, as the driver does)."""

    packed: torch.Tensor  # uint8 [panels, k / 32, record bytes]
    out_features: int
    asym: bool  # Q4_1 (d and m per block) rather than Q4_0 (d)
    bias: torch.Tensor | None = None  # [out] float32
    input: Q4Format | None = None
    kernels: CpuKernels | None = None

    @classmethod
    def from_blocks(cls, blocks: Blocks, bias: torch.Tensor | None = None, **fields) -> Q4Linear:
        n, k = blocks.shape
        if k % BLOCK or n <= 0:
            raise ValueError(f"a [{n}, {k}] weight is not whole 4-bit blocks")
        return cls(
            pack(blocks),
            n,
            blocks.qtype == "Q4_1",
            None if bias is None else bias.float().contiguous(),
            **fields,
        )

    @property
    def in_features(self) -> int:
        return self.packed.shape[1] * BLOCK

    @property
    def num_bytes(self) -> int:
        tensors = [self.packed, self.bias]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    def apply(self, h: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Block-quantized rows (`Q4Format`) times the weight's transpose: [rows, out] float32."""
        q, scales, sums = h
        return self.kernels.q4_gemm(q, scales, sums, self.packed, self.out_features, self.asym)

    def dense(self, y: torch.Tensor) -> torch.Tensor:
        return y if self.bias is None else y + self.bias

    def check(self, n: int, k: int) -> None:
        """Refuse (KernelInputError) a weight that is not [n, k] as packed."""
        check_q4_packed(self.packed, n, k, self.asym)

    def to_tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        tensors = {f"{prefix}.packed": self.packed}
        if self.bias is not None:
            tensors[f"{prefix}.bias"] = self.bias
        return tensors

    def numbers(self, prefix: str) -> dict[str, int]:
        return {f"{prefix}.n": self.out_features, f"{prefix}.asym": int(self.asym)}

    @classmethod
    def from_tensors(
        cls, tensors: dict[str, torch.Tensor], numbers: dict[str, int], prefix: str, **fields
    ) -> Q4Linear:
        return cls(
            tensors[f"{prefix}.packed"],
            int(numbers[f"{prefix}.n"]),
            bool(numbers[f"{prefix}.asym"]),
            tensors.get(f"{prefix}.bias"),
            **fields,
        )


def unsupported(
    checkpoint, config, kernels: CpuKernels | None, device: torch.device | None = None
) -> str | None:
    """Why the 4-bit path cannot run this checkpoint (on `device`), or None when it can: every
    linear weight of every layer must be Q4_0 or Q4_1 in a GGUF file, the widths whole blocks,
    and the device a CPU with AVX512-VNNI."""
    if device is not None and device.type != "cpu":
        return "not on the CPU"
    if not hasattr(checkpoint, "raw_rows"):
        return "the checkpoint is not a GGUF file"
    for width, name in (
        (config.hidden_size, "hidden size"),
        (config.q_size, "attention width"),
        (config.intermediate_size, "FFN width"),
    ):
        if width % BLOCK:
            return f"the {name} ({width}) is not a multiple of {BLOCK}"
    types = {
        checkpoint.tensor_type(f"model.layers.{i}.{name}.weight")
        for i in range(config.num_layers)
        for name in checkpoint.family.layer_tensors()
    }
    if not types <= FORMATS:
        return f"its layers' weights are {'/'.join(sorted(map(str, types)))}, not all Q4_0/Q4_1"
    # The file's own reasons first: they hold on every machine.
    if kernels is None or not kernels.q4:
        return "the CPU has no AVX512-VNNI (or no C compiler)"
    return None


def load_projection(
    checkpoint,
    prefix: str,
    names: tuple[str, ...],
    kernels: CpuKernels,
    *,
    bias: bool = False,
    input: Q4Format | None = None,
) -> Q4Linear:
    """The fused product of `names` (e.g. q, k, v) of a layer, its blocks packed."""
    parts = [
        Blocks(
            checkpoint.tensor_type(f"{prefix}{n}.weight"),
            checkpoint.raw_rows(f"{prefix}{n}.weight"),
        )
        for n in names
    ]
    biases = None
    if bias:
        biases = torch.cat([require_float(checkpoint, f"{prefix}{n}.bias") for n in names])
    return Q4Linear.from_blocks(
        fuse(parts), biases, input=input or Q4Format(kernels), kernels=kernels
    )


def require_float(checkpoint, name: str) -> torch.Tensor:
    tensor = checkpoint.get(name)
    if tensor is None:
        raise ValueError(f"checkpoint is missing tensor {name!r}")
    return tensor.float().contiguous()
