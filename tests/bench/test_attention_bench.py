"""The attention benchmark hands the kernel valid shapes and reports every case."""

from __future__ import annotations

import torch

from kvserve.bench import attention_bench


def test_each_case_runs_in_both_dtypes_and_is_tabled():
    cases = [attention_bench.CASES[3], attention_bench.CASES[4]]  # a multi-chunk prefill, decode
    results = attention_bench.run(repeats=1, cases=cases)
    assert [(name, dtype) for name, dtype, _ in results] == [
        (name, dtype) for name, _ in cases for dtype in ("float32", "bfloat16")
    ]
    assert all(ms > 0 for _, _, ms in results)
    table = attention_bench.format_table(results).splitlines()
    assert len(table) == 2 + len(results)
    assert table[2].startswith("| 8 chunks of 65 rows after 863 | float32 |")


def test_the_multi_turn_case_is_eight_chunks_of_their_own():
    """Rows 0..64 read table 0 with lengths 864..928, rows 65..129 table 1, and so on."""
    seen = {}

    class Spy:
        def paged_attention(self, q, kv, tables, lengths, out, scale, row_tables):
            seen.update(
                rows=q.shape[0], tables=tables.shape[0], lengths=lengths, row_tables=row_tables
            )

    attention_bench._prefill(65, 863, 8, torch.float32, Spy())()
    assert seen["rows"] == 520 and seen["tables"] == 8
    assert seen["lengths"][:65].tolist() == list(range(864, 929))
    assert torch.equal(seen["row_tables"], torch.arange(8).repeat_interleave(65))
