"""Bad input: each mistake gets its documented status and an OpenAI error body naming the
field, never 422, and the server keeps serving afterwards."""

from __future__ import annotations

import json

import httpx
import pytest

from kvserve.config import ServerConfig

pytestmark = pytest.mark.slow

API_KEY = "test-key"
MAX_BODY_BYTES = 4096
MAX_MODEL_LEN = 256
NUM_KV_BLOCKS = 6  # 6 x 32 = 192 positions: less than the context
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MESSAGES = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def server(server_factory, engine_config):
    server = server_factory(
        engine_config(num_kv_blocks=NUM_KV_BLOCKS, max_model_len=MAX_MODEL_LEN),
        ServerConfig(api_key=API_KEY, max_body_bytes=MAX_BODY_BYTES),
    )
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as client:
        yield client


@pytest.fixture(autouse=True)
def still_serving(client, server):
    """After every bad request, a good one is still answered and nothing leaked."""
    yield
    reply = client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 1})
    assert reply.status_code == 200, reply.text
    assert server.call(server.state.engine.is_idle)


def _error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    return error


def _chat(client, payload: dict) -> httpx.Response:
    return client.post("/v1/chat/completions", json=payload)


def test_malformed_json(client):
    response = client.post(
        "/v1/chat/completions",
        content=b'{"messages": [',
        headers={"content-type": "application/json"},
    )
    error = _error(response, 400)
    assert error["type"] == "invalid_request_error"
    assert "JSON" in error["message"]


@pytest.mark.parametrize("body", [b"", b"[1, 2]", b'"text"'])
def test_body_that_is_not_an_object(client, body):
    _error(client.post("/v1/chat/completions", content=body), 400)


@pytest.mark.parametrize(
    ("payload", "param"),
    [
        ({"messages": MESSAGES, "temperature": "hot"}, "temperature"),
        ({"messages": MESSAGES, "max_tokens": 2.5}, "max_tokens"),
        ({"messages": MESSAGES, "stream": "yes"}, "stream"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        ({"messages": [{"content": "no role"}]}, "messages[0].role"),
        ({"messages": "Hi"}, "messages"),
    ],
)
def test_wrong_types_name_the_field(client, payload, param):
    assert _error(_chat(client, payload), 400)["param"] == param


def test_missing_messages(client):
    error = _error(_chat(client, {"model": None, "max_tokens": 3}), 400)
    assert error["param"] == "messages"
    assert _error(_chat(client, {"messages": []}), 400)["param"] == "messages"
    assert _error(client.post("/v1/completions", json={"max_tokens": 3}), 400)["param"] == "prompt"


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
@pytest.mark.parametrize("value", [-1, 0])
def test_non_positive_max_tokens(client, field, value):
    assert _error(_chat(client, {"messages": MESSAGES, field: value}), 400)["param"] == field


def test_huge_max_tokens(client):
    error = _error(_chat(client, {"messages": MESSAGES, "max_tokens": 10**9}), 400)
    assert error["param"] == "max_tokens"
    error = _error(client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 10**9}), 400)
    assert error["param"] == "max_tokens"


@pytest.mark.parametrize(
    ("field", "value"),
    [("temperature", 2.5), ("temperature", -0.1), ("top_p", 0.0), ("top_p", 1.5)],
)
def test_sampling_parameter_out_of_range(client, field, value):
    error = _error(_chat(client, {"messages": MESSAGES, field: value, "max_tokens": 2}), 400)
    assert error["param"] == field


def test_unknown_model(client):
    error = _error(_chat(client, {"model": "gpt-17", "messages": MESSAGES, "max_tokens": 2}), 404)
    assert error["type"] == "not_found_error"
    assert error["param"] == "model"
    response = client.post("/v1/completions", json={"model": "gpt-17", "prompt": "Hi"})
    assert _error(response, 404)["param"] == "model"


def test_prompt_beyond_the_context(client):
    long_text = "word " * (MAX_MODEL_LEN + 50)
    chat = [{"role": "user", "content": long_text}]
    error = _error(_chat(client, {"messages": chat, "max_tokens": 1}), 400)
    assert error["param"] == "messages"
    assert str(MAX_MODEL_LEN) in error["message"]
    response = client.post("/v1/completions", json={"prompt": long_text, "max_tokens": 1})
    assert _error(response, 400)["param"] == "prompt"


def test_prompt_plus_answer_beyond_the_whole_pool(client):
    # Fits the context (256) but not the pool (192 positions).
    prompt_ids = client.post("/tokenize", json={"prompt": "word " * 100}).json()["tokens"]
    assert len(prompt_ids) + 120 <= MAX_MODEL_LEN
    response = client.post("/v1/completions", json={"prompt": prompt_ids, "max_tokens": 120})
    error = _error(response, 400)
    assert error["param"] == "max_tokens"
    assert "KV cache" in error["message"]


def test_oversized_body(client):
    filler = "x" * MAX_BODY_BYTES
    response = _chat(client, {"messages": [{"role": "user", "content": filler}]})
    assert _error(response, 413)["code"] == "request_too_large"


def test_oversized_body_without_content_length(client):
    def chunks():
        yield b'{"messages": [{"role": "user", "content": "'
        for _ in range(MAX_BODY_BYTES // 512 + 1):
            yield b"x" * 512
        yield b'"}]}'

    response = client.post("/v1/chat/completions", content=chunks())
    assert response.request.headers.get("transfer-encoding") == "chunked"
    _error(response, 413)


def test_api_key(server):
    payload = {"messages": MESSAGES, "max_tokens": 1}
    url = server.url + "/v1/chat/completions"
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        error = _error(httpx.post(url, json=payload, headers=headers), 401)
        assert error["type"] == "authentication_error"
    assert httpx.get(server.url + "/v1/models").status_code == 401
    assert httpx.post(server.url + "/tokenize", json={"prompt": "a"}).status_code == 401
    # Probes and scrapes stay open.
    for path in ("/health", "/ready", "/metrics"):
        assert httpx.get(server.url + path).status_code == 200
    assert httpx.post(url, json=payload, headers=AUTH, timeout=60).status_code == 200


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("functions", [{"name": "f"}]),
        ("guided_regex", "a+"),
        ("n", 129),  # above the limit
        ("n", 3),  # more answers than the server runs sequences at once
        ("n", 0),
        ("cache_salt", ""),
        ("logit_bias", {"not-a-token": 1}),
        ("guided_json", {"type": "object"}),
    ],
)
def test_answer_changing_fields_are_refused_by_name(client, field, value):
    error = _error(_chat(client, {"messages": MESSAGES, "max_tokens": 1, field: value}), 400)
    assert error["param"] == field


@pytest.mark.parametrize(("field", "value"), [("suffix", "!"), ("best_of", 3)])
def test_completion_fields_refused_by_name(client, field, value):
    response = client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1, field: value})
    assert _error(response, 400)["param"] == field


def test_several_prompts_refused_by_name(client):
    response = client.post("/v1/completions", json={"prompt": ["a", "b"], "max_tokens": 1})
    assert _error(response, 400)["param"] == "prompt"


def test_harmless_unknown_fields_are_accepted_and_reported(client, server, metrics):
    before = metrics(server)
    payload = {
        "messages": MESSAGES,
        "max_tokens": 1,
        "user": "someone",
        "metadata": {"k": "v"},
        "functions": [],
        "response_format": {"type": "text"},
    }
    response = _chat(client, payload)
    assert response.status_code == 200
    ignored = response.headers["x-kvserve-ignored-fields"].split(",")
    assert sorted(ignored) == ["functions", "metadata", "user"]
    after = metrics(server)
    key = 'kvserve:ignored_fields_total{field="user"}'
    assert after[key] - before.get(key, 0) == 1


def test_unknown_route_and_wrong_method_have_openai_bodies(client):
    assert _error(client.get("/v1/nothing-here"), 404)["type"] == "not_found_error"
    _error(client.get("/v1/chat/completions"), 405)


def test_no_422_anywhere(client):
    bodies = [
        {"messages": [{"role": "user", "content": "Hi"}], "stop": 5},
        {"messages": [{"role": "user", "content": "Hi"}], "stream_options": {"include_usage": 1}},
        {"messages": [{"role": "user", "content": "Hi"}], "logit_bias": {"1": "x"}},
        {"prompt": {"nested": True}},
    ]
    for body in bodies:
        path = "/v1/completions" if "prompt" in body else "/v1/chat/completions"
        response = client.post(path, content=json.dumps(body))
        assert response.status_code == 400, response.text
