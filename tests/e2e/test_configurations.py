"""Every configuration (fp32, bf16, int8 weights, int8 KV cache, both, 4-bit blocks; the real
qwen2.5-coder:0.5b in auto, int8, none and with the int8 KV cache) behind the real server:
prompts of every awkward length, and a model that raises in the middle of a step (a context
filled to its last position is in tests/engine/test_configurations.py). The server answers each request (200 or a clear 400), fails
only the step's own requests when the model raises, and keeps serving; the pool comes back
whole."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from kvserve.config import CacheConfig, DeviceConfig, EngineConfig, QueueConfig, SchedulerConfig
from tests.configurations import CONFIGURATIONS, REAL_CONFIGURATIONS, params

pytestmark = pytest.mark.slow

# The longest crosses several prefill chunks and a power of two of positions; a context filled
# to its last position is tests/engine/test_configurations.py's (without the server around it:
# here 4,000 positions cost most of each configuration's time and tested nothing more).
PROMPT_LENGTHS = [1, 31, 32, 33, 511, 512, 513, 1000, 2049]
# A real 0.5B model prefills about 100x slower than the default one: the lengths that cross a
# block, a chunk and several chunks, to keep the suite's time.
REAL_PROMPT_LENGTHS = [1, 31, 32, 33, 512, 513, 1100]
MAX_MODEL_LEN = 4096


def prompt_ids(length: int, salt: int = 0) -> list[int]:
    """`length` ordinary token ids (no control tokens), different for each salt."""
    return [1000 + (7 * i + 13 * salt) % 20000 for i in range(length)]


@pytest.fixture(scope="module", params=params(CONFIGURATIONS + REAL_CONFIGURATIONS))
def server(request, server_factory):
    configuration = request.param
    loaded = request.getfixturevalue(configuration.model_fixture)
    config = EngineConfig(
        device=DeviceConfig(device="cpu"),
        cache=CacheConfig(num_kv_blocks=420, kv_cache_dtype=configuration.kv_cache_dtype),
        scheduler=SchedulerConfig(max_num_seqs=4, max_model_len=MAX_MODEL_LEN),
        queue=QueueConfig(max_queue_per_slot=8, queue_timeout=600),
    )
    server = server_factory(config, loaded=loaded)
    server.configuration = configuration
    yield server
    server.stop()


def completion(server, prompt, **fields) -> httpx.Response:
    return httpx.post(
        server.url + "/v1/completions",
        json={"prompt": prompt, "max_tokens": 4, "temperature": 0, **fields},
        timeout=600,
    )


def test_every_prompt_length_is_answered(server):
    engine = server.state.engine
    assert server.call(lambda: engine.kv_cache.kv.dtype).is_floating_point == (
        server.configuration.kv_cache_dtype != "int8"
    )
    lengths = REAL_PROMPT_LENGTHS if server.configuration in REAL_CONFIGURATIONS else PROMPT_LENGTHS
    with ThreadPoolExecutor(len(lengths)) as pool:
        replies = list(pool.map(lambda n: completion(server, prompt_ids(n, n)), lengths))
    for length, reply in zip(lengths, replies, strict=True):
        assert reply.status_code == 200, (length, reply.text)
        body = reply.json()
        assert body["usage"]["prompt_tokens"] == length
        assert 1 <= body["usage"]["completion_tokens"] <= 4
    # Too long for the context: a clear 400 naming the field, and nothing else happens.
    refused = completion(server, prompt_ids(MAX_MODEL_LEN + 1))
    assert refused.status_code == 400
    assert refused.json()["error"]["param"] in ("prompt", "max_tokens")
    assert server.call(engine.is_idle)
    assert completion(server, "The sea is").status_code == 200


class FaultyModel:
    """The engine's model, raising from inside `forward` once armed: after the step's rows went
    through every layer (the KV cache was written), before any token was sampled."""

    def __init__(self, model) -> None:
        self._model = model
        self.armed = False
        self.faults = 0

    def __getattr__(self, name):
        return getattr(self._model, name)

    def forward(self, token_ids, meta, kv_cache):
        logits = self._model.forward(token_ids, meta, kv_cache)
        if self.armed:
            self.armed = False
            self.faults += 1
            raise RuntimeError("injected model fault")
        return logits


def test_a_model_fault_mid_step_fails_only_that_step(server, until):
    engine = server.state.engine
    faulty = FaultyModel(engine.batch.model)
    engine.batch.model = faulty
    try:
        payload = {
            "prompt": prompt_ids(600, 5),  # two prefill chunks, then decode
            "max_tokens": 64,
            "ignore_eos": True,
            "stream": True,
        }

        def stream() -> list[str]:
            data = []
            with httpx.stream(
                "POST", server.url + "/v1/completions", json=payload, timeout=600
            ) as response:
                assert response.status_code == 200
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        data.append(line.removeprefix("data: "))
                        if len(data) == 4:
                            faulty.armed = True  # a decode step a few tokens in fails
            return data

        with ThreadPoolExecutor(2) as pool:
            results = list(pool.map(lambda _: stream(), range(2)))
        assert faulty.faults >= 1
        for data in results:
            assert data[-1] == "[DONE]"
            error = json.loads(data[-2])["error"]
            assert error["type"] == "server_error"
            assert "injected model fault" in error["message"]
        until(lambda: server.call(engine.is_idle), message="the failed step leaked")
        assert server.call(engine.pool.check_whole)
    finally:
        engine.batch.model = faulty._model
    # The next requests are answered, long and short.
    assert completion(server, prompt_ids(700, 9)).status_code == 200
    assert completion(server, "Hello").status_code == 200
