"""Bad input through the ingress: the conformance tests written for `kvserve serve` (those that
do not depend on its small test configuration), run unchanged against the ingress."""

from __future__ import annotations

import httpx
import pytest

from tests.e2e.test_bad_input import (  # noqa: F401  (collected here, run on the ingress)
    AUTH,
    test_body_that_is_not_an_object,
    test_completion_fields_refused_by_name,
    test_huge_max_tokens,
    test_malformed_json,
    test_missing_messages,
    test_no_422_anywhere,
    test_non_positive_max_tokens,
    test_sampling_parameter_out_of_range,
    test_unknown_model,
    test_unknown_route_and_wrong_method_have_openai_bodies,
    test_wrong_types_name_the_field,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def client(cluster):
    with httpx.Client(base_url=cluster.url, headers=AUTH, timeout=60) as client:
        yield client


@pytest.fixture(autouse=True)
def still_serving(client):
    """After every bad request, a good one is still answered."""
    yield
    reply = client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 1})
    assert reply.status_code == 200, reply.text


def test_a_body_past_the_limit_is_413_at_the_ingress(client):
    response = client.post(
        "/v1/completions",
        content=iter([b'{"prompt": "', b"x" * (9 * 1024 * 1024), b'"}']),  # chunked, no length
    )
    assert response.status_code == 413
    assert response.json()["error"]["code"] == "request_too_large"
