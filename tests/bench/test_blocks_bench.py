"""The block-format benchmark builds the 1.5B's products in both forms, times each row count and
tables it."""

from __future__ import annotations

import pytest

from kvserve.bench import blocks_bench
from kvserve.model.kernels import load_kernels

pytestmark = pytest.mark.skipif(
    not load_kernels().blocks_isa or not load_kernels().int8_gemm_isa,
    reason="the block and int8 products need AVX2",
)

SMALL = (
    ("qkv", [("Q4_K", 256), ("Q4_K", 32), ("Q6_K", 32)], 256),
    ("down", [("Q6_K", 256)], 512),
)


def test_the_products_are_one_layer_of_the_1_5b_in_both_forms():
    products = blocks_bench.model_products(layers=1)
    shapes = [(p.name, p.weight.qtypes, p.n, p.k) for p in products]
    assert shapes == [
        ("qkv", ("Q4_K", "Q4_K", "Q6_K"), 2048, 1536),
        ("o", ("Q4_K",), 1536, 1536),
        ("gate_up", ("Q4_K", "Q4_K"), 17920, 1536),
        ("down", ("Q6_K",), 1536, 8960),
    ]
    block_bytes, int8_bytes = blocks_bench.weight_bytes(products)
    assert 0.6 < block_bytes / int8_bytes < 0.7  # 4.5 and 6.6 bits a weight against 8


def test_each_row_count_is_timed_and_tabled():
    products = blocks_bench.model_products(layers=1, layer=SMALL)
    results = blocks_bench.run(products, rows=(1, 3), repeats=1)
    assert [t.rows for t in results] == [1, 3]
    assert all(t.blocks_ms > 0 and t.int8_ms > 0 for t in results)
    table = blocks_bench.format_table(results, *blocks_bench.weight_bytes(products), 1e10)
    lines = table.splitlines()
    assert len(lines) == 4 and "of the read bandwidth" in lines[2]
    assert lines[3].startswith("| 3 | ")
