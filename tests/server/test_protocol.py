"""The wire protocol without a model: parsing, field policy, parameter mapping, errors, shapes."""

from __future__ import annotations

import json

import pytest

from kvserve.engine.stream import TokenLogprob, Usage
from kvserve.request import InvalidRequest, QueueFull, QueueTimeout
from kvserve.server.dialects.openai import (
    DEFAULT_COMPLETION_MAX_TOKENS,
    ChatCompletionRequest,
    CompletionRequest,
    sampling_params,
)
from kvserve.server.dialects.openai_chat import ChatStream
from kvserve.server.dialects.openai_completions import CompletionBody
from kvserve.server.protocol import APIError, parse_request, refused_fields
from kvserve.server.render import Ending, Update

VOCAB = 1000
MESSAGES = [{"role": "user", "content": "hi"}]


def _chat(**fields) -> ChatCompletionRequest:
    return parse_request(
        ChatCompletionRequest, json.dumps({"messages": MESSAGES, **fields}).encode()
    )


def _completion(**fields) -> CompletionRequest:
    return parse_request(CompletionRequest, json.dumps({"prompt": "hi", **fields}).encode())


def _parse_error(body: bytes, model=ChatCompletionRequest) -> APIError:
    with pytest.raises(APIError) as caught:
        parse_request(model, body)
    assert caught.value.status == 400
    return caught.value


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (b'{"messages": [{"role": "user", "content": 3}]}', "messages[0].content"),
        (b'{"messages": [{"role": "user"}, {"content": "x"}]}', "messages[1].role"),
        (b'{"messages": [], "max_tokens": "5"}', "max_tokens"),
        (b'{"messages": [], "temperature": true}', "temperature"),
        (b'{"messages": [], "stop": [1]}', "stop"),
        (
            b'{"messages": [], "stream_options": {"include_usage": "yes"}}',
            "stream_options.include_usage",
        ),
        (b'{"max_tokens": 5}', "messages"),
    ],
)
def test_validation_errors_name_the_field(body, param):
    assert _parse_error(body).param == param


@pytest.mark.parametrize("body", [b"{", b"not json", b"", b"   ", b"[]", b"3"])
def test_unparsable_bodies_are_400_without_param(body):
    error = _parse_error(body)
    assert error.param is None
    assert error.body()["error"]["type"] == "invalid_request_error"


def test_strings_are_not_numbers():
    # Lax parsing would turn "0.5" into 0.5; OpenAI refuses it, and so do we.
    assert _parse_error(b'{"messages": [], "top_p": "0.5"}').param == "top_p"


def test_extras_are_kept_for_classification():
    request = _chat(user="u", functions=[], foo={"bar": 1})
    assert set(request.model_extra) == {"user", "functions", "foo"}


@pytest.mark.parametrize(
    ("extras", "refused"),
    [
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"function_call": {"name": "f"}}, "function_call"),
        ({"guided_json": {"type": "object"}}, "guided_json"),
        ({"user": "x", "echo": True}, "echo"),
        ({"suffix": "end"}, "suffix"),
        ({"best_of": 2}, "best_of"),
        ({"min_tokens": 5}, "min_tokens"),
    ],
)
def test_answer_changing_extras_are_refused_by_name(extras, refused):
    _, error = refused_fields(extras)
    assert error is not None
    assert error.status == 400
    assert error.param == refused


def test_harmless_extras_are_ignored_and_listed():
    extras = {
        "user": "x",
        "metadata": {},
        "functions": [],
        "function_call": "none",
        "echo": False,
        "best_of": 1,
        "something_new": 1,
    }
    ignored, error = refused_fields(extras)
    assert error is None
    assert ignored == list(extras)


def test_chat_without_max_tokens_leaves_the_budget_to_the_engine():
    assert sampling_params(_chat(), VOCAB).max_tokens is None


def test_completion_default_max_tokens_is_openais():
    assert sampling_params(_completion(), VOCAB).max_tokens == DEFAULT_COMPLETION_MAX_TOKENS


def test_max_completion_tokens_wins_and_is_named_in_errors():
    params = sampling_params(_chat(max_tokens=50, max_completion_tokens=7), VOCAB)
    assert params.max_tokens == 7
    with pytest.raises(APIError) as caught:
        sampling_params(_chat(max_completion_tokens=0), VOCAB)
    assert caught.value.param == "max_completion_tokens"


def test_sampling_fields_map_through():
    params = sampling_params(
        _chat(
            temperature=0.5,
            top_p=0.9,
            top_k=40,
            min_p=0.05,
            seed=7,
            stop="END",
            presence_penalty=0.1,
            frequency_penalty=0.2,
            repetition_penalty=1.1,
            logit_bias={"5": -100},
            logprobs=True,
            top_logprobs=3,
            ignore_eos=True,
        ),
        VOCAB,
    )
    assert (params.temperature, params.top_p, params.top_k, params.min_p) == (0.5, 0.9, 40, 0.05)
    assert params.seed == 7
    assert params.stop == ("END",)
    assert (params.presence_penalty, params.frequency_penalty) == (0.1, 0.2)
    assert params.repetition_penalty == 1.1
    assert params.logit_bias == ((5, -100.0),)
    assert params.logprobs == 3
    assert params.ignore_eos


def test_null_means_default():
    params = sampling_params(_chat(temperature=None, top_p=None, stop=None, seed=None), VOCAB)
    assert (params.temperature, params.top_p, params.stop, params.seed) == (1.0, 1.0, (), None)


def test_logprobs_flags():
    assert sampling_params(_chat(logprobs=True), VOCAB).logprobs == 0
    assert sampling_params(_chat(logprobs=False), VOCAB).logprobs is None
    with pytest.raises(APIError) as caught:
        sampling_params(_chat(top_logprobs=2), VOCAB)
    assert caught.value.param == "top_logprobs"
    assert sampling_params(_completion(logprobs=2), VOCAB).logprobs == 2
    with pytest.raises(APIError) as caught:
        sampling_params(_completion(logprobs=50), VOCAB)
    assert caught.value.param == "logprobs"


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"n": 129}, "n"),
        ({"n": 0}, "n"),
        ({"cache_salt": ""}, "cache_salt"),
        ({"temperature": 2.1}, "temperature"),
        ({"logit_bias": {str(VOCAB): 1}}, "logit_bias"),
        ({"stop_token_ids": [VOCAB]}, "stop_token_ids"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
    ],
)
def test_out_of_range_parameters(fields, param):
    with pytest.raises(APIError) as caught:
        sampling_params(_chat(**fields), VOCAB)
    assert caught.value.status == 400
    assert caught.value.param == param


def test_overload_errors_carry_retry_after_the_wait_budget():
    error = APIError.from_engine(QueueFull(30.0))
    assert error.status == 429
    assert error.headers["Retry-After"] == "30"
    assert error.body()["error"] == {
        "message": error.message,
        "type": "rate_limit_error",
        "param": None,
        "code": "queue_full",
    }
    # A fractional budget rounds up: retrying earlier could only be refused again.
    assert APIError.from_engine(QueueTimeout(0.4)).headers["Retry-After"] == "1"


def test_engine_params_are_renamed_to_the_request_field():
    error = APIError.from_engine(
        InvalidRequest("too long", "prompt"), param_names={"prompt": "messages"}
    )
    assert (error.status, error.param) == (400, "messages")


def _data(frames: str) -> list[dict]:
    """The JSON data of SSE frames."""
    return [json.loads(frame.removeprefix("data: ")) for frame in frames.split("\n\n") if frame]


def test_chat_renderer_stream_shapes():
    renderer = ChatStream("chatcmpl-1", "m", 123, lambda i: b"ab", logprobs=False)
    (chunk,) = _data(renderer.head())
    assert chunk["object"] == "chat.completion.chunk"
    assert chunk["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert renderer.update(Update(())) == ""  # held-back text: nothing to send
    (middle,) = _data(renderer.update(Update(("Hé",))))
    assert middle["choices"][0] == {
        "index": 0,
        "delta": {"content": "Hé"},
        "logprobs": None,
        "finish_reason": None,
    }
    (last,) = _data(renderer.update(Update((), finish_reason="stop")))
    assert last["choices"][0]["delta"] == {}
    assert last["choices"][0]["finish_reason"] == "stop"
    usage = json.loads(renderer.usage_chunk(Usage(3, 4, cached_tokens=2)))
    assert usage["choices"] == []
    assert usage["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 4,
        "total_tokens": 7,
        "prompt_tokens_details": {"cached_tokens": 2},
    }
    assert {usage["id"], last["id"], chunk["id"]} == {"chatcmpl-1"}


def test_logprobs_shapes():
    table = {1: b"He", 2: b"llo", 3: b"\xe2\x82"}  # 3: part of a character

    entries = (TokenLogprob(1, -0.5, ((1, -0.5), (3, -1.0))), TokenLogprob(2, float("-inf")))
    chat = ChatStream("c", "m", 0, table.__getitem__, logprobs=True)
    (chunk,) = _data(chat.update(Update(("Hello",), logprobs=entries)))
    content = chunk["choices"][0]["logprobs"]
    first, second = content["content"]
    assert first["token"] == "He" and first["bytes"] == [72, 101]
    assert first["top_logprobs"][1] == {"token": "\ufffd", "logprob": -1.0, "bytes": [226, 130]}
    assert second["logprob"] == -9999.0  # JSON has no -Infinity

    completion = CompletionBody("c", "m", 0, table.__getitem__, logprobs=True)
    completion.update(Update(("Hello",), logprobs=entries))
    logprobs = completion.body(Ending("length", Usage(1, 2)))["choices"][0]["logprobs"]
    assert logprobs["tokens"] == ["He", "llo"]
    assert logprobs["text_offset"] == [0, 2]
    assert logprobs["top_logprobs"][0] == {"He": -0.5, "\ufffd": -1.0}
