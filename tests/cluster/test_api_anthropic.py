"""The official anthropic client through the ingress: Messages conformance tests written for
`kvserve serve`, run unchanged against the ingress."""

from __future__ import annotations

import anthropic
import pytest

from tests.e2e.test_anthropic_client import (  # noqa: F401  (collected here, run on the ingress)
    test_count_tokens_is_the_prompt_of_create,
    test_create_matches_chat_and_reports_usage,
    test_every_frame_names_its_event_in_order,
    test_max_tokens_is_the_stop_reason_when_the_budget_runs_out,
    test_stream_and_final_message_match_create,
    test_unknown_model_is_not_found,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(cluster):
    return cluster


@pytest.fixture(scope="module")
def client(cluster):
    with anthropic.Anthropic(base_url=cluster.url, api_key="unused", max_retries=0) as client:
        yield client


@pytest.fixture(scope="module")
def model(cluster):
    import httpx

    return httpx.get(cluster.url + "/v1/models").json()["data"][0]["id"]
