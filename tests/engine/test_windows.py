"""A model whose every layer attends to a sliding window, through the engine: each sequence
gives back the blocks behind its window as it runs, so prompts and answers many windows long
run in a pool that could never hold them, and their tokens are the model's own."""

from __future__ import annotations

import asyncio

import torch

from kvserve.engine.engine import Engine, EngineObserver
from tests.engine.helpers import make_config, request
from tests.model.helpers import greedy_continuation


class Tables(EngineObserver):
    """Each planned chunk's sequence, first position and table length."""

    def __init__(self) -> None:
        self.chunks: list[tuple[str, int, int]] = []

    def on_step(self, plan, seconds: float) -> None:
        self.chunks += [(c.request_id, c.start, len(c.block_ids)) for c in plan.chunks]


def test_answers_many_windows_long_in_a_small_pool_are_the_models_own(windowed_mistral):
    """Two prompts of 300 and 250 tokens, 100 greedy tokens each, prefilled in chunks of 64 in a
    pool of 8 blocks of 32 (256 positions, less than either request alone): both are admitted at
    once, every step holds at most each sequence's window and chunk, the tokens are those of the
    model alone with every block kept (and transformers' argmax at every position), the
    blocks behind the windows went back to the pool and the pool is whole at the end."""
    reference, loaded = windowed_mistral
    config = make_config(slots=2, blocks=8, chunk=64, rows=128, max_model_len=None)
    generator = torch.Generator().manual_seed(11)
    vocab = loaded.config.vocab_size
    prompts = [torch.randint(3, vocab, (n,), generator=generator).tolist() for n in (300, 250)]
    tables = Tables()

    async def main():
        engine = Engine(config, loaded, observer=tables)
        await engine.start()
        try:
            streams = [
                engine.submit(request(ids, max_tokens=100, temperature=0, ignore_eos=True))
                for ids in prompts
            ]
            outputs = [[t async for d in stream for t in d.token_ids] for stream in streams]
            return engine, outputs, engine.kv.num_window_freed, engine.is_idle()
        finally:
            await engine.stop()

    engine, outputs, freed, idle = asyncio.run(main())
    kv, scheduler = engine.kv, engine.scheduler
    assert kv.window == 16 and loaded.config.kv_window == 16
    for position in (0, 15, 16, 47, 48, 399):
        first = loaded.config.first_attended_position(position) // kv.block_size
        assert kv.first_needed_block(position) == first
    # The window (16) and a chunk (64) span at most 4 blocks of 32.
    assert scheduler.window_blocks == 4
    assert all(len(ids) + 100 > kv.num_blocks * kv.block_size for ids in prompts)
    assert tables.chunks
    for _, start, length in tables.chunks:  # the table after the holes
        assert length - kv.first_needed_block(start) <= scheduler.window_blocks
    for ids, tokens in zip(prompts, outputs, strict=True):
        assert tokens == greedy_continuation(loaded.model, ids, 100)
        with torch.no_grad():
            theirs = reference(torch.tensor([ids + tokens[:-1]])).logits[0, len(ids) - 1 :]
        chosen = theirs.gather(1, torch.tensor(tokens)[:, None])[:, 0]
        assert (theirs.max(dim=1).values - chosen).max().item() <= 1e-3
    # Of 400 + 350 positions' 24 blocks, all but the last few went back while they ran.
    assert freed >= kv.blocks_for(400) + kv.blocks_for(350) - 2 * scheduler.window_blocks
    assert scheduler.num_preemptions == 0
    assert idle
