"""Sampling parameters and their validation: plain Python, no torch, nothing native.

`SamplingParams` carries the user-facing knobs under their OpenAI/vLLM names, and a request's
`StructuredOutput` constraint when it has one. The HTTP layer builds and validates them without
importing the model; the batched sampler that honours them is `kvserve.engine.sampler`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

MAX_STOP_STRINGS = 4
"""At most this many stop strings per request, as OpenAI allows."""

MAX_LOGPROBS = 20
"""At most this many top alternatives per token, as OpenAI's `top_logprobs` allows."""

MAX_LOGIT_BIAS_ENTRIES = 1024
"""At most this many logit_bias entries: they are turned into tensors every step."""

MAX_N = 128
"""At most this many choices per request."""

_SEED_MIN = -(2**63)
_SEED_MAX = 2**64 - 1


class SamplingParamsError(ValueError):
    """A sampling parameter is out of range; `param` names the OpenAI request field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


LogitBias = Mapping[int, float] | tuple[tuple[int, float], ...]

STRUCTURED_KINDS = frozenset({"json", "json_object", "regex", "choice", "grammar"})
"""What a `StructuredOutput` may constrain the answer to (vLLM's `structured_outputs` kinds, and
`json_object`: any JSON object)."""

MAX_STRUCTURED_SPEC_CHARS = 200_000
"""The longest schema, regex or grammar text a request may bring."""


@dataclass(frozen=True, slots=True)
class StructuredOutput:
    """A constraint on the answer's text, enforced token by token by the sampler.

    `kind` is one of `STRUCTURED_KINDS`; `spec` is its text: a JSON schema as canonical JSON
    (``kind="json"``, keys in the given order), a regular expression, a JSON list of choice strings, or a Lark grammar
    (llguidance's dialect, which also reads GBNF-style ``::=`` rules); empty for
    ``json_object``. `param` is the request field it came from, so a schema the grammar
    engine cannot enforce is refused (400) naming that field. Two constraints with the same
    kind and spec compile to the same grammar (the engine caches compiled grammars by them).

    Build one with the class methods; every API dialect (chat, responses, messages, tools)
    turns its own fields into one of these.
    """

    kind: str
    spec: str = ""
    param: str = "structured_outputs"

    @classmethod
    def json_schema(
        cls, schema: Mapping[str, object] | bool, param: str = "structured_outputs.json"
    ) -> StructuredOutput:
        """Answers that validate against `schema` (a JSON schema as a mapping)."""
        if not isinstance(schema, Mapping | bool):
            raise SamplingParamsError("the JSON schema must be an object", param)
        try:
            # Key order is kept: the grammar writes properties in the schema's order.
            text = json.dumps(schema, separators=(",", ":"), allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise SamplingParamsError(
                f"the JSON schema cannot be serialised: {exc}", param
            ) from None
        return cls("json", text, param)

    @classmethod
    def json_object(cls, param: str = "response_format") -> StructuredOutput:
        """Any JSON object (OpenAI's JSON mode), with bounded whitespace."""
        return cls("json_object", "", param)

    @classmethod
    def regex(cls, pattern: str, param: str = "structured_outputs.regex") -> StructuredOutput:
        """Answers matching the whole of `pattern`."""
        if not isinstance(pattern, str) or not pattern:
            raise SamplingParamsError("the regex must be a non-empty string", param)
        return cls("regex", pattern, param)

    @classmethod
    def choice(
        cls, choices: Iterable[str], param: str = "structured_outputs.choice"
    ) -> StructuredOutput:
        """Answers equal to one of `choices`."""
        if isinstance(choices, str | Mapping) or not isinstance(choices, Iterable):
            raise SamplingParamsError("choice must be a list of strings", param)
        values = list(choices)
        if not values or not all(isinstance(value, str) and value for value in values):
            raise SamplingParamsError("choice must be a non-empty list of non-empty strings", param)
        return cls("choice", json.dumps(values, ensure_ascii=False), param)

    @classmethod
    def grammar(cls, text: str, param: str = "structured_outputs.grammar") -> StructuredOutput:
        """Answers of a context-free grammar (Lark syntax, as llguidance reads it)."""
        if not isinstance(text, str) or not text.strip():
            raise SamplingParamsError("the grammar must be a non-empty string", param)
        return cls("grammar", text, param)

    @property
    def key(self) -> tuple[str, str]:
        """What identifies the compiled grammar: kind and text."""
        return (self.kind, self.spec)

    def validate(self) -> None:
        """Raise `SamplingParamsError` for a malformed constraint (the grammar engine checks
        what the text means when it compiles it)."""
        if self.kind not in STRUCTURED_KINDS:
            raise SamplingParamsError(
                f"unknown structured output kind {self.kind!r}; expected one of "
                + ", ".join(sorted(STRUCTURED_KINDS)),
                self.param,
            )
        if not isinstance(self.spec, str) or len(self.spec) > MAX_STRUCTURED_SPEC_CHARS:
            raise SamplingParamsError(
                f"the {self.kind} specification must be text of at most "
                f"{MAX_STRUCTURED_SPEC_CHARS} characters",
                self.param,
            )


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How one request wants its tokens chosen (OpenAI/vLLM names and defaults).

    Construction normalises containers so the object stays hashable: `stop` may be given as one
    string or any iterable of strings, `stop_token_ids` as any iterable of ints, and `logit_bias` as a
    mapping (JSON keys such as ``"50256"`` become ints) or as (token_id, bias) pairs; they are
    stored as tuples, `logit_bias` sorted by token id. A container of the wrong shape raises
    `SamplingParamsError` at once; values are range-checked by `validate`.
    """

    # vLLM's (and OpenAI completions') default; None = the rest of the context (the engine
    # resolves it; the chat endpoint passes None when a request names no limit).
    max_tokens: int | None = 16
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 = off
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: LogitBias = ()
    logprobs: int | None = None  # None = off; else the number of top alternatives (0..20)
    n: int = 1
    # None = off; else each prompt token's log-probability and this many top alternatives
    # (0..20), from the model's raw distribution (vLLM's `prompt_logprobs`).
    prompt_logprobs: int | None = None
    structured: StructuredOutput | None = None  # None = free text
    # False: this request's answers never speculate, whatever the server's speculative config
    # (the answer is the same either way; only the time it takes changes).
    speculative: bool = True

    def __post_init__(self) -> None:
        stop = self.stop
        if isinstance(stop, str):
            stop = (stop,)
        object.__setattr__(self, "stop", _as_tuple(stop, "stop"))
        object.__setattr__(self, "stop_token_ids", _as_tuple(self.stop_token_ids, "stop_token_ids"))
        object.__setattr__(self, "logit_bias", _normalise_logit_bias(self.logit_bias))

    @property
    def greedy(self) -> bool:
        """Whether the token is the argmax: temperature 0 or top_k 1."""
        return self.temperature == 0 or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        """Whether any repetition, presence or frequency penalty is active."""
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise `SamplingParamsError` naming the first field that is out of range.

        With `vocab_size`, token ids in `logit_bias` and `stop_token_ids` must lie in
        ``[0, vocab_size)``.
        """
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise SamplingParamsError("max_tokens must be a positive integer", "max_tokens")
        _check_range(self.temperature, "temperature", 0.0, 2.0)
        _check_range(self.top_p, "top_p", 0.0, 1.0, low_inclusive=False)
        if not _is_int(self.top_k) or self.top_k < -1:
            raise SamplingParamsError("top_k must be an integer >= 0 (0 or -1 = off)", "top_k")
        _check_range(self.min_p, "min_p", 0.0, 1.0)
        if self.seed is not None and (
            not _is_int(self.seed) or not _SEED_MIN <= self.seed <= _SEED_MAX
        ):
            raise SamplingParamsError("seed must be a 64-bit integer", "seed")
        self._validate_stop(vocab_size)
        if not isinstance(self.ignore_eos, bool):
            raise SamplingParamsError("ignore_eos must be a boolean", "ignore_eos")
        if not isinstance(self.speculative, bool):
            raise SamplingParamsError("speculative must be a boolean", "speculative")
        _check_range(self.presence_penalty, "presence_penalty", -2.0, 2.0)
        _check_range(self.frequency_penalty, "frequency_penalty", -2.0, 2.0)
        _check_range(self.repetition_penalty, "repetition_penalty", 0.0, 2.0, low_inclusive=False)
        self._validate_logit_bias(vocab_size)
        if self.logprobs is not None and (
            not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS
        ):
            raise SamplingParamsError(
                f"top_logprobs must be an integer between 0 and {MAX_LOGPROBS}", "top_logprobs"
            )
        if not _is_int(self.n) or not 1 <= self.n <= MAX_N:
            raise SamplingParamsError(f"n must be an integer between 1 and {MAX_N}", "n")
        if self.prompt_logprobs is not None and (
            not _is_int(self.prompt_logprobs) or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS
        ):
            raise SamplingParamsError(
                f"prompt_logprobs must be an integer between 0 and {MAX_LOGPROBS}",
                "prompt_logprobs",
            )
        if self.structured is not None:
            if not isinstance(self.structured, StructuredOutput):
                raise SamplingParamsError(
                    "structured must be a StructuredOutput", "structured_outputs"
                )
            self.structured.validate()

    def _validate_stop(self, vocab_size: int | None) -> None:
        if len(self.stop) > MAX_STOP_STRINGS:
            raise SamplingParamsError(
                f"stop accepts at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}", "stop"
            )
        for text in self.stop:
            if not isinstance(text, str):
                raise SamplingParamsError("stop must be a string or a list of strings", "stop")
            if not text:
                raise SamplingParamsError("stop strings must not be empty", "stop")
        for token_id in self.stop_token_ids:
            if not _is_token_id(token_id, vocab_size):
                raise SamplingParamsError(
                    f"stop_token_ids holds {token_id!r}, not a token id of this model",
                    "stop_token_ids",
                )

    def _validate_logit_bias(self, vocab_size: int | None) -> None:
        if len(self.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
            raise SamplingParamsError(
                f"logit_bias accepts at most {MAX_LOGIT_BIAS_ENTRIES} entries", "logit_bias"
            )
        seen: set[int] = set()
        for token_id, bias in self.logit_bias:
            if not _is_token_id(token_id, vocab_size):
                raise SamplingParamsError(
                    f"logit_bias key {token_id!r} is not a token id of this model", "logit_bias"
                )
            if token_id in seen:
                raise SamplingParamsError(f"logit_bias names token {token_id} twice", "logit_bias")
            seen.add(token_id)
            if not _is_real(bias) or not -100.0 <= bias <= 100.0:
                raise SamplingParamsError(
                    f"logit_bias value for token {token_id} must be between -100 and 100",
                    "logit_bias",
                )


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _is_token_id(value: object, vocab_size: int | None) -> bool:
    if not _is_int(value) or value < 0:
        return False
    return vocab_size is None or value < vocab_size


def _check_range(
    value: object, param: str, low: float, high: float, *, low_inclusive: bool = True
) -> None:
    if _is_real(value) and (low <= value if low_inclusive else low < value) and value <= high:
        return
    bracket = "[" if low_inclusive else "("
    raise SamplingParamsError(f"{param} must be a number in {bracket}{low:g}, {high:g}]", param)


def _as_tuple(values: object, param: str) -> tuple:
    if values is None:
        return ()
    if isinstance(values, Mapping) or not isinstance(values, Iterable):
        raise SamplingParamsError(f"{param} must be a list", param)
    return tuple(values)


def _normalise_logit_bias(
    logit_bias: LogitBias | Iterable[tuple[object, object]] | None,
) -> tuple[tuple[int, float], ...]:
    if not logit_bias:
        return ()
    items = (
        logit_bias.items()
        if isinstance(logit_bias, Mapping)
        else _as_tuple(logit_bias, "logit_bias")
    )
    pairs = []
    for item in items:
        if not isinstance(item, tuple | list) or len(item) != 2:
            raise SamplingParamsError("logit_bias must map token ids to numbers", "logit_bias")
        key, value = item
        # JSON object keys are strings; OpenAI clients send token ids that way.
        if isinstance(key, str) and key.strip().lstrip("-").isdigit():
            key = int(key)
        pairs.append((key, value))
    if all(_is_int(key) for key, _ in pairs):
        pairs.sort(key=lambda pair: pair[0])
    return tuple(pairs)
