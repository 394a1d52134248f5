"""The routing rule and the metrics merge, without Ray or a model (milliseconds)."""

from __future__ import annotations

from kvserve.cluster.ingress import merge_metrics
from kvserve.cluster.router import PrefixRouter


def _hashes(*names: str) -> list[bytes]:
    return [name.encode() for name in names]


def test_a_remembered_prefix_goes_where_it_went_before():
    router = PrefixRouter()
    first = router.choose(_hashes("a", "b"), ["r1", "r2"])
    assert first.reason == "balance"
    router.sent(first.order[0], _hashes("a", "b"))
    router.report(first.order[0], running=0, waiting=0)
    again = router.choose(_hashes("a", "b", "c"), ["r1", "r2"])
    assert again.order[0] == first.order[0]
    assert (again.reason, again.matched_blocks) == ("prefix", 2)


def test_the_deepest_remembered_block_wins():
    router = PrefixRouter()
    router.sent("r1", _hashes("a"))
    router.sent("r2", _hashes("a", "b"))  # r2 saw a longer prefix after r1
    router.report("r1", 0, 0)
    router.report("r2", 0, 0)
    assert router.choose(_hashes("a", "b", "c"), ["r1", "r2"]).order[0] == "r2"


def test_a_short_shared_start_is_not_enough_to_follow():
    router = PrefixRouter(min_match=0.5)
    router.sent("r1", _hashes("system"))
    router.report("r1", 0, 0)
    router.report("r2", 0, 0)
    picks = {router.choose(_hashes("system", f"u{i}", f"v{i}"), ["r1", "r2"]) for i in range(4)}
    assert {d.reason for d in picks} == {"balance"}
    assert {d.order[0] for d in picks} == {"r1", "r2"}
    assert router.choose(_hashes("system", "u0"), ["r1", "r2"]).reason == "prefix"  # half


def test_a_busy_holder_loses_to_the_least_loaded_past_the_threshold():
    router = PrefixRouter(load_threshold=2)
    router.sent("r1", _hashes("a"))
    router.report("r1", running=2, waiting=0)
    router.report("r2", running=0, waiting=0)
    assert router.choose(_hashes("a"), ["r1", "r2"]).order[0] == "r1"  # 2 more: within
    router.report("r1", running=2, waiting=1)
    decision = router.choose(_hashes("a"), ["r1", "r2"])
    assert (decision.order, decision.reason) == (("r2", "r1"), "load")


def test_unknown_prompts_take_turns_and_load_counts_what_is_in_flight():
    router = PrefixRouter()
    picks = []
    for _ in range(4):
        decision = router.choose([], ["r1", "r2"])
        picks.append(decision.order[0])
    assert sorted(picks) == ["r1", "r1", "r2", "r2"]
    router.started("r1")
    router.started("r1")
    assert router.choose([], ["r1", "r2"]).order == ("r2", "r1")
    # A late report does not hide what the ingress knows is in flight, nor the reverse.
    router.report("r1", running=0, waiting=0)
    assert router.loads()["r1"] == 2
    router.report("r1", running=2, waiting=3)
    assert router.loads()["r1"] == 5
    router.ended("r1")
    router.ended("r1")
    router.report("r1", running=0, waiting=0)
    assert router.loads()["r1"] == 0


def test_a_dead_replica_is_forgotten_and_the_map_is_bounded():
    router = PrefixRouter(capacity=3)
    router.sent("r1", _hashes("a", "b"))
    router.sent("r2", _hashes("c", "d"))
    assert router.num_remembered == 3  # "a" was evicted first
    assert router.choose(_hashes("c", "d"), ["r1"]).order == ("r1",)  # r2 is not living
    router.forget("r2")
    assert router.num_remembered == 1
    assert router.choose(_hashes("a"), []).order == ()


def test_merged_metrics_label_each_replica_and_keep_families_together():
    text = (
        "# HELP kvserve:x Things.\n# TYPE kvserve:x counter\n"
        'kvserve:x_total{reason="a"} 1.0\n'
        "# HELP kvserve:y Level.\n# TYPE kvserve:y gauge\nkvserve:y 2.0\n"
    )
    merged = merge_metrics({"r1": text, "r2": text.replace("1.0", "5.0")})
    lines = merged.splitlines()
    assert lines.count("# TYPE kvserve:x counter") == 1
    x = lines.index("# TYPE kvserve:x counter")
    assert lines[x + 1 : x + 3] == [
        'kvserve:x_total{replica="r1",reason="a"} 1.0',
        'kvserve:x_total{replica="r2",reason="a"} 5.0',
    ]
    assert 'kvserve:y{replica="r2"} 2.0' in lines
