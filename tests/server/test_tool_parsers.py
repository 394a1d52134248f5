"""The tool-call syntax of each template family, without a model: Llama 3 JSON and Mistral
[TOOL_CALLS] (Hermes has tests/server/test_tools.py): calls read whole and streamed in any
split, text that is not a call kept as content, the forced (required, named) constraint in
the family's own format read back to the same calls, the family chosen from the template, and
tool history rendered by the families' real templates."""

from __future__ import annotations

import json
import random

import pytest

from kvserve.engine.stream import Delta, Usage
from kvserve.server.dialects.function_tools import CallEnd, CallReader, CallStart
from kvserve.server.dialects.openai_chat import chat_rendering
from kvserve.server.tools import (
    TOOL_CALL_PARSERS,
    HermesToolParser,
    Llama3JsonToolParser,
    MistralToolParser,
    ToolCall,
    mistral_call_id,
    parser_for,
    plan_tools,
    template_family,
    tool_prompt,
)
from tests.chat_templates import LLAMA_3_1, MISTRAL_V0_3, QWEN_LIKE

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}


def run(parser, text: str, sizes: list[int]) -> tuple[str, list[tuple[str, dict]]]:
    """Feed `text` cut at the given sizes (cycled); (content, calls)."""
    items = []
    start = 0
    index = 0
    while start < len(text):
        size = sizes[index % len(sizes)]
        items += parser.feed(text[start : start + size])
        start += size
        index += 1
    items += parser.finish()
    content = "".join(item for item in items if isinstance(item, str))
    calls = [
        (item.name, json.loads(item.arguments)) for item in items if isinstance(item, ToolCall)
    ]
    return content, calls


def random_splits(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[1], [2], [3], [7], [10**6]] + [
        [rng.randint(1, 9) for _ in range(20)] for _ in range(40)
    ]


CASES = {
    "llama3_json": [
        # (answer, content, calls)
        (
            '{"name": "get_weather", "parameters": {"city": "Oslo"}}',
            "",
            [("get_weather", {"city": "Oslo"})],
        ),
        (
            '<|python_tag|>{"name": "get_weather", "parameters": {"city": "北京 {x}"}}',
            "",
            [("get_weather", {"city": "北京 {x}"})],
        ),
        (
            '\n  {"name": "get_time", "parameters": {}}; {"name": "get_weather", '
            '"arguments": {"city": "a\\"b"}}',
            "",
            [("get_time", {}), ("get_weather", {"city": 'a"b'})],
        ),
        ("The weather is fine.", "The weather is fine.", []),
        ("  {not json} at all", "  {not json} at all", []),
        ('{"city": "Oslo"}', '{"city": "Oslo"}', []),
        (
            "<|python_tag|>brave_search.call(query=1)",
            "<|python_tag|>brave_search.call(query=1)",
            [],
        ),
        ('{"name": "get_time", "parameters": {', '{"name": "get_time", "parameters": {', []),
        ('Sure: {"name": "get_time"}', 'Sure: {"name": "get_time"}', []),
        ("<", "<", []),
    ],
    "mistral": [
        (
            '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Oslo"}}]',
            "",
            [("get_weather", {"city": "Oslo"})],
        ),
        (
            'Let me check.\n[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "[x]"}}, '
            '{"name": "get_time", "arguments": {}, "id": "abcdefghi"}]',
            "Let me check.",
            [("get_weather", {"city": "[x]"}), ("get_time", {})],
        ),
        (
            '[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}[TOOL_CALLS]get_time[ARGS]{}',
            "",
            [("get_weather", {"city": "Oslo"}), ("get_time", {})],
        ),
        (
            '[TOOL_CALLS]get_time[CALL_ID]a1b2c3d4e[ARGS] {"timezone": "Europe/Oslo"}',
            "",
            [("get_time", {"timezone": "Europe/Oslo"})],
        ),
        ("A [list] of [TOOL things].", "A [list] of [TOOL things].", []),
        ("[TOOL_CALLS] not json", "[TOOL_CALLS] not json", []),
        ('[TOOL_CALLS] [{"city": 1}]', '[TOOL_CALLS] [{"city": 1}]', []),
        ('[{"name": "get_time", "arguments": {}}]', '[{"name": "get_time", "arguments": {}}]', []),
        ("[TOOL_CALLS]bad name![ARGS]{}", "[TOOL_CALLS]bad name![ARGS]{}", []),
        ("ends with [TOOL_CA", "ends with [TOOL_CA", []),
    ],
}


@pytest.mark.parametrize("parser_name", list(CASES))
def test_calls_and_content_are_the_same_in_any_split(parser_name):
    cls = TOOL_CALL_PARSERS[parser_name]
    for number, (text, content, calls) in enumerate(CASES[parser_name]):
        whole = cls().parse(text)
        assert (whole[0] or "", [(c.name, json.loads(c.arguments)) for c in whole[1]]) == (
            content,
            calls,
        ), text
        for sizes in random_splits(number):
            assert run(cls(), text, sizes) == (content, calls), (text, sizes)


@pytest.mark.parametrize("cls", [Llama3JsonToolParser, MistralToolParser])
def test_calls_come_out_as_soon_as_they_close(cls):
    first = (
        '{"name": "get_time", "parameters": {}}'
        if cls is Llama3JsonToolParser
        else "[TOOL_CALLS]get_time[ARGS]{}"
    )
    parser = cls(id_prefix="toolu_")
    items = parser.feed(first)
    if cls is MistralToolParser:
        items += parser.feed("[TOOL_CALLS]")  # the next call's marker ends this one's object
    assert [item.name for item in items if isinstance(item, ToolCall)] == ["get_time"]
    assert all(item.id.startswith("toolu_") for item in parser.calls)


def test_mistral_content_never_shows_the_start_of_a_marker():
    text = 'I will look [TOOL_CALLS] [{"name": "get_time", "arguments": {}}]'
    for sizes in random_splits(5):
        parser = MistralToolParser()
        shown = ""
        start = 0
        for size in sizes * len(text):
            if start >= len(text):
                break
            for item in parser.feed(text[start : start + size]):
                if isinstance(item, str):
                    shown += item
            start += size
        assert "[" not in shown
        assert shown == "I will look"


# --------------------------------------------------------------------------------------------
# Forced choices: the family's format, read back the same with or without its marker


def example_answer(parser_name: str, calls: list[tuple[str, dict]], marker: bool) -> str:
    if parser_name == "llama3_json":
        body = "; ".join(json.dumps({"name": n, "parameters": a}) for n, a in calls)
        return ("<|python_tag|>" if marker else "") + body
    body = json.dumps([{"name": n, "arguments": a} for n, a in calls])
    return ("[TOOL_CALLS] " if marker else "") + body


@pytest.mark.parametrize("parser_name", ["llama3_json", "mistral"])
def test_forced_constraints_are_the_familys_format(parser_name):
    named = plan_tools(
        [WEATHER, TIME],
        {"type": "function", "function": {"name": "get_weather"}},
        parser=parser_name,
    )
    required = plan_tools([WEATHER, TIME], "required", parser=parser_name)
    single = plan_tools([WEATHER, TIME], "required", parallel_tool_calls=False, parser=parser_name)
    named_schema = json.loads(named.constraint.spec)
    required_schema = json.loads(required.constraint.spec)
    arguments = "parameters" if parser_name == "llama3_json" else "arguments"
    closed_weather = {**WEATHER["function"]["parameters"], "additionalProperties": False}
    call = {
        "type": "object",
        "properties": {"name": {"const": "get_weather"}, arguments: closed_weather},
        "required": ["name", arguments],
        "additionalProperties": False,
    }
    if parser_name == "llama3_json":
        # One call per turn: Llama 3's templates take no more.
        assert named_schema == call
        assert [o["properties"]["name"]["const"] for o in required_schema["anyOf"]] == [
            "get_weather",
            "get_time",
        ]
        assert json.loads(single.constraint.spec) == required_schema
    else:
        assert named_schema == {"type": "array", "items": call, "minItems": 1, "maxItems": 1}
        assert required_schema["minItems"] == 1 and "maxItems" not in required_schema
        assert json.loads(single.constraint.spec)["maxItems"] == 1
    assert named.constraint.param == "tools.function.parameters"
    assert required.reads_with_parser and named.reads_with_parser


@pytest.mark.parametrize("parser_name", ["llama3_json", "mistral"])
@pytest.mark.parametrize("choice", ["required", "named"])
def test_forced_answers_read_the_same_with_or_without_the_marker(parser_name, choice):
    tool_choice = (
        "required"
        if choice == "required"
        else {"type": "function", "function": {"name": "get_weather"}}
    )
    plan = plan_tools([WEATHER, TIME], tool_choice, parser=parser_name)
    calls = [("get_weather", {"city": "Oslo"})]
    if choice == "required" and parser_name == "mistral":
        calls.append(("get_time", {}))
    results = []
    for marker in (False, True):
        text = example_answer(parser_name, calls, marker)
        for sizes in random_splits(1)[:10]:
            results.append(run(plan.new_parser(), text, sizes))
    assert results == [("", calls)] * len(results)
    # Under auto a bare Mistral array is content: only the marker starts calls there.
    if parser_name == "mistral":
        auto = plan_tools([WEATHER, TIME], "auto", parser=parser_name)
        bare = example_answer(parser_name, calls, False)
        assert auto.new_parser().parse(bare) == (bare, [])


def chat_renderer(plan):
    return chat_rendering("chatcmpl-1", "m", lambda t: b"", plan=plan)


def streamed_calls(chunks):
    calls: dict[int, dict] = {}
    finish = None
    content = ""
    for chunk in chunks:
        choice = json.loads(chunk)["choices"][0]
        finish = choice["finish_reason"] or finish
        content += choice["delta"].get("content") or ""
        for entry in choice["delta"].get("tool_calls", []):
            call = calls.setdefault(entry["index"], {"arguments": ""})
            if "id" in entry:
                call["name"] = entry["function"]["name"]
            call["arguments"] += entry["function"].get("arguments", "")
    return content, [(c["name"], json.loads(c["arguments"])) for c in calls.values()], finish


@pytest.mark.parametrize("parser_name", ["llama3_json", "mistral"])
@pytest.mark.parametrize("choice", ["auto", "required", "named"])
def test_chat_responses_carry_the_calls(parser_name, choice):
    tool_choice = (
        {"type": "function", "function": {"name": "get_weather"}} if choice == "named" else choice
    )
    plan = plan_tools([WEATHER, TIME], tool_choice, parser=parser_name)
    calls = [("get_weather", {"city": "Oslo"})]
    text = example_answer(parser_name, calls, marker=choice == "auto")
    finish = "stop" if choice == "named" else "tool_calls"

    final = Delta(finish_reason="stop", usage=Usage(1, 2))
    streaming = chat_renderer(plan)
    frames = streaming.head()
    for start in range(0, len(text), 4):
        frames += streaming.frames(Delta(text=text[start : start + 4], token_ids=(1,)))
    frames += streaming.tail(final)
    chunks = [
        frame.removeprefix("data: ")
        for frame in frames.split("\n\n")
        if frame.startswith("data: {")
    ]
    assert streamed_calls(chunks) == ("", calls, finish)

    whole = chat_renderer(plan)
    whole.add(Delta(text=text, token_ids=(1,)))
    whole.add(final)
    body = whole.response(final)
    message = body["choices"][0]["message"]
    assert message["content"] is None
    assert [
        (c["function"]["name"], json.loads(c["function"]["arguments"]))
        for c in message["tool_calls"]
    ] == calls
    assert body["choices"][0]["finish_reason"] == finish


@pytest.mark.parametrize("parser_name", ["llama3_json", "mistral"])
def test_the_other_dialects_read_forced_calls_in_the_familys_format(parser_name):
    plan = plan_tools([WEATHER, TIME], "required", parser=parser_name)
    reader = CallReader(plan, "toolu_")
    text = example_answer(parser_name, [("get_time", {})], marker=False)
    pieces = reader.feed(text[:5], final=False) + reader.feed(text[5:], final=True)
    starts = [piece for piece in pieces if isinstance(piece, CallStart)]
    ends = [piece for piece in pieces if isinstance(piece, CallEnd)]
    assert [s.name for s in starts] == ["get_time"] and starts[0].id.startswith("toolu_")
    assert [json.loads(e.arguments) for e in ends] == [{}]
    assert reader.called


# --------------------------------------------------------------------------------------------
# The family of a template, and tool history in its own format


def test_the_parser_follows_the_template_family():
    assert template_family(LLAMA_3_1) == "llama3_json"
    assert template_family(MISTRAL_V0_3) == "mistral"
    assert template_family(QWEN_LIKE) == "hermes"
    # A template that never reads `tools` gets the Hermes fallback prompt, whatever its family.
    assert template_family("<|start_header_id|>{{ messages }} ipython [TOOL_CALLS]") == "hermes"
    assert template_family(None) == "hermes"
    assert parser_for(MISTRAL_V0_3, None) == parser_for(MISTRAL_V0_3, "auto") == "mistral"
    assert parser_for(MISTRAL_V0_3, "hermes") == "hermes"
    assert TOOL_CALL_PARSERS["qwen"] is HermesToolParser


HISTORY = [
    {"role": "user", "content": "What is the weather in Oslo?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_0123456789abcdef01234567",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
            }
        ],
    },
    {
        "role": "tool",
        "tool_call_id": "call_0123456789abcdef01234567",
        "content": '{"temperature": 21}',
    },
]


@pytest.fixture(scope="module")
def vocabulary():
    from kvserve.model.gguf import read_header
    from kvserve.model.paths import default_model_path
    from kvserve.tokenizer import Tokenizer

    path = default_model_path()
    return Tokenizer.from_gguf(path, fields=read_header(path).fields)


def test_llama3_template_round_trips_a_tool_result(vocabulary):
    tok = vocabulary.with_chat_template(LLAMA_3_1)
    plan = plan_tools([WEATHER], "auto", parser=parser_for(LLAMA_3_1, None))
    messages, kwargs = tool_prompt(plan, HISTORY, LLAMA_3_1, {})
    rendered = tok.render_chat(messages, **kwargs)
    assert (
        '<|start_header_id|>assistant<|end_header_id|>\n\n{"name": "get_weather", '
        '"parameters": {"city": "Oslo"}}<|eot_id|>'
    ) in rendered
    # The template writes a string result with tojson (strings are iterable to Jinja).
    assert (
        '<|start_header_id|>ipython<|end_header_id|>\n\n"{\\"temperature\\": 21}"<|eot_id|>'
        in rendered
    )
    assert '"name": "get_weather"' in rendered.split("<|eot_id|>")[1]  # the tool listing
    assert rendered.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")
    # The call the model writes back in that format parses to the same call.
    content, calls = plan.new_parser().parse(
        '{"name": "get_weather", "parameters": {"city": "Oslo"}}'
    )
    assert content is None and [(c.name, c.arguments) for c in calls] == [
        ("get_weather", '{"city": "Oslo"}')
    ]


def test_mistral_template_round_trips_a_tool_result(vocabulary):
    tok = vocabulary.with_chat_template(MISTRAL_V0_3)
    plan = plan_tools([WEATHER], "auto", parser=parser_for(MISTRAL_V0_3, None))
    messages, kwargs = tool_prompt(plan, HISTORY, MISTRAL_V0_3, {})
    rendered = tok.render_chat(messages, **kwargs)
    short = mistral_call_id("call_0123456789abcdef01234567")
    assert short == "bcdef01234567"[-9:] and short.isalnum() and len(short) == 9
    assert (
        f'[TOOL_CALLS] [{{"name": "get_weather", "arguments": {{"city": "Oslo"}}, "id": "{short}"}}]'
        in rendered
    )
    assert (
        f'[TOOL_RESULTS] {{"content": {{"temperature": 21}}, "call_id": "{short}"}}[/TOOL_RESULTS]'
        in rendered
    )
    assert '[AVAILABLE_TOOLS] [{"type": "function", "function": {"name": "get_weather"' in rendered
    # The ids the client sends are its own; the template needs nine letters and digits, and a
    # call and its result keep matching.
    assert mistral_call_id("call_1") == mistral_call_id("call_1") != mistral_call_id("call_2")
    assert len(mistral_call_id("call_1")) == 9
    # The messages the client sent are not changed in place.
    assert HISTORY[1]["tool_calls"][0]["function"]["arguments"] == '{"city": "Oslo"}'


def test_the_chat_template_and_parser_flags(tmp_path):
    import argparse

    from kvserve.cli import engine_config_from_args
    from kvserve.server.cli import add_arguments, server_config_from_args

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    template_file = tmp_path / "mistral.jinja"
    template_file.write_text(MISTRAL_V0_3)
    args = parser.parse_args(["--chat-template", str(template_file), "--tool-call-parser", "auto"])
    assert engine_config_from_args(args).chat_template == MISTRAL_V0_3
    assert server_config_from_args(args).tool_call_parser == "auto"
    inline = parser.parse_args(["--chat-template", "{{ messages[0]['content'] }}"])
    assert engine_config_from_args(inline).chat_template == "{{ messages[0]['content'] }}"
    assert engine_config_from_args(parser.parse_args([])).chat_template is None
    with pytest.raises(SystemExit, match="no such file"):
        engine_config_from_args(parser.parse_args(["--chat-template", str(tmp_path / "nope")]))
    with pytest.raises(SystemExit):
        parser.parse_args(["--tool-call-parser", "made-up"])


def test_a_template_that_does_not_compile_is_refused_at_start(vocabulary):
    from kvserve.tokenizer import ChatTemplateError

    with pytest.raises(ChatTemplateError, match="compile"):
        vocabulary.with_chat_template("{% for %}")
    assert vocabulary.with_chat_template(None).chat_template is None
    assert vocabulary.chat_template is not None  # the original is unchanged


BARE_HERMES = [
    # (answer, content, calls): a call that opens the answer bare or in a JSON fence is a call
    (
        '```json\n{\n  "name": "get_weather",\n  "arguments": {"city": "Oslo"}\n}\n```',
        "",
        [("get_weather", {"city": "Oslo"})],
    ),
    ('{"name": "get_time", "arguments": {}}', "", [("get_time", {})]),
    (
        '{"name": "get_weather", "arguments": {"city": "Oslo"}}\nLet me check.',
        "Let me check.",
        [("get_weather", {"city": "Oslo"})],
    ),
    # ...and only that: other JSON, other fences and text stay content, as written
    ('{"name": "Bob", "age": 3}', '{"name": "Bob", "age": 3}', []),
    ('```json\n{"a": 1}\n```', '```json\n{"a": 1}\n```', []),
    ("```python\nprint(1)\n```", "```python\nprint(1)\n```", []),
    ("`x` is a name", "`x` is a name", []),
    ('{"name": "get_time", "arguments": {', '{"name": "get_time", "arguments": {', []),
    (
        'Sure. {"name": "get_time", "arguments": {}}',
        'Sure. {"name": "get_time", "arguments": {}}',
        [],
    ),
]


@pytest.mark.parametrize(("answer", "content", "calls"), BARE_HERMES)
def test_hermes_reads_a_call_that_opens_the_answer_bare_or_fenced(answer, content, calls):
    for sizes in random_splits(len(answer)):
        assert run(HermesToolParser(), answer, sizes) == (content, calls), sizes
    # Mistral's syntax has its marker: a bare object there is content.
    if calls:
        assert MistralToolParser().parse(answer)[1] == []
