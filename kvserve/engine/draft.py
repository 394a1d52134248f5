"""The draft-model proposer of speculative decoding: a smaller model of the same vocabulary
guesses the next tokens (`{"model": NAME, "num_speculative_tokens": k}`).

The draft has its own KV cache with the target's block count and block size, addressed by the
same block ids and block tables: a block the scheduler grants a sequence covers both caches, so
reservations, growth, rollback and release need no accounting of their own. The pool's size
counts both (kvserve/model/kv_cache.py, `choose_pool_size`).

Each sequence records how many positions the draft has computed (`Sequence.draft_len`). To
guess k tokens for a decoding sequence of L tokens, the draft first computes its positions from
`min(draft_len, num_computed)` to L - 1 (catching up: the whole prompt the first time, the
last guess and the bonus token after a full accept), takes the argmax of the last row, then
runs k - 1 single-row steps on its own guesses. It writes positions up to L + k - 2, all inside
the blocks the scheduler grew for the verify chunk (positions up to L + k - 1). After the
verification, positions below the new `num_computed` hold the kept tokens, so `min(draft_len,
num_computed)` is what stays valid; a preemption resets `draft_len` to 0 (new blocks).

The draft writes a sequence's positions from 0 into its own table, including blocks it shares
with others (prefix caching, an n > 1 prompt): the same tokens at the same positions, so the
same values; and nothing is copied in the draft cache (a sequence's first draft run recomputes
its copied tail block itself).

The guesses are the draft's argmax (a point mass), which the target's verification
(`Sampler.verify`, the point-mass rule) keeps exact for greedy and sampled requests alike. A
draft whose head is in GGUF blocks picks them with a 4-bit copy of its first rows
(kvserve/model/head.py, `GuessHead`): a draft step reads less, and a rounding or a token past
the copy can only cost an accepted guess.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import NamedTuple

import torch

from kvserve.core.plan import ChunkPlan
from kvserve.model.head import GuessHead
from kvserve.model.kv_cache import KVCache


def check_same_vocabulary(target_tokenizer, draft_tokenizer, draft_name: str) -> None:
    """Refuse (ValueError) a draft whose vocabulary differs from the target's: its size, or
    the spelling of any token id."""
    target_size, draft_size = target_tokenizer.vocab_size, draft_tokenizer.vocab_size
    if target_size != draft_size:
        raise ValueError(
            f"draft model {draft_name!r} has a vocabulary of {draft_size} tokens, the target's "
            f"has {target_size} (a difference of {abs(draft_size - target_size)}): speculative "
            "decoding needs a draft of the same vocabulary"
        )
    for token_id in range(target_size):
        mine, theirs = target_tokenizer.token_bytes(token_id), draft_tokenizer.token_bytes(token_id)
        if mine != theirs:
            raise ValueError(
                f"draft model {draft_name!r} has a vocabulary of {draft_size} tokens like the "
                f"target's, but token {token_id} differs ({theirs!r} in the draft, {mine!r} in "
                "the target): speculative decoding needs a draft of the same vocabulary"
            )


class DraftRequest(NamedTuple):
    """One sequence's ask of the draft: its positions from `first` on hold `tail` (up to its
    last token), its block table, and how many guesses it wants."""

    seq_id: str
    first: int  # the first position the draft lacks
    tail: Seq[int]
    table: Seq[int]
    num_guesses: int


class DraftProposer:
    """Guesses by the draft model; runs on the device thread (`propose`)."""

    def __init__(
        self,
        model,
        kv_cache: KVCache,
        vocab_size: int,
        max_rows: int,
        guess_head: GuessHead | None = None,
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = kv_cache.block_size
        self.vocab_size = vocab_size  # guesses stay below it (the target's token ids)
        self.max_rows = max(1, max_rows)  # rows per catch-up forward pass
        self.device = model.device
        self.guess_head = guess_head  # None: the argmax of the model's logits

    def _best(self, chunks: Seq[ChunkPlan]) -> list[int]:
        """One draft forward over `chunks`: the best token of each sampling chunk's last row."""
        token_ids = [t for chunk in chunks for t in chunk.token_ids]
        ids = torch.tensor(token_ids, dtype=torch.long).to(self.device)
        meta = self.model.attention.build_metadata(chunks, self.block_size, self.kv_cache.kv.dtype)
        with torch.inference_mode():
            if self.guess_head is not None:
                rows = self.model.sampled_rows(ids, meta, self.kv_cache)
                return self.guess_head.best(rows, self.vocab_size).tolist()
            logits = self.model.forward(ids, meta, self.kv_cache)
        return logits[:, : self.vocab_size].argmax(dim=-1).tolist()

    def propose(self, requests: Seq[DraftRequest]) -> list[tuple[int, ...]]:
        """Guesses for every request together: one catch-up pass (split at `max_rows` rows),
        then one batched single-row pass per further guess."""
        guesses: list[list[int]] = [[] for _ in requests]
        # Catch-up: every sequence's missing positions, up to its last token.
        done = [0] * len(requests)  # of each request's tail
        pending = list(range(len(requests)))
        while pending:
            chunks: list[ChunkPlan] = []
            owners: list[int] = []
            rows = 0
            still: list[int] = []
            for index in pending:
                seq_id, first, tail, table, _ = requests[index]
                room = self.max_rows - rows
                if room <= 0:
                    still.append(index)
                    continue
                begin = done[index]
                end = min(len(tail), begin + room)
                last = end == len(tail)
                chunks.append(
                    ChunkPlan(
                        request_id=seq_id,
                        slot=0,
                        start=first + begin,
                        num_tokens=end - begin,
                        block_ids=table,
                        is_prefill=not last or end - begin > 1,
                        samples=last,
                        token_ids=tuple(tail[begin:end]),
                    )
                )
                owners.append(index)
                rows += end - begin
                done[index] = end
                if not last:
                    still.append(index)
            best = self._best(chunks)
            sampling = [index for chunk, index in zip(chunks, owners, strict=True) if chunk.samples]
            if sampling:
                for index, token in zip(sampling, best, strict=True):
                    guesses[index].append(int(token))
            pending = still
        # Further guesses: one row per sequence still wanting some, all in one pass.
        step = 1
        while True:
            active = [i for i, request in enumerate(requests) if request.num_guesses > step]
            if not active:
                break
            chunks = []
            for index in active:
                seq_id, first, tail, table, _ = requests[index]
                chunks.append(
                    ChunkPlan(
                        request_id=seq_id,
                        slot=0,
                        start=first + len(tail) - 1 + step,
                        num_tokens=1,
                        block_ids=table,
                        is_prefill=False,
                        samples=True,
                        token_ids=(guesses[index][-1],),
                    )
                )
            best = self._best(chunks)
            for index, token in zip(active, best, strict=True):
                guesses[index].append(int(token))
            step += 1
        return [
            tuple(g[: request.num_guesses]) for g, request in zip(guesses, requests, strict=True)
        ]
