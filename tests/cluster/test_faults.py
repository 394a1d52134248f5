"""Overload, disconnect and a killed replica, through the ingress on the shared cluster."""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.cluster.conftest import CAPACITY_PER_REPLICA
from tests.e2e.conftest import RawClient, wait_until

pytestmark = pytest.mark.slow


def _port(cluster) -> int:
    return int(cluster.url.rsplit(":", 1)[1])


def _idle(cluster) -> bool:
    replicas = cluster.replicas()
    return all(
        cluster.replica_metrics(replica_id)["kvserve:num_requests_running"] == 0
        and cluster.replica_metrics(replica_id)["kvserve:num_requests_waiting"] == 0
        for replica_id in replicas
    )


def test_a_burst_of_four_times_capacity_gets_200s_and_429s(cluster):
    replicas = cluster.replicas()
    capacity = CAPACITY_PER_REPLICA * len(replicas)
    before = {r: cluster.replica_metrics(r) for r in replicas}
    payload = {"prompt": "Write a story:", "max_tokens": 12, "ignore_eos": True}
    barrier = threading.Barrier(4 * capacity)

    def one(_: int) -> httpx.Response:
        barrier.wait()
        return httpx.post(cluster.url + "/v1/completions", json=payload, timeout=120)

    with ThreadPoolExecutor(4 * capacity) as pool:
        responses = list(pool.map(one, range(4 * capacity)))
    statuses = [r.status_code for r in responses]
    assert set(statuses) <= {200, 429}, statuses
    refused = [r for r in responses if r.status_code == 429]
    assert refused, "four times the capacity at once should overflow"
    for response in refused:
        assert int(response.headers["retry-after"]) >= 1
        assert response.json()["error"]["type"]
    # No 429 while a replica had room: every replica's queue filled, so at least the whole
    # capacity was served, and each refusal was refused by every replica first.
    assert statuses.count(200) >= capacity
    after = {r: cluster.replica_metrics(r) for r in replicas}
    key = 'kvserve:request_rejections_total{reason="queue_full"}'
    refusals = {r: after[r][key] - before[r][key] for r in replicas}
    assert all(count > 0 for count in refusals.values()), refusals
    assert sum(refusals.values()) >= len(replicas) * len(refused)
    wait_until(lambda: _idle(cluster), 60, "the replicas did not drain")


def test_a_client_that_leaves_mid_stream_frees_its_slot_in_the_replica(cluster):
    raw = RawClient(_port(cluster))
    raw.post(
        "/v1/completions",
        {"prompt": "Tell me everything", "max_tokens": 1500, "stream": True, "ignore_eos": True},
    )
    status, headers = raw.read_head()
    assert status == 200
    replica_id = headers["x-kvserve-replica"]
    raw.read_events(2)
    before = cluster.replica_metrics(replica_id)
    assert before["kvserve:num_requests_running"] == 1
    raw.sock.close()

    def freed() -> bool:
        now = cluster.replica_metrics(replica_id)
        return now["kvserve:num_requests_running"] == 0 and now[
            'kvserve:http_requests_total{endpoint="/v1/completions",status="499"}'
        ] > before.get('kvserve:http_requests_total{endpoint="/v1/completions",status="499"}', 0.0)

    # 1500 tokens would take minutes: freed within seconds means the replica cancelled it.
    wait_until(freed, 20, "the replica kept generating for a client that left")
    after = cluster.replica_metrics(replica_id)
    assert (
        after['kvserve:request_rejections_total{reason="client_gone"}']
        == before['kvserve:request_rejections_total{reason="client_gone"}'] + 1
    )
    assert after["kvserve:num_free_kv_blocks"] == after["kvserve:num_kv_blocks"] or (
        after["kvserve:kv_cache_usage_perc"] < before["kvserve:kv_cache_usage_perc"]
    )


def _stream(cluster, index: int, results: dict, started: threading.Event) -> None:
    payload = {
        "messages": [{"role": "user", "content": f"Story number {index}, please."}],
        "max_tokens": 600,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream(
        "POST", cluster.url + "/v1/chat/completions", json=payload, timeout=120
    ) as response:
        events = []
        results[index] = (response.headers["x-kvserve-replica"], events)
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(line[len("data: ") :])
                if len(events) == 2:
                    started.set()


def test_a_killed_replica_fails_its_streams_and_comes_back(cluster):
    import ray

    replicas = cluster.wait_ready()
    results: dict[int, tuple[str, list[str]]] = {}
    threads = []
    # Distinct prompts take turns, so four streams run on both replicas.
    for index in range(4):
        started = threading.Event()
        thread = threading.Thread(target=_stream, args=(cluster, index, results, started))
        thread.start()
        threads.append(thread)
        assert started.wait(120), "a stream did not start"
    victim = results[0][0]
    ray.kill(ray.get_actor(replicas[victim]["actor_name"], namespace="serve"), no_restart=True)
    for thread in threads:
        thread.join(120)
        assert not thread.is_alive(), "a stream hung after its replica was killed"
    for replica, events in results.values():
        assert events[-1] == "[DONE]"
        if replica == victim:
            # The dialect's mid-stream error, then the terminator: a client sees why it ended.
            error = json.loads(events[-2])["error"]
            assert error["message"] and error["type"]
        else:
            assert "error" not in json.loads(events[-2])
    # New requests go to the living replica at once.
    for _ in range(3):
        reply = httpx.post(
            cluster.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=60
        )
        assert reply.status_code == 200
        assert reply.headers["x-kvserve-replica"] != victim
    # Ray Serve starts a replacement; the ingress routes to it once it announces itself.
    back = cluster.wait_ready(timeout=240)
    assert victim not in back and len(back) == 2
    newcomer = next(replica for replica in back if replica not in replicas)
    wait_until(
        lambda: (
            httpx.post(
                cluster.url + "/v1/completions",
                json={"prompt": "Hello", "max_tokens": 1},
                timeout=60,
            ).headers["x-kvserve-replica"]
            == newcomer
        ),
        60,
        "the replacement replica got no request",
    )
