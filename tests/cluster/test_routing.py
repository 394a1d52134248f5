"""Routing through the ingress: a shared long prefix keeps landing on the replica that holds its
KV (its prefix-cache hit counter says so), distinct prompts spread, and each request goes to the
replicas of the model it names."""

from __future__ import annotations

import httpx
import pytest

from tests.cluster.conftest import SECOND_MODEL
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


def _not_found(cluster, replica_id: str) -> float:
    """The 404s a replica answered, on every endpoint."""
    samples = cluster.replica_metrics(replica_id).items()
    return sum(v for k, v in samples if k.startswith("kvserve:http_requests") and '"404"' in k)


def test_each_model_is_served_by_its_own_replicas(cluster):
    """The second model tokenizes exactly as the first (the same file under another name): the
    prefix a replica of the first model holds still never draws the second model's requests."""
    first_model, second_model = cluster.models
    assert second_model == SECOND_MODEL
    first, second = cluster.wait_ready(), cluster.wait_ready(model=second_model)
    everyone = first | second
    listed = httpx.get(cluster.url + "/v1/models", timeout=30).json()["data"]
    assert [card["id"] for card in listed] == [first_model, second_model]
    # Its own first block: no replica holds this prompt yet (about 350 tokens).
    prompt = f"Routing by model. {PREFIX[: len(PREFIX) // 3]}\nWhich dock?"
    landed = []
    for model in (first_model, second_model, first_model):
        before = {r: cluster.replica_metrics(r)[HITS] for r in everyone}
        reply = httpx.post(
            cluster.url + "/v1/completions",
            json={"model": model, "prompt": prompt, "max_tokens": 1},
            timeout=120,
        )
        assert reply.status_code == 200, reply.text
        assert reply.json()["model"] == model
        replica = reply.headers["x-kvserve-replica"]
        landed.append(replica)
        hits = cluster.replica_metrics(replica)[HITS] - before[replica]
        if len(landed) < 3:
            assert hits == 0  # each model's replica computes the prompt once
        else:
            assert replica == landed[0] and hits >= 256  # ... and reuses it
    assert landed[0] in first and landed[1] in second
    # Ollama's tagged name reaches the model's replica, which answers as that model.
    ollama = httpx.post(
        cluster.url + "/api/generate",
        json={"model": f"{second_model}:latest", "prompt": "Hi", "stream": False},
        timeout=120,
    )
    assert ollama.status_code == 200, ollama.text
    assert ollama.headers["x-kvserve-replica"] in second
    # A model the cluster does not serve: the ingress answers, naming the served ones.
    before = {r: _not_found(cluster, r) for r in everyone}
    unknown = httpx.post(
        cluster.url + "/v1/messages",
        json={"model": "gpt-17", "max_tokens": 1, "messages": [{"role": "user", "content": "Hi"}]},
        timeout=30,
    )
    assert unknown.status_code == 404
    assert unknown.json()["error"]["type"] == "not_found_error"
    assert f"'{first_model}', '{second_model}'" in unknown.json()["error"]["message"]
    assert "x-kvserve-replica" not in unknown.headers
    assert {r: _not_found(cluster, r) for r in everyone} == before
