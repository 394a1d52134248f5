"""Every configuration through the engine at the shapes that break kernels: 64 rows in a step,
prefill chunks that end in the middle of a block, every block size the CLI accepts, and a
context filled to its last position."""

from __future__ import annotations

import asyncio

import pytest

from kvserve.config import BLOCK_SIZES, CacheConfig, EngineConfig, SchedulerConfig
from tests.configurations import params
from tests.engine.helpers import collect, request, run_engine, tokens_of

pytestmark = pytest.mark.slow

PROMPTS = {
    length: [2000 + (11 * i + length) % 9000 for i in range(length)] for length in (1, 33, 513)
}


@pytest.fixture(params=params())
def configuration(request):
    configuration = request.param
    return configuration, request.getfixturevalue(configuration.model_fixture)


def config(
    kv_cache_dtype, *, block_size=32, blocks=160, slots=8, chunk=512, rows=2048, model_len=2048
):
    return EngineConfig(
        cache=CacheConfig(
            block_size=block_size, num_kv_blocks=blocks, kv_cache_dtype=kv_cache_dtype
        ),
        scheduler=SchedulerConfig(
            max_num_seqs=slots,
            max_model_len=model_len,
            prefill_chunk=chunk,
            max_num_batched_tokens=rows,
        ),
    )


def answers(loaded, engine_config, prompts, max_tokens=6, record_steps=False):
    """Greedy answers to every prompt, submitted together; the engine is idle afterwards."""

    async def body(engine):
        streams = [
            engine.submit(request(p, max_tokens=max_tokens, temperature=0, ignore_eos=True))
            for p in prompts
        ]
        results = await asyncio.gather(*(collect(s) for s in streams))
        for _ in range(100):
            if engine.is_idle():
                break
            await asyncio.sleep(0.01)
        assert engine.is_idle()
        steps = list(engine.step_log) if engine.step_log is not None else []
        return [tokens_of(r) for r in results], [r[-1].finish_reason for r in results], steps

    return run_engine(loaded, engine_config, body, record_steps=record_steps)


def test_sixty_four_rows_in_one_step(configuration):
    configuration, loaded = configuration
    prompts = [[3000 + i * 17 + j for j in range(1 + i % 40)] for i in range(64)]
    tokens, reasons, steps = answers(
        loaded,
        config(configuration.kv_cache_dtype, slots=64, blocks=200),
        prompts,
        record_steps=True,
    )
    assert reasons == ["length"] * 64
    assert all(len(t) == 6 for t in tokens)
    assert max(len(s.chunks) for s in steps) == 64  # one step ran every sequence's row
    # A single row alone gives the same answer where rows are independent of their batch.
    if configuration.exact:
        alone, _, _ = answers(loaded, config(configuration.kv_cache_dtype), prompts[5:6])
        assert alone[0] == tokens[5]


def test_chunks_that_end_in_the_middle_of_a_block(configuration):
    configuration, loaded = configuration
    prompts = list(PROMPTS.values())
    whole, _, _ = answers(loaded, config(configuration.kv_cache_dtype), prompts)
    # 100-token chunks and 150 rows a step: chunks start and end inside blocks.
    cut, reasons, steps = answers(
        loaded,
        config(configuration.kv_cache_dtype, chunk=100, rows=150),
        prompts,
        record_steps=True,
    )
    assert reasons == ["length"] * len(prompts)
    starts = {start for s in steps for (_, start, _, prefill) in s.chunks if prefill}
    assert any(start % 32 for start in starts), starts
    if configuration.exact:
        assert cut == whole


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_every_block_size(configuration, block_size):
    configuration, loaded = configuration
    prompts = list(PROMPTS.values())
    blocks = 3 * (-(-600 // block_size))
    tokens, reasons, _ = answers(
        loaded, config(configuration.kv_cache_dtype, block_size=block_size, blocks=blocks), prompts
    )
    assert reasons == ["length"] * len(prompts)
    if configuration.exact and block_size != 32:
        reference, _, _ = answers(loaded, config(configuration.kv_cache_dtype), prompts)
        assert tokens == reference


def test_a_context_filled_to_its_last_position(configuration):
    """Prompt and answer take every position of the context (1,024 here: the 33rd block's
    last slot); one more position is refused at the door."""
    from kvserve.request import InvalidRequest

    configuration, loaded = configuration
    prompt = [2000 + (5 * i) % 9000 for i in range(1000)]
    engine_config = config(configuration.kv_cache_dtype, model_len=1024, blocks=40)
    tokens, reasons, _ = answers(loaded, engine_config, [prompt], max_tokens=24)
    assert reasons == ["length"] and len(tokens[0]) == 24

    async def too_long(engine):
        with pytest.raises(InvalidRequest):
            engine.submit(request(prompt, max_tokens=25))
        return engine.is_idle()

    assert run_engine(loaded, engine_config, too_long)
