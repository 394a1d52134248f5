"""Paged attention over a flat batch of rows drawn from many sequences.

A step's rows are the concatenation of chunks, one chunk per sequence: a prefill chunk (several
consecutive prompt positions) or a decode row (one position). Every row's K/V is first written
into the paged cache at its slot; then each row attends to its own sequence's positions
`0 .. its position`, read back through the sequence's block table. Sequences never see each other:
masks and block tables are per sequence.

On the CPU (fp32/bf16) a C kernel handles every row alike, reading K/V straight out of the
cache through the row's block table; causality is each row's length. Elsewhere (CUDA, or when
the kernel cannot be built) torch ops do it, two ways:
- single-row chunks (decode) are batched into one attention call over block tables padded to the
  longest context, with a mask for each row's length;
- multi-row chunks (prefill) run one call each: a first chunk (start 0) attends causally to its own
  fresh K/V without touching the cache; a later chunk gathers its earlier positions from the cache
  and uses an offset causal mask.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F


class ChunkLike(Protocol):
    """What the model needs to know about one sequence's rows in a step (all integers)."""

    start: int  # position of the chunk's first row
    num_tokens: int
    block_ids: Sequence[int]  # the sequence's block table
    samples: bool  # the chunk's last row needs logits


@dataclass(slots=True)
class PrefillSegment:
    row_start: int
    num_rows: int
    start: int  # position of the first row
    block_table: torch.Tensor | None  # [num_blocks] long; None when start == 0 (no cache read)
    mask: torch.Tensor | None  # [num_rows, start + num_rows] bool; None when start == 0


@dataclass(slots=True)
class AttentionMetadata:
    """Everything attention needs for one step, built once and shared by all layers."""

    num_rows: int
    slot_mapping: torch.Tensor  # [rows] long: flat cache slot of each row
    positions: torch.Tensor  # [rows] long
    segments: list[PrefillSegment]
    decode_rows: slice | torch.Tensor | None  # rows of single-row chunks (a slice when contiguous)
    decode_block_tables: torch.Tensor | None  # [decode rows, max blocks] long
    decode_lengths: torch.Tensor | None  # [decode rows] long: positions each row attends to
    decode_mask: torch.Tensor | None  # [decode rows, 1, max blocks * block_size] bool
    logits_indices: torch.Tensor  # [sampling chunks] long: the last row of each sampling chunk
    # For the C kernel, which handles every row alike (see kvserve/model/native.py):
    chunk_tables: torch.Tensor  # [chunks, max blocks] long: each chunk's block table, padded
    row_tables: torch.Tensor  # [rows] long: the chunk (table) of each row
    row_lengths: torch.Tensor  # [rows] long: positions each row attends to (its position + 1)
    torch_path: bool = True  # whether the fields the torch path needs were built


def build_metadata(
    chunks: Sequence[ChunkLike], block_size: int, device: torch.device, *, native: bool = False
) -> AttentionMetadata:
    """Turn a step's chunks (in row order) into index tensors for the forward pass.

    With `native`, only what the C kernel reads is built (no per-chunk masks or padded decode
    tables); the model must then take the native path.
    """
    slots: list[int] = []
    row_tables: list[int] = []
    chunk_tables: list[Sequence[int]] = []
    positions: list[int] = []
    segments: list[PrefillSegment] = []
    decode_row_ids: list[int] = []
    decode_tables: list[Sequence[int]] = []
    decode_lengths: list[int] = []
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
        chunk_tables.append(table[: (end + block_size - 1) // block_size])
        if chunk.samples:
            logits_rows.append(row + n - 1)
        row += n
        if native:
            continue
        if n == 1:
            decode_row_ids.append(row - 1)
            decode_tables.append(table[: (end + block_size - 1) // block_size])
            decode_lengths.append(end)
        elif start == 0:
            segments.append(PrefillSegment(row - n, n, 0, None, None))
        else:
            used = table[: (end + block_size - 1) // block_size]
            # row i (position start+i) sees cache positions j <= start + i
            mask = torch.ones(n, end, dtype=torch.bool).tril(diagonal=start)
            segments.append(
                PrefillSegment(
                    row - n,
                    n,
                    start,
                    torch.tensor(used, dtype=torch.long).to(device, non_blocking=True),
                    mask.to(device, non_blocking=True),
                )
            )

    decode_rows: slice | torch.Tensor | None = None
    decode_block_tables = decode_lengths_t = decode_mask = None
    if decode_row_ids:
        first = decode_row_ids[0]
        if decode_row_ids == list(range(first, first + len(decode_row_ids))):
            decode_rows = slice(first, first + len(decode_row_ids))
        else:
            decode_rows = torch.tensor(decode_row_ids, dtype=torch.long, device=device)
        width = max(len(t) for t in decode_tables)
        padded = [list(t) + [0] * (width - len(t)) for t in decode_tables]
        decode_block_tables = torch.tensor(padded, dtype=torch.long).to(device, non_blocking=True)
        lengths = torch.tensor(decode_lengths, dtype=torch.long)
        decode_lengths_t = lengths.to(device, non_blocking=True)
        span = torch.arange(width * block_size)
        # decode_mask: [D, 1, L] True where the position exists in that row's sequence
        decode_mask = (span[None, :] < lengths[:, None])[:, None, :].to(device, non_blocking=True)
    width = max((len(t) for t in chunk_tables), default=1)
    padded_tables = [list(t) + [0] * (width - len(t)) for t in chunk_tables]
    positions_t = torch.tensor(positions, dtype=torch.long)
    return AttentionMetadata(
        num_rows=row,
        slot_mapping=torch.tensor(slots, dtype=torch.long).to(device, non_blocking=True),
        positions=positions_t.to(device, non_blocking=True),
        segments=segments,
        decode_rows=decode_rows,
        decode_block_tables=decode_block_tables,
        decode_lengths=decode_lengths_t,
        decode_mask=decode_mask,
        logits_indices=torch.tensor(logits_rows, dtype=torch.long).to(device, non_blocking=True),
        chunk_tables=torch.tensor(padded_tables, dtype=torch.long)
        .view(len(padded_tables), width)
        .to(device, non_blocking=True),
        row_tables=torch.tensor(row_tables, dtype=torch.long).to(device, non_blocking=True),
        row_lengths=(positions_t + 1).to(device, non_blocking=True),
        torch_path=not native,
    )


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_layer: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    native: bool = False,
    store: bool = True,
    kv_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """Write this step's K/V into the cache (unless `store` is False: the caller already
    did), then attend. Returns `[rows, heads * head_dim]`.

    q: [rows, heads, head_dim]; k, v: [rows, kv_heads, head_dim];
    kv_layer: [2, kv_heads, num_blocks, block_size, head_dim] (this layer's cache).
    `native` selects the C kernel (CPU, fp32/bf16) for every row. An int8 cache (`kv_scales`
    given) is native only, and written by the caller (native.rope_store).
    """
    rows, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    group = num_heads // num_kv_heads
    _, _, num_blocks, block_size, _ = kv_layer.shape
    if kv_scales is not None and (store or not native):
        raise ValueError("the int8 KV cache is written and read by the CPU kernels only")
    # flat: [2, kv_heads, num_blocks * block_size, head_dim]
    if store:
        flat = kv_layer.view(2, num_kv_heads, num_blocks * block_size, head_dim)
        flat[0].index_copy_(1, meta.slot_mapping, k.transpose(0, 1))
        flat[1].index_copy_(1, meta.slot_mapping, v.transpose(0, 1))

    out = torch.empty(rows, num_heads, head_dim, dtype=q.dtype, device=q.device)
    if native:
        from kvserve.model import native as kernels

        kernels.paged_attention(
            q,
            kv_layer,
            meta.chunk_tables,
            meta.row_lengths,
            out,
            scale,
            meta.row_tables,
            kv_scales=kv_scales,
        )
        return out.view(rows, num_heads * head_dim)
    if not meta.torch_path:
        raise ValueError("metadata was built for the native kernel only")
    for seg in meta.segments:
        rows_of = slice(seg.row_start, seg.row_start + seg.num_rows)
        # SDPA's fused CPU kernel wants 4-D [batch, heads, n, head_dim]; 3-D falls back to
        # the unfused math path (about 2.5x slower here).
        qs = q[rows_of].transpose(0, 1).unsqueeze(0)  # [1, heads, n, head_dim]
        if seg.block_table is None:
            ks = k[rows_of].transpose(0, 1).unsqueeze(0)  # [1, kv_heads, n, head_dim]
            vs = v[rows_of].transpose(0, 1).unsqueeze(0)
            mask, causal = None, True
        else:
            length = seg.start + seg.num_rows
            # gathered: [2, kv_heads, length, head_dim]
            gathered = kv_layer[:, :, seg.block_table].flatten(2, 3)[:, :, :length]
            ks, vs = gathered[0].unsqueeze(0), gathered[1].unsqueeze(0)
            mask, causal = seg.mask, False
        out[rows_of] = F.scaled_dot_product_attention(
            qs, ks, vs, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=group > 1
        )[0].transpose(0, 1)

    if meta.decode_rows is not None:
        rows_of = meta.decode_rows
        out[rows_of] = _decode_torch(q[rows_of], kv_layer, meta, scale, group)
    return out.view(rows, num_heads * head_dim)


def _decode_torch(
    q: torch.Tensor, kv_layer: torch.Tensor, meta: AttentionMetadata, scale: float, group: int
) -> torch.Tensor:
    """Single-row chunks with torch ops: gather each sequence's blocks, one masked SDPA call."""
    num_decode, num_heads, head_dim = q.shape
    num_kv_heads = num_heads // group
    # gathered: [2, kv_heads, D, L, head_dim] with L = max blocks * block_size
    gathered = kv_layer[:, :, meta.decode_block_tables].flatten(3, 4)
    # The `group` query heads sharing a KV head become that head's query rows: [kv_heads, D, group, hd]
    qd = q.reshape(num_decode, num_kv_heads, group, head_dim).transpose(0, 1)
    od = F.scaled_dot_product_attention(
        qd, gathered[0], gathered[1], attn_mask=meta.decode_mask, scale=scale
    )
    return od.transpose(0, 1).reshape(num_decode, num_heads, head_dim)
