"""Prefix caching workloads for `make bench`: the cache on and off, in the same run, no HTTP.

- Shared prefix: one long system prompt (1,200 tokens) and distinct user turns (64 tokens),
  32 output tokens each, at 1 and at 8 concurrent. The first request of each run warms the
  cache (and is not measured), as the first user of a deployment would.
- Multi-turn chat: conversations of several turns, each turn resending the whole history (every
  earlier user turn and answer) plus a new user turn. Time to first token of the last turn
  against the first says whether the history is recomputed.

Prompts are token ids drawn from the tokenizer's own encoding of random words, so the lengths
are exact. Time to first token is measured from submit to the first delta.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from dataclasses import dataclass

from kvserve.bench.loadgen import WORDS
from kvserve.config import CacheConfig, EngineConfig, SchedulerConfig
from kvserve.engine.engine import Engine
from kvserve.model.loader import LoadedModel
from kvserve.params import SamplingParams
from kvserve.request import GenerationRequest


@dataclass(frozen=True, slots=True)
class PrefixBenchResult:
    workload: str  # "shared prefix, C=1" | "multi-turn, turn 1" ...
    cache: bool
    ttfts: tuple[float, ...]
    cached_tokens: int  # over every measured request
    run_p50s: tuple[float, ...] = ()  # each repeat's own p50, where the workload was repeated

    @property
    def p50(self) -> float:
        return statistics.median(self.ttfts)

    @property
    def p99(self) -> float:
        ordered = sorted(self.ttfts)
        return ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]


def _tokens(tokenizer, count: int, rng: random.Random) -> list[int]:
    """Exactly `count` token ids of random words."""
    ids: list[int] = []
    while len(ids) < count:
        ids += tokenizer.encode(" " + " ".join(rng.choices(WORDS, k=count)))
    return ids[:count]


def _engine(loaded: LoadedModel, cache: bool, max_num_seqs: int, kv_cache_dtype: str) -> Engine:
    config = EngineConfig(
        cache=CacheConfig(
            num_kv_blocks=max_num_seqs * 48 + 64,  # room for the workloads' longest contexts
            kv_cache_dtype=kv_cache_dtype,
            enable_prefix_caching=cache,
        ),
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_model_len=2048),
    )
    return Engine(config, loaded)


async def _ask(engine: Engine, ids: list[int], output_len: int) -> tuple[float, list[int], int]:
    """(time to first token, answer tokens, cached prompt tokens) of one greedy request."""
    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    started = time.monotonic()
    stream = engine.submit(GenerationRequest(tuple(ids), params))
    ttft = None
    tokens: list[int] = []
    cached = 0
    async for delta in stream:
        if ttft is None and delta.token_ids:
            ttft = time.monotonic() - started
        tokens += delta.token_ids
        if delta.finished:
            cached = delta.usage.cached_tokens
    return ttft or 0.0, tokens, cached


def shared_prefix(
    loaded: LoadedModel,
    concurrency: int,
    cache: bool,
    *,
    num_requests: int,
    system_len: int = 1200,
    user_len: int = 64,
    output_len: int = 32,
    kv_cache_dtype: str = "auto",
    seed: int = 0,
) -> PrefixBenchResult:
    rng = random.Random(f"shared-prefix-{seed}")
    system = _tokens(loaded.tokenizer, system_len, rng)
    prompts = [system + _tokens(loaded.tokenizer, user_len, rng) for _ in range(num_requests + 1)]

    async def main():
        engine = _engine(loaded, cache, concurrency, kv_cache_dtype)
        await engine.start()
        try:
            await _ask(engine, prompts[0], output_len)  # warm-up (and, cache on, the prefix)
            gate = asyncio.Semaphore(concurrency)

            async def one(ids):
                async with gate:
                    return await _ask(engine, ids, output_len)

            return await asyncio.gather(*(one(ids) for ids in prompts[1:]))
        finally:
            await engine.stop()

    results = asyncio.run(main())
    return PrefixBenchResult(
        f"shared prefix, C={concurrency}",
        cache,
        tuple(r[0] for r in results),
        sum(r[2] for r in results),
    )


def multi_turn(
    loaded: LoadedModel,
    cache: bool,
    *,
    conversations: int = 8,
    turns: int = 10,
    user_len: int = 64,
    output_len: int = 32,
    kv_cache_dtype: str = "auto",
    seed: int = 0,
) -> list[PrefixBenchResult]:
    """Every conversation runs its turns in order, the conversations concurrently; returns the
    first turn's and the last turn's times to first token."""
    rng = random.Random(f"multi-turn-{seed}")
    users = [
        [_tokens(loaded.tokenizer, user_len, rng) for _ in range(turns)]
        for _ in range(conversations)
    ]

    async def main():
        engine = _engine(loaded, cache, conversations, kv_cache_dtype)
        await engine.start()
        try:
            # Warm-up shaped like the first turn (every conversation at once): the process's
            # first step of that many rows pays one-off costs the first turn must not carry.
            warm = [_tokens(loaded.tokenizer, user_len, rng) for _ in range(conversations)]
            await asyncio.gather(*(_ask(engine, ids, 4) for ids in warm))

            async def conversation(turn_ids):
                history: list[int] = []
                per_turn = []
                for user in turn_ids:
                    history += user
                    ttft, answer, cached = await _ask(engine, history, output_len)
                    history += answer
                    per_turn.append((ttft, cached))
                return per_turn

            return await asyncio.gather(*(conversation(u) for u in users))
        finally:
            await engine.stop()

    runs = asyncio.run(main())
    return [
        PrefixBenchResult(
            f"multi-turn, turn {turn + 1}",
            cache,
            tuple(run[turn][0] for run in runs),
            sum(run[turn][1] for run in runs),
        )
        for turn in (0, turns - 1)
    ]


# The multi-turn workload's conversations move in step, so one run gives one sample of each
# turn: it runs this many times, the times pooled.
MULTI_TURN_RUNS = 3


def run_prefix_bench(
    loaded: LoadedModel,
    concurrencies: tuple[int, ...] = (1, 8),
    *,
    num_requests: int = 16,
    conversations: int = 8,
    turns: int = 10,
    repeats: int = MULTI_TURN_RUNS,
    kv_cache_dtype: str = "auto",
) -> list[PrefixBenchResult]:
    """Both workloads, the cache on and off, one after the other in this process; the
    multi-turn workload `repeats` times, its times pooled."""
    results = []
    for concurrency in concurrencies:
        for cache in (True, False):
            print(f"  shared prefix C={concurrency}, cache {'on' if cache else 'off'}", flush=True)
            results.append(
                shared_prefix(
                    loaded,
                    concurrency,
                    cache,
                    num_requests=max(num_requests, concurrency),
                    kv_cache_dtype=kv_cache_dtype,
                )
            )
    for cache in (True, False):
        print(f"  multi-turn, cache {'on' if cache else 'off'}, {repeats} runs", flush=True)
        runs = [
            multi_turn(
                loaded,
                cache,
                conversations=conversations,
                turns=turns,
                kv_cache_dtype=kv_cache_dtype,
                seed=seed,
            )
            for seed in range(repeats)
        ]
        for same in zip(*runs, strict=True):  # the first turn of each run, then the last
            results.append(
                PrefixBenchResult(
                    same[0].workload,
                    cache,
                    tuple(t for r in same for t in r.ttfts),
                    sum(r.cached_tokens for r in same),
                    tuple(r.p50 for r in same),
                )
            )
    return results


def format_prefix_table(results: list[PrefixBenchResult]) -> str:
    """A markdown table, and the ratios the targets are stated in."""
    lines = [
        "| workload | cache | requests | TTFT p50 | TTFT p99 | cached prompt tokens |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        lines.append(
            f"| {r.workload} | {'on' if r.cache else 'off'} | {len(r.ttfts)} | "
            f"{r.p50 * 1000:.0f} ms | {r.p99 * 1000:.0f} ms | {r.cached_tokens} |"
        )
    by_key = {(r.workload, r.cache): r for r in results}
    lines.append("")
    for (workload, cache), on in by_key.items():
        off = by_key.get((workload, False))
        if cache and off is not None and off.p50 > 0:
            lines.append(
                f"{workload}: TTFT p50 with the cache / without = {on.p50 / off.p50:.2f}.  "
            )
    turns = sorted(
        (r for r in results if r.cache and r.workload.startswith("multi-turn")),
        key=lambda r: int(r.workload.rsplit(" ", 1)[1]),
    )
    if len(turns) == 2 and turns[0].p50 > 0:
        each = ""
        if len(turns[0].run_p50s) > 1:
            ratios = (b / a for a, b in zip(turns[0].run_p50s, turns[1].run_p50s, strict=True))
            each = f" (each run: {', '.join(f'{r:.2f}' for r in ratios)})"
        lines.append(
            f"multi-turn, cache on: TTFT p50 of {turns[1].workload.split(', ')[1]} / "
            f"{turns[0].workload.split(', ')[1]} = {turns[1].p50 / turns[0].p50:.2f}{each}.  "
        )
    return "\n".join(lines)
