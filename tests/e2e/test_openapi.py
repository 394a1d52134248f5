"""The described API: /openapi.json and /docs cover every route, and a schema-driven fuzzer
(schemathesis) sends each route generated requests, valid and invalid, on a live server.

The fuzz run is bounded (a fixed number of examples per route, derandomized so a run is
repeatable) and served with a short context, so no generated request can generate for long.
Every answer must be a documented status with a documented body, and none may be a 5xx.
"""

from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)

from kvserve.model.paths import DEFAULT_MODEL_NAME
from kvserve.server.app import ENDPOINTS
from tests.e2e.conftest import small_engine_config

pytestmark = pytest.mark.slow

EXAMPLES_PER_ROUTE = 20


@pytest.fixture(scope="module")
def fuzzed_server(server_factory):
    server = server_factory(small_engine_config(max_model_len=96, num_kv_blocks=16))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def api_schema(fuzzed_server):
    return schemathesis.openapi.from_url(fuzzed_server.url + "/openapi.json")


def test_every_route_is_described_with_its_models(fuzzed_server):
    document = httpx.get(fuzzed_server.url + "/openapi.json").json()
    described = set(document["paths"])
    assert described == ENDPOINTS - {"/openapi.json", "/docs"}
    schemas = document["components"]["schemas"]
    for path, operations in document["paths"].items():
        for method, operation in operations.items():
            ok = operation["responses"]["200"]["content"]
            if path in ("/metrics", "/"):
                assert "text/plain" in ok
                continue
            assert ok["application/json"]["schema"]["$ref"].startswith("#/components/schemas/")
            if method == "post":
                body = operation["requestBody"]["content"]["application/json"]["schema"]
                assert body["$ref"].rsplit("/", 1)[1] in schemas
                assert "400" in operation["responses"]
    for streaming in ("/v1/chat/completions", "/v1/completions"):
        assert (
            "text/event-stream"
            in document["paths"][streaming]["post"]["responses"]["200"]["content"]
        )
    for streaming in ("/api/chat", "/api/generate"):
        assert (
            "application/x-ndjson"
            in document["paths"][streaming]["post"]["responses"]["200"]["content"]
        )
    completion = schemas["CompletionRequest"]["properties"]
    assert {"prompt", "echo", "logprobs", "max_tokens", "stream"} <= set(completion)
    docs = httpx.get(fuzzed_server.url + "/docs")
    assert docs.status_code == 200 and "/openapi.json" in docs.text


ROUTES = [
    ("GET", "/health"),
    ("GET", "/ready"),
    ("GET", "/metrics"),
    ("GET", "/v1/models"),
    ("GET", "/v1/models/{model_id}"),
    ("POST", "/v1/chat/completions"),
    ("POST", "/v1/completions"),
    ("POST", "/tokenize"),
    ("POST", "/detokenize"),
    ("POST", "/v1/messages"),
    ("POST", "/v1/messages/count_tokens"),
    ("POST", "/v1/responses"),
    ("GET", "/"),
    ("POST", "/api/chat"),
    ("POST", "/api/generate"),
    ("GET", "/api/tags"),
    ("POST", "/api/show"),
    ("GET", "/api/ps"),
    ("GET", "/api/version"),
    ("POST", "/api/pull"),
    ("POST", "/v1/embeddings"),
    ("POST", "/api/embed"),
    ("POST", "/api/embeddings"),
]


def test_the_fuzzed_routes_are_all_the_routes():
    assert {path for _, path in ROUTES} == ENDPOINTS - {"/openapi.json", "/docs"}


# Fields a generated body keeps when repaired, so that it reaches the engine: the schema allows
# any model name and any number, which the server mostly (and rightly) refuses with 400/404.
_KEPT = frozenset(
    {
        "prompt",
        "messages",
        "input",
        "tokens",
        "echo",
        "logprobs",
        "top_logprobs",
        "stream",
        "stream_options",
        "stop",
        "seed",
        "ignore_eos",
        "add_generation_prompt",
        "add_special_tokens",
        "temperature",
        "raw",
        "system",
        "encoding_format",
        "truncate",
    }
)

# Bodies of the Ollama routes name the served model; the embedding routes take their input.
_OLLAMA = frozenset({"/api/chat", "/api/generate", "/api/show", "/api/embed", "/api/embeddings"})


def _repaired(case):
    """Half the examples: the generated body without what would be refused anyway (an unknown
    model, out-of-range numbers, unknown extras, malformed messages), so that the generation
    paths (streaming, logprobs, echo, stop strings) get fuzzed too."""
    if not isinstance(case.body, dict):
        return case
    body = {key: value for key, value in case.body.items() if key in _KEPT}
    if isinstance(body.get("messages"), list):
        texts = [m.get("content") for m in body["messages"] if isinstance(m, dict)]
        text = next((t for t in texts if isinstance(t, str)), "Hi")
        body["messages"] = [{"role": "user", "content": text[:200]}]
    if body.get("stream") is not True:
        body.pop("stream_options", None)
    for name in ("logprobs", "top_logprobs"):
        value = body.get(name)
        if isinstance(value, int) and not isinstance(value, bool):
            body[name] = abs(value) % 6
    if body.get("logprobs") is not True:
        body.pop("top_logprobs", None)
    seed = body.get("seed")
    if not isinstance(seed, int) or not -(2**63) <= seed < 2**63:
        body.pop("seed", None)
    temperature = body.get("temperature")
    if not isinstance(temperature, float) or not 0 <= temperature <= 2:
        body.pop("temperature", None)
    if case.operation.path.endswith(("completions", "/v1/messages")):
        body["max_tokens"] = 4
    if case.operation.path == "/v1/responses":
        if not isinstance(body.get("input"), str):
            body["input"] = "Hi"
        body["max_output_tokens"] = 4
    path = case.operation.path
    if path in _OLLAMA:
        body["model"] = DEFAULT_MODEL_NAME
    if path == "/api/pull":
        # The catalogue's default model, installed with the tests: a pull that succeeds at once.
        body["model"] = "smollm2:135m"
    if path in ("/api/chat", "/api/generate"):
        body["options"] = {"num_predict": 4}
        if path == "/api/generate" and not isinstance(body.get("prompt"), str):
            body["prompt"] = "Hi"
    if path in ("/v1/embeddings", "/api/embed") and not isinstance(body.get("input"), str):
        body["input"] = "Hi"
    if path == "/api/embeddings" and not isinstance(body.get("prompt"), str):
        body["prompt"] = "Hi"
    case.body = body
    return case


# Hypothesis drives schemathesis' strategies directly: its pytest plugin (`from_fixture`) reads
# a pytest-internal attribute that pytest 9 no longer has.
@pytest.mark.parametrize(("method", "path"), ROUTES)
def test_fuzzing_finds_no_server_error(api_schema, fuzzed_server, method, path):
    operation = api_schema[path][method]

    @settings(
        max_examples=EXAMPLES_PER_ROUTE,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(case=st.one_of(operation.as_strategy(), operation.as_strategy().map(_repaired)))
    def send(case) -> None:
        case.call_and_validate(
            checks=[
                not_a_server_error,
                status_code_conformance,
                content_type_conformance,
                response_schema_conformance,
            ],
            timeout=60,
        )
        # Whatever was sent, the engine is left running.
        assert fuzzed_server.state.engine.running

    send()


def test_field_names_the_fuzzer_found_are_reported_in_a_legal_header(fuzzed_server):
    """An unknown field named with a control character once made the ignored-fields header
    illegal, and the answer a 500."""
    body = {"prompt": "Hi", "max_tokens": 1, "a\rb": 1, "x,y": 2, "é": 3}
    response = httpx.post(fuzzed_server.url + "/v1/completions", json=body, timeout=60)
    assert response.status_code == 200
    assert response.headers["x-kvserve-ignored-fields"] == "a%0Db,x%2Cy,%C3%A9"
