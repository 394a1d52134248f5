"""The same API through the ingress: the official openai client, a subset of the conformance
tests written for `kvserve serve` run unchanged against the ingress, and the ingress's own
routes (health, ready, merged metrics, the replica header)."""

from __future__ import annotations

import time

import httpx
import openai
import pytest

from tests.e2e.conftest import RawClient, scrape
from tests.e2e.test_openai_client import (  # noqa: F401  (collected here, run on the ingress)
    test_async_client_concurrent_requests,
    test_chat_logprobs,
    test_chat_max_tokens_gives_length,
    test_chat_stream_matches_non_stream_and_reports_usage,
    test_completions_default_max_tokens_is_16,
    test_completions_stream_and_not,
    test_errors_surface_as_openai_exceptions,
    test_seed_makes_sampling_repeatable,
    test_stop_string_cuts_the_text,
    test_stream_without_include_usage_has_no_usage_chunk,
)
from tests.e2e.test_responses_client import (  # noqa: F401
    test_budget_running_out_is_incomplete,
    test_every_frame_names_its_event,
)
from tests.e2e.test_responses_client import (  # noqa: F401
    test_stream_and_final_response_match_create as test_responses_stream_matches_create,
)

pytestmark = pytest.mark.slow

MESSAGES = [{"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def server(cluster):
    return cluster


@pytest.fixture(scope="module")
def client(cluster):
    with openai.OpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0) as client:
        yield client


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def _wait_until_idle(cluster, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while any(replica["load"] for replica in cluster.replicas().values()):
        assert time.monotonic() < deadline, f"the replicas stay loaded: {cluster.replicas()}"
        time.sleep(0.05)


def test_openai_client_streams_and_each_response_names_its_replica(client, model, cluster):
    replicas = set(cluster.replicas())
    seen = set()
    for index in range(4):
        # Equal loads, so the choice is a tie taken in turn (a replica's load is what it last
        # reported, twice a second: a report from its previous request can still be standing).
        _wait_until_idle(cluster)
        raw = client.chat.completions.with_raw_response.create(
            model=model,
            # A system message of its own: with the template's default one, every prompt
            # would start with the same block, and the router would keep them together.
            messages=[
                {"role": "system", "content": f"You are counter number {index}."},
                {"role": "user", "content": f"Count to {index + 3}."},
            ],
            max_tokens=4,
            stream=True,
        )
        assert raw.headers["x-kvserve-replica"] in replicas
        seen.add(raw.headers["x-kvserve-replica"])
        chunks = list(raw.parse())
        assert chunks[-1].choices[0].finish_reason is not None
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    for response in (
        httpx.post(cluster.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 1}),
        httpx.post(cluster.url + "/v1/completions", json={"prompt": 5}),  # a 400 too
    ):
        assert response.headers["x-kvserve-replica"] in replicas
    # The model list is one replica's of each model.
    listed = httpx.get(cluster.url + "/v1/models").headers["x-kvserve-replica"].split(", ")
    assert len(listed) == len(cluster.models) and listed[0] in replicas
    # Prompts that differ from their first block on take turns.
    assert seen == replicas


def test_events_are_relayed_while_generation_runs(cluster, model):
    """The first event reaches the client while its replica still generates: nothing between
    the replica and the client holds the stream back."""
    raw = RawClient(int(cluster.url.rsplit(":", 1)[1]))
    try:
        raw.post(
            "/v1/completions",
            {
                "model": model,
                "prompt": "Once upon",
                "max_tokens": 400,
                "stream": True,
                "ignore_eos": True,
            },
        )
        status, headers = raw.read_head()
        assert status == 200
        assert headers["content-type"].startswith("text/event-stream")
        raw.read_events(2)
        running = cluster.replica_metrics(headers["x-kvserve-replica"])
        assert running["kvserve:num_requests_running"] >= 1
    finally:
        raw.sock.close()


def test_health_ready_and_metrics_with_replica_and_model_labels(cluster):
    assert httpx.get(cluster.url + "/health").json() == {"status": "ok"}
    ready = httpx.get(cluster.url + "/ready").json()
    assert ready["status"] == "ready" and ready["models"] == cluster.num_replicas
    # The stream the test before left is cancelled at its replica's next step: the merged
    # and the replica's own numbers are compared once nothing runs.
    _wait_until_idle(cluster)
    assert ready["replicas"] == sum(cluster.num_replicas.values())
    merged = scrape(cluster)
    for model in cluster.models:
        for replica_id in cluster.replicas(model):
            own = cluster.replica_metrics(replica_id)
            for name in ("kvserve:num_requests_running", "kvserve:num_kv_blocks"):
                assert name in own
                assert merged[f'{name}{{replica="{replica_id}",model="{model}"}}'] == own[name]
    assert merged["kvserve:cluster_replicas"] == sum(cluster.num_replicas.values())
    # Every family's samples stay together under one HELP/TYPE (the text format requires it).
    text = httpx.get(cluster.url + "/metrics").text
    types = [line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")]
    assert len(types) == len(set(types))


def test_unknown_routes_and_bad_bodies_answer_as_a_replica_would(cluster):
    missing = httpx.get(cluster.url + "/v1/nothing-here")
    assert missing.status_code == 404
    assert missing.json()["error"]["message"]
    bad = httpx.post(cluster.url + "/v1/chat/completions", content=b"{not json")
    assert bad.status_code == 400
    assert bad.json()["error"]["type"] == "invalid_request_error"
