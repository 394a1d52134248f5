"""response_format and structured_outputs → one StructuredOutput, or a 400 naming the field;
and parsing a request needs neither torch nor the C kernels."""

from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest

from kvserve.server.protocol import APIError
from kvserve.server.structured import from_response_format, from_structured_outputs, structured

SCHEMA = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}


def test_response_format_kinds():
    assert from_response_format({"type": "text"}) is None
    assert from_response_format({"type": "json_object"}).kind == "json_object"
    constraint = from_response_format(
        {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": False}}
    )
    assert constraint.kind == "json"
    assert json.loads(constraint.spec) == SCHEMA
    assert list(json.loads(constraint.spec)["properties"]) == ["b", "a"]  # order kept
    assert constraint.param == "response_format.json_schema.schema"


def test_structured_outputs_kinds():
    assert from_structured_outputs({"json": json.dumps(SCHEMA)}).kind == "json"
    assert from_structured_outputs({"regex": "a+"}).spec == "a+"
    assert json.loads(from_structured_outputs({"choice": ["x", "y"]}).spec) == ["x", "y"]
    assert from_structured_outputs({"grammar": 'start: "a"'}).kind == "grammar"
    assert from_structured_outputs({"json_object": True}).kind == "json_object"
    # vLLM's tuning options are accepted
    assert from_structured_outputs({"regex": "a", "disable_any_whitespace": True}).kind == "regex"


@pytest.mark.parametrize(
    ("response_format", "structured_outputs", "param"),
    [
        ({"type": "xml"}, None, "response_format.type"),
        ("json", None, "response_format"),
        ({"type": "json_schema", "json_schema": "x"}, None, "response_format.json_schema"),
        (
            {"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}},
            None,
            "response_format.json_schema.schema",
        ),
        (None, {}, "structured_outputs"),
        (None, {"regex": "a", "choice": ["a"]}, "structured_outputs"),
        (None, {"regex": ""}, "structured_outputs.regex"),
        (None, {"choice": "a"}, "structured_outputs.choice"),
        (None, {"choice": ["a", 1]}, "structured_outputs.choice"),
        (None, {"json": "{not json"}, "structured_outputs.json"),
        (None, {"structural_tag": "x"}, "structured_outputs.structural_tag"),
        ({"type": "json_object"}, {"regex": "a"}, "structured_outputs"),
    ],
)
def test_bad_fields_are_400_naming_the_field(response_format, structured_outputs, param):
    body = SimpleNamespace(response_format=response_format, structured_outputs=structured_outputs)
    with pytest.raises(APIError) as caught:
        structured(body)
    assert caught.value.status == 400
    assert caught.value.param == param


def test_parsing_a_request_imports_neither_torch_nor_kernels():
    code = (
        "import sys\n"
        "from kvserve.server.dialects.openai import ChatCompletionRequest, sampling_params\n"
        "from kvserve.server.protocol import parse_request\n"
        "from kvserve.server.structured import structured\n"
        "from kvserve.server.tools import plan_tools\n"
        'body = parse_request(ChatCompletionRequest, b\'{"messages": [], '
        '"response_format": {"type": "json_object"}}\')\n'
        "sampling_params(body, 100, structured(body))\n"
        "plan_tools([{'type': 'function', 'function': {'name': 'f'}}], 'required')\n"
        "bad = [m for m in ('torch', 'kvserve.model.kernels', 'llguidance') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
