"""Prefix affinity through the ingress: a shared long prefix keeps landing on the replica that
holds its KV (its prefix-cache hit counter says so), distinct prompts spread."""

from __future__ import annotations

import httpx
import pytest

from tests.e2e.conftest import scrape

pytestmark = pytest.mark.slow

HITS = "kvserve:prefix_cache_hits_total"
QUERIES = "kvserve:prefix_cache_queries_total"
# About 1,000 tokens of shared context (the default model's tokenizer: ~1.3 tokens a word).
PREFIX = " ".join(
    f"Record {i}: the harbour master logged ship {i * 7 % 31} arriving at dock {i % 9}."
    for i in range(70)
)


def _tokens(cluster, text: str) -> int:
    reply = httpx.post(cluster.url + "/tokenize", json={"prompt": text}, timeout=30)
    return reply.json()["count"]


def test_requests_sharing_a_long_prefix_land_on_one_replica(cluster):
    assert 950 <= _tokens(cluster, PREFIX) <= 1300
    replicas = cluster.wait_ready()
    before = {r: cluster.replica_metrics(r) for r in replicas}
    landed = []
    for index in range(16):
        reply = httpx.post(
            cluster.url + "/v1/completions",
            json={"prompt": f"{PREFIX}\nQuestion {index}: which dock?", "max_tokens": 1},
            timeout=120,
        )
        assert reply.status_code == 200, reply.text
        landed.append(reply.headers["x-kvserve-replica"])
    routed = {k: v for k, v in scrape(cluster).items() if k.startswith("kvserve:cluster_")}
    assert len(set(landed)) == 1, (landed, routed)
    holder = landed[0]
    after = {r: cluster.replica_metrics(r) for r in replicas}
    hits = {r: after[r][HITS] - before[r][HITS] for r in replicas}
    queries = {r: after[r][QUERIES] - before[r][QUERIES] for r in replicas}
    # Every request after the first found (nearly) the whole prefix cached on its replica.
    assert hits[holder] >= 15 * 900, hits
    assert all(hits[r] == 0 and queries[r] == 0 for r in replicas if r != holder), hits


def test_distinct_prompts_spread_over_both_replicas(cluster):
    replicas = cluster.wait_ready()
    landed = set()
    for index in range(6):
        # Each prompt fills more than one block, each its own.
        text = f"Topic {index}: " + " ".join(f"word{index}x{j}" for j in range(40))
        reply = httpx.post(
            cluster.url + "/v1/completions", json={"prompt": text, "max_tokens": 1}, timeout=60
        )
        assert reply.status_code == 200
        landed.add(reply.headers["x-kvserve-replica"])
    assert landed == set(replicas)
