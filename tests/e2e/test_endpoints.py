"""Health, readiness, tokenize/detokenize, metrics and the access log on a live server."""

from __future__ import annotations

import threading

import httpx
import pytest

from kvserve.config import ServerConfig
from kvserve.server.metrics import REJECTION_REASONS

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(server_factory):
    server = server_factory()
    yield server
    server.stop()


def test_ready_is_503_until_the_model_is_loaded(loaded_default, engine_config):
    from kvserve.engine.engine import Engine
    from kvserve.server.app import create_app
    from tests.e2e.harness import BackgroundServer

    release = threading.Event()
    config = engine_config()

    def slow_factory(observer):
        release.wait(30)
        return Engine(config, loaded=loaded_default, observer=observer)

    app = create_app(ServerConfig(), slow_factory)
    with BackgroundServer(app) as server:
        assert httpx.get(server.url + "/health").status_code == 200
        ready = httpx.get(server.url + "/ready")
        assert ready.status_code == 503
        assert ready.json()["status"] == "loading"
        # The lone model is named by its file once loaded: nothing to list yet.
        listing = httpx.get(server.url + "/v1/models")
        assert listing.status_code == 503
        assert listing.json()["error"]["type"] == "server_error"
        # A request during the load waits for it (within the wait budget), then is answered.
        early: list[httpx.Response] = []
        waiter = threading.Thread(
            target=lambda: early.append(
                httpx.post(
                    server.url + "/v1/completions",
                    json={"prompt": "Hi", "max_tokens": 1},
                    timeout=60,
                )
            )
        )
        waiter.start()
        waiter.join(0.5)
        assert not early  # still waiting for the load
        release.set()
        waiter.join(60)
        assert early[0].status_code == 200
        server.wait_ready()
        assert httpx.get(server.url + "/ready").status_code == 200
        assert httpx.get(server.url + "/v1/models").json()["data"][0]["status"] == "loaded"


def test_a_model_that_fails_to_load_keeps_ready_503():
    from kvserve.server.app import create_app
    from tests.e2e.harness import BackgroundServer

    failures = []

    def broken_factory(observer):
        raise FileNotFoundError("no such model file")

    app = create_app(ServerConfig(), broken_factory, on_load_error=failures.append)
    with BackgroundServer(app) as server:
        with pytest.raises(RuntimeError):
            server.wait_ready(timeout=10)
        ready = httpx.get(server.url + "/ready")
        assert ready.status_code == 503
        assert "no such model file" in ready.json()["error"]
        response = httpx.post(server.url + "/v1/completions", json={"prompt": "Hi"})
        assert response.status_code == 503
        assert "no such model file" in response.json()["error"]["message"]
    assert len(failures) == 1 and isinstance(failures[0], FileNotFoundError)


def test_tokenize_detokenize_round_trip(server):
    text = "Hello, world! Ünïcödé and 漢字 too."
    tokens = httpx.post(server.url + "/tokenize", json={"prompt": text}).json()
    assert tokens["count"] == len(tokens["tokens"]) > 0
    assert tokens["max_model_len"] == server.state.engine.max_model_len
    back = httpx.post(server.url + "/detokenize", json={"tokens": tokens["tokens"]}).json()
    assert back["prompt"] == text


def test_tokenize_messages_matches_the_chat_prompt(server):
    messages = [{"role": "user", "content": "What is two plus two?"}]
    tokens = httpx.post(server.url + "/tokenize", json={"messages": messages}).json()
    reply = httpx.post(
        server.url + "/v1/chat/completions",
        json={"messages": messages, "max_tokens": 1},
        timeout=60,
    ).json()
    assert reply["usage"]["prompt_tokens"] == tokens["count"]


def test_detokenize_refuses_ids_outside_the_vocabulary(server):
    response = httpx.post(server.url + "/detokenize", json={"tokens": [1, 10**9]})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "tokens"


def test_metrics_names_present_and_moving(server, metrics):
    before = metrics(server)
    for name in (
        "kvserve:num_requests_running",
        "kvserve:num_requests_waiting",
        "kvserve:kv_cache_usage_perc",
        "kvserve:time_to_first_token_seconds_count",
        "kvserve:inter_token_latency_seconds_count",
        "kvserve:e2e_request_latency_seconds_count",
        "kvserve:request_queue_time_seconds_count",
        "kvserve:prompt_tokens_total",
        "kvserve:generation_tokens_total",
    ):
        assert name in before, name
    for reason in REJECTION_REASONS:
        assert f'kvserve:request_rejections_total{{reason="{reason}"}}' in before
    reply = httpx.post(
        server.url + "/v1/completions",
        json={"prompt": "Once upon a time", "max_tokens": 5, "ignore_eos": True},
        timeout=60,
    ).json()
    usage = reply["usage"]
    after = metrics(server)

    def moved(name: str) -> float:
        return after[name] - before.get(name, 0.0)

    assert moved("kvserve:prompt_tokens_total") == usage["prompt_tokens"]
    assert moved("kvserve:generation_tokens_total") == usage["completion_tokens"] == 5
    assert moved("kvserve:time_to_first_token_seconds_count") == 1
    assert moved("kvserve:inter_token_latency_seconds_count") == 4
    assert moved("kvserve:e2e_request_latency_seconds_count") == 1
    assert moved("kvserve:request_queue_time_seconds_count") == 1
    assert moved('kvserve:request_success_total{finished_reason="length"}') == 1
    assert moved('kvserve:http_requests_total{endpoint="/v1/completions",status="200"}') == 1
    assert after["kvserve:num_requests_running"] == 0
    assert after["kvserve:kv_cache_usage_perc"] == 0


def test_kv_cache_usage_gauge_follows_the_pool(server, gate_factory, metrics):
    gate = gate_factory(server)
    engine = server.state.engine
    done = threading.Event()

    def request() -> None:
        httpx.post(
            server.url + "/v1/completions",
            json={"prompt": "Hi", "max_tokens": 8},
            timeout=60,
        )
        done.set()

    thread = threading.Thread(target=request)
    thread.start()
    try:
        gate.wait_blocked()
        samples = metrics(server)
        assert samples["kvserve:num_requests_running"] == 1
        expected = server.call(lambda: engine.pool.usage)
        assert samples["kvserve:kv_cache_usage_perc"] == pytest.approx(expected)
        assert expected > 0
    finally:
        gate.open()
        thread.join(60)
    assert done.is_set()


def test_access_log_line(server, access_log, until):
    response = httpx.post(
        server.url + "/v1/completions",
        json={"prompt": "Hello", "max_tokens": 3, "ignore_eos": True},
        timeout=60,
    )
    request_id = response.headers["x-request-id"]
    until(lambda: access_log.line_for(request_id) is not None)
    line = access_log.line_for(request_id)
    fields = line.split()
    assert fields[:4] == [request_id, "POST", "/v1/completions", "200"]
    usage = response.json()["usage"]
    assert f"prompt_tokens={usage['prompt_tokens']}" in fields
    assert "completion_tokens=3" in fields
    ttft = next(f for f in fields if f.startswith("ttft="))
    duration = next(f for f in fields if f.startswith("duration="))
    assert float(ttft[5:-1]) <= float(duration[9:-1])
    assert "finish=length" in fields
    # One line per request, refusals included.
    bad = httpx.post(server.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": -1})
    until(lambda: access_log.line_for(bad.headers["x-request-id"]) is not None)
    assert access_log.line_for(bad.headers["x-request-id"]).split()[3] == "400"


def test_models_endpoint(server):
    body = httpx.get(server.url + "/v1/models").json()
    assert body["object"] == "list"
    (card,) = body["data"]
    assert card["id"] == server.state.model_name
    assert card["object"] == "model"
    assert card["owned_by"]
    assert card["max_model_len"] == server.state.engine.max_model_len
