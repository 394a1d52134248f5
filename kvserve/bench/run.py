"""`make bench`: model, engine and HTTP benchmarks, appended to docs/benchmarks.md.

Each section records the date, the machine, threads and dtype, and the ratios measured in the
same run. The machine must be idle: on a 2-core box any other busy process slows decode many
times over, and the numbers then say nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx

# The admission section's model: a real chat model with a long context, where reserving whole
# answers of chats without max_tokens runs few of them at once.
ADMISSION_MODEL = "qwen2.5-coder:1.5b"


def machine_line() -> str:
    model = platform.processor() or "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    import torch

    from kvserve.model.loader import cpu_has_bf16

    features = "AVX512-BF16" if cpu_has_bf16() else "no native bf16"
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return (
        f"{model}, {os.cpu_count()} cores ({features}), torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '-')}"
        f", GOMP_SPINCOUNT={os.environ.get('GOMP_SPINCOUNT', '-')}, load average at start {load:.2f}"
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until_ready(server: subprocess.Popen, url: str, timeout: float = 300.0) -> None:
    """Poll `url`/ready until 200; RuntimeError if the server exits or the time runs out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"server exited with {server.returncode}")
        try:
            if httpx.get(url + "/ready", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError("server did not become ready")


# Every answer under this schema is longer than the benchmark's 128 output tokens (at least 100
# notes), so constrained and free requests produce the same number of tokens; its masks mix
# free strings, enums and bounded integers.
BENCH_SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 40},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
        "notes": {
            "type": "array",
            "minItems": 100,
            "items": {
                "type": "object",
                "properties": {
                    "day": {"type": "integer", "minimum": 1, "maximum": 31},
                    "text": {"type": "string", "maxLength": 60},
                },
                "required": ["day", "text"],
            },
        },
    },
    "required": ["title", "tags", "notes"],
}
BENCH_FORMAT = {"type": "json_schema", "json_schema": {"name": "notes", "schema": BENCH_SCHEMA}}
CONSTRAINED_CONCURRENCIES = (8, 32)
"""Where `make bench` also measures every request constrained by `BENCH_SCHEMA`."""


def http_bench(
    concurrencies: list[int], dtype: str, quantization: str = "none", kv_cache_dtype: str = "auto"
) -> tuple[str, list]:
    """Start `kvserve serve` on a free loopback port and load it with the load generator; at
    the `CONSTRAINED_CONCURRENCIES` also with every request JSON-schema constrained (the
    constrained results are the ones whose `config.response_format` is set)."""
    from kvserve.bench.loadgen import BenchConfig, format_table, run_benchmark

    with serving(
        "--max-num-seqs",
        str(max(concurrencies)),
        "--dtype",
        dtype,
        "--quantization",
        quantization,
        "--kv-cache-dtype",
        kv_cache_dtype,
    ) as url:
        results = []
        runs = [(c, None) for c in concurrencies]
        runs += [(c, BENCH_FORMAT) for c in concurrencies if c in CONSTRAINED_CONCURRENCIES]
        for concurrency, response_format in runs:
            config = BenchConfig(
                url=url,
                concurrency=concurrency,
                num_prompts=max(4, 2 * concurrency),
                input_len=128,
                output_len=128,
                endpoint="completions",
                ignore_eos=True,
                warmup=1,
                response_format=response_format,
            )
            result = asyncio.run(run_benchmark(config))
            label = " JSON-schema constrained" if response_format else ""
            print(
                f"  HTTP C={concurrency}{label}: {result.output_throughput:.0f} out tok/s",
                flush=True,
            )
            results.append(result)
        free = [r for r in results if r.config.response_format is None]
        return format_table(free), results


@contextlib.contextmanager
def serving(*flags: str, command: str = "serve", timeout: float = 300.0) -> Iterator[str]:
    """`kvserve COMMAND FLAGS` on a free loopback port until ready; yields its URL and stops it
    (SIGINT, as an operator would) after."""
    port = free_port()
    argv = [sys.executable, "-m", "kvserve", command, "--host", "127.0.0.1"]
    argv += ["--port", str(port), *flags]
    url = f"http://127.0.0.1:{port}"
    with running(argv, lambda server: wait_until_ready(server, url, timeout)):
        yield url


@contextlib.contextmanager
def running(
    argv: list[str],
    wait: Callable[[subprocess.Popen], None],
    env: dict[str, str] | None = None,
) -> Iterator[subprocess.Popen]:
    """Run the server `argv` until `wait(process)` returns (its RuntimeError, with the end of
    the server's output, if it fails); yields the process and stops it with SIGINT after. The
    output goes to a temporary file: an unread pipe would stall a server that logs every
    request."""
    with tempfile.TemporaryFile() as log:
        server = subprocess.Popen(
            argv, env=dict(env or os.environ), stdout=log, stderr=subprocess.STDOUT
        )
        try:
            try:
                wait(server)
            except RuntimeError as exc:
                log.seek(0)
                output = log.read().decode(errors="replace")[-3000:]
                raise RuntimeError(f"{exc}: {output}") from None
            yield server
        finally:
            server.send_signal(signal.SIGINT)
            try:
                server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()


def spec_section(args: argparse.Namespace) -> list[str]:
    """Speculative decoding by prompt lookup (kvserve/bench/spec_bench.py): one stream on the
    editing workload and a chat, off against on, then editing requests at once at 1, 8 and 32
    streams; on the default model and each of `--spec-models` (catalogue names pulled first)."""
    from kvserve.bench import spec_bench
    from kvserve.hub.pull_cli import pull_if_missing

    models: list[str | None] = [None]
    for name in filter(None, args.spec_models.split(",")):
        pull_if_missing(name)
        models.append(name)
    lines = [
        "### Speculative decoding, prompt lookup (k = 4), one stream\n",
        *spec_bench.ONE_STREAM_HEADER,
    ]
    for model in models:
        lines += spec_bench.measure(model, runs=3)
    lines += ["", "### Speculative decoding, prompt lookup, many editing streams\n"]
    lines += spec_bench.BATCH_HEADER
    for model in models:
        lines += spec_bench.measure_batches(model, (1, 8, 32), max_tokens=128, runs=1)
    return [*lines, ""]


def viewer_section(args: argparse.Namespace) -> tuple[list[str], dict]:
    """Throughput at 32 concurrent with no viewer and with one on the engine event stream."""
    from kvserve.bench.viewer_bench import format_viewer_bench, run_viewer_bench

    with serving(
        "--max-num-seqs",
        "32",
        "--dtype",
        args.dtype,
        "--quantization",
        args.quantization,
        "--kv-cache-dtype",
        args.kv_cache_dtype,
    ) as url:
        result = run_viewer_bench(url, concurrency=32)
    print(f"  one viewer / none: {result.ratio:.1%}", flush=True)
    lines = [
        "### Watching the engine (`GET /v1/engine/events`, the dashboard's stream)\n",
        format_viewer_bench(result),
        "",
    ]
    return lines, {"ratio": result.ratio, "events": result.num_events}


def embedding_section(args: argparse.Namespace) -> tuple[list[str], dict]:
    """MiniLM through `kvserve serve` next to transformers' BertModel on the same sentences."""
    from kvserve.bench.embedding_bench import (
        EmbeddingBenchResult,
        bench_sentences,
        format_embedding_table,
        reference_seconds,
        server_seconds,
    )
    from kvserve.model.paths import minilm_model_dir

    model_dir = minilm_model_dir()
    sentences = bench_sentences(args.embedding_sentences)
    reference = reference_seconds(model_dir, sentences, batch_size=32)
    with serving(str(model_dir)) as url:
        served = server_seconds(url, sentences, concurrency=8, per_request=args.embedding_batch)
    result = EmbeddingBenchResult(len(sentences), 8, args.embedding_batch, 32, served, reference)
    print(f"  kvserve / transformers: {result.ratio:.2f}x", flush=True)
    lines = [
        f"### Embeddings (`kvserve serve` all-MiniLM-L6-v2, {len(sentences)} sentences of 4-40 "
        "words; transformers in the same run)\n",
        format_embedding_table(result),
        "",
    ]
    return lines, result.to_dict()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="make bench", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--only",
        default="model,engine,http,prefix,bigmodel,viewer,cluster,embeddings,admission,spec",
        help="comma list of sections",
    )
    parser.add_argument(
        "--spec-models",
        default="",
        help="catalogue names or paths the speculative section measures beside the default "
        "model (comma list; e.g. qwen2.5-coder:1.5b)",
    )
    parser.add_argument(
        "--admission-model",
        default=ADMISSION_MODEL,
        help="the model of the admission section (partial against full reservation): a "
        f"catalogue name (pulled first when missing), a path, or 'embedded' (default: "
        f"{ADMISSION_MODEL})",
    )
    parser.add_argument("--admission-concurrency", type=int, default=64)
    parser.add_argument(
        "--admission-prompts", type=int, default=None, help="chats sent (default: the concurrency)"
    )
    parser.add_argument("--admission-kv-memory", default="4GB", help="--kv-cache-memory of both")
    parser.add_argument(
        "--skip-bigmodel",
        action="store_true",
        help="skip the 1B-shaped section (kvserve/bench/bigmodel_bench.py: generates about "
        "2 GB of checkpoints on first use and takes minutes); the report says it was skipped",
    )
    parser.add_argument("--bigmodel-types", default="Q8_0,Q4_0", help="1B-shaped files to measure")
    parser.add_argument(
        "--prefix-requests", type=int, default=16, help="measured requests per shared-prefix run"
    )
    parser.add_argument("--prefix-conversations", type=int, default=8)
    parser.add_argument("--prefix-turns", type=int, default=10)
    parser.add_argument("--concurrency", default="1,8,32,64")
    parser.add_argument(
        "--embedding-sentences", type=int, default=1000, help="sentences the embeddings run sends"
    )
    parser.add_argument(
        "--embedding-batch", type=int, default=16, help="sentences in one embeddings request"
    )
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--quantization", default="auto", help="auto | none | int8 (linear layers)")
    parser.add_argument("--kv-cache-dtype", default="auto", help="auto | model | int8")
    parser.add_argument(
        "--baseline",
        default="none",
        help="also run the engine section with this --quantization (its KV cache in the model's "
        "dtype) and print both side by side; 'off' to skip",
    )
    parser.add_argument("--no-reference", action="store_true", help="skip transformers figures")
    parser.add_argument("--output", default="docs/benchmarks.md")
    parser.add_argument("--json", default=None, help="also write raw results here")
    args = parser.parse_args(argv)
    sections = set(args.only.split(","))
    concurrencies = [int(c) for c in args.concurrency.split(",")]

    from kvserve.bench.engine_bench import (
        format_comparison_table,
        format_engine_table,
        run_engine_bench,
    )
    from kvserve.bench.model_bench import format_model_table, reference_model, run_model_bench
    from kvserve.config import DeviceConfig
    from kvserve.model.loader import load_model

    loaded = load_model(None, DeviceConfig(dtype=args.dtype, quantization=args.quantization))
    from kvserve.model.kv_cache import choose_cache_dtype

    cache_dtype, cache_reason = choose_cache_dtype(args.kv_cache_dtype, loaded.model)
    dtype = str(loaded.dtype).removeprefix("torch.")
    if loaded.model.quantization != "none":
        dtype += f", {loaded.model.quantization} linear layers"
    dtype += f", {str(cache_dtype).removeprefix('torch.')} KV cache"
    chosen = (
        f"--quantization {args.quantization}: {loaded.model.quantization} "
        f"({loaded.quantization_reason}); --kv-cache-dtype {args.kv_cache_dtype}: "
        f"{str(cache_dtype).removeprefix('torch.')} ({cache_reason})"
    )
    stamp = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    out = [
        f"\n## {stamp} — {loaded.name}, {dtype}\n",
        f"Machine: {machine_line()}.\n",
        f"Configuration: {chosen}.\n",
    ]
    raw: dict = {"date": stamp, "machine": machine_line(), "dtype": dtype}
    raw["quantization"], raw["kv_cache_dtype"] = args.quantization, args.kv_cache_dtype
    engine_results = []

    if "model" in sections:
        print("model benchmark...", flush=True)
        result = run_model_bench(
            loaded, with_reference=not args.no_reference, cache_dtype=cache_dtype
        )
        out += ["### Model (forward pass only)\n", format_model_table(result), ""]
        raw["model"] = result.to_dict()
    if "engine" in sections:
        print("engine benchmark...", flush=True)
        from kvserve.model import device_thread

        reference = None if args.no_reference else device_thread.call(reference_model, loaded)
        engine_results = run_engine_bench(
            loaded, tuple(concurrencies), reference=reference, kv_cache_dtype=args.kv_cache_dtype
        )
        del reference
        out += [
            "### Engine (continuous batching, no HTTP; 128-token prompts, 128 output tokens)\n",
            format_engine_table(engine_results),
            "",
        ]
        raw["engine"] = [r.to_dict() for r in engine_results]
        if args.baseline != "off" and args.baseline != loaded.model.quantization:
            print(f"engine benchmark, --quantization {args.baseline}...", flush=True)
            baseline = load_model(None, DeviceConfig(dtype=args.dtype, quantization=args.baseline))
            baseline_results = run_engine_bench(
                baseline, tuple(concurrencies), kv_cache_dtype="model"
            )
            del baseline
            name = f"--quantization {args.baseline}"
            out += [
                f"### Engine: this configuration next to `{name}` (same run)\n",
                format_comparison_table(engine_results, baseline_results, name),
                "",
            ]
            raw["engine_baseline"] = [r.to_dict() for r in baseline_results]
    if "http" in sections:
        print("HTTP benchmark...", flush=True)
        table, results = http_bench(
            concurrencies, args.dtype, args.quantization, args.kv_cache_dtype
        )
        out += [
            "### HTTP (`kvserve bench` against `kvserve serve`, streaming completions)\n",
            table,
            "",
        ]
        raw["http"] = [r.to_dict() | {"records": None} for r in results]
        by_c = {r.concurrency: r for r in engine_results}
        free = {r.config.concurrency: r for r in results if r.config.response_format is None}
        for r in results:
            if r.config.response_format is not None:
                base = free[r.config.concurrency]
                out.append(
                    f"JSON-schema constrained/free at {r.config.concurrency} concurrent: "
                    f"{r.output_throughput / base.output_throughput:.0%} "
                    f"({r.output_throughput:.0f} / {base.output_throughput:.0f} out tok/s, "
                    f"{r.num_completed} / {base.num_completed} requests completed).  "
                )
                continue
            engine = by_c.get(r.config.concurrency)
            if engine is not None:
                out.append(
                    f"HTTP/engine at {r.config.concurrency} concurrent: "
                    f"{r.output_throughput / engine.output_tok_s:.0%} "
                    f"({r.output_throughput:.0f} / {engine.output_tok_s:.0f} out tok/s).  "
                )
        out.append("")

    if "cluster" in sections:
        print("cluster benchmark (ingress + 1 replica against kvserve serve)...", flush=True)
        from kvserve.bench.cluster_bench import format_cluster_table, run_cluster_bench

        rows = run_cluster_bench(
            [c for c in concurrencies if c in (8, 32)] or [8, 32],
            two_replicas=True,
            engine_flags=[
                *("--dtype", args.dtype, "--quantization", args.quantization),
                *("--kv-cache-dtype", args.kv_cache_dtype),
            ],
        )
        out += [
            "### Cluster (`kvserve cluster --replicas 1` against `kvserve serve`, same run; "
            "128-token prompts, 64 output tokens, streaming completions)\n",
            format_cluster_table(rows),
            "",
        ]
        raw["cluster"] = [
            {
                "concurrency": r.concurrency,
                "ratio": r.ratio,
                "direct": r.direct.to_dict() | {"records": None},
                "cluster": r.cluster.to_dict() | {"records": None},
            }
            for r in rows
        ]

    if "prefix" in sections:
        print("prefix cache benchmark...", flush=True)
        from kvserve.bench.prefix_bench import (
            MULTI_TURN_RUNS,
            format_prefix_table,
            run_prefix_bench,
        )

        prefix_results = run_prefix_bench(
            loaded,
            num_requests=args.prefix_requests,
            conversations=args.prefix_conversations,
            turns=args.prefix_turns,
            kv_cache_dtype=args.kv_cache_dtype,
        )
        out += [
            "### Prefix cache (engine, no HTTP; cache on and off in the same run)\n",
            f"Shared prefix: a 1,200-token system prompt, distinct 64-token user turns, 32 output "
            f"tokens, {args.prefix_requests} measured requests after one warm-up. Multi-turn: "
            f"{args.prefix_conversations} conversations of {args.prefix_turns} turns (64-token "
            "user turns, 32-token answers), each turn resending the whole history; the "
            f"conversations move in step, so the workload runs {MULTI_TURN_RUNS} times and the "
            "times are pooled.\n",
            format_prefix_table(prefix_results),
            "",
        ]
        raw["prefix"] = [
            {"workload": r.workload, "cache": r.cache, "ttfts": r.ttfts} for r in prefix_results
        ]

    if "admission" in sections:
        print("admission benchmark (partial against full reservation)...", flush=True)
        from kvserve.bench.admission_bench import format_admission_table, run_admission_bench

        concurrency = args.admission_concurrency
        model = None if args.admission_model == "embedded" else args.admission_model
        runs = run_admission_bench(
            model,
            concurrency=concurrency,
            num_prompts=args.admission_prompts,
            kv_cache_memory=args.admission_kv_memory,
            engine_flags=[
                *("--dtype", args.dtype, "--quantization", args.quantization),
                *("--kv-cache-dtype", args.kv_cache_dtype),
            ],
        )
        name = model or "the embedded model"
        out += [
            f"### Admission: partial reservation against `--admission reserve` ({name}, "
            f"{concurrency} concurrent streamed chats without max_tokens, `--max-num-seqs "
            f"{concurrency} --kv-cache-memory {args.admission_kv_memory}`, temperature 0.7 with a seed "
            "per chat)\n",
            format_admission_table(runs, concurrency),
            "",
        ]
        raw["admission"] = [
            {
                "admission": r.admission,
                "peak_running": r.peak_running,
                "preemptions": r.num_preemptions,
                "peak_blocks_used": r.peak_blocks_used,
                "block_bytes": r.block_bytes,
                "result": r.result.to_dict() | {"records": None},
            }
            for r in runs
        ]

    if "bigmodel" in sections and args.skip_bigmodel:
        print("1B-shaped benchmark: skipped (--skip-bigmodel)", flush=True)
        out += ["### 1B-shaped model\n", "Skipped in this run (`--skip-bigmodel`).", ""]
    elif "bigmodel" in sections:
        print("1B-shaped benchmark...", flush=True)
        from kvserve.bench.bigmodel_bench import run_bigmodel_bench

        big_concurrencies = tuple(c for c in concurrencies if c <= 32) or (1,)
        table, raw["bigmodel"] = run_bigmodel_bench(
            tuple(args.bigmodel_types.split(",")), big_concurrencies
        )
        out += [
            "### 1B-shaped model (synthetic Llama-3.2-1B shape, kvserve/bench/big_model.py)\n",
            table,
            "",
        ]

    if "viewer" in sections:
        print("engine viewer benchmark...", flush=True)
        lines, raw["viewer"] = viewer_section(args)
        out += lines

    if "embeddings" in sections:
        print("embeddings benchmark...", flush=True)
        lines, raw["embeddings"] = embedding_section(args)
        out += lines

    if "spec" in sections:
        print("speculative decoding benchmark...", flush=True)
        out += spec_section(args)

    text = "\n".join(out)
    print(text)
    path = Path(args.output)
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("# Benchmarks\n\nAppended by `make bench`; newest last.\n")
    with path.open("a") as f:
        f.write(text + "\n")
    if args.json:
        Path(args.json).write_text(json.dumps(raw, indent=2, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
