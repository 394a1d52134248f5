"""Paged attention backends, one chosen per model at load (`select_attention`).

A step's rows are the concatenation of chunks, one chunk per sequence: a prefill chunk (several
consecutive prompt positions) or a decode row (one position). Every row's K/V is written into
the paged cache at its slot; then each row attends to its own sequence's positions `0 .. its
position`, read back through the sequence's block table. Sequences never see each other.

A layer may attend to a sliding window only (the row's last `config.layer_window(layer)`
positions), soft-cap its scores (`config.attn_logit_softcapping`) and rotate with its own RoPE
(`LayerRopes`: Gemma 3's windowed layers); every backend implements the same semantics. Where
every layer is windowed, a sequence gives back the blocks behind its window and its table shows
a placeholder there (kvserve/core/blocks.py: `PLACEHOLDER_BLOCK`, a block someone else may hold):
every backend starts reading at the block of the window's first position, never before.

Each backend builds the metadata it reads (`build_metadata`, once per step, shared by every
layer) and does one layer's RoPE, cache write and attention (`forward`):

- `CpuPagedAttention` (kvserve/model/attention/cpu.py): the C kernels, every row alike, reading
  K/V straight out of the cache through the row's block table; float or int8 caches;
- `TorchPagedAttention` (kvserve/model/attention/sdpa.py): torch ops (CUDA, or a CPU without the
  kernels), decode rows batched into one masked call, prefill chunks one call each.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from kvserve.model.kernels import CpuKernels

KV_INT8_REQUIREMENTS = (
    "--kv-cache-dtype int8 runs on the CPU kernels (needs a C compiler, a CPU with AVX512-VNNI, "
    "float32 or bfloat16, and head_dim 64 or 128)"
)


class ChunkLike(Protocol):
    """What the model needs to know about one sequence's rows in a step (all integers)."""

    start: int  # position of the chunk's first row
    num_tokens: int
    block_ids: Sequence[int]  # the sequence's block table
    samples: bool  # the chunk's last row needs logits


@dataclass(frozen=True, slots=True)
class RopeTables:
    """RoPE's half tables: cos and sin of position * inverse frequency, times the scheme's
    attention factor (YaRN, longrope; 1 otherwise), float32 [max_positions, head_dim / 2] on
    the model's device."""

    cos_half: torch.Tensor
    sin_half: torch.Tensor

    @classmethod
    def build(
        cls,
        inverse_frequencies: list[float] | torch.Tensor,
        max_positions: int,
        device,
        attention_factor: float = 1.0,
    ) -> RopeTables:
        inv = torch.as_tensor(inverse_frequencies, dtype=torch.float32)
        angles = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv)
        cos, sin = angles.cos(), angles.sin()
        if attention_factor != 1.0:  # as transformers: cos() * attention_scaling
            cos, sin = cos * attention_factor, sin * attention_factor
        return cls(cos.contiguous().to(device), sin.contiguous().to(device))

    @property
    def max_positions(self) -> int:
        return self.cos_half.shape[0]


@dataclass(frozen=True, slots=True)
class LayerRopes:
    """The RoPE tables of every layer: the model's, and the windowed layers' own where the
    model has a local RoPE (Gemma 3). `rope` is the model's (the one-call drivers' tables)."""

    rope: RopeTables
    layers: tuple[RopeTables, ...]

    @classmethod
    def build(cls, config, device) -> LayerRopes:
        inv, factor = config.rope()
        rope = RopeTables.build(inv, config.max_position_embeddings, device, factor)
        local = rope
        if config.local_rope_theta is not None:
            inv, factor = config.rope(local=True)
            local = RopeTables.build(inv, config.max_position_embeddings, device, factor)
        layers = tuple(
            local if config.layer_uses_local_rope(i) else rope for i in range(config.num_layers)
        )
        return cls(rope, layers)


def flatten_chunks(chunks: Sequence[ChunkLike], block_size: int):
    """Per row of a step: flat cache slots, positions, the chunk (table) of each row, each
    chunk's used table, and the rows that need logits (the last row of each sampling chunk)."""
    slots: list[int] = []
    positions: list[int] = []
    row_tables: list[int] = []
    tables: list[Sequence[int]] = []
    logits_rows: list[int] = []
    row = 0
    for index, chunk in enumerate(chunks):
        n, start, table = chunk.num_tokens, chunk.start, chunk.block_ids
        end = start + n
        if len(table) * block_size < end:
            raise ValueError(f"block table of {len(table)} blocks cannot hold position {end - 1}")
        for pos in range(start, end):
            slots.append(table[pos // block_size] * block_size + pos % block_size)
        positions.extend(range(start, end))
        row_tables.extend([index] * n)
        tables.append(table[: (end + block_size - 1) // block_size])
        if chunk.samples:
            logits_rows.append(row + n - 1)
        row += n
    return slots, positions, row_tables, tables, logits_rows


class AttentionBackend(Protocol):
    """One model's paged attention: metadata per step, then RoPE + cache write + attention
    per layer."""

    name: str
    supports_int8_cache: bool
    rope: RopeTables  # the model's (layers with their own RoPE keep theirs in `ropes`)
    ropes: LayerRopes

    def build_metadata(
        self, chunks: Sequence[ChunkLike], block_size: int, cache_dtype: torch.dtype | None = None
    ):
        """The step's index tensors (row order = chunk order), on the model's device, for a KV
        cache of `cache_dtype` (None: not said). Its `logits_indices` ([sampling rows] int64)
        may be replaced by the caller."""
        ...

    def check_step(self, meta, kv_cache, num_rows: int) -> None:
        """Refuse (ValueError) a step the backend cannot run on this cache."""
        ...

    def forward(self, qkv: torch.Tensor, layer: int, meta, kv_cache) -> torch.Tensor:
        """Layer `layer`: rotate q and k of qkv ([rows, q + 2 kv], model dtype), write k and v
        into the cache, attend. Returns [rows, q] in the model dtype."""
        ...


def int8_cache_refusal(config) -> str | None:
    """Why this model cannot run on the int8 KV cache whatever the CPU (its kernels have no
    sliding window and no soft cap), None when it can."""
    if config.windowed:
        return "its kernels do not implement this model's sliding-window layers"
    if config.attn_logit_softcapping is not None:
        return "its kernels do not implement this model's attention soft-capping"
    return None


def select_attention(
    config, dtype: torch.dtype, device: torch.device, kernels: CpuKernels | None, ropes: LayerRopes
) -> AttentionBackend:
    """The C kernels where they run this model (CPU, fp32/bf16, head_dim 64 or 128), else
    torch ops."""
    from kvserve.model.attention.cpu import CpuPagedAttention
    from kvserve.model.attention.sdpa import TorchPagedAttention

    if kernels is not None and kernels.supports(
        device, dtype, config.num_heads, config.num_kv_heads, config.head_dim
    ):
        return CpuPagedAttention(config, dtype, kernels, ropes)
    return TorchPagedAttention(config, dtype, device, ropes)
