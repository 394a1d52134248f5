"""Sampling parameters and the batched sampler, checked against plain-Python references."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from kvserve.engine.sampler import RowState, Sampler, make_generator
from kvserve.params import MAX_LOGPROBS, MAX_STOP_STRINGS, SamplingParams, SamplingParamsError

# A hand-made distribution over 8 tokens, most likely first, placed on shuffled token ids so that
# nothing depends on the likely tokens having small ids.
PROBABILITIES = [0.30, 0.22, 0.16, 0.12, 0.08, 0.06, 0.04, 0.02]
TOKEN_ORDER = [5, 2, 7, 0, 3, 6, 1, 4]


def hand_made_logits() -> list[float]:
    logits = [0.0] * len(PROBABILITIES)
    for probability, token_id in zip(PROBABILITIES, TOKEN_ORDER, strict=True):
        logits[token_id] = math.log(probability)
    return logits


def softmax(logits: list[float]) -> list[float]:
    top = max(logits)
    weights = [math.exp(value - top) for value in logits]
    total = sum(weights)
    return [weight / total for weight in weights]


def reference_distribution(logits: list[float], params: SamplingParams) -> list[float]:
    """The distribution a random row is drawn from, computed token by token."""
    probs = softmax([value / params.temperature for value in logits])
    ranked = sorted(range(len(probs)), key=lambda token_id: -probs[token_id])
    allowed = set(ranked)
    if params.top_k > 0:
        allowed = set(ranked[: params.top_k])
    if params.top_p < 1.0:
        mass = sum(probs[token_id] for token_id in allowed)
        nucleus, before = set(), 0.0
        for token_id in ranked:
            if token_id not in allowed or before >= params.top_p:
                break
            nucleus.add(token_id)
            before += probs[token_id] / mass
        allowed = nucleus
    if params.min_p > 0.0:
        top = max(probs)
        allowed = {token_id for token_id in allowed if probs[token_id] >= params.min_p * top}
    total = sum(probs[token_id] for token_id in allowed)
    return [probs[i] / total if i in allowed else 0.0 for i in range(len(probs))]


def draw_many(
    logits: list[float], params: SamplingParams, num_draws: int, seed: int = 0
) -> Counter[int]:
    """Draw `num_draws` tokens, one per row of a batch of identical unseeded rows."""
    batch = torch.tensor([logits] * num_draws)
    rows = [RowState(params) for _ in range(num_draws)]
    return Counter(Sampler(seed=seed).sample(batch, rows).token_ids)


def total_variation(counts: Counter[int], expected: list[float]) -> float:
    num_draws = sum(counts.values())
    return 0.5 * sum(
        abs(counts.get(token_id, 0) / num_draws - probability)
        for token_id, probability in enumerate(expected)
    )


# --- SamplingParams ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -3}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": 2.01}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"min_p": -0.01}, "min_p"),
        ({"min_p": 1.01}, "min_p"),
        ({"seed": 2**64}, "seed"),
        ({"seed": "7"}, "seed"),
        ({"stop": ("a", "b", "c", "d", "e")}, "stop"),
        ({"stop": ("ok", "")}, "stop"),
        ({"stop": (3,)}, "stop"),
        ({"stop_token_ids": (-1,)}, "stop_token_ids"),
        ({"ignore_eos": 1}, "ignore_eos"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -2.5}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"repetition_penalty": 2.1}, "repetition_penalty"),
        ({"logit_bias": {5: 100.5}}, "logit_bias"),
        ({"logit_bias": {5: math.inf}}, "logit_bias"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias"),
        ({"logit_bias": {"five": 1.0}}, "logit_bias"),
        ({"logit_bias": ((5, 1.0), ("5", 2.0))}, "logit_bias"),
        ({"logprobs": MAX_LOGPROBS + 1}, "top_logprobs"),
        ({"logprobs": -1}, "top_logprobs"),
        ({"n": 0}, "n"),
    ],
)
def test_out_of_range_fields_name_their_param(fields: dict, param: str) -> None:
    with pytest.raises(SamplingParamsError) as raised:
        SamplingParams(**fields).validate()
    assert raised.value.param == param
    assert isinstance(raised.value, ValueError)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"stop": 3}, "stop"),
        ({"stop": {"a": 1}}, "stop"),
        ({"stop_token_ids": 5}, "stop_token_ids"),
        ({"logit_bias": 5}, "logit_bias"),
        ({"logit_bias": [(1, 2.0, 3.0)]}, "logit_bias"),
    ],
)
def test_containers_of_the_wrong_shape_are_refused_at_once(fields: dict, param: str) -> None:
    with pytest.raises(SamplingParamsError) as raised:
        SamplingParams(**fields)
    assert raised.value.param == param


def test_token_ids_are_checked_against_the_vocabulary() -> None:
    SamplingParams(logit_bias={99: 1.0}, stop_token_ids=(99,)).validate(vocab_size=100)
    with pytest.raises(SamplingParamsError) as raised:
        SamplingParams(logit_bias={100: 1.0}).validate(vocab_size=100)
    assert raised.value.param == "logit_bias"
    with pytest.raises(SamplingParamsError) as raised:
        SamplingParams(stop_token_ids=(100,)).validate(vocab_size=100)
    assert raised.value.param == "stop_token_ids"


def test_in_range_values_pass_including_the_edges() -> None:
    SamplingParams().validate(vocab_size=10)
    SamplingParams(
        max_tokens=1,
        temperature=2.0,
        top_p=1.0,
        top_k=-1,
        min_p=1.0,
        seed=-(2**63),
        stop=("x",) * MAX_STOP_STRINGS,
        presence_penalty=-2.0,
        frequency_penalty=2.0,
        repetition_penalty=2.0,
        logit_bias={0: -100, 9: 100.0},
        logprobs=MAX_LOGPROBS,
    ).validate(vocab_size=10)
    SamplingParams(temperature=0.0, logprobs=0, seed=2**64 - 1).validate()


def test_containers_are_normalised_and_the_params_hashable() -> None:
    params = SamplingParams(stop="END", stop_token_ids=[2, 1], logit_bias={"7": 1.5, 3: -2.0})
    assert params.stop == ("END",)
    assert params.stop_token_ids == (2, 1)
    assert params.logit_bias == ((3, -2.0), (7, 1.5))
    same = SamplingParams(stop=["END"], stop_token_ids=(2, 1), logit_bias=((7, 1.5), (3, -2.0)))
    assert params == same
    assert hash(params) == hash(same)


def test_greedy_property() -> None:
    assert SamplingParams(temperature=0.0).greedy
    assert SamplingParams(temperature=1.3, top_k=1).greedy
    assert not SamplingParams(temperature=0.2, top_k=2).greedy


# --- greedy -----------------------------------------------------------------------------------


def python_argmax(values: list[float]) -> int:
    """The index of the largest value, the lowest index among equals."""
    best = 0
    for index, value in enumerate(values):
        if value > values[best]:
            best = index
    return best


def test_greedy_rows_take_the_argmax_with_ties_to_the_lowest_id() -> None:
    generator = torch.Generator().manual_seed(11)
    logits = torch.randn(12, 500, generator=generator)
    logits[3, [17, 40, 99]] = logits[3].max() + 1.0  # a three-way tie
    logits[5] = 0.0  # all tied
    rows = [RowState(SamplingParams(temperature=0.0)) for _ in range(12)]
    output = Sampler(seed=0).sample(logits, rows)
    assert output.token_ids == [python_argmax(row) for row in logits.tolist()]
    assert output.token_ids[3] == 17
    assert output.token_ids[5] == 0


def test_top_k_one_and_vanishing_temperature_are_greedy() -> None:
    generator = torch.Generator().manual_seed(12)
    # Logits at least 0.5 apart, so at temperature 0.01 a runner-up has odds below e^-50.
    logits = torch.stack([torch.randperm(300, generator=generator) * 0.5 for _ in range(64)])
    expected = [python_argmax(row) for row in logits.tolist()]
    sampler = Sampler(seed=0)
    for params in (
        SamplingParams(temperature=1.5, top_k=1),
        SamplingParams(temperature=0.01),
        SamplingParams(temperature=1e-4),
        SamplingParams(temperature=1e-30),
    ):
        for _ in range(5):
            output = sampler.sample(logits, [RowState(params) for _ in range(64)])
            assert output.token_ids == expected, params


def test_greedy_and_random_rows_share_a_batch() -> None:
    generator = torch.Generator().manual_seed(13)
    logits = torch.randn(10, 50, generator=generator)
    rows = [
        RowState(SamplingParams(temperature=0.0 if index % 2 == 0 else 1.0)) for index in range(10)
    ]
    sampler = Sampler(seed=0)
    random_tokens = set()
    for _ in range(20):
        output = sampler.sample(logits, rows)
        for index in range(0, 10, 2):
            assert output.token_ids[index] == python_argmax(logits[index].tolist())
        random_tokens.update(output.token_ids[1::2])
    assert len(random_tokens) > 5  # the random rows really are random


# --- truncation and the draw ------------------------------------------------------------------


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(top_k=3),
        SamplingParams(top_p=0.45),
        SamplingParams(top_p=0.6),
        SamplingParams(top_p=0.9),
        # Renormalised over the top 4 the nucleus holds 3 tokens; over all 8 it would hold 4.
        SamplingParams(top_k=4, top_p=0.7),
        # Temperature flattens first: 4 tokens instead of 3.
        SamplingParams(temperature=2.0, top_p=0.6),
        SamplingParams(min_p=0.35),
        SamplingParams(min_p=0.5, temperature=0.8),
        SamplingParams(top_k=6, top_p=0.95, min_p=0.3),
    ],
)
def test_truncation_keeps_exactly_the_allowed_tokens(params: SamplingParams) -> None:
    logits = hand_made_logits()
    expected = reference_distribution(logits, params)
    allowed = {token_id for token_id, p in enumerate(expected) if p > 0}
    assert 1 < len(allowed) < len(logits)
    counts = draw_many(logits, params, num_draws=20_000)
    assert set(counts) == allowed
    assert total_variation(counts, expected) < 0.02


@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.6])
def test_draw_frequencies_match_the_softmax(temperature: float) -> None:
    logits = hand_made_logits()
    params = SamplingParams(temperature=temperature)
    expected = reference_distribution(logits, params)
    counts = draw_many(logits, params, num_draws=40_000, seed=5)
    assert total_variation(counts, expected) < 0.015


@pytest.mark.parametrize(("scale", "top_p"), [(0.3, 0.9), (0.3, 0.5), (2.5, 0.9), (6.0, 0.9)])
def test_top_p_over_a_large_vocabulary(scale: float, top_p: float) -> None:
    # A flat distribution puts the nucleus beyond the first few hundred tokens, a peaked one
    # inside them; both must match the reference set.
    generator = torch.Generator().manual_seed(14)
    logits = (torch.randn(1000, generator=generator) * scale).tolist()
    params = SamplingParams(top_p=top_p)
    expected = reference_distribution(logits, params)
    ranked = sorted(range(len(logits)), key=lambda token_id: -logits[token_id])
    num_allowed = sum(1 for p in expected if p > 0)
    counts = draw_many(logits, params, num_draws=4000)
    assert all(expected[token_id] > 0 for token_id in counts)
    # The draws reach the far end of the nucleus, so it was not cut short either.
    deepest = max(ranked.index(token_id) for token_id in counts)
    assert deepest >= 0.8 * (num_allowed - 1)


def test_seeded_sampler_repeats_itself() -> None:
    logits = hand_made_logits()
    params = SamplingParams()
    assert draw_many(logits, params, 500, seed=3) == draw_many(logits, params, 500, seed=3)
    assert draw_many(logits, params, 500, seed=3) != draw_many(logits, params, 500, seed=4)


# --- logit bias, suppression, penalties -------------------------------------------------------


def reference_processed(
    logits: list[float],
    params: SamplingParams,
    prompt_token_ids: list[int],
    output_token_ids: list[int],
) -> list[float]:
    """logit_bias, then repetition, then presence/frequency penalties, token by token."""
    processed = list(logits)
    for token_id, bias in params.logit_bias:
        processed[token_id] += bias
    history = set(prompt_token_ids) | set(output_token_ids)
    for token_id in range(len(processed)):
        if token_id in history:
            if processed[token_id] > 0:
                processed[token_id] /= params.repetition_penalty
            else:
                processed[token_id] *= params.repetition_penalty
        count = output_token_ids.count(token_id)
        processed[token_id] -= count * params.frequency_penalty
        processed[token_id] -= (1.0 if count > 0 else 0.0) * params.presence_penalty
    return processed


PENALTY_CASES = [
    (SamplingParams(), [1, 2], [3]),
    (SamplingParams(repetition_penalty=1.7), [0, 1, 1, 4], [6, 4]),
    (SamplingParams(repetition_penalty=0.6), [2, 9], [9, 11]),
    (SamplingParams(presence_penalty=0.8, frequency_penalty=0.5), [0, 5], [5, 5, 7, 2, 5]),
    (SamplingParams(presence_penalty=-1.0, frequency_penalty=-0.3), [], [3, 3, 8]),
    (
        SamplingParams(
            repetition_penalty=1.3,
            presence_penalty=0.4,
            frequency_penalty=1.1,
            logit_bias={2: 3.0, 10: -4.5},
        ),
        [10, 11, 2],
        [2, 2, 0, 9],
    ),
]


@pytest.fixture(scope="module")
def penalty_batch() -> tuple[torch.Tensor, list[RowState], list[list[float]]]:
    generator = torch.Generator().manual_seed(15)
    logits = torch.randn(len(PENALTY_CASES), 12, generator=generator) * 2
    rows = [
        RowState(params, prompt_token_ids=prompt, output_token_ids=output)
        for params, prompt, output in PENALTY_CASES
    ]
    expected = [
        reference_processed(row_logits, params, prompt, output)
        for row_logits, (params, prompt, output) in zip(logits.tolist(), PENALTY_CASES, strict=True)
    ]
    return logits, rows, expected


def test_penalties_and_bias_match_the_reference(penalty_batch) -> None:
    logits, rows, expected = penalty_batch
    before = logits.clone()
    processed = Sampler(seed=0).process_logits(logits, rows)
    assert torch.allclose(processed, torch.tensor(expected), atol=1e-5)
    assert torch.equal(logits, before)  # the caller's logits are left alone


def test_greedy_choice_follows_the_penalised_logits(penalty_batch) -> None:
    logits, rows, expected = penalty_batch
    greedy_rows = [
        RowState(
            SamplingParams(
                temperature=0.0,
                repetition_penalty=row.params.repetition_penalty,
                presence_penalty=row.params.presence_penalty,
                frequency_penalty=row.params.frequency_penalty,
                logit_bias=row.params.logit_bias,
            ),
            prompt_token_ids=row.prompt_token_ids,
            output_token_ids=row.output_token_ids,
        )
        for row in rows
    ]
    output = Sampler(seed=0).sample(logits, greedy_rows)
    assert output.token_ids == [python_argmax(values) for values in expected]


def test_logit_bias_forces_and_bans_tokens() -> None:
    logits = hand_made_logits()
    unlikely, likely = TOKEN_ORDER[-1], TOKEN_ORDER[0]
    forced = draw_many(logits, SamplingParams(logit_bias={unlikely: 100.0}), 2000)
    assert forced == Counter({unlikely: 2000})
    banned = draw_many(logits, SamplingParams(logit_bias={likely: -100.0}), 5000)
    assert likely not in banned and len(banned) == len(logits) - 1
    greedy = Sampler(seed=0).sample(
        torch.tensor([logits]), [RowState(SamplingParams(temperature=0, logit_bias={likely: -5}))]
    )
    assert greedy.token_ids == [TOKEN_ORDER[1]]


def test_suppressed_tokens_are_never_drawn() -> None:
    logits = hand_made_logits()
    suppressed = TOKEN_ORDER[:2]
    batch = torch.tensor([logits] * 3000)
    rows = [RowState(SamplingParams(), suppressed_token_ids=suppressed) for _ in range(3000)]
    rows[0] = RowState(SamplingParams(temperature=0.0), suppressed_token_ids=suppressed)
    output = Sampler(seed=0).sample(batch, rows)
    assert output.token_ids[0] == TOKEN_ORDER[2]
    assert not set(output.token_ids) & set(suppressed)
    assert len(set(output.token_ids)) == len(logits) - len(suppressed)


# --- log-probabilities ------------------------------------------------------------------------


def test_logprobs_are_the_log_softmax_of_the_processed_logits(penalty_batch) -> None:
    logits, rows, expected = penalty_batch
    requested = [0, 1, 3, 5, 12, None]
    temperatures = [1.0, 0.5, 0.0, 1.8, 1.0, 1.0]
    asking = [
        RowState(
            SamplingParams(
                temperature=temperature,
                logprobs=count,
                repetition_penalty=row.params.repetition_penalty,
                presence_penalty=row.params.presence_penalty,
                frequency_penalty=row.params.frequency_penalty,
                logit_bias=row.params.logit_bias,
            ),
            prompt_token_ids=row.prompt_token_ids,
            output_token_ids=row.output_token_ids,
        )
        for row, count, temperature in zip(rows, requested, temperatures, strict=True)
    ]
    output = Sampler(seed=0).sample(logits, asking)
    for index, count in enumerate(requested):
        if count is None:
            assert output.logprobs[index] is None
            assert output.top_logprobs[index] is None
            continue
        # Independent of temperature: log_softmax of the processed logits.
        values = expected[index]
        top = max(values)
        log_total = top + math.log(sum(math.exp(value - top) for value in values))
        reference = [value - log_total for value in values]
        chosen = output.token_ids[index]
        assert output.logprobs[index] == pytest.approx(reference[chosen], abs=1e-5)
        alternatives = output.top_logprobs[index]
        assert len(alternatives) == count
        best = sorted(range(len(values)), key=lambda token_id: -values[token_id])[:count]
        assert [token_id for token_id, _ in alternatives] == best
        for token_id, logprob in alternatives:
            assert logprob == pytest.approx(reference[token_id], abs=1e-5)
        assert [lp for _, lp in alternatives] == sorted(
            (lp for _, lp in alternatives), reverse=True
        )


def test_logprobs_can_be_asked_for_at_most_twenty() -> None:
    SamplingParams(logprobs=20).validate()
    with pytest.raises(SamplingParamsError) as raised:
        SamplingParams(logprobs=21).validate()
    assert raised.value.param == "top_logprobs"
    logits = torch.randn(2, 100, generator=torch.Generator().manual_seed(16))
    output = Sampler(seed=0).sample(
        logits, [RowState(SamplingParams(logprobs=20)), RowState(SamplingParams(logprobs=2))]
    )
    assert [len(alternatives) for alternatives in output.top_logprobs] == [20, 2]


# --- per-request seeds ------------------------------------------------------------------------

VOCAB_SIZE = 600
NUM_STEPS = 40


def step_logits(step: int, num_rows: int, salt: int) -> torch.Tensor:
    """Logits for one step, from flat (nucleus beyond the first candidates) to peaked."""
    generator = torch.Generator().manual_seed(1000 * salt + step)
    scale = [0.3, 1.0, 3.0, 8.0][step % 4]
    return torch.randn(num_rows, VOCAB_SIZE, generator=generator) * scale


TARGET_PARAMS = [
    SamplingParams(temperature=0.9, top_p=0.95, seed=7),
    SamplingParams(temperature=1.2, top_k=40, top_p=0.8, min_p=0.02, seed=7),
    SamplingParams(temperature=0.7, repetition_penalty=1.3, frequency_penalty=0.5, seed=7),
]

NEIGHBOURS = [
    SamplingParams(temperature=0.0),
    SamplingParams(),
    SamplingParams(top_p=0.5),
    SamplingParams(top_k=5, seed=8),
    SamplingParams(min_p=0.1, temperature=1.5, seed=7),
    SamplingParams(temperature=0.4, top_k=1),
]


def run_seeded(target: SamplingParams, seed: int, layout, sampler_seed: int = 0) -> list[int]:
    """Drive the target request for NUM_STEPS steps among neighbours chosen by `layout`.

    `layout(step)` gives (neighbour indices, target position) for that step. The target's logits
    are the same in every layout; its neighbours' are not.
    """
    sampler = Sampler(seed=sampler_seed)
    generator = make_generator(seed, "cpu")
    neighbour_generators = {
        index: make_generator(params.seed, "cpu")
        for index, params in enumerate(NEIGHBOURS)
        if params.seed is not None
    }
    prompt = list(range(0, VOCAB_SIZE, 7))
    output_ids: list[int] = []
    for step in range(NUM_STEPS):
        neighbour_ids, position = layout(step)
        rows = [
            RowState(NEIGHBOURS[index], generator=neighbour_generators.get(index))
            for index in neighbour_ids
        ]
        others = step_logits(step, len(rows), salt=position + 17 * len(rows))
        target_row = RowState(
            target, generator=generator, prompt_token_ids=prompt, output_token_ids=output_ids
        )
        rows.insert(position, target_row)
        logits = torch.cat([others[:position], step_logits(step, 1, salt=0), others[position:]])
        token_id = sampler.sample(logits, rows).token_ids[position]
        output_ids.append(token_id)
    return output_ids


LAYOUTS = {
    "alone": lambda step: ([], 0),
    "middle": lambda step: ([0, 1, 3, 4], 2),
    "first": lambda step: ([5, 2, 1, 0, 3], 0),
    "last": lambda step: ([1, 2, 4], 3),
    "changing": lambda step: (
        list(range(step % 7)[: len(NEIGHBOURS)]),
        (3 * step) % (step % 7 + 1),
    ),
}


@pytest.mark.parametrize("target", TARGET_PARAMS)
def test_a_seeded_row_ignores_its_batch(target: SamplingParams) -> None:
    alone = run_seeded(target, 7, LAYOUTS["alone"])
    assert len(set(alone)) > NUM_STEPS // 4  # a real random sequence, not a constant
    for name, layout in LAYOUTS.items():
        assert run_seeded(target, 7, layout, sampler_seed=len(name)) == alone, name
    assert run_seeded(target, 8, LAYOUTS["alone"]) != alone


def test_make_generator_follows_the_seed() -> None:
    def numbers(seed: int) -> list[float]:
        return torch.rand(5, generator=make_generator(seed, "cpu")).tolist()

    assert numbers(42) == numbers(42)
    assert numbers(42) != numbers(43)
    assert numbers(-1) == numbers(2**64 - 1)  # negative seeds wrap modulo 2**64


def test_half_precision_logits_are_accepted() -> None:
    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(17)).to(torch.bfloat16)
    rows = [RowState(SamplingParams(temperature=0.0, logprobs=2)) for _ in range(4)]
    output = Sampler(seed=0).sample(logits, rows)
    assert output.token_ids == [python_argmax(row) for row in logits.float().tolist()]
    assert all(isinstance(logprob, float) for logprob in output.logprobs)


def test_empty_batch() -> None:
    output = Sampler().sample(torch.empty(0, 10), [])
    assert output.token_ids == [] and output.logprobs == [] and output.top_logprobs == []


def test_rows_must_match_the_logits() -> None:
    with pytest.raises(ValueError):
        Sampler().sample(torch.zeros(2, 10), [RowState(SamplingParams())])
