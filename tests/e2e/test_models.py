"""Several models in one server, on real weights: the default model and the MiniLM embedder
side by side through the official clients, loads on demand shared by the requests that wait,
keep-alive and the memory budget seen in /v1/models/{id} and /api/ps, nothing left behind by
an unload, and a real process whose memory drops when its model unloads."""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import subprocess
import sys
import threading
import time

import httpx
import ollama
import openai
import pytest

from kvserve.config import ServerConfig
from kvserve.engine.events import engine_settings
from kvserve.server.models import ModelRegistry, ServedModel
from tests.e2e.conftest import CHAT, StepGate, small_engine_config
from tests.e2e.harness import BackgroundServer, free_port

pytestmark = pytest.mark.slow

GENERATOR = "smol"
EMBEDDER = "minilm"
TEXTS = ["The cat sat on the mat.", "A dog barked.", "Quantum chromodynamics"]


def generator(loaded, builds: list | None = None, gate: threading.Event | None = None, wrap=None):
    """A factory of engines over `loaded` (a decoder model), counting its builds; `gate` holds
    each build until set, `wrap(engine)` is called on each."""
    from kvserve.engine.engine import Engine

    def build(observer):
        if gate is not None:
            gate.wait(30)
        engine = Engine(small_engine_config(max_num_seqs=4), loaded=loaded, observer=observer)
        if builds is not None:
            builds.append(engine)
        if wrap is not None:
            wrap(engine)
        return engine

    return build


def embedder(loaded):
    from kvserve.engine.embedding import EmbeddingEngine

    return lambda observer: EmbeddingEngine(small_engine_config(), loaded, observer=observer)


def serve(*models: ServedModel, **budget) -> BackgroundServer:
    from kvserve.server.app import create_app

    return BackgroundServer(create_app(ServerConfig(), ModelRegistry(models, **budget)))


def card(server, name: str) -> dict:
    reply = httpx.get(f"{server.url}/v1/models/{name}", timeout=10)
    reply.raise_for_status()
    return reply.json()


def wait_for(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_two_models_answer_side_by_side_as_each_does_alone(loaded_fp32, loaded_minilm, metrics):
    models = (
        ServedModel(GENERATOR, generator(loaded_fp32), keep_alive=None),
        ServedModel(EMBEDDER, embedder(loaded_minilm), keep_alive=None),
    )
    questions = [CHAT, [{"role": "user", "content": "Name three colours."}]]
    with serve(*models) as server:
        listed = httpx.get(server.url + "/v1/models").json()["data"]
        assert [(m["id"], m["status"]) for m in listed] == [
            (GENERATOR, "unloaded"),
            (EMBEDDER, "unloaded"),
        ]
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)

        def chat(messages) -> str:
            stream = client.chat.completions.create(
                model=GENERATOR, messages=messages, max_tokens=24, temperature=0, stream=True
            )
            return "".join(
                chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices
            )

        def embed() -> list[list[float]]:
            reply = client.embeddings.create(model=EMBEDDER, input=TEXTS)
            assert reply.model == EMBEDDER
            return [item.embedding for item in reply.data]

        alone = [chat(q) for q in questions], embed()

        async def together():
            return await asyncio.gather(
                *(asyncio.to_thread(chat, q) for q in questions),
                asyncio.to_thread(embed),
                asyncio.to_thread(embed),
            )

        first, second, vectors, vectors_again = asyncio.run(together())
        assert [first, second] == alone[0] and all(first)
        assert vectors == alone[1] and vectors_again == alone[1]
        # Each model's series under its name.
        samples = metrics(server, by_model=True)
        assert samples[f'kvserve:generation_tokens_total{{model_name="{GENERATOR}"}}'] > 0
        assert samples[f'kvserve:generation_tokens_total{{model_name="{EMBEDDER}"}}'] == 0
        assert samples[f'kvserve:embedding_inputs_total{{model_name="{EMBEDDER}"}}'] == 9
        # The event stream shows one model: its own engine's settings.
        for name in (GENERATOR, EMBEDDER):
            url = f"{server.url}/v1/engine/events?model={name}"
            with httpx.stream("GET", url, timeout=10) as events:
                first = next(line for line in events.iter_lines() if line.startswith("data:"))
            snapshot = json.loads(first.removeprefix("data:"))
            assert snapshot["type"] == "snapshot"
            engine = server.state.models.find(name).engine
            assert snapshot["config"] == json.loads(json.dumps(engine_settings(engine)))
            assert snapshot["config"]["max_num_seqs"] == (4 if name == GENERATOR else 0)
        assert httpx.get(server.url + "/v1/engine/events?model=other").status_code == 404
        # A model the server does not serve is a 404 naming those it does.
        with pytest.raises(openai.NotFoundError) as caught:
            client.chat.completions.create(model="other", messages=CHAT, max_tokens=2)
        assert GENERATOR in str(caught.value) and EMBEDDER in str(caught.value)
        client.close()


def test_a_load_on_demand_is_shared_and_a_wait_past_the_budget_is_429(loaded_default, caplog):
    builds: list = []
    gate = threading.Event()
    slow_gate = threading.Event()
    models = (
        ServedModel(GENERATOR, generator(loaded_default, builds, gate), keep_alive=None),
        ServedModel("slow", generator(loaded_default, gate=slow_gate), keep_alive=None),
    )
    body = {"model": GENERATOR, "prompt": "Once upon a time", "max_tokens": 4, "temperature": 0}
    with (
        caplog.at_level(logging.INFO, logger="kvserve.server"),
        serve(*models, load_timeout=1.0) as server,
    ):
        replies: list[httpx.Response] = []

        def send() -> None:
            replies.append(httpx.post(server.url + "/v1/completions", json=body, timeout=60))

        senders = [threading.Thread(target=send) for _ in range(10)]
        for sender in senders:
            sender.start()
        wait_for(lambda: card(server, GENERATOR)["status"] == "loading")
        time.sleep(0.3)
        assert not replies  # all ten wait for the one load
        gate.set()
        for sender in senders:
            sender.join(60)
        assert [r.status_code for r in replies] == [200] * 10
        assert len({r.json()["choices"][0]["text"] for r in replies}) == 1
        assert len(builds) == 1
        loaded_lines = [
            r for r in caplog.records if r.getMessage().startswith(f"model {GENERATOR} loaded")
        ]
        assert len(loaded_lines) == 1
        # A model whose load outlasts the wait budget: 429 with Retry-After; the load goes on.
        late = httpx.post(
            server.url + "/v1/completions", json={**body, "model": "slow"}, timeout=30
        )
        assert late.status_code == 429 and late.headers["Retry-After"]
        assert late.json()["error"]["code"] == "model_loading"
        slow_gate.set()
        wait_for(lambda: card(server, "slow")["status"] == "loaded", 30)
        reply = httpx.post(
            server.url + "/v1/completions", json={**body, "model": "slow"}, timeout=30
        )
        assert reply.status_code == 200 and card(server, "slow")["loads"] == 1


def test_keep_alive_unloads_leaving_nothing_and_a_running_stream_holds_its_model(loaded_default):
    builds: list = []
    gates: list[StepGate] = []

    def gate_first(engine) -> None:
        if not gates:
            gates.append(StepGate(engine, closed=True))

    model = ServedModel(
        GENERATOR, generator(loaded_default, builds, wrap=gate_first), keep_alive=0.3
    )
    body = {"model": GENERATOR, "prompt": "The sea is", "max_tokens": 40, "temperature": 0}
    with serve(model) as server:
        threads_before = threads()
        # A stream whose steps are held for longer than the keep-alive: its model stays.
        lines: list[str] = []

        def read() -> None:
            url = server.url + "/v1/completions"
            with httpx.stream("POST", url, json={**body, "stream": True}, timeout=60) as stream:
                lines.extend(stream.iter_lines())

        reader = threading.Thread(target=read)
        reader.start()
        wait_for(lambda: bool(gates))
        gates[0].wait_blocked()
        time.sleep(0.6)
        assert card(server, GENERATOR)["status"] == "loaded"
        gates[0].open()
        reader.join(60)
        assert "data: [DONE]" in lines
        # Then it unloads: its engine stopped, its pool whole, its threads gone.
        wait_for(lambda: card(server, GENERATOR)["status"] == "unloaded")
        engine = builds[0]
        assert not engine.running
        assert engine.pool.num_free == engine.pool.num_blocks
        assert server.state.models.find(GENERATOR).engine is None
        after_first = threads()
        assert after_first <= threads_before
        # The next request loads it again.
        reply = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
        assert reply.status_code == 200
        assert card(server, GENERATOR)["loads"] == 2 and len(builds) == 2
        # Ollama's keep_alive: -1 keeps it, 0 unloads it right after the answer.
        ollama_body = {"model": GENERATOR, "prompt": "", "keep_alive": -1}
        loaded = httpx.post(server.url + "/api/generate", json=ollama_body, timeout=30).json()
        assert loaded["done_reason"] == "load"
        time.sleep(0.5)
        assert card(server, GENERATOR)["status"] == "loaded"
        assert card(server, GENERATOR)["expires_at"] is None
        unload = {**ollama_body, "keep_alive": 0}
        answer = httpx.post(server.url + "/api/generate", json=unload, timeout=30).json()
        assert answer["done_reason"] == "unload"
        wait_for(lambda: card(server, GENERATOR)["status"] == "unloaded")
        assert builds[1].pool.num_free == builds[1].pool.num_blocks
        assert threads() == after_first  # loads and unloads leave no thread behind


def test_the_budget_evicts_the_least_recently_used_idle_model(loaded_default, loaded_minilm):
    models = (
        ServedModel(GENERATOR, generator(loaded_default), keep_alive=None),
        ServedModel(EMBEDDER, embedder(loaded_minilm), keep_alive=None),
    )
    chat = {"model": GENERATOR, "messages": CHAT, "max_tokens": 30, "temperature": 0}
    embed = {"model": EMBEDDER, "input": TEXTS}
    with serve(*models, max_loaded_models=1) as server:
        assert httpx.post(server.url + "/v1/chat/completions", json=chat, timeout=60).is_success
        assert httpx.post(server.url + "/v1/embeddings", json=embed, timeout=60).is_success
        assert card(server, GENERATOR)["status"] == "unloaded"
        client = ollama.Client(host=server.url, timeout=60)
        assert [m.model for m in client.ps().models] == [f"{EMBEDDER}:latest"]
        listed = {m.model for m in client.list().models}
        assert listed == {f"{GENERATOR}:latest", f"{EMBEDDER}:latest"}
        # While the generator streams, nothing can make room for the embedder: 503.
        with httpx.stream(
            "POST", server.url + "/v1/chat/completions", json={**chat, "stream": True}, timeout=60
        ) as stream:
            lines = stream.iter_lines()
            next(lines)
            refused = httpx.post(server.url + "/v1/embeddings", json=embed, timeout=30)
            assert refused.status_code == 503
            assert refused.json()["error"]["code"] == "model_budget"
            assert "--max-loaded-models 1" in refused.json()["error"]["message"]
            for _ in lines:
                pass
        assert card(server, GENERATOR)["status"] == "loaded"


def threads() -> set[str]:
    """The threads that are not the serving loop's worker pool (which tokenizes, shared by
    every model), nor a load's own (it ends right after the load)."""
    return {
        t.name
        for t in threading.enumerate()
        if not t.name.startswith("asyncio_") and t.name != "kvserve-load"
    }


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_a_real_server_gives_its_memory_back_when_a_model_unloads(minilm_dir, tmp_path):
    port = free_port()
    command = [
        sys.executable, "-m", "kvserve", "serve", "default", str(minilm_dir),
        "--port", str(port), "--keep-alive", "1s", "--max-model-len", "2048",
    ]  # fmt: skip
    with open(tmp_path / "server.log", "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: _answers(url + "/ready"), 120)
        name = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        before = _rss(process.pid)
        body = {"model": name, "messages": CHAT, "max_tokens": 8}
        assert httpx.post(url + "/v1/chat/completions", json=body, timeout=120).is_success
        loaded = _rss(process.pid)
        wait_for(lambda: _status(url, name) == "unloaded", 30)
        unloaded = _rss(process.pid)
        assert loaded - before > 100 * 2**20, (before, loaded)
        assert loaded - unloaded > (loaded - before) / 2, (before, loaded, unloaded)
        assert httpx.post(url + "/v1/chat/completions", json=body, timeout=120).is_success
        assert httpx.get(f"{url}/v1/models/{name}").json()["loads"] == 2
        process.send_signal(signal.SIGTERM)
        assert process.wait(60) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(30)


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _status(url: str, name: str) -> str:
    return httpx.get(f"{url}/v1/models/{name}", timeout=5).json()["status"]
