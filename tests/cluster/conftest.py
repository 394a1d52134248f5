"""One local Ray cluster for every cluster test: two replicas of the default model at one
thread each behind the ingress, started once per session and always shut down.

Ray and two model loads take most of a minute on two cores, so every test shares this one
application; the test that kills a replica runs last (its module sorts last) and waits for Ray
Serve to bring it back.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from types import SimpleNamespace

import httpx
import pytest

from tests.e2e.conftest import scrape

REPLICA_SETTINGS = {
    "threads": 1,
    "device": "cpu",
    "max_num_seqs": 2,
    "max_queue_per_slot": 2,
    "num_kv_blocks": 192,
    "max_model_len": 2048,
}
SLOTS, QUEUE_PER_SLOT = REPLICA_SETTINGS["max_num_seqs"], REPLICA_SETTINGS["max_queue_per_slot"]
CAPACITY_PER_REPLICA = SLOTS * (1 + QUEUE_PER_SLOT)
"""Requests one replica holds (running + waiting) before it answers 429."""


class Cluster:
    """The ingress's address and the replicas behind it."""

    def __init__(self, url: str, num_replicas: int) -> None:
        self.url = url
        self.num_replicas = num_replicas

    def replicas(self) -> dict[str, dict]:
        """`GET /cluster/replicas` by replica id."""
        body = httpx.get(self.url + "/cluster/replicas", timeout=10).json()
        return {r["replica"]: r for r in body["replicas"]}

    def wait_ready(self, timeout: float = 180.0) -> dict[str, dict]:
        """Wait until every replica is ready and registered."""
        deadline = time.monotonic() + timeout
        while True:
            replicas = {k: r for k, r in self.replicas().items() if r["ready"]}
            if len(replicas) == self.num_replicas:
                return replicas
            if time.monotonic() > deadline:
                raise TimeoutError(f"replicas ready: {sorted(replicas)}")
            time.sleep(0.2)

    def replica_metrics(self, replica_id: str) -> dict[str, float]:
        """The replica's own /metrics, scraped at its address."""
        return scrape(SimpleNamespace(url=self.replicas()[replica_id]["url"]))


@pytest.fixture(scope="session")
def cluster() -> Iterator[Cluster]:
    import ray
    from ray import serve

    from kvserve.cluster.cli import APP_NAME
    from kvserve.cluster.deployments import build_app

    ray.init(num_cpus=2, include_dashboard=False)
    try:
        serve.start(proxy_location="Disabled")
        app = build_app(
            {"replicas": 2, "cpus_per_replica": 1, "port": 0, "serve_args": REPLICA_SETTINGS}
        )
        handle = serve.run(app, name=APP_NAME, route_prefix=None)
        cluster = Cluster(handle.url.remote().result(), num_replicas=2)
        cluster.wait_ready()
        yield cluster
    finally:
        serve.shutdown()
        ray.shutdown()
