"""An HTTP app served on its own event loop in a thread of the current process.

A Ray Serve replica is an actor whose event loop belongs to Ray; kvserve's engine and the
ingress each want a uvicorn server of their own (SSE flushed per event, disconnects seen at
once), so each deployment runs one here, on a port it owns.
"""

from __future__ import annotations

import argparse
import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

import uvicorn

__all__ = ["ThreadedServer", "serve_namespace"]


def serve_namespace(overrides: dict[str, Any]) -> argparse.Namespace:
    """`kvserve serve`'s parsed flags: its defaults, then `overrides` (by destination name,
    e.g. {"threads": 1, "max_num_seqs": 4}). The flag list is `kvserve serve`'s own."""
    from kvserve.server.cli import add_arguments

    parser = argparse.ArgumentParser(prog="kvserve serve")
    add_arguments(parser)
    args = parser.parse_args([])
    unknown = sorted(set(overrides) - set(vars(args)))
    if unknown:
        raise ValueError(f"not a 'kvserve serve' setting: {', '.join(unknown)}")
    for name, value in overrides.items():
        setattr(args, name, value)
    return args


class ThreadedServer:
    """A uvicorn server (kvserve's `Server` for a replica) on its own loop in a daemon thread."""

    def __init__(self, server: uvicorn.Server) -> None:
        self.server = server
        self.loop: asyncio.AbstractEventLoop | None = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name="kvserve-http", daemon=True)

    def _main(self) -> None:
        self.loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_until_complete(self.server.serve())
        except BaseException as exc:
            self.error = exc
        finally:
            self.loop.close()

    def start(self, timeout: float = 60.0) -> ThreadedServer:
        """Start; returns once the socket listens."""
        self._thread.start()
        self.wait_for(lambda: self.server.started, timeout, "the server did not start")
        return self

    def wait_for(self, predicate: Callable[[], bool], timeout: float, message: str) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            if not self._thread.is_alive():
                raise RuntimeError(f"{message}: {self.error!r}")
            if time.monotonic() > deadline:
                raise TimeoutError(message)
            time.sleep(0.02)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def port(self) -> int:
        for server in getattr(self.server, "servers", ()):
            for sock in server.sockets:
                return sock.getsockname()[1]
        raise RuntimeError("the server is not listening")

    def call_soon(self, function: Callable[..., Any], *args: Any) -> None:
        """Run `function(*args)` on the server's loop."""
        if self.loop is not None and not self.loop.is_closed():
            self.loop.call_soon_threadsafe(function, *args)

    def stop(self, timeout: float = 30.0) -> None:
        self.server.should_exit = True
        self._thread.join(timeout)
        if self._thread.is_alive():
            self.server.force_exit = True
            self._thread.join(timeout)
