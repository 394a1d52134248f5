"""Speculative decoding leaves answers unchanged: token for token in float32 (greedy, and seeded
sampling, which draws the same numbers), beside requests that do not speculate, with stop
strings and budgets ending inside a guess, n > 1 and structured output; and at temperature 1
its first tokens follow the target model's distribution (a chi-square test on a tiny model)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math

import pytest
import torch

from kvserve.config import SchedulerConfig, SpeculativeConfig
from kvserve.core import BlockPool, KVManager, Prompt, Scheduler, make_sequences
from kvserve.engine.batch import Batch
from kvserve.engine.engine import EngineObserver
from kvserve.engine.events import EngineEvents
from kvserve.engine.sampler import RowState, Sampler
from kvserve.params import SamplingParams, StructuredOutput
from tests.engine.helpers import make_config, request, run_engine

CODE = (
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\n"
    "def mul(a, b):\n    return a * b\n\n# the same code again:\ndef add(a, b):\n"
)
FUNCTIONS = StructuredOutput.regex(r"(def (add|sub|mul)\(a, b\):\n    return a [-+*] b\n\n){1,3}")


class Drafts(EngineObserver):
    """Counts what was verified."""

    def __init__(self) -> None:
        self.drafted = 0
        self.accepted = 0
        self.verified: list[tuple[str, int]] = []  # (sequence, guesses kept) per verification

    def on_speculated(self, state, num_drafted: int, num_accepted: int, seq_id: str) -> None:
        self.drafted += num_drafted
        self.accepted += num_accepted
        self.verified.append((seq_id, num_accepted))


def _requests(tokenizer):
    code = tokenizer.encode(CODE)
    sampled = dict(
        temperature=0.8,
        top_k=40,
        top_p=0.95,
        min_p=0.02,
        seed=7,
        presence_penalty=0.3,
        frequency_penalty=0.2,
        repetition_penalty=1.1,
        logit_bias={tokenizer.encode(" b")[0]: 1.5},
        logprobs=2,
    )
    return {
        "greedy": request(code, max_tokens=32, temperature=0, ignore_eos=True),
        "opted_out": request(code, max_tokens=32, temperature=0, speculative=False),
        "stop": request(code, max_tokens=32, temperature=0, stop=["sub"]),
        "budget": request(code, max_tokens=7, temperature=0),
        "n2": request(code, max_tokens=20, temperature=0, n=2),
        "grammar": request(code, max_tokens=40, temperature=0, structured=FUNCTIONS),
        "sampled": request(code, max_tokens=24, **sampled),
    }


def _run(loaded, speculative):
    """Answers, steps, idleness, the verifications seen, and the dashboard's step rows (every
    step's chunks as the event stream sent them)."""
    observer = Drafts()
    # The dashboard's stream, watched: an event per step, nothing dropped.
    events = EngineEvents(max_rate=10_000, buffer_size=100_000)
    config = dataclasses.replace(make_config(slots=8, blocks=96), speculative=speculative)

    async def body(engine):
        engine.observer.observers = (*engine.observer.observers, observer, events)
        events.bind(engine)
        viewer = events.connect()
        requests = _requests(loaded.tokenizer)
        streams = {name: engine.submit(req) for name, req in requests.items()}
        answers = {}
        for name, stream in streams.items():
            deltas = [d async for d in stream]
            by_index: dict[int, dict] = {}
            for d in deltas:
                answer = by_index.setdefault(d.index, {"tokens": [], "text": "", "logprobs": []})
                answer["tokens"].extend(d.token_ids)
                answer["text"] += d.text
                answer["logprobs"].extend(lp.logprob for lp in d.logprobs)
                if d.finish_reason is not None and (d.usage is None or d.index == deltas[-1].index):
                    answer["finish"] = d.finish_reason
            answers[name] = by_index
        await asyncio.sleep(0)
        events.flush()
        viewer.close()
        sent = [json.loads(text) for text in await viewer.next_batch()]
        rows = {step[0]: step[2] for e in sent if e["type"] == "update" for step in e["steps"]}
        return answers, engine.num_steps, engine.is_idle(), rows

    answers, steps, idle, rows = run_engine(loaded, config, body)
    assert len(rows) == steps  # every step the engine ran reached the viewer
    return answers, steps, idle, observer, rows


@pytest.mark.parametrize("weights", ["loaded_fp32", "loaded_bf16", "loaded_int8"])
def test_answers_are_unchanged_in_a_mixed_batch(weights, request):
    """float32, bf16 (with the CPU's bf16 dot product where it has one: a verify chunk's
    attention rows take a decode row's arithmetic, csrc/paged_attention.c), and int8 layers on
    the int8 cache (the default model's default), where a verify chunk's rows are one tile."""
    loaded = request.getfixturevalue(weights)
    plain, plain_steps, _, _, plain_rows = _run(loaded, None)
    spec, spec_steps, idle, drafts, spec_rows = _run(
        loaded, SpeculativeConfig(num_speculative_tokens=4, disable_when_slower=False)
    )
    assert idle
    for name in plain:
        for index, answer in plain[name].items():
            other = spec[name][index]
            assert other["tokens"] == answer["tokens"], (name, index)
            assert other["text"] == answer["text"], (name, index)
            assert other["finish"] == answer["finish"], (name, index)
            assert other["logprobs"] == pytest.approx(answer["logprobs"], abs=1e-4), name
    # The cases end where they were meant to: inside the answer, not at the budget.
    assert plain["stop"][0]["finish"] == "stop" and len(plain["stop"][0]["tokens"]) < 32
    assert len(plain["budget"][0]["tokens"]) == 7
    assert plain["grammar"][0]["text"].startswith("def ")
    assert len(plain["sampled"][0]["logprobs"]) == 24
    # It did speculate, and guesses were accepted: fewer steps for the same answers.
    assert drafts.accepted > 0 and drafts.drafted > drafts.accepted
    assert spec_steps < plain_steps
    # The dashboard marks each verifying chunk: its guesses (its last rows) and how many of
    # them the step kept, the same verifications the engine reported.
    assert all(len(chunk) == 3 for chunks in plain_rows.values() for chunk in chunks)
    marked = [chunk for chunks in spec_rows.values() for chunk in chunks if len(chunk) == 5]
    assert marked and all(
        not prefill and 1 <= guesses == rows - 1 for _, rows, prefill, guesses, _ in marked
    )
    verified = [(seq, kept) for seq, _, _, _, kept in marked if kept is not None]
    assert sorted(verified) == sorted(drafts.verified)
    assert all(0 <= kept <= guesses for _, _, _, guesses, kept in marked if kept is not None)


# -- the distribution ----------------------------------------------------------------------------

VOCAB = 4


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """A random two-layer Llama over 4 tokens, its head scaled so that the next-token
    distributions are far from uniform."""
    import transformers

    from kvserve.model.kernels import load_kernels
    from kvserve.model.llama import LlamaModel
    from kvserve.model.safetensors import SafetensorsCheckpoint

    path = tmp_path_factory.mktemp("tiny-spec")
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,  # head_dim 64: the C attention kernels run it
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=1,
        num_key_value_heads=1,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    torch.manual_seed(3)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        model.lm_head.weight.mul_(12.0)
    model.save_pretrained(path, safe_serialization=True)
    checkpoint = SafetensorsCheckpoint(path)
    return LlamaModel.from_tensors(
        checkpoint.config,
        checkpoint.get,
        dtype=torch.float32,
        device=torch.device("cpu"),
        kernels=load_kernels(),
    )


def test_the_engine_measures_whether_speculation_pays(loaded_fp32):
    """By default (`disable_when_slower`) the engine reports each decoding step's wall time to
    the scheduler, which measures both kinds of step at the batch size before it picks one: one
    stream here, so some steps guess and some do not, and the answer is the plain one."""
    config = make_config(slots=4, blocks=64)
    code = loaded_fp32.tokenizer.encode(CODE)

    def answer(speculative):
        observer = Drafts()

        async def body(engine):
            engine.observer.observers = (*engine.observer.observers, observer)
            deltas = [
                d
                async for d in engine.submit(
                    request(code, max_tokens=48, temperature=0, ignore_eos=True)
                )
            ]
            payoff = engine.scheduler.payoff
            return [t for d in deltas for t in d.token_ids], engine.num_steps, payoff

        tokens, steps, payoff = run_engine(
            loaded_fp32, dataclasses.replace(config, speculative=speculative), body
        )
        return tokens, steps, payoff, observer

    plain, _, none, _ = answer(None)
    assert none is None
    spec = SpeculativeConfig(num_speculative_tokens=4)
    assert spec.disable_when_slower
    tokens, steps, payoff, drafts = answer(spec)
    assert tokens == plain
    on, off = payoff.rates(1)
    assert on > 0 and off > 0  # both kinds were measured, in tokens a second
    assert 0 < len(drafts.verified) < steps - 1  # some steps guessed, others did not


def _first_three(model, prompt, params, *, speculative, num_samples, slots=120):
    """The first three tokens of `num_samples` answers, sampled `slots` at a time through the
    scheduler and the batch; with `speculative`, every decode step guesses tokens 1, 2."""
    from kvserve.model.kv_cache import KVCache

    block_size = 16
    pool = BlockPool(slots * 2, block_size)
    kv = KVManager(pool)
    spec = (
        SpeculativeConfig(num_speculative_tokens=2, disable_by_batch_size=slots)
        if speculative
        else None
    )
    scheduler = Scheduler(
        SchedulerConfig(max_num_seqs=slots, max_num_batched_tokens=4096),
        kv,
        64,
        speculative=spec,
        proposer=lambda seq, k: (1, 2)[:k],
    )
    batch = Batch(
        model, KVCache(model.config, slots * 2, block_size, torch.float32, model.device), Sampler(5)
    )
    samples: list[tuple[int, int, int]] = []
    round_ = 0
    while len(samples) < num_samples:
        seqs = []
        for i in range(min(slots, num_samples - len(samples))):
            seq = make_sequences(f"r{round_}-{i}", len(prompt), 6, Prompt(tuple(prompt)))[0]
            assert scheduler.admit([seq])
            seqs.append(seq)
        round_ += 1
        while scheduler.num_running:
            plan = scheduler.schedule()
            rows = {
                seq_id: RowState(
                    params,
                    prompt_token_ids=prompt,
                    output_token_ids=scheduler.get(seq_id).output_token_ids,
                )
                for chunk in plan.chunks
                for seq_id in chunk.sampler_ids
            }
            output = batch.execute(plan, rows)
            sampled: dict = {seq_id: s.token_id for seq_id, s in output.sampled.items()}
            for seq_id, spec_out in output.speculated.items():
                sampled[seq_id] = tuple(t.token_id for t in spec_out.tokens)
            for seq in scheduler.update_from_output(plan, sampled):
                scheduler.release(seq.seq_id)
            for seq in list(scheduler.running):
                if seq.num_output >= 3:
                    scheduler.release(seq.seq_id)
        samples.extend(tuple(seq.output_token_ids[:3]) for seq in seqs)
    assert pool.num_free == pool.num_blocks and kv.check_whole()
    return samples


def _exact_first_three(model, prompt):
    """P(t1, t2, t3) from the model's logits at temperature 1, over every prefix."""
    from kvserve.model.kv_cache import KVCache
    from tests.model.helpers import Chunk

    probs = {}
    for t1 in range(VOCAB):
        for t2 in range(VOCAB):
            ids = [*prompt, t1, t2]
            cache = KVCache(model.config, 1, 16, torch.float32, model.device)
            meta = model.attention.build_metadata([Chunk(0, len(ids), [0], True)], 16)
            meta.logits_indices = torch.arange(len(ids))
            p = torch.softmax(model.forward(torch.tensor(ids), meta, cache), dim=-1)
            n = len(prompt)
            for t3 in range(VOCAB):
                probs[(t1, t2, t3)] = p[n - 1, t1].item() * p[n, t2].item() * p[n + 1, t3].item()
    return probs


def _chi_square(samples, probs):
    """The statistic and its degrees of freedom, cells with an expected count below 5 pooled."""
    counts: dict = {}
    for sample in samples:
        counts[sample] = counts.get(sample, 0) + 1
    total = len(samples)
    statistic, cells, pooled_expected, pooled_observed = 0.0, 0, 0.0, 0
    for cell, p in probs.items():
        expected = p * total
        if expected < 5:
            pooled_expected += expected
            pooled_observed += counts.get(cell, 0)
            continue
        statistic += (counts.get(cell, 0) - expected) ** 2 / expected
        cells += 1
    if pooled_expected >= 5:
        statistic += (pooled_observed - pooled_expected) ** 2 / pooled_expected
        cells += 1
    return statistic, cells - 1


def _critical(df: int, z: float = 3.09) -> float:
    """The chi-square quantile at 1 - 0.001 (Wilson-Hilferty)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def test_sampling_at_temperature_one_keeps_the_target_distribution(tiny_model):
    prompt = [0, 3, 1]
    params = SamplingParams(temperature=1.0)
    probs = _exact_first_three(tiny_model, prompt)
    spec = _first_three(tiny_model, prompt, params, speculative=True, num_samples=2400)
    plain = _first_three(tiny_model, prompt, params, speculative=False, num_samples=2400)
    for samples in (spec, plain):
        statistic, df = _chi_square(samples, probs)
        assert df >= 12, sorted(probs.values())
        assert statistic < _critical(df), (statistic, df)
    # The guesses were both accepted and rejected (both branches of the rule ran).
    assert any(s[1] == 1 for s in spec) and any(s[1] != 1 for s in spec)
    # The test can fail: guesses taken without verification are far off the distribution.
    always = [(s[0], 1, 2) for s in spec]
    assert _chi_square(always, probs)[0] > _critical(_chi_square(always, probs)[1])
