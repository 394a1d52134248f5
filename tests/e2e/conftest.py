"""Live servers on 127.0.0.1 for end-to-end tests, and the tools to look inside them.

Servers run in-process (uvicorn on its own loop in a thread) over the session's shared model, so
tests can read the engine's state on its loop (`server.call`) and hold or slow its steps by
wrapping `engine.batch.execute` (`StepGate`). Every server a test starts is stopped at teardown.
"""

from __future__ import annotations

import json
import logging
import re
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import httpx
import pytest

from kvserve.config import (
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    QueueConfig,
    SchedulerConfig,
    ServerConfig,
    StreamConfig,
)

CHAT = [{"role": "user", "content": "Tell me about the sea."}]


def small_engine_config(
    *,
    max_num_seqs: int = 2,
    num_kv_blocks: int = 64,
    max_queue_per_slot: int = 2,
    queue_timeout: float = 30.0,
    buffer_steps: int = 256,
    max_model_len: int | None = 1024,
) -> EngineConfig:
    return EngineConfig(
        device=DeviceConfig(device="cpu"),
        cache=CacheConfig(num_kv_blocks=num_kv_blocks),
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_model_len=max_model_len),
        queue=QueueConfig(max_queue_per_slot=max_queue_per_slot, queue_timeout=queue_timeout),
        stream=StreamConfig(buffer_steps=buffer_steps),
    )


@pytest.fixture(scope="session")
def server_factory(loaded_default):
    """`start(engine_config=..., server_config=..., sock=..., loaded=...) -> BackgroundServer`,
    ready (on the session's default model unless `loaded` names another; a loaded encoder is
    served for embeddings only).

    Servers not stopped by the test are stopped when the session ends."""
    from kvserve.engine.embedding import EmbeddingEngine
    from kvserve.engine.engine import Engine
    from kvserve.model.bert import LoadedEncoder
    from kvserve.server.app import create_app
    from tests.e2e.harness import BackgroundServer

    started: list[BackgroundServer] = []

    def start(
        engine_config: EngineConfig | None = None,
        server_config: ServerConfig | None = None,
        *,
        sock: socket.socket | None = None,
        loaded=None,
    ) -> BackgroundServer:
        config = engine_config or small_engine_config()
        model = loaded or loaded_default

        def engine(observer):
            if isinstance(model, LoadedEncoder):  # an embedding-only model
                return EmbeddingEngine(config, model, observer=observer)
            return Engine(config, loaded=model, observer=observer, record_steps=True)

        app = create_app(server_config or ServerConfig(), engine)
        server = BackgroundServer(app, sock=sock).start()
        started.append(server)
        server.wait_ready()
        return server

    yield start
    for server in started:
        server.stop()


class StepGate:
    """Wraps `engine.batch.execute` so steps run only when the test allows them.

    `plans` lists each step's request ids in the order the steps began. `step()` lets one more
    step run, `open()` lets all run, `delay` slows each step (seconds) once it may run.
    """

    def __init__(self, engine, *, closed: bool = True, delay: float = 0.0) -> None:
        self.engine = engine
        self._execute = engine.batch.execute
        self._condition = threading.Condition()
        self._open = not closed
        self._allowed = 0
        self.delay = delay
        self.plans: list[tuple[str, ...]] = []
        self.num_blocked = 0
        self.num_done = 0
        self.fail_after: int | None = None
        engine.batch.execute = self

    def __call__(self, plan, *args):
        with self._condition:
            self.plans.append(tuple(plan.request_ids))
            while not self._open and self._allowed == 0:
                self.num_blocked += 1
                self._condition.notify_all()
                self._condition.wait()
                self.num_blocked -= 1
            if not self._open:
                self._allowed -= 1
        if self.delay:
            time.sleep(self.delay)
        try:
            if self.fail_after is not None and len(self.plans) > self.fail_after:
                raise RuntimeError("injected step failure")
            return self._execute(plan, *args)
        finally:
            with self._condition:
                self.num_done += 1
                self._condition.notify_all()

    def wait_blocked(self, timeout: float = 30.0) -> None:
        """Wait until a step is held at the gate."""
        self._wait_for(lambda: self.num_blocked > 0, timeout, "no step reached the gate")

    def step(self, timeout: float = 30.0) -> None:
        """Let exactly one held step run, and wait until it has run."""
        self.wait_blocked(timeout)
        with self._condition:
            target = self.num_done + 1
            self._allowed += 1
            self._condition.notify_all()
        self._wait_for(lambda: self.num_done >= target, timeout, "the step did not finish")

    def open(self) -> None:
        with self._condition:
            self._open = True
            self._condition.notify_all()

    def remove(self) -> None:
        self.open()
        self.engine.batch.execute = self._execute

    def _wait_for(self, predicate: Callable[[], bool], timeout: float, message: str) -> None:
        deadline = time.monotonic() + timeout
        with self._condition:
            while not predicate():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(message)
                self._condition.wait(remaining)


@pytest.fixture
def gate_factory():
    """`gate(server, closed=True, delay=0.0) -> StepGate`; removed after the test."""
    gates: list[StepGate] = []

    def install(server, *, closed: bool = True, delay: float = 0.0) -> StepGate:
        gate = StepGate(server.state.engine, closed=closed, delay=delay)
        gates.append(gate)
        return gate

    yield install
    for gate in reversed(gates):
        gate.remove()


def wait_until(predicate: Callable[[], bool], timeout: float = 30.0, message: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(message or "condition not reached")
        time.sleep(0.01)


@pytest.fixture
def until():
    """`until(predicate, timeout=30, message="")`: poll until true, else TimeoutError."""
    return wait_until


class AccessLog(logging.Handler):
    """Collects the `kvserve.access` lines."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())

    def line_for(self, request_id: str) -> str | None:
        for line in self.lines:
            if line.startswith(request_id + " "):
                return line
        return None

    def with_status(self, status: int) -> list[str]:
        return [line for line in self.lines if line.split()[3] == str(status)]


@pytest.fixture
def access_log() -> Iterator[AccessLog]:
    logger = logging.getLogger("kvserve.access")
    handler = AccessLog()
    previous = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    yield handler
    logger.removeHandler(handler)
    logger.setLevel(previous)


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? (\S+)$")


_MODEL_LABEL = re.compile(r'model_name="(?:[^"\\]|\\.)*",?')


def scrape(server, *, by_model: bool = False) -> dict[str, float]:
    """`GET /metrics` as {'name{labels}': value}: summed over the served models (their
    `model_name` label left out) unless `by_model`."""
    response = httpx.get(server.url + "/metrics", timeout=10)
    response.raise_for_status()
    samples: dict[str, float] = {}
    for line in response.text.splitlines():
        match = _SAMPLE.match(line)
        if match:
            labels = match.group(2) or ""
            if not by_model:
                labels = _MODEL_LABEL.sub("", labels).replace(",}", "}")
                labels = "" if labels == "{}" else labels
            key = match.group(1) + labels
            samples[key] = samples.get(key, 0.0) + float(match.group(3))
    return samples


@pytest.fixture
def metrics():
    """`metrics(server) -> {'name{labels}': value}` from GET /metrics."""
    return scrape


@dataclass
class RawResponse:
    status: int
    headers: dict[str, str]
    body: bytes


class RawClient:
    """HTTP/1.1 over a plain socket, for what httpx hides: closing mid-answer, not reading."""

    def __init__(self, port: int, *, receive_buffer: int | None = None) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        if receive_buffer is not None:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
        self.sock.connect(("127.0.0.1", port))
        self.sock.settimeout(60)
        self._buffer = b""

    def post(self, path: str, payload: dict, headers: dict[str, str] | None = None) -> None:
        body = json.dumps(payload).encode()
        lines = [
            f"POST {path} HTTP/1.1",
            "Host: 127.0.0.1",
            "Content-Type: application/json",
            f"Content-Length: {len(body)}",
            *(f"{name}: {value}" for name, value in (headers or {}).items()),
        ]
        self.sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode() + body)

    def read_head(self) -> tuple[int, dict[str, str]]:
        while b"\r\n\r\n" not in self._buffer:
            chunk = self.sock.recv(4096)
            if not chunk:
                raise ConnectionError("closed before the response head")
            self._buffer += chunk
        head, self._buffer = self._buffer.split(b"\r\n\r\n", 1)
        status_line, *header_lines = head.decode("latin-1").split("\r\n")
        headers = {}
        for line in header_lines:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        self._ndjson = headers.get("content-type", "").startswith("application/x-ndjson")
        return int(status_line.split()[1]), headers

    def read_events(self, count: int) -> bytes:
        """Read until `count` SSE events (or, for an NDJSON answer, objects) have arrived;
        returns everything after the head."""
        marker = b'"done":' if getattr(self, "_ndjson", False) else b"data: "
        while self._buffer.count(marker) < count:
            chunk = self.sock.recv(4096)
            if not chunk:
                raise ConnectionError(f"closed before {count} events")
            self._buffer += chunk
        return self._buffer

    def read_until(self, marker: bytes) -> bytes:
        while marker not in self._buffer:
            chunk = self.sock.recv(4096)
            if not chunk:
                raise ConnectionError(f"closed before {marker!r}")
            self._buffer += chunk
        return self._buffer

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def raw_client():
    """`raw_client(port, receive_buffer=None) -> RawClient`; closed after the test."""
    clients: list[RawClient] = []

    def connect(port: int, *, receive_buffer: int | None = None) -> RawClient:
        client = RawClient(port, receive_buffer=receive_buffer)
        clients.append(client)
        return client

    yield connect
    for client in clients:
        client.close()


def sse_events(lines: list[str]) -> list[str]:
    return [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]


@pytest.fixture(scope="session")
def engine_config():
    """`engine_config(**overrides) -> EngineConfig`: small settings for fast tests."""
    return small_engine_config
