"""The embeddings benchmark's table states the ratio its target is written in."""

from __future__ import annotations

from kvserve.bench.embedding_bench import (
    EmbeddingBenchResult,
    bench_sentences,
    format_embedding_table,
)


def test_table_gives_server_over_reference() -> None:
    result = EmbeddingBenchResult(1000, 8, 16, 32, server_seconds=2.0, reference_seconds=2.5)
    table = format_embedding_table(result)
    assert (
        "| kvserve `/v1/embeddings`, 8 clients, 16 sentences a request | 1000 | 2.00 | 500 |"
        in table
    )
    assert "| transformers `BertModel`, batches of 32 | 1000 | 2.50 | 400 |" in table
    assert "kvserve / transformers: 1.25x." in table


def test_sentences_are_fixed_by_the_seed_and_of_bounded_length() -> None:
    sentences = bench_sentences(200)
    assert sentences == bench_sentences(200)
    assert sentences != bench_sentences(200, seed=1)
    assert all(4 <= len(s.split()) <= 40 for s in sentences)
