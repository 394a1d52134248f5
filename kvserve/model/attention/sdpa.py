"""Paged attention by torch ops (CUDA, or a CPU without the C kernels).

RoPE is the half-rotation form, x * cos + rotate_half(x) * sin, on tables in the model dtype
(each layer's own: Gemma 3's windowed layers rotate with their own base). Each row's K/V is
written into the cache at its slot, then two kinds of calls attend:
- single-row chunks (decode) are batched into one attention call over block tables padded to the
  longest context, with a mask for each row's length (and its window);
- multi-row chunks (prefill) run one call each: a first chunk (start 0) attends causally to its own
  fresh K/V without touching the cache; a later chunk gathers its earlier positions from the cache
  and uses an offset causal mask.
A layer with a sliding window W masks, for a row at position p, every position before
p - W + 1; the masks are built once per step for each window the model's layers use. Where every
layer is windowed, the blocks before the block of p - W + 1 (`config.first_attended_position`)
are not gathered at all: a sequence gives those back to the pool (kvserve/core/kv_manager.py), and
its table shows a placeholder there that belongs to someone else. Soft-capped
scores (C tanh(s / C), Gemma 2) have no SDPA form: those layers attend by explicit products in
float32 (scores, cap, mask, softmax, values).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kvserve.model.attention import (
    KV_INT8_REQUIREMENTS,
    ChunkLike,
    LayerRopes,
    RopeTables,
    flatten_chunks,
)


@dataclass(slots=True)
class PrefillSegment:
    row_start: int
    num_rows: int
    start: int  # position of the first row
    # [num_blocks] long: the table from the first block any row attends to (`offset`); None
    # when start == 0 (no cache read)
    block_table: torch.Tensor | None
    # by window (None: the whole context): [num_rows, start + num_rows] bool, or None for a
    # plain causal call (start 0 and no window)
    masks: dict[int | None, torch.Tensor | None] = field(default_factory=dict)
    offset: int = 0  # the position `block_table` starts at (its masks' first column)


@dataclass(slots=True)
class TorchAttentionMetadata:
    """What the torch path reads of one step, built once and shared by all layers."""

    num_rows: int
    slot_mapping: torch.Tensor  # [rows] long: flat cache slot of each row
    positions: torch.Tensor  # [rows] long
    logits_indices: torch.Tensor  # [sampling chunks] long: the last row of each sampling chunk
    segments: list[PrefillSegment]
    decode_rows: slice | torch.Tensor | None  # rows of single-row chunks (a slice when contiguous)
    # [decode rows, max blocks] long: each row's table from the first block it attends to
    decode_block_tables: torch.Tensor | None
    decode_lengths: torch.Tensor | None  # [decode rows] long: its positions in that table
    # by window: [decode rows, 1, max blocks * block_size] bool, True where the row attends
    decode_masks: dict[int | None, torch.Tensor] = field(default_factory=dict)

    @property
    def decode_mask(self) -> torch.Tensor | None:
        """The decode rows' mask without a window."""
        return self.decode_masks.get(None)


def _prefill_mask(n: int, start: int, window: int | None) -> torch.Tensor | None:
    """[n, start + n] bool: row i (position start + i) sees positions start + i - W + 1 ..
    start + i; None for the plain causal case (start 0, no window)."""
    if start == 0 and window is None:
        return None
    mask = torch.ones(n, start + n, dtype=torch.bool).tril(diagonal=start)
    if window is not None:
        mask &= torch.ones(n, start + n, dtype=torch.bool).triu(diagonal=start - window + 1)
    return mask


class TorchPagedAttention:
    """Paged attention over a cache in the model dtype, by torch ops."""

    name = "torch-sdpa"
    supports_int8_cache = False

    def __init__(
        self, config, dtype: torch.dtype, device: torch.device, ropes: LayerRopes | RopeTables
    ) -> None:
        if isinstance(ropes, RopeTables):
            ropes = LayerRopes(ropes, (ropes,) * config.num_layers)
        self.config = config
        self.dtype = dtype
        self.device = device
        self.ropes = ropes
        self.rope = ropes.rope
        self.scale = config.attention_scale
        self.windows = config.layer_windows
        self.softcap = config.attn_logit_softcapping
        # Half rotation: x*cos + rotate_half(x)*sin, with rotate_half(x) = [-x2, x1]. Written as
        # x*cos + roll(x, half)*sin_signed where sin_signed = [-sin, sin]: one op fewer per layer.
        tables: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.layer_tables = []
        for rope in ropes.layers:
            if id(rope) not in tables:
                cos, sin = rope.cos_half, rope.sin_half
                tables[id(rope)] = (
                    torch.cat([cos, cos], dim=-1).to(device, dtype),
                    torch.cat([-sin, sin], dim=-1).to(device, dtype),
                )
            self.layer_tables.append(tables[id(rope)])
        self.rope_cos, self.rope_sin = self.layer_tables[0] if self.layer_tables else (None, None)

    def build_metadata(
        self,
        chunks: Sequence[ChunkLike],
        block_size: int,
        cache_dtype: torch.dtype | None = None,  # the same metadata for every cache
    ) -> TorchAttentionMetadata:
        device = self.device
        windows = sorted(set(self.windows), key=lambda w: -1 if w is None else w)
        slots, positions, _, tables, logits_rows = flatten_chunks(chunks, block_size)
        segments: list[PrefillSegment] = []
        decode_row_ids: list[int] = []
        decode_tables: list[Sequence[int]] = []
        decode_lengths: list[int] = []
        row = 0
        first_attended = self.config.first_attended_position
        for chunk, used in zip(chunks, tables, strict=True):
            n, start = chunk.num_tokens, chunk.start
            end = start + n
            row += n
            # Blocks wholly before the window of the chunk's first row are never read.
            skip = first_attended(start) // block_size
            offset = skip * block_size
            if n == 1:
                decode_row_ids.append(row - 1)
                decode_tables.append(used[skip:])
                decode_lengths.append(end - offset)
                continue
            masks = {}
            for window in windows:
                mask = _prefill_mask(n, start, window)
                if mask is not None:
                    mask = mask[:, offset:].contiguous().to(device, non_blocking=True)
                masks[window] = mask
            table = None
            if start > 0:
                table = torch.tensor(used[skip:], dtype=torch.long).to(device, non_blocking=True)
            segments.append(PrefillSegment(row - n, n, start, table, masks, offset))
        decode_rows: slice | torch.Tensor | None = None
        decode_block_tables = decode_lengths_t = None
        decode_masks: dict[int | None, torch.Tensor] = {}
        if decode_row_ids:
            first = decode_row_ids[0]
            if decode_row_ids == list(range(first, first + len(decode_row_ids))):
                decode_rows = slice(first, first + len(decode_row_ids))
            else:
                decode_rows = torch.tensor(decode_row_ids, dtype=torch.long, device=device)
            width = max(len(t) for t in decode_tables)
            padded = [list(t) + [0] * (width - len(t)) for t in decode_tables]
            decode_block_tables = torch.tensor(padded, dtype=torch.long).to(
                device, non_blocking=True
            )
            lengths = torch.tensor(decode_lengths, dtype=torch.long)
            decode_lengths_t = lengths.to(device, non_blocking=True)
            span = torch.arange(width * block_size)
            for window in windows:
                # [D, 1, L] True where the position exists in that row's sequence (and window)
                mask = span[None, :] < lengths[:, None]
                if window is not None:
                    mask &= span[None, :] >= lengths[:, None] - window
                decode_masks[window] = mask[:, None, :].to(device, non_blocking=True)
        return TorchAttentionMetadata(
            num_rows=len(positions),
            slot_mapping=torch.tensor(slots, dtype=torch.long).to(device, non_blocking=True),
            positions=torch.tensor(positions, dtype=torch.long).to(device, non_blocking=True),
            logits_indices=torch.tensor(logits_rows, dtype=torch.long).to(
                device, non_blocking=True
            ),
            segments=segments,
            decode_rows=decode_rows,
            decode_block_tables=decode_block_tables,
            decode_lengths=decode_lengths_t,
            decode_masks=decode_masks,
        )

    def check_step(self, meta: TorchAttentionMetadata, kv_cache, num_rows: int) -> None:
        if kv_cache.quantized:
            raise ValueError(KV_INT8_REQUIREMENTS)
        if not isinstance(meta, TorchAttentionMetadata):
            raise ValueError(f"{type(meta).__name__} is not this backend's metadata")

    def forward(
        self, qkv: torch.Tensor, layer: int, meta: TorchAttentionMetadata, kv_cache
    ) -> torch.Tensor:
        cfg = self.config
        rows, heads, kv_heads, head_dim = (
            qkv.shape[0],
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
        )
        qk_size = cfg.q_size + cfg.kv_size
        rope_cos, rope_sin = self.layer_tables[layer]
        # cos, sin: [rows, 1, head_dim]
        cos = rope_cos[meta.positions].unsqueeze(1)
        sin = rope_sin[meta.positions].unsqueeze(1)
        qk = qkv[:, :qk_size].view(rows, heads + kv_heads, head_dim)
        qk = torch.addcmul(qk * cos, qk.roll(head_dim // 2, dims=-1), sin)
        v = qkv[:, qk_size:].view(rows, kv_heads, head_dim)
        return paged_attention(
            qk[:, :heads],
            qk[:, heads:],
            v,
            kv_cache.layer(layer),
            meta,
            self.scale,
            window=self.windows[layer],
            softcap=self.softcap,
        )


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    softcap: float | None,
    group: int,
) -> torch.Tensor:
    """Attention of q [..., heads, n, d] over k, v [..., heads / group, L, d]; mask broadcast
    to [..., heads, n, L] (True: attended), None: causal (n == L). With a soft cap, by explicit
    products in float32, the scores capped before the mask and the softmax."""
    if softcap is None:
        causal = mask is None
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=group > 1
        )
    if group > 1:
        k, v = k.repeat_interleave(group, dim=-3), v.repeat_interleave(group, dim=-3)
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    if mask is None:
        n, length = scores.shape[-2], scores.shape[-1]
        mask = torch.ones(n, length, dtype=torch.bool, device=q.device).tril(length - n)
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(scores.softmax(dim=-1), v.float()).to(q.dtype)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_layer: torch.Tensor,
    meta: TorchAttentionMetadata,
    scale: float,
    *,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Write this step's K/V into the cache, then attend. Returns `[rows, heads * head_dim]`.

    q: [rows, heads, head_dim]; k, v: [rows, kv_heads, head_dim];
    kv_layer: [2, kv_heads, num_blocks, block_size, head_dim] (this layer's cache).
    """
    rows, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    group = num_heads // num_kv_heads
    _, _, num_blocks, block_size, _ = kv_layer.shape
    # flat: [2, kv_heads, num_blocks * block_size, head_dim]
    flat = kv_layer.view(2, num_kv_heads, num_blocks * block_size, head_dim)
    flat[0].index_copy_(1, meta.slot_mapping, k.transpose(0, 1))
    flat[1].index_copy_(1, meta.slot_mapping, v.transpose(0, 1))

    out = torch.empty(rows, num_heads, head_dim, dtype=q.dtype, device=q.device)
    for seg in meta.segments:
        rows_of = slice(seg.row_start, seg.row_start + seg.num_rows)
        # SDPA's fused CPU kernel wants 4-D [batch, heads, n, head_dim]; 3-D falls back to
        # the unfused math path (about 2.5x slower here).
        qs = q[rows_of].transpose(0, 1).unsqueeze(0)  # [1, heads, n, head_dim]
        if seg.block_table is None:
            ks = k[rows_of].transpose(0, 1).unsqueeze(0)  # [1, kv_heads, n, head_dim]
            vs = v[rows_of].transpose(0, 1).unsqueeze(0)
        else:
            length = seg.start + seg.num_rows - seg.offset
            # gathered: [2, kv_heads, length, head_dim], from position seg.offset
            gathered = kv_layer[:, :, seg.block_table].flatten(2, 3)[:, :, :length]
            ks, vs = gathered[0].unsqueeze(0), gathered[1].unsqueeze(0)
        out[rows_of] = attend(qs, ks, vs, seg.masks[window], scale, softcap, group)[0].transpose(
            0, 1
        )

    if meta.decode_rows is not None:
        rows_of = meta.decode_rows
        out[rows_of] = _decode_torch(
            q[rows_of], kv_layer, meta, scale, group, meta.decode_masks[window], softcap
        )
    return out.view(rows, num_heads * head_dim)


def _decode_torch(
    q: torch.Tensor,
    kv_layer: torch.Tensor,
    meta: TorchAttentionMetadata,
    scale: float,
    group: int,
    mask: torch.Tensor,
    softcap: float | None,
) -> torch.Tensor:
    """Single-row chunks with torch ops: gather each sequence's blocks, one masked call."""
    num_decode, num_heads, head_dim = q.shape
    num_kv_heads = num_heads // group
    # gathered: [2, kv_heads, D, L, head_dim] with L = max blocks * block_size
    gathered = kv_layer[:, :, meta.decode_block_tables].flatten(3, 4)
    # The `group` query heads sharing a KV head become that head's query rows: [kv_heads, D, group, hd]
    qd = q.reshape(num_decode, num_kv_heads, group, head_dim).transpose(0, 1)
    od = attend(qd, gathered[0], gathered[1], mask, scale, softcap, 1)
    return od.transpose(0, 1).reshape(num_decode, num_heads, head_dim)
