"""Engine benchmark: continuous batching without HTTP, against transformers' static batches.

At each concurrency C, 2*C requests (128-token prompts, 128 output tokens, ignore_eos, greedy)
go through the engine with at most C in flight; output tok/s counts every generated token over
the whole run (prefills included), as vLLM's serving benchmark does. The same requests then run
through transformers' `generate` in static batches of C, in the same process and dtype.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from dataclasses import asdict, dataclass

import torch

from kvserve.bench.loadgen import build_prompts
from kvserve.config import CacheConfig, EngineConfig, SchedulerConfig
from kvserve.engine.engine import Engine
from kvserve.model import device_thread
from kvserve.model.loader import LoadedModel
from kvserve.params import SamplingParams
from kvserve.request import GenerationRequest


@dataclass
class EngineBenchResult:
    concurrency: int
    num_requests: int
    output_tokens: int
    duration: float
    output_tok_s: float
    ttft_mean: float
    ttft_median: float
    ttft_p99: float
    itl_mean: float = 0.0  # seconds between a request's tokens, after its first
    reference_output_tok_s: float | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def bench_prompts(loaded: LoadedModel, num: int, input_len: int, seed: int = 0) -> list[list[int]]:
    """`num` prompts of exactly `input_len` token ids, from the load generator's word prompts."""
    texts = build_prompts(num, input_len + 16, seed)
    prompts = []
    for text in texts:
        ids = loaded.tokenizer.encode(text)
        if len(ids) < input_len:
            raise ValueError("prompt text shorter than the requested input length")
        prompts.append(ids[:input_len])
    return prompts


async def _engine_run(
    engine: Engine, prompts: list[list[int]], concurrency: int, output_len: int
) -> tuple[float, list[float], int, list[float]]:
    """Duration, each request's TTFT, output tokens, and each request's mean inter-token time."""
    gate = asyncio.Semaphore(concurrency)
    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)

    async def one(ids: list[int]) -> tuple[float, int, float]:
        async with gate:
            sent = time.perf_counter()
            stream = engine.submit(GenerationRequest(tuple(ids), params))
            first = last = None
            count = 0
            async for delta in stream:
                if delta.token_ids:
                    last = time.perf_counter()
                    first = first or last
                count += len(delta.token_ids)
            itl = (last - first) / (count - 1) if first is not None and count > 1 else 0.0
            return (first - sent) if first is not None else 0.0, count, itl

    started = time.perf_counter()
    results = await asyncio.gather(*(one(p) for p in prompts))
    duration = time.perf_counter() - started
    return duration, [r[0] for r in results], sum(r[1] for r in results), [r[2] for r in results]


def measure_engine(
    loaded: LoadedModel,
    concurrency: int,
    *,
    input_len: int = 128,
    output_len: int = 128,
    max_num_seqs: int = 64,
    kv_cache_dtype: str = "auto",
    num_requests: int | None = None,
) -> EngineBenchResult:
    num = num_requests or max(4, 2 * concurrency)
    prompts = bench_prompts(loaded, num, input_len)
    blocks_per_seq = -(-(input_len + output_len) // 32)
    config = EngineConfig(
        cache=CacheConfig(
            num_kv_blocks=max_num_seqs * blocks_per_seq + 8, kv_cache_dtype=kv_cache_dtype
        ),
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs),
    )

    async def main():
        engine = Engine(config, loaded)
        await engine.start()
        try:
            # Warm-up: one short request so first-call costs are not measured.
            await _engine_run(engine, prompts[:1], 1, 4)
            return await _engine_run(engine, prompts, concurrency, output_len)
        finally:
            await engine.stop()

    duration, ttfts, tokens, itls = asyncio.run(main())
    ttfts.sort()
    return EngineBenchResult(
        concurrency=concurrency,
        num_requests=num,
        output_tokens=tokens,
        duration=duration,
        output_tok_s=tokens / duration,
        ttft_mean=statistics.fmean(ttfts),
        ttft_median=statistics.median(ttfts),
        ttft_p99=ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))],
        itl_mean=statistics.fmean(itls),
    )


@torch.inference_mode()
def measure_reference(
    model, prompts: list[list[int]], concurrency: int, output_len: int = 128
) -> float:
    """Output tok/s of transformers `generate` over the same prompts in static batches."""
    device = next(model.parameters()).device
    tokens = 0
    started = time.perf_counter()
    for first in range(0, len(prompts), concurrency):
        batch = torch.tensor(prompts[first : first + concurrency], device=device)
        out = model.generate(
            batch,
            attention_mask=torch.ones_like(batch),
            max_new_tokens=output_len,
            min_new_tokens=output_len,
            do_sample=False,
            pad_token_id=0,
        )
        tokens += (out.shape[1] - batch.shape[1]) * batch.shape[0]
    return tokens / (time.perf_counter() - started)


def run_engine_bench(
    loaded: LoadedModel,
    concurrencies: tuple[int, ...] = (1, 8, 32, 64),
    *,
    reference=None,
    kv_cache_dtype: str = "auto",
) -> list[EngineBenchResult]:
    results = []
    for concurrency in concurrencies:
        result = measure_engine(loaded, concurrency, kv_cache_dtype=kv_cache_dtype)
        if reference is not None:
            prompts = bench_prompts(loaded, result.num_requests, 128)
            result.reference_output_tok_s = device_thread.call(
                measure_reference, reference, prompts, concurrency
            )
        results.append(result)
    return results


def format_comparison_table(
    results: list[EngineBenchResult], baseline: list[EngineBenchResult], name: str
) -> str:
    """The default configuration next to `name` (e.g. `--quantization none`), same run."""
    lines = [
        f"| concurrency | default out tok/s | {name} out tok/s | ratio "
        f"| default inter-token ms | {name} inter-token ms |",
        "| ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r, b in zip(results, baseline, strict=True):
        lines.append(
            f"| {r.concurrency} | {r.output_tok_s:.0f} | {b.output_tok_s:.0f} | "
            f"{r.output_tok_s / b.output_tok_s:.2f}x | {r.itl_mean * 1e3:.1f} | "
            f"{b.itl_mean * 1e3:.1f} |"
        )
    return "\n".join(lines)


def format_engine_table(results: list[EngineBenchResult]) -> str:
    lines = [
        "| concurrency | requests | kvserve out tok/s | TTFT mean / median / p99 (s) "
        "| inter-token mean (ms) | transformers static batches out tok/s | ratio |",
        "| ---: | ---: | ---: | --- | ---: | ---: | ---: |",
    ]
    for r in results:
        ref = r.reference_output_tok_s
        ratio = f"{r.output_tok_s / ref:.2f}x" if ref else "—"
        ref_text = f"{ref:.0f}" if ref else "—"
        lines.append(
            f"| {r.concurrency} | {r.num_requests} | {r.output_tok_s:.0f} | "
            f"{r.ttft_mean:.2f} / {r.ttft_median:.2f} / {r.ttft_p99:.2f} | "
            f"{r.itl_mean * 1e3:.1f} | {ref_text} | {ratio} |"
        )
    return "\n".join(lines)
