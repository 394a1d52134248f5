"""Embeddings in the engine room: the Embedder's batching and admission rules without a model,
and a decoder's pooled hidden states against transformers' (the independent reference)."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch
import torch.nn.functional as F

from kvserve.engine.embedding import DecoderEmbeddings, Embedder, EmbeddingObserver
from kvserve.request import (
    EngineError,
    EngineStopped,
    InvalidRequest,
    QueueFull,
    QueueTimeout,
    RequestCancelled,
)


class Recorder(EmbeddingObserver):
    def __init__(self) -> None:
        self.finished: list[tuple[str, str | None]] = []
        self.rejected: list[str] = []
        self.batches: list[int] = []

    def on_embedding_finished(self, job) -> None:
        self.finished.append((job.request_id, job.outcome))

    def on_embedding_rejected(self, reason: str) -> None:
        self.rejected.append(reason)

    def on_embedding_batch(self, num_inputs: int, num_tokens: int, seconds: float) -> None:
        self.batches.append(num_inputs)


class FakeModel:
    """[sum of ids, length] per input; records each batch; can be held or made to fail."""

    def __init__(self) -> None:
        self.batches: list[list[list[int]]] = []
        self.release = threading.Event()
        self.release.set()
        self.fail = False

    def __call__(self, inputs):
        self.release.wait(30)
        self.batches.append([list(ids) for ids in inputs])
        if self.fail:
            raise RuntimeError("injected failure")
        return torch.tensor([[float(sum(ids)), float(len(ids))] for ids in inputs])


def embedder(model: FakeModel, observer=None, **overrides) -> Embedder:
    settings = dict(
        dimensions=2,
        max_input_tokens=8,
        vocab_size=100,
        tokenize=lambda text, truncate: [ord(c) % 100 for c in text],
        max_batch_tokens=16,
        max_jobs=4,
        queue_timeout=30.0,
        observer=observer,
    )
    settings.update(overrides)
    return Embedder(model, **settings)


def run(coroutine):
    return asyncio.run(coroutine)


def test_inputs_of_concurrent_requests_share_a_forward_pass():
    async def main():
        model, recorder = FakeModel(), Recorder()
        e = embedder(model, recorder, max_batch_tokens=64)
        await e.start()
        jobs = [e.submit(f"r{i}", [[i, 1], [i, 2, 3]]) for i in range(3)]
        results = [await job.result() for job in jobs]
        await e.stop()
        return model, recorder, results

    model, recorder, results = run(main())
    assert len(model.batches) == 1 and len(model.batches[0]) == 6
    for i, vectors in enumerate(results):
        assert vectors.tolist() == [[i + 1, 2], [i + 5, 3]]
    assert recorder.batches == [6]
    assert [outcome for _, outcome in recorder.finished] == ["done"] * 3


def test_the_token_budget_splits_a_request_over_passes_in_order():
    async def main():
        model = FakeModel()
        e = embedder(model, max_batch_tokens=8)
        await e.start()
        vectors = await e.submit("r", [[1] * 5, [2] * 5, [3] * 3]).result()
        await e.stop()
        return model, vectors

    model, vectors = run(main())
    assert [len(batch) for batch in model.batches] == [1, 2]
    assert vectors.tolist() == [[5, 5], [10, 5], [9, 3]]


def test_a_full_queue_is_refused_and_nothing_is_registered():
    async def main():
        model, recorder = FakeModel(), Recorder()
        model.release.clear()
        e = embedder(model, recorder, max_jobs=2)
        await e.start()
        first, second = e.submit("a", [[1]]), e.submit("b", [[2]])
        with pytest.raises(QueueFull):
            e.submit("c", [[3]])
        assert recorder.rejected == ["queue_full"]
        model.release.set()
        await first.result(), await second.result()
        await e.stop()
        return e

    assert run(main()).is_idle()


def test_a_wait_past_the_budget_is_a_queue_timeout():
    async def main():
        model, recorder = FakeModel(), Recorder()
        model.release.clear()
        e = embedder(model, recorder, queue_timeout=0.2, max_batch_tokens=8)
        await e.start()
        running = e.submit("busy", [[1] * 8])
        await asyncio.sleep(0.05)  # the first pass has started and is held
        waiting = e.submit("late", [[2]])
        await asyncio.sleep(0.4)
        model.release.set()
        await running.result()
        with pytest.raises(QueueTimeout):
            await waiting.result()
        await e.stop()
        return model, recorder

    model, recorder = run(main())
    assert ("late", "queue_timeout") in recorder.finished
    assert all([2] not in batch for batch in model.batches)  # it never ran


def test_a_cancelled_request_never_runs_its_waiting_inputs():
    async def main():
        model = FakeModel()
        model.release.clear()
        e = embedder(model, max_batch_tokens=8)
        await e.start()
        busy = e.submit("busy", [[1] * 8])
        await asyncio.sleep(0.05)
        gone = e.submit("gone", [[7, 7], [8]])
        assert e.cancel("gone") and not e.cancel("gone")
        model.release.set()
        await busy.result()
        with pytest.raises(RequestCancelled):
            await gone.result()
        await e.stop()
        return model, e

    model, e = run(main())
    assert model.batches == [[[1] * 8]]
    assert e.is_idle()


def test_a_failed_pass_fails_its_requests_not_the_embedder():
    async def main():
        model = FakeModel()
        model.fail = True
        e = embedder(model)
        await e.start()
        with pytest.raises(EngineError):
            await e.submit("a", [[1, 2]]).result()
        model.fail = False
        vectors = await e.submit("b", [[3]]).result()
        await e.stop()
        with pytest.raises(EngineStopped):
            e.submit("c", [[1]])
        return vectors

    assert run(main()).tolist() == [[3, 1]]


def test_inputs_are_checked_and_cut_only_when_asked():
    e = embedder(FakeModel())
    assert e.tokenize("abc") == [97, 98, 99]
    with pytest.raises(InvalidRequest, match="more than this model's 8"):
        e.tokenize("a" * 9)
    assert len(e.tokenize("a" * 9, truncate=True)) == 8
    with pytest.raises(InvalidRequest, match="token ids"):
        e.fit([5, 100])
    with pytest.raises(InvalidRequest, match="no tokens"):
        e.fit([])


def test_stopping_ends_waiting_requests():
    async def main():
        model = FakeModel()
        model.release.clear()
        e = embedder(model, max_batch_tokens=8)
        await e.start()
        busy = e.submit("busy", [[1] * 8])
        await asyncio.sleep(0.05)
        waiting = e.submit("w", [[2]])
        stopping = asyncio.ensure_future(e.stop())
        await asyncio.sleep(0.05)
        model.release.set()
        await stopping
        return busy, waiting

    busy, waiting = run(main())
    assert busy.outcome == "done"
    assert waiting.outcome == "shutdown"


# --------------------------------------------------------------------------------------------
# A decoder's embeddings


TEXTS = [
    "The sea is calm tonight.",
    "def fibonacci(n): return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)",
    "Paris",
    "A much longer sentence about the weather, the mountains and the rivers of Europe, "
    "which goes on for a while so that it spans more than one KV block of positions.",
]


def _reference(hf_reference, ids: list[int], pooling: str) -> torch.Tensor:
    with torch.no_grad():
        hidden = hf_reference.model(torch.tensor([ids])).last_hidden_state[0].float()
    vector = hidden[-1] if pooling == "last" else hidden.mean(dim=0)
    return F.normalize(vector, dim=-1)


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_decoder_embeddings_match_transformers_hidden_states(loaded_fp32, hf_reference, pooling):
    tokenizer = loaded_fp32.tokenizer
    ids = [tokenizer.encode(text, add_bos=tokenizer.add_bos) for text in TEXTS]
    embed = DecoderEmbeddings(
        loaded_fp32.model, cache_dtype=torch.float32, block_size=16, pooling=pooling
    )
    together = embed(ids)
    assert together.shape == (len(TEXTS), loaded_fp32.config.hidden_size)
    for vector, one in zip(together, ids, strict=True):
        assert F.cosine_similarity(vector, _reference(hf_reference, one, pooling), dim=0) >= 0.9999
    alone = torch.cat([embed([one]) for one in ids])
    assert torch.allclose(together, alone, atol=1e-4)


def test_int8_decoder_embeddings_are_close_to_float(loaded_default, loaded_fp32):
    tokenizer = loaded_fp32.tokenizer
    ids = [tokenizer.encode(text, add_bos=tokenizer.add_bos) for text in TEXTS]
    exact = DecoderEmbeddings(
        loaded_fp32.model, cache_dtype=torch.float32, block_size=32, pooling="mean"
    )(ids)
    served = loaded_default.model
    cache_dtype = torch.int8 if served.supports_int8_kv_cache else served.dtype
    quantized = DecoderEmbeddings(served, cache_dtype=cache_dtype, block_size=32, pooling="mean")(
        ids
    )
    assert F.cosine_similarity(exact, quantized, dim=-1).min() >= 0.98
