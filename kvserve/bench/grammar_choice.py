"""Measure the two grammar engines on the default model's vocabulary: the figures behind the
choice of llguidance (docs/structured-output.md).

    python -m kvserve.bench.grammar_choice [--rows 32]

For each library that is installed (llguidance is a dependency; xgrammar can be added with
``pip install --no-deps xgrammar apache-tvm-ffi`` to compare), it reports:

- tokenizer setup: building the library's view of the 49,152-token vocabulary (once per server);
- compile: one JSON schema into a grammar (once per distinct schema; cached by text);
- first mask: a fresh request's first bitmask (compile + matcher + mask: the first-request cost);
- mask per row: filling the bitmasks of `rows` matchers in one batched call, mid-answer,
  averaged over the answer's tokens, divided by the number of rows.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch

from kvserve.model.paths import default_model_path
from kvserve.tokenizer import Tokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 4},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city", "zip"],
        },
        "kind": {"enum": ["a", "b", "c"]},
    },
    "required": ["name", "age", "tags", "address", "kind"],
}
ANSWER = json.dumps(
    {
        "name": "Ada Lovelace",
        "age": 36,
        "tags": ["math", "poetry"],
        "address": {"city": "London", "zip": "12345"},
        "kind": "b",
    },
    separators=(",", ":"),
)


def _timed(fn: Callable[[], object]) -> tuple[float, object]:
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def measure_llguidance(tokenizer: Tokenizer, vocab_size: int, rows: int) -> dict[str, float]:
    import llguidance
    import llguidance.torch as llgt

    setup, lltok = _timed(
        lambda: llguidance.LLTokenizer(
            tokenizer.backend_json(), n_vocab=vocab_size, eos_token=tokenizer.eos_token_id
        )
    )
    grammar = llguidance.LLMatcher.grammar_from_json_schema(
        SCHEMA, defaults={"whitespace_flexible": False}
    )
    compile_s, template = _timed(lambda: llguidance.LLMatcher(lltok, grammar))
    bitmask = llgt.allocate_token_bitmask(rows, vocab_size)
    first, _ = _timed(
        lambda: llgt.fill_next_token_bitmask(llguidance.LLMatcher(lltok, grammar), bitmask, 0)
    )
    answer_ids = tokenizer.encode(ANSWER)
    matchers = [template.deep_copy() for _ in range(rows)]
    executor = llguidance.LLExecutor()
    per_step = []
    for token in answer_ids:
        seconds, _ = _timed(
            lambda: llgt.fill_next_token_bitmask_par(
                executor, [(m, i) for i, m in enumerate(matchers)], bitmask
            )
        )
        per_step.append(seconds)
        for m in matchers:
            assert m.consume_token(token), m.get_error()
    return {
        "tokenizer_setup_ms": setup * 1e3,
        "compile_ms": compile_s * 1e3,
        "first_request_ms": (compile_s + first) * 1e3,
        "mask_per_row_us": statistics.mean(per_step) / rows * 1e6,
        "mask_step_ms": statistics.mean(per_step) * 1e3,
    }


def measure_xgrammar(tokenizer: Tokenizer, vocab_size: int, rows: int) -> dict[str, float]:
    import xgrammar

    def info() -> object:
        vocab = [tokenizer.token_bytes(i) for i in range(tokenizer.vocab_size)]
        return xgrammar.TokenizerInfo(
            vocab,
            vocab_type=xgrammar.VocabType.RAW,
            vocab_size=vocab_size,
            stop_token_ids=[tokenizer.eos_token_id],
        )

    setup, tok_info = _timed(info)
    compiler = xgrammar.GrammarCompiler(tok_info, cache_enabled=False)
    schema = json.dumps(SCHEMA)
    compile_s, compiled = _timed(
        lambda: compiler.compile_json_schema(schema, any_whitespace=False, separators=(",", ":"))
    )
    bitmask = xgrammar.allocate_token_bitmask(rows, vocab_size)
    first, _ = _timed(lambda: xgrammar.GrammarMatcher(compiled).fill_next_token_bitmask(bitmask, 0))
    answer_ids = tokenizer.encode(ANSWER)
    matchers = [xgrammar.GrammarMatcher(compiled) for _ in range(rows)]
    batch_class = getattr(xgrammar, "BatchGrammarMatcher", None)
    batch = batch_class() if batch_class is not None else None
    per_step = []
    for token in answer_ids:
        if batch is not None:
            seconds, _ = _timed(lambda: batch.batch_fill_next_token_bitmask(matchers, bitmask))
        else:

            def fill() -> None:
                for i, m in enumerate(matchers):
                    m.fill_next_token_bitmask(bitmask, i)

            seconds, _ = _timed(fill)
        per_step.append(seconds)
        for m in matchers:
            assert m.accept_token(token)
    return {
        "tokenizer_setup_ms": setup * 1e3,
        "compile_ms": compile_s * 1e3,
        "first_request_ms": (compile_s + first) * 1e3,
        "mask_per_row_us": statistics.mean(per_step) / rows * 1e6,
        "mask_step_ms": statistics.mean(per_step) * 1e3,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=32)
    args = parser.parse_args(argv)
    tokenizer = Tokenizer.from_gguf(default_model_path())
    vocab_size = tokenizer.vocab_size
    print(
        f"vocabulary {vocab_size} tokens, {args.rows} rows, torch threads {torch.get_num_threads()}"
    )
    for name, measure in (("llguidance", measure_llguidance), ("xgrammar", measure_xgrammar)):
        try:
            figures = measure(tokenizer, vocab_size, args.rows)
        except ImportError as exc:
            print(f"{name}: not installed ({exc})")
            continue
        print(name, " ".join(f"{k}={v:.3f}" for k, v in figures.items()))


if __name__ == "__main__":
    main()
