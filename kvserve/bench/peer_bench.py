"""kvserve against llama.cpp's `llama-server` on the same GGUF file, in the same run.

    python -m kvserve.bench.peer_bench MODEL.gguf [--slots 8] [--context-per-slot 2048]
        [--wide 32] [--llama-server PATH]

Both servers get 2 threads and the same context per slot (llama-server `-t 2 -np 8 -c 8*2048`;
kvserve `--max-num-seqs 8 --max-model-len 2048` over a pool of 8 full contexts). Measured:

- start: process start until a first one-token completion is answered (a server that listens
  before its model is loaded is not started until it answers), kvserve's first start with an
  empty prepared-weight cache and its next start (the prepared blocks memory-mapped), its
  sources byte-compiled first, as an installed package and `make serve` have them;
- streams: the load generator (completions, 128-word prompts, 128 tokens, ignore_eos) at 1
  and 8 concurrent: output tok/s and the mean inter-token time;
- memory: each process's resident memory after the 8 streams;
- kvserve at 32 concurrent (`--max-num-seqs 32`), in its default path and with int8 layers.
"""

from __future__ import annotations

import argparse
import asyncio
import compileall
import contextlib
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from kvserve.bench.run import free_port, machine_line, running


@dataclass
class ServerFigures:
    label: str
    start_s: float = 0.0  # process start to a first answered completion
    cached_start_s: float | None = None  # kvserve: the next start, prepared blocks mapped
    rss_bytes: int = 0  # after the 8 streams
    tok_s: dict[int, float] = field(default_factory=dict)  # concurrency -> output tok/s
    itl_ms: dict[int, float] = field(default_factory=dict)  # concurrency -> mean inter-token


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _first_answer(process: subprocess.Popen, url: str, timeout: float = 600.0) -> None:
    """Wait until `url` answers a one-token completion (or the process dies)."""
    deadline = time.monotonic() + timeout
    body = {"prompt": "Hello", "max_tokens": 1}
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode}")
        try:
            models = httpx.get(url + "/v1/models", timeout=2)
            if models.status_code == 200:
                body["model"] = models.json()["data"][0]["id"]
                if httpx.post(url + "/v1/completions", json=body, timeout=60).status_code == 200:
                    return
        except (httpx.HTTPError, KeyError, IndexError, ValueError):
            pass
        time.sleep(0.05)
    raise RuntimeError("the server never answered")


@contextlib.contextmanager
def started(argv: list[str], url: str, env: dict | None = None) -> Iterator[tuple[int, float]]:
    """Run `argv` until it answers; yields (pid, seconds from start to the first answer)."""
    began = time.monotonic()
    with running(argv, lambda process: _first_answer(process, url), env) as process:
        yield process.pid, time.monotonic() - began


def load(url: str, concurrency: int, output_len: int = 128) -> tuple[float, float]:
    """(output tok/s, mean inter-token ms) of the load generator at `concurrency`."""
    from kvserve.bench.loadgen import BenchConfig, run_benchmark

    config = BenchConfig(
        url=url,
        concurrency=concurrency,
        num_prompts=max(2, 2 * concurrency),
        input_len=128,
        output_len=output_len,
        endpoint="completions",
        ignore_eos=True,
        warmup=1,
    )
    result = asyncio.run(run_benchmark(config))
    if result.num_failed:
        raise RuntimeError(f"{result.num_failed} requests failed: {result.failures}")
    return result.output_throughput, result.itl.mean * 1e3 if result.itl else float("nan")


def kvserve_argv(model: str, port: int, slots: int, context: int, *flags: str) -> list[str]:
    return [
        sys.executable, "-m", "kvserve", "serve", model, "--host", "127.0.0.1",
        "--port", str(port), "--max-num-seqs", str(slots), "--max-model-len", str(context),
        "--num-kv-blocks", str(slots * -(-context // 32)), *flags,
    ]  # fmt: skip


def measure_kvserve(
    model: str, slots: int, context: int, concurrencies: tuple[int, ...], label: str, *flags: str
) -> ServerFigures:
    figures = ServerFigures(label)
    with tempfile.TemporaryDirectory(prefix="kvserve-peer-bench-") as prepared:
        env = dict(os.environ, KVSERVE_WEIGHT_CACHE_DIR=prepared)
        for attempt in ("first", "cached"):
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            argv = kvserve_argv(model, port, slots, context, *flags)
            with started(argv, url, env) as (pid, seconds):
                if attempt == "first":
                    figures.start_s = seconds
                    continue
                figures.cached_start_s = seconds
                for concurrency in concurrencies:
                    figures.tok_s[concurrency], figures.itl_ms[concurrency] = load(url, concurrency)
                    print(f"  {label} C={concurrency}: {figures.tok_s[concurrency]:.1f} tok/s, "
                          f"{figures.itl_ms[concurrency]:.1f} ms", flush=True)  # fmt: skip
                figures.rss_bytes = _rss(pid)
    return figures


def measure_peer(
    model: str,
    slots: int,
    context: int,
    concurrencies: tuple[int, ...],
    binary: Path | None = None,
) -> ServerFigures:
    """llama-server's figures; `binary`: another build of it (default: `peer.build`'s)."""
    from kvserve.bench.peer import built_binary, server_argv

    binary = binary or built_binary()
    if binary is None:
        raise RuntimeError("llama-server is not built: python -m kvserve.bench.peer build")
    figures = ServerFigures("llama-server")
    port = free_port()
    argv = server_argv(
        binary, Path(model), port, threads=2, parallel=slots, context=slots * context
    )
    with started(argv, f"http://127.0.0.1:{port}") as (pid, seconds):
        figures.start_s = seconds
        for concurrency in concurrencies:
            url = f"http://127.0.0.1:{port}"
            figures.tok_s[concurrency], figures.itl_ms[concurrency] = load(url, concurrency)
            print(f"  llama-server C={concurrency}: {figures.tok_s[concurrency]:.1f} tok/s, "
                  f"{figures.itl_ms[concurrency]:.1f} ms", flush=True)  # fmt: skip
        figures.rss_bytes = _rss(pid)
    return figures


def run(
    model: str,
    slots: int = 8,
    context: int = 2048,
    wide: int = 32,
    peer_binary: Path | None = None,
) -> list[ServerFigures]:
    """Every figure of the module docstring, peers in turn on the same file."""
    peer = measure_peer(model, slots, context, (1, slots), peer_binary)
    ours = measure_kvserve(model, slots, context, (1, slots), "kvserve")
    results = [peer, ours]
    if wide:
        results.append(measure_kvserve(model, wide, context, (wide,), f"kvserve, {wide} slots"))
        results.append(
            measure_kvserve(
                model, wide, context, (wide,), f"kvserve int8, {wide} slots",
                "--quantization", "int8",
            )
        )  # fmt: skip
    return results


def format_report(model: str, results: list[ServerFigures], slots: int) -> str:
    peer, ours = results[0], results[1]
    lines = [
        f"Model: `{Path(model).name}` ({Path(model).stat().st_size / 2**20:,.0f} MiB).",
        "",
        "| | " + " | ".join(r.label for r in results) + " |",
        "| --- |" + " ---: |" * len(results),
    ]

    def row(name: str, values: list[str]) -> None:
        lines.append(f"| {name} | " + " | ".join(values) + " |")

    row("start, to a first answer", [f"{r.start_s:.1f} s" for r in results])
    row(
        "next start (prepared blocks mapped)",
        ["—" if r.cached_start_s is None else f"{r.cached_start_s:.1f} s" for r in results],
    )
    row("resident memory after the streams", [f"{r.rss_bytes / 2**20:,.0f} MiB" for r in results])
    for c in sorted({c for r in results for c in r.tok_s}):
        row(
            f"{c} stream{'s' if c > 1 else ''}: out tok/s (inter-token)",
            [f"{r.tok_s[c]:.1f} ({r.itl_ms[c]:.1f} ms)" if c in r.tok_s else "—" for r in results],
        )
    lines += [
        "",
        "Ratios, same run: single-stream inter-token kvserve / llama-server "
        f"{ours.itl_ms[1] / peer.itl_ms[1]:.2f}; {slots} streams kvserve / llama-server "
        f"{ours.tok_s[slots] / peer.tok_s[slots]:.2f}x; resident memory "
        f"{ours.rss_bytes / peer.rss_bytes:.2f}x.",
    ]
    if len(results) >= 4:
        wide = max(results[2].tok_s)
        lines.append(
            f"At {wide} streams: {results[2].tok_s[wide]:.1f} tok/s on the file's blocks, "
            f"{results[3].tok_s[wide]:.1f} with int8 layers "
            f"({results[2].tok_s[wide] / results[3].tok_s[wide]:.2f}x)."
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model", help="a GGUF file (or a catalogue name already pulled)")
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--context-per-slot", type=int, default=2048)
    parser.add_argument("--wide", type=int, default=32, help="kvserve's many-stream run (0: off)")
    parser.add_argument(
        "--llama-server",
        type=Path,
        default=None,
        help="a llama-server binary built another way (default: python -m kvserve.bench.peer "
        "build's), e.g. without a path that fails on this machine",
    )
    args = parser.parse_args(argv)
    from kvserve.model.paths import resolve_model_path

    model = str(resolve_model_path(args.model))
    print(machine_line(), flush=True)
    # Where PYTHONDONTWRITEBYTECODE is set, every start would compile kvserve's sources anew.
    compileall.compile_dir(Path(__file__).parents[1], quiet=1)
    results = run(model, args.slots, args.context_per_slot, args.wide, args.llama_server)
    print(format_report(model, results, args.slots))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
