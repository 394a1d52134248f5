"""The quality benchmark (`python -m kvserve.bench.quality`) on a short slice of its text."""

from __future__ import annotations

import math

import pytest

from kvserve.bench import quality
from kvserve.model import device_thread
from kvserve.model.kernels import load_kernels

needs_kernels = pytest.mark.skipif(
    not load_kernels().int8_gemm_isa, reason="needs the C kernels and AVX512-VNNI or AVX2"
)


def test_the_text_is_a_few_thousand_tokens_and_fits_the_context(loaded_fp32):
    text = quality.quality_text()
    assert text == quality.quality_text()  # the same text every run
    num_tokens = len(loaded_fp32.tokenizer.encode(text))
    assert 2_000 <= num_tokens <= 8_000, num_tokens
    assert num_tokens <= loaded_fp32.config.max_position_embeddings


def test_chunks_read_the_earlier_positions_from_the_cache(loaded_fp32):
    """The same 300 tokens in one forward and in chunks of 100 (ending mid-block, each
    attending to earlier chunks through the paged cache) score the same."""
    ids = loaded_fp32.tokenizer.encode(quality.quality_text())[:300]
    model = loaded_fp32.model
    whole = device_thread.call(quality.score_tokens, model, ids, chunk_size=300)
    chunked = device_thread.call(quality.score_tokens, model, ids, chunk_size=100)
    assert len(whole.nll) == len(chunked.nll) == 299
    assert chunked.agreement(whole) >= 0.99
    assert math.isclose(chunked.perplexity, whole.perplexity, rel_tol=1e-3)
    # and a chunk that could not see the earlier ones predicts worse: context matters
    alone = device_thread.call(quality.score_tokens, model, ids[200:], chunk_size=100)
    assert alone.nll[:20].mean() > chunked.nll[200:220].mean()


@needs_kernels
def test_float32_and_int8_rows_are_sane(loaded_fp32, loaded_int8):
    configs = [quality.FLOAT32, quality.INT8_LINEAR]
    loaded = {quality.FLOAT32.name: loaded_fp32, quality.INT8_LINEAR.name: loaded_int8}
    rows = quality.measure_quality(
        configs, max_tokens=300, chunk_size=128, baseline=quality.FLOAT32.name, loaded=loaded
    )
    exact, int8 = rows
    assert [r.name for r in rows] == ["float32", "int8 linear"]
    assert exact.num_tokens == int8.num_tokens == 300
    assert exact.agreement_pct == 100.0 and exact.vs_baseline_pct == 0.0
    # documentation prose under a 135M model: a perplexity well above 1, far below the vocab
    assert 1.5 < exact.perplexity < 100, exact.perplexity
    assert math.isfinite(int8.perplexity)
    assert abs(int8.perplexity / exact.perplexity - 1) < 0.05
    assert int8.vs_baseline_pct == pytest.approx(100 * (int8.perplexity / exact.perplexity - 1))
    assert 85 <= int8.agreement_pct < 100, int8.agreement_pct
    table = quality.format_quality_table(rows, baseline="float32")
    assert "| int8 linear |" in table and f"{int8.agreement_pct:.1f}%" in table


def test_missing_reference_leaves_the_columns_empty(loaded_fp32):
    rows = quality.measure_quality(
        [quality.FLOAT32],
        max_tokens=40,
        reference="bf16",
        loaded={quality.FLOAT32.name: loaded_fp32},
    )
    assert rows[0].agreement_pct is None and rows[0].vs_baseline_pct is None
    assert "| float32 |" in (table := quality.format_quality_table(rows))
    assert "| — | — |" in table


def test_configurations_whose_kernels_are_missing_are_named_with_the_reason(kernels):
    """`make bench` on a CPU without VNNI runs what it can and says what it left out."""
    import copy

    avx2 = copy.copy(kernels)  # what a CPU with AVX2 and no AVX512 reports
    avx2.kv_int8, avx2.int8_gemm_isa, avx2.q4 = False, "AVX2", False
    reasons = {c.name: quality.missing_kernels(c, avx2) for c in quality.CONFIGS}
    assert reasons["float32"] is None and reasons["bf16"] is None
    assert reasons["int8 linear"] is None and reasons["int8 linear, float32"] is None
    assert reasons["int8 KV cache"] == "the int8 KV cache needs AVX512-VNNI"
    assert reasons["int8 linear + int8 KV cache"] == "the int8 KV cache needs AVX512-VNNI"
    assert reasons["4-bit blocks"] == "4-bit blocks need AVX512-VNNI"
    avx2.int8_gemm_isa = None
    assert quality.missing_kernels(quality.INT8_LINEAR, avx2) == (
        "int8 linear layers need AVX512-VNNI or AVX2"
    )
