"""What watching the engine costs: throughput with no viewer and with one viewer connected to
`GET /v1/engine/events`, against the same server in the same run.

The runs alternate (none, one, none, one, ...) so that drift on a shared machine falls on both
sides; the ratio is of the summed output tokens over the summed durations.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass

import httpx

from kvserve.bench.loadgen import BenchConfig, BenchResult, run_benchmark

__all__ = ["ViewerBench", "format_viewer_bench", "run_viewer_bench"]


@dataclass(frozen=True, slots=True)
class ViewerBench:
    """Output throughput without and with a viewer, and what the viewer received."""

    concurrency: int
    without: list[BenchResult]
    with_viewer: list[BenchResult]
    num_events: int  # events the viewer read during its runs
    num_bytes: int

    @staticmethod
    def _throughput(results: list[BenchResult]) -> float:
        tokens = sum(r.total_output_tokens for r in results)
        seconds = sum(r.duration for r in results)
        return tokens / seconds if seconds else 0.0

    @property
    def throughput_without(self) -> float:
        return self._throughput(self.without)

    @property
    def throughput_with(self) -> float:
        return self._throughput(self.with_viewer)

    @property
    def ratio(self) -> float:
        """Throughput with one viewer over throughput with none."""
        return self.throughput_with / self.throughput_without if self.throughput_without else 0.0


async def _watch(url: str, counts: list[int]) -> None:
    """Read the event stream until cancelled, counting events and bytes."""
    async with (
        httpx.AsyncClient(timeout=httpx.Timeout(30, read=None), trust_env=False) as client,
        client.stream("GET", url + "/v1/engine/events") as response,
    ):
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                counts[0] += 1
                counts[1] += len(line)


async def _measure(config: BenchConfig, pairs: int) -> ViewerBench:
    without: list[BenchResult] = []
    with_viewer: list[BenchResult] = []
    counts = [0, 0]
    for _ in range(pairs):
        without.append(await run_benchmark(config))
        watcher = asyncio.create_task(_watch(config.url, counts))
        try:
            await asyncio.sleep(0.5)  # connected, and its snapshot read
            if watcher.done():
                watcher.result()  # the stream failed: say why
            with_viewer.append(await run_benchmark(config))
        finally:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
    return ViewerBench(config.concurrency, without, with_viewer, counts[0], counts[1])


def run_viewer_bench(
    url: str,
    *,
    concurrency: int = 32,
    num_prompts: int = 64,
    input_len: int = 32,
    output_len: int = 128,
    pairs: int = 3,
) -> ViewerBench:
    """Alternate `pairs` runs without and with one viewer against the server at `url`. Runs of
    about a second (32 requests of 32 tokens) moved by +-5% from run to run here; the defaults
    make each run about 8 s (docs/benchmarks.md, the viewer's cost over a longer run)."""
    config = BenchConfig(
        url=url,
        concurrency=concurrency,
        num_prompts=num_prompts,
        input_len=input_len,
        output_len=output_len,
        endpoint="completions",
        ignore_eos=True,
        warmup=1,
    )
    return asyncio.run(_measure(config, pairs))


def format_viewer_bench(result: ViewerBench) -> str:
    """One Markdown table and the ratio line."""
    first = (result.without or result.with_viewer)[0].config
    rows = [
        "| viewers | runs | requests completed | out tok/s |",
        "| ---: | ---: | ---: | ---: |",
        f"| 0 | {len(result.without)} | {sum(r.num_completed for r in result.without)} | "
        f"{result.throughput_without:.1f} |",
        f"| 1 | {len(result.with_viewer)} | {sum(r.num_completed for r in result.with_viewer)} | "
        f"{result.throughput_with:.1f} |",
        "",
        f"One viewer / none at {result.concurrency} concurrent: {result.ratio:.1%} "
        f"(target >= 97%; {first.num_prompts} requests of {first.input_len} prompt words and "
        f"{first.output_len} output tokens per run, runs alternating; the viewer read "
        f"{result.num_events} events, {result.num_bytes / max(1, result.num_events):.0f} bytes "
        "each on average).",
    ]
    return "\n".join(rows)
