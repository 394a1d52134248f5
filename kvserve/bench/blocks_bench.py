"""Products with weights in GGUF block formats (kvserve/model/linear/blocks.py) against the int8
product, on the shapes of Qwen2.5-Coder-1.5B.

    python -m kvserve.bench.blocks_bench [--repeats 5] [--rows 1 8 32] [--layers 28]

One call is one decode step's products, every layer's (28 layers: q|k|v, o, gate|up and
down; hidden 1536, q 1536, k and v 256 each, intermediate 8960), each weight its own tensor, so
the weights stream from memory as in the engine. The block side has Q4_K everywhere but v and
down, which are Q6_K (as a Q4_K_M file has them), 0.85 GB packed; the int8 side the same
shapes in int8 (kvserve_int8_gemm, 1.31 GB). Activations are quantized beforehand on both
sides: the products alone are timed. For each row count, the best of `repeats` calls, their
weight bytes per second, and at 1 row the fraction of the read bandwidth measured just before.
The quality of the block path is measured through the model itself (kvserve/bench/quality.py).
On a CPU with AMX-INT8 the products of 13 rows and more take it; KVSERVE_AMX=0 in the
environment times the vector tiles instead (csrc/blocks_gemm.c, kvserve_blocks_amx).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from kvserve.bench.model_bench import best_seconds
from kvserve.model.block_formats import FORMATS
from kvserve.model.kernels import CpuKernels, load_kernels
from kvserve.model.linear.blocks import BlockLinear, BlockWeight
from kvserve.model.linear.int8 import pack_int8_weight

HIDDEN, Q_SIZE, KV_SIZE, INTERMEDIATE, LAYERS = 1536, 1536, 256, 8960, 28
ROWS = (1, 8, 32)

# One layer of a Q4_K_M file of the 1.5B: (product, [(type, out) per part], in)
LAYER = (
    ("qkv", [("Q4_K", Q_SIZE), ("Q4_K", KV_SIZE), ("Q6_K", KV_SIZE)], HIDDEN),
    ("o", [("Q4_K", HIDDEN)], Q_SIZE),
    ("gate_up", [("Q4_K", INTERMEDIATE), ("Q4_K", INTERMEDIATE)], HIDDEN),
    ("down", [("Q6_K", HIDDEN)], INTERMEDIATE),
)


def random_raw(qtype: str, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Random GGUF blocks [n, row bytes] of `qtype`, with small float16 scales."""
    f = FORMATS[qtype]
    raw = rng.integers(0, 256, (n, k // f.values, f.gguf_bytes), dtype=np.uint8)
    scales = (rng.random((n, k // f.values), dtype=np.float32) * 0.01).astype(np.float16)
    at = 208 if qtype == "Q6_K" else 0
    raw[:, :, at : at + 2] = scales[..., None].view(np.uint8)
    return raw.reshape(n, -1)


@dataclass(slots=True)
class Product:
    """One product of the step, in both forms."""

    name: str
    weight: BlockLinear
    panels: torch.Tensor  # the int8 product's packed weight
    correction: torch.Tensor

    @property
    def k(self) -> int:
        return self.weight.in_features

    @property
    def n(self) -> int:
        return self.weight.out_features


def model_products(
    layers: int = LAYERS, layer=LAYER, seed: int = 0, kernels: CpuKernels | None = None
) -> list[Product]:
    """Every product of `layers` layers, block-packed and int8-packed."""
    kernels = kernels or load_kernels()
    rng = np.random.default_rng(seed)
    generator = torch.Generator().manual_seed(seed)
    products = []
    for _ in range(layers):
        for name, parts, k in layer:
            weight = BlockLinear(
                tuple(BlockWeight.from_raw(q, random_raw(q, n, k, rng), kernels) for q, n in parts)
            )
            int8 = torch.randint(
                -127, 128, (weight.out_features, k), dtype=torch.int8, generator=generator
            )
            panels, correction = pack_int8_weight(int8)
            products.append(Product(name, weight, panels, correction))
    return products


def _step(products: list[Product], rows: int, side: str) -> Callable[[], None]:
    inputs = {k: torch.randn(rows, k) for k in {p.k for p in products}}
    kernels = products[0].weight.kernels
    if side == "blocks":
        acts = {k: kernels.blocks_quantize(x) for k, x in inputs.items()}
        calls = [(p.weight.apply, acts[p.k]) for p in products]
    else:
        q8 = {k: torch.randint(-127, 128, (rows, k), dtype=torch.int8) for k in inputs}

        def int8_call(p: Product) -> Callable[[torch.Tensor], torch.Tensor]:
            return lambda q: kernels.int8_gemm(q, p.panels, p.correction, p.n)

        calls = [(int8_call(p), q8[p.k]) for p in products]

    def call() -> None:
        for fn, x in calls:
            fn(x)

    return call


@dataclass(frozen=True, slots=True)
class Timing:
    rows: int
    blocks_ms: float
    int8_ms: float


def run(products: list[Product], rows=ROWS, repeats: int = 5) -> list[Timing]:
    """The step's products at each row count, block side and int8 side taken in turn."""
    kernels = products[0].weight.kernels
    if not kernels.blocks_isa or not kernels.int8_gemm_isa:
        raise RuntimeError("the block and int8 products need the C kernels and AVX2")
    results = []
    for count in rows:
        ours = best_seconds(_step(products, count, "blocks"), repeats)
        theirs = best_seconds(_step(products, count, "int8"), repeats)
        results.append(Timing(count, ours * 1e3, theirs * 1e3))
    return results


def weight_bytes(products: list[Product]) -> tuple[int, int]:
    """(block bytes, int8 bytes) the step reads."""
    return (
        sum(p.weight.num_bytes for p in products),
        sum(p.panels.numel() + p.correction.numel() * 4 for p in products),
    )


def format_table(
    results: list[Timing], block_bytes: int, int8_bytes: int, bandwidth: float | None = None
) -> str:
    lines = [
        "| rows | blocks (Q4_K/Q6_K) | int8 | int8 / blocks |",
        "| ---: | ---: | ---: | ---: |",
    ]
    for t in results:
        ours = block_bytes / t.blocks_ms / 1e6
        theirs = int8_bytes / t.int8_ms / 1e6
        note = ""
        if bandwidth and t.rows == 1:
            note = f", {ours * 1e9 / bandwidth:.0%} of the read bandwidth"
        lines.append(
            f"| {t.rows} | {t.blocks_ms:.2f} ms ({ours:.1f} GB/s{note}) | "
            f"{t.int8_ms:.2f} ms ({theirs:.1f} GB/s) | {t.int8_ms / t.blocks_ms:.2f}x |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rows", type=int, nargs="+", default=list(ROWS))
    parser.add_argument("--layers", type=int, default=LAYERS)
    args = parser.parse_args(argv)
    from kvserve.bench.bigmodel_bench import measure_bandwidth

    products = model_products(args.layers)
    block_bytes, int8_bytes = weight_bytes(products)
    bandwidth = measure_bandwidth()
    print(
        f"instructions: {load_kernels().blocks_path}, threads: {torch.get_num_threads()}, "
        f"weights: {block_bytes / 1e9:.2f} GB blocks, {int8_bytes / 1e9:.2f} GB int8, "
        f"read bandwidth {bandwidth / 1e9:.1f} GB/s"
    )
    results = run(products, args.rows, args.repeats)
    print(format_table(results, block_bytes, int8_bytes, bandwidth))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
