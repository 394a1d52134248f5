"""Embeddings for `make bench`: sentences through `POST /v1/embeddings` of `kvserve serve
<all-MiniLM-L6-v2>` from concurrent clients, beside transformers' `BertModel` run directly on
the same sentences in batches of 32 (with the model's mean pooling and normalization), in the
same run. The server adds HTTP, tokenizing and batching across requests; the ratio says what
that costs, or gains (it groups inputs by length, so pads less).

Sentences are random words, 4 to 40 of them. Each client sends its share in requests of
`per_request` sentences, as an indexing pipeline does; time runs from the first request to the
last answer. The reference tokenizes each batch as part of its time too.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from kvserve.bench.loadgen import WORDS

__all__ = [
    "EmbeddingBenchResult",
    "bench_sentences",
    "format_embedding_table",
    "reference_seconds",
    "server_seconds",
]


@dataclass(frozen=True, slots=True)
class EmbeddingBenchResult:
    num_sentences: int
    concurrency: int
    per_request: int
    batch_size: int
    server_seconds: float
    reference_seconds: float

    @property
    def server_rate(self) -> float:
        return self.num_sentences / self.server_seconds

    @property
    def reference_rate(self) -> float:
        return self.num_sentences / self.reference_seconds

    @property
    def ratio(self) -> float:
        """Server sentences per second over the reference's."""
        return self.server_rate / self.reference_rate

    def to_dict(self) -> dict:
        return {
            "sentences": self.num_sentences,
            "concurrency": self.concurrency,
            "per_request": self.per_request,
            "batch_size": self.batch_size,
            "server_seconds": self.server_seconds,
            "reference_seconds": self.reference_seconds,
            "ratio": self.ratio,
        }


def bench_sentences(count: int, seed: int = 0) -> list[str]:
    """`count` sentences of 4 to 40 random words."""
    rng = random.Random(seed)
    return [
        " ".join(rng.choices(WORDS, k=rng.randint(4, 40))).capitalize() + "." for _ in range(count)
    ]


def reference_seconds(model_dir: Path, sentences: list[str], batch_size: int = 32) -> float:
    """Seconds for transformers' BertModel to embed `sentences` in batches of `batch_size`
    (tokenizing, the forward pass, mean pooling and normalization), after one warm-up batch."""
    import torch
    import torch.nn.functional as F
    from transformers import AutoTokenizer, BertModel

    model = BertModel.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))

    def embed(batch: list[str]) -> torch.Tensor:
        inputs = tokenizer(
            batch, padding=True, truncation=True, max_length=256, return_tensors="pt"
        )
        hidden = model(**inputs).last_hidden_state
        mask = inputs["attention_mask"].unsqueeze(-1).float()
        return F.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1)

    with torch.inference_mode():
        embed(sentences[:batch_size])
        started = time.perf_counter()
        for start in range(0, len(sentences), batch_size):
            embed(sentences[start : start + batch_size])
        return time.perf_counter() - started


def server_seconds(
    url: str, sentences: list[str], *, concurrency: int = 8, per_request: int = 16
) -> float:
    """Seconds for `concurrency` clients to embed `sentences` through `url`/v1/embeddings in
    requests of `per_request`, after one warm-up request. Every answer is checked."""
    requests = [sentences[i : i + per_request] for i in range(0, len(sentences), per_request)]

    async def main() -> float:
        limits = httpx.Limits(max_connections=concurrency)
        async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as client:

            async def send(batch: list[str]) -> None:
                response = await client.post("/v1/embeddings", json={"input": batch})
                response.raise_for_status()
                if len(response.json()["data"]) != len(batch):
                    raise RuntimeError("an answer lacks vectors")

            await send(requests[0])
            queue = list(reversed(requests))

            async def worker() -> None:
                while queue:
                    await send(queue.pop())

            started = time.perf_counter()
            await asyncio.gather(*(worker() for _ in range(concurrency)))
            return time.perf_counter() - started

    return asyncio.run(main())


def format_embedding_table(result: EmbeddingBenchResult) -> str:
    return "\n".join(
        [
            "| | sentences | seconds | sentences/s |",
            "| --- | --- | --- | --- |",
            f"| kvserve `/v1/embeddings`, {result.concurrency} clients, {result.per_request} "
            f"sentences a request | {result.num_sentences} | {result.server_seconds:.2f} | "
            f"{result.server_rate:.0f} |",
            f"| transformers `BertModel`, batches of {result.batch_size} | "
            f"{result.num_sentences} | {result.reference_seconds:.2f} | "
            f"{result.reference_rate:.0f} |",
            "",
            f"kvserve / transformers: {result.ratio:.2f}x.",
        ]
    )
