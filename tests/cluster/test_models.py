"""Several models behind one ingress, without Ray or a model: the real ingress app in front of
fake replicas (tiny Starlette apps reached in memory), each answering who it is. Milliseconds."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from kvserve.cluster.ingress import REPLICA_HEADER, Ingress, ReplicaInfo, ServedModel
from kvserve.cluster.router import PrefixRouter

REPLICAS = {"a1": "alpha", "a2": "alpha", "b1": "beta", "b2": "beta"}


class SameHashes:
    """Both models tokenize alike here (the hard case): a prompt's hashes are its words."""

    def hashes(self, path: str, request: dict[str, Any]) -> list[bytes]:
        return [word.encode() for word in str(request.get("prompt", "")).split()]


def _fake_replica(replica_id: str, model: str, calls: list[tuple[str, str]]) -> Starlette:
    async def answer(request: Request) -> JSONResponse:
        calls.append((replica_id, request.url.path))
        if request.url.path == "/v1/models":
            return JSONResponse({"object": "list", "data": [{"id": model, "object": "model"}]})
        if request.url.path == "/api/tags":
            return JSONResponse({"models": [{"name": f"{model}:latest", "model": model}]})
        if request.headers.get("authorization") == "Bearer wrong":
            return JSONResponse({"error": {"message": "a valid API key is required"}}, 401)
        return JSONResponse({"replica": replica_id, "model": model})

    return Starlette(routes=[Route("/{path:path}", answer, methods=["GET", "POST"])])


class Cluster:
    """An ingress serving alpha then beta, two fake replicas each, and a client for it."""

    def __init__(self, *, api_key: str | None = None, ready: dict[str, bool] | None = None):
        self.calls: list[tuple[str, str]] = []
        self.ingress = Ingress(
            [
                ServedModel("alpha", SameHashes(), PrefixRouter()),
                ServedModel("beta", SameHashes(), PrefixRouter()),
            ],
            api_key=api_key,
        )
        mounts = {
            f"http://{replica_id}": httpx.ASGITransport(
                app=_fake_replica(replica_id, model, self.calls)
            )
            for replica_id, model in REPLICAS.items()
        }
        self.ingress._client = httpx.AsyncClient(mounts=mounts)
        for replica_id, model in REPLICAS.items():
            self.ingress.register(
                ReplicaInfo(
                    replica_id,
                    f"http://{replica_id}",
                    model=model,
                    ready=(ready or {}).get(replica_id, True),
                )
            )

    def send(self, *requests: tuple[str, str, Any]) -> list[httpx.Response]:
        """Each (method, path, json body or raw bytes) in turn, through the ingress."""

        async def run() -> list[httpx.Response]:
            transport = httpx.ASGITransport(app=self.ingress.app)
            async with httpx.AsyncClient(transport=transport, base_url="http://ingress") as client:
                answers = []
                for method, path, body in requests:
                    content = body if isinstance(body, bytes) else None
                    payload = None if isinstance(body, bytes) or body is None else body
                    answers.append(
                        await client.request(method, path, json=payload, content=content)
                    )
                return answers

        return asyncio.run(run())


def _model_of(response: httpx.Response) -> str:
    assert response.status_code == 200, response.text
    return REPLICAS[response.headers[REPLICA_HEADER]]


def test_each_request_goes_to_the_replicas_of_the_model_it_names():
    cluster = Cluster()
    chat = {"messages": [{"role": "user", "content": "Hi"}]}
    answers = cluster.send(
        ("POST", "/v1/chat/completions", {"model": "alpha", **chat}),
        ("POST", "/v1/chat/completions", {"model": "beta", **chat}),
        ("POST", "/v1/messages", {"model": "beta", "max_tokens": 2, **chat}),
        ("POST", "/api/chat", {"model": "beta:latest", **chat}),  # as Ollama tags it
        ("POST", "/api/show", {"name": "beta"}),  # Ollama's older field
        ("POST", "/v1/embeddings", {"model": "beta", "input": "Hi"}),
        ("POST", "/tokenize", {"model": "beta", "prompt": "Hi"}),
        # Named no model: the first model's, as a single server treats it.
        ("POST", "/v1/completions", {"prompt": "Hi"}),
        ("POST", "/v1/completions", {"model": None, "prompt": "Hi"}),
        ("POST", "/v1/completions", {"model": 5, "prompt": "Hi"}),  # its replica says 400
        ("POST", "/v1/completions", b"{not json"),
        ("POST", "/api/pull", {"model": "beta"}),  # a model to download, not one served
        ("GET", "/api/version", None),
    )
    assert [_model_of(a) for a in answers] == ["alpha"] + ["beta"] * 6 + ["alpha"] * 6


def test_an_unknown_model_is_a_404_in_its_dialect_and_reaches_no_replica():
    cluster = Cluster()
    chat = {"model": "gpt-17", "messages": [{"role": "user", "content": "Hi"}]}
    openai, anthropic, ollama, empty = cluster.send(
        ("POST", "/v1/chat/completions", chat),
        ("POST", "/v1/messages", {**chat, "max_tokens": 2}),
        ("POST", "/api/chat", chat),
        ("POST", "/v1/completions", {"model": "", "prompt": "Hi"}),  # a single server's 404 too
    )
    assert cluster.calls == []
    for response in (openai, anthropic, ollama, empty):
        assert response.status_code == 404
        assert REPLICA_HEADER not in response.headers
    error = openai.json()["error"]
    assert (error["type"], error["param"], error["code"]) == (
        "not_found_error",
        "model",
        "model_not_found",
    )
    assert error["message"] == (
        "the model 'gpt-17' does not exist; this cluster serves 'alpha', 'beta'"
    )
    assert anthropic.json() == {
        "type": "error",
        "error": {"type": "not_found_error", "message": error["message"]},
    }
    assert ollama.json() == {"error": error["message"]}
    assert "''" in empty.json()["error"]["message"]
    counted = cluster.ingress.registry.get_sample_value(
        "kvserve:cluster_unknown_model_requests_total"
    )
    assert counted == 4


def test_without_the_api_key_an_unknown_model_is_the_replicas_401():
    """Which models a cluster serves is not told to a client without the key."""
    cluster = Cluster(api_key="secret")
    body = {"model": "gpt-17", "prompt": "Hi"}
    (without,) = cluster.send(("POST", "/v1/completions", body))
    assert cluster.calls and cluster.calls[0][0] in ("a1", "a2")

    async def with_key(key: str) -> httpx.Response:
        transport = httpx.ASGITransport(app=cluster.ingress.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://ingress") as client:
            headers = {"Authorization": f"Bearer {key}"}
            return await client.post("/v1/completions", json=body, headers=headers)

    cluster.calls.clear()
    assert asyncio.run(with_key("secret")).status_code == 404
    assert cluster.calls == []
    assert asyncio.run(with_key("wrong")).status_code == 401  # the replica's answer
    assert len(cluster.calls) == 1


def test_a_prefix_remembered_for_one_model_never_routes_another():
    cluster = Cluster()
    prompt = {"prompt": "one two three four"}
    first, again, other, other_again = cluster.send(
        ("POST", "/v1/completions", {"model": "alpha", **prompt}),
        ("POST", "/v1/completions", {"model": "alpha", **prompt}),
        ("POST", "/v1/completions", {"model": "beta", **prompt}),
        ("POST", "/v1/completions", {"model": "beta", **prompt}),
    )
    holder = first.headers[REPLICA_HEADER]
    assert again.headers[REPLICA_HEADER] == holder
    assert REPLICAS[other.headers[REPLICA_HEADER]] == "beta"
    assert other_again.headers[REPLICA_HEADER] == other.headers[REPLICA_HEADER]
    sample = cluster.ingress.registry.get_sample_value

    def routed(model: str, replica: str, reason: str) -> float | None:
        labels = {"model": model, "replica": replica, "reason": reason}
        return sample("kvserve:cluster_routed_requests_total", labels)

    # The same hashes under beta were nobody's yet: balanced, not sent after alpha's holder.
    assert routed("alpha", holder, "prefix") == 1
    assert routed("beta", other.headers[REPLICA_HEADER], "balance") == 1
    assert routed("beta", other.headers[REPLICA_HEADER], "prefix") == 1
    alpha, beta = cluster.ingress.models
    assert alpha.router.num_remembered == beta.router.num_remembered == 4


def test_listings_name_every_ready_model_once_in_order():
    cluster = Cluster()
    models, tags = cluster.send(("GET", "/v1/models", None), ("GET", "/api/tags", None))
    assert [card["id"] for card in models.json()["data"]] == ["alpha", "beta"]
    assert models.json()["object"] == "list"
    listed = models.headers[REPLICA_HEADER].split(", ")
    assert sorted(REPLICAS[r] for r in listed) == ["alpha", "beta"]
    assert [entry["name"] for entry in tags.json()["models"]] == ["alpha:latest", "beta:latest"]
    # beta still loading: listed once it has a ready replica, and /ready waits for it.
    loading = Cluster(ready={"b1": False, "b2": False})
    models, ready, beta = loading.send(
        ("GET", "/v1/models", None),
        ("GET", "/ready", None),
        ("POST", "/v1/completions", {"model": "beta", "prompt": "Hi"}),
    )
    assert [card["id"] for card in models.json()["data"]] == ["alpha"]
    assert ready.status_code == 503
    assert ready.json() == {
        "status": "loading",
        "model": "alpha",
        "models": {"alpha": 2, "beta": 0},
        "replicas": 2,
    }
    assert beta.status_code == 503
    assert "beta" in beta.json()["error"]["message"]


def test_the_replica_table_shows_each_replicas_model_and_strangers_get_nothing():
    cluster = Cluster()
    # A replica of a model this cluster does not serve is listed, never routed to.
    cluster.ingress.register(ReplicaInfo("g1", "http://g1", model="gamma", ready=True))
    table, ready, *routed = cluster.send(
        ("GET", "/cluster/replicas", None),
        ("GET", "/ready", None),
        *[("POST", "/v1/completions", {"prompt": f"p{i}"}) for i in range(4)],
    )
    body = table.json()
    assert {r["replica"]: r["model"] for r in body["replicas"]} == REPLICAS | {"g1": "gamma"}
    assert [(m["model"], m["replicas"]) for m in body["models"]] == [("alpha", 2), ("beta", 2)]
    assert ready.json() == {
        "status": "ready",
        "model": "alpha",
        "models": {"alpha": 2, "beta": 2},
        "replicas": 4,
    }
    assert {r.headers[REPLICA_HEADER] for r in routed} == {"a1", "a2"}


def test_two_models_may_not_share_a_name():
    import pytest

    with pytest.raises(ValueError, match="'alpha'"):
        Ingress([ServedModel("alpha"), ServedModel("alpha")])


def test_metrics_name_each_replicas_model_unless_a_sample_names_its_own():
    from kvserve.cluster.ingress import merge_metrics

    text = '# TYPE kvserve:x counter\nkvserve:x_total 1.0\nkvserve:x_total{model="m"} 2.0\n'
    lines = merge_metrics({"a1": text, "b1": text}, models={"a1": "alpha", "b1": "beta"})
    assert lines.splitlines()[1:] == [
        'kvserve:x_total{replica="a1",model="alpha"} 1.0',
        'kvserve:x_total{replica="a1",model="m"} 2.0',
        'kvserve:x_total{replica="b1",model="beta"} 1.0',
        'kvserve:x_total{replica="b1",model="m"} 2.0',
    ]
