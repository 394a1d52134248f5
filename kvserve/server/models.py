"""The models one server serves: each loaded on first use, unloaded when idle, within a budget.

Every model is a `ServedModel` with its own engine (its own Scheduler, KV pool and engine loop)
once loaded, so the serving rules hold per model unchanged. The `ModelRegistry` owns them:

- **On demand.** A request for a model that is not loaded starts its load and waits for it,
  within the queue's wait budget (then 429 with Retry-After, as a full queue answers); every
  request for a model being loaded waits for that same load. Preloaded models load at start.
- **Keep-alive.** When a model's last request ends, it stays loaded `keep_alive` seconds (the
  server's, or the one the request asked for, as Ollama's `keep_alive`); None keeps it forever,
  0 unloads it at once. A model with requests running or waiting is never unloaded.
- **Budget.** At most `max_loaded_models` loaded (or loading) at once, and at most
  `max_loaded_bytes` of weights plus KV pools. A load that would pass either first unloads the
  least recently used idle models; when those are not enough the request gets 503 naming the
  budget. A model's size before its first load is the size of its files plus the KV pool its
  settings plan (an estimate); after a load, the bytes it really took.

Torch work of every model runs on the process's one device thread (`kvserve.model.device_thread`:
two OpenMP pools on a few cores slow both), so several loaded models share the cores step by step.
All methods run on the event loop thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import gc
import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from kvserve.engine.engine import EngineObserver, Observers
from kvserve.engine.events import EngineEvents
from kvserve.server.protocol import APIError

if TYPE_CHECKING:
    from kvserve.engine.engine import Engine

__all__ = ["KEEP", "ModelRegistry", "ServedModel", "parse_keep_alive"]

log = logging.getLogger("kvserve.server")

ModelFactory = Callable[[EngineObserver], "Engine"]
"""Builds one model's engine (loading its weights) given its observer; runs in a thread."""

KEEP: Any = object()
"""`release`'s keep_alive when the request asked for none: the model's own stays."""


def parse_keep_alive(value: Any) -> float | None:
    """Ollama's `keep_alive` as seconds: a duration ("5m", "1h30m", "300ms"), a number of
    seconds, negative for forever (None); "" or absent is not for this function."""
    if isinstance(value, bool):
        raise ValueError(f"keep_alive {value!r} is not a duration")
    if isinstance(value, int | float):
        seconds = float(value)
    else:
        text = str(value).strip()
        sign = -1.0 if text.startswith("-") else 1.0
        body = text.lstrip("+-")
        try:
            seconds = sign * float(body)
        except ValueError:
            seconds = sign * _duration(body)
    if seconds != seconds:  # NaN
        raise ValueError(f"keep_alive {value!r} is not a duration")
    return None if seconds < 0 else seconds


_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def _duration(text: str) -> float:
    """Go's duration syntax: a run of <number><unit> ("1h30m", "2.5s")."""
    total, number, index = 0.0, "", 0
    if not text:
        raise ValueError("an empty duration")
    while index < len(text):
        char = text[index]
        if char.isdigit() or char == ".":
            number += char
            index += 1
            continue
        unit = next(
            (u for u in ("ns", "us", "µs", "ms", "h", "m", "s") if text.startswith(u, index)),
            None,
        )
        if unit is None or not number:
            raise ValueError(f"{text!r} is not a duration such as '5m'")
        total += float(number) * _UNITS[unit]
        number, index = "", index + len(unit)
    if number:
        raise ValueError(f"{text!r} is not a duration such as '5m' (a unit is missing)")
    return total


def _return_memory() -> None:
    """Collect the unloaded engine's cycles and hand freed heap pages back to the system."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


class ServedModel:
    """One model the server serves, loaded or not."""

    def __init__(
        self,
        name: str | None,
        factory: ModelFactory,
        *,
        keep_alive: float | None,
        estimate_bytes: int = 0,
        path: Any = None,
        preload: bool = False,
    ) -> None:
        self.name = name  # None until the engine names it (a lone model served by its name)
        self.path = path  # the resolved file or directory, when known before loading
        self.keep_alive = keep_alive
        self.preload = preload
        self.events = EngineEvents()
        self.engine: Engine | None = None
        self.status = "unloaded"  # unloaded | loading | loaded | unloading | failed
        self.load_error: BaseException | None = None
        self.active = 0  # requests accepted for it whose responses have not ended
        self.last_used = time.monotonic()
        self.expires_at: float | None = None  # wall clock; None: never (or not loaded)
        self.num_loads = 0
        self.num_bytes = estimate_bytes  # the estimate until loaded, then what it took
        self.load_seconds: float | None = None
        self._factory = factory
        self._observer: EngineObserver | None = None
        self._load: asyncio.Task[Engine] | None = None
        self._timer: asyncio.TimerHandle | None = None

    @property
    def loaded(self) -> bool:
        return self.engine is not None and self.status == "loaded"

    @property
    def idle(self) -> bool:
        return self.active == 0

    def card(self) -> dict[str, Any]:
        """Whether it is loaded and until when, as `/v1/models/{id}` adds to the card."""
        card: dict[str, Any] = {"status": self.status, "loads": self.num_loads}
        if self.loaded:
            card["expires_at"] = None if self.expires_at is None else int(self.expires_at)
            card["max_model_len"] = self.engine.max_model_len
            card["memory_bytes"] = self.num_bytes
        if self.load_error is not None:
            card["error"] = str(self.load_error)
        return card


class ModelRegistry:
    """The served models, in the order given (the first is the default), and their loads."""

    def __init__(
        self,
        models: Iterable[ServedModel],
        *,
        observer: Callable[[ServedModel], EngineObserver] | None = None,
        on_loaded: Callable[[ServedModel, Engine], None] | None = None,
        max_loaded_models: int | None = None,
        max_loaded_bytes: int | None = None,
        load_timeout: float = 30.0,
    ) -> None:
        self.models: list[ServedModel] = list(models)
        if not self.models:
            raise ValueError("no model to serve")
        names = [m.name for m in self.models if m.name is not None]
        if len(set(names)) != len(names):
            twice = sorted({n for n in names if names.count(n) > 1})
            raise ValueError(f"two models are served under the same name: {', '.join(twice)}")
        self._observer = observer
        self._on_loaded = on_loaded
        self.max_loaded_models = max_loaded_models
        self.max_loaded_bytes = max_loaded_bytes
        self.load_timeout = load_timeout
        self._room = asyncio.Lock()  # one load at a time decides what to unload
        self._unloads: set[asyncio.Task[None]] = set()
        self._loaders: set[threading.Thread] = set()
        self.stopping = False

    # -- lookup --------------------------------------------------------------------------------

    @property
    def default(self) -> ServedModel:
        return self.models[0]

    @property
    def names(self) -> list[str]:
        return [m.name for m in self.models if m.name is not None]

    def find(self, name: str | None) -> ServedModel | None:
        """The model served as `name` (or, as Ollama tags names, `<name>:latest`); None for
        no name is the default model."""
        if name is None or name == "":
            return self.default
        for model in self.models:
            if model.name is None and len(self.models) == 1:
                return model  # a lone model not named yet: its name is checked once loaded
            if model.name is not None and name in (model.name, f"{model.name}:latest"):
                return model
        return None

    def resolve(self, name: str | None) -> ServedModel:
        """The model served as `name`; 404 naming those served for another."""
        model = self.find(name)
        if model is None:
            raise self.not_found(name)
        return model

    def not_found(self, name: str | None) -> APIError:
        served = ", ".join(f"'{n}'" for n in self.names)
        return APIError(
            404,
            f"the model '{name}' does not exist; this server serves {served}",
            param="model",
            code="model_not_found",
        )

    def observe(
        self,
        observer: Callable[[ServedModel], EngineObserver],
        on_loaded: Callable[[ServedModel, Engine], None] | None = None,
    ) -> None:
        """Give each engine built from now on `observer(model)` (the server's metrics), and
        call `on_loaded` after each load."""
        self._observer = observer
        self._on_loaded = on_loaded

    @property
    def loading(self) -> bool:
        """Whether a model's weights are being read in a thread right now."""
        return any(thread.is_alive() for thread in self._loaders)

    # -- leases --------------------------------------------------------------------------------

    async def acquire(self, model: ServedModel, timeout: float | None = None) -> Engine:
        """Hold `model` for one request (until `release`) and return its engine, loading it
        first when needed. A load not done within `timeout` (the wait budget) is a 429; the
        load goes on for the requests after."""
        model.active += 1
        model.last_used = time.monotonic()
        self._cancel_expiry(model)
        try:
            return await self._engine_of(model, self.load_timeout if timeout is None else timeout)
        except BaseException:
            self.release(model)
            raise

    def release(self, model: ServedModel, keep_alive: float | None = KEEP) -> None:
        """One request of `model` ended; when it was the last, the keep-alive starts (the
        request's own, when it asked for one)."""
        model.active = max(0, model.active - 1)
        model.last_used = time.monotonic()
        if keep_alive is not KEEP:
            model.keep_alive = keep_alive  # Ollama's rule: the last request's keep_alive sticks
        if model.active == 0 and model.loaded:
            self._arm_expiry(model)

    async def _engine_of(self, model: ServedModel, timeout: float) -> Engine:
        if self.stopping:
            raise APIError(503, "the server is shutting down", code="shutting_down")
        if model.loaded:
            return model.engine
        if model._load is None or model._load.done():
            # A failed load is tried again by the next request (the file may be back).
            model._load = asyncio.get_running_loop().create_task(
                self._load_model(model), name=f"kvserve-load-{model.name}"
            )
        try:
            return await asyncio.wait_for(asyncio.shield(model._load), timeout)
        except TimeoutError:
            raise APIError(
                429,
                f"the model '{model.name}' is still loading after the wait budget "
                f"({timeout:g} s); retry shortly",
                code="model_loading",
                headers={"Retry-After": "5"},
            ) from None

    # -- loading and unloading -----------------------------------------------------------------

    async def preload(self) -> None:
        """Load every model marked `preload`, in order; the first failure is raised."""
        for model in self.models:
            if model.preload:
                model.active += 1  # not unloadable while it loads for the start
                try:
                    await self._engine_of(model, float("inf"))
                finally:
                    self.release(model)

    async def _load_model(self, model: ServedModel) -> Engine:
        while model.status == "unloading":  # its previous engine is still stopping
            await asyncio.sleep(0.01)
        async with self._room:
            await self._make_room(model)
            model.status = "loading"
            model.load_error = None
        started = time.monotonic()
        try:
            engine = await self._build(model)
            await engine.start()
        except APIError:
            model.status = "unloaded"
            raise
        except Exception as exc:
            log.exception("the model %s could not be loaded", model.name or "")
            model.status = "failed"
            model.load_error = exc
            raise APIError(
                503, f"the model '{model.name}' failed to load: {exc}", code="model_load_failed"
            ) from exc
        if self.stopping:
            await engine.stop()
            model.status = "unloaded"
            raise APIError(503, "the server is shutting down", code="shutting_down")
        if model.name is None:
            model.name = engine.loaded.name
        if model.path is None:
            model.path = getattr(engine.loaded, "path", None)
        model.engine = engine
        model.status = "loaded"
        model.num_loads += 1
        model.load_seconds = time.monotonic() - started
        model.num_bytes = _engine_bytes(engine) or model.num_bytes
        model.events.bind(engine)
        bind = getattr(self._observer(model), "bind", None) if self._observer else None
        if bind is not None:
            bind(engine)
        log.info(
            "model %s loaded in %.1f s (%d MiB of weights and KV pool)%s",
            model.name,
            model.load_seconds,
            model.num_bytes // 2**20,
            "" if model.num_loads == 1 else f", load {model.num_loads}",
        )
        if self._on_loaded is not None:
            self._on_loaded(model, engine)
        if model.active == 0:
            self._arm_expiry(model)
        # Now that its true size is known, the budget may need more room (best effort).
        async with self._room:
            with contextlib.suppress(APIError):
                await self._make_room(model)
        return engine

    async def _build(self, model: ServedModel) -> Engine:
        """The engine, built in a daemon thread (a load takes seconds, and a server stopped
        meanwhile must not wait for it)."""
        loop = asyncio.get_running_loop()
        built: asyncio.Future[Engine] = loop.create_future()
        observers = [model.events]
        if self._observer is not None:
            observers.insert(0, self._observer(model))
        observer = Observers(*observers)

        def settle(result: Engine | None, error: BaseException | None) -> None:
            if built.done():
                return
            if error is not None:
                built.set_exception(error)
            else:
                built.set_result(result)

        def build() -> None:
            try:
                engine, error = model._factory(observer), None
            except BaseException as exc:  # reported on the loop, whatever it was
                engine, error = None, exc
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(settle, engine, error)

        thread = threading.Thread(target=build, name="kvserve-load", daemon=True)
        self._loaders = {t for t in self._loaders if t.is_alive()} | {thread}
        thread.start()
        return await built

    def _loaded_bytes(self, but: ServedModel) -> tuple[int, int]:
        """(models loaded or loading, their bytes), `but` aside."""
        holding = [m for m in self.models if m is not but and m.status in ("loaded", "loading")]
        return len(holding), sum(m.num_bytes for m in holding)

    def _over(self, model: ServedModel) -> str | None:
        count, num_bytes = self._loaded_bytes(model)
        if self.max_loaded_models is not None and count + 1 > self.max_loaded_models:
            return f"--max-loaded-models {self.max_loaded_models}"
        if (
            self.max_loaded_bytes is not None
            and num_bytes + model.num_bytes > self.max_loaded_bytes
        ):
            return f"--max-loaded-bytes {self.max_loaded_bytes / 2**20:,.0f} MiB"
        return None

    async def _make_room(self, model: ServedModel) -> None:
        """Unload least recently used idle models until `model` fits the budget; 503 when
        the idle ones are not enough."""
        while (budget := self._over(model)) is not None:
            idle = [m for m in self.models if m is not model and m.loaded and m.idle]
            if not idle:
                count, num_bytes = self._loaded_bytes(model)
                raise APIError(
                    503,
                    f"cannot load '{model.name}' (about {model.num_bytes / 2**20:,.0f} MiB): "
                    f"the memory budget ({budget}) is taken by {count} model(s) "
                    f"({num_bytes / 2**20:,.0f} MiB) with requests running or waiting; "
                    "retry when they finish",
                    code="model_budget",
                    headers={"Retry-After": "5"},
                )
            victim = min(idle, key=lambda m: m.last_used)
            log.info(
                "unloading %s (least recently used) to make room for %s", victim.name, model.name
            )
            await self.unload(victim)

    async def unload(self, model: ServedModel) -> bool:
        """Stop `model`'s engine and let its memory go; False when it is busy or not loaded."""
        if not model.loaded or not model.idle:
            return False
        self._cancel_expiry(model)
        engine = model.engine
        model.status = "unloading"
        try:
            await engine.stop()
        finally:
            model.engine = None
            model._load = None  # a finished load task holds the engine as its result
            model.expires_at = None
            model.status = "unloaded"
            model.events.close_all()
            model.events.engine = None
            del engine
            _return_memory()
        log.info("model %s unloaded", model.name)
        return True

    def _arm_expiry(self, model: ServedModel) -> None:
        self._cancel_expiry(model)
        keep = model.keep_alive
        if keep is None:
            model.expires_at = None
            return
        model.expires_at = time.time() + keep
        loop = asyncio.get_running_loop()
        model._timer = loop.call_later(keep, self._expire, model)

    def _cancel_expiry(self, model: ServedModel) -> None:
        if model._timer is not None:
            model._timer.cancel()
            model._timer = None
        model.expires_at = None

    def _expire(self, model: ServedModel) -> None:
        model._timer = None
        if model.idle and model.loaded and not self.stopping:
            task = asyncio.get_running_loop().create_task(self.unload(model))
            self._unloads.add(task)
            task.add_done_callback(self._unloads.discard)

    async def stop(self) -> None:
        """Stop every engine (what runs ends with finish reason "shutdown"). Idempotent."""
        self.stopping = True
        for model in self.models:
            self._cancel_expiry(model)
            if model.engine is not None:
                await model.engine.stop()
        for task in list(self._unloads):
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await task


def _engine_bytes(engine: Any) -> int:
    """The bytes a loaded engine holds: weights plus its KV pool."""
    weights = getattr(getattr(getattr(engine, "loaded", None), "model", None), "num_bytes", 0)
    pool = getattr(getattr(engine, "pool_size", None), "num_bytes", 0)
    return int(weights or 0) + int(pool or 0)
