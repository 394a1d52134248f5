"""The prefix cache benchmark's table states the ratios its targets are written in."""

from __future__ import annotations

from kvserve.bench.prefix_bench import PrefixBenchResult, format_prefix_table


def test_table_gives_cache_on_over_off_and_last_turn_over_first() -> None:
    results = [
        PrefixBenchResult("shared prefix, C=1", True, (0.1, 0.2, 0.3), 3600),
        PrefixBenchResult("shared prefix, C=1", False, (0.8, 0.8, 0.9), 0),
        PrefixBenchResult("multi-turn, turn 1", True, (0.2, 0.2), 0),
        PrefixBenchResult("multi-turn, turn 10", True, (0.3, 0.3), 1500),
        PrefixBenchResult("multi-turn, turn 1", False, (0.2, 0.2), 0),
        PrefixBenchResult("multi-turn, turn 10", False, (1.0, 1.0), 0),
    ]
    table = format_prefix_table(results)
    assert "| shared prefix, C=1 | on | 3 | 200 ms | 300 ms | 3600 |" in table
    assert "shared prefix, C=1: TTFT p50 with the cache / without = 0.25." in table
    assert "multi-turn, turn 10: TTFT p50 with the cache / without = 0.30." in table
    assert "multi-turn, cache on: TTFT p50 of turn 10 / turn 1 = 1.50." in table


def test_repeated_multi_turn_runs_give_each_runs_ratio() -> None:
    results = [
        PrefixBenchResult("multi-turn, turn 1", True, (0.2, 0.2, 0.25, 0.25), 0, (0.2, 0.25)),
        PrefixBenchResult("multi-turn, turn 10", True, (0.3, 0.3, 0.3, 0.3), 3000, (0.3, 0.3)),
    ]
    table = format_prefix_table(results)
    # pooled p50s 0.225 and 0.3; runs 0.3 / 0.2 and 0.3 / 0.25
    assert (
        "multi-turn, cache on: TTFT p50 of turn 10 / turn 1 = 1.33 (each run: 1.50, 1.20)." in table
    )
