"""Paged attention alone (kvserve/model/csrc/paged_attention.c), per layer of SmolLM2-135M's shape.

    python -m kvserve.bench.attention_bench [--repeats 30]

The shapes a step hands one layer's attention kernel: prefill chunks of 512 rows at several
depths, the multi-turn workload's last turn (8 chunks of 65 rows after 863 cached positions, each
chunk its own table), and decode rows each a sequence of its own. Float32 and bf16 caches with
random contents; the best of `repeats` calls. To compare two versions of the kernel, run this
from each checkout (PYTHONPATH=<checkout>, KVSERVE_CACHE_DIR=<a directory of its own>) in turn.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch

from kvserve.bench.model_bench import best_seconds
from kvserve.model.kernels import CpuKernels, load_kernels

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 32


def _prefill(
    rows: int, start: int, chunks: int, dtype: torch.dtype, kernels: CpuKernels
) -> Callable[[], None]:
    """`chunks` prefill chunks of `rows` rows after `start` positions, each its own table."""
    length = start + rows
    per = -(-length // BLOCK)
    tables = torch.arange(chunks * per).view(chunks, per)
    lengths = torch.arange(start + 1, length + 1).repeat(chunks)
    row_tables = torch.arange(chunks).repeat_interleave(rows)
    return _call(chunks * rows, chunks * per, tables, lengths, row_tables, dtype, kernels)


def _decode(rows: int, length: int, dtype: torch.dtype, kernels: CpuKernels) -> Callable[[], None]:
    """`rows` decode rows, each a sequence of `length` positions."""
    per = -(-length // BLOCK)
    tables = torch.arange(rows * per).view(rows, per)
    return _call(rows, rows * per, tables, torch.full((rows,), length), None, dtype, kernels)


def _call(rows, blocks, tables, lengths, row_tables, dtype, kernels) -> Callable[[], None]:
    generator = torch.Generator().manual_seed(0)
    kv = torch.randn(2, KV_HEADS, blocks, BLOCK, HEAD_DIM, generator=generator).to(dtype)
    q = torch.randn(rows, HEADS, HEAD_DIM, generator=generator).to(dtype)
    out = torch.empty_like(q)
    scale = HEAD_DIM**-0.5
    return lambda: kernels.paged_attention(q, kv, tables, lengths, out, scale, row_tables)


Case = Callable[[torch.dtype, CpuKernels], Callable[[], None]]
CASES: list[tuple[str, Case]] = [
    ("prefill, 512 rows at position 0", lambda d, k: _prefill(512, 0, 1, d, k)),
    ("prefill, 512 rows after 1,536", lambda d, k: _prefill(512, 1536, 1, d, k)),
    ("prefill, 512 rows after 7,488", lambda d, k: _prefill(512, 7488, 1, d, k)),
    ("8 chunks of 65 rows after 863", lambda d, k: _prefill(65, 863, 8, d, k)),
    ("decode, 1 row at 500", lambda d, k: _decode(1, 500, d, k)),
    ("decode, 32 rows at 500", lambda d, k: _decode(32, 500, d, k)),
    ("decode, 32 rows at 2,000", lambda d, k: _decode(32, 2000, d, k)),
]


def run(
    repeats: int = 30, cases=CASES, kernels: CpuKernels | None = None
) -> list[tuple[str, str, float]]:
    """(case, dtype, best milliseconds) for each case in float32 and bf16."""
    kernels = kernels or load_kernels()
    if not kernels.has("attention"):
        raise RuntimeError("the C attention kernels did not build on this machine")
    return [
        (
            name,
            str(dtype).removeprefix("torch."),
            best_seconds(make(dtype, kernels), repeats) * 1e3,
        )
        for name, make in cases
        for dtype in (torch.float32, torch.bfloat16)
    ]


def format_table(results: list[tuple[str, str, float]]) -> str:
    lines = ["| attention, one layer | cache | best of the calls |", "| --- | --- | ---: |"]
    lines += [f"| {name} | {dtype} | {ms:.2f} ms |" for name, dtype, ms in results]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args(argv)
    print(f"threads: {torch.get_num_threads()}")
    print(format_table(run(args.repeats)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
