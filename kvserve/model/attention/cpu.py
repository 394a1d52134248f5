"""Paged attention by the C kernels (csrc/paged_attention.c, csrc/kv_int8.c): every row alike.

Each row reads K/V straight out of the cache through its chunk's block table; causality is
each row's length, a layer's sliding window the last positions of it (the kernel skips the
blocks before them), and its soft cap is applied in the kernel. The int8 cache kernels have
neither: a windowed or soft-capped model refuses that cache. The kernels trust the indices they are handed, so `check_step` checks every
index of a step once (kvserve.model.kernels.check_step_indices) before the first layer runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvserve.model.attention import (
    KV_INT8_REQUIREMENTS,
    ChunkLike,
    LayerRopes,
    flatten_chunks,
    int8_cache_refusal,
)
from kvserve.model.kernels import CpuKernels, check_step_indices


@dataclass(slots=True)
class CpuAttentionMetadata:
    """What the C kernels read of one step."""

    num_rows: int
    slot_mapping: torch.Tensor  # [rows] long: flat cache slot of each row
    positions: torch.Tensor  # [rows] long
    logits_indices: torch.Tensor  # [sampling chunks] long: the last row of each sampling chunk
    chunk_tables: torch.Tensor  # [chunks, max blocks] long: each chunk's block table, padded
    row_tables: torch.Tensor  # [rows] long: the chunk (table) of each row
    row_lengths: torch.Tensor  # [rows] long: positions each row attends to (its position + 1)


def rows_alone_in_verify_chunks(
    chunks: Sequence[ChunkLike], tables: list[Sequence[int]], block_size: int
) -> tuple[list[int], list[Sequence[int]]]:
    """Row tables and tables where each row of a speculative verify chunk (a decode row and its
    guesses: `draft_token_ids`) has a table entry of its own. The kernels work on consecutive
    rows of one table as a tile, and the bf16 dot-product tile sums in another order than a
    row alone (csrc/paged_attention.c); alone, each verify row is computed exactly as the decode
    row it stands for, so verification accepts exactly what decoding would have produced. The
    other chunks keep their tiles, so prefill chunks of any size still agree with each other."""
    row_tables: list[int] = []
    split: list[Sequence[int]] = []
    for chunk, table in zip(chunks, tables, strict=True):
        if getattr(chunk, "draft_token_ids", ()):
            for position in range(chunk.start, chunk.start + chunk.num_tokens):
                row_tables.append(len(split))
                split.append(table[: position // block_size + 1])
        else:
            row_tables.extend([len(split)] * chunk.num_tokens)
            split.append(table)
    return row_tables, split


class CpuPagedAttention:
    """The CPU kernels' paged attention over a float or an int8 cache."""

    name = "cpu-paged"

    def __init__(self, config, dtype: torch.dtype, kernels: CpuKernels, ropes: LayerRopes) -> None:
        self.config = config
        self.dtype = dtype
        self.kernels = kernels
        self.ropes = ropes
        self.rope = ropes.rope
        self.scale = config.attention_scale
        self.windows = config.layer_windows
        self.softcap = config.attn_logit_softcapping
        self.int8_cache_refusal = int8_cache_refusal(config)
        self.supports_int8_cache = kernels.kv_int8 and self.int8_cache_refusal is None

    def build_metadata(
        self,
        chunks: Sequence[ChunkLike],
        block_size: int,
        cache_dtype: torch.dtype | None = None,
    ) -> CpuAttentionMetadata:
        slots, positions, row_tables, tables, logits_rows = flatten_chunks(chunks, block_size)
        # Over an int8 or a float32 cache the kernels compute a tile's rows in the arithmetic of
        # rows alone (csrc/kv_int8.c, csrc/paged_attention.c): a verify chunk keeps its tile
        # and reads the cache once for all its rows. Over a bf16 one (or an unknown), each verify
        # row stands alone.
        tiles_are_rows = cache_dtype in (torch.int8, torch.float32)
        if not tiles_are_rows and any(getattr(chunk, "draft_token_ids", ()) for chunk in chunks):
            row_tables, tables = rows_alone_in_verify_chunks(chunks, tables, block_size)
        width = max((len(t) for t in tables), default=1)
        padded = [list(t) + [0] * (width - len(t)) for t in tables]
        positions_t = torch.tensor(positions, dtype=torch.long)
        return CpuAttentionMetadata(
            num_rows=len(positions),
            slot_mapping=torch.tensor(slots, dtype=torch.long),
            positions=positions_t,
            logits_indices=torch.tensor(logits_rows, dtype=torch.long),
            chunk_tables=torch.tensor(padded, dtype=torch.long).view(len(padded), width),
            row_tables=torch.tensor(row_tables, dtype=torch.long),
            row_lengths=positions_t + 1,
        )

    def check_step(self, meta: CpuAttentionMetadata, kv_cache, num_rows: int) -> None:
        if kv_cache.quantized and not self.supports_int8_cache:
            if self.int8_cache_refusal is not None:
                raise ValueError(f"--kv-cache-dtype int8: {self.int8_cache_refusal}")
            raise ValueError(KV_INT8_REQUIREMENTS)
        if not isinstance(meta, CpuAttentionMetadata):
            raise ValueError(f"{type(meta).__name__} is not this backend's metadata")
        check_step_indices(
            meta, kv_cache.num_blocks, kv_cache.block_size, self.rope.max_positions, num_rows
        )

    def forward(
        self, qkv: torch.Tensor, layer: int, meta: CpuAttentionMetadata, kv_cache
    ) -> torch.Tensor:
        cfg = self.config
        rows, heads, kv_heads, head_dim = (
            qkv.shape[0],
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
        )
        kv_layer, kv_scales = kv_cache.layer(layer), kv_cache.layer_scales(layer)
        rope = self.ropes.layers[layer]
        self.kernels.rope_store(
            qkv,
            meta.positions,
            rope.cos_half,
            rope.sin_half,
            meta.slot_mapping,
            kv_layer,
            heads,
            kv_heads,
            head_dim,
            kv_scales,
        )
        out = torch.empty(rows, heads, head_dim, dtype=qkv.dtype)
        self.kernels.paged_attention(
            qkv[:, : cfg.q_size].view(rows, heads, head_dim),
            kv_layer,
            meta.chunk_tables,
            meta.row_lengths,
            out,
            self.scale,
            meta.row_tables,
            kv_scales=kv_scales,
            window=self.windows[layer],
            softcap=self.softcap,
        )
        return out.view(rows, heads * head_dim)
