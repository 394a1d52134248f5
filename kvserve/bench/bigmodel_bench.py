"""The 1B-shaped benchmark: start times, throughput and the memory-bandwidth bound of decode.

For the synthetic Llama-3.2-1B-shaped checkpoint (kvserve/bench/big_model.py) in Q8_0 and
Q4_0, and for the default model:

- start: `load_model` in a fresh process, first with an empty prepared-weight cache (the
  weights are prepared and written), then again (they are memory-mapped). Both the loader's
  own time and the whole process (interpreter and imports included) are reported;
- the engine at 1, 8 and 32 concurrent requests (kvserve/bench/engine_bench.py, fewer and
  shorter requests than the engine section, to keep the run short): output tok/s and the
  single stream's inter-token time;
- the bytes of weights one decode step reads (with int8 weights: every product's panels, scales
  and corrections, the int8 lm_head and the two residual rotations; with `--quantization q4`:
  the packed 4-bit blocks, the int8 lm_head and its rotation), against what reading the file's
  blocks would take, and the batch-1 bound each gives at the memory bandwidth measured in the
  same run (a sum over a 1 GiB buffer on every thread).

The Q4_0 file runs twice: int8 (what `auto` picks) and q4 (its blocks kept in memory).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

# Targets for the 1B-shaped Q4_0 file (docs/benchmarks.md).
TARGET_FIRST_START_S = 10.0
TARGET_CACHED_START_S = 3.0
TARGET_ITL_MS = 16.0
TARGET_TOK_S_32 = 180.0


@dataclass
class StartResult:
    label: str
    file_bytes: int
    first_load_s: float  # load_model, empty cache: prepared and written
    first_process_s: float  # process start to loaded, same run
    cached_load_s: float  # load_model, prepared weights memory-mapped
    cached_process_s: float
    statuses: tuple[str, str]  # what the cache did each time ("written", "hit")


@dataclass
class DecodeResult:
    label: str
    weight_bytes_per_step: int  # the prepared weights as the decode step reads them
    block_bytes_per_step: int  # the same products read as the file's blocks
    bandwidth: float = 0.0  # bytes/s, measured just before this file's decode runs
    tok_s: dict[int, float] = field(default_factory=dict)  # concurrency -> output tok/s
    itl_ms: dict[int, float] = field(default_factory=dict)  # concurrency -> inter-token ms


def measure_bandwidth(nbytes: int = 1 << 30, repeats: int = 5) -> float:
    """Read bandwidth in bytes/s: the best of `repeats` sums over an `nbytes` float32 buffer,
    on torch's threads (those inference uses)."""
    buffer = torch.ones(nbytes // 4, dtype=torch.float32)
    buffer.sum()
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        buffer.sum()
        best = min(best, time.perf_counter() - started)
    del buffer
    return nbytes / best


def timed_start(
    model: str | None, cache_dir: Path, quantization: str = "auto"
) -> tuple[float, float, str]:
    """(load_model seconds, process seconds, cache status) of loading `model` in a new
    process with `cache_dir` as the prepared-weight cache."""
    env = dict(os.environ, KVSERVE_WEIGHT_CACHE_DIR=str(cache_dir))
    command = [sys.executable, "-m", "kvserve.bench.bigmodel_bench", "--start", model or ""]
    command += ["--quantization", quantization]
    started = time.perf_counter()
    result = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    process_s = time.perf_counter() - started
    if result.returncode != 0:
        raise RuntimeError(f"loading {model} failed:\n{result.stderr[-3000:]}")
    report = json.loads(result.stdout.strip().splitlines()[-1])
    return report["load_seconds"], process_s, report["weight_cache"]


def measure_starts(
    label: str, model: str | None, file_bytes: int, quantization: str = "auto"
) -> StartResult:
    """First (empty cache) and cached start of `model`, each in a fresh process."""
    cache_dir = Path(tempfile.mkdtemp(prefix="kvserve-bench-prepared-"))
    try:
        first = timed_start(model, cache_dir, quantization)
        cached = timed_start(model, cache_dir, quantization)
    finally:
        shutil.rmtree(cache_dir, ignore_errors=True)
    return StartResult(
        label, file_bytes, first[0], first[1], cached[0], cached[1], (first[2], cached[2])
    )


def block_bytes(path: Path) -> int:
    """Bytes of the file's matrices (every layer's products and the tied embedding, which is
    the lm_head): what one decode step reads if it reads the blocks as they are stored."""
    from kvserve.model.gguf import read_header

    return sum(t.nbytes for t in read_header(path).tensors if len(t.shape) == 2)


def measure_decode(
    label: str,
    path: Path,
    concurrencies: tuple[int, ...],
    output_len: int,
    quantization: str = "auto",
) -> DecodeResult:
    """The engine on `path` (int8 or q4 weights, prepared in a temporary directory)."""
    from kvserve.bench.engine_bench import measure_engine
    from kvserve.config import DeviceConfig
    from kvserve.model.loader import load_model

    with tempfile.TemporaryDirectory(prefix="kvserve-bench-prepared-") as cache_dir:
        loaded = load_model(
            str(path),
            DeviceConfig(device="cpu", weight_cache_dir=cache_dir, quantization=quantization),
        )
        model = loaded.model
        if model.quantization == "none":
            raise RuntimeError(f"{label}: expected int8 or q4, got {model.quantization}")
        # The machine's load changes within a run: the bound uses the bandwidth of the moment.
        result = DecodeResult(
            label, model.weight_bytes_per_step, block_bytes(path), measure_bandwidth()
        )
        for concurrency in concurrencies:
            engine = measure_engine(
                loaded,
                concurrency,
                input_len=128,
                output_len=output_len,
                max_num_seqs=max(concurrencies),
                num_requests=max(2, concurrency),
            )
            result.tok_s[concurrency] = engine.output_tok_s
            result.itl_ms[concurrency] = engine.itl_mean * 1e3
            print(
                f"  {label} C={concurrency}: {engine.output_tok_s:.0f} out tok/s, "
                f"inter-token {engine.itl_mean * 1e3:.1f} ms",
                flush=True,
            )
        del loaded
    return result


def _mib(n: int) -> str:
    return f"{n / 2**20:.0f} MiB"


def format_report(
    bandwidth: float, starts: list[StartResult], decodes: list[DecodeResult], output_len: int
) -> str:
    gbs = bandwidth / 1e9
    lines = [
        f"Memory bandwidth measured at the start of this run: {gbs:.1f} GB/s (sum over a 1 GiB "
        f"buffer, {torch.get_num_threads()} threads; again before each file's decode).\n",
        "#### Start (fresh process each; first: empty prepared-weight cache, then cached)\n",
        "| model | file | first start: load / process (s) | cached start: load / process (s) "
        "| cache |",
        "| --- | ---: | ---: | ---: | --- |",
    ]
    for s in starts:
        lines.append(
            f"| {s.label} | {_mib(s.file_bytes)} | {s.first_load_s:.1f} / "
            f"{s.first_process_s:.1f} | {s.cached_load_s:.1f} / {s.cached_process_s:.1f} | "
            f"{' then '.join(s.statuses)} |"
        )
    if decodes:
        concurrencies = sorted(decodes[0].tok_s)
        lines += [
            "",
            f"#### Decode through the engine (128-token prompts, {output_len} output tokens, "
            "int8 KV cache)\n",
            "| file, weights | weights read per step | as file blocks | bandwidth (GB/s) "
            "| batch-1 bound, read / blocks (ms) | 1-stream inter-token (ms) | "
            + " | ".join(f"out tok/s @{c}" for c in concurrencies)
            + " |",
            "| --- | ---: | ---: | ---: | ---: | ---: | "
            + " | ".join("---:" for _ in concurrencies)
            + " |",
        ]
        for d in decodes:
            measured = d.bandwidth or bandwidth
            bound = d.weight_bytes_per_step / measured * 1e3
            block_bound = d.block_bytes_per_step / measured * 1e3
            lines.append(
                f"| {d.label} | {_mib(d.weight_bytes_per_step)} | "
                f"{_mib(d.block_bytes_per_step)} | {measured / 1e9:.1f} | "
                f"{bound:.1f} / {block_bound:.1f} | "
                f"{d.itl_ms.get(1, float('nan')):.1f} | "
                + " | ".join(f"{d.tok_s.get(c, float('nan')):.0f}" for c in concurrencies)
                + " |"
            )
    lines.append("")
    lines += _verdicts(starts, decodes)
    return "\n".join(lines)


def _verdicts(starts: list[StartResult], decodes: list[DecodeResult]) -> list[str]:
    out = []
    for s in starts:
        if "Q4_0" in s.label:
            out.append(
                f"Targets, {s.label}: first start {s.first_load_s:.1f} s "
                f"(target <= {TARGET_FIRST_START_S:.0f} s: "
                f"{'met' if s.first_load_s <= TARGET_FIRST_START_S else 'missed'}), cached "
                f"start {s.cached_load_s:.1f} s (target <= {TARGET_CACHED_START_S:.0f} s: "
                f"{'met' if s.cached_load_s <= TARGET_CACHED_START_S else 'missed'}; the whole "
                f"process {s.cached_process_s:.1f} s).  "
            )
    for d in decodes:
        if "Q4_0" in d.label and 1 in d.itl_ms:
            out.append(
                f"Targets, {d.label}: 1-stream inter-token {d.itl_ms[1]:.1f} ms (target <= "
                f"{TARGET_ITL_MS:.0f} ms: {'met' if d.itl_ms[1] <= TARGET_ITL_MS else 'missed'})"
                + (
                    f", {d.tok_s[32]:.0f} tok/s at 32 streams (target >= "
                    f"{TARGET_TOK_S_32:.0f}: {'met' if d.tok_s[32] >= TARGET_TOK_S_32 else 'missed'})"
                    if 32 in d.tok_s
                    else ""
                )
                + ".  "
            )
    return out


def run_bigmodel_bench(
    quant_types: tuple[str, ...] = ("Q8_0", "Q4_0"),
    concurrencies: tuple[int, ...] = (1, 8, 32),
    *,
    output_len: int = 64,
    with_default: bool = True,
) -> tuple[str, dict]:
    """Generate the 1B-shaped files if needed, measure, and return (markdown, raw figures)."""
    from kvserve.bench.big_model import LLAMA_1B_SHAPED, generate
    from kvserve.model.paths import default_model_path

    bandwidth = measure_bandwidth()
    print(f"  memory bandwidth {bandwidth / 1e9:.1f} GB/s", flush=True)
    started = time.perf_counter()
    paths = generate(LLAMA_1B_SHAPED, quant_types)
    print(f"  1B-shaped files ready in {time.perf_counter() - started:.0f} s", flush=True)
    starts = []
    if with_default:
        default = default_model_path()
        starts.append(measure_starts("SmolLM2-135M (default)", None, default.stat().st_size))
    # (label, file, --quantization): the Q4_0 file with int8 weights and with its blocks kept
    runs = [(f"1B-shaped {q}, int8", path, "auto") for q, path in paths.items()]
    runs += [(f"1B-shaped {q}, q4", path, "q4") for q, path in paths.items() if q == "Q4_0"]
    for label, path, quantization in runs:
        starts.append(measure_starts(label, str(path), path.stat().st_size, quantization))
        print(f"  start {starts[-1]}", flush=True)
    decodes = [
        measure_decode(label, path, concurrencies, output_len, quantization)
        for label, path, quantization in runs
    ]
    raw = {
        "bandwidth_bytes_s": bandwidth,
        "starts": [asdict(s) for s in starts],
        "decodes": [asdict(d) for d in decodes],
    }
    return format_report(bandwidth, starts, decodes, output_len), raw


def _start_main(model: str, quantization: str) -> int:
    """One timed load (see `timed_start`): prints its figures as JSON."""
    from kvserve.config import DeviceConfig
    from kvserve.model.loader import load_model

    loaded = load_model(model or None, DeviceConfig(device="cpu", quantization=quantization))
    print(json.dumps({"load_seconds": loaded.load_seconds, "weight_cache": loaded.weight_cache}))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--start", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--quantization", default="auto", help=argparse.SUPPRESS)
    parser.add_argument("--types", default="Q8_0,Q4_0")
    parser.add_argument("--concurrency", default="1,8,32")
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--no-default", action="store_true", help="skip the default's starts")
    args = parser.parse_args(argv)
    if args.start is not None:
        return _start_main(args.start, args.quantization)
    text, _ = run_bigmodel_bench(
        tuple(args.types.split(",")),
        tuple(int(c) for c in args.concurrency.split(",")),
        output_len=args.output_len,
        with_default=not args.no_default,
    )
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
