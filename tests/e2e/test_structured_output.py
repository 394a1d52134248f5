"""Structured output and tool calling through the official openai client on the default model.

Every answer is checked against its own schema or language: the constraint is what makes a
135M model's output parse, so a failure here is the grammar not being enforced.
"""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from enum import StrEnum
from typing import Annotated, Literal

import httpx
import openai
import pytest
from pydantic import BaseModel, Field

from kvserve.config import ServerConfig
from tests.e2e.conftest import small_engine_config

pytestmark = pytest.mark.slow

MAX_TOKENS = 300


@pytest.fixture(scope="module")
def server(server_factory):
    server = server_factory(small_engine_config(max_num_seqs=8, num_kv_blocks=256), ServerConfig())
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(
        base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=600
    ) as client:
        yield client


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


# --------------------------------------------------------------------------------------------
# 15 schemas for chat.completions.parse()

Short = Annotated[str, Field(max_length=24)]


class Colour(StrEnum):
    red = "red"
    green = "green"
    blue = "blue"


class City(BaseModel):
    name: Short
    country: Short


class Person(BaseModel):
    name: Short
    age: Annotated[int, Field(ge=0, le=120)]


class Address(BaseModel):
    street: Short
    city: City


class PersonWithAddress(BaseModel):
    person: Person
    address: Address


class Tags(BaseModel):
    tags: Annotated[list[Short], Field(min_length=2, max_length=4)]


class Scores(BaseModel):
    scores: Annotated[list[Annotated[int, Field(ge=1, le=10)]], Field(min_length=1, max_length=3)]


class Favourite(BaseModel):
    colour: Colour


class Status(BaseModel):
    status: Literal["open", "closed", "pending"]
    priority: Literal[1, 2, 3]


class OptionalFields(BaseModel):
    title: Short
    subtitle: Short | None = None
    pages: int | None = None


class Cat(BaseModel):
    kind: Literal["cat"]
    lives: Annotated[int, Field(ge=1, le=9)]


class Dog(BaseModel):
    kind: Literal["dog"]
    good: bool


class Pet(BaseModel):
    pet: Cat | Dog


class Measurement(BaseModel):
    celsius: Annotated[float, Field(ge=-50, le=60)]
    humidity: Annotated[float, Field(ge=0, le=1)]


class Code(BaseModel):
    zip_code: Annotated[str, Field(pattern=r"^[0-9]{5}$")]
    country_code: Annotated[str, Field(pattern=r"^[A-Z]{2}$")]


class Version(BaseModel):
    version: Annotated[str, Field(pattern=r"^[0-9]+\.[0-9]+\.[0-9]+$")]
    stable: bool


class Team(BaseModel):
    name: Short
    members: Annotated[list[Person], Field(min_length=1, max_length=2)]


class Inventory(BaseModel):
    items: Annotated[list[City | Person], Field(min_length=1, max_length=2)]
    total: Annotated[int, Field(ge=0, le=1000)]


class Event(BaseModel):
    name: Short
    day: Annotated[int, Field(ge=1, le=31)]
    colour: Colour | None
    tags: Annotated[list[Literal["a", "b", "c"]], Field(max_length=3)]


SCHEMAS = [
    (Person, "Describe a person."),
    (PersonWithAddress, "Describe a person and where they live."),
    (Tags, "Give some tags for a blog post about the sea."),
    (Scores, "Rate three films."),
    (Favourite, "What is your favourite colour?"),
    (Status, "What is the status of the ticket?"),
    (OptionalFields, "Describe a book."),
    (Pet, "Describe a pet."),
    (Measurement, "What is the weather like?"),
    (Code, "Give an address code."),
    (Version, "What version is the software?"),
    (Team, "Describe a small team."),
    (Inventory, "List what is in the warehouse."),
    (Event, "Describe an event."),
    (City, "Name a city."),
]


def test_parse_returns_a_valid_object_for_every_schema(client, model):
    assert len(SCHEMAS) >= 15

    def parse(entry):
        schema, question = entry
        completion = client.chat.completions.parse(
            model=model,
            messages=[{"role": "user", "content": question}],
            response_format=schema,
            max_tokens=MAX_TOKENS,
            temperature=0,
        )
        choice = completion.choices[0]
        return schema, choice

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(parse, SCHEMAS))
    for schema, choice in results:
        assert choice.finish_reason == "stop", (schema.__name__, choice.message.content)
        parsed = choice.message.parsed
        assert isinstance(parsed, schema), (schema.__name__, choice.message.content)
        # parse() validated it; validate the raw text once more, strictly, against the schema.
        assert schema.model_validate_json(choice.message.content) == parsed


# --------------------------------------------------------------------------------------------
# regex, choice, grammar: only strings of the language

REGEX = r"[a-z]{2,6}-[0-9]{2,3}"
CHOICES = ["red", "green", "blue", "light yellow"]
GRAMMAR = (
    'start: greeting " " name "!"\ngreeting: "hello" | "hi" | "good day"\nname: /[A-Z][a-z]{1,8}/\n'
)
GRAMMAR_LANGUAGE = r"(hello|hi|good day) [A-Z][a-z]{1,8}!"


@pytest.mark.parametrize(
    ("structured_outputs", "language"),
    [
        ({"regex": REGEX}, REGEX),
        ({"choice": CHOICES}, "|".join(map(re.escape, CHOICES))),
        ({"grammar": GRAMMAR}, GRAMMAR_LANGUAGE),
    ],
    ids=["regex", "choice", "grammar"],
)
def test_twenty_seeded_samples_are_in_the_language(client, model, structured_outputs, language):
    def sample(seed):
        completion = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "Say something."}],
            temperature=1.0,
            seed=seed,
            max_tokens=40,
            extra_body={"structured_outputs": structured_outputs},
        )
        return completion.choices[0]

    with ThreadPoolExecutor(8) as pool:
        choices = list(pool.map(sample, range(20)))
    texts = [choice.message.content for choice in choices]
    for choice, text in zip(choices, texts, strict=True):
        assert choice.finish_reason == "stop", text
        assert re.fullmatch(language, text), text
    assert len(set(texts)) > 1  # temperature 1.0 with different seeds explores the language


def test_json_object_mode_gives_a_json_object_with_bounded_whitespace(client, model):
    completion = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Describe a dog in JSON."}],
        response_format={"type": "json_object"},
        max_tokens=60,
        temperature=0,
    )
    text = completion.choices[0].message.content
    assert text.startswith("{")
    # Whitespace between JSON tokens is bounded (none at all): the model cannot loop on it.
    outside_strings = re.sub(r'"(?:[^"\\]|\\.)*"?', '""', text)
    assert not re.search(r"\s", outside_strings), text
    if completion.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    else:
        assert completion.choices[0].finish_reason == "length"


def test_constrained_answer_cut_by_max_tokens_ends_with_length(client, model):
    completion = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Describe a team."}],
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "team", "schema": Team.model_json_schema()},
        },
        max_tokens=5,
        temperature=0,
    )
    assert completion.choices[0].finish_reason == "length"
    assert completion.usage.completion_tokens == 5


def test_completions_endpoint_takes_structured_outputs(client, model):
    completion = client.completions.create(
        model=model,
        prompt="The answer is",
        max_tokens=10,
        temperature=0,
        extra_body={"structured_outputs": {"choice": ["yes", "no"]}},
    )
    assert completion.choices[0].text in ("yes", "no")


# --------------------------------------------------------------------------------------------
# Tools


class WeatherArgs(BaseModel):
    city: Short
    unit: Literal["celsius", "fahrenheit"]


class TimeArgs(BaseModel):
    timezone: Annotated[str, Field(pattern=r"^[A-Z][a-z]{1,12}/[A-Z][a-z]{1,12}$")]


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The current weather in a city.",
            "parameters": WeatherArgs.model_json_schema(),
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "The current time in a timezone.",
            "parameters": TimeArgs.model_json_schema(),
        },
    },
]
ARGS = {"get_weather": WeatherArgs, "get_time": TimeArgs}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def check_calls(calls, names=("get_weather", "get_time")):
    assert calls
    for call in calls:
        assert call.type == "function"
        assert call.id
        assert call.function.name in names
        ARGS[call.function.name].model_validate_json(call.function.arguments)


@pytest.mark.parametrize(
    "tool_choice",
    ["required", {"type": "function", "function": {"name": "get_time"}}],
    ids=["required", "named"],
)
def test_required_and_named_calls_validate(client, model, tool_choice):
    names = ("get_weather", "get_time") if tool_choice == "required" else ("get_time",)
    for seed in range(3):
        completion = client.chat.completions.create(
            model=model,
            messages=ASK,
            tools=TOOLS,
            tool_choice=tool_choice,
            # at temperature 1.0 a small model may list calls until max_tokens: one call each
            parallel_tool_calls=False,
            max_tokens=MAX_TOKENS,
            temperature=1.0,
            seed=seed,
        )
        choice = completion.choices[0]
        assert choice.finish_reason == ("tool_calls" if tool_choice == "required" else "stop")
        assert choice.message.content is None
        assert len(choice.message.tool_calls) == 1
        check_calls(choice.message.tool_calls, names)


@pytest.mark.parametrize(
    "tool_choice",
    ["required", {"type": "function", "function": {"name": "get_weather"}}],
    ids=["required", "named"],
)
def test_streamed_calls_accumulate_in_the_client_helper(client, model, tool_choice):
    with client.chat.completions.stream(
        model=model,
        messages=ASK,
        tools=TOOLS,
        tool_choice=tool_choice,
        max_tokens=MAX_TOKENS,
        temperature=0,
    ) as stream:
        for _ in stream:
            pass
        final = stream.get_final_completion()
    choice = final.choices[0]
    assert choice.finish_reason == ("tool_calls" if tool_choice == "required" else "stop")
    check_calls(choice.message.tool_calls)
    if tool_choice != "required":
        assert [c.function.name for c in choice.message.tool_calls] == ["get_weather"]


def test_a_full_tool_round_trip(client, model):
    first = client.chat.completions.create(
        model=model,
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=MAX_TOKENS,
        temperature=0,
    )
    call = first.choices[0].message.tool_calls[0]
    check_calls([call])
    history = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.function.name, "arguments": call.function.arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21, "sky": "clear"}'},
    ]
    final = client.chat.completions.create(
        model=model, messages=history, tools=TOOLS, tool_choice="none", max_tokens=40, temperature=0
    )
    choice = final.choices[0]
    assert choice.finish_reason in ("stop", "length")
    assert choice.message.content
    assert not choice.message.tool_calls


def test_auto_returns_content_or_parsed_calls(client, model):
    completion = client.chat.completions.create(
        model=model, messages=ASK, tools=TOOLS, tool_choice="auto", max_tokens=60, temperature=0
    )
    choice = completion.choices[0]
    if choice.message.tool_calls:
        assert choice.finish_reason == "tool_calls"
        for call in choice.message.tool_calls:
            json.loads(call.function.arguments)
    else:
        assert choice.finish_reason in ("stop", "length")
        assert (
            "<tool_call>" not in (choice.message.content or "") or choice.finish_reason == "length"
        )


# --------------------------------------------------------------------------------------------
# Bad input: 400 naming the field, and the server goes on serving

BAD = [
    (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "strin"}},
            }
        },
        "response_format.json_schema.schema",
    ),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs.regex"),
    ({"structured_outputs": {"grammar": "start: ((("}}, "structured_outputs.grammar"),
    ({"structured_outputs": {"regex": "a+", "choice": ["a"]}}, "structured_outputs"),
    (
        {"structured_outputs": {"regex": "a+"}, "response_format": {"type": "json_object"}},
        "structured_outputs",
    ),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"tools": []}, "tools"),
    (
        {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        "tool_choice",
    ),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    (
        {"tools": [{"type": "function", "function": {"name": "bad name!"}}]},
        "tools[0].function.name",
    ),
    (
        {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
        "tool_choice",
    ),
]


@pytest.mark.parametrize(("fields", "param"), BAD)
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_bad_input_is_400_naming_the_field(server, fields, param, stream):
    body = {"messages": ASK, "max_tokens": 5, "stream": stream, **fields}
    response = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    assert error["type"] == "invalid_request_error"
    # and the next request is served
    ok = httpx.post(
        server.url + "/v1/chat/completions",
        json={"messages": ASK, "max_tokens": 2, "structured_outputs": {"choice": ["yes", "no"]}},
        timeout=120,
    )
    assert ok.status_code == 200
    assert ok.json()["choices"][0]["message"]["content"] in ("yes", "no")
    server.call(lambda: None)
    assert server.state.engine.running
