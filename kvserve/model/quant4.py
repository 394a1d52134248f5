"""Weights kept in their 4-bit blocks (`--quantization q4`): GGUF's Q4_0 and Q4_1 as they are.

A decode step reads every weight once, so at small batch sizes its time is the bytes it reads.
The int8 path (kvserve/model/quant.py) rotates and re-quantizes the weights to int8: twice the
bytes of a 4-bit file. Here the file's blocks are kept, exactly, only reordered for the VNNI
kernel (kvserve/model/csrc/q4_gemm.c), which unpacks them in registers: 32 weights of one output
column share a float16 scale d (and for Q4_1 an offset m), w = d * q + m with q in 0..15.

Activations are quantized per block of 32 as llama.cpp's Q8_0 (a scale per block, not per row),
so no rotation is needed to contain outliers: each block's error stays within its own range.
The weights are exactly the file's, so the only rounding the path adds is that of the
activations, as in llama.cpp.

The lm_head (the tied embedding, a float tensor here) is rotated and quantized to int8 per output
channel to pick each row's best candidates, which are then recomputed exactly in float32 (as on
the int8 path, kvserve/model/quant.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvserve.model import native_q4
from kvserve.model.config import require_tensor
from kvserve.model.native_q4 import BLOCK, NIBBLE_BYTES, PANEL
from kvserve.model.quant import Int8Weight, residual_rotation

# GGUF block sizes in bytes: Q4_0 = d (float16) + 16 bytes of nibbles; Q4_1 adds m (float16).
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20}
FORMATS = frozenset(BLOCK_BYTES)
_LAYER_WEIGHTS = ("qkv", "o", "gate_up", "down")


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


@dataclass(slots=True)
class Q4Weight:
    packed: torch.Tensor  # uint8 [panels, k / 32, record bytes]
    out_features: int
    asym: bool  # Q4_1 (d and m per block) rather than Q4_0 (d)
    bias: torch.Tensor | None = None  # [out] float32

    @classmethod
    def from_blocks(cls, blocks: Blocks, bias: torch.Tensor | None = None) -> Q4Weight:
        n, k = blocks.shape
        if k % BLOCK or n <= 0:
            raise ValueError(f"a [{n}, {k}] weight is not whole 4-bit blocks")
        return cls(
            pack(blocks),
            n,
            blocks.qtype == "Q4_1",
            None if bias is None else bias.float().contiguous(),
        )

    @property
    def num_bytes(self) -> int:
        tensors = [self.packed, self.bias]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    def matmul(self, q: torch.Tensor, scales: torch.Tensor, sums: torch.Tensor) -> torch.Tensor:
        """Block-quantized rows (see `native.quantize_blocks`) times the weight's transpose:
        [rows, out] float32."""
        return native_q4.q4_gemm(q, scales, sums, self.packed, self.out_features, self.asym)


@dataclass(slots=True)
class Q4Layer:
    qkv: Q4Weight  # q|k|v rows (Hugging Face order), with the q|k|v bias where the model has one
    o: Q4Weight
    gate_up: Q4Weight  # gate rows, then up rows
    down: Q4Weight
    attn_norm: torch.Tensor  # [hidden] float32
    mlp_norm: torch.Tensor  # [hidden] float32
    qk_norm: torch.Tensor | None  # [heads + kv_heads, head_dim] float32, or None


@dataclass(slots=True)
class Q4Weights:
    layers: list[Q4Layer]
    # The int8 lm_head that picks each row's candidates: final norm folded in, in the basis of
    # `rotation`. The last hidden states carry a few huge channels; rotated, they spread over
    # all channels, so one int8 scale per row keeps the rest (as on the int8 path).
    head: Int8Weight
    rotation: torch.Tensor  # [hidden, hidden] float32
    native_layers: object = None  # the C driver's table (kvserve.model.native_q4)

    def to_tensors(self) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
        """Every tensor by name, and the integers that complete them (for the weight cache)."""
        tensors = {"rotation": self.rotation} | self.head.to_tensors("head")
        numbers = {"num_layers": len(self.layers)}
        for index, layer in enumerate(self.layers):
            prefix = f"layers.{index}"
            for name in _LAYER_WEIGHTS:
                weight = getattr(layer, name)
                tensors[f"{prefix}.{name}.packed"] = weight.packed
                if weight.bias is not None:
                    tensors[f"{prefix}.{name}.bias"] = weight.bias
                numbers[f"{prefix}.{name}.n"] = weight.out_features
                numbers[f"{prefix}.{name}.asym"] = int(weight.asym)
            for name in ("attn_norm", "mlp_norm", "qk_norm"):
                if getattr(layer, name) is not None:
                    tensors[f"{prefix}.{name}"] = getattr(layer, name)
        return tensors, numbers

    @classmethod
    def from_tensors(
        cls, tensors: dict[str, torch.Tensor], numbers: dict[str, int], config
    ) -> Q4Weights:
        """The inverse of `to_tensors` (the tensors are used where they lie: memory-mapped);
        the C layer table is rebuilt and checked against the model's shapes."""
        layers = []
        for index in range(numbers["num_layers"]):
            prefix = f"layers.{index}"
            weights = {
                name: Q4Weight(
                    tensors[f"{prefix}.{name}.packed"],
                    int(numbers[f"{prefix}.{name}.n"]),
                    bool(numbers[f"{prefix}.{name}.asym"]),
                    tensors.get(f"{prefix}.{name}.bias"),
                )
                for name in _LAYER_WEIGHTS
            }
            layers.append(
                Q4Layer(
                    **weights,
                    attn_norm=tensors[f"{prefix}.attn_norm"],
                    mlp_norm=tensors[f"{prefix}.mlp_norm"],
                    qk_norm=tensors.get(f"{prefix}.qk_norm"),
                )
            )
        weights = cls(layers, Int8Weight.from_tensors(tensors, "head"), tensors["rotation"])
        weights.native_layers = native_q4.q4_layer_table(layers, config)
        return weights

    @property
    def num_bytes(self) -> int:
        return (
            self.head.num_bytes
            + self.rotation.numel() * 4
            + sum(
                w.num_bytes
                for layer in self.layers
                for w in (layer.qkv, layer.o, layer.gate_up, layer.down)
            )
        )


_PROJECTIONS = {
    "qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "o": ("self_attn.o_proj",),
    "gate_up": ("mlp.gate_proj", "mlp.up_proj"),
    "down": ("mlp.down_proj",),
}


def unsupported(checkpoint, config, device: torch.device | None = None) -> str | None:
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
        for names in _PROJECTIONS.values()
        for name in names
    }
    if not types <= FORMATS:
        return f"its layers' weights are {'/'.join(sorted(map(str, types)))}, not all Q4_0/Q4_1"
    # The file's own reasons first: they hold on every machine.
    if not native_q4.q4_available():
        return "the CPU has no AVX512-VNNI (or no C compiler)"
    return None


def load_layers(checkpoint, config, progress=None) -> list[Q4Layer]:
    """Every layer's weights from a GGUF checkpoint whose layers are Q4_0/Q4_1 (see
    `unsupported`), packed for the kernel; the small float tensors (norms, biases) as float32."""

    def need(name: str) -> torch.Tensor:
        return require_tensor(checkpoint.get, name).float().contiguous()

    def weight(prefix: str, names: tuple[str, ...], bias: bool = False) -> Q4Weight:
        parts = [
            Blocks(
                checkpoint.tensor_type(f"{prefix}{n}.weight"),
                checkpoint.raw_rows(f"{prefix}{n}.weight"),
            )
            for n in names
        ]
        biases = torch.cat([need(f"{prefix}{n}.bias") for n in names]) if bias else None
        return Q4Weight.from_blocks(fuse(parts), biases)

    layers = []
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        qk_norm = None
        if config.qk_norm:
            qn, kn = need(p + "self_attn.q_norm.weight"), need(p + "self_attn.k_norm.weight")
            qk_norm = torch.cat(
                [qn.expand(config.num_heads, -1), kn.expand(config.num_kv_heads, -1)]
            ).contiguous()
        layers.append(
            Q4Layer(
                qkv=weight(p, _PROJECTIONS["qkv"], bias=config.attention_bias),
                o=weight(p, _PROJECTIONS["o"]),
                gate_up=weight(p, _PROJECTIONS["gate_up"]),
                down=weight(p, _PROJECTIONS["down"]),
                attn_norm=need(p + "input_layernorm.weight"),
                mlp_norm=need(p + "post_attention_layernorm.weight"),
                qk_norm=qk_norm,
            )
        )
        if progress:
            progress(1)
    return layers


def prepare(config, layers: list[Q4Layer], norm: torch.Tensor, lm_head: torch.Tensor) -> Q4Weights:
    """The 4-bit model: its layers, the int8 head and the C driver's table."""
    residual = residual_rotation(config.hidden_size)
    head = Int8Weight.quantize(residual.right(lm_head.float() * norm[None, :]))
    weights = Q4Weights(layers, head, residual.matrix().contiguous())
    weights.native_layers = native_q4.q4_layer_table(layers, config)
    return weights
