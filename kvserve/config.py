"""Configuration: frozen dataclasses grouped by concern, built once from CLI flags / env vars.

Values found at run time (the number of KV blocks, the model's context length) are passed
explicitly to whoever needs them; they are never written back into these objects.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

ENV_PREFIX = "KVSERVE_"


def env_name(flag: str) -> str:
    """`--max-num-seqs` -> `KVSERVE_MAX_NUM_SEQS`."""
    return ENV_PREFIX + flag.lstrip("-").replace("-", "_").upper()


def env_default(flag: str, default, cast=str):
    """The default of a flag: its environment variable when set, else `default`."""
    raw = os.environ.get(env_name(flag))
    if raw is None or raw == "":
        return default
    if cast is bool:
        return raw.strip().lower() in ("1", "true", "yes", "on")
    return cast(raw)


QUANTIZATIONS = ("auto", "none", "int8", "gguf", "q4")
# What a GGUF model's layer weights may be requantized to at load (DeviceConfig.requantize).
REQUANTIZE_TYPES = ("Q4_0",)
KV_CACHE_DTYPES = ("auto", "model", "int8")


def _check_requantize(name: str, value: str | None) -> None:
    if value not in (None, *REQUANTIZE_TYPES):
        raise ValueError(f"{name} must be {' or '.join(REQUANTIZE_TYPES)} or null, got {value!r}")


# Positions per KV block the command line accepts (vLLM's set above 1); each is tested.
BLOCK_SIZES = (8, 16, 32, 64, 128)


@dataclass(frozen=True, slots=True)
class DeviceConfig:
    """Where and in what precision the model runs."""

    device: str = "auto"  # "auto" | "cpu" | "cuda" | "cuda:N"
    dtype: str = "auto"  # "auto" | "bfloat16" | "float16" | "float32"
    num_threads: int | None = None  # torch intra-op threads on CPU; None = number of cores
    # "auto" (a K-quant GGUF keeps its blocks; int8 for another quantized checkpoint where the
    # CPU kernels run; else none) | "none" (the model's dtype) | "int8" (int8 linear layers,
    # kvserve/model/linear/int8.py) | "gguf" (the file's blocks, kvserve/model/linear/blocks.py)
    # | "q4" (Q4_0/Q4_1 blocks on AVX512-VNNI, kvserve/model/linear/q4.py)
    quantization: str = "auto"
    # Prepared int8 weights cached on disk and memory-mapped at the next start
    # (kvserve/model/weight_cache.py); the directory defaults to $KVSERVE_WEIGHT_CACHE_DIR, else
    # <user cache dir>/prepared.
    weight_cache: bool = True
    weight_cache_dir: str | None = None
    # A GGUF model kept in its blocks: its layer weights whose blocks take more bytes a value
    # are requantized to this type at load ("Q4_0"; None: as the file has them). The engine
    # sets it for a draft model (SpeculativeConfig.draft_requantize).
    requantize: str | None = None

    def __post_init__(self) -> None:
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(
                f"unknown quantization {self.quantization!r} (use {' or '.join(QUANTIZATIONS)})"
            )
        _check_requantize("requantize", self.requantize)


@dataclass(frozen=True, slots=True)
class CacheConfig:
    """The paged KV cache: block size and how the pool is sized."""

    block_size: int = 32
    num_kv_blocks: int | None = None  # explicit pool size; wins over kv_cache_memory
    # The pool's memory for K and V of all layers: bytes (an int), or a fraction of the memory
    # available at start (a float in (0, 1]); None = the default fraction for the device
    # (kvserve.model.kv_cache.choose_pool_size)
    kv_cache_memory: int | float | None = None
    # "auto" (see kvserve.model.kv_cache.choose_cache_dtype) | "model" (the model's dtype) |
    # "int8" (kvserve/model/csrc/kv_int8.c)
    kv_cache_dtype: str = "auto"
    enable_prefix_caching: bool = True  # reuse the KV of published prompt blocks

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"unknown kv_cache_dtype {self.kv_cache_dtype!r} (use {' or '.join(KV_CACHE_DTYPES)})"
            )
        if self.block_size <= 0:
            raise ValueError("block_size must be positive")
        if self.num_kv_blocks is not None and self.num_kv_blocks <= 0:
            raise ValueError("num_kv_blocks must be positive")
        memory = self.kv_cache_memory
        if isinstance(memory, float) and not 0.0 < memory <= 1.0:
            raise ValueError(f"kv_cache_memory as a fraction must be in (0, 1], got {memory}")
        if memory is not None and memory <= 0:
            raise ValueError("kv_cache_memory must be positive")


ADMISSIONS = ("partial", "reserve")
Admission = Literal["partial", "reserve"]
# Answer positions "partial" admission reserves beyond the prompt; see docs/serving.md for the
# measurement behind it.
DEFAULT_RESERVE_TOKENS = 256


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Whom to admit and what each step computes.

    `admission` says what a request's blocks are taken for when it is admitted: "partial" (the
    prompt and the first `reserve_tokens` positions of the answer; the rest grows from the free
    pool, preempting the latest arrivals by recompute when it runs dry) or "reserve" (the prompt
    and the whole answer budget: nothing ever grows or is preempted). The answer budget of a
    request that names no max_tokens is the rest of the context. For a model whose every layer
    attends to a sliding window, either reservation is capped at the blocks the window needs at
    once, and blocks behind the window go back as a sequence runs (kvserve/core/scheduler.py).
    """

    max_num_seqs: int = 8  # slots
    max_model_len: int | None = None  # None = the model's context length
    max_num_batched_tokens: int = 2048  # rows per step
    prefill_chunk: int = 512  # prompt tokens per sequence per step
    admission: Admission = "partial"
    reserve_tokens: int = DEFAULT_RESERVE_TOKENS  # answer positions reserved under "partial"

    def __post_init__(self) -> None:
        if self.max_num_seqs <= 0:
            raise ValueError("max_num_seqs must be positive")
        if self.prefill_chunk <= 0:
            raise ValueError("prefill_chunk must be positive")
        if self.max_num_batched_tokens <= 0:
            raise ValueError("max_num_batched_tokens must be positive")
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ValueError("max_model_len must be positive")
        if self.admission not in ADMISSIONS:
            raise ValueError(
                f"unknown admission policy {self.admission!r} (use {' or '.join(ADMISSIONS)})"
            )
        if self.reserve_tokens <= 0:
            raise ValueError("reserve_tokens must be positive")


@dataclass(frozen=True, slots=True)
class QueueConfig:
    """The bounded admission queue in front of the scheduler."""

    max_queue_per_slot: int = 8  # waiters per slot
    queue_timeout: float = 30.0  # seconds a waiter may wait before 429
    max_overtakes: int | None = None  # times the head may be overtaken; None = slots, 0 = FIFO

    def __post_init__(self) -> None:
        if self.max_queue_per_slot < 0:
            raise ValueError("max_queue_per_slot must be >= 0")
        if self.queue_timeout <= 0:
            raise ValueError("queue_timeout must be positive")
        if self.max_overtakes is not None and self.max_overtakes < 0:
            raise ValueError("max_overtakes must be >= 0")


@dataclass(frozen=True, slots=True)
class StreamConfig:
    """Per-request delivery."""

    buffer_steps: int = 256  # undelivered steps before a client counts as a slow consumer

    def __post_init__(self) -> None:
        if self.buffer_steps <= 0:
            raise ValueError("buffer_steps must be positive")


@dataclass(frozen=True, slots=True)
class EmbeddingConfig:
    """How a decoder's hidden states become an embedding (an encoder says so itself)."""

    pooling: str = "last"  # "last" (the last token's state) | "mean" (the average)

    def __post_init__(self) -> None:
        if self.pooling not in ("last", "mean"):
            raise ValueError(f"unknown pooling {self.pooling!r} (use last or mean)")


SPECULATIVE_METHODS = ("ngram", "draft_model")
# Decoding sequences in a step above which nobody speculates: verification rows then cost more
# than they save (each guess is a row of compute; a large batch already shares the weights'
# read). vLLM's old `speculative_disable_by_batch_size`. Measured (docs/serving.md): on copied
# answers speculation paid up to 16 streams and lost at 32; a chat gains about nothing even
# alone, so the rule sits lower, at 8.
DEFAULT_SPEC_DISABLE_BATCH_SIZE = 8


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """Speculative decoding, as vLLM's `--speculative-config` spells it.

    `method` "ngram" guesses the next `num_speculative_tokens` tokens by prompt lookup: the
    longest suffix of the sequence's tokens of `prompt_lookup_min` .. `prompt_lookup_max` tokens
    found earlier in them, and what followed it. "draft_model" guesses with a smaller `model`
    of the same vocabulary. Guesses are verified inside the step (kvserve/core/spec.py).
    `disable_by_batch_size`: with more decoding sequences than this in a step, none speculates.
    `disable_when_slower` (default on): below that, a step speculates only while it measures
    faster than plain decoding at its batch size (kvserve/core/spec.py, `Payoff`).
    `draft_requantize` (default "Q4_0"; null: as the file has them): a draft kept in its GGUF
    blocks has the layer weights whose blocks take more bytes a value requantized to it at
    load (DeviceConfig.requantize). A draft's rounding only decides which guesses are
    accepted; Qwen2.5-Coder-0.5B's Q4_K_M file (mostly Q5_0 and Q6_K layers) reads 19% fewer
    bytes a step this way.
    """

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    model: str | None = None
    disable_by_batch_size: int = DEFAULT_SPEC_DISABLE_BATCH_SIZE
    disable_when_slower: bool = True
    draft_requantize: str | None = "Q4_0"

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(
                f"speculative method {self.method!r} is not supported (use "
                f"{' or '.join(SPECULATIVE_METHODS)})"
            )
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= 16:
            raise ValueError(f"num_speculative_tokens must be an integer in [1, 16], got {k!r}")
        for name in ("prompt_lookup_min", "prompt_lookup_max", "disable_by_batch_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not isinstance(self.disable_when_slower, bool):
            raise ValueError(
                f"disable_when_slower must be true or false, got {self.disable_when_slower!r}"
            )
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"prompt_lookup_min ({self.prompt_lookup_min}) is larger than "
                f"prompt_lookup_max ({self.prompt_lookup_max})"
            )
        _check_requantize("draft_requantize", self.draft_requantize)
        if self.method == "draft_model" and not self.model:
            raise ValueError('the "draft_model" method needs a "model"')
        if self.method == "ngram" and self.model:
            raise ValueError('the "ngram" method takes no "model"')

    def describe(self) -> str:
        """One line for the banner."""
        off = f"off above {self.disable_by_batch_size} decoding sequences"
        if self.disable_when_slower:
            off += " and where measured slower than plain decoding"
        if self.method == "ngram":
            return (
                f"speculative decoding: ngram prompt lookup, {self.num_speculative_tokens} "
                f"tokens, n-grams of {self.prompt_lookup_min}-{self.prompt_lookup_max}; {off}"
            )
        layers = "" if self.draft_requantize is None else f" (layers as {self.draft_requantize})"
        return (
            f"speculative decoding: draft model {self.model}{layers}, "
            f"{self.num_speculative_tokens} tokens; {off}"
        )


_SPEC_KEYS = {
    "method",
    "num_speculative_tokens",
    "prompt_lookup_min",
    "prompt_lookup_max",
    "model",
    "disable_by_batch_size",
    "disable_when_slower",
    "draft_requantize",
}


def parse_speculative_config(
    value: str | Mapping[str, object] | SpeculativeConfig | None,
) -> SpeculativeConfig | None:
    """A `SpeculativeConfig` from vLLM's JSON (text or a mapping); None stays None.

    vLLM's spellings are read: a config naming a `model` and no method is "draft_model";
    "[ngram]" and "draft" name the same methods; `prompt_lookup_min` alone sets the maximum
    too when it is larger than the default. Unknown keys and bad values raise ValueError with
    the reason, so a server refuses to start on them.
    """
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--speculative-config is not valid JSON: {exc}") from None
    if not isinstance(value, Mapping):
        raise ValueError("--speculative-config must be a JSON object")
    unknown = sorted(set(value) - _SPEC_KEYS)
    if unknown:
        raise ValueError(
            f"--speculative-config has unknown key(s) {', '.join(map(repr, unknown))}; the keys "
            f"are {', '.join(sorted(_SPEC_KEYS))}"
        )
    fields = dict(value)
    if "num_speculative_tokens" not in fields:
        raise ValueError("--speculative-config needs num_speculative_tokens")
    method = fields.get("method")
    if method is None:
        method = "draft_model" if fields.get("model") else None
    method = {"[ngram]": "ngram", "draft": "draft_model"}.get(method, method)
    if method is None:
        raise ValueError('--speculative-config needs a "method" ("ngram") or a draft "model"')
    fields["method"] = method
    if "prompt_lookup_min" in fields and "prompt_lookup_max" not in fields:
        fields["prompt_lookup_max"] = max(fields["prompt_lookup_min"], 4)
    if "prompt_lookup_max" in fields and "prompt_lookup_min" not in fields:
        fields["prompt_lookup_min"] = min(fields["prompt_lookup_max"], 2)
    try:
        return SpeculativeConfig(**fields)
    except TypeError as exc:
        raise ValueError(f"--speculative-config: {exc}") from None


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Everything the engine needs, grouped."""

    model: str | None = None  # path to a .gguf file or a Hugging Face directory; None = default
    device: DeviceConfig = DeviceConfig()
    cache: CacheConfig = CacheConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    queue: QueueConfig = QueueConfig()
    stream: StreamConfig = StreamConfig()
    embedding: EmbeddingConfig = EmbeddingConfig()
    speculative: SpeculativeConfig | None = None  # None = no speculative decoding
    seed: int = 0
    # The Jinja chat template to use in place of the model's own (its text); None keeps it.
    chat_template: str | None = None


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """HTTP concerns only."""

    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None
    api_key: str | None = None
    max_body_bytes: int = 8 * 1024 * 1024
    log_level: str = "info"
    tool_call_parser: str | None = None  # None = chosen by chat-template family
    # Seconds a SIGTERM/SIGINT lets running requests finish before the engine is stopped.
    shutdown_timeout: float = 30.0
    # Origins browsers may call the API from (CORS); empty = no CORS headers at all.
    allowed_origins: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.shutdown_timeout >= 0:  # NaN too
            raise ValueError(
                f"--shutdown-timeout must be 0 or more seconds, got {self.shutdown_timeout}"
            )
        for origin in self.allowed_origins:
            if origin != "*" and not _ORIGIN.fullmatch(origin):
                raise ValueError(
                    f"--allowed-origins: {origin!r} is not an origin (scheme://host[:port], "
                    "no path or trailing slash), nor '*'"
                )
        if "*" in self.allowed_origins and self.api_key:
            raise ValueError(
                "--allowed-origins '*' cannot be combined with --api-key: name the origins "
                "whose pages may send the key"
            )


# What a browser sends in `Origin`: a scheme and a host, maybe a port, nothing after it.
_ORIGIN = re.compile(r"[a-z][a-z0-9+.-]*://[^\s/?#]+")


def parse_origins(value: str | None) -> tuple[str, ...]:
    """`--allowed-origins A,B` as a tuple (spaces and empty items dropped)."""
    if not value:
        return ()
    return tuple(item.strip() for item in value.split(",") if item.strip())
