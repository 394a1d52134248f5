"""The logits heads: the final norm and the lm_head product for the rows that sample.

With low-precision products (bf16 weights, or an int8 head) the full-vocabulary product is
rounded (bf16 keeps 8 bits: steps of 0.125 around logit 20), so the few best candidates of each
row are recomputed exactly in float32 from the float lm_head. Greedy choices and the head of
the distribution are then as exact as the weights allow, for the cost of a [rows, k] product.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvserve.model import device_thread
from kvserve.model.kernels import CpuKernels
from kvserve.model.linear.float import FloatLinear
from kvserve.model.linear.int8 import Int8Linear

# Candidates per row whose logits are recomputed in float32 when the product is rounded.
REFINE_TOP_K = 16


def soft_cap(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """tanh(logits / cap) * cap in place (Gemma 2's final soft cap; None: as they are). It is
    monotonic, so the refined candidates stay each row's best."""
    if cap is None:
        return logits
    return logits.div_(cap).tanh_().mul_(cap)


def refine(
    logits: torch.Tensor, x: torch.Tensor, lm_head: torch.Tensor, kernels: CpuKernels | None
) -> torch.Tensor:
    """Recompute each row's REFINE_TOP_K best logits exactly: x [rows, hidden] float32 are
    the normalized hidden states the final norm gives (its weight applied)."""
    if kernels is not None and kernels.has("quant_ops") and logits.is_contiguous():
        top = kernels.topk_rows(logits, REFINE_TOP_K)  # [rows, k]
    else:
        top = logits.topk(REFINE_TOP_K, dim=-1).indices
    return logits.scatter_(1, top, exact_logits(lm_head[top].float(), x))


def exact_logits(weights: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Each row's candidates' logits in float32: weights [rows, k, hidden], x [rows, hidden] ->
    [rows, k]. Elementwise products summed per candidate: a row's sums never depend on the rows
    beside it (a batched matrix product's do, with the batch size)."""
    return (weights * x.unsqueeze(1)).sum(-1)


class FloatHead:
    """rmsnorm then the float lm_head (its bf16 product refined), then the soft cap if any."""

    def __init__(
        self,
        norm: torch.Tensor,
        lm_head: torch.Tensor,
        eps: float,
        kernels: CpuKernels | None,
        softcap: float | None = None,
    ) -> None:
        self.norm = norm  # [hidden] float32
        self.lm_head = lm_head  # [vocab, hidden], model dtype
        self.eps = eps
        self.softcap = softcap
        self.kernels = kernels if kernels is not None and kernels.families else None
        self.product = FloatLinear(lm_head, kernels=kernels)

    @property
    def num_bytes(self) -> int:
        return 0  # the lm_head is counted with the model's tensors

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """float32 logits [rows, vocab] of residual rows x: [rows, hidden] float32."""
        vocab, hidden = self.lm_head.shape
        if x.shape[0] == 0:  # a step whose chunks all continue a prompt samples nothing
            return x.new_empty(0, vocab, dtype=torch.float32)
        x = F.rms_norm(x, (hidden,), self.norm, self.eps)
        if self.lm_head.dtype == torch.float32:
            return soft_cap(self.product.apply(x), self.softcap)
        logits = self.product.apply(x.to(self.lm_head.dtype)).float()
        return soft_cap(refine(logits, x, self.lm_head, self.kernels), self.softcap)


class QuantizedHead:
    """An int8 head (final norm folded in, reading the rotated basis) picks each row's best
    candidates, recomputed exactly from the float lm_head. `to_head` rotates residual rows into
    the head's basis (None: they are in it already, the int8 path); `to_model` turns them back
    into the model's basis for the exact recompute (None: they are in it, the 4-bit path)."""

    def __init__(
        self,
        head: Int8Linear,
        norm: torch.Tensor,
        lm_head: torch.Tensor,
        eps: float,
        kernels: CpuKernels,
        *,
        to_head: torch.Tensor | None = None,
        to_model: torch.Tensor | None = None,
        softcap: float | None = None,
    ) -> None:
        self.head = head
        self.softcap = softcap
        self.norm = norm
        self.lm_head = lm_head
        self.eps = eps
        self.kernels = kernels
        self.to_head = to_head  # [hidden, hidden] float32
        self.to_model = to_model

    @property
    def num_bytes(self) -> int:
        """The int8 head and the rotations it reads (the float lm_head is the model's)."""
        rotations = [t for t in (self.to_head, self.to_model) if t is not None]
        return self.head.num_bytes + sum(t.numel() * t.element_size() for t in rotations)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        k = self.kernels
        vocab, hidden = self.lm_head.shape
        if x.shape[0] == 0:
            return x.new_empty(0, vocab, dtype=torch.float32)
        in_head = x if self.to_head is None else k.rotate_rows(x, self.to_head)
        in_model = x if self.to_model is None else k.rotate_rows(x, self.to_model)
        q, s = k.add_rmsnorm_q8(in_head, None, None, None, self.eps)
        logits = k.dequantize(self.head.matmul(q), s, self.head.scale, None, torch.float32)
        # The best candidates of each row, exactly, from the rows in the model's basis
        normed = F.rms_norm(in_model, (hidden,), self.norm, self.eps)
        return soft_cap(refine(logits, normed, self.lm_head, k), self.softcap)


def dequantize_rows(qtype: str, raw, rows: torch.Tensor) -> torch.Tensor:
    """The float32 rows `rows` ([n] int64) of a GGUF block-quantized weight `raw` (uint8
    [out, row bytes], a view of the mapped file): only those rows are read and decoded."""
    import numpy as np
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    picked = np.asarray(raw)[rows.cpu().numpy()]
    values = dequantize(picked, GGMLQuantizationType[qtype])
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).view(len(rows), -1)


class BlockEmbedding:
    """Token embeddings left in the file's blocks (the mapped GGUF file): each step decodes the
    rows of its tokens only, so no float copy of the table is ever in memory."""

    def __init__(self, qtype: str, raw, hidden: int) -> None:
        self.qtype = qtype
        self.raw = raw  # uint8 [vocab, row bytes], a view of the mapped file
        self.hidden = hidden

    @property
    def num_bytes(self) -> int:
        return int(self.raw.nbytes)

    def __call__(self, token_ids: torch.Tensor) -> torch.Tensor:
        """float32 [rows, hidden] for token_ids [rows] int64."""
        if token_ids.numel() == 0:
            return torch.empty(0, self.hidden, dtype=torch.float32)
        if int(token_ids.min()) < 0 or int(token_ids.max()) >= self.raw.shape[0]:
            raise ValueError("a token id outside the vocabulary")
        return dequantize_rows(self.qtype, self.raw, token_ids)


class BlockHead:
    """rmsnorm, then the lm_head in the file's blocks (the block product, 8-bit activations)
    picks each row's best candidates, recomputed exactly in float32 from the file's rows."""

    def __init__(
        self,
        head,
        norm: torch.Tensor,
        qtype: str,
        raw,
        eps: float,
        kernels,
        softcap: float | None = None,
    ) -> None:
        self.softcap = softcap
        self.head = head  # kvserve.model.linear.blocks.BlockLinear [vocab, hidden]
        self.norm = norm
        self.qtype = qtype
        self.raw = raw  # uint8 [vocab, row bytes]: the file's rows, for the exact recompute
        self.eps = eps
        self.kernels = kernels
        self._guesses: GuessHead | None = None

    @property
    def num_bytes(self) -> int:
        return self.head.num_bytes

    def guess_head(self) -> GuessHead:
        """Its 4-bit copy for a draft's guesses (GuessHead), made at the first call and kept:
        the engines sharing a loaded draft share one."""
        if self._guesses is None:
            self._guesses = GuessHead(self)
        return self._guesses

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        vocab = self.head.out_features
        if x.shape[0] == 0:
            return x.new_empty(0, vocab, dtype=torch.float32)
        normed = F.rms_norm(x, (x.shape[1],), self.norm, self.eps)
        logits = self.head.apply(self.kernels.blocks_quantize(normed))
        top = self.kernels.topk_rows(logits, REFINE_TOP_K)  # [rows, k]
        unique, inverse = torch.unique(top, return_inverse=True)
        weights = dequantize_rows(self.qtype, self.raw, unique)[inverse]  # [rows, k, hidden]
        return soft_cap(logits.scatter_(1, top, exact_logits(weights, normed)), self.softcap)


# A draft model's head (GuessHead): requantized to GUESS_QTYPE when the file's blocks take more
# bytes a value (BlockWeight.requantized), GUESS_CHUNK_ROWS vocabulary rows at a time (a float
# copy of the whole head would be 0.5 GB for a 151,936 x 896 head). Its guesses are tokens
# below GUESS_VOCAB (a multiple of 16, the packed panels' width): byte-level BPE vocabularies
# number their tokens by merge rank and SentencePiece ones by score, the common ones first.
# qwen2.5-coder:0.5b as qwen2.5-coder:1.5b's draft, k = 4, one stream (docs/benchmarks.md,
# 2026-12-07 00:07): the whole vocabulary 1.45x on the editing bench (98.1% of guesses
# accepted), the first 65,536 tokens 1.52x (95.2%), the first 32,768 1.37x (81.3%).
GUESS_QTYPE = "Q4_0"
GUESS_CHUNK_ROWS = 8192
GUESS_VOCAB = 65536


class GuessHead:
    """A draft model's head: the best token of each row, from a 4-bit copy of its lm_head's
    first GUESS_VOCAB rows.

    A draft's guesses only choose what the target verifies (kvserve/engine/draft.py): a token
    that a rounding changes, or that the copy leaves out, costs at most an accepted guess, never
    a wrong one. A small draft's head is a large part of each of its steps (Qwen2.5-Coder-0.5B:
    151,936 x 896 in Q8_0, 145 of the 484 MB a step reads), so its first 65,536 rows are
    requantized to Q4_0 (33 MB) once at load, and no candidate is recomputed exactly (the
    target's head does that for its own choices)."""

    def __init__(self, head: BlockHead) -> None:
        self.norm, self.eps, self.kernels = head.norm, head.eps, head.kernels
        self.model_product = head.head
        self.product = self._requantized(head)

    @classmethod
    def of(cls, head) -> GuessHead | None:
        """The guess head of a model's head, or None where it has none (a float or int8 head:
        the draft samples its full logits). Made on the device thread, as a load is: its
        requantization runs parallel kernels, which on another thread would start a second
        OpenMP pool (kvserve.model.device_thread)."""
        if not isinstance(head, BlockHead):
            return None
        return device_thread.call(head.guess_head)

    def _requantized(self, head: BlockHead):
        """The product of the head's first GUESS_VOCAB rows in GUESS_QTYPE, from the file's
        rows, or as they are (a view) where their blocks are no larger."""
        from kvserve.model.block_formats import PANEL
        from kvserve.model.linear.blocks import BlockLinear, BlockWeight

        (part,) = head.head.parts
        if part.out_features > GUESS_VOCAB:
            part = BlockWeight(
                part.qtype,
                GUESS_VOCAB,
                part.in_features,
                part.packed[: GUESS_VOCAB // PANEL],
                None if part.bias is None else part.bias[:GUESS_VOCAB],
                part.kernels,
            )
        weight = part.requantized(
            GUESS_QTYPE,
            lambda rows: dequantize_rows(head.qtype, head.raw, rows),
            GUESS_CHUNK_ROWS,
        )
        if weight is head.head.parts[0]:
            return head.head
        return BlockLinear((weight,))

    @property
    def num_bytes(self) -> int:
        """The bytes of its own copy (0 where it reads the model's head, or a part of it)."""
        (own,), (model,) = self.product.parts, self.model_product.parts
        return 0 if own.packed.data_ptr() == model.packed.data_ptr() else self.product.num_bytes

    def best(self, x: torch.Tensor, vocab: int) -> torch.Tensor:
        """The best token id below `vocab` (and GUESS_VOCAB) of each residual row x ([rows,
        hidden] float32): [rows] int64."""
        if x.shape[0] == 0:  # a catch-up pass whose chunks all continue a prompt
            return torch.empty(0, dtype=torch.long)
        normed = F.rms_norm(x, (x.shape[1],), self.norm, self.eps)
        logits = self.product.apply(self.kernels.blocks_quantize(normed))
        return logits[:, :vocab].argmax(dim=-1)
