"""The speculative bench's run order (kvserve/bench/spec_bench.py)."""

from kvserve.bench.spec_bench import rotated


def test_each_engine_starts_one_run_in_turn_keeping_the_cycle():
    engines = [("off", 0), ("on", 1), ("always", 2)]
    orders = [[key for key, _ in rotated(engines, run)] for run in range(4)]
    assert orders == [
        ["off", "on", "always"],
        ["on", "always", "off"],
        ["always", "off", "on"],
        ["off", "on", "always"],
    ]
    assert [first for first, *_ in orders[:3]] == ["off", "on", "always"]
    assert rotated([], 2) == []
    assert engines == [("off", 0), ("on", 1), ("always", 2)]  # the caller's list is left alone
