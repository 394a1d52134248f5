"""A served app on its own event loop in a daemon thread, for tests: `BackgroundServer`; and
for `kvserve serve` run as a process: `free_port`, `OutputLines`."""

from __future__ import annotations

import asyncio
import queue
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

from fastapi import FastAPI

from kvserve.engine.engine import Engine
from kvserve.server.app import Server
from kvserve.server.core import ServerState

T = TypeVar("T")


class BackgroundServer:
    """An app served on its own event loop in a daemon thread.

        with BackgroundServer(app) as server:
            httpx.get(server.url + "/health")

    `call(fn)` runs `fn` on the serving loop (where engine state may be read) and returns its
    result; `wait_ready()` waits for the model to load.
    """

    def __init__(
        self,
        app: FastAPI,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        sock: socket.socket | None = None,
        log_level: str = "warning",
    ) -> None:
        self.app = app
        self.state: ServerState = app.state.kvserve
        self.server = Server(app, host=host, port=port, log_level=log_level)
        self.host = host
        self._sock = sock
        self._thread: threading.Thread | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self._error: BaseException | None = None

    @property
    def port(self) -> int:
        port = self.server.bound_port
        if port is None:
            raise RuntimeError("the server is not listening")
        return port

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 60.0) -> BackgroundServer:
        """Start serving; returns once the socket listens (the model may still be loading)."""

        def main() -> None:
            self.loop = asyncio.new_event_loop()
            asyncio.set_event_loop(self.loop)
            try:
                sockets = [self._sock] if self._sock is not None else None
                self.loop.run_until_complete(self.server.serve(sockets=sockets))
            except BaseException as exc:
                self._error = exc
            finally:
                self.loop.close()

        self._thread = threading.Thread(target=main, name="kvserve-http", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the server did not start: {self._error!r}")
            time.sleep(0.01)
        return self

    def wait_ready(self, timeout: float = 120.0) -> Engine:
        """Block until the engine runs; returns it."""
        deadline = time.monotonic() + timeout
        while not self.state.ready:
            if self.state.load_error is not None:
                raise RuntimeError("the model failed to load") from self.state.load_error
            if time.monotonic() > deadline:
                raise TimeoutError("the engine did not become ready")
            time.sleep(0.01)
        assert self.state.engine is not None
        return self.state.engine

    def call(self, function: Callable[[], T], timeout: float = 30.0) -> T:
        """Run `function()` on the serving loop's thread and return its result."""
        if self.loop is None:
            raise RuntimeError("the server is not running")
        future: Future[T] = Future()

        def run() -> None:
            try:
                future.set_result(function())
            except BaseException as exc:
                future.set_exception(exc)

        self.loop.call_soon_threadsafe(run)
        return future.result(timeout)

    def stop(self, timeout: float = 30.0) -> None:
        """Shut down (engine first, then connections) and join the thread."""
        self.server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                self.server.force_exit = True
                self._thread.join(timeout)

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def free_port() -> int:
    """A TCP port on 127.0.0.1 nothing listens on now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class OutputLines:
    """A process's output stream, line by line, read in a thread so waits can time out."""

    def __init__(self, stream) -> None:
        self.lines: list[str] = []
        self._queue: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, args=(stream,), daemon=True).start()

    def _pump(self, stream) -> None:
        for line in stream:
            self._queue.put(line)
        self._queue.put(None)

    def _next(self, deadline: float, waiting_for: str) -> str | None:
        """The next line (kept in `lines`), None once the stream has ended; TimeoutError when
        none comes before `deadline`."""
        while (remaining := deadline - time.monotonic()) > 0:
            try:
                line = self._queue.get(timeout=remaining)
            except queue.Empty:
                continue
            if line is None:
                self._queue.put(None)  # closed for any later wait too
                return None
            self.lines.append(line)
            return line
        raise TimeoutError(f"{waiting_for}; got {self.lines}")

    def wait_for(self, text: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while (line := self._next(deadline, f"{text!r} not printed")) is not None:
            if text in line:
                return line
        raise RuntimeError(f"the process exited before printing {text!r}: {self.lines}")

    def until_closed(self, timeout: float) -> list[str]:
        """Every line, once the stream has ended (the process exited)."""
        deadline = time.monotonic() + timeout
        while self._next(deadline, "the stream did not end") is not None:
            pass
        return self.lines
