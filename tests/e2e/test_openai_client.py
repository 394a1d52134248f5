"""The official `openai` client (sync and async) against a live server on loopback."""

from __future__ import annotations

import asyncio

import openai
import pytest

pytestmark = pytest.mark.slow

MESSAGES = [{"role": "user", "content": "Name three colours."}]
PROMPT = "The three primary colours are"


@pytest.fixture(scope="module")
def server(server_factory):
    server = server_factory()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0) as client:
        yield client


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def test_models_lists_the_served_model(client, server):
    models = client.models.list().data
    assert [m.id for m in models] == [server.state.model_name]
    assert models[0].object == "model"


def test_chat_max_tokens_gives_length(client, model):
    reply = client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=5, temperature=0, extra_body={"ignore_eos": True}
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "length"
    assert choice.message.role == "assistant"
    assert choice.message.content
    assert reply.usage.completion_tokens == 5
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + 5
    assert reply.id.startswith("chatcmpl-")


def test_chat_stream_matches_non_stream_and_reports_usage(client, model):
    whole = client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=8, temperature=0
    )
    chunks = list(
        client.chat.completions.create(
            model=model,
            messages=MESSAGES,
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    content_chunks = [c for c in chunks if c.choices]
    finishes = [c.choices[0].finish_reason for c in content_chunks]
    # Only the last content chunk carries the finish reason.
    assert finishes[-1] == whole.choices[0].finish_reason
    assert all(reason is None for reason in finishes[:-1])
    text = "".join(c.choices[0].delta.content or "" for c in content_chunks)
    assert text == whole.choices[0].message.content
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == []
    assert usage_chunk.usage.completion_tokens == whole.usage.completion_tokens
    assert usage_chunk.usage.prompt_tokens == whole.usage.prompt_tokens


def test_stream_without_include_usage_has_no_usage_chunk(client, model):
    chunks = list(
        client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=3, stream=True)
    )
    assert all(chunk.choices for chunk in chunks)
    assert chunks[-1].choices[0].finish_reason is not None


def test_completions_stream_and_not(client, model):
    whole = client.completions.create(model=model, prompt=PROMPT, max_tokens=6, temperature=0)
    assert whole.object == "text_completion"
    streamed = list(
        client.completions.create(
            model=model,
            prompt=PROMPT,
            max_tokens=6,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].text for c in streamed if c.choices)
    assert text == whole.choices[0].text
    assert streamed[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_completions_default_max_tokens_is_16(client, model):
    reply = client.completions.create(
        model=model, prompt=PROMPT, temperature=0, extra_body={"ignore_eos": True}
    )
    assert reply.usage.completion_tokens == 16
    assert reply.choices[0].finish_reason == "length"


def test_stop_string_cuts_the_text(client, model):
    free = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    )
    text = free.choices[0].text
    # A stop string taken from the middle of what the model says anyway.
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    assert stop.strip(), f"no usable stop string in {text!r}"
    stopped = client.completions.create(
        model=model,
        prompt=PROMPT,
        max_tokens=12,
        temperature=0,
        stop=[stop],
        extra_body={"ignore_eos": True},
    )
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].text == text[: text.index(stop)]


def test_seed_makes_sampling_repeatable(client, model):
    def sample(seed: int) -> str:
        reply = client.chat.completions.create(
            model=model, messages=MESSAGES, max_tokens=12, temperature=1.0, seed=seed
        )
        return reply.choices[0].message.content

    first = sample(1234)
    assert sample(1234) == first
    others = {sample(seed) for seed in (1, 2, 3)}
    assert others != {first}, "different seeds all produced the seeded text"


def test_chat_logprobs(client, model):
    reply = client.chat.completions.create(
        model=model,
        messages=MESSAGES,
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        extra_body={"ignore_eos": True},
    )
    content = reply.choices[0].logprobs.content
    assert len(content) == 4
    assert "".join(entry.token for entry in content) == reply.choices[0].message.content
    for entry in content:
        assert entry.logprob <= 0
        assert bytes(entry.bytes).decode("utf-8", "replace") == entry.token
        assert len(entry.top_logprobs) == 3
        # Greedy: the chosen token is the most likely one.
        assert entry.top_logprobs[0].token == entry.token
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)
        values = [alt.logprob for alt in entry.top_logprobs]
        assert values == sorted(values, reverse=True)


def test_completion_logprobs(client, model):
    reply = client.completions.create(
        model=model,
        prompt=PROMPT,
        max_tokens=4,
        temperature=0,
        logprobs=2,
        extra_body={"ignore_eos": True},
    )
    logprobs = reply.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == 4
    assert "".join(logprobs.tokens) == reply.choices[0].text
    offsets = [0]
    for token in logprobs.tokens[:-1]:
        offsets.append(offsets[-1] + len(token))
    assert logprobs.text_offset == offsets
    for token, top in zip(logprobs.tokens, logprobs.top_logprobs, strict=True):
        assert token in top and len(top) == 2


def test_async_client_concurrent_requests(server, model):
    async def run() -> list:
        async with openai.AsyncOpenAI(
            base_url=server.url + "/v1", api_key="unused", max_retries=0
        ) as client:
            plain = client.chat.completions.create(
                model=model, messages=MESSAGES, max_tokens=4, temperature=0
            )

            async def streamed() -> str:
                stream = await client.completions.create(
                    model=model, prompt=PROMPT, max_tokens=4, temperature=0, stream=True
                )
                return "".join([c.choices[0].text async for c in stream if c.choices])

            return await asyncio.gather(plain, streamed())

    chat, text = asyncio.run(run())
    assert chat.choices[0].message.content
    assert chat.usage.completion_tokens <= 4
    assert text


def test_errors_surface_as_openai_exceptions(client, model):
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model="no-such-model", messages=MESSAGES, max_tokens=2)
    assert caught.value.body["param"] == "model"
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=model, messages=MESSAGES, temperature=3.5)
    assert caught.value.body["param"] == "temperature"


# -- n > 1 and the prefix cache -----------------------------------------------------------------

LONG_SYSTEM = "You answer in one short sentence. " * 12


def _prefill_rows(server, request_id_part: str) -> int:
    engine = server.state.engine
    return sum(
        n
        for record in engine.step_log
        for seq_id, _, n, is_prefill in record.chunks
        if is_prefill and request_id_part in seq_id
    )


def test_chat_n_answers_with_indexes_and_usage_prefilled_once(client, model, server):
    reply = client.chat.completions.create(
        model=model,
        messages=MESSAGES,
        max_tokens=6,
        temperature=0.9,
        seed=11,
        n=2,
        extra_body={"ignore_eos": True},
    )
    assert [c.index for c in reply.choices] == [0, 1]
    assert all(c.finish_reason == "length" and c.message.content for c in reply.choices)
    assert reply.usage.completion_tokens == 12
    request_id = reply.id.removeprefix("chatcmpl-")
    # Prefilled once: the rows computing the prompt add up to the prompt, not twice it.
    assert 0 < _prefill_rows(server, request_id) <= reply.usage.prompt_tokens
    # (That seeded answer i equals the answer seed + i gives alone is checked exactly in
    # float32: tests/engine/test_prefix_cache.py. This server runs bf16.)


def test_completions_n_stream_interleaves_indexes_and_sums_usage(client, model, server):
    chunks = list(
        client.completions.create(
            model=model,
            prompt=PROMPT,
            max_tokens=5,
            temperature=0.8,
            n=2,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    texts = {0: "", 1: ""}
    finishes = {}
    for chunk in chunks[:-1]:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    assert finishes == {0: "length", 1: "length"}
    assert all(texts.values())
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.completion_tokens == 10
    request_id = chunks[0].id.removeprefix("cmpl-")
    assert 0 < _prefill_rows(server, request_id) <= usage.prompt_tokens


def test_a_repeated_prefix_is_reported_as_cached_and_counted(client, model, server, metrics):
    messages = [{"role": "system", "content": LONG_SYSTEM}, *MESSAGES]
    before = metrics(server)
    first = client.chat.completions.create(
        model=model, messages=messages, max_tokens=4, temperature=0
    )
    chunks = list(
        client.chat.completions.create(
            model=model,
            messages=messages,
            max_tokens=4,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    other_tenant = client.chat.completions.create(
        model=model, messages=messages, max_tokens=4, temperature=0, extra_body={"cache_salt": "b"}
    )
    after = metrics(server)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = chunks[-1].usage.prompt_tokens_details.cached_tokens
    # Every position the first request computed: whole blocks by reference and the rest of the
    # last one copied from its published tail, all but the last prompt token (computed again
    # for its logits).
    assert cached == first.usage.prompt_tokens - 1
    assert "".join(c.choices[0].delta.content or "" for c in chunks[:-1]) == (
        first.choices[0].message.content
    )
    assert other_tenant.usage.prompt_tokens_details.cached_tokens == 0
    queries = "kvserve:prefix_cache_queries_total"
    hits = "kvserve:prefix_cache_hits_total"
    assert after[queries] - before[queries] == 3 * first.usage.prompt_tokens
    assert after[hits] - before[hits] == cached
    assert "kvserve:num_cached_free_kv_blocks" in after
