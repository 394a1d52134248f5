"""Serving load generator for any OpenAI-compatible streaming server.

Measures the way vLLM's `bench serve` does, so numbers compare across servers: a seeded `random`
workload of fixed input and output lengths, streamed requests under a concurrency cap with either
all requests released at once or Poisson arrivals, timed on the client with `time.perf_counter()`.

Definitions (all client side, from the moment a request is sent, after the concurrency cap):

- TTFT: until the first chunk that carries text.
- ITL: every gap between two successive chunks that carry text.
- TPOT: per request, (E2E - TTFT) / (output tokens - 1), for requests with more than one token.
- E2E: until the stream ends (`[DONE]`).
- Output tokens: `usage.completion_tokens` from the final usage chunk when the server sends one,
  else the number of chunks that carried text.
- Duration: from the first request sent to the last request finished; throughputs divide by it.

Only completed requests enter latency and throughput figures; failed (non-200 replies, error
events inside a stream, broken connections) and client-cancelled requests are counted apart.

This module must not import torch: it is pointed at other servers on machines without our engine.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import math
import os
import random
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import httpx
import numpy as np

Endpoint = Literal["chat", "completions"]
Outcome = Literal["completed", "failed", "cancelled"]

# Failure keys that are not HTTP status codes: an error event inside a 200 stream, and no usable
# reply at all (connection refused or reset, timeout, a stream cut short, a malformed event).
STREAM_ERROR = "stream-error"
TRANSPORT_ERROR = "transport-error"

# Common English words that are one token each, with or without a leading space, in GPT-2-style
# byte-level BPE vocabularies (every one checked against SmolLM2's; words this common are whole
# tokens in most BPE vocabularies). A prompt of N words is then about N tokens for a model whose
# tokenizer we do not have; the server's usage.prompt_tokens reports the exact count.
_WORD_TEXT = """
    the of and to in is that for it as was with be by on not he this are or his from at which but
    have an had they you were their one all we can her has there been if more when will would who
    so no she other its may these what them than some him time into only do like then now over
    such our man me even most made after also did many before must through back years where much
    your way well down should because each just those people how too little state good very make
    world still own see men work long get here between both life being under never day same
    another know while last might us great old year off come since against go came right used
    take three states few house use during without again place around however home small found
    thought went say part once high general upon school every does got left number course war
    until always away something fact though water less public put think almost hand enough far
    head yet government system better set nothing night end why called find going look later point
    next program give group young let room side social present given several order national
    possible rather second face per among form important often things early white case large need
    big four within felt along children best church ever least power development light thing
    family interest want members mind country area others done although open problem
"""
WORDS: tuple[str, ...] = tuple(_WORD_TEXT.split())

_ERROR_BODY_LIMIT = 2000  # characters of an error reply kept per request


@dataclass(frozen=True, slots=True)
class BenchConfig:
    """One benchmark run: where to send, what workload, how requests arrive."""

    url: str = "http://127.0.0.1:8000"  # base URL, optionally ending in /v1
    model: str | None = None  # None = the first model the server lists at /v1/models
    concurrency: int = 1  # requests in flight at most
    num_prompts: int = 32
    input_len: int = 128  # prompt words, about that many tokens for a BPE tokenizer
    output_len: int | None = 128  # max_tokens; None: sent without one (chat front-ends' way)
    request_rate: float = math.inf  # requests per second, Poisson; inf = all at once
    cancel_rate: float = 0.0  # fraction of requests the client aborts mid-stream
    cancel_after: int = 4  # chunks with text a cancelled request reads before closing
    endpoint: Endpoint = "chat"
    seed: int = 0
    ignore_eos: bool = False
    warmup: int = 0  # requests sent and discarded before measuring
    timeout: float = 3600.0  # seconds a reply may stay silent (connecting: at most 60)
    api_key: str | None = None
    response_format: dict[str, Any] | None = None  # sent as is: constrains every answer
    # The prompts, in order and repeated as needed; None: `input_len` seeded words each.
    prompts: tuple[str, ...] | None = None
    # 0: greedy. Above 0 every request also carries a seed of its own (from `seed` and its
    # index), so a rerun, or another server that honours seeds, samples the same answers.
    temperature: float = 0.0

    def __post_init__(self) -> None:
        try:
            scheme = httpx.URL(self.url).scheme
        except httpx.InvalidURL as exc:
            raise ValueError(f"invalid url {self.url!r}: {exc}") from exc
        if scheme not in ("http", "https"):
            raise ValueError(f"url must start with http:// or https://, not {self.url!r}")
        if self.concurrency < 1:
            raise ValueError("concurrency must be at least 1")
        if self.num_prompts < 1:
            raise ValueError("num_prompts must be at least 1")
        if self.input_len < 1 or (self.output_len is not None and self.output_len < 1):
            raise ValueError("input_len and output_len must be at least 1")
        if not self.request_rate > 0:
            raise ValueError("request_rate must be positive (inf = all at once)")
        if not 0.0 <= self.cancel_rate <= 1.0:
            raise ValueError("cancel_rate must be within [0, 1]")
        if self.cancel_after < 1:
            raise ValueError("cancel_after must be at least 1")
        if self.endpoint not in ("chat", "completions"):
            raise ValueError(f"unknown endpoint {self.endpoint!r}: chat | completions")
        if self.warmup < 0:
            raise ValueError("warmup must be >= 0")
        if self.timeout <= 0:
            raise ValueError("timeout must be positive")
        if self.prompts is not None and not self.prompts:
            raise ValueError("prompts, when given, must not be empty")
        if not 0.0 <= self.temperature <= 2.0:
            raise ValueError("temperature must be within [0, 2]")

    @property
    def base_url(self) -> str:
        """The URL up to and including `/v1`."""
        url = self.url.rstrip("/")
        return url if url.endswith("/v1") else url + "/v1"

    @property
    def endpoint_url(self) -> str:
        """Where the requests go."""
        path = "/chat/completions" if self.endpoint == "chat" else "/completions"
        return self.base_url + path


@dataclass(slots=True)
class RequestRecord:
    """What the client saw of one request. Offsets and latencies are seconds."""

    index: int
    outcome: Outcome
    status: int | None  # HTTP status; None when no reply arrived
    scheduled: float  # planned arrival, from the start of the run
    start: float  # sent (after waiting for the concurrency cap), from the start of the run
    end: float  # finished, failed or aborted, from the start of the run
    ttft: float | None  # None when no chunk carried text
    e2e: float
    itls: list[float] = field(default_factory=list)
    num_chunks: int = 0  # chunks that carried text
    output_tokens: int = 0  # usage.completion_tokens when reported, else num_chunks
    prompt_tokens: int | None = None  # usage.prompt_tokens; None when the server did not say
    error: str | None = None  # error body or message of a failed request
    error_in_stream: bool = False  # failed by an error event inside a 200 stream

    @property
    def tpot(self) -> float | None:
        """(E2E - TTFT) / (output tokens - 1); None below two tokens or without a first token."""
        if self.ttft is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    @property
    def failure_key(self) -> str | None:
        """How a failure is counted: its HTTP status, STREAM_ERROR or TRANSPORT_ERROR."""
        if self.outcome != "failed":
            return None
        if self.status is not None and self.status != 200:
            return str(self.status)
        return STREAM_ERROR if self.error_in_stream else TRANSPORT_ERROR

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready, latencies in milliseconds."""
        tpot = self.tpot
        return {
            "index": self.index,
            "outcome": self.outcome,
            "status": self.status,
            "failure": self.failure_key,
            "error": self.error,
            "scheduled_ms": _ms(self.scheduled),
            "start_ms": _ms(self.start),
            "end_ms": _ms(self.end),
            "ttft_ms": None if self.ttft is None else _ms(self.ttft),
            "tpot_ms": None if tpot is None else _ms(tpot),
            "e2e_ms": _ms(self.e2e),
            "itls_ms": [_ms(gap) for gap in self.itls],
            "num_chunks": self.num_chunks,
            "output_tokens": self.output_tokens,
            "prompt_tokens": self.prompt_tokens,
        }


@dataclass(frozen=True, slots=True)
class LatencyStats:
    """Summary of latency samples in seconds (numpy's linear percentile, population std)."""

    count: int
    mean: float
    median: float
    p99: float
    std: float

    @classmethod
    def of(cls, samples: list[float]) -> LatencyStats | None:
        """The summary of `samples`; None when there are none."""
        if not samples:
            return None
        values = np.asarray(samples, dtype=np.float64)
        return cls(
            count=len(samples),
            mean=float(values.mean()),
            median=float(np.median(values)),
            p99=float(np.percentile(values, 99)),
            std=float(values.std()),
        )


@dataclass(slots=True)
class BenchResult:
    """Everything one run measured, with the per-request records it was computed from."""

    config: BenchConfig  # with the model name resolved
    started_at: str  # ISO 8601, UTC
    duration: float  # seconds, first request sent to last request finished
    num_completed: int
    num_failed: int
    num_cancelled: int
    num_rate_limited: int  # failed with 429
    failures: dict[str, int]  # failure key (HTTP status, STREAM_ERROR, TRANSPORT_ERROR) -> count
    total_input_tokens: int | None  # None when a completed request had no usage.prompt_tokens
    total_output_tokens: int
    request_throughput: float  # completed requests per second
    output_throughput: float  # output tokens of completed requests per second
    total_token_throughput: float | None  # input + output tokens per second
    ttft: LatencyStats | None
    tpot: LatencyStats | None
    itl: LatencyStats | None
    e2e: LatencyStats | None
    records: list[RequestRecord]

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: config, every metric (vLLM's names, milliseconds), per-request records."""
        config = asdict(self.config)
        # vLLM writes an unbounded rate as "inf"; bare Infinity is not JSON.
        if math.isinf(self.config.request_rate):
            config["request_rate"] = "inf"
        config.pop("api_key")
        config["endpoint_url"] = self.config.endpoint_url
        metrics: dict[str, Any] = {
            "duration_s": self.duration,
            "completed": self.num_completed,
            "failed": self.num_failed,
            "cancelled": self.num_cancelled,
            "rate_limited": self.num_rate_limited,
            "failures": dict(self.failures),
            "total_input_tokens": self.total_input_tokens,
            "total_output_tokens": self.total_output_tokens,
            "request_throughput": self.request_throughput,
            "output_throughput": self.output_throughput,
            "total_token_throughput": self.total_token_throughput,
        }
        for name, stats in (
            ("ttft", self.ttft),
            ("tpot", self.tpot),
            ("itl", self.itl),
            ("e2el", self.e2e),
        ):
            metrics[f"num_{name}_samples"] = 0 if stats is None else stats.count
            for part in ("mean", "median", "p99", "std"):
                value = None if stats is None else _ms(getattr(stats, part))
                metrics[f"{part}_{name}_ms"] = value
        return {
            "config": config,
            "started_at": self.started_at,
            "metrics": metrics,
            "records": [record.to_dict() for record in self.records],
        }


def build_prompts(num_prompts: int, input_len: int, seed: int) -> list[str]:
    """`num_prompts` prompts of `input_len` words drawn from WORDS, seeded.

    Words are drawn independently per prompt, so prompts differ from their first words on and a
    prefix cache finds nothing to share beyond the chat template.
    """
    rng = random.Random(f"prompts-{seed}")
    return [" ".join(rng.choices(WORDS, k=input_len)) for _ in range(num_prompts)]


def arrival_offsets(num_prompts: int, request_rate: float, seed: int) -> list[float]:
    """Planned send times in seconds from the start: all 0 for an infinite rate, else a Poisson
    process (seeded exponential gaps) whose first request goes at 0."""
    if math.isinf(request_rate):
        return [0.0] * num_prompts
    rng = random.Random(f"arrivals-{seed}")
    offsets = [0.0]
    for _ in range(num_prompts - 1):
        offsets.append(offsets[-1] + rng.expovariate(request_rate))
    return offsets


def cancel_indices(num_prompts: int, cancel_rate: float, seed: int) -> frozenset[int]:
    """Which requests the client aborts: round(rate * n) of them, chosen with the seed."""
    rng = random.Random(f"cancels-{seed}")
    return frozenset(rng.sample(range(num_prompts), round(cancel_rate * num_prompts)))


def request_body(config: BenchConfig, model: str, prompt: str, index: int = 0) -> dict[str, Any]:
    """The JSON body for one streamed request (the `index`-th of its run)."""
    body: dict[str, Any] = {"model": model}
    if config.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if config.output_len is not None:
        body["max_tokens"] = config.output_len
    body.update(
        temperature=config.temperature,
        stream=True,
        stream_options={"include_usage": True},
    )
    if config.temperature > 0:
        body["seed"] = config.seed * 1_000_003 + index
    if config.ignore_eos:
        # Not in OpenAI's API; vLLM, llama.cpp and kvserve read it as an extra body field.
        body["ignore_eos"] = True
    if config.response_format is not None:
        body["response_format"] = config.response_format
    return body


async def run_benchmark(config: BenchConfig) -> BenchResult:
    """Run the warmup requests, then the measured ones, and summarise the measured ones.

    Raises ValueError when `config.model` is None and the server lists no model.
    """
    limits = httpx.Limits(
        max_connections=config.concurrency + 1, max_keepalive_connections=config.concurrency
    )
    timeout = httpx.Timeout(config.timeout, connect=min(config.timeout, 60.0))
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    # trust_env=False: a proxy picked up from the environment would be timed as the server.
    async with httpx.AsyncClient(
        limits=limits, timeout=timeout, headers=headers, trust_env=False
    ) as client:
        if config.model is None:
            config = replace(config, model=await _first_model(client, config))
        count = config.warmup + config.num_prompts
        if config.prompts is None:
            prompts = build_prompts(count, config.input_len, config.seed)
        else:
            prompts = [config.prompts[i % len(config.prompts)] for i in range(count)]
        if config.warmup:
            await _run_requests(
                client,
                config,
                prompts[: config.warmup],
                [0.0] * config.warmup,
                frozenset(),
            )
        started_at = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
        records = await _run_requests(
            client,
            config,
            prompts[config.warmup :],
            arrival_offsets(config.num_prompts, config.request_rate, config.seed),
            cancel_indices(config.num_prompts, config.cancel_rate, config.seed),
        )
    return summarize(config, records, started_at)


def summarize(config: BenchConfig, records: list[RequestRecord], started_at: str) -> BenchResult:
    """Compute every metric from per-request records."""
    completed = [r for r in records if r.outcome == "completed"]
    failed = [r for r in records if r.outcome == "failed"]
    failures = Counter(r.failure_key for r in failed)
    duration = max(r.end for r in records) - min(r.start for r in records)
    # Guard a zero span (every request refused within one clock tick) against division by zero.
    span = max(duration, 1e-9)
    prompt_counts = [r.prompt_tokens for r in completed]
    total_input = (
        sum(count for count in prompt_counts if count is not None)
        if None not in prompt_counts
        else None
    )
    total_output = sum(r.output_tokens for r in completed)
    tpots = [tpot for r in completed if (tpot := r.tpot) is not None]
    return BenchResult(
        config=config,
        started_at=started_at,
        duration=duration,
        num_completed=len(completed),
        num_failed=len(failed),
        num_cancelled=sum(r.outcome == "cancelled" for r in records),
        num_rate_limited=failures.get("429", 0),
        failures=dict(sorted(failures.items())),
        total_input_tokens=total_input,
        total_output_tokens=total_output,
        request_throughput=len(completed) / span,
        output_throughput=total_output / span,
        total_token_throughput=None if total_input is None else (total_input + total_output) / span,
        ttft=LatencyStats.of([r.ttft for r in completed if r.ttft is not None]),
        tpot=LatencyStats.of(tpots),
        itl=LatencyStats.of([gap for r in completed for gap in r.itls]),
        e2e=LatencyStats.of([r.e2e for r in completed]),
        records=records,
    )


async def _first_model(client: httpx.AsyncClient, config: BenchConfig) -> str:
    url = config.base_url + "/models"
    try:
        response = await client.get(url)
        response.raise_for_status()
        return str(response.json()["data"][0]["id"])
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as exc:
        raise ValueError(f"could not read a model name from {url} ({exc}); pass --model") from exc


async def _run_requests(
    client: httpx.AsyncClient,
    config: BenchConfig,
    prompts: list[str],
    offsets: list[float],
    cancel_ids: frozenset[int],
) -> list[RequestRecord]:
    assert config.model is not None
    semaphore = asyncio.Semaphore(config.concurrency)
    origin = time.perf_counter()

    async def one(index: int) -> RequestRecord:
        async with semaphore:
            return await _send(
                client,
                config,
                request_body(config, config.model, prompts[index], index),
                index=index,
                scheduled=offsets[index],
                origin=origin,
                cancel_after=config.cancel_after if index in cancel_ids else None,
            )

    tasks = []
    for index, offset in enumerate(offsets):
        # Sleep to absolute planned times so timer overshoot does not accumulate over a run.
        delay = origin + offset - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(index)))
    return list(await asyncio.gather(*tasks))


async def _send(
    client: httpx.AsyncClient,
    config: BenchConfig,
    body: dict[str, Any],
    *,
    index: int,
    scheduled: float,
    origin: float,
    cancel_after: int | None,
) -> RequestRecord:
    status: int | None = None
    ttft: float | None = None
    last: float | None = None
    itls: list[float] = []
    num_chunks = 0
    usage_output: int | None = None
    prompt_tokens: int | None = None
    outcome: Outcome = "failed"
    error: str | None = None
    error_in_stream = False
    finished = False  # [DONE] or a finish_reason arrived
    start = time.perf_counter()
    try:
        async with client.stream("POST", config.endpoint_url, json=body) as response:
            status = response.status_code
            if status != 200:
                text = (await response.aread()).decode("utf-8", errors="replace")
                error = text[:_ERROR_BODY_LIMIT]
            else:
                async for line in response.aiter_lines():
                    now = time.perf_counter()
                    # SSE comments (": ping"), event names and blank separators carry no data.
                    if not line.startswith("data:"):
                        continue
                    data = line[len("data:") :].strip()
                    if data == "[DONE]":
                        finished = True
                        break
                    event = json.loads(data)
                    if not isinstance(event, dict):
                        raise ValueError(f"unexpected event {data[:200]!r}")
                    if event.get("error") or event.get("object") == "error":
                        error_in_stream = True
                        error = data[:_ERROR_BODY_LIMIT]
                        break
                    usage = event.get("usage")
                    if usage:
                        usage_output = usage.get("completion_tokens", usage_output)
                        prompt_tokens = usage.get("prompt_tokens", prompt_tokens)
                    choices = event.get("choices") or []
                    if not choices:
                        continue
                    choice = choices[0]
                    if choice.get("finish_reason"):
                        finished = True
                    if not _choice_text(choice):
                        continue
                    if ttft is None:
                        ttft = now - start
                    else:
                        itls.append(now - last)
                    last = now
                    num_chunks += 1
                    if cancel_after is not None and num_chunks >= cancel_after and not finished:
                        # Leaving the `async with` early closes the connection: the server sees
                        # the client go, as it would when a user closes a chat window.
                        outcome = "cancelled"
                        break
                if outcome != "cancelled" and not error_in_stream:
                    if finished:
                        outcome = "completed"
                    else:
                        error = "stream ended before [DONE] or a finish_reason"
    except (httpx.HTTPError, ValueError, TypeError, AttributeError) as exc:
        # ValueError covers malformed JSON; TypeError/AttributeError a body of the wrong shape.
        outcome = "failed"
        error = f"{type(exc).__name__}: {exc}"[:_ERROR_BODY_LIMIT]
    end = time.perf_counter()
    return RequestRecord(
        index=index,
        outcome=outcome,
        status=status,
        scheduled=scheduled,
        start=start - origin,
        end=end - origin,
        ttft=ttft,
        e2e=end - start,
        itls=itls,
        num_chunks=num_chunks,
        output_tokens=usage_output if usage_output is not None else num_chunks,
        prompt_tokens=prompt_tokens,
        error=error if outcome == "failed" else None,
        error_in_stream=error_in_stream,
    )


def _choice_text(choice: dict[str, Any]) -> str:
    """The text a streamed choice carries: chat delta content (or reasoning), or completion text."""
    delta = choice.get("delta")
    if isinstance(delta, dict):
        return delta.get("content") or delta.get("reasoning_content") or ""
    return choice.get("text") or ""


def _ms(seconds: float) -> float:
    return seconds * 1000.0


def _fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _fmt_ms(stats: LatencyStats | None, part: str) -> str:
    return "-" if stats is None else f"{_ms(getattr(stats, part)):.1f}"


def format_report(result: BenchResult) -> str:
    """A readable summary of one run, laid out like vLLM's `bench serve` result."""
    config = result.config
    rate = "inf" if math.isinf(config.request_rate) else f"{config.request_rate:g}"
    failures = ", ".join(f"{key}: {count}" for key, count in result.failures.items())
    rows: list[tuple[str, str] | str] = [
        "Serving Benchmark Result",
        ("Endpoint", config.endpoint_url),
        ("Model", str(config.model)),
        ("Concurrency / request rate (req/s)", f"{config.concurrency} / {rate}"),
        ("Requests sent", str(config.num_prompts)),
        ("Successful requests", str(result.num_completed)),
        ("Failed requests", str(result.num_failed) + (f" ({failures})" if failures else "")),
        ("Cancelled by the client", str(result.num_cancelled)),
        ("Benchmark duration (s)", f"{result.duration:.2f}"),
        ("Total input tokens", _fmt(result.total_input_tokens, 0)),
        ("Total generated tokens", str(result.total_output_tokens)),
        ("Request throughput (req/s)", f"{result.request_throughput:.2f}"),
        ("Output token throughput (tok/s)", f"{result.output_throughput:.2f}"),
        ("Total token throughput (tok/s)", _fmt(result.total_token_throughput)),
    ]
    for title, name, stats in (
        ("Time to First Token", "TTFT", result.ttft),
        ("Time per Output Token (excl. 1st token)", "TPOT", result.tpot),
        ("Inter-token Latency", "ITL", result.itl),
        ("End-to-end Latency", "E2EL", result.e2e),
    ):
        rows.append(title)
        for part, label in (("mean", "Mean"), ("median", "Median"), ("p99", "P99"), ("std", "Std")):
            rows.append((f"{label} {name} (ms)", _fmt_ms(stats, part)))
    width = 50
    lines = []
    for row in rows:
        if isinstance(row, str):
            fill = "=" if row == rows[0] else "-"
            lines.append(f" {row} ".center(width, fill))
        else:
            lines.append(f"{row[0] + ':':<40} {row[1]}")
    lines.append("=" * width)
    return "\n".join(lines)


def format_table(results: list[BenchResult]) -> str:
    """A Markdown table, one row per run (latencies in milliseconds)."""
    header = (
        "| concurrency | requests | req/s | out tok/s | TTFT mean (ms) | TTFT median (ms) "
        "| TTFT p99 (ms) | TPOT mean (ms) | ITL mean (ms) | ITL p99 (ms) | E2E mean (ms) "
        "| failures |"
    )
    lines = [header, "|" + "---:|" * 12]
    for result in results:
        config = result.config
        concurrency = str(config.concurrency)
        if not math.isinf(config.request_rate):
            concurrency += f" @ {config.request_rate:g} req/s"
        requests = str(config.num_prompts)
        if result.num_cancelled:
            requests += f" ({result.num_cancelled} cancelled)"
        failures = str(result.num_failed)
        if result.failures:
            failures += " (" + ", ".join(f"{k}: {n}" for k, n in result.failures.items()) + ")"
        cells = [
            concurrency,
            requests,
            f"{result.request_throughput:.2f}",
            f"{result.output_throughput:.1f}",
            _fmt_ms(result.ttft, "mean"),
            _fmt_ms(result.ttft, "median"),
            _fmt_ms(result.ttft, "p99"),
            _fmt_ms(result.tpot, "mean"),
            _fmt_ms(result.itl, "mean"),
            _fmt_ms(result.itl, "p99"),
            _fmt_ms(result.e2e, "mean"),
            failures,
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _optional_length(text: str) -> int | None:
    return None if text.strip().lower() in ("none", "") else int(text)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `kvserve bench`."""
    defaults = BenchConfig()
    parser.add_argument(
        "--url", default=defaults.url, help="server base URL, optionally ending in /v1"
    )
    parser.add_argument(
        "--model", default=None, help="model name to send (default: the first at /v1/models)"
    )
    parser.add_argument("--endpoint", choices=("chat", "completions"), default=defaults.endpoint)
    parser.add_argument(
        "--concurrency", type=int, default=defaults.concurrency, help="requests in flight at most"
    )
    parser.add_argument("--num-prompts", type=int, default=defaults.num_prompts)
    parser.add_argument(
        "--input-len", type=int, default=defaults.input_len, help="prompt length in words (~tokens)"
    )
    parser.add_argument(
        "--output-len",
        type=_optional_length,
        default=defaults.output_len,
        help="max_tokens per request; 'none' sends none (the server's default answer length)",
    )
    parser.add_argument(
        "--request-rate",
        type=float,
        default=defaults.request_rate,
        help="Poisson arrivals in requests/s (default inf: all at once, up to --concurrency)",
    )
    parser.add_argument(
        "--cancel-rate",
        type=float,
        default=defaults.cancel_rate,
        help="fraction of requests the client aborts after --cancel-after chunks",
    )
    parser.add_argument("--cancel-after", type=int, default=defaults.cancel_after)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument(
        "--ignore-eos",
        action="store_true",
        help="send ignore_eos so every reply is max_tokens long",
    )
    parser.add_argument(
        "--warmup", type=int, default=defaults.warmup, help="requests sent before measuring"
    )
    parser.add_argument(
        "--timeout", type=float, default=defaults.timeout, help="seconds per request read"
    )
    parser.add_argument(
        "--api-key",
        default=os.environ.get("OPENAI_API_KEY"),
        help="bearer token (default: $OPENAI_API_KEY)",
    )
    parser.add_argument("--json", type=Path, default=None, help="write config, metrics, records")


def run(args: argparse.Namespace) -> int:
    """`kvserve bench`: 0 when some request completed, 1 when none did, 2 on bad arguments."""
    try:
        config = BenchConfig(
            url=args.url,
            model=args.model,
            concurrency=args.concurrency,
            num_prompts=args.num_prompts,
            input_len=args.input_len,
            output_len=args.output_len,
            request_rate=args.request_rate,
            cancel_rate=args.cancel_rate,
            cancel_after=args.cancel_after,
            endpoint=args.endpoint,
            seed=args.seed,
            ignore_eos=args.ignore_eos,
            warmup=args.warmup,
            timeout=args.timeout,
            api_key=args.api_key,
        )
        result = asyncio.run(run_benchmark(config))
    except ValueError as exc:
        print(f"kvserve bench: {exc}", file=sys.stderr)
        return 2
    print(format_report(result))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result.to_dict(), indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0 if result.num_completed else 1
