"""The engine on the real model: continuous batching, batch invariance, every way a request ends."""

from __future__ import annotations

import asyncio

import pytest

from kvserve.request import InvalidRequest, QueueFull, QueueTimeout, RequestCancelled
from tests.engine.helpers import (
    collect,
    make_config,
    request,
    run_engine,
    text_of,
    tokens_of,
)

PROMPTS = [
    "What is the capital of France?",
    "Write a short poem about autumn leaves.",
    "How many legs does a spider have?",
    "Translate 'good morning' into Spanish.",
    "What is 12 times 7?",
    "Name a famous painting by Leonardo da Vinci.",
    "Give me a synonym for 'happy'.",
    "What colour is the sky on a clear day?",
    "Describe a cat in three words.",
    "Who wrote Romeo and Juliet?",
    "What is the boiling point of water in Celsius?",
    "Suggest a name for a pet goldfish.",
    "What is the largest planet in the solar system?",
    "Explain what a noun is.",
    "List two fruits that are red.",
    "What day comes after Monday?",
]


def chat_ids(loaded, text: str) -> list[int]:
    return loaded.tokenizer.encode_chat([{"role": "user", "content": text}])


# -- continuous batching ----------------------------------------------------------------------


def test_arrival_joins_at_next_step_and_finished_leaves_at_once(loaded_default):
    tok = loaded_default.tokenizer
    a_ids = tok.encode("Once upon a time")
    b_ids = tok.encode("The weather today is")
    c_ids = tok.encode("In the beginning")

    async def body(engine):
        a = engine.submit(request(a_ids, max_tokens=12, temperature=0, ignore_eos=True))
        b = engine.submit(request(b_ids, max_tokens=30, temperature=0, ignore_eos=True))
        got_b = []
        async for delta in b:  # let A and B decode a few steps
            got_b.append(delta)
            if len(got_b) == 5:
                break
        next_plan = engine.scheduler.num_steps  # plans handed out so far, incl. one in flight
        c_request = request(c_ids, max_tokens=4, temperature=0, ignore_eos=True)
        c = engine.submit(c_request)
        await asyncio.gather(collect(a), collect(b), collect(c))
        return a, c_request.request_id, next_plan, list(engine.step_log)

    a, c_id, next_plan, log = run_engine(
        loaded_default, make_config(slots=4), body, record_steps=True
    )
    by_step = {record.step: record for record in log}
    # C's prefill is in exactly the next plan after its arrival, beside decode rows of others.
    first_c = min(r.step for r in log if c_id in r.request_ids)
    assert first_c == next_plan
    joined = by_step[first_c]
    assert any(chunk[0] == c_id and chunk[3] for chunk in joined.chunks)
    assert any(not chunk[3] for chunk in joined.chunks if chunk[0] != c_id)
    # A leaves the batch in the step after its last token.
    a_id = a.request_id
    a_steps = [r.step for r in log if a_id in r.request_ids]
    last_a = max(a_steps)
    assert a_steps == list(range(min(a_steps), last_a + 1))  # in every step while it ran
    assert all(a_id not in r.request_ids for r in log if r.step > last_a)
    assert any(r.step > last_a for r in log)  # others kept stepping after A left


# -- batch invariance -------------------------------------------------------------------------


@pytest.fixture
def request_fixture(request):
    """pytest's `request` under another name (this module's `request` builds a request)."""
    return request


def test_sixteen_prompts_together_match_each_alone_fp32(loaded_fp32):
    prompts = [chat_ids(loaded_fp32, p) for p in PROMPTS]
    params = dict(max_tokens=24, temperature=0)

    async def together(engine):
        streams = [engine.submit(request(p, **params)) for p in prompts]
        return [tokens_of(d) for d in await asyncio.gather(*(collect(s) for s in streams))]

    async def alone(engine):
        out = []
        for p in prompts:
            out.append(tokens_of(await collect(engine.submit(request(p, **params)))))
        return out

    config = make_config(slots=16, blocks=256)
    batched = run_engine(loaded_fp32, config, together)
    single = run_engine(loaded_fp32, config, alone)
    assert batched == single
    assert len({tuple(t) for t in batched}) > 8  # genuinely different continuations


def test_int8_prompts_together_match_each_alone(loaded_int8):
    """With int8 linear layers every row is computed alone (per-row activation scales, exact
    integer sums, per-row kernels): greedy tokens in a batch equal those run alone."""
    if loaded_int8.model.layers[0].qkv.panels is None:
        pytest.skip("needs the packed int8 product (AVX512-VNNI or AVX2)")
    prompts = [chat_ids(loaded_int8, p) for p in PROMPTS]
    params = dict(max_tokens=24, temperature=0)

    async def together(engine):
        streams = [engine.submit(request(p, **params)) for p in prompts]
        return [tokens_of(d) for d in await asyncio.gather(*(collect(s) for s in streams))]

    async def alone(engine):
        return [tokens_of(await collect(engine.submit(request(p, **params)))) for p in prompts]

    config = make_config(slots=16, blocks=256)
    batched = run_engine(loaded_int8, config, together)
    assert batched == run_engine(loaded_int8, config, alone)
    assert len({tuple(t) for t in batched}) > 8


@pytest.mark.parametrize("fixture", ["loaded_fp32", "loaded_int8"])
def test_seeded_sampling_same_alone_and_in_a_batch(fixture, request_fixture):
    """Exact in float32 and with int8 linear layers, where every row is computed alone. (bf16
    products are not batch invariant: oneDNN blocks them by row count, and a draw that lands
    within that rounding of a boundary can differ.)"""
    loaded = request_fixture.getfixturevalue(fixture)
    prompts = [chat_ids(loaded, p) for p in PROMPTS[:6]]
    seeded = dict(max_tokens=20, temperature=0.9, top_p=0.95, seed=1234, ignore_eos=True)

    async def alone(engine):
        return tokens_of(await collect(engine.submit(request(prompts[0], **seeded))))

    async def in_batch(engine):
        streams = [
            engine.submit(request(p, max_tokens=20, temperature=1.0, ignore_eos=True))
            for p in prompts[1:3]
        ]
        target = engine.submit(request(prompts[0], **seeded))
        streams += [
            engine.submit(request(p, max_tokens=20, temperature=0, ignore_eos=True))
            for p in prompts[3:]
        ]
        results = await asyncio.gather(collect(target), *(collect(s) for s in streams))
        return tokens_of(results[0])

    config = make_config(slots=8, blocks=128)
    assert run_engine(loaded, config, alone) == run_engine(loaded, config, in_batch)


# -- no state carried between requests ----------------------------------------------------------


def test_reused_blocks_and_slots_carry_nothing_over(loaded_fp32):
    """'Fluent but wrong for the next request': a request must produce the same tokens on a
    fresh engine and after another request has used (and dirtied) the same slot and blocks."""
    victim = chat_ids(loaded_fp32, "Name three colours of the rainbow.")
    polluter = chat_ids(loaded_fp32, "Write a long story about dragons, " * 8)
    params = dict(
        max_tokens=24, temperature=0.7, seed=99, repetition_penalty=1.3, frequency_penalty=0.5
    )

    async def fresh(engine):
        return tokens_of(await collect(engine.submit(request(victim, **params))))

    async def after_polluter(engine):
        await collect(
            engine.submit(
                request(
                    polluter,
                    max_tokens=40,
                    temperature=0.8,
                    seed=5,
                    repetition_penalty=1.1,
                    ignore_eos=True,
                )
            )
        )
        assert engine.pool.num_free == engine.pool.num_blocks
        return tokens_of(await collect(engine.submit(request(victim, **params))))

    # One slot, and a pool exactly as large as the polluter's reservation: the polluter holds
    # (and writes) every block, so every block the victim gets was dirtied by the polluter.
    num_blocks = -(-(len(polluter) + 40) // 32)
    assert -(-(len(victim) + 24) // 32) <= num_blocks
    config = make_config(slots=1, blocks=num_blocks)
    assert run_engine(loaded_fp32, config, fresh) == run_engine(loaded_fp32, config, after_polluter)


# -- how requests end -------------------------------------------------------------------------


def test_max_tokens_ends_with_length_and_usage(loaded_default):
    ids = chat_ids(loaded_default, "Count from one to one hundred.")

    async def body(engine):
        return await collect(
            engine.submit(request(ids, max_tokens=7, temperature=0, ignore_eos=True))
        )

    deltas = run_engine(loaded_default, make_config(), body)
    final = deltas[-1]
    assert final.finish_reason == "length"
    assert final.usage.prompt_tokens == len(ids)
    assert final.usage.completion_tokens == 7 == len(tokens_of(deltas))
    assert all(d.finish_reason is None for d in deltas[:-1])


def test_eos_ends_with_stop_and_text_matches_decode(loaded_default):
    ids = chat_ids(loaded_default, "Say hello.")
    tok = loaded_default.tokenizer

    async def body(engine):
        return await collect(engine.submit(request(ids, max_tokens=200, temperature=0)))

    deltas = run_engine(loaded_default, make_config(), body)
    assert deltas[-1].finish_reason == "stop"
    generated = tokens_of(deltas)
    assert generated[-1] in tok.eos_token_ids
    assert text_of(deltas) == tok.decode(generated)


def test_stop_string_is_not_emitted(loaded_default):
    ids = chat_ids(loaded_default, "Count from one to ten in digits separated by commas.")

    async def run(engine, **extra):
        return await collect(engine.submit(request(ids, max_tokens=40, temperature=0, **extra)))

    free = text_of(run_engine(loaded_default, make_config(), lambda e: run(e)))
    assert "4" in free
    stop = free[free.index("4") : free.index("4") + 1]
    stopped = run_engine(loaded_default, make_config(), lambda e: run(e, stop=[stop]))
    assert stopped[-1].finish_reason == "stop"
    assert text_of(stopped) == free[: free.index(stop)]


def test_logprobs_are_delivered(loaded_default):
    ids = chat_ids(loaded_default, "Hi")

    async def body(engine):
        return await collect(
            engine.submit(request(ids, max_tokens=5, temperature=0, logprobs=3, ignore_eos=True))
        )

    deltas = run_engine(loaded_default, make_config(), body)
    entries = [lp for d in deltas for lp in d.logprobs]
    assert len(entries) == 5
    for entry in entries:
        assert entry.logprob <= 0
        assert len(entry.top) == 3
        assert entry.top[0][0] == entry.token_id  # greedy: the chosen token is the best


def test_infeasible_request_is_refused_at_the_door(loaded_default):
    async def body(engine):
        with pytest.raises(InvalidRequest) as too_long:
            engine.submit(request([1] * 100, max_tokens=5000))
        with pytest.raises(InvalidRequest) as bad_param:
            engine.submit(request([1, 2, 3], temperature=-1))
        with pytest.raises(InvalidRequest):
            engine.submit(request([]))
        return too_long.value.param, bad_param.value.param, engine.is_idle()

    param, bad, idle = run_engine(loaded_default, make_config(max_model_len=2048), body)
    assert param == "max_tokens"
    assert bad == "temperature"
    assert idle


def test_queue_full_queue_timeout_and_cancel_while_queued(loaded_default):
    ids = loaded_default.tokenizer.encode("Tell me everything about the history of Rome.")

    async def body(engine):
        long_request = request(ids, max_tokens=400, temperature=0, ignore_eos=True)
        long = engine.submit(long_request)
        await long.admitted()
        waiting = engine.submit(request(ids, max_tokens=4))
        to_cancel = request(ids, max_tokens=4)
        cancelled = engine.submit(to_cancel)
        with pytest.raises(QueueFull):
            engine.submit(request(ids, max_tokens=4))
        assert engine.num_waiting == 2
        assert engine.cancel(to_cancel.request_id)
        assert not engine.cancel(to_cancel.request_id)  # idempotent
        with pytest.raises(RequestCancelled):
            await cancelled.admitted()
        assert (await collect(cancelled))[-1].finish_reason == "cancelled"
        with pytest.raises(QueueTimeout):
            await waiting.admitted()
        timeout_final = (await collect(waiting))[-1]
        engine.cancel(long_request.request_id)
        final = (await collect(long))[-1]
        return timeout_final.finish_reason, final.finish_reason, engine.is_idle()

    config = make_config(slots=1, queue_per_slot=2, queue_timeout=0.5, blocks=32)
    timeout_reason, long_reason, idle = run_engine(loaded_default, config, body)
    assert timeout_reason == "queue_timeout"
    assert long_reason == "cancelled"
    assert idle


def test_slow_consumer_is_dropped_and_others_continue(loaded_default):
    ids = loaded_default.tokenizer.encode("Write about the ocean.")

    async def body(engine):
        slow = engine.submit(request(ids, max_tokens=60, temperature=0, ignore_eos=True))
        fast = engine.submit(request(ids, max_tokens=60, temperature=0, ignore_eos=True))
        fast_deltas = await collect(fast)  # the slow stream is never read meanwhile
        slow_deltas = await collect(slow)
        return slow_deltas, fast_deltas, engine.is_idle()

    slow, fast, idle = run_engine(loaded_default, make_config(buffer=4), body)
    assert slow[-1].finish_reason == "slow_consumer"
    assert len(tokens_of(slow)) == 4  # exactly the buffer, then dropped
    assert fast[-1].finish_reason == "length" and len(tokens_of(fast)) == 60
    assert idle


def test_long_prompt_does_not_stall_decoding_sequences(loaded_default):
    """8 sequences decode while a prompt of several chunks is prefilled: every decoding
    sequence gets its row in every one of those steps (its gap stays one step)."""
    tok = loaded_default.tokenizer
    long_ids = tok.encode("The history of computing is long and varied. " * 150)[:1400]
    short = [tok.encode(f"Sequence number {i} says") for i in range(8)]

    async def body(engine):
        streams = [
            engine.submit(request(s, max_tokens=40, temperature=0, ignore_eos=True)) for s in short
        ]
        first = []
        for s in streams:
            first.append(await s.__anext__())  # all eight are decoding
        big = request(long_ids, max_tokens=2, temperature=0, ignore_eos=True)
        engine.submit(big)
        await asyncio.gather(*(collect(s) for s in streams))
        return big.request_id, list(engine.step_log)

    big_id, log = run_engine(
        loaded_default, make_config(slots=9, blocks=160, chunk=512), body, record_steps=True
    )
    prefill_steps = [r for r in log if any(c[0] == big_id and c[3] for c in r.chunks)]
    assert len(prefill_steps) == 3  # 1400 tokens in chunks of at most 512
    for record in prefill_steps:
        big_chunk = next(c for c in record.chunks if c[0] == big_id)
        assert big_chunk[2] <= 512
        decoding = [c for c in record.chunks if not c[3]]
        assert len(decoding) == 8  # nobody waited
