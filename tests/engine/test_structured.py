"""Structured output in the engine: the bitmask kernel, the grammar cache, end-of-sequence only
where the grammar accepts, and a request waiting for its grammar holding no slot."""

from __future__ import annotations

import asyncio
import re
import threading

import pytest
import torch

from kvserve.engine.sampler import RowState, Sampler, apply_token_bitmask
from kvserve.engine.structured import GrammarError, StructuredOutputManager, fill_bitmasks
from kvserve.params import SamplingParams, StructuredOutput
from kvserve.request import InvalidRequest
from tests.engine.helpers import collect, make_config, request, run_engine, text_of


def allowed_from_bitmask(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    bits = [[(int(word) >> b) & 1 for word in row for b in range(32)] for row in bitmask]
    return torch.tensor(bits, dtype=torch.bool)[:, :vocab]


@pytest.mark.parametrize("use_kernel", [True, False])
def test_bitmask_masks_exactly_the_cleared_bits(use_kernel, kernels):
    if use_kernel:
        assert kernels.has("bitmask")
    generator = torch.Generator().manual_seed(0)
    vocab = 100  # not a multiple of 32: the last word is partial
    logits = torch.randn(5, vocab, generator=generator)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, 4), dtype=torch.int32, generator=generator)
    bitmask[1] = -1  # all allowed
    rows = [0, 2, 4]
    masked = logits.clone()
    apply_token_bitmask(masked, bitmask, rows, kernels if use_kernel else None)
    allowed = allowed_from_bitmask(bitmask, vocab)
    for i, row in enumerate(rows):
        expected = torch.where(allowed[i], logits[row], -torch.inf)
        assert torch.equal(masked[row], expected)
    for row in (1, 3):  # rows without a grammar are untouched
        assert torch.equal(masked[row], logits[row])


def test_tokens_past_the_bitmask_are_masked():
    logits = torch.zeros(1, 40)
    apply_token_bitmask(logits, torch.full((1, 1), -1, dtype=torch.int32), [0])
    assert torch.isinf(logits[0, 32:]).all() and (logits[0, :32] == 0).all()


@pytest.fixture(scope="module")
def manager(loaded_default):
    manager = StructuredOutputManager(loaded_default.tokenizer, loaded_default.config.vocab_size)
    yield manager
    manager.close()


def test_grammars_are_cached_by_text(manager):
    first = manager.compile(StructuredOutput.regex("[0-9]{3}"))
    again = manager.compile(StructuredOutput.regex("[0-9]{3}", param="other"))
    assert first is again
    assert first.result(timeout=60) is not None
    assert manager.compile(StructuredOutput.regex("[0-9]{4}")) is not first


@pytest.mark.parametrize(
    "constraint",
    [
        StructuredOutput.regex("(unclosed", param="p.regex"),
        StructuredOutput.json_schema({"type": "strin"}, param="p.json"),
        StructuredOutput.grammar("start: (((", param="p.grammar"),
    ],
    ids=["regex", "schema", "grammar"],
)
def test_a_refused_grammar_fails_with_the_library_reason_and_the_field(manager, constraint):
    with pytest.raises(GrammarError) as caught:
        manager.compile(constraint).result(timeout=60)
    assert caught.value.param == constraint.param
    assert "cannot be enforced" in caught.value.message


def test_end_of_sequence_is_allowed_only_where_the_grammar_accepts(manager, loaded_default):
    tokenizer = loaded_default.tokenizer
    vocab = loaded_default.config.vocab_size
    compiled = manager.compile(StructuredOutput.regex("[0-9]{3}")).result(timeout=60)
    state = manager.matcher(compiled)
    eos = sorted(tokenizer.eos_token_ids)
    for digit in "123":
        allowed = allowed_from_bitmask(fill_bitmasks([state], vocab), vocab)[0]
        assert not any(allowed[t] for t in eos)
        assert state.accept(tokenizer.encode(digit)[0])
    allowed = allowed_from_bitmask(fill_bitmasks([state], vocab), vocab)[0]
    assert any(allowed[t] for t in eos)
    assert not allowed[tokenizer.encode("4")[0]]


def test_the_sampler_draws_only_allowed_tokens(manager, loaded_default):
    vocab = loaded_default.config.vocab_size
    compiled = manager.compile(StructuredOutput.choice(["yes", "no"])).result(timeout=60)
    rows = [
        RowState(SamplingParams(temperature=1.0), grammar=manager.matcher(compiled)),
        RowState(SamplingParams(temperature=0)),
        RowState(SamplingParams(temperature=0), grammar=manager.matcher(compiled)),
    ]
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(1))
    allowed = allowed_from_bitmask(fill_bitmasks([rows[0].grammar], vocab), vocab)[0]
    tokens = Sampler(seed=0).sample(logits, rows).token_ids
    assert allowed[tokens[0]] and allowed[tokens[2]]
    assert tokens[1] == int(logits[1].argmax())


def test_a_request_waiting_for_its_grammar_holds_no_slot(loaded_default, monkeypatch):
    gate = threading.Event()

    async def body(engine):
        original = engine.structured._compile

        def slow_compile(constraint):
            gate.wait(60)
            return original(constraint)

        monkeypatch.setattr(engine.structured, "_compile", slow_compile)
        prompt = loaded_default.tokenizer.encode("The answer is")
        waiting = engine.submit(
            request(prompt, max_tokens=5, structured=StructuredOutput.regex("(yes|no)"))
        )
        cancelled = engine.submit(
            request(prompt, max_tokens=5, structured=StructuredOutput.regex("[a-z]{4}"))
        )
        assert engine.num_running == 0 and engine.num_waiting == 0
        # One slot only, and an unconstrained request takes it and finishes meanwhile.
        free = await collect(engine.submit(request(prompt, max_tokens=3, temperature=0)))
        assert free[-1].finish_reason == "length"
        engine.cancel(cancelled.request_id)
        cancelled_deltas = await collect(cancelled)
        gate.set()
        answer = await collect(waiting)
        await asyncio.sleep(0)
        return cancelled_deltas, answer, engine.is_idle()

    cancelled, answer, idle = run_engine(loaded_default, make_config(slots=1), body)
    assert cancelled[-1].finish_reason == "cancelled"
    assert answer[-1].finish_reason == "stop"
    assert re.fullmatch("yes|no", text_of(answer))
    assert idle


def test_a_cached_bad_grammar_is_refused_at_submit(loaded_default, monkeypatch):
    gate = threading.Event()

    async def body(engine):
        original = engine.structured._compile

        def held_compile(constraint):
            # Still compiling when the first submit looks (a bad regex fails in microseconds,
            # and a compilation already done at submit is refused there).
            gate.wait(60)
            return original(constraint)

        monkeypatch.setattr(engine.structured, "_compile", held_compile)
        prompt = loaded_default.tokenizer.encode("Hi")
        bad = StructuredOutput.regex("(unclosed", param="structured_outputs.regex")
        stream = engine.submit(request(prompt, structured=bad))
        gate.set()
        first = await collect(stream)
        with pytest.raises(InvalidRequest) as caught:
            engine.submit(request(prompt, structured=bad))
        return first, caught.value, engine.is_idle()

    first, error, idle = run_engine(loaded_default, make_config(), body)
    assert first[-1].finish_reason == "error"
    assert isinstance(first[-1].error, InvalidRequest)
    assert first[-1].error.param == error.param == "structured_outputs.regex"
    assert idle


def test_sampled_rows_masks_are_filled_in_one_call_beside_the_forward_pass(
    loaded_default, monkeypatch
):
    import kvserve.engine.batch as batch_module

    events: list[tuple[str, int]] = []
    start = batch_module.start_bitmasks

    def recording_start(grammars, vocab_size):
        events.append(("masks", len(grammars)))
        return start(grammars, vocab_size)

    monkeypatch.setattr(batch_module, "start_bitmasks", recording_start)
    pattern = "(yes|no)( (yes|no)){3}"

    async def body(engine):
        forward = engine.batch.model.forward

        def recording_forward(*args, **kwargs):
            events.append(("forward", 0))
            return forward(*args, **kwargs)

        monkeypatch.setattr(engine.batch.model, "forward", recording_forward)
        prompt = loaded_default.tokenizer.encode("Answer yes or no:")
        constraint = StructuredOutput.regex(pattern)
        streams = [
            engine.submit(
                request(prompt, max_tokens=8, temperature=0.8, seed=seed, structured=constraint)
            )
            for seed in range(3)
        ]
        # Greedy constrained and unconstrained rows take no part in the early fill.
        greedy = engine.submit(request(prompt, max_tokens=8, temperature=0, structured=constraint))
        free = engine.submit(request(prompt, max_tokens=8, temperature=0, ignore_eos=True))
        answers = [await collect(stream) for stream in (*streams, greedy)]
        await collect(free)
        return answers, engine.is_idle()

    answers, idle = run_engine(loaded_default, make_config(slots=5), body)
    for answer in answers:
        assert re.fullmatch(pattern, text_of(answer))
    assert idle
    # Every step that samples constrained rows at random starts one fill for all of them,
    # before its forward pass.
    fills = [(i, n) for i, (kind, n) in enumerate(events) if kind == "masks"]
    assert fills and {n for _, n in fills} <= {1, 2, 3} and 3 in {n for _, n in fills}
    for i, _ in fills:
        assert events[i + 1][0] == "forward"


def test_greedy_rows_that_guess_right_need_no_mask_and_answer_the_same(loaded_fp32, monkeypatch):
    import kvserve.engine.sampler as sampler_module
    import kvserve.engine.structured as structured_module

    schema = {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 20},
            "days": {"type": "array", "items": {"type": "integer"}, "maxItems": 3},
        },
        "required": ["city", "days"],
    }
    questions = ["Describe Paris as JSON.", "Plan three days in Rome:", "The weather in Oslo"]
    calls: list[int] = []
    fill = sampler_module.fill_bitmasks

    def counting_fill(grammars, vocab_size):
        calls.append(len(grammars))
        return fill(grammars, vocab_size)

    monkeypatch.setattr(sampler_module, "fill_bitmasks", counting_fill)
    monkeypatch.setattr(structured_module, "fill_bitmasks", counting_fill)  # beside the forward

    def answers():
        async def body(engine):
            streams = [
                engine.submit(
                    request(
                        loaded_fp32.tokenizer.encode(question),
                        max_tokens=24,
                        temperature=0,
                        structured=StructuredOutput.json_schema(schema),
                    )
                )
                for question in questions
            ]
            return [text_of(await collect(stream)) for stream in streams]

        return run_engine(loaded_fp32, make_config(slots=3), body)

    guessed = answers()
    masked_rows_guessing = sum(calls)
    calls.clear()
    monkeypatch.setattr(sampler_module.Sampler, "guesses", staticmethod(lambda row: False))
    masked = answers()
    # The same tokens, with far fewer rows masked: a mask only where the best token was wrong.
    assert guessed == masked
    assert masked_rows_guessing < sum(calls)
    for text in guessed:
        assert text.startswith("{")
