"""Preemption by recompute changes no answer: in float32 (where a row's logits do not depend on
its batch mates) greedy and seeded answers, structured output, logprobs and prompt logprobs are
the same token for token in a pool so small that requests are preempted and resumed as in a
pool where nothing is ever preempted; and the engine drains to idle afterwards."""

from __future__ import annotations

from kvserve.engine.engine import Engine, EngineObserver
from kvserve.params import StructuredOutput
from tests.engine.helpers import WORDS, collect, make_config, request

GRAMMAR = StructuredOutput.regex(r"(river|stone|light|paper)( (river|stone|light|paper)){2,40}")


class Preemptions(EngineObserver):
    def __init__(self) -> None:
        self.by_request: dict[str, int] = {}

    def on_preempted(self, state, num_sequences: int) -> None:
        self.by_request[state.request_id] = self.by_request.get(state.request_id, 0) + 1


def prompt_of(tokenizer, length: int, seed: int) -> list[int]:
    text = " ".join(WORDS[(seed * 7 + i * 3) % len(WORDS)] for i in range(length))
    return tokenizer.encode(text)[:length]


def answers(loaded, config, specs) -> tuple[list[dict], dict[str, int], int, bool]:
    """Submit `specs` (name, prompt, sampling params) in order on one engine; each answer's
    tokens, text, logprobs and prompt logprobs by name, and the preemptions seen."""
    import asyncio

    async def main():
        observer = Preemptions()
        engine = Engine(config, loaded, observer=observer)
        await engine.start()
        try:
            requests = [request(prompt, **params) for _, prompt, params in specs]
            streams = [engine.submit(r) for r in requests]
            results = []
            for (name, _, _), r, stream in zip(specs, requests, streams, strict=True):
                deltas = await collect(stream)
                by_index: dict[int, dict] = {}
                for delta in deltas:
                    entry = by_index.setdefault(
                        delta.index, {"tokens": [], "text": "", "logprobs": [], "reason": None}
                    )
                    entry["tokens"] += list(delta.token_ids)
                    entry["text"] += delta.text
                    entry["logprobs"] += [
                        (lp.token_id, round(lp.logprob, 5), tuple(t for t, _ in lp.top))
                        for lp in delta.logprobs
                    ]
                    if delta.prompt_logprobs is not None:
                        entry["prompt_logprobs"] = [
                            None if lp is None else (lp.token_id, round(lp.logprob, 5), lp.rank)
                            for lp in delta.prompt_logprobs
                        ]
                    if delta.finish_reason is not None:
                        entry["reason"] = delta.finish_reason
                results.append({"name": name, "id": r.request_id, "answers": by_index})
            preempted = {
                result["name"]: observer.by_request[result["id"]]
                for result in results
                if result["id"] in observer.by_request
            }
            idle = engine.is_idle()
            return results, preempted, engine.num_preemptions, idle
        finally:
            await engine.stop()

    return asyncio.run(main())


def strip_ids(results: list[dict]) -> list[dict]:
    return [{key: value for key, value in r.items() if key != "id"} for r in results]


def test_answers_are_the_same_with_and_without_preemption(loaded_fp32) -> None:
    tokenizer = loaded_fp32.tokenizer
    # The latest arrivals are preempted first: the ones whose state is hardest to keep (a
    # grammar, logprobs, a seeded generator, n answers) come last.
    specs = [
        ("greedy", prompt_of(tokenizer, 9, 0), {"max_tokens": 40, "temperature": 0}),
        (
            "penalized",
            prompt_of(tokenizer, 7, 1),
            {"max_tokens": 40, "temperature": 0, "repetition_penalty": 1.3},
        ),
        (
            "seeded",
            prompt_of(tokenizer, 8, 2),
            {"max_tokens": 40, "temperature": 1.0, "top_p": 0.9, "seed": 11},
        ),
        (
            "n2",
            prompt_of(tokenizer, 6, 5),
            {"max_tokens": 40, "temperature": 1.0, "seed": 3, "n": 2},
        ),
        (
            "structured",
            prompt_of(tokenizer, 10, 3),
            {"max_tokens": 40, "temperature": 0.8, "seed": 5, "structured": GRAMMAR},
        ),
        (
            "logprobs",
            prompt_of(tokenizer, 12, 4),
            {"max_tokens": 40, "temperature": 0, "logprobs": 3, "prompt_logprobs": 2},
        ),
    ]
    for _, _, params in specs:
        params.setdefault("ignore_eos", True)
    roomy, roomy_preempted, roomy_count, roomy_idle = answers(
        loaded_fp32, make_config(slots=7, blocks=64, max_model_len=256), specs
    )
    assert roomy_count == 0 and roomy_preempted == {} and roomy_idle
    # 7 blocks of 32 hold about half of what the seven answers grow to.
    tight, preempted, count, idle = answers(
        loaded_fp32, make_config(slots=7, blocks=7, max_model_len=256, reserve_tokens=4), specs
    )
    assert idle
    assert count >= 3
    assert {"structured", "logprobs", "n2"} <= set(preempted)
    assert "greedy" not in preempted  # the oldest is never preempted
    assert strip_ids(tight) == strip_ids(roomy)
    structured = next(r for r in tight if r["name"] == "structured")["answers"][0]
    assert structured["reason"] == "stop" or len(structured["tokens"]) == 40
    logprobs = next(r for r in tight if r["name"] == "logprobs")["answers"][0]
    assert len(logprobs["prompt_logprobs"]) == 12 and len(logprobs["logprobs"]) == 40


def test_a_prompt_scored_when_preempted_mid_prefill_is_scored_once_from_the_start(
    loaded_fp32,
) -> None:
    tokenizer = loaded_fp32.tokenizer
    long_prompt = (prompt_of(tokenizer, 60, 6) * 3)[:150]
    decoder_prompt = (prompt_of(tokenizer, 20, 7) * 2)[:28]
    specs = [
        # The oldest: a 1-block reservation it outgrows at position 32 (its fifth token),
        # while the next one still prefills its 150-token prompt 16 positions a step.
        ("decoder", decoder_prompt, {"max_tokens": 10, "temperature": 0}),
        (
            "scored",
            long_prompt,
            {"max_tokens": 4, "temperature": 0, "prompt_logprobs": 1, "logprobs": 1},
        ),
    ]
    for _, _, params in specs:
        params["ignore_eos"] = True
    roomy, _, roomy_count, _ = answers(
        loaded_fp32, make_config(slots=2, blocks=32, chunk=16, reserve_tokens=1), specs
    )
    tight, preempted, count, idle = answers(
        loaded_fp32, make_config(slots=2, blocks=6, chunk=16, reserve_tokens=1), specs
    )
    assert roomy_count == 0 and count >= 1 and idle
    assert set(preempted) == {"scored"}
    assert strip_ids(tight) == strip_ids(roomy)
    scored = next(r for r in tight if r["name"] == "scored")["answers"][0]
    assert len(scored["prompt_logprobs"]) == 150 and scored["prompt_logprobs"][0] is None
