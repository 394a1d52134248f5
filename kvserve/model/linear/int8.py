"""Int8 linear layers (`--quantization int8`): int8 weights times int8 activations on the CPU.

With AVX512-VNNI an int8 matrix product runs about twice as fast as bf16, and a decode step,
which reads every weight once, moves half the bytes. The product is a C kernel over weights
packed at load (kvserve/model/csrc/int8_gemm.c; AVX512-VNNI, or AVX2 with the same exact sums);
with neither, `torch._int_mm`, slower than float there (so `auto` does not pick int8). Each
linear layer becomes an `Int8Linear`:

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

Families with post-norms (Gemma 2/3: an RMSNorm on the attention and MLP outputs before they
join the residual) cannot fold those norms into a product: their weight acts after the
normalization of the product's own output. There o_proj and down_proj write the model's basis,
and one kernel (add_post_norm_q8) normalizes their output, applies the norm weight and rotates
the result into the residual basis as it adds it. For that rotation to be cheap per row, the
residual rotation of these families is `structured_rotation`: random signs, then normalized
Walsh-Hadamard blocks of the largest power of 2 dividing the width (the odd part unmixed).
Gemma's (1 + w) norms arrive as their factors (kvserve/model/families/) and fold like any other.

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

from kvserve.model.kernels import INT8_BLOCK_COLS, CpuKernels, KernelInputError

# The rotation of the residual stream is fixed, so the same checkpoint always gives the same
# quantized weights.
ROTATION_SEED = 0x6B76
MAX_DOWN_BLOCK = 4096
# Part of the key of prepared weights cached on disk (kvserve/model/weight_cache.py): bump it
# whenever the prepared tensors change for the same checkpoint (rotation, rounding, packing).
PREPARATION_VERSION = 3
_WEIGHT_FIELDS = ("weight", "scale", "bias", "panels", "correction")


def pack_int8_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Pack an int8 weight [n, k] (k a multiple of 4) for the int8 product kernel: returns the
    panels [ceil(n / 64), k / 4, 64, 4] int8 (zero columns past n) and the correction
    128 * sum_k weight[n, k] as int32, padded alike."""
    if not isinstance(weight, torch.Tensor) or weight.dtype != torch.int8 or weight.dim() != 2:
        raise KernelInputError("the weight to pack must be a 2-D int8 tensor")
    n, k = weight.shape
    if not (k % 4 == 0 and k > 0 and n > 0):
        raise KernelInputError(f"cannot pack a [{n}, {k}] weight (k % 4 != 0)")
    # Row sums in float32 are exact here (|sum| <= 127 k < 2^24 for k <= 2^17) and several
    # times faster than torch's integer reduction, which dominated packing a 1B model.
    if k > 1 << 17:
        raise KernelInputError(f"cannot pack a [{n}, {k}] weight (k > 131072)")
    blocks = -(-n // INT8_BLOCK_COLS)
    padded = torch.zeros(blocks * INT8_BLOCK_COLS, k, dtype=torch.int8)
    padded[:n] = weight
    panels = padded.view(blocks, INT8_BLOCK_COLS, k // 4, 4).permute(0, 2, 1, 3).contiguous()
    correction = (padded.float().sum(dim=1) * 128).to(torch.int32).contiguous()
    return panels, correction


class Int8Format:
    """Per-row symmetric int8 rows with their scales, made by the quant_ops kernels. The
    residual stream is in the rotated basis and the norms' weights are folded into the
    products, so `normed` takes no weight. `down_block` is the Walsh-Hadamard block that
    rotates the down product's input (`gated`, whose gate is `activation`'s); `residual_signs`
    and `residual_block` describe a structured residual rotation (`structured_rotation`), which
    `add_normed` applies to the post-norms' outputs."""

    __slots__ = ("kernels", "down_block", "activation", "residual_signs", "residual_block")

    def __init__(
        self,
        kernels: CpuKernels,
        down_block: int,
        activation: str = "silu",
        residual_signs: torch.Tensor | None = None,
        residual_block: int = 1,
    ) -> None:
        self.kernels = kernels
        self.down_block = down_block
        self.activation = activation
        self.residual_signs = residual_signs  # [hidden] float32 of +-1
        self.residual_block = residual_block

    def normed(
        self, x: torch.Tensor, delta: Int8Output | None, weight: torch.Tensor | None, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if weight is not None:
            raise ValueError("the int8 format folds norm weights into its products")
        if delta is None:
            return self.kernels.add_rmsnorm_q8(x, None, None, None, eps)
        return self.kernels.add_rmsnorm_q8(x, delta.acc, delta.row_scales, delta.col_scales, eps)

    def add_normed(
        self, x: torch.Tensor, delta: Int8Output, weight: torch.Tensor, eps: float
    ) -> None:
        """x += rmsnorm(delta) * weight, rotated into the residual basis (a post-norm)."""
        if delta.bias is not None:
            raise ValueError("a post-normed product has no bias here")
        self.kernels.add_post_norm_q8(
            x,
            delta.acc,
            delta.row_scales,
            delta.col_scales,
            weight,
            eps,
            self.residual_signs,
            self.residual_block,
        )

    def rows(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.kernels.quantize_rows(t)

    def gated(self, gate_up: Int8Output) -> tuple[torch.Tensor, torch.Tensor]:
        return self.kernels.silu_mul_q8(
            gate_up.acc,
            gate_up.row_scales,
            gate_up.col_scales,
            self.down_block,
            activation=self.activation,
        )


@dataclass(slots=True)
class Int8Output:
    """An int8 product before dequantization: y = acc * row_scales[:, None] * col_scales + bias."""

    acc: torch.Tensor  # [rows, out] int32
    row_scales: torch.Tensor  # [rows] float32
    col_scales: torch.Tensor  # [out] float32
    bias: torch.Tensor | None
    kernels: CpuKernels

    def add_to(self, x: torch.Tensor) -> None:
        if self.bias is not None:
            raise ValueError("a product added to the residual stream has no bias here")
        self.kernels.add_rmsnorm_q8(
            x, self.acc, self.row_scales, self.col_scales, 0.0, normalize=False
        )


@dataclass(slots=True)
class Int8Linear:
    """Per-output-channel symmetric int8 weights, packed for the int8 product kernel where it
    runs (else kept as [out, in] for torch._int_mm)."""

    weight: torch.Tensor | None  # [out, in] int8; None once packed into `panels`
    scale: torch.Tensor  # [out] float32
    bias: torch.Tensor | None  # [out] float32
    panels: torch.Tensor | None = None  # [ceil(out / 64), in / 4, 64, 4] int8
    correction: torch.Tensor | None = None  # [ceil(out / 64) * 64] int32
    input: Int8Format | None = None
    kernels: CpuKernels | None = None
    dtype: torch.dtype = torch.float32  # of `dense`

    @property
    def out_features(self) -> int:
        return self.scale.shape[0]

    @property
    def in_features(self) -> int:
        return self.weight.shape[1] if self.panels is None else self.panels.shape[1] * 4

    @classmethod
    def quantize(
        cls,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        kernels: CpuKernels | None = None,
        **fields,
    ) -> Int8Linear:
        """Per-output-channel symmetric int8 of a float weight [out, in], packed where the
        int8 product kernel runs."""
        weight = weight.float()
        top = weight.abs().amax(dim=1)
        scale = torch.where(top > 0, top / 127, torch.ones_like(top))
        quantized = torch.round(weight / scale[:, None]).clamp_(-127, 127).to(torch.int8)
        result = cls(
            quantized.contiguous(),
            scale.contiguous(),
            None if bias is None else bias.float().contiguous(),
            kernels=kernels,
            **fields,
        )
        if weight.shape[1] % 4 == 0 and kernels is not None and kernels.int8_gemm_isa:
            result.panels, result.correction = pack_int8_weight(quantized)
            result.weight = None
        return result

    def matmul(self, q: torch.Tensor) -> torch.Tensor:
        """q: [rows, in] int8 -> [rows, out] int32, exact."""
        if self.panels is not None:
            return self.kernels.int8_gemm(q, self.panels, self.correction, self.out_features)
        return torch._int_mm(q, self.weight.t())

    def apply(self, h: tuple[torch.Tensor, torch.Tensor]) -> Int8Output:
        q, row_scales = h
        return Int8Output(self.matmul(q), row_scales, self.scale, self.bias, self.kernels)

    def dense(self, y: Int8Output) -> torch.Tensor:
        return self.kernels.dequantize(y.acc, y.row_scales, y.col_scales, y.bias, self.dtype)

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
    def from_tensors(cls, tensors: dict[str, torch.Tensor], prefix: str, **fields) -> Int8Linear:
        """The inverse of `to_tensors`."""
        values = {field: tensors.get(f"{prefix}.{field}") for field in _WEIGHT_FIELDS}
        if values["scale"] is None or (values["weight"] is None and values["panels"] is None):
            raise KeyError(f"prepared weight {prefix} is incomplete")
        return cls(**values, **fields)


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


def structured_rotation(hidden: int, seed: int = ROTATION_SEED) -> Rotation:
    """diag(random signs) @ (normalized Hadamard blocks of `down_block(hidden)` columns): the
    residual rotation of the families with post-norms, cheap to apply to one row at run time
    (kernels.add_post_norm_q8: a sign flip and a Walsh-Hadamard transform per block)."""
    generator = torch.Generator().manual_seed(seed)
    block = down_block(hidden)
    signs = (torch.randint(0, 2, (hidden,), generator=generator) * 2 - 1).float()
    return Rotation((hidden // block, *_power_of_two_factors(block)), signs)


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


def rotate_layer(
    config,
    qkv: torch.Tensor,
    qkv_bias: torch.Tensor | None,
    o: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    attn_norm: torch.Tensor,
    mlp_norm: torch.Tensor,
    residual: Rotation,
    down_block_size: int,
    *,
    writes_residual: bool = True,
) -> RotatedLayer:
    """One layer's weights (fused q|k|v and gate|up, HF layout) in the rotated basis (float32),
    norms folded into the products that follow them. Without `writes_residual` (post-norm
    families), o_proj and down_proj keep writing the model's basis: their output is normed
    before it is rotated into the residual (Int8Format.add_normed)."""
    head_dim, q_size, kv_size = config.head_dim, config.q_size, config.kv_size
    intermediate = config.intermediate_size
    head_block = head_dim if head_dim & (head_dim - 1) == 0 else 1
    per_head = block_hadamard(kv_size, head_block)
    split = q_size + kv_size
    qkv = qkv.float() * attn_norm[None, :]
    # values v W_v^T become v W_v^T H: rotate the v rows of each head
    values = per_head.left_transposed(qkv[split:])
    qkv = residual.right(torch.cat([qkv[:split], values]))
    bias = None
    if qkv_bias is not None:
        bias = qkv_bias.float().clone()
        bias[split:] = per_head.right(bias[None, split:])[0]
    # o_proj's columns undo each query head's rotation (H is symmetric, H H = I)
    o_weight = block_hadamard(q_size, head_block).right(o.float())
    gate_up = residual.right(gate_up.float() * mlp_norm[None, :])
    down = block_hadamard(intermediate, down_block_size).right(down.float())
    if writes_residual:
        o_weight = residual.left_transposed(o_weight)
        down = residual.left_transposed(down)
    return RotatedLayer(qkv, bias, o_weight, gate_up, down)
