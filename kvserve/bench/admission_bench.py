"""Partial reservation against full reservation, through HTTP: concurrent chats without
max_tokens (what most chat front-ends send) on one KV budget.

Each admission policy runs `kvserve serve MODEL --max-num-seqs C --kv-cache-memory M
--admission {partial,reserve}` with a queue that lets every request wait as long as it needs,
and the load generator sends C concurrent streamed chats with no max_tokens: short questions a
chat user asks (`chat_questions`), one wave of C by default, sampled at temperature 0.7 with a
seed per chat (as chat front-ends sample; greedy decoding of a small model can repeat itself to
the end of the context), so both policies produce the same answers (a preempted request resumes
its seeded generator where it was). While it runs, /metrics is polled for the requests running
and the KV blocks held. The table gives out tok/s, TTFT p99, the peak of requests running, the
preemptions, and the memory each policy needs to run all C at once: under "reserve" C full
contexts; under "partial" C prompts with their first `--reserve-tokens` positions to admit
them all, and the peak actually held in the run.

`make bench` runs it on qwen2.5-coder:1.5b (`ARGS="--only admission --admission-model NAME"`
for another model: a catalogue name, pulled first when missing, or a path); `python -m
kvserve.bench.admission_bench [MODEL]` runs it alone (on the embedded model without MODEL; tiny
sizes with `--concurrency 4 --num-prompts 4 --kv-cache-memory 64MB`, for a smoke run).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass

import httpx

from kvserve.bench.loadgen import BenchConfig, BenchResult, run_benchmark

ADMISSIONS = ("partial", "reserve")

TOPICS = (
    "a hash map",
    "a mutex",
    "TCP slow start",
    "a B-tree",
    "garbage collection",
    "a closure",
    "tail recursion",
    "a bloom filter",
    "the CAP theorem",
    "a race condition",
    "memoization",
    "a linked list",
    "big-O notation",
    "a deadlock",
    "a unit test",
    "dependency injection",
    "a REST API",
    "a database index",
    "a git rebase",
    "a cache miss",
    "a virtual machine",
    "a container image",
    "a load balancer",
    "a semaphore",
    "an abstract class",
    "a compiler",
    "an interpreter",
    "a hash collision",
    "binary search",
    "quicksort",
    "a heap",
    "a trie",
    "a regular expression",
    "a coroutine",
    "an event loop",
    "a memory leak",
    "a segmentation fault",
    "a stack overflow",
    "a pointer",
    "immutability",
    "a pure function",
    "a monad",
    "a type system",
    "an API key",
    "public-key cryptography",
    "a checksum",
    "UTF-8",
    "a floating-point rounding error",
    "a thread pool",
    "a message queue",
    "eventual consistency",
    "a transaction",
    "SQL injection",
    "a cookie",
    "a DNS lookup",
    "a CDN",
    "an SSH key",
    "a Makefile",
    "a linter",
    "continuous integration",
    "a feature flag",
    "a code review",
    "a breakpoint",
    "a profiler",
)
"""What the chats ask about: one topic each, a question a chat user asks (and the model
answers in a few sentences and ends, so a run's length is bounded by its answers, not by the
context)."""


def chat_questions(topics: Sequence[str] = TOPICS) -> tuple[str, ...]:
    """The bench's chats: short questions with short answers, as a chat front-end sends
    them (no max_tokens)."""
    return tuple(f"In two or three sentences: what is {topic}?" for topic in topics)


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? (\S+)$")


@dataclass(slots=True)
class AdmissionRun:
    """One policy's run and what /metrics said during it."""

    admission: str
    result: BenchResult
    max_model_len: int
    reserve_tokens: int
    num_blocks: int
    block_size: int
    block_bytes: int
    peak_running: int = 0
    peak_blocks_used: int = 0
    num_preemptions: int = 0

    @property
    def mean_prompt_tokens(self) -> float:
        prompts = [r.prompt_tokens for r in self.result.records if r.prompt_tokens is not None]
        return sum(prompts) / len(prompts) if prompts else 0.0

    def blocks_to_admit_all(self, concurrency: int) -> int:
        """Blocks the policy reserves to admit `concurrency` of these chats at once."""
        prompt = round(self.mean_prompt_tokens)
        if self.admission == "reserve":
            positions = self.max_model_len  # no max_tokens: the rest of the context
        else:
            positions = prompt + self.reserve_tokens
        return concurrency * -(-positions // self.block_size)


def scrape(url: str) -> dict[str, float]:
    """`GET /metrics` as {'name{labels}': value}."""
    response = httpx.get(url + "/metrics", timeout=10)
    response.raise_for_status()
    samples: dict[str, float] = {}
    for line in response.text.splitlines():
        match = _SAMPLE.match(line)
        if match:
            samples[match.group(1) + (match.group(2) or "")] = float(match.group(3))
    return samples


async def _watch(url: str, run: AdmissionRun, stop: asyncio.Event, every: float) -> None:
    async with httpx.AsyncClient(timeout=10) as client:
        while not stop.is_set():
            try:
                response = await client.get(url + "/metrics")
            except httpx.HTTPError:
                await asyncio.sleep(every)
                continue
            for line in response.text.splitlines():
                match = _SAMPLE.match(line)
                if match is None:
                    continue
                name, value = match.group(1), float(match.group(3))
                if name == "kvserve:num_requests_running":
                    run.peak_running = max(run.peak_running, int(value))
                elif name == "kvserve:num_free_kv_blocks":
                    run.peak_blocks_used = max(run.peak_blocks_used, run.num_blocks - int(value))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), every)


async def _measure(config: BenchConfig, run: AdmissionRun, every: float) -> BenchResult:
    stop = asyncio.Event()
    watcher = asyncio.create_task(_watch(config.url, run, stop, every))
    try:
        return await run_benchmark(config)
    finally:
        stop.set()
        await watcher


def run_admission_bench(
    model: str | None,
    *,
    concurrency: int = 64,
    num_prompts: int | None = None,
    prompts: Sequence[str] | None = None,
    temperature: float = 0.7,
    kv_cache_memory: str = "4GB",
    reserve_tokens: int | None = None,
    max_model_len: int | None = None,
    engine_flags: Sequence[str] = (),
    admissions: Sequence[str] = ADMISSIONS,
    poll_seconds: float = 0.25,
) -> list[AdmissionRun]:
    """Run the workload once per admission policy on a fresh server; see the module docstring."""
    from kvserve.bench.run import serving

    if model is not None:
        from kvserve.hub.pull_cli import pull_if_missing

        pull_if_missing(model)  # before any server starts: its start has a deadline
    runs = []
    for admission in admissions:
        flags = [] if model is None else [model]
        flags += ["--max-num-seqs", str(concurrency), "--kv-cache-memory", kv_cache_memory]
        flags += ["--admission", admission, "--queue-timeout", "86400"]
        if reserve_tokens is not None:
            flags += ["--reserve-tokens", str(reserve_tokens)]
        if max_model_len is not None:
            flags += ["--max-model-len", str(max_model_len)]
        flags += list(engine_flags)
        with serving(*flags) as url:
            card = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]
            metrics = scrape(url)
            run = AdmissionRun(
                admission=admission,
                result=None,  # type: ignore[arg-type]  (set below)
                max_model_len=int(card["max_model_len"]),
                reserve_tokens=reserve_tokens or _default_reserve_tokens(),
                num_blocks=int(metrics["kvserve:num_kv_blocks"]),
                block_size=int(metrics["kvserve:kv_cache_block_size"]),
                block_bytes=int(metrics["kvserve:kv_cache_block_bytes"]),
            )
            config = BenchConfig(
                url=url,
                concurrency=concurrency,
                num_prompts=num_prompts or concurrency,
                prompts=tuple(prompts or chat_questions()),
                temperature=temperature,
                output_len=None,
                endpoint="chat",
                warmup=1,
            )
            started = time.monotonic()
            run.result = asyncio.run(_measure(config, run, poll_seconds))
            run.num_preemptions = int(scrape(url).get("kvserve:num_preemptions_total", 0))
            print(
                f"  --admission {admission}: {run.result.output_throughput:.0f} out tok/s, "
                f"peak {run.peak_running} running, {run.num_preemptions} preemptions "
                f"({time.monotonic() - started:.0f} s)",
                flush=True,
            )
            runs.append(run)
    return runs


def _default_reserve_tokens() -> int:
    from kvserve.config import DEFAULT_RESERVE_TOKENS

    return DEFAULT_RESERVE_TOKENS


def _gib(num_bytes: float) -> str:
    return f"{num_bytes / 2**30:.2f} GiB"


def format_admission_table(runs: Sequence[AdmissionRun], concurrency: int) -> str:
    """The runs side by side, and the ratios of the first (partial) to the second (reserve)."""
    header = (
        "| admission | out tok/s | TTFT p99 (ms) | completed | peak running | preemptions | "
        f"to admit all {concurrency} | peak held |\n| --- | ---: | ---: | ---: | ---: | ---: | "
        "---: | ---: |"
    )
    lines = [header]
    for run in runs:
        result = run.result
        ttft = "-" if result.ttft is None else f"{1000 * result.ttft.p99:.0f}"
        lines.append(
            f"| {run.admission} | {result.output_throughput:.1f} | {ttft} | "
            f"{result.num_completed}/{result.config.num_prompts} | {run.peak_running} | "
            f"{run.num_preemptions} | "
            f"{_gib(run.blocks_to_admit_all(concurrency) * run.block_bytes)} | "
            f"{_gib(run.peak_blocks_used * run.block_bytes)} |"
        )
    by_name = {run.admission: run for run in runs}
    if {"partial", "reserve"} <= set(by_name):
        partial, reserve = by_name["partial"].result, by_name["reserve"].result
        if reserve.output_throughput > 0:
            lines.append("")
            lines.append(
                f"partial/reserve out tok/s: "
                f"{partial.output_throughput / reserve.output_throughput:.2f}x"
                + (
                    f"; TTFT p99 partial/reserve: {partial.ttft.p99 / reserve.ttft.p99:.2f}x"
                    if partial.ttft and reserve.ttft and reserve.ttft.p99 > 0
                    else ""
                )
            )
    return "\n".join(lines)


@dataclass(frozen=True, slots=True)
class SweepPoint:
    """One `reserve_tokens` under one pool in the scheduler alone (no model): how many steps
    the workload took, the rows computed per row of prompt and answer (above 1: recompute),
    the mean of sequences running, and the preemptions."""

    pool_positions: int
    reserve_tokens: int
    num_steps: int
    rows_per_token: float
    mean_running: float
    num_preemptions: int


def sweep_reserve_tokens(
    reserve_tokens: Sequence[int] = (16, 64, 128, 256, 512, 1024),
    pool_positions: Sequence[int] = (12_000, 24_000),
    *,
    concurrency: int = 64,
    num_requests: int = 256,
    max_model_len: int = 32_768,
    seed: int = 0,
) -> list[SweepPoint]:
    """The core Scheduler over a closed loop of `concurrency` chats (prompts of 50-400
    tokens, answers log-normal around 250 tokens, no max_tokens), for each first part and pool:
    a small first part admits more at once but preempts more and recomputes more rows."""
    import math
    import random

    from kvserve.config import SchedulerConfig
    from kvserve.core import (
        AdmissionQueue,
        BlockPool,
        KVManager,
        Prompt,
        Scheduler,
        admit_or_enqueue,
        admit_waiting,
        make_sequences,
    )

    points = []
    for pool in pool_positions:
        for reserve in reserve_tokens:
            rng = random.Random(seed)
            jobs = []
            for index in range(num_requests):
                prompt = rng.randint(50, 400)
                answer = int(math.exp(rng.gauss(math.log(250), 0.8)))
                jobs.append((f"r{index}", prompt, max(1, min(answer, max_model_len - prompt))))
            config = SchedulerConfig(
                max_num_seqs=concurrency, admission="partial", reserve_tokens=reserve
            )
            scheduler = Scheduler(
                config, KVManager(BlockPool(pool // 32, 32, prefix_caching=True)), max_model_len
            )
            queue = AdmissionQueue(num_requests, math.inf, concurrency)
            answers: dict[str, int] = {}
            pending = list(jobs)
            done = rows = running = steps = in_flight = 0
            while done < len(jobs):
                while in_flight < concurrency and pending:
                    request_id, prompt, answer = pending.pop(0)
                    tokens = tuple(rng.randrange(1, 50_000) for _ in range(prompt))
                    seqs = make_sequences(
                        request_id,
                        prompt,
                        scheduler.check(prompt, None),
                        Prompt(tokens),
                        stop_token_ids=frozenset({0}),
                    )
                    answers[request_id] = answer
                    admit_or_enqueue(scheduler, queue, seqs, 0.0)
                    in_flight += 1
                admit_waiting(scheduler, queue)
                plan = scheduler.schedule()
                rows += plan.num_rows
                running += scheduler.num_running
                steps += 1
                sampled = {
                    seq_id: 0 if scheduler.get(seq_id).num_output + 1 >= answers[seq_id] else 7
                    for chunk in plan.chunks
                    for seq_id in chunk.sampler_ids
                }
                for seq in scheduler.update_from_output(plan, sampled):
                    scheduler.release(seq.seq_id)
                    done += 1
                    in_flight -= 1
            total = sum(prompt + answer for _, prompt, answer in jobs)
            points.append(
                SweepPoint(
                    pool, reserve, steps, rows / total, running / steps, scheduler.num_preemptions
                )
            )
    return points


def format_sweep(points: Sequence[SweepPoint]) -> str:
    lines = [
        "| pool (positions) | --reserve-tokens | steps | rows / token | mean running | "
        "preemptions |\n| ---: | ---: | ---: | ---: | ---: | ---: |"
    ]
    for p in points:
        lines.append(
            f"| {p.pool_positions} | {p.reserve_tokens} | {p.num_steps} | "
            f"{p.rows_per_token:.3f} | {p.mean_running:.1f} | {p.num_preemptions} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default=None, help="model path (default: embedded)")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--num-prompts", type=int, default=None, help="default: concurrency")
    parser.add_argument("--temperature", type=float, default=0.7, help="0: greedy")
    parser.add_argument("--kv-cache-memory", default="4GB")
    parser.add_argument("--reserve-tokens", type=int, default=None)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument(
        "--sweep",
        action="store_true",
        help="instead: the scheduler alone over --reserve-tokens choices (no model, no timing)",
    )
    args, engine_flags = parser.parse_known_args(argv)
    if args.sweep:
        print(format_sweep(sweep_reserve_tokens()))
        return 0
    runs = run_admission_bench(
        args.model,
        concurrency=args.concurrency,
        num_prompts=args.num_prompts,
        temperature=args.temperature,
        kv_cache_memory=args.kv_cache_memory,
        reserve_tokens=args.reserve_tokens,
        max_model_len=args.max_model_len,
        engine_flags=engine_flags,
    )
    print(format_admission_table(runs, args.concurrency))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
