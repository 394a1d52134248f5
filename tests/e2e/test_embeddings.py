"""Embeddings on a live server: MiniLM served for embeddings only, through the official `openai`
and `ollama` clients (and the wire), the admission rules (429, 499), the metrics that count
them apart from generation; and a decoder model's embeddings."""

from __future__ import annotations

import asyncio
import base64
import json
import socket
import threading

import httpx
import numpy as np
import ollama
import openai
import pytest
import torch

from tests.e2e.conftest import small_engine_config

pytestmark = pytest.mark.slow

TEXTS = ["The cat sat on the mat.", "A dog barked.", "Quantum chromodynamics", "ok"]
MODEL = "all-MiniLM-L6-v2"


@pytest.fixture(scope="module")
def server(server_factory, loaded_minilm):
    server = server_factory(loaded=loaded_minilm)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0) as client:
        yield client


@pytest.fixture(scope="module")
def ollama_client(server):
    client = ollama.Client(host=server.url, timeout=60)
    yield client
    client.close()


def direct(loaded_minilm, texts: list[str]) -> torch.Tensor:
    ids = [loaded_minilm.tokenizer.encode(text) for text in texts]
    return loaded_minilm.model.embed(ids)


def test_openai_client_float_and_base64(client, loaded_minilm):
    expected = direct(loaded_minilm, TEXTS)
    floats = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
    assert [item.index for item in floats.data] == list(range(len(TEXTS)))
    got = torch.tensor([item.embedding for item in floats.data])
    assert got.shape == (len(TEXTS), 384)
    assert torch.allclose(got, expected, atol=1e-5)
    ids = [loaded_minilm.tokenizer.encode(text) for text in TEXTS]
    assert floats.usage.prompt_tokens == floats.usage.total_tokens == sum(map(len, ids))
    assert floats.model == MODEL

    # Asked for base64, the client hands the strings over as they came.
    encoded = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="base64")
    vectors = [np.frombuffer(base64.b64decode(d.embedding), dtype="<f4") for d in encoded.data]
    assert torch.allclose(torch.tensor(np.stack(vectors)), got)
    # Given no format, the client asks for base64 itself and decodes it into floats.
    default = client.embeddings.create(model=MODEL, input=TEXTS)
    assert torch.allclose(torch.tensor([item.embedding for item in default.data]), got)


def test_base64_on_the_wire_is_little_endian_float32(server, loaded_minilm):
    body = {"input": "The cat sat on the mat.", "encoding_format": "base64"}
    answer = httpx.post(server.url + "/v1/embeddings", json=body).json()
    raw = base64.b64decode(answer["data"][0]["embedding"])
    vector = np.frombuffer(raw, dtype="<f4")
    assert np.allclose(vector, direct(loaded_minilm, [body["input"]])[0].numpy(), atol=1e-6)


def test_token_ids_and_lists_of_them(client, loaded_minilm):
    ids = [loaded_minilm.tokenizer.encode(text) for text in TEXTS[:2]]
    expected = loaded_minilm.model.embed(ids)
    one = client.embeddings.create(model=MODEL, input=ids[0])
    assert torch.allclose(torch.tensor(one.data[0].embedding), expected[0], atol=1e-5)
    both = client.embeddings.create(model=MODEL, input=ids)
    assert torch.allclose(torch.tensor([d.embedding for d in both.data]), expected, atol=1e-5)


def test_requests_in_flight_together_get_their_own_vectors(server, loaded_minilm):
    async def all_of_them() -> list[dict]:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
            calls = [http.post("/v1/embeddings", json={"input": [text, "x"]}) for text in TEXTS]
            return [response.json() for response in await asyncio.gather(*calls)]

    answers = asyncio.run(all_of_them())
    expected = direct(loaded_minilm, TEXTS)
    for answer, vector in zip(answers, expected, strict=True):
        assert torch.allclose(torch.tensor(answer["data"][0]["embedding"]), vector, atol=1e-5)


def test_length_dimensions_and_truncation(client, server):
    long = " ".join(["word"] * 400)
    with pytest.raises(openai.BadRequestError) as caught:
        client.embeddings.create(model=MODEL, input=["short", long])
    assert "256" in str(caught.value) and caught.value.body["param"] == "input[1]"
    cut = client.embeddings.create(model=MODEL, input=long, extra_body={"truncate": True})
    assert cut.usage.prompt_tokens == 256
    assert client.embeddings.create(model=MODEL, input="a", dimensions=384).data
    with pytest.raises(openai.BadRequestError, match="dimensions"):
        client.embeddings.create(model=MODEL, input="a", dimensions=128)
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="text-embedding-3-small", input="a")
    for body, param in (
        ({"input": []}, "input"),
        ({"input": "a", "encoding_format": "hex"}, "encoding_format"),
    ):
        response = httpx.post(server.url + "/v1/embeddings", json=body)
        assert response.status_code == 400 and response.json()["error"]["param"] == param


def test_ollama_client_embed_and_embeddings(ollama_client, loaded_minilm):
    expected = direct(loaded_minilm, TEXTS)
    answer = ollama_client.embed(model=MODEL, input=TEXTS)
    assert torch.allclose(torch.tensor(answer.embeddings), expected, atol=1e-5)
    assert answer.prompt_eval_count > 0 and answer.total_duration > 0
    assert ollama_client.embed(model=f"{MODEL}:latest", input="").embeddings == []
    legacy = ollama_client.embeddings(model=MODEL, prompt=TEXTS[0])
    assert torch.allclose(torch.tensor(legacy.embedding), expected[0], atol=1e-5)

    long = " ".join(["word"] * 400)
    assert len(ollama_client.embed(model=MODEL, input=long).embeddings) == 1  # truncated
    with pytest.raises(ollama.ResponseError) as caught:
        ollama_client.embed(model=MODEL, input=long, truncate=False)
    assert caught.value.status_code == 400 and "256" in caught.value.error
    with pytest.raises(ollama.ResponseError) as caught:
        ollama_client.embed(model=MODEL, input="a", options={"num_ctx": 4096})
    assert caught.value.status_code == 400 and "num_ctx" in caught.value.error


def test_an_embedding_model_refuses_to_generate_and_says_what_it_does(
    client, ollama_client, server
):
    ready = httpx.get(server.url + "/ready")
    assert ready.status_code == 200
    assert ready.json()["status"] == "ready" and ready.json()["kernels"] is None
    with pytest.raises(openai.BadRequestError, match="embedding model"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(ollama.ResponseError) as caught:
        ollama_client.generate(model=MODEL, prompt="hi")
    assert caught.value.status_code == 400 and "embedding model" in caught.value.error
    assert ollama_client.show(MODEL).capabilities == ["embedding"]
    (listed,) = ollama_client.list().models
    assert listed.details.family == "bert" and listed.details.format == "safetensors"
    assert listed.details.quantization_level == "F32"


def test_embeddings_are_counted_apart_from_generation(server, client, metrics):
    before = metrics(server)
    client.embeddings.create(model=MODEL, input=TEXTS)
    after = metrics(server)

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert delta('kvserve:embedding_requests_total{outcome="done"}') == 1
    assert delta("kvserve:embedding_inputs_total") == len(TEXTS)
    assert delta("kvserve:embedding_prompt_tokens_total") > len(TEXTS)
    assert delta("kvserve:embedding_batches_total") >= 1
    assert delta("kvserve:embedding_request_latency_seconds_count") == 1
    assert delta('kvserve:http_requests_total{endpoint="/v1/embeddings",status="200"}') == 1
    assert delta("kvserve:prompt_tokens_total") == 0  # generation's own counters stay put
    assert not any(name.startswith("kvserve:request_success_total") for name in after)


class HeldModel:
    """Wraps the embedder's model so its passes run only once released."""

    def __init__(self, embedder) -> None:
        self.embedder = embedder
        self.encode = embedder._encode
        self.release = threading.Event()
        self.entered = threading.Event()
        embedder._encode = self

    def __call__(self, inputs):
        self.entered.set()
        self.release.wait(60)
        return self.encode(inputs)

    def remove(self) -> None:
        self.release.set()
        self.embedder._encode = self.encode


def test_a_full_queue_is_429_and_a_client_that_leaves_is_499(
    server_factory, loaded_minilm, raw_client, access_log, metrics, until
):
    server = server_factory(
        small_engine_config(max_num_seqs=1, max_queue_per_slot=1, queue_timeout=30),
        loaded=loaded_minilm,
    )
    embedder = server.state.engine.embedder
    held = HeldModel(embedder)
    try:
        running = raw_client(server.port)
        running.post("/v1/embeddings", {"input": "one"})
        assert held.entered.wait(30)
        leaving = raw_client(server.port)
        leaving.post("/api/embed", {"model": MODEL, "input": "two"})
        until(lambda: server.call(lambda: embedder.num_waiting) == 1)
        # max_jobs = slots * (1 + waiters per slot) = 2: the third is refused at once.
        full = httpx.post(server.url + "/v1/embeddings", json={"input": "three"})
        assert full.status_code == 429 and full.headers["retry-after"] == "30"
        assert full.json()["error"]["type"] == "rate_limit_error"
        ollama_full = httpx.post(server.url + "/api/embed", json={"model": MODEL, "input": "x"})
        assert ollama_full.status_code == 429 and set(ollama_full.json()) == {"error"}
        leaving.close()
        until(lambda: server.call(lambda: embedder.num_waiting) == 0)
        until(lambda: access_log.with_status(499) != [])
        held.release.set()
        status, _ = running.read_head()
        assert status == 200
        until(lambda: server.call(embedder.is_idle))
        samples = metrics(server)
        assert samples['kvserve:embedding_rejections_total{reason="queue_full"}'] == 2
        assert samples['kvserve:embedding_rejections_total{reason="client_gone"}'] == 1
        assert samples['kvserve:request_rejections_total{reason="client_gone"}'] == 0
        assert samples['kvserve:embedding_requests_total{outcome="cancelled"}'] == 1
    finally:
        held.remove()
        server.stop()


def test_a_decoder_model_embeds_too(server_factory):
    server = server_factory()
    try:
        body = {"input": ["The sea is calm.", "The sea is calm.", "Taxes are due."]}
        answer = httpx.post(server.url + "/v1/embeddings", json=body, timeout=60).json()
        vectors = torch.tensor([item["embedding"] for item in answer["data"]])
        assert vectors.shape == (3, server.state.engine.model_config.hidden_size)
        assert torch.allclose(vectors.norm(dim=-1), torch.ones(3), atol=1e-4)
        assert torch.allclose(vectors[0], vectors[1], atol=1e-5)
        assert not torch.allclose(vectors[0], vectors[2], atol=1e-2)
        # Generation still runs beside it.
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        response = httpx.post(server.url + "/v1/chat/completions", json=chat, timeout=60)
        assert response.status_code == 200
        assert server.call(server.state.engine.embedder.is_idle)
    finally:
        server.stop()


def test_a_socket_closed_mid_request_leaves_nothing_behind(server, until):
    sock = socket.create_connection(("127.0.0.1", server.port))
    body = json.dumps({"input": TEXTS * 50}).encode()
    sock.sendall(
        b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    sock.close()
    until(lambda: server.call(server.state.engine.embedder.is_idle))
