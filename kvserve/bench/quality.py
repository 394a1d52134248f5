"""Quality of each configuration: perplexity, and next-token agreement with float32.

The text is CPython's own documentation as shipped in the standard library
(`pydoc_data.topics`, a fixed selection of topics, a few thousand tokens): nothing is
downloaded, and no test uses it. Each configuration runs the real model through the paged
forward the engine runs: the text is one sequence, computed in prefill chunks of at most 512
rows, each chunk reading the earlier positions' K and V back from a KV cache of the
configuration's dtype (int8 included). Every position's logits are kept for scoring.

Rows: perplexity; perplexity against a baseline configuration (bf16) in %; and the share of
positions whose most likely next token (argmax) equals the reference configuration's (float32).
`python -m kvserve.bench.quality` prints the table (`make bench` runs it).
"""

from __future__ import annotations

import argparse
import datetime
import math
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from kvserve.config import DeviceConfig
from kvserve.core.plan import ChunkPlan
from kvserve.model import device_thread, loader
from kvserve.model.kv_cache import KVCache
from kvserve.model.llama import LlamaModel
from kvserve.model.loader import LoadedModel, load_model
from kvserve.model.paths import DEFAULT_MODEL_NAME

# The prefill chunk the engine computes at most per sequence and step (SchedulerConfig).
MAX_CHUNK = 512
BLOCK_SIZE = 32

# Prose sections of the language reference (the execution model; the import system): about
# 4,000 tokens together, and no overlap between them.
TOPICS = ("execmodel", "import")


@dataclass(frozen=True, slots=True)
class QualityConfig:
    """One configuration to measure: how the model is loaded, and the KV cache's dtype
    (None: the model's own dtype, as the engine allocates without `--kv-cache-dtype int8`)."""

    name: str
    device: DeviceConfig
    kv_cache_dtype: torch.dtype | None = None


# Every configuration is spelled out, so a change of defaults does not change what is measured.
FLOAT32 = QualityConfig("float32", DeviceConfig(device="cpu", dtype="float32", quantization="none"))
BF16 = QualityConfig("bf16", DeviceConfig(device="cpu", dtype="bfloat16", quantization="none"))
INT8_LINEAR = QualityConfig(
    "int8 linear", DeviceConfig(device="cpu", dtype="bfloat16", quantization="int8")
)
# What `auto` gives on a CPU without native bf16 (AVX2: a float32 model, int8 products).
INT8_LINEAR_F32 = QualityConfig(
    "int8 linear, float32", DeviceConfig(device="cpu", dtype="float32", quantization="int8")
)
INT8_KV = QualityConfig("int8 KV cache", BF16.device, torch.int8)
INT8_BOTH = QualityConfig("int8 linear + int8 KV cache", INT8_LINEAR.device, torch.int8)
Q4_LINEAR = QualityConfig(
    "4-bit blocks", DeviceConfig(device="cpu", dtype="bfloat16", quantization="q4")
)
Q4_BOTH = QualityConfig("4-bit blocks + int8 KV cache", Q4_LINEAR.device, torch.int8)
CONFIGS = (FLOAT32, BF16, INT8_LINEAR, INT8_LINEAR_F32, INT8_KV, INT8_BOTH, Q4_LINEAR, Q4_BOTH)


def missing_kernels(config: QualityConfig, kernels=None) -> str | None:
    """Why `config` cannot run on this CPU (its C kernels were not built here), or None."""
    return loader.missing_kernels(
        config.device.quantization, config.kv_cache_dtype == torch.int8, kernels
    )


def quality_text(topics: Sequence[str] = TOPICS) -> str:
    """The shipped text: the named topics of the Python documentation, in order."""
    from pydoc_data.topics import topics as docs

    return "\n\n".join(docs[name].strip() for name in topics)


def chunk_logits(
    model: LlamaModel,
    ids: Sequence[int],
    *,
    cache_dtype: torch.dtype | None = None,
    chunk_size: int = MAX_CHUNK,
    block_size: int = BLOCK_SIZE,
) -> Iterator[torch.Tensor]:
    """Float32 logits of every position of `ids` as one sequence, chunk after chunk
    (`[rows of the chunk, vocab]`): each chunk is one forward step of the engine's kind,
    writing its K and V into a paged cache of `cache_dtype` and attending to the earlier ones
    through the block table."""
    device = model.device
    blocks = tuple(range(-(-len(ids) // block_size)))
    cache = KVCache(model.config, len(blocks), block_size, cache_dtype or model.dtype, device)
    tokens = torch.tensor(list(ids), dtype=torch.long)
    for start in range(0, len(ids), chunk_size):
        count = min(chunk_size, len(ids) - start)
        chunk = ChunkPlan("text", 0, start, count, blocks, is_prefill=True, samples=True)
        meta = model.attention.build_metadata([chunk], block_size)
        # every row's logits, not only the chunk's last one (the engine samples that one)
        meta.logits_indices = torch.arange(count, device=device)
        yield model.forward(tokens[start : start + count].to(device), meta, cache).float()


@dataclass(frozen=True, slots=True)
class TokenScores:
    """Per position of a text that has a next token: its negative log-likelihood under the
    model, and the model's most likely next token."""

    nll: torch.Tensor  # [positions] float64
    predicted: torch.Tensor  # [positions] long

    @property
    def perplexity(self) -> float:
        return math.exp(float(self.nll.mean()))

    def agreement(self, other: TokenScores) -> float:
        """Share of positions (0..1) where both predict the same next token."""
        return float((self.predicted == other.predicted).double().mean())


def score_tokens(model: LlamaModel, ids: Sequence[int], **options) -> TokenScores:
    """Score `ids` as one sequence (`options`: those of `chunk_logits`)."""
    targets = torch.tensor(list(ids[1:]), dtype=torch.long)
    nll, predicted = [], []
    row = 0
    for logits in chunk_logits(model, ids, **options):
        logits = logits[: len(targets) - row].cpu()  # the last position has no next token
        want = targets[row : row + logits.shape[0]]
        nll.append(-logits.log_softmax(-1).gather(1, want[:, None])[:, 0].double())
        predicted.append(logits.argmax(-1))
        row += logits.shape[0]
    return TokenScores(torch.cat(nll), torch.cat(predicted))


@dataclass(frozen=True, slots=True)
class QualityRow:
    name: str
    perplexity: float
    vs_baseline_pct: float | None  # perplexity against the baseline's, in % (+: worse)
    agreement_pct: float | None  # next-token argmax equal to the reference's, % of positions
    num_tokens: int  # of the text, scored as one sequence


def measure_quality(
    configs: Sequence[QualityConfig],
    *,
    max_tokens: int | None = None,
    chunk_size: int = MAX_CHUNK,
    reference: str = FLOAT32.name,
    baseline: str = BF16.name,
    loaded: Mapping[str, LoadedModel] | None = None,
) -> list[QualityRow]:
    """Score the text (its first `max_tokens` tokens, if given) in each configuration, one
    model in memory at a time. `loaded` holds models already loaded, by configuration name.
    The agreement column needs the `reference` configuration among `configs`, the relative
    perplexity the `baseline` one; otherwise they are None."""
    loaded = loaded or {}
    text = quality_text()
    scores: dict[str, TokenScores] = {}
    for config in configs:
        model = loaded.get(config.name) or load_model(None, config.device)
        ids = model.tokenizer.encode(text)[:max_tokens]
        scores[config.name] = device_thread.call(
            score_tokens,
            model.model,
            ids,
            cache_dtype=config.kv_cache_dtype,
            chunk_size=chunk_size,
        )
        del model
    rows = []
    for config in configs:
        score = scores[config.name]
        vs = agree = None
        if baseline in scores:
            vs = 100 * (score.perplexity / scores[baseline].perplexity - 1)
        if reference in scores:
            agree = 100 * score.agreement(scores[reference])
        num_tokens = len(score.predicted) + 1
        rows.append(QualityRow(config.name, score.perplexity, vs, agree, num_tokens))
    return rows


def format_quality_table(
    rows: Sequence[QualityRow], baseline: str = BF16.name, reference: str = FLOAT32.name
) -> str:
    lines = [
        f"| configuration | perplexity | vs {baseline} | next token = {reference}'s |",
        "| --- | ---: | ---: | ---: |",
    ]
    for row in rows:
        vs = "—" if row.vs_baseline_pct is None else f"{row.vs_baseline_pct:+.2f}%"
        agree = "—" if row.agreement_pct is None else f"{row.agreement_pct:.1f}%"
        lines.append(f"| {row.name} | {row.perplexity:.3f} | {vs} | {agree} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kvserve.bench.quality", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--max-tokens", type=int, default=None, help="score only the first N")
    parser.add_argument("--chunk-size", type=int, default=MAX_CHUNK, help="rows per forward")
    parser.add_argument("--output", default=None, help="also append the section to this file")
    args = parser.parse_args(argv)

    from kvserve.bench.run import machine_line

    stamp = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    machine = machine_line()
    runnable = [c for c in CONFIGS if missing_kernels(c) is None]
    skipped = [f"{c.name} ({missing_kernels(c)})" for c in CONFIGS if c not in runnable]
    rows = measure_quality(runnable, max_tokens=args.max_tokens, chunk_size=args.chunk_size)
    text = "\n".join(
        [
            f"\n## {stamp} — Quality, {DEFAULT_MODEL_NAME}\n",
            f"Machine: {machine}.\n",
            f"Text: CPython {sys.version.split()[0]} documentation, `pydoc_data.topics` "
            f"{' + '.join(repr(t) for t in TOPICS)}, {rows[0].num_tokens} tokens as one sequence, "
            f"in forward chunks of {args.chunk_size} rows over a paged KV cache. Perplexity "
            f"against {BF16.name} (+: worse); next token: share of positions whose argmax "
            f"equals {FLOAT32.name}'s.\n",
            format_quality_table(rows),
            "",
        ]
        + ([f"Not run on this CPU: {'; '.join(skipped)}.\n"] if skipped else [])
    )
    print(text)
    if args.output:
        with Path(args.output).open("a") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
