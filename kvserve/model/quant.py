"""Int8 linear layers (`--quantization int8`): int8 weights times int8 activations on the CPU.

With AVX512-VNNI an int8 matrix product runs about twice as fast as bf16, and a decode step,
which reads every weight once, moves half the bytes. The product is a C kernel over weights
packed at load (kvserve/model/csrc/int8_gemm.c; AVX512-VNNI, or AVX2 with the same exact sums);
with neither, `torch._int_mm`, slower than float there (so `auto` does not pick int8). Each
linear layer becomes

    y = (q_x @ q_w.T) * s_x[:, None] * s_w        (int32 accumulation, exact)

with per-output-channel weight scales `s_w` fixed at load and per-row activation scales `s_x`
computed for each row from that row alone, so a row's result never depends on its batch mates.

Per-row int8 activations lose accuracy where a few channels carry outliers, as in every LLM. So,
as QuaRot does, the model is first rotated by orthogonal matrices that spread outliers over all
channels while leaving its function unchanged, all folded into the weights at load:

- the residual stream is rotated by a fixed orthogonal matrix R (x' = x R: random signs, then a
  random orthogonal mix of 64-channel groups and a 64-point Hadamard inside each): embedded rows
  are rotated as they enter, every weight that reads the residual becomes W diag(norm weight) R,
  every weight that writes it R^T W, and the rows that need logits are rotated back before the
  final norm. RMSNorm commutes with R once its weight is folded into the next product;
- each value head is rotated by a normalized Hadamard matrix (folded into v_proj, undone in
  o_proj's columns): attention outputs are weighted sums of values, so they rotate alike;
- the input of down_proj, silu(gate) * up, is rotated at run time by Walsh-Hadamard blocks
  (in the kernel that quantizes it) and the rotation undone in down_proj's columns.

The lm_head is quantized the same way (in the rotated basis, the final norm folded in) to pick
each row's 16 best candidates, which are then recomputed exactly in float32 from the float
lm_head, as the unquantized path does after its bf16 product. Measured on the default model: perplexity on an
English text (the first 1,024 tokens of a document) 32.38 against 32.22 in float32 and 32.24 in
bf16; without the rotations, 33.38. docs/serving.md has the figures for longer text.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvserve.model import native

# The rotation of the residual stream is fixed, so the same checkpoint always gives the same
# quantized weights.
ROTATION_SEED = 0x6B76
MAX_DOWN_BLOCK = 4096
# Part of the key of prepared weights cached on disk (kvserve/model/weight_cache.py): bump it
# whenever the prepared tensors change for the same checkpoint (rotation, rounding, packing).
PREPARATION_VERSION = 1
_WEIGHT_FIELDS = ("weight", "scale", "bias", "panels", "correction")
_LAYER_WEIGHTS = ("qkv", "o", "gate_up", "down")


@dataclass(slots=True)
class Int8Weight:
    weight: torch.Tensor | None  # [out, in] int8; None once packed into `panels`
    scale: torch.Tensor  # [out] float32
    bias: torch.Tensor | None  # [out] float32
    # The weight packed for the VNNI kernel (kvserve/model/csrc/int8_gemm.c), when available:
    panels: torch.Tensor | None = None
    correction: torch.Tensor | None = None

    @property
    def out_features(self) -> int:
        return self.scale.shape[0]

    @classmethod
    def quantize(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> Int8Weight:
        """Per-output-channel symmetric int8 of a float weight [out, in]."""
        weight = weight.float()
        top = weight.abs().amax(dim=1)
        scale = torch.where(top > 0, top / 127, torch.ones_like(top))
        quantized = torch.round(weight / scale[:, None]).clamp_(-127, 127).to(torch.int8)
        result = cls(
            quantized.contiguous(),
            scale.contiguous(),
            None if bias is None else bias.float().contiguous(),
        )
        if weight.shape[1] % 4 == 0 and native.int8_gemm_available():
            result.panels, result.correction = native.pack_int8_weight(quantized)
            result.weight = None
        return result

    def matmul(self, q: torch.Tensor) -> torch.Tensor:
        """q: [rows, in] int8 -> [rows, out] int32, exact."""
        if self.panels is not None:
            return native.int8_gemm(q, self.panels, self.correction, self.out_features)
        return torch._int_mm(q, self.weight.t())

    @property
    def num_bytes(self) -> int:
        tensors = [self.weight, self.scale, self.bias, self.panels, self.correction]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    def to_tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        """The tensors this weight is made of, named `prefix.field` (absent ones left out)."""
        return {
            f"{prefix}.{field}": getattr(self, field)
            for field in _WEIGHT_FIELDS
            if getattr(self, field) is not None
        }

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], prefix: str) -> Int8Weight:
        """The inverse of `to_tensors`."""
        values = {field: tensors.get(f"{prefix}.{field}") for field in _WEIGHT_FIELDS}
        if values["scale"] is None or (values["weight"] is None and values["panels"] is None):
            raise KeyError(f"prepared weight {prefix} is incomplete")
        return cls(**values)


@dataclass(slots=True)
class Int8Layer:
    qkv: Int8Weight
    o: Int8Weight
    gate_up: Int8Weight
    down: Int8Weight


@dataclass(slots=True)
class Int8Weights:
    layers: list[Int8Layer]
    rotation: torch.Tensor  # [hidden, hidden] float32: the residual stream is x @ rotation
    inverse: torch.Tensor  # rotation.T, contiguous
    down_block: int  # Walsh-Hadamard block of the down_proj input (1: none)
    head: Int8Weight  # lm_head, final norm folded in, reading the rotated residual
    # The layers described for the C driver (kvserve/model/csrc/forward_int8.c), when every
    # weight is packed for the VNNI kernel; None otherwise (the forward pass then loops here).
    native_layers: object = None

    @property
    def num_bytes(self) -> int:
        total = sum(
            w.num_bytes
            for layer in self.layers
            for w in (layer.qkv, layer.o, layer.gate_up, layer.down)
        )
        total += self.head.num_bytes
        return total + 2 * self.rotation.numel() * self.rotation.element_size()

    def to_tensors(self) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
        """Every tensor by name, and the integers that complete them (for the weight cache)."""
        tensors = {"rotation": self.rotation} | self.head.to_tensors("head")
        for index, layer in enumerate(self.layers):
            for name in _LAYER_WEIGHTS:
                tensors |= getattr(layer, name).to_tensors(f"layers.{index}.{name}")
        return tensors, {"num_layers": len(self.layers), "down_block": self.down_block}

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], numbers: dict[str, int]) -> Int8Weights:
        """The inverse of `to_tensors`; the C layer table is rebuilt when every weight is
        packed (the tensors may be memory-mapped: they are used where they lie)."""
        layers = [
            Int8Layer(
                *(
                    Int8Weight.from_tensors(tensors, f"layers.{index}.{name}")
                    for name in _LAYER_WEIGHTS
                )
            )
            for index in range(numbers["num_layers"])
        ]
        rotation = tensors["rotation"]
        weights = cls(
            layers,
            rotation,
            rotation.t().contiguous(),
            int(numbers["down_block"]),
            Int8Weight.from_tensors(tensors, "head"),
        )
        weights.native_layers = _native_table(layers)
        return weights


def hadamard(n: int) -> torch.Tensor:
    """The normalized Sylvester-Hadamard matrix of order n (a power of 2): symmetric, orthogonal."""
    assert n >= 1 and n & (n - 1) == 0
    matrix = torch.ones(1, 1, dtype=torch.float64)
    while matrix.shape[0] < n:
        matrix = torch.cat([torch.cat([matrix, matrix], 1), torch.cat([matrix, -matrix], 1)])
    return matrix / n**0.5


def random_orthogonal(n: int, generator: torch.Generator) -> torch.Tensor:
    """A Haar-distributed random orthogonal matrix of order n."""
    gaussian = torch.randn(n, n, generator=generator, dtype=torch.float64)
    q, r = torch.linalg.qr(gaussian)
    return (q * torch.sign(torch.diagonal(r))[None, :]).contiguous()


@dataclass(frozen=True, slots=True)
class Rotation:
    """The orthogonal matrix diag(signs) @ kron(factors[0], factors[1], ...), kept factored so
    that applying it to a weight costs a few small products instead of one of order n^3."""

    factors: tuple[torch.Tensor | int, ...]  # float32 square matrices; an int n: identity
    signs: torch.Tensor | None = None  # [n] of +-1, float32

    @property
    def orders(self) -> list[int]:
        return [f if isinstance(f, int) else f.shape[0] for f in self.factors]

    @property
    def size(self) -> int:
        return math.prod(self.orders)

    def matrix(self) -> torch.Tensor:
        dense = torch.ones(1, 1)
        for factor in self.factors:
            dense = torch.kron(dense, torch.eye(factor) if isinstance(factor, int) else factor)
        return dense if self.signs is None else self.signs[:, None] * dense

    def right(self, weight: torch.Tensor) -> torch.Tensor:
        """weight @ M for weight [rows, n] (float32)."""
        rows, n = weight.shape
        assert n == self.size
        x = weight if self.signs is None else weight * self.signs[None, :]
        x = x.reshape(rows, *self.orders)
        for axis, factor in enumerate(self.factors, start=1):
            if not isinstance(factor, int):
                x = (x.movedim(axis, -1) @ factor).movedim(-1, axis)
        return x.reshape(rows, n)

    def left_transposed(self, weight: torch.Tensor) -> torch.Tensor:
        """M^T @ weight for weight [n, cols] (float32)."""
        return self.right(weight.t().contiguous()).t()


def _power_of_two_factors(n: int) -> list[torch.Tensor]:
    """Hadamard factors of order <= 64 whose Kronecker product is the Hadamard of order n."""
    factors = []
    while n > 1:
        order = min(n, 64)
        factors.append(hadamard(order).float())
        n //= order
    return factors


def residual_rotation(hidden: int, seed: int = ROTATION_SEED) -> Rotation:
    """diag(random signs) @ kron(random orthogonal of the odd part, Hadamard of the power of 2):
    with hidden = 576 = 9 * 64, a random 9x9 block structure times a 64-point Hadamard."""
    generator = torch.Generator().manual_seed(seed)
    power = hidden & -hidden
    odd = hidden // power
    factors = [] if odd == 1 else [random_orthogonal(odd, generator).float()]
    factors += _power_of_two_factors(power) or [1]
    signs = (torch.randint(0, 2, (hidden,), generator=generator) * 2 - 1).float()
    return Rotation(tuple(factors), signs)


def block_hadamard(n: int, block: int) -> Rotation:
    """Normalized Hadamard blocks of order `block` along the diagonal (identity when block is 1)."""
    return Rotation((n // block, *_power_of_two_factors(block)))


def down_block(intermediate: int) -> int:
    """The largest power of 2 dividing `intermediate`, at most MAX_DOWN_BLOCK."""
    block = 1
    while intermediate % (block * 2) == 0 and block * 2 <= MAX_DOWN_BLOCK:
        block *= 2
    return block


@dataclass(slots=True)
class RotatedLayer:
    qkv: torch.Tensor  # [q + 2 kv, hidden] float32, attention norm folded in
    qkv_bias: torch.Tensor | None
    o: torch.Tensor  # [hidden, q]
    gate_up: torch.Tensor  # [2 intermediate, hidden], MLP norm folded in
    down: torch.Tensor  # [hidden, intermediate], expects its input rotated by down blocks


def rotate_layer(config, layer, residual: Rotation, down_block_size: int) -> RotatedLayer:
    """One layer's weights in the rotated basis (float32), norms folded into the products that
    follow them. `layer` is a kvserve.model.llama.LayerWeights."""
    head_dim, q_size, kv_size = config.head_dim, config.q_size, config.kv_size
    intermediate = config.intermediate_size
    head_block = head_dim if head_dim & (head_dim - 1) == 0 else 1
    per_head = block_hadamard(kv_size, head_block)
    split = q_size + kv_size
    qkv = layer.qkv.float() * layer.attn_norm[None, :]
    # values v W_v^T become v W_v^T H: rotate the v rows of each head
    values = per_head.left_transposed(qkv[split:])
    qkv = residual.right(torch.cat([qkv[:split], values]))
    bias = None
    if layer.qkv_bias is not None:
        bias = layer.qkv_bias.float().clone()
        bias[split:] = per_head.right(bias[None, split:])[0]
    # o_proj's columns undo each query head's rotation (H is symmetric, H H = I)
    o_weight = block_hadamard(q_size, head_block).right(layer.o.float())
    o_weight = residual.left_transposed(o_weight)
    gate_up = residual.right(layer.gate_up.float() * layer.mlp_norm[None, :])
    down = block_hadamard(intermediate, down_block_size).right(layer.down.float())
    down = residual.left_transposed(down)
    return RotatedLayer(qkv, bias, o_weight, gate_up, down)


def quantize_model(config, layers: list, norm: torch.Tensor, lm_head: torch.Tensor) -> Int8Weights:
    """Rotate and quantize a Llama-family model's layers and lm_head (see the module docstring).

    `layers` are kvserve.model.llama.LayerWeights (fused q|k|v and gate|up, HF layout). The
    embeddings are left as they are (the forward pass rotates the embedded rows, x @ rotation),
    and so is the float lm_head, which recomputes each row's best candidates exactly from the
    rows turned back (x @ rotation.T)."""
    residual = residual_rotation(config.hidden_size)
    block = down_block(config.intermediate_size)
    quantized = []
    for layer in layers:
        rotated = rotate_layer(config, layer, residual, block)
        quantized.append(
            Int8Layer(
                qkv=Int8Weight.quantize(rotated.qkv, rotated.qkv_bias),
                o=Int8Weight.quantize(rotated.o),
                gate_up=Int8Weight.quantize(rotated.gate_up),
                down=Int8Weight.quantize(rotated.down),
            )
        )
    head = Int8Weight.quantize(residual.right(lm_head.float() * norm[None, :]))
    rotation = residual.matrix().contiguous()
    weights = Int8Weights(quantized, rotation, rotation.t().contiguous(), block, head)
    weights.native_layers = _native_table(quantized)
    return weights


def _native_table(layers: list[Int8Layer]) -> object:
    """The C driver's description of the layers when every weight is packed, else None."""
    packed = [w for layer in layers for w in (layer.qkv, layer.o, layer.gate_up, layer.down)]
    if all(w.panels is not None for w in packed):
        return native.int8_layer_table(layers)
    return None
