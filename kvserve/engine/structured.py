"""Structured output: grammars compiled off the engine thread, one matcher per request, and
the step's bitmasks filled in one batched call.

The grammar engine is llguidance (docs/structured-output.md has the measurements behind the
choice). Its pieces map onto the engine like this:

- `StructuredOutputManager.compile` turns a request's `StructuredOutput` into a compiled
  grammar on a worker thread (never the engine loop's), and caches it by kind and text, so a
  schema sent twice is compiled once. A grammar the library refuses fails the future with
  `GrammarError`, carrying the library's reason and the request field it came from.
- `StructuredOutputManager.matcher` gives each request its own `GrammarState` (a copy of the
  compiled matcher: cheap, no recompilation). The engine keeps it on the request's state,
  advances it with every sampled token, and drops it in its one release path.
- `fill_bitmasks` fills the bitmasks of a step's constrained rows in one call that runs in
  llguidance's own threads; the sampler applies them with a C kernel before drawing. A greedy
  row first checks its unconstrained choice (`GrammarState.allows`): when the grammar allows
  it, it is also the best allowed token, and that row needs no mask at all (most steps of a
  model that follows the format). `start_bitmasks` starts the call for the rows that cannot
  take that shortcut on a thread of its own, so the Batch has it run beside the forward pass
  (the matchers are only advanced after the step, on the loop thread).

llguidance allows an end-of-sequence token only where the grammar accepts, so a constrained
answer can only end complete (or be cut by max_tokens).
"""

from __future__ import annotations

import functools
import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import llguidance
import torch

from kvserve.params import StructuredOutput
from kvserve.tokenizer import Tokenizer

log = logging.getLogger("kvserve.engine")

MAX_CACHED_GRAMMARS = 256
"""Compiled grammars kept, least recently used dropped first."""

# JSON is generated compact (no whitespace between tokens), which bounds the whitespace a
# model can emit: in JSON mode a small model would otherwise loop on newlines.
_JSON_OPTIONS = {"whitespace_flexible": False}


class GrammarError(ValueError):
    """The grammar engine refused a constraint; `param` names the request field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class GrammarState:
    """One request's position in its grammar. Advanced on the engine loop between steps and
    read by the sampler during a step, never both at once."""

    __slots__ = ("matcher",)

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self.matcher = matcher

    def accept(self, token_id: int) -> bool:
        """Advance past a sampled token; False when the grammar does not allow it."""
        return self.matcher.consume_token(token_id)

    def allows(self, token_id: int) -> bool:
        """Whether the grammar allows `token_id` next (end-of-sequence included), without
        advancing: one token's check, far cheaper than the whole vocabulary's mask."""
        return self.matcher.validate_tokens([token_id]) == 1

    def valid_prefix(self, token_ids: Sequence[int]) -> int:
        """How many of `token_ids`, in order from here, the grammar allows (none consumed)."""
        if not token_ids:
            return 0
        return self.matcher.validate_tokens(list(token_ids))

    def draft_bitmasks(self, token_ids: Sequence[int], vocab_size: int) -> torch.Tensor:
        """The masks of a speculative chunk's rows, `[len(token_ids) + 1, ceil(vocab / 32)]`
        int32: row j's after the first j guesses. The matcher is advanced through the guesses
        and rolled back after, so it is left where it was."""
        bitmask = _allocate_bitmask(len(token_ids) + 1, vocab_size)
        consumed = 0
        try:
            for index in range(len(token_ids) + 1):
                row = bitmask[index]
                self.matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * 4)
                if index == len(token_ids) or not self.matcher.consume_token(token_ids[index]):
                    break
                consumed += 1
        finally:
            if consumed:
                self.matcher.rollback(consumed)
        return bitmask

    @property
    def is_stopped(self) -> bool:
        """Nothing but the end of the answer can follow."""
        return self.matcher.is_stopped()

    @property
    def error(self) -> str | None:
        return self.matcher.get_error() if self.matcher.is_error() else None


class GrammarAfter:
    """A grammar as it would stand after some guessed tokens, for a row verifying the next
    guess: it answers `allows` (the greedy rows' check before any mask) without advancing the
    matcher; the row's mask is filled apart (`GrammarState.draft_bitmasks`)."""

    __slots__ = ("base", "prefix")

    def __init__(self, base: GrammarState, prefix: Sequence[int]) -> None:
        self.base = base
        self.prefix = list(prefix)

    def allows(self, token_id: int) -> bool:
        tokens = [*self.prefix, token_id]
        return self.base.valid_prefix(tokens) == len(tokens)


def grammar_text(constraint: StructuredOutput) -> str:
    """The llguidance grammar for a constraint (not yet checked: compiling checks it)."""
    kind, spec = constraint.kind, constraint.spec
    if kind == "json":
        try:
            schema = json.loads(spec)
        except json.JSONDecodeError as exc:
            raise GrammarError(f"the JSON schema is not JSON: {exc}", constraint.param) from None
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_OPTIONS)
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema(
            {"type": "object"}, defaults=_JSON_OPTIONS
        )
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec)
    if kind == "choice":
        choices = json.loads(spec)
        # Lark string literals take JSON's escapes.
        rule = " | ".join(json.dumps(choice, ensure_ascii=False) for choice in choices)
        return llguidance.LLMatcher.grammar_from_lark(f"start: {rule}\n")
    if kind == "grammar":
        lark = spec
        if "::=" in spec:
            # GBNF (llama.cpp's and vLLM's EBNF dialect); llguidance translates it.
            try:
                lark = llguidance.gbnf_to_lark(spec)
            except Exception as exc:
                raise GrammarError(
                    f"the grammar is not valid GBNF: {exc}", constraint.param
                ) from None
        return llguidance.LLMatcher.grammar_from_lark(lark)
    raise GrammarError(f"unknown structured output kind {kind!r}", constraint.param)


class StructuredOutputManager:
    """Compiles and caches grammars for one tokenizer; hands out per-request matchers.

    `vocab_size` is the model's (its logits' width), which may exceed the tokenizer's.
    `compile` and `matcher` are called on the engine loop; compiling runs on one worker thread.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        vocab_size: int,
        *,
        max_cached: int = MAX_CACHED_GRAMMARS,
    ) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._max_cached = max_cached
        self._cache: OrderedDict[tuple[str, str], Future[llguidance.LLMatcher]] = OrderedDict()
        self._lock = threading.Lock()
        self._worker: ThreadPoolExecutor | None = None

    def _started_worker(self) -> ThreadPoolExecutor:
        """The worker thread, started if needed; the caller holds the lock."""
        if self._worker is None:
            self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvserve-grammar")
        return self._worker

    def _llg_tokenizer(self) -> llguidance.LLTokenizer:
        """llguidance's view of the vocabulary, built by the first compilation. It is not built
        ahead: on a 150k vocabulary it takes about 0.9 s without releasing the GIL, which would
        hold up the server's start (and every stream) for a part only constrained requests
        use; the first such request pays it instead, as in vLLM."""
        return _llg_tokenizer(self._tokenizer, self.vocab_size)

    def compile(self, constraint: StructuredOutput) -> Future[llguidance.LLMatcher]:
        """The compiled grammar of `constraint`: a done future when cached, else one that the
        worker completes. A refused grammar fails it with `GrammarError`."""
        key = constraint.key
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                return future
            future = self._started_worker().submit(self._compile, constraint)
            self._cache[key] = future
            while len(self._cache) > self._max_cached:
                self._cache.popitem(last=False)
        return future

    def _compile(self, constraint: StructuredOutput) -> llguidance.LLMatcher:
        grammar = grammar_text(constraint)
        matcher = llguidance.LLMatcher(self._llg_tokenizer(), grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(
                f"the {_describe(constraint.kind)} cannot be enforced: {matcher.get_error()}",
                constraint.param,
            )
        return matcher

    @staticmethod
    def matcher(compiled: llguidance.LLMatcher) -> GrammarState:
        """A fresh request's state in a compiled grammar."""
        return GrammarState(compiled.deep_copy())

    def close(self) -> None:
        """Stop the worker thread once the compilation in progress (if any) finishes; a later
        `compile` starts a new one. Compilations not started are cancelled (and dropped from
        the cache)."""
        with self._lock:
            worker, self._worker = self._worker, None
            for key in [key for key, future in self._cache.items() if not future.done()]:
                del self._cache[key]
        if worker is not None:
            worker.shutdown(wait=True, cancel_futures=True)


@functools.lru_cache(maxsize=4)
def _llg_tokenizer(tokenizer: Tokenizer, vocab_size: int) -> llguidance.LLTokenizer:
    """llguidance's view of a vocabulary; built once per tokenizer (engines share models)."""
    eos = sorted(tokenizer.eos_token_ids)
    return llguidance.LLTokenizer(
        tokenizer.backend_json(), n_vocab=vocab_size, eos_token=eos if eos else None
    )


def _describe(kind: str) -> str:
    return {
        "json": "JSON schema",
        "json_object": "JSON object format",
        "regex": "regex",
        "choice": "choice list",
        "grammar": "grammar",
    }.get(kind, kind)


_executor: llguidance.LLExecutor | None = None
_executor_lock = threading.Lock()


def _mask_executor() -> llguidance.LLExecutor:
    global _executor
    if _executor is None:
        with _executor_lock:
            if _executor is None:
                _executor = llguidance.LLExecutor(num_threads=max(1, torch.get_num_threads()))
    return _executor


def fill_bitmasks(grammars: Sequence[GrammarState], vocab_size: int) -> torch.Tensor:
    """The next-token bitmasks of these grammars, `[len(grammars), ceil(vocab / 32)]` int32,
    filled in one call across llguidance's threads (the GIL is released meanwhile)."""
    bitmask = _allocate_bitmask(len(grammars), vocab_size)
    _mask_executor().unsafe_compute_mask_ptr(
        [(grammar.matcher, i) for i, grammar in enumerate(grammars)],
        bitmask.data_ptr(),
        bitmask.shape[1] * 4,
        len(grammars),
    )
    return bitmask


def _allocate_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """`[rows, ceil(vocab / 32)]` int32, every token allowed, in the layout llguidance fills
    (its `llguidance.torch` helpers do the same, but that module decorates a function with
    torch.compile, and importing it imports torch's compiler: two seconds of every start)."""
    return torch.full((rows, (vocab_size + 31) // 32), -1, dtype=torch.int32)


_filler: ThreadPoolExecutor | None = None


def _filler_executor() -> ThreadPoolExecutor:
    global _filler
    if _filler is None:
        with _executor_lock:
            if _filler is None:
                _filler = ThreadPoolExecutor(1, thread_name_prefix="kvserve-masks")
    return _filler


def start_bitmasks(grammars: Sequence[GrammarState], vocab_size: int) -> Future[torch.Tensor]:
    """`fill_bitmasks` started on the mask thread; its result is the bitmask tensor."""
    return _filler_executor().submit(fill_bitmasks, list(grammars), vocab_size)
