"""Per-request delivery: a bounded buffer the engine fills without ever waiting.

The engine loop puts at most one delta per request per step with `offer`, which never blocks:
when a client has `capacity` undelivered steps pending, `offer` returns False and the engine
cancels the request as a slow consumer. The final delta (finish reason and usage) is always
delivered, beyond the bound, so a stream that ended can be told from one that broke.

Everything here runs on the event loop's thread; there are no locks.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass

from kvserve.request import EngineError


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # most likely alternatives, best first
    rank: int | None = None  # 1 = the most likely token; None where it was not computed


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int  # every answer's tokens, added up (n > 1)
    cached_tokens: int = 0  # prompt tokens taken from the prefix cache

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True, slots=True)
class Delta:
    """What one step added to one answer of a request, or the request's end.

    `text` holds only whole characters; it may be empty while bytes of a character, or a
    possible stop string, are held back. `index` names the answer (0 .. n-1). An answer's last
    delta has its `finish_reason`; the stream's last delta (`finished`) also has `usage`. With
    n = 1 those are the same delta.
    """

    text: str = ""
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[TokenLogprob, ...] = ()
    finish_reason: str | None = None  # stop | length | cancelled | slow_consumer | error | ...
    usage: Usage | None = None
    error: EngineError | None = None
    timestamp: float = 0.0
    index: int = 0
    # On the delta of the first generated token, when the request asked for prompt logprobs:
    # one entry per prompt token, None for the first (nothing precedes it).
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None
    stop_sequence: str | None = None  # the stop string that ended it (finish_reason "stop")

    @property
    def finished(self) -> bool:
        """The stream's last delta."""
        return self.usage is not None


class Stream:
    """Async iterator of Deltas for one request.

    `await stream.admitted()` returns once the request holds a slot (or raises the error that
    ended it while queued: QueueTimeout, RequestCancelled, EngineStopped), so a server can pick
    its status code before sending a byte.
    """

    def __init__(self, request_id: str, capacity: int) -> None:
        self.request_id = request_id
        self.capacity = capacity
        self._items: deque[Delta] = deque()
        self._final: Delta | None = None
        self._wakeup = asyncio.Event()
        self._admission: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    # -- engine side ---------------------------------------------------------------------------

    def offer(self, delta: Delta) -> bool:
        """Queue a delta without waiting. False: the client is `capacity` steps behind."""
        if self._final is not None:
            return True
        if len(self._items) >= self.capacity:
            return False
        self._items.append(delta)
        self._wakeup.set()
        return True

    def finish(self, delta: Delta) -> None:
        """Deliver the last delta (never refused) and end the stream. Idempotent."""
        if self._final is not None:
            return
        self._final = delta
        if not self._admission.done():
            if delta.error is not None:
                self._admission.set_exception(delta.error)
                self._admission.exception()  # mark retrieved: nobody may be waiting
            else:
                self._admission.set_result(None)
        self._wakeup.set()

    def mark_admitted(self) -> None:
        if not self._admission.done():
            self._admission.set_result(None)

    # -- consumer side -------------------------------------------------------------------------

    async def admitted(self) -> None:
        await asyncio.shield(self._admission)

    def __aiter__(self) -> Stream:
        return self

    async def __anext__(self) -> Delta:
        while True:
            if self._items:
                return self._items.popleft()
            if self._final is not None:
                final, self._final = self._final, _DONE
                if final is _DONE:
                    raise StopAsyncIteration
                return final
            self._wakeup.clear()
            await self._wakeup.wait()

    def drain_ready(self) -> list[Delta]:
        """Every delta available now without waiting (lets a writer batch its output)."""
        out = list(self._items)
        self._items.clear()
        if self._final is not None and self._final is not _DONE:
            out.append(self._final)
            self._final = _DONE
        return out

    async def collect(self) -> list[Delta]:
        return [delta async for delta in self]


_DONE = Delta(finish_reason="__done__", usage=Usage(0, 0))
