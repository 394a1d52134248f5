"""The ModelRegistry's rules over engines that load instantly or when told: shared loads,
the wait budget, keep-alive, the memory budget, failed loads, and Ollama's durations."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import pytest

from kvserve.server.models import ModelRegistry, ServedModel, parse_keep_alive
from kvserve.server.protocol import APIError


class FakeEngine:
    """What the registry reads of an engine: start/stop, running, and its size."""

    def __init__(self, name: str, num_bytes: int) -> None:
        self.loaded = SimpleNamespace(name=name, model=SimpleNamespace(num_bytes=num_bytes))
        self.pool_size = SimpleNamespace(num_bytes=0)
        self.max_model_len = 128
        self.started = self.stopped = False

    async def start(self) -> None:
        self.started = True

    async def stop(self) -> None:
        self.stopped = True

    @property
    def running(self) -> bool:
        return self.started and not self.stopped


class Factory:
    """Builds FakeEngines, counting builds; `gate` (when set) holds each build until set."""

    def __init__(self, name: str, num_bytes: int = 100, gate: threading.Event | None = None):
        self.name, self.num_bytes, self.gate = name, num_bytes, gate
        self.builds: list[FakeEngine] = []
        self.fail: Exception | None = None

    def __call__(self, observer) -> FakeEngine:
        if self.gate is not None:
            self.gate.wait(10)
        if self.fail is not None:
            raise self.fail
        engine = FakeEngine(self.name, self.num_bytes)
        self.builds.append(engine)
        return engine


def served(name, factory, keep_alive=None, num_bytes=100) -> ServedModel:
    return ServedModel(name, factory, keep_alive=keep_alive, estimate_bytes=num_bytes)


def run(coroutine):
    return asyncio.run(coroutine)


def test_requests_during_a_load_share_it():
    async def scenario():
        gate = threading.Event()
        factory = Factory("a", gate=gate)
        model = served("a", factory)
        registry = ModelRegistry([model])
        waiters = [asyncio.create_task(registry.acquire(model)) for _ in range(10)]
        await asyncio.sleep(0.05)
        assert model.status == "loading" and model.active == 10
        gate.set()
        engines = await asyncio.gather(*waiters)
        assert len(factory.builds) == 1
        assert all(engine is factory.builds[0] for engine in engines)
        assert model.num_loads == 1 and model.loaded
        for _ in engines:
            registry.release(model)
        assert model.active == 0

    run(scenario())


def test_a_load_longer_than_the_wait_budget_is_429_and_goes_on():
    async def scenario():
        gate = threading.Event()
        factory = Factory("a", gate=gate)
        model = served("a", factory)
        registry = ModelRegistry([model], load_timeout=0.05)
        with pytest.raises(APIError) as caught:
            await registry.acquire(model)
        assert caught.value.status == 429 and caught.value.code == "model_loading"
        assert caught.value.headers["Retry-After"]
        assert model.active == 0  # the lease was given back
        gate.set()
        engine = await registry.acquire(model, timeout=5)
        assert engine is factory.builds[0] and len(factory.builds) == 1
        registry.release(model)

    run(scenario())


def test_keep_alive_unloads_an_idle_model_and_never_a_busy_one():
    async def scenario():
        factory = Factory("a")
        model = served("a", factory, keep_alive=0.05)
        registry = ModelRegistry([model])
        engine = await registry.acquire(model)
        await asyncio.sleep(0.15)  # past the keep-alive, but the request still runs
        assert model.loaded and not engine.stopped
        registry.release(model)
        assert model.expires_at is not None
        await asyncio.sleep(0.15)
        assert model.status == "unloaded" and engine.stopped and model.engine is None
        # The next request loads it again.
        again = await registry.acquire(model)
        assert again is not engine and model.num_loads == 2
        registry.release(model, keep_alive=None)  # as Ollama's keep_alive -1: stays
        await asyncio.sleep(0.15)
        assert model.loaded and model.expires_at is None
        await registry.acquire(model)
        registry.release(model, keep_alive=0)  # keep_alive 0: unloaded right after
        await asyncio.sleep(0.02)
        assert model.status == "unloaded"
        await registry.stop()

    run(scenario())


def test_the_model_budget_unloads_the_least_recently_used_idle_model():
    async def scenario():
        factories = {name: Factory(name) for name in "abc"}
        models = {name: served(name, factories[name]) for name in "abc"}
        registry = ModelRegistry(models.values(), max_loaded_models=2)
        for name in "ab":
            await registry.acquire(models[name])
            registry.release(models[name])
        await registry.acquire(models["a"])  # a is now the more recent
        registry.release(models["a"])
        await registry.acquire(models["c"])
        assert models["b"].status == "unloaded"  # the least recently used went
        assert models["a"].loaded and models["c"].loaded
        # c is busy and a is busy: nothing can make room for b.
        await registry.acquire(models["a"])
        with pytest.raises(APIError) as caught:
            await registry.acquire(models["b"])
        assert caught.value.status == 503 and caught.value.code == "model_budget"
        assert "--max-loaded-models 2" in caught.value.message
        assert models["a"].loaded and models["c"].loaded
        await registry.stop()

    run(scenario())


def test_the_bytes_budget_counts_what_each_model_holds():
    async def scenario():
        small, large = Factory("small", 100), Factory("large", 300)
        models = [served("small", small, num_bytes=100), served("large", large, num_bytes=300)]
        registry = ModelRegistry(models, max_loaded_bytes=350)
        await registry.acquire(models[0])
        with pytest.raises(APIError) as caught:  # small is busy, and 100 + 300 > 350
            await registry.acquire(models[1])
        assert caught.value.code == "model_budget" and "--max-loaded-bytes" in caught.value.message
        registry.release(models[0])
        await registry.acquire(models[1])  # small is idle now: it goes
        assert models[0].status == "unloaded" and models[1].loaded
        await registry.stop()

    run(scenario())


def test_a_failed_load_is_503_and_the_next_request_tries_again():
    async def scenario():
        factory = Factory("a")
        factory.fail = FileNotFoundError("no such model file")
        model = served("a", factory)
        registry = ModelRegistry([model])
        with pytest.raises(APIError) as caught:
            await registry.acquire(model)
        assert caught.value.status == 503 and "no such model file" in caught.value.message
        assert model.status == "failed" and model.active == 0
        factory.fail = None
        await registry.acquire(model)
        assert model.loaded and model.load_error is None
        await registry.stop()

    run(scenario())


def test_a_load_that_the_servers_stop_ends_is_no_load_failure():
    """The server stops while the engine of its start-up model is built: the load ends with the
    stop (the engine built meanwhile is stopped) and reports no load error, so `kvserve serve`
    exits as a stop does; a load that fails is still reported."""
    from kvserve.config import ServerConfig
    from kvserve.server.core import ServerState

    async def scenario(fail: Exception | None):
        gate = threading.Event()
        factory = Factory("a", gate=gate)
        factory.fail = fail
        errors: list[BaseException] = []
        model = ServedModel("a", factory, keep_alive=None, preload=True)
        state = ServerState(ServerConfig(), ModelRegistry([model]), on_load_error=errors.append)
        load = asyncio.create_task(state.load())
        while model.status != "loading":
            await asyncio.sleep(0.01)
        await state.stop()  # the build is held meanwhile
        gate.set()
        await load
        return state, factory, errors

    state, factory, errors = run(scenario(None))
    assert errors == [] and state.load_error is None
    assert len(factory.builds) == 1 and factory.builds[0].stopped
    state, factory, errors = run(scenario(FileNotFoundError("no such model file")))
    assert len(errors) == 1 and isinstance(errors[0], FileNotFoundError)
    assert state.load_error is errors[0]


def test_names_are_found_with_ollamas_tag_and_unknown_ones_are_404():
    registry = ModelRegistry([served("a", Factory("a")), served("b:1b", Factory("b"))])
    assert registry.find(None).name == "a"
    assert registry.find("a:latest").name == "a"
    assert registry.find("b:1b").name == "b:1b"
    with pytest.raises(APIError) as caught:
        registry.resolve("c")
    assert caught.value.status == 404 and "'a', 'b:1b'" in caught.value.message
    with pytest.raises(ValueError, match="same name"):
        ModelRegistry([served("a", Factory("a")), served("a", Factory("a"))])


@pytest.mark.parametrize(
    ("value", "seconds"),
    [("5m", 300.0), ("1h30m", 5400.0), ("300ms", 0.3), ("10", 10.0), (30, 30.0), ("0", 0.0)],
)
def test_keep_alive_durations(value, seconds):
    assert parse_keep_alive(value) == pytest.approx(seconds)


@pytest.mark.parametrize("value", ["-1", -1, "-5m"])
def test_a_negative_keep_alive_is_forever(value):
    assert parse_keep_alive(value) is None


@pytest.mark.parametrize("value", ["5x", "m", "1.5.5s", True])
def test_bad_keep_alives_are_refused(value):
    with pytest.raises(ValueError):
        parse_keep_alive(value)


def _registry(*argv: str):
    import argparse

    from kvserve.cli import engine_config_from_args
    from kvserve.server.cli import add_arguments, build_registry, server_config_from_args

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(list(argv))
    return build_registry(args, engine_config_from_args(args), server_config_from_args(args))


def test_the_serve_flags_name_each_model_and_set_its_keep_alive_and_preload(minilm_dir):
    lone = _registry()
    assert [m.name for m in lone.models] == ["SmolLM2-135M-Instruct"]
    assert lone.default.preload and lone.default.keep_alive is None  # loaded at start, kept
    several = _registry("default", str(minilm_dir), "--preload", "all-MiniLM-L6-v2")
    assert several.names == ["SmolLM2-135M-Instruct", "all-MiniLM-L6-v2"]
    assert [m.preload for m in several.models] == [False, True]
    assert {m.keep_alive for m in several.models} == {300.0}
    assert several.models[1].num_bytes > 80 * 2**20  # its files, until it has loaded
    budget = _registry(
        "default", str(minilm_dir), "--keep-alive", "-1", "--max-loaded-models", "1",
        "--max-loaded-bytes", "1GiB",
    )  # fmt: skip
    assert budget.default.keep_alive is None
    assert (budget.max_loaded_models, budget.max_loaded_bytes) == (1, 2**30)
    from_dir = _registry("--models-dir", str(minilm_dir.parent))
    assert from_dir.names == ["all-MiniLM-L6-v2"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("default", "MINILM", "--preload", "nope"), "--preload: nope not served"),
        (("default", "MINILM", "--served-model-name", "x"), "names one model"),
        (("default", "MINILM", "--keep-alive", "soon"), "--keep-alive"),
        (("default", "default"), "same name"),
        (("--models-dir", "/nonexistent"), "not a directory"),
        (("default", "--max-loaded-models", "0"), "at least 1"),
    ],
)
def test_bad_serve_flags_for_several_models_are_refused(argv, message, minilm_dir):
    argv = tuple(str(minilm_dir) if a == "MINILM" else a for a in argv)
    with pytest.raises(ValueError, match=message):
        _registry(*argv)


def test_a_request_during_an_unload_waits_for_it_then_loads_again():
    class SlowStop(FakeEngine):
        async def stop(self) -> None:
            await asyncio.sleep(0.1)
            await super().stop()

    async def scenario():
        builds: list[FakeEngine] = []

        def factory(observer):
            builds.append(SlowStop("a", 100))
            return builds[-1]

        model = served("a", factory)
        registry = ModelRegistry([model])
        await registry.acquire(model)
        registry.release(model)
        unloading = asyncio.create_task(registry.unload(model))
        await asyncio.sleep(0.02)
        assert model.status == "unloading"
        engine = await registry.acquire(model)
        assert await unloading
        assert builds[0].stopped and engine is builds[1] and model.status == "loaded"
        registry.release(model)
        await registry.stop()

    run(scenario())
