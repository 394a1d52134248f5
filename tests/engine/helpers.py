"""Build engines over the session's shared model and drive them from synchronous tests."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from kvserve.config import CacheConfig, EngineConfig, QueueConfig, SchedulerConfig, StreamConfig
from kvserve.engine.engine import Engine
from kvserve.params import SamplingParams
from kvserve.request import GenerationRequest


def make_config(
    *,
    slots: int = 4,
    blocks: int = 64,
    chunk: int = 512,
    rows: int = 2048,
    queue_per_slot: int = 8,
    queue_timeout: float = 30.0,
    overtakes: int | None = None,
    buffer: int = 256,
    max_model_len: int | None = 2048,
    admission: str = "partial",
    reserve_tokens: int = 256,
    kv_cache_dtype: str = "auto",
    block_size: int = 32,
) -> EngineConfig:
    return EngineConfig(
        cache=CacheConfig(
            block_size=block_size, num_kv_blocks=blocks, kv_cache_dtype=kv_cache_dtype
        ),
        scheduler=SchedulerConfig(
            max_num_seqs=slots,
            max_model_len=max_model_len,
            max_num_batched_tokens=rows,
            prefill_chunk=chunk,
            admission=admission,
            reserve_tokens=reserve_tokens,
        ),
        queue=QueueConfig(
            max_queue_per_slot=queue_per_slot, queue_timeout=queue_timeout, max_overtakes=overtakes
        ),
        stream=StreamConfig(buffer_steps=buffer),
    )


def run_engine(
    loaded, config: EngineConfig, body: Callable[[Engine], Awaitable[Any]], record_steps=False
) -> Any:
    """Start an engine on a fresh event loop, run `body(engine)`, stop it, return the result."""

    async def main():
        engine = Engine(config, loaded, record_steps=record_steps)
        await engine.start()
        try:
            return await body(engine)
        finally:
            await engine.stop()

    return asyncio.run(main())


def request(tokens, cache_salt: str | None = None, **params) -> GenerationRequest:
    return GenerationRequest(tuple(tokens), SamplingParams(**params), cache_salt=cache_salt)


async def collect(stream):
    deltas = [d async for d in stream]
    return deltas


def tokens_of(deltas) -> list[int]:
    return [t for d in deltas for t in d.token_ids]


def text_of(deltas) -> str:
    return "".join(d.text for d in deltas)


WORDS = (
    "river",
    "stone",
    "light",
    "paper",
    "window",
    "orange",
    "quiet",
    "seven",
    "market",
    "garden",
)
"""Words whose prompts tokenize alike in every run: a test's prompts are chosen by seed."""


def words(tokenizer, count: int, seed: int) -> list[int]:
    """The token ids of `count` of `WORDS`, in an order chosen by `seed`."""
    text = " ".join(WORDS[(seed * 7 + i * 3) % len(WORDS)] for i in range(count))
    return tokenizer.encode(text)
