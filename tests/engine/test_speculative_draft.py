"""Speculative decoding by a draft model leaves answers unchanged, token for token in float32:
with the target as its own draft (every greedy guess accepted) and with a random-weight draft
of the same vocabulary (guesses rejected and rolled back), beside requests that do not
speculate, stop strings and budgets ending inside a guess, n > 1, structured output and seeded
sampling. A draft of another vocabulary is refused at start; the pool drains whole after
cancels; the config reaches the engine from the CLI and from LLM()."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import subprocess
import sys
import textwrap

import pytest

from kvserve.config import SpeculativeConfig, parse_speculative_config
from kvserve.engine.engine import Engine
from tests.engine.helpers import make_config
from tests.engine.test_leaks import check_interleaving, interleavings
from tests.engine.test_speculative import Drafts, _requests

# Every step guesses (the rule that stops where guessing measures slower is off): the tests
# count drafts and steps.
DRAFT = SpeculativeConfig(
    method="draft_model", model="draft", num_speculative_tokens=3, disable_when_slower=False
)


def _short(requests):
    """The speculative test's cases with smaller budgets (fast on two cores)."""
    out = {}
    for name, req in requests.items():
        params = req.params
        budget = min(params.max_tokens, 16 if name != "budget" else 7)
        out[name] = dataclasses.replace(req, params=dataclasses.replace(params, max_tokens=budget))
    return out


def _run(loaded, speculative, draft=None):
    observer = Drafts()
    config = dataclasses.replace(make_config(slots=8, blocks=96), speculative=speculative)

    async def main():
        engine = Engine(config, loaded, draft=draft)
        engine.observer.observers = (*engine.observer.observers, observer)
        await engine.start()
        try:
            streams = {
                name: engine.submit(req)
                for name, req in _short(_requests(loaded.tokenizer)).items()
            }
            answers = {}
            for name, stream in streams.items():
                by_index: dict[int, dict] = {}
                async for d in stream:
                    answer = by_index.setdefault(d.index, {"tokens": [], "text": "", "lp": []})
                    answer["tokens"].extend(d.token_ids)
                    answer["text"] += d.text
                    answer["lp"].extend(lp.logprob for lp in d.logprobs)
                    if d.finish_reason is not None:
                        answer.setdefault("finish", d.finish_reason)
                answers[name] = by_index
            await asyncio.sleep(0)
            return answers, engine.num_steps, engine.is_idle(), engine.describe_memory()
        finally:
            await engine.stop()

    answers, steps, idle, memory = asyncio.run(main())
    return answers, steps, idle, observer, memory


@pytest.fixture(scope="module")
def plain(loaded_fp32):
    return _run(loaded_fp32, None)


def _same(plain_answers, spec_answers):
    for name in plain_answers:
        for index, answer in plain_answers[name].items():
            other = spec_answers[name][index]
            assert other["tokens"] == answer["tokens"], (name, index)
            assert other["text"] == answer["text"], (name, index)
            assert other["finish"] == answer["finish"], (name, index)
            assert other["lp"] == pytest.approx(answer["lp"], abs=1e-4), name


def test_the_target_as_its_own_draft_is_always_right(loaded_fp32, plain):
    answers, steps, idle, drafts, memory = _run(loaded_fp32, DRAFT, draft=loaded_fp32)
    assert idle
    _same(plain[0], answers)
    assert plain[0]["stop"][0]["finish"] == "stop"
    assert len(plain[0]["budget"][0]["tokens"]) == 7
    assert len(plain[0]["n2"]) == 2
    # Greedy guesses of the model itself: nearly all kept (the sampled request's are not).
    assert drafts.drafted > 0 and drafts.accepted >= drafts.drafted // 2
    assert steps < plain[1]
    assert "draft weights" in memory and "target + draft caches" in memory


def test_a_k_quant_draft_guesses_with_its_4_bit_head_and_changes_nothing(qwen05_gguf):
    """The real 0.5B in its K-quant blocks as its own draft: its guesses come from its head
    requantized to 4 bits (GuessHead), some differ from the target's own choice at near ties,
    and every answer is the same as without speculation."""
    engine = Engine(
        dataclasses.replace(make_config(), speculative=DRAFT), qwen05_gguf, draft=qwen05_gguf
    )
    assert engine.drafter.guess_head is engine.guess_head
    assert engine.guess_head.product.qtypes == ("Q4_0",)
    alone = _run(qwen05_gguf, None)
    answers, steps, idle, drafts, memory = _run(qwen05_gguf, DRAFT, draft=qwen05_gguf)
    assert idle
    _same(alone[0], answers)
    assert drafts.drafted > 0 and drafts.accepted >= drafts.drafted // 2
    assert steps < alone[1]
    assert "draft weights" in memory


def test_a_random_draft_is_rolled_back_and_changes_nothing(loaded_fp32, windowed_mistral, plain):
    answers, _, idle, drafts, _ = _run(loaded_fp32, DRAFT, draft=windowed_mistral[1])
    assert idle
    _same(plain[0], answers)
    assert drafts.drafted > drafts.accepted  # it guessed, and was mostly wrong


def test_a_draft_of_another_vocabulary_is_refused_at_start(loaded_fp32, qwen05_path):
    spec = SpeculativeConfig(method="draft_model", model=str(qwen05_path))
    with pytest.raises(ValueError, match=r"vocabulary of \d+ tokens, the target's has \d+"):
        Engine(dataclasses.replace(make_config(), speculative=spec), loaded_fp32)


def test_the_pool_counts_the_draft_cache(loaded_fp32):
    from kvserve.config import CacheConfig

    base = make_config()
    budget = CacheConfig(block_size=32, kv_cache_memory=64 * 2**20)
    alone = Engine(dataclasses.replace(base, cache=budget), loaded_fp32)
    both = Engine(
        dataclasses.replace(base, cache=budget, speculative=DRAFT), loaded_fp32, draft=loaded_fp32
    )
    assert both.pool_size.bytes_per_block == 2 * alone.pool_size.bytes_per_block
    assert both.pool_size.num_blocks == alone.pool_size.num_blocks // 2
    assert both.draft_kv_cache.num_blocks == both.kv_cache.num_blocks


def test_the_config_parses_from_the_cli():
    import argparse

    from kvserve.cli import add_engine_arguments, engine_config_from_args

    text = '{"model": "qwen2.5-coder:0.5b", "num_speculative_tokens": 4}'
    spec = parse_speculative_config(text)
    assert spec.method == "draft_model" and spec.model == "qwen2.5-coder:0.5b"
    assert spec.num_speculative_tokens == 4
    assert spec.draft_requantize == "Q4_0"
    assert "draft model qwen2.5-coder:0.5b (layers as Q4_0), 4 tokens" in spec.describe()
    as_file = parse_speculative_config(text[:-1] + ', "draft_requantize": null}')
    assert as_file.draft_requantize is None
    assert "draft model qwen2.5-coder:0.5b, 4 tokens" in as_file.describe()
    with pytest.raises(ValueError, match="draft_requantize must be Q4_0 or null"):
        parse_speculative_config(text[:-1] + ', "draft_requantize": "Q2_K"}')
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    args = parser.parse_args(["--speculative-config", text])
    assert engine_config_from_args(args).speculative == spec


def test_llm_loads_a_draft_by_its_path_and_answers_the_same(loaded_fp32, model_path):
    from kvserve.engine.llm import LLM
    from kvserve.params import SamplingParams

    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompt = "def add(a, b):\n    return a + b\n\ndef add(a, b):\n"
    with LLM(config=make_config(), loaded=loaded_fp32) as llm:
        expected = llm.generate([prompt], params)[0].outputs[0].token_ids
    spec = {"model": str(model_path), "num_speculative_tokens": 2}
    with LLM(config=make_config(), loaded=loaded_fp32, speculative_config=spec) as llm:
        assert llm.engine.draft is not None and llm.engine.draft is not loaded_fp32
        got = llm.generate([prompt], params)[0].outputs[0].token_ids
    assert list(got) == list(expected)


def test_a_k_quant_draft_is_loaded_with_q4_0_layers_and_answers_the_same(qwen05_gguf, qwen05_path):
    """The engine loads a draft in GGUF blocks with its larger layer blocks requantized to Q4_0
    (SpeculativeConfig.draft_requantize); the real 0.5B's guesses for itself are then mostly
    accepted, and the answer is the target's own."""
    from kvserve.engine.llm import LLM
    from kvserve.params import SamplingParams

    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    prompt = "def add(a, b):\n    return a + b\n\ndef add(a, b):\n"
    with LLM(config=make_config(), loaded=qwen05_gguf) as llm:
        expected = llm.generate([prompt], params)[0].outputs[0].token_ids
    spec = {"model": str(qwen05_path), "num_speculative_tokens": 3, "disable_when_slower": False}
    observer = Drafts()
    with LLM(config=make_config(), loaded=qwen05_gguf, speculative_config=spec) as llm:
        draft = llm.engine.draft
        assert draft is not qwen05_gguf and draft.requantized == "Q4_0"
        layers = draft.model.layers
        assert {q for layer in layers for q in (*layer.qkv.qtypes, *layer.down.qtypes)} == {
            "Q4_0",
            "Q4_K",  # the file's own Q4_K stays (as many bytes a value)
        }
        llm.engine.observer.observers = (*llm.engine.observer.observers, observer)
        got = llm.generate([prompt], params)[0].outputs[0].token_ids
    assert list(got) == list(expected)
    assert observer.drafted > 0 and observer.accepted >= observer.drafted // 2


def test_a_draft_engine_starts_no_openmp_pool_off_the_device_thread(qwen05_path, tmp_path):
    """Building an engine with a K-quant draft (its layers and its guess head requantized)
    runs every parallel kernel on the device thread: libgomp gives each thread that opens a
    parallel region a pool of its own, and a second pool on a 2-core machine makes the workers
    of both sleep between regions (their spin is cut short once threads outnumber the cores),
    so every later region pays a wake-up. Measured before this held (the 1.5B with the 0.5B as
    its draft, one stream, the editing bench): 21.3-21.8 -> 24.8-25.4 tok/s. In a process of
    its own: any kernel the test process ran on its main thread would already have that pool."""
    script = tmp_path / "pools.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import json, os, threading
            from kvserve.config import DeviceConfig
            from kvserve.engine.llm import LLM
            from kvserve.model.loader import load_model
            from kvserve.params import SamplingParams

            def foreign():  # the process's threads that Python did not start (libgomp's workers)
                python = {{t.native_id for t in threading.enumerate()}}
                return {{int(t) for t in os.listdir("/proc/self/task")}} - python

            path = {str(qwen05_path)!r}
            params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
            loaded = load_model(path, DeviceConfig(device="cpu"))
            with LLM(loaded=loaded, max_num_seqs=2, max_model_len=256) as llm:
                llm.generate(["def f(x):"], params)  # the device thread's pool exists now
            before = foreign()
            spec = {{"model": path, "num_speculative_tokens": 2, "disable_when_slower": False}}
            with LLM(loaded=loaded, max_num_seqs=2, max_model_len=256, speculative_config=spec) as llm:
                assert llm.engine.guess_head is not None
                llm.generate(["def f(x):"], params)
                print(json.dumps({{"new": sorted(foreign() - before), "before": len(before)}}))
            """
        )
    )
    result = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    threads = json.loads(result.stdout.splitlines()[-1])
    assert threads["before"] >= 1  # the device thread's worker (and numpy's and torch's own)
    assert threads["new"] == []


# The word prompts through a small pool, with cancels, slow consumers, n > 1, grammars and the
# prefix cache: drafts by the target itself (even examples) or by a random draft (odd ones).
@interleavings(6)
def test_any_interleaving_with_a_draft_drains_to_an_idle_engine(
    loaded_fp32, windowed_mistral, specs
):
    draft = loaded_fp32 if len(specs) % 2 == 0 else windowed_mistral[1]
    check_interleaving(loaded_fp32, specs, DRAFT, draft=draft)


# The real 0.5B in its K-quant blocks with its own draft as the engine loads it (layers
# requantized to Q4_0, guesses from its 4-bit head, some rejected): cancels, slow consumers
# and rollbacks drain the pool whole.
@pytest.mark.slow
@interleavings(3)
def test_any_interleaving_with_a_k_quant_draft_drains_to_an_idle_engine(
    qwen05_gguf, qwen05_draft, specs
):
    check_interleaving(qwen05_gguf, specs, DRAFT, draft=qwen05_draft)
