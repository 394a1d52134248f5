"""One renderer shape for every dialect of the HTTP API.

The generation core reads each answer as pieces: text, and for each tool call its start, its
arguments in parts and its end (`kvserve.server.dialects.function_tools.CallReader` finds the
calls under the request's tool plan, the same way for every dialect). A dialect only draws the
pieces, in one of two renderers:

- a `StreamRenderer` turns each `Update` into frames ready to send (SSE events, NDJSON lines):
  `head` once the request is admitted, `update` per delta, then `tail` with the `Ending` (the
  reason, the usage) or `error` when the answer broke after the 200 went out;
- a `BodyRenderer` collects the updates and returns the whole answer from `body`.

`Rendering` joins a dialect's two renderers for one request: the engine's deltas go in, through
a call reader per answer, and the pieces go to the streaming renderer or to the whole one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvserve.engine.stream import Delta, TokenLogprob, Usage
from kvserve.server.dialects.function_tools import (
    CallArguments,
    CallEnd,
    CallReader,
    CallStart,
    Piece,
)
from kvserve.server.protocol import APIError
from kvserve.server.tools import ToolPlan

__all__ = [
    "BodyRenderer",
    "CallArguments",
    "CallEnd",
    "CallStart",
    "Ending",
    "Piece",
    "Rendering",
    "StreamRenderer",
    "Timing",
    "Update",
    "text_of",
]


@dataclass(frozen=True, slots=True)
class Update:
    """What one delta added to answer `index` (0 .. n-1): its pieces in order, its tokens'
    log-probabilities, and the answer's finish reason when it ended here. `prompt_logprobs`
    (one entry per prompt token, None first) rides on the first delta of a request that asked
    for them."""

    pieces: tuple[Piece, ...]
    index: int = 0
    logprobs: tuple[TokenLogprob, ...] = ()
    finish_reason: str | None = None
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None


@dataclass(frozen=True, slots=True)
class Timing:
    """When the request arrived, was admitted, got its first token and ended (monotonic
    seconds; None where it did not happen)."""

    arrived: float
    admitted: float | None
    first_token: float | None
    finished: float


@dataclass(frozen=True, slots=True)
class Ending:
    """How the request ended: the finish reason (`stop` or `length`), the usage over every
    answer, the stop string that ended it, and its timing where the core measured it."""

    finish_reason: str
    usage: Usage
    stop_sequence: str | None = None
    timing: Timing | None = None


def text_of(pieces: tuple[Piece, ...]) -> str:
    """The text among `pieces` (calls left out)."""
    return "".join(piece for piece in pieces if isinstance(piece, str))


class StreamRenderer:
    """A dialect's streamed answer: every method returns ready frames (possibly empty)."""

    media_type = "text/event-stream"

    def head(self) -> str:
        """Frames sent once the request is admitted, before any token."""
        return ""

    def update(self, update: Update) -> str:
        """Frames for one delta's pieces."""
        raise NotImplementedError

    def tail(self, ending: Ending) -> str:
        """The last frames: the stop reason and usage, and the end of the stream."""
        raise NotImplementedError

    def error(self, error: APIError) -> str:
        """The frames that end a stream which failed after its 200 went out."""
        raise NotImplementedError


class BodyRenderer:
    """A dialect's whole answer: updates collected, then the response body."""

    def update(self, update: Update) -> None:
        raise NotImplementedError

    def body(self, ending: Ending) -> dict[str, Any]:
        raise NotImplementedError


class Rendering:
    """One request's answer in one dialect, streamed or whole, as the generation core drives
    it (`kvserve.server.core.ServerState.generate`).

    Streaming: `head` once admitted, `frames` per delta, then `tail` (the final delta) or
    `error_tail`. Whole: `add` per delta, the final one included, then `response`. Each delta
    is read by the call reader of its answer (tool calls under `plan`, ids starting with
    `id_prefix`) and handed over as an `Update`; `stream` and `whole` build the dialect's two
    renderers, the one used on first use.
    """

    def __init__(
        self,
        plan: ToolPlan | None,
        *,
        stream: Callable[[], StreamRenderer],
        whole: Callable[[], BodyRenderer],
        id_prefix: str = "call_",
    ) -> None:
        self._plan = plan
        self._id_prefix = id_prefix
        self._make_stream = stream
        self._make_whole = whole
        self._stream: StreamRenderer | None = None
        self._whole: BodyRenderer | None = None
        self._readers: dict[int, CallReader] = {}

    @property
    def streamer(self) -> StreamRenderer:
        if self._stream is None:
            self._stream = self._make_stream()
        return self._stream

    @property
    def collector(self) -> BodyRenderer:
        if self._whole is None:
            self._whole = self._make_whole()
        return self._whole

    @property
    def media_type(self) -> str:
        """The content type of the streamed answer."""
        return self.streamer.media_type

    def _update(self, delta: Delta) -> Update:
        reader = self._readers.get(delta.index)
        if reader is None:
            reader = self._readers[delta.index] = CallReader(self._plan, self._id_prefix)
        pieces = reader.feed(delta.text, final=delta.finish_reason is not None)
        return Update(
            tuple(pieces), delta.index, delta.logprobs, delta.finish_reason, delta.prompt_logprobs
        )

    # -- streaming -----------------------------------------------------------------------------

    def head(self) -> str:
        return self.streamer.head()

    def frames(self, delta: Delta) -> str:
        return self.streamer.update(self._update(delta))

    def tail(self, final: Delta, timing: Timing | None = None) -> str:
        streamer = self.streamer
        return streamer.update(self._update(final)) + streamer.tail(_ending(final, timing))

    def error_tail(self, error: APIError) -> str:
        return self.streamer.error(error)

    # -- whole ---------------------------------------------------------------------------------

    def add(self, delta: Delta) -> None:
        self.collector.update(self._update(delta))

    def response(self, final: Delta, timing: Timing | None = None) -> dict[str, Any]:
        return self.collector.body(_ending(final, timing))


def _ending(final: Delta, timing: Timing | None) -> Ending:
    assert final.finish_reason is not None and final.usage is not None
    return Ending(final.finish_reason, final.usage, final.stop_sequence, timing)
