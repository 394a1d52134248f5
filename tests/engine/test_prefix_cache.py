"""Prefix caching and n > 1 on the real model, in float32 (where a row's logits do not depend
on its batch mates, so answers compare token for token).

A greedy answer is the same with a cache hit and without: a hit of one block, of many, of the
whole prompt minus one token, and after cached blocks were evicted and their memory reused by
another prompt. Salts never share. n answers prefill the prompt once, and each answer is the
one its own request would get."""

from __future__ import annotations

import asyncio

from kvserve.config import CacheConfig, EngineConfig
from tests.engine.helpers import collect, make_config, request, run_engine, tokens_of, words

BS = 32


def without_cache(config: EngineConfig) -> EngineConfig:
    cache = config.cache
    return EngineConfig(
        cache=CacheConfig(
            block_size=cache.block_size,
            num_kv_blocks=cache.num_kv_blocks,
            enable_prefix_caching=False,
        ),
        scheduler=config.scheduler,
        queue=config.queue,
        stream=config.stream,
    )


def greedy(ids, **extra):
    return request(ids, max_tokens=8, temperature=0, ignore_eos=True, **extra)


def test_greedy_answers_are_the_same_with_hits_of_one_many_and_all_but_one_token(loaded_fp32):
    tok = loaded_fp32.tokenizer
    base = words(tok, 200, 1)
    shared_one = base[:40] + words(tok, 20, 2)  # shares one full block with `base`
    shared_many = base[:130] + words(tok, 15, 3)  # shares four full blocks
    all_but_one = base[: 3 * BS + 1]  # hits 3 blocks = every prompt token but the last
    prompts = [shared_one, shared_many, all_but_one, base[: 3 * BS + 1]]
    config = make_config(slots=2, blocks=64, max_model_len=512)

    async def cached(engine):
        await collect(engine.submit(greedy(base)))  # publishes base's blocks
        results = []
        for ids in prompts:
            deltas = await collect(engine.submit(greedy(ids)))
            results.append((tokens_of(deltas), deltas[-1].usage.cached_tokens))
        return results

    async def uncached(engine):
        return [tokens_of(await collect(engine.submit(greedy(ids)))) for ids in prompts]

    hits = run_engine(loaded_fp32, config, cached)
    misses = run_engine(loaded_fp32, without_cache(config), uncached)
    assert [tokens for tokens, _ in hits] == misses
    assert [cached_tokens for _, cached_tokens in hits] == [BS, 4 * BS, 3 * BS, 3 * BS]


def test_after_eviction_and_reuse_no_request_reads_another_prompts_kv(loaded_fp32):
    """Fill the pool, evict the cached prefix, reuse its memory for other prompts, then ask
    again: the answer is the uncached one, and the cache no longer claims the evicted blocks."""
    tok = loaded_fp32.tokenizer
    first = words(tok, 100, 4)
    others = [words(tok, 100, seed) for seed in (5, 6, 7)]
    num_blocks = -(-(len(first) + 8) // BS) + 1  # room for one request and a little more
    config = make_config(slots=1, blocks=num_blocks, max_model_len=512)

    async def body(engine):
        before = tokens_of(await collect(engine.submit(greedy(first))))
        assert engine.pool.num_cached_free > 0
        for ids in others:  # each needs most of the pool: first's cached blocks are evicted
            await collect(engine.submit(greedy(ids)))
        again = await collect(engine.submit(greedy(first)))
        assert engine.is_idle()
        return before, tokens_of(again), again[-1].usage.cached_tokens

    async def alone(engine):
        return tokens_of(await collect(engine.submit(greedy(first))))

    before, again, cached_tokens = run_engine(loaded_fp32, config, body)
    assert before == again == run_engine(loaded_fp32, without_cache(config), alone)
    assert cached_tokens == 0  # evicted: recomputed, not read from reused memory


def test_salts_never_share(loaded_fp32):
    ids = words(loaded_fp32.tokenizer, 120, 8)
    config = make_config(slots=2, blocks=64, max_model_len=512)

    async def body(engine):
        cached = []
        for salt in ("tenant-a", "tenant-b", None, "tenant-a"):
            deltas = await collect(engine.submit(greedy(ids, cache_salt=salt)))
            cached.append(deltas[-1].usage.cached_tokens)
        return cached

    # The fourth takes every position the first computed (its whole prompt and the answer's
    # fed-back tokens), capped so its own last token is computed.
    assert run_engine(loaded_fp32, config, body) == [0, 0, 0, len(ids) - 1]


def test_a_chat_turn_reuses_the_previous_prompt_and_answer_and_answers_as_without_cache(
    loaded_fp32,
):
    """Each turn resends the history: the previous prompt, the answer generated for it and a
    new user turn. The next turn takes every position the previous one computed (the answer's
    full blocks by reference, its partly filled last block by copy): all but the last answer
    token, which was sampled and never fed back. Its answers are the uncached ones."""
    tok = loaded_fp32.tokenizer
    users = [words(tok, 70, 12), words(tok, 30, 13), words(tok, 45, 14)]
    answer_len = 40
    config = make_config(slots=2, blocks=64, max_model_len=512)

    def ask(ids):
        return request(ids, max_tokens=answer_len, temperature=0, ignore_eos=True)

    async def chat(engine):
        history: list[int] = []
        turns = []
        for user in users:
            history += user
            deltas = await collect(engine.submit(ask(history)))
            answer = tokens_of(deltas)
            turns.append((len(history), answer, deltas[-1].usage.cached_tokens))
            history += answer
        assert engine.is_idle()
        return turns

    cached = run_engine(loaded_fp32, config, chat)
    uncached = run_engine(loaded_fp32, without_cache(config), chat)
    assert [answer for _, answer, _ in cached] == [answer for _, answer, _ in uncached]
    assert [c for _, _, c in uncached] == [0, 0, 0]
    num_prompt = [n for n, _, _ in cached]
    # Turn k + 1 took turn k's prompt and all its answer tokens but the last.
    assert [c for _, _, c in cached] == [0] + [n + answer_len - 1 for n in num_prompt[:-1]]
    # Those end mid-block: the answer's full blocks and a copied tail.
    assert all((n + answer_len - 1) % BS for n in num_prompt[:-1])


def test_n_answers_prefill_once_and_each_is_its_own_requests_answer(loaded_fp32):
    ids = words(loaded_fp32.tokenizer, 70, 9)  # not a whole number of blocks: a copied block
    assert len(ids) % BS
    config = make_config(slots=4, blocks=64, max_model_len=512)

    def sampled(seed, n=1):
        return request(ids, max_tokens=6, temperature=0.9, seed=seed, n=n, ignore_eos=True)

    async def together(engine):
        deltas = await collect(engine.submit(sampled(40, n=3)))
        steps = list(engine.step_log)
        return deltas, steps

    async def apart(engine):
        return [tokens_of(await collect(engine.submit(sampled(40 + i)))) for i in range(3)]

    deltas, steps = run_engine(loaded_fp32, config, together, record_steps=True)
    answers = [[t for d in deltas if d.index == i for t in d.token_ids] for i in range(3)]
    # With a seed, answer i draws from its own derived stream: the one seed + i gives alone.
    assert answers == run_engine(loaded_fp32, without_cache(config), apart, record_steps=False)
    prefill_rows = sum(n for record in steps for _, _, n, is_prefill in record.chunks if is_prefill)
    assert prefill_rows == len(ids)  # the prompt was computed once, not three times
    final = deltas[-1]
    assert final.finished and final.usage.prompt_tokens == len(ids)
    assert final.usage.completion_tokens == 18
    ends = sorted(d.index for d in deltas if d.finish_reason is not None)
    assert ends == [0, 1, 2]


def test_n_answers_reserve_all_or_nothing_and_a_cancel_ends_all(loaded_fp32):
    ids = words(loaded_fp32.tokenizer, 40, 10)
    config = make_config(slots=3, blocks=64, max_model_len=512)

    async def body(engine):
        stream = engine.submit(request(ids, max_tokens=50, temperature=0.8, n=3))
        await stream.admitted()
        assert engine.num_running == 3
        # Every slot is taken: a one-answer request waits.
        waiting = engine.submit(request(ids, max_tokens=2, temperature=0))
        assert engine.num_waiting == 1
        while engine.num_steps < 3:
            await asyncio.sleep(0.01)
        engine.cancel(stream.request_id)
        deltas = await collect(stream)
        await collect(waiting)
        return deltas[-1].finish_reason, engine.is_idle()

    assert run_engine(loaded_fp32, config, body) == ("cancelled", True)


def test_offline_api_returns_n_outputs_from_one_prefill(loaded_fp32):
    from kvserve.engine.llm import LLM
    from kvserve.params import SamplingParams

    ids = words(loaded_fp32.tokenizer, 30, 11)
    params = SamplingParams(max_tokens=4, temperature=0.8, seed=3, n=2, ignore_eos=True)
    config = make_config(slots=2, blocks=32, max_model_len=256)
    with LLM(config=config, loaded=loaded_fp32, record_steps=True) as llm:
        (result,) = llm.generate([ids], params)
        prefill_rows = sum(
            num_tokens
            for record in llm.engine.step_log
            for _, _, num_tokens, is_prefill in record.chunks
            if is_prefill
        )
        (alone,) = llm.generate(
            [ids], SamplingParams(max_tokens=4, temperature=0.8, seed=4, ignore_eos=True)
        )
    assert [o.index for o in result.outputs] == [0, 1]
    assert all(len(o.token_ids) == 4 and o.finish_reason == "length" for o in result.outputs)
    assert prefill_rows == len(ids)  # the prompt was computed once for both answers
    assert result.outputs[1].token_ids == alone.outputs[0].token_ids  # answer 1: seed + 1
