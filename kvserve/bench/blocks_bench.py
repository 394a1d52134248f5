"""Products with weights in GGUF block formats (kvserve/model/blocks.py) against the int8 product,
on the shapes of Qwen2.5-Coder-1.5B; and the precision of 8-bit activation blocks on a real file.

    python -m kvserve.bench.blocks_bench [--repeats 5] [--rows 1 8 32] [--layers 28]
    python -m kvserve.bench.blocks_bench --precision FILE.gguf [--tokens 256]
    python -m kvserve.bench.blocks_bench --quality FILE.gguf [--tokens 2000]

Speed: one call is one decode step's products, every layer's (28 layers: q|k|v, o, gate|up and
down; hidden 1536, q 1536, k and v 256 each, intermediate 8960), each weight its own tensor, so
the weights stream from memory as in the engine. The block side has Q4_K everywhere but v and
down, which are Q6_K (as a Q4_K_M file has them), 0.85 GB packed; the int8 side the same
shapes in int8 (kvserve_int8_gemm, 1.31 GB). Activations are quantized beforehand on both
sides: the products alone are timed. For each row count, the best of `repeats` calls, their
weight bytes per second, and at 1 row the fraction of the read bandwidth measured just before.

Precision (`--precision`): real inputs of a few layers' products, captured from the float32
model on the shipped quality text, multiplied by the file's blocks through the kernel and in
float64 by the dequantized weight: the relative error of each product (the rounding of the
activations to 8-bit blocks, the only rounding the block path adds).

Quality (`--quality`): the whole model scored on the quality text in float32 with its inputs
to every linear layer rounded as activation blocks would round them (blocks of 32 or 256, 8 or
12 bits), then with every layer's products run by the block kernels on the file's own blocks,
against float32 (the dequantized file): perplexity and next-token agreement.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from kvserve.bench.model_bench import best_seconds
from kvserve.model import blocks, native
from kvserve.model.blocks import BlockWeight, FusedBlockWeight

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
    f = blocks.FORMATS[qtype]
    raw = rng.integers(0, 256, (n, k // f.values, f.gguf_bytes), dtype=np.uint8)
    scales = (rng.random((n, k // f.values), dtype=np.float32) * 0.01).astype(np.float16)
    at = 208 if qtype == "Q6_K" else 0
    raw[:, :, at : at + 2] = scales[..., None].view(np.uint8)
    return raw.reshape(n, -1)


@dataclass(slots=True)
class Product:
    """One product of the step, in both forms."""

    name: str
    weight: FusedBlockWeight
    panels: torch.Tensor  # the int8 product's packed weight
    correction: torch.Tensor

    @property
    def k(self) -> int:
        return self.weight.in_features

    @property
    def n(self) -> int:
        return self.weight.out_features


def model_products(layers: int = LAYERS, layer=LAYER, seed: int = 0) -> list[Product]:
    """Every product of `layers` layers, block-packed and int8-packed."""
    rng = np.random.default_rng(seed)
    generator = torch.Generator().manual_seed(seed)
    products = []
    for _ in range(layers):
        for name, parts, k in layer:
            weight = blocks.fuse(
                [BlockWeight.from_raw(q, random_raw(q, n, k, rng)) for q, n in parts]
            )
            int8 = torch.randint(
                -127, 128, (weight.out_features, k), dtype=torch.int8, generator=generator
            )
            panels, correction = native.pack_int8_weight(int8)
            products.append(Product(name, weight, panels, correction))
    return products


def _step(products: list[Product], rows: int, side: str) -> Callable[[], None]:
    inputs = {k: torch.randn(rows, k) for k in {p.k for p in products}}
    if side == "blocks":
        acts = {k: blocks.quantize(x) for k, x in inputs.items()}
        calls = [(p.weight.apply_blocks, acts[p.k]) for p in products]
    else:
        q8 = {k: torch.randint(-127, 128, (rows, k), dtype=torch.int8) for k in inputs}

        def int8_call(p: Product) -> Callable[[torch.Tensor], torch.Tensor]:
            return lambda q: native.int8_gemm(q, p.panels, p.correction, p.n)

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
    if not blocks.available() or not native.int8_gemm_available():
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


# -- precision on a real file ---------------------------------------------------------------------

_PRODUCTS = {
    "qkv": (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), 0),
    "o": (("self_attn.o_proj",), 1),
    "gate_up": (("mlp.gate_proj", "mlp.up_proj"), 2),
    "down": (("mlp.down_proj",), 3),
}


@dataclass(frozen=True, slots=True)
class TensorError:
    layer: int
    product: str
    types: str
    rows: int
    relative: float  # |ours - float64| / |float64|, Frobenius, over the captured rows
    worst_row: float  # the same, for the worst row


def _load_float(path: Path):
    from kvserve.config import DeviceConfig
    from kvserve.model.loader import load_model

    return load_model(str(path), DeviceConfig(device="cpu", dtype="float32", quantization="none"))


def precision_report(path: Path, tokens: int = 256, layers=None) -> list[TensorError]:
    """Per product of the chosen layers (default: first, middle, last), the relative error of
    the block product on the real inputs of `tokens` tokens of the quality text."""
    from kvserve.bench.quality import quality_text, score_tokens
    from kvserve.model.gguf import GGUFCheckpoint

    loaded = _load_float(path)
    model = loaded.model
    count = model.config.num_layers
    layers = sorted({0, count // 2, count - 1} if layers is None else set(layers))
    captured: dict[tuple[int, int], list[torch.Tensor]] = {}

    class Capture:
        def __init__(self, linear, key) -> None:
            self.linear, self.key = linear, key

        def __call__(self, x: torch.Tensor) -> torch.Tensor:
            captured.setdefault(self.key, []).append(x.detach().float().clone())
            return self.linear(x)

    original = list(model.projections)
    for index in layers:
        model.projections[index] = tuple(
            Capture(linear, (index, slot)) for slot, linear in enumerate(original[index])
        )
    try:
        score_tokens(model, loaded.tokenizer.encode(quality_text())[:tokens])
    finally:
        model.projections[:] = original
    del loaded, model
    checkpoint = GGUFCheckpoint(path)
    report = []
    for index in layers:
        for product, (names, slot) in _PRODUCTS.items():
            weight = blocks.fused_from_checkpoint(
                checkpoint, [f"model.layers.{index}.{n}.weight" for n in names]
            )
            x = torch.cat(captured[(index, slot)])
            ours = weight.apply(x).double()
            exact = x.double() @ weight.dequantize().double().T
            per_row = (ours - exact).norm(dim=1) / exact.norm(dim=1).clamp_min(1e-30)
            report.append(
                TensorError(
                    index,
                    product,
                    "/".join(weight.qtypes),
                    x.shape[0],
                    float((ours - exact).norm() / exact.norm()),
                    float(per_row.max()),
                )
            )
    return report


def format_precision(report: list[TensorError]) -> str:
    lines = [
        "| layer | product | types | rows | relative error | worst row |",
        "| ---: | --- | --- | ---: | ---: | ---: |",
    ]
    for e in report:
        lines.append(
            f"| {e.layer} | {e.product} | {e.types} | {e.rows} | {e.relative:.2e} | "
            f"{e.worst_row:.2e} |"
        )
    return "\n".join(lines)


def rounded_blocks(x: torch.Tensor, block: int, levels: int) -> torch.Tensor:
    """x [rows, k] as activation blocks of `block` values and `levels` steps each side of 0
    would give it back (127: 8 bits; 2032: the 4-bit path's 12 bits), in float32."""
    rows, k = x.shape
    block = block if k % block == 0 else 32
    v = x.float().reshape(rows, k // block, block)
    top = v.abs().amax(-1, keepdim=True)
    # the kernel's arithmetic: p = round-half-even(v * (levels / top)), value = p * (top / levels)
    inverse = torch.where(top > 0, levels / top, torch.zeros_like(top))
    return (torch.round(v * inverse) * (top / levels)).reshape(rows, k)


SCHEMES = (("8 bits / 32", 32, 127), ("8 bits / 256", 256, 127), ("12 bits / 32", 32, 2032))


def block_projections(checkpoint, config, fine: bool = False) -> list[tuple]:
    """Every layer's four products (q|k|v with its bias, o, gate|up, down) as the block
    kernels run them (12-bit activations with `fine`), in the order and with the calls of
    `LlamaModel.projections`."""
    layers = []
    for index in range(config.num_layers):
        prefix = f"model.layers.{index}."
        products = []
        for names, _ in _PRODUCTS.values():
            biases = None
            if config.attention_bias and names[0] == "self_attn.q_proj":
                biases = [prefix + n + ".bias" for n in names]
            weight = blocks.fused_from_checkpoint(
                checkpoint, [prefix + n + ".weight" for n in names], biases
            )
            products.append(lambda x, w=weight: w.apply(x.float().contiguous(), fine))
        layers.append(tuple(products))
    return layers


def emulated_quality(
    path: Path, tokens: int = 2000, schemes=SCHEMES, kernels: bool = True
) -> list[tuple]:
    """(configuration, perplexity, vs float32 in %, next-token agreement in %): float32, then
    every linear layer's input rounded by each scheme, then (with `kernels`) every layer's
    products run by the block kernels on the file's blocks, with 8- and 12-bit activations."""
    from kvserve.bench.quality import quality_text, score_tokens
    from kvserve.model.gguf import GGUFCheckpoint

    loaded = _load_float(path)
    model = loaded.model
    ids = loaded.tokenizer.encode(quality_text())[:tokens]
    exact = score_tokens(model, ids)
    rows = [("float32", exact.perplexity, 0.0, 100.0)]
    original = list(model.projections)

    def rounding(linear, block, levels):
        return lambda x: linear(rounded_blocks(x, block, levels))

    configurations = [
        (name, [tuple(rounding(linear, b, n) for linear in layer) for layer in original])
        for name, b, n in schemes
    ]
    if kernels:
        checkpoint = GGUFCheckpoint(path)
        for fine in (False, True):
            configurations.append(
                (
                    f"block kernels, {12 if fine else 8} bits / 32",
                    block_projections(checkpoint, model.config, fine),
                )
            )
    for name, projections in configurations:
        model.projections[:] = projections
        try:
            got = score_tokens(model, ids)
        finally:
            model.projections[:] = original
        rows.append(
            (
                name,
                got.perplexity,
                100 * (got.perplexity / exact.perplexity - 1),
                100 * got.agreement(exact),
            )
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rows", type=int, nargs="+", default=list(ROWS))
    parser.add_argument("--layers", type=int, default=LAYERS)
    parser.add_argument("--precision", type=Path, help="a GGUF file: per-product errors")
    parser.add_argument("--quality", type=Path, help="a GGUF file: emulated perplexity")
    parser.add_argument("--tokens", type=int, default=None)
    args = parser.parse_args(argv)
    if args.precision:
        print(format_precision(precision_report(args.precision, args.tokens or 256)))
        return 0
    if args.quality:
        print("| activations | perplexity | vs float32 | agreement |")
        print("| --- | ---: | ---: | ---: |")
        for name, ppl, delta, agree in emulated_quality(args.quality, args.tokens or 2000):
            print(f"| {name} | {ppl:.4f} | {delta:+.3f}% | {agree:.2f}% |")
        return 0
    from kvserve.bench.bigmodel_bench import measure_bandwidth

    products = model_products(args.layers)
    block_bytes, int8_bytes = weight_bytes(products)
    bandwidth = measure_bandwidth()
    print(
        f"instructions: {blocks.isa()}, threads: {torch.get_num_threads()}, "
        f"weights: {block_bytes / 1e9:.2f} GB blocks, {int8_bytes / 1e9:.2f} GB int8, "
        f"read bandwidth {bandwidth / 1e9:.1f} GB/s"
    )
    results = run(products, args.rows, args.repeats)
    print(format_table(results, block_bytes, int8_bytes, bandwidth))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
