"""Offline API for scripts: `LLM(model).generate(prompts, SamplingParams(...))`.

It runs the same Engine as the server, on an event loop in a background thread, so the calls
here are plain blocking functions.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvserve.config import EngineConfig
from kvserve.engine.engine import Engine
from kvserve.engine.stream import Delta, TokenLogprob, Usage
from kvserve.model.loader import LoadedModel
from kvserve.request import GenerationRequest
from kvserve.sampling import SamplingParams

Prompt = str | Sequence[int]
Conversation = Sequence[Mapping[str, Any]]


@dataclass(frozen=True, slots=True)
class CompletionOutput:
    """One of a request's n answers."""

    index: int
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str
    logprobs: tuple[TokenLogprob, ...]


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """A request's result: `outputs` holds its n answers; `text`, `token_ids`, `finish_reason`
    and `logprobs` are the first answer's; `usage` adds up every answer."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str
    usage: Usage
    logprobs: tuple[TokenLogprob, ...]
    outputs: tuple[CompletionOutput, ...] = ()


class LLM:
    """A model and an engine for batch generation from Python.

    All prompts given to one `generate` call are submitted together and batched continuously.
    """

    def __init__(
        self,
        model: str | None = None,
        config: EngineConfig | None = None,
        *,
        loaded: LoadedModel | None = None,
        record_steps: bool = False,
    ) -> None:
        config = config or EngineConfig(model=model)
        if model is not None and config.model != model:
            raise ValueError("pass the model either as `model` or inside `config`, not both")
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="kvserve-llm", daemon=True
        )
        self._thread.start()
        self.engine = Engine(config, loaded, record_steps=record_steps)
        self.tokenizer = self.engine.tokenizer
        self._call(self.engine.start())

    def _call(self, coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    def encode(self, prompt: Prompt) -> tuple[int, ...]:
        if isinstance(prompt, str):
            return tuple(self.tokenizer.encode(prompt, add_bos=self.tokenizer.add_bos))
        return tuple(prompt)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Generate for each prompt (text, or token ids); outputs in prompt order."""
        if isinstance(prompts, str) or (
            isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        return self._generate([self.encode(p) for p in prompts], params)

    def chat(
        self,
        conversations: Conversation | Sequence[Conversation],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Generate a reply to each conversation, rendered with the model's chat template."""
        if conversations and isinstance(conversations[0], Mapping):
            conversations = [conversations]
        return self._generate([tuple(self.tokenizer.encode_chat(c)) for c in conversations], params)

    def stream(
        self, prompt_token_ids: Sequence[int], params: SamplingParams | None = None
    ) -> Iterator[Delta]:
        """Yield deltas of one generation as they are produced."""
        request = GenerationRequest(tuple(prompt_token_ids), params or SamplingParams())

        async def start():
            return self.engine.submit(request)

        stream = self._call(start())
        while True:
            delta = self._call(stream.__anext__())
            yield delta
            if delta.finished:
                return

    def _generate(
        self,
        prompt_ids: list[tuple[int, ...]],
        params: SamplingParams | Sequence[SamplingParams] | None,
    ) -> list[RequestOutput]:
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompt_ids)
        if len(params) != len(prompt_ids):
            raise ValueError("give one SamplingParams, or one per prompt")
        requests = [GenerationRequest(ids, p) for ids, p in zip(prompt_ids, params, strict=True)]

        async def run() -> list[RequestOutput]:
            streams = [self.engine.submit(r) for r in requests]
            results = await asyncio.gather(*(s.collect() for s in streams))
            return [_output(r, deltas) for r, deltas in zip(requests, results, strict=True)]

        return self._call(run())

    def close(self) -> None:
        if self._loop.is_closed():
            return
        self._call(self.engine.stop())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _output(request: GenerationRequest, deltas: list[Delta]) -> RequestOutput:
    final = deltas[-1]
    if final.error is not None and final.finish_reason not in ("stop", "length"):
        raise final.error
    outputs = []
    for index in range(request.params.n):
        mine = [d for d in deltas if d.index == index]
        ends = [d.finish_reason for d in mine if d.finish_reason is not None]
        outputs.append(
            CompletionOutput(
                index=index,
                text="".join(d.text for d in mine),
                token_ids=tuple(t for d in mine for t in d.token_ids),
                finish_reason=ends[-1] if ends else final.finish_reason,
                logprobs=tuple(lp for d in mine for lp in d.logprobs),
            )
        )
    first = outputs[0]
    return RequestOutput(
        request_id=request.request_id,
        prompt_token_ids=request.prompt_token_ids,
        text=first.text,
        token_ids=first.token_ids,
        finish_reason=first.finish_reason,
        usage=final.usage,
        logprobs=first.logprobs,
        outputs=tuple(outputs),
    )
