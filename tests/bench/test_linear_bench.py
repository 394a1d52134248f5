"""The linear-layer benchmark runs both products on the model's shapes and tables each count."""

from __future__ import annotations

import pytest

from kvserve.bench import linear_bench
from kvserve.model.kernels import load_kernels

pytestmark = pytest.mark.skipif(
    not load_kernels().f32_row_product, reason="the float32 row product needs AVX2 and FMA"
)


def test_the_weights_are_a_decode_steps_products():
    weights = linear_bench.model_weights(layers=2, vocab=64)
    assert [tuple(w.shape) for w in weights] == [
        (960, 576), (576, 576), (3072, 576), (576, 1536),
        (960, 576), (576, 576), (3072, 576), (576, 1536),
        (64, 576),
    ]  # fmt: skip


def test_each_row_count_is_timed_for_both_products_and_tabled():
    weights = linear_bench.model_weights(layers=1, vocab=64)
    results = linear_bench.run(repeats=1, rows=(1, 3), weights=weights)
    assert [rows for rows, _, _ in results] == [1, 3]
    assert all(blas > 0 and ours > 0 for _, blas, ours in results)
    table = linear_bench.format_table(results, 10.0).splitlines()
    assert len(table) == 4
    assert table[2].startswith("| 1 | ") and table[3].startswith("| 3 | ")
