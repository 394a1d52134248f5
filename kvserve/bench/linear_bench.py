"""float32 linear layers at decode's row counts: the BLAS (`F.linear`) against kvserve's row
product (kvserve/model/csrc/f32_gemm.c), on SmolLM2-135M's shapes.

    python -m kvserve.bench.linear_bench [--repeats 5]

One call is what a decode step does: the four products of each of the 30 layers (q|k|v, o,
gate|up, down) and the head (49,152 x 576), every weight its own tensor, 538 MB in all, so
the weights stream from memory as they do in the engine. For each row count, the best of
`repeats` calls of each, taken in turn, and their ratio.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
import torch.nn.functional as F

from kvserve.bench.model_bench import best_seconds
from kvserve.model.kernels import CpuKernels, load_kernels

HIDDEN, INTERMEDIATE, QKV, VOCAB, LAYERS = 576, 1536, 960, 49152, 30
ROWS = (1, 2, 4, 8, 16, 32, 64)


def model_weights(layers: int = LAYERS, vocab: int = VOCAB) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    shapes = [(QKV, HIDDEN), (HIDDEN, HIDDEN), (2 * INTERMEDIATE, HIDDEN), (HIDDEN, INTERMEDIATE)]
    weights = [torch.randn(s, generator=generator) for _ in range(layers) for s in shapes]
    return [*weights, torch.randn(vocab, HIDDEN, generator=generator)]


def _step(weights: list[torch.Tensor], rows: int, product) -> Callable[[], None]:
    inputs = {k: torch.randn(rows, k) for k in {w.shape[1] for w in weights}}
    pairs = [(inputs[w.shape[1]], w) for w in weights]

    def call() -> None:
        for x, w in pairs:
            product(x, w)

    return call


def run(
    repeats: int = 5, rows=ROWS, weights=None, kernels: CpuKernels | None = None
) -> list[tuple[int, float, float]]:
    """(rows, BLAS ms, row product ms) per row count."""
    kernels = kernels or load_kernels()
    if not kernels.f32_row_product:
        raise RuntimeError("the float32 row product needs the C kernels with AVX2 and FMA")
    weights = model_weights() if weights is None else weights
    results = []
    for count in rows:
        blas = _step(weights, count, F.linear)
        ours = _step(weights, count, kernels.f32_gemm)
        results.append(
            (count, best_seconds(blas, repeats) * 1e3, best_seconds(ours, repeats) * 1e3)
        )
    return results


def format_table(results: list[tuple[int, float, float]], megabytes: float) -> str:
    lines = [
        "| rows | BLAS (F.linear) | row product (f32_gemm.c) | BLAS / row product |",
        "| ---: | ---: | ---: | ---: |",
    ]
    for rows, blas, ours in results:
        lines.append(
            f"| {rows} | {blas:.1f} ms ({megabytes / blas:.1f} GB/s) | "
            f"{ours:.1f} ms ({megabytes / ours:.1f} GB/s) | {blas / ours:.2f}x |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    weights = model_weights()
    megabytes = sum(w.numel() for w in weights) * 4 / 1e6
    print(f"threads: {torch.get_num_threads()}, weights: {megabytes:.0f} MB float32")
    print(format_table(run(args.repeats, weights=weights), megabytes))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
