"""One local Ray cluster for every cluster test: two models behind the ingress, two replicas
of the default model and one of a second model (the default model's file under another name),
at one thread each, started once per session and always shut down.

Ray and three model loads take most of a minute on two cores, so every test shares this one
application; the test that kills a replica runs last (its module sorts last) and waits for Ray
Serve to bring it back. Requests that name no model go to the first model, so the tests written
for one model see the default model's two replicas.
"""

from __future__ import annotations

import os
import shutil
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

SECOND_MODEL = "kvserve-second"
"""The second model's served name: its file's stem."""


class Cluster:
    """The ingress's address and the replicas behind it: `num_replicas` of each model, by name
    in the cluster's order."""

    def __init__(self, url: str, num_replicas: dict[str, int]) -> None:
        self.url = url
        self.num_replicas = num_replicas
        self.models = list(num_replicas)

    def replicas(self, model: str | None = None) -> dict[str, dict]:
        """`GET /cluster/replicas` by replica id: those of `model` (default: the first model,
        which takes the requests that name none)."""
        model = model or self.models[0]
        return {k: r for k, r in self.all_replicas().items() if r["model"] == model}

    def all_replicas(self) -> dict[str, dict]:
        """`GET /cluster/replicas` by replica id, every model's."""
        body = httpx.get(self.url + "/cluster/replicas", timeout=10).json()
        return {r["replica"]: r for r in body["replicas"]}

    def wait_ready(self, timeout: float = 180.0, model: str | None = None) -> dict[str, dict]:
        """Wait until every replica of every model is ready and registered; returns those of
        `model` (default: the first)."""
        deadline = time.monotonic() + timeout
        while True:
            ready = {
                m: {k: r for k, r in self.replicas(m).items() if r["ready"]} for m in self.models
            }
            if all(len(ready[m]) == self.num_replicas[m] for m in self.models):
                return ready[model or self.models[0]]
            if time.monotonic() > deadline:
                raise TimeoutError(f"replicas ready: {ready}")
            time.sleep(0.2)

    def replica_metrics(self, replica_id: str) -> dict[str, float]:
        """The replica's own /metrics, scraped at its address."""
        return scrape(SimpleNamespace(url=self.all_replicas()[replica_id]["url"]))


# Package scope: Ray and its replicas go when the cluster tests end (idle, they still take a
# quarter of two cores and 3 GB, which the rest of the suite needs).
@pytest.fixture(scope="package")
def cluster(tmp_path_factory) -> Iterator[Cluster]:
    import ray
    from ray import serve

    from kvserve.cluster.cli import APP_NAME
    from kvserve.cluster.deployments import build_app
    from kvserve.model.paths import DEFAULT_MODEL_NAME, default_model_path

    second = tmp_path_factory.mktemp("second-model") / f"{SECOND_MODEL}.gguf"
    try:
        os.link(default_model_path(), second)
    except OSError:  # another file system
        shutil.copyfile(default_model_path(), second)
    # Ray counts CPUs, it does not pin them: three replicas of one CPU each on two cores.
    ray.init(num_cpus=3, include_dashboard=False)
    try:
        serve.start(proxy_location="Disabled")
        settings = {**REPLICA_SETTINGS, "models": [None, str(second)]}
        app = build_app(
            {"replicas": [2, 1], "cpus_per_replica": 1, "port": 0, "serve_args": settings}
        )
        handle = serve.run(app, name=APP_NAME, route_prefix=None)
        cluster = Cluster(
            handle.url.remote().result(), num_replicas={DEFAULT_MODEL_NAME: 2, SECOND_MODEL: 1}
        )
        cluster.wait_ready()
        yield cluster
    finally:
        serve.shutdown()
        ray.shutdown()
