"""Offline API for scripts, shaped like vLLM's: `LLM(model).generate(prompts, SamplingParams())`.

    from kvserve import LLM, SamplingParams

    with LLM(dtype="float32", max_num_seqs=16) as llm:
        for output in llm.generate(["The sea is"], SamplingParams(max_tokens=20)):
            print(output.prompt, output.outputs[0].text)

It runs the same Engine as the server, on an event loop in a background thread, so the calls
here are plain blocking functions. Options take vLLM's names; the outputs have vLLM's fields.
An LLM left open is closed when the interpreter exits (or when it is garbage collected), so a
script that never calls `close` still ends quietly.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import weakref
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvserve.config import EngineConfig, parse_speculative_config
from kvserve.engine.engine import Engine
from kvserve.engine.stream import Delta, TokenLogprob
from kvserve.model.loader import LoadedModel
from kvserve.params import SamplingParams, SamplingParamsError
from kvserve.request import GenerationRequest, InvalidRequest
from kvserve.tokenizer import Tokenizer

__all__ = ["LLM", "CompletionOutput", "Logprob", "RequestOutput"]

Prompt = str | Sequence[int] | Mapping[str, Any]
Conversation = Sequence[Mapping[str, Any]]

# vLLM's engine-argument names, and where each lives in EngineConfig.
ENGINE_OPTIONS: dict[str, tuple[str, str]] = {
    "dtype": ("device", "dtype"),
    "device": ("device", "device"),
    "quantization": ("device", "quantization"),
    "kv_cache_dtype": ("cache", "kv_cache_dtype"),
    "max_num_seqs": ("scheduler", "max_num_seqs"),
    "max_model_len": ("scheduler", "max_model_len"),
    "enable_prefix_caching": ("cache", "enable_prefix_caching"),
    "seed": ("", "seed"),
    "speculative_config": ("", "speculative"),
}
"""Keyword options of `LLM`: name -> (EngineConfig group, field); "" is EngineConfig itself."""


@dataclass(frozen=True, slots=True)
class Logprob:
    """One token's log-probability at a position (vLLM's `Logprob`). `rank` is 1 for the most
    likely token; None where it was not computed (a sampled token outside the top alternatives)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


PositionLogprobs = dict[int, Logprob]
"""The chosen (or prompt) token and the top alternatives at one position, by token id."""


@dataclass(frozen=True, slots=True)
class CompletionOutput:
    """One generated sequence (vLLM's `CompletionOutput`)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[PositionLogprobs] | None
    finish_reason: str | None


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """The answer to one prompt (vLLM's `RequestOutput`): `outputs` holds `n` completions.

    `prompt_logprobs` (when asked for with `SamplingParams(prompt_logprobs=k)`) has one entry
    per prompt token, None for the first.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[PositionLogprobs | None] | None
    outputs: list[CompletionOutput]
    finished: bool = True


def engine_config(
    model: str | None = None, config: EngineConfig | None = None, **options: Any
) -> EngineConfig:
    """`config` (or the defaults) with `model` and vLLM-named `options` applied.

    An unknown option is a TypeError that lists the known ones.
    """
    unknown = sorted(set(options) - set(ENGINE_OPTIONS))
    if unknown:
        raise TypeError(
            f"LLM() got unknown option(s) {', '.join(map(repr, unknown))}; "
            f"the options are: {', '.join(sorted(ENGINE_OPTIONS))}"
        )
    config = config or EngineConfig()
    if model is not None:
        if config.model not in (None, model):
            raise ValueError("pass the model either as `model` or inside `config`, not both")
        config = dataclasses.replace(config, model=model)
    groups: dict[str, dict[str, Any]] = {}
    for name, value in options.items():
        group, field_name = ENGINE_OPTIONS[name]
        groups.setdefault(group, {})[field_name] = value
    top = groups.pop("", {})
    if "speculative" in top:
        top["speculative"] = parse_speculative_config(top["speculative"])
    for group, values in groups.items():
        top[group] = dataclasses.replace(getattr(config, group), **values)
    return dataclasses.replace(config, **top)


class LLM:
    """A model and an engine for batch generation from Python.

    `LLM(model=None, **options)`: `model` is a .gguf file or a Hugging Face directory (None: the
    default model); options take vLLM's names (see `ENGINE_OPTIONS`). `config` gives a whole
    EngineConfig instead (options then change it), `loaded` an already loaded model.
    All prompts given to one `generate` call are submitted together and batched continuously.
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        config: EngineConfig | None = None,
        loaded: LoadedModel | None = None,
        record_steps: bool = False,
        **options: Any,
    ) -> None:
        config = engine_config(model, config, **options)
        self.engine = Engine(config, loaded, record_steps=record_steps)
        self.tokenizer: Tokenizer = self.engine.tokenizer
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="kvserve-llm", daemon=True
        )
        self._thread.start()
        # Closes the engine at interpreter exit (or when this object is collected) if `close`
        # was never called; it holds no reference to `self`.
        self._finalizer = weakref.finalize(self, _shut_down, self.engine, self._loop, self._thread)
        self._call(self.engine.start())

    def _call(self, coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    def encode(self, prompt: str | Sequence[int]) -> tuple[int, ...]:
        """Token ids of a raw prompt: text is encoded with control tokens parsed (a prompt the
        caller templated itself), ids are taken as they are."""
        if isinstance(prompt, str):
            return tuple(
                self.tokenizer.encode(prompt, add_bos=self.tokenizer.add_bos, parse_special=True)
            )
        return tuple(prompt)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Generate for each prompt; outputs in prompt order.

        A prompt is text, a list of token ids, or vLLM's `{"prompt": text}` /
        `{"prompt_token_ids": ids}`. Text is a raw prompt: control-token spellings in it
        (`<|im_start|>`) become control tokens.
        """
        if (
            isinstance(prompts, str | Mapping)
            or isinstance(prompts, Sequence)
            and prompts
            and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        items = []
        for prompt in prompts:
            if isinstance(prompt, Mapping):
                if "prompt_token_ids" in prompt:
                    prompt = list(prompt["prompt_token_ids"])
                elif "prompt" in prompt:
                    prompt = prompt["prompt"]
                else:
                    raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
            text = prompt if isinstance(prompt, str) else None
            items.append((text, self.encode(prompt)))
        return self._generate(items, sampling_params)

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Reply to one conversation (a list of messages) or to each of a list of them, each
        rendered with the model's chat template; text in the messages stays text."""
        if messages and isinstance(messages[0], Mapping):
            messages = [messages]
        items = [
            (self.tokenizer.render_chat(c), tuple(self.tokenizer.encode_chat(c))) for c in messages
        ]
        return self._generate(items, sampling_params)

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
        items: list[tuple[str | None, tuple[int, ...]]],
        params: SamplingParams | Sequence[SamplingParams] | None,
    ) -> list[RequestOutput]:
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(items)
        if len(params) != len(items):
            raise ValueError("give one SamplingParams, or one per prompt")
        for p in params:
            try:
                p.validate(self.engine.model_config.vocab_size)
            except SamplingParamsError as exc:
                raise ValueError(str(exc)) from None
        # One engine request per prompt: its n answers share one prefill, answer i drawing
        # from seed + i when a seed is given.
        requests = [GenerationRequest(ids, p) for (_, ids), p in zip(items, params, strict=True)]

        async def run() -> list[list[Delta]]:
            streams = []
            try:
                for request in requests:
                    streams.append(self.engine.submit(request))
            except BaseException:
                for request in requests:
                    self.engine.cancel(request.request_id)
                raise
            return list(await asyncio.gather(*(s.collect() for s in streams)))

        try:
            results = self._call(run())
        except InvalidRequest as exc:
            raise ValueError(exc.message) from None
        return [
            self._output(text, group, deltas)
            for (text, _), group, deltas in zip(items, requests, results, strict=True)
        ]

    def _output(
        self, prompt: str | None, request: GenerationRequest, results: list[Delta]
    ) -> RequestOutput:
        final = results[-1]
        if final.error is not None and final.finish_reason not in ("stop", "length"):
            raise final.error
        outputs = []
        prompt_logprobs = None
        wanted = request.params.logprobs is not None
        for index in range(request.params.n):
            deltas = [d for d in results if d.index == index]
            ends = [d.finish_reason for d in deltas if d.finish_reason is not None]
            for delta in deltas:
                if delta.prompt_logprobs is not None and prompt_logprobs is None:
                    prompt_logprobs = [
                        None if entry is None else self._position(entry)
                        for entry in delta.prompt_logprobs
                    ]
            entries = [lp for d in deltas for lp in d.logprobs]
            outputs.append(
                CompletionOutput(
                    index=index,
                    text="".join(d.text for d in deltas),
                    token_ids=[t for d in deltas for t in d.token_ids],
                    cumulative_logprob=sum(e.logprob for e in entries) if wanted else None,
                    logprobs=[self._position(e) for e in entries] if wanted else None,
                    finish_reason=ends[-1] if ends else final.finish_reason,
                )
            )
        return RequestOutput(
            request_id=request.request_id,
            prompt=prompt,
            prompt_token_ids=list(request.prompt_token_ids),
            prompt_logprobs=prompt_logprobs,
            outputs=outputs,
        )

    def _position(self, entry: TokenLogprob) -> PositionLogprobs:
        """vLLM's dict for one position: the alternatives by rank, and the token itself."""
        texts = self.tokenizer.token_texts
        ranked = {
            token_id: Logprob(logprob, rank, text)
            for rank, ((token_id, logprob), text) in enumerate(
                zip(entry.top, texts([t for t, _ in entry.top]), strict=True), start=1
            )
        }
        if entry.token_id not in ranked:
            (text,) = texts([entry.token_id])
            ranked = {entry.token_id: Logprob(entry.logprob, entry.rank, text), **ranked}
        return ranked

    def close(self) -> None:
        """Stop the engine and its thread (requests still running end). Idempotent."""
        self._finalizer()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _shut_down(engine: Engine, loop: asyncio.AbstractEventLoop, thread: threading.Thread) -> None:
    if loop.is_closed():
        return
    if threading.current_thread() is thread:
        # Collected on its own loop's thread, which cannot wait for itself: stop the loop.
        loop.stop()
        return
    if thread.is_alive():
        asyncio.run_coroutine_threadsafe(engine.stop(), loop).result()
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
    loop.close()
