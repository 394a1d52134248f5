"""The load generator measured against a scripted OpenAI-style streaming server on loopback.

The server below streams chat/completion chunks with known delays, counts, usage and failures,
and records what it saw (requests in flight, disconnects, request bodies), so every check compares
the client's records with the server's own account or with the metric definitions.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from kvserve.bench import loadgen
from kvserve.bench.loadgen import (
    STREAM_ERROR,
    TRANSPORT_ERROR,
    BenchConfig,
    BenchResult,
    arrival_offsets,
    build_prompts,
    cancel_indices,
    format_report,
    format_table,
    run_benchmark,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
CHAT_TEMPLATE_TOKENS = 7  # what the scripted server adds to a chat prompt's word count


@dataclass
class Scenario:
    """How the scripted server answers, and what it observed."""

    first_delay: float = 0.05  # before the first content chunk
    gap: float = 0.02  # between content chunks
    tokens_per_chunk: int = 1
    send_usage: bool = True  # honour stream_options.include_usage
    reject_every: int | None = None  # arrivals with index % n == n - 1 get reject_status
    reject_status: int = 429
    error_every: int | None = None  # arrivals with index % n == 0 get an error event...
    error_after: int = 2  # ...after this many content chunks
    truncate_after: int | None = None  # end the stream after this many chunks, no finish
    gate: int | None = None  # the first `gate` streams wait until `gate` streams are open
    # observed
    num_requests: int = 0
    num_rejected: int = 0
    num_finished: int = 0
    num_disconnects: int = 0
    in_flight: int = 0
    max_in_flight: int = 0
    bodies: list[dict[str, Any]] = field(default_factory=list)
    prompt_tokens: list[int] = field(default_factory=list)


def make_app(scenarios: dict[str, Scenario]) -> FastAPI:
    app = FastAPI()

    @app.get("/{name}/v1/models")
    async def models(name: str) -> dict[str, Any]:
        return {
            "object": "list",
            "data": [{"id": f"model-{name}", "object": "model", "owned_by": "test"}],
        }

    @app.post("/{name}/v1/chat/completions")
    async def chat(name: str, request: Request):
        return answer(scenarios[name], await request.json(), chat=True)

    @app.post("/{name}/v1/completions")
    async def completions(name: str, request: Request):
        return answer(scenarios[name], await request.json(), chat=False)

    return app


def answer(scenario: Scenario, body: dict[str, Any], *, chat: bool):
    arrival = scenario.num_requests
    scenario.num_requests += 1
    scenario.bodies.append(body)
    every = scenario.reject_every
    if every is not None and arrival % every == every - 1:
        scenario.num_rejected += 1
        return JSONResponse(
            {"error": {"message": "overloaded", "type": "rate_limit_error", "code": None}},
            status_code=scenario.reject_status,
            headers={"Retry-After": "30"},
        )
    text = body["messages"][0]["content"] if chat else body["prompt"]
    prompt_tokens = len(text.split()) + (CHAT_TEMPLATE_TOKENS if chat else 0)
    scenario.prompt_tokens.append(prompt_tokens)
    num_chunks = math.ceil(body["max_tokens"] / scenario.tokens_per_chunk)
    fail = scenario.error_every is not None and arrival % scenario.error_every == 0
    include_usage = bool(body.get("stream_options", {}).get("include_usage"))
    hold = scenario.gate is not None and arrival < scenario.gate
    return StreamingResponse(
        stream(scenario, chat, num_chunks, prompt_tokens, include_usage, fail, hold),
        media_type="text/event-stream",
    )


def event(payload: dict[str, Any] | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


def envelope(chat: bool, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    kind = "chat.completion.chunk" if chat else "text_completion"
    return {"id": "cmpl-1", "object": kind, "created": 0, "model": "m", "choices": choices, **extra}


def chunk(chat: bool, text: str, finish_reason: str | None = None) -> dict[str, Any]:
    if chat:
        choice = {"index": 0, "delta": {"content": text}, "finish_reason": finish_reason}
    else:
        choice = {"index": 0, "text": text, "finish_reason": finish_reason}
    return envelope(chat, [choice])


async def stream(scenario, chat, num_chunks, prompt_tokens, include_usage, fail, hold):
    scenario.in_flight += 1
    scenario.max_in_flight = max(scenario.max_in_flight, scenario.in_flight)
    finished = False
    try:
        if chat:
            # Like real servers: a role-only first delta, which carries no text.
            role = {
                "index": 0,
                "delta": {"role": "assistant", "content": ""},
                "finish_reason": None,
            }
            yield event(envelope(chat, [role]))
        yield ": keep-alive\n\n"
        if hold:
            deadline = time.monotonic() + 10.0  # liveness only; the check is max_in_flight
            while scenario.in_flight < scenario.gate and time.monotonic() < deadline:
                await asyncio.sleep(0.002)
        await asyncio.sleep(scenario.first_delay)
        for position in range(num_chunks):
            if position:
                await asyncio.sleep(scenario.gap)
            if fail and position == scenario.error_after:
                error = {"message": "engine failed", "type": "server_error", "code": 500}
                yield event({"error": error})
                yield event("[DONE]")
                finished = True
                return
            if scenario.truncate_after is not None and position == scenario.truncate_after:
                finished = True
                return
            yield event(chunk(chat, f" w{position}"))
        yield event(chunk(chat, "", finish_reason="length"))
        if include_usage and scenario.send_usage:
            completion_tokens = num_chunks * scenario.tokens_per_chunk
            usage = {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
            }
            yield event(envelope(chat, [], usage=usage))
        yield event("[DONE]")
        finished = True
    finally:
        scenario.in_flight -= 1
        if finished:
            scenario.num_finished += 1
        else:
            scenario.num_disconnects += 1


@dataclass
class ScriptedServer:
    base_url: str
    scenarios: dict[str, Scenario]

    def add(self, **settings: Any) -> tuple[str, Scenario]:
        """A fresh scenario and the base URL that reaches it."""
        name = uuid.uuid4().hex[:8]
        scenario = Scenario(**settings)
        self.scenarios[name] = scenario
        return f"{self.base_url}/{name}", scenario


@pytest.fixture(scope="module")
def server() -> Iterator[ScriptedServer]:
    scenarios: dict[str, Scenario] = {}
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(
        make_app(scenarios), log_level="warning", lifespan="off", timeout_graceful_shutdown=2
    )
    uvicorn_server = uvicorn.Server(config)
    thread = threading.Thread(target=uvicorn_server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        wait_for(lambda: uvicorn_server.started)
        yield ScriptedServer(f"http://127.0.0.1:{port}", scenarios)
    finally:
        uvicorn_server.should_exit = True
        thread.join(timeout=10)
        sock.close()


def wait_for(predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached")
        time.sleep(0.01)


def bench(url: str, **settings: Any) -> BenchResult:
    settings.setdefault("input_len", 16)
    return asyncio.run(run_benchmark(BenchConfig(url=url, **settings)))


def assert_record_relations(result: BenchResult) -> None:
    """What must hold for every completed request, whatever the timings were."""
    for record in result.records:
        assert record.start <= record.end
        if record.outcome != "completed":
            continue
        assert record.ttft is not None
        assert 0 <= record.ttft <= record.e2e
        assert len(record.itls) == record.num_chunks - 1
        assert all(gap >= 0 for gap in record.itls)
        # The first chunk plus every gap cannot exceed the request's whole time.
        assert record.ttft + sum(record.itls) <= record.e2e
        if record.output_tokens > 1:
            expected = (record.e2e - record.ttft) / (record.output_tokens - 1)
            assert record.tpot == pytest.approx(expected)
        else:
            assert record.tpot is None


# ---------------------------------------------------------------- workload


@pytest.fixture(scope="module")
def smollm2_tokenizer(hf_tokenizer):
    return hf_tokenizer


def test_prompts_are_about_input_len_tokens_for_a_bpe_tokenizer(smollm2_tokenizer) -> None:
    for input_len in (1, 37, 256):
        prompts = build_prompts(6, input_len, seed=3)
        for prompt in prompts:
            num_tokens = len(smollm2_tokenizer(prompt, add_special_tokens=False)["input_ids"])
            assert abs(num_tokens - input_len) <= max(1, input_len // 20)
        if input_len > 1:
            assert len(set(prompts)) == len(prompts)


def test_workload_is_seeded() -> None:
    assert build_prompts(4, 50, seed=1) == build_prompts(4, 50, seed=1)
    assert build_prompts(4, 50, seed=1) != build_prompts(4, 50, seed=2)
    assert arrival_offsets(5, math.inf, seed=0) == [0.0] * 5
    offsets = arrival_offsets(200, 10.0, seed=4)
    assert offsets == arrival_offsets(200, 10.0, seed=4)
    assert offsets != arrival_offsets(200, 10.0, seed=5)
    assert offsets[0] == 0.0
    assert all(later > earlier for earlier, later in zip(offsets, offsets[1:], strict=False))
    assert len(cancel_indices(10, 0.3, seed=0)) == 3
    assert cancel_indices(10, 0.3, seed=0) == cancel_indices(10, 0.3, seed=0)
    assert cancel_indices(10, 0.0, seed=0) == frozenset()
    assert cancel_indices(10, 1.0, seed=0) == frozenset(range(10))


def test_config_rejects_impossible_settings() -> None:
    for settings in (
        {"concurrency": 0},
        {"num_prompts": 0},
        {"request_rate": 0.0},
        {"cancel_rate": 1.5},
        {"endpoint": "embeddings"},
        {"url": "127.0.0.1:8000"},
        {"url": "http://[::1"},
    ):
        with pytest.raises(ValueError):
            BenchConfig(**settings)


def test_endpoint_url_accepts_a_base_with_or_without_v1() -> None:
    for url in ("http://h:1", "http://h:1/", "http://h:1/v1", "http://h:1/v1/"):
        assert BenchConfig(url=url).endpoint_url == "http://h:1/v1/chat/completions"
        assert BenchConfig(url=url, endpoint="completions").endpoint_url == (
            "http://h:1/v1/completions"
        )


# ---------------------------------------------------------------- measurements


def test_streamed_requests_follow_the_metric_definitions(server: ScriptedServer) -> None:
    url, scenario = server.add()
    result = bench(url, concurrency=4, num_prompts=8, output_len=6)

    assert (result.num_completed, result.num_failed, result.num_cancelled) == (8, 0, 0)
    assert result.failures == {}
    assert scenario.num_requests == 8
    assert [r.index for r in result.records] == list(range(8))
    assert_record_relations(result)
    for record in result.records:
        # The role-only first delta and the empty finish chunk carry no text.
        assert record.num_chunks == 6
        assert record.output_tokens == 6
        assert len(record.itls) == 5
        assert record.scheduled == 0.0
    # Prompt sizes come from the server's usage, not from the client's word count.
    assert sorted(r.prompt_tokens for r in result.records) == sorted(scenario.prompt_tokens)
    assert result.total_input_tokens == sum(scenario.prompt_tokens)
    assert result.total_output_tokens == 48

    for body in scenario.bodies:
        assert body["model"] == f"model-{url.rsplit('/', 1)[1]}"  # found at /v1/models
        assert body["max_tokens"] == 6
        assert body["stream"] is True
        assert body["stream_options"] == {"include_usage": True}
        assert body["temperature"] == 0
        assert "ignore_eos" not in body
        assert len(body["messages"][0]["content"].split()) == 16
    assert len({body["messages"][0]["content"] for body in scenario.bodies}) == 8

    records = result.records
    assert result.duration == pytest.approx(
        max(r.end for r in records) - min(r.start for r in records)
    )
    assert result.request_throughput == pytest.approx(8 / result.duration)
    assert result.output_throughput == pytest.approx(48 / result.duration)
    assert result.total_token_throughput == pytest.approx(
        (sum(scenario.prompt_tokens) + 48) / result.duration
    )
    ttfts = [r.ttft for r in records]
    assert result.ttft.count == 8
    assert result.ttft.mean == pytest.approx(statistics.fmean(ttfts))
    assert result.ttft.median == pytest.approx(statistics.median(ttfts))
    assert result.ttft.std == pytest.approx(statistics.pstdev(ttfts))
    assert result.ttft.median <= result.ttft.p99 <= max(ttfts)
    gaps = [gap for r in records for gap in r.itls]
    assert result.itl.count == len(gaps) == 40
    assert result.itl.mean == pytest.approx(statistics.fmean(gaps))
    assert result.tpot.mean == pytest.approx(statistics.fmean(r.tpot for r in records))
    assert result.e2e.mean == pytest.approx(statistics.fmean(r.e2e for r in records))
    assert scenario.max_in_flight <= 4


def test_output_tokens_come_from_usage_when_chunks_carry_several(server: ScriptedServer) -> None:
    url, scenario = server.add(tokens_per_chunk=2)
    result = bench(url, model="m", concurrency=2, num_prompts=3, output_len=8)

    assert result.num_completed == 3
    assert_record_relations(result)
    for record in result.records:
        assert record.num_chunks == 4
        assert len(record.itls) == 3
        assert record.output_tokens == 8
        assert record.tpot == pytest.approx((record.e2e - record.ttft) / 7)
    assert result.total_output_tokens == 24


def test_without_usage_output_tokens_are_counted_chunks(server: ScriptedServer) -> None:
    url, _ = server.add(tokens_per_chunk=2, send_usage=False)
    result = bench(url, model="m", concurrency=3, num_prompts=3, output_len=8)

    assert result.num_completed == 3
    assert_record_relations(result)
    for record in result.records:
        assert record.output_tokens == record.num_chunks == 4
        assert record.prompt_tokens is None
    # Without the server's prompt counts there is no honest total.
    assert result.total_input_tokens is None
    assert result.total_token_throughput is None


def test_completions_endpoint_and_ignore_eos(server: ScriptedServer) -> None:
    url, scenario = server.add()
    result = bench(
        url + "/v1", model="m", endpoint="completions", ignore_eos=True, num_prompts=2, output_len=3
    )

    assert result.num_completed == 2
    assert_record_relations(result)
    assert all(record.num_chunks == 3 for record in result.records)
    for body in scenario.bodies:
        assert body["ignore_eos"] is True
        assert len(body["prompt"].split()) == 16
        assert "messages" not in body
    assert sorted(r.prompt_tokens for r in result.records) == sorted(scenario.prompt_tokens)


@pytest.mark.parametrize("status", [429, 503])
def test_refused_requests_are_failures_with_their_status(
    server: ScriptedServer, status: int
) -> None:
    url, scenario = server.add(reject_every=2, reject_status=status)
    result = bench(url, model="m", concurrency=2, num_prompts=6, output_len=3)

    assert scenario.num_rejected == 3
    assert result.num_failed == 3
    assert result.num_completed == 3
    assert result.failures == {str(status): 3}
    assert result.num_rate_limited == (3 if status == 429 else 0)
    failed = [r for r in result.records if r.outcome == "failed"]
    assert all(r.status == status and "rate_limit_error" in r.error for r in failed)
    # Latency figures describe completed requests only.
    assert result.ttft.count == result.e2e.count == 3
    assert result.total_output_tokens == 9
    assert f"{status}: 3" in format_report(result)
    assert f"3 ({status}: 3)" in format_table([result])


def test_error_event_inside_a_stream_is_a_failure(server: ScriptedServer) -> None:
    url, scenario = server.add(error_every=2, error_after=2)
    result = bench(url, model="m", concurrency=4, num_prompts=4, output_len=5)

    assert scenario.num_requests == 4
    assert result.num_failed == 2
    assert result.failures == {STREAM_ERROR: 2}
    assert result.num_completed == 2
    failed = [r for r in result.records if r.outcome == "failed"]
    assert all(r.status == 200 and "engine failed" in r.error for r in failed)
    assert all(r.num_chunks == 2 for r in failed)
    assert result.ttft.count == 2
    assert result.total_output_tokens == 10


def test_stream_cut_short_is_a_failure(server: ScriptedServer) -> None:
    url, _ = server.add(truncate_after=2)
    result = bench(url, model="m", num_prompts=2, output_len=5)
    assert result.num_failed == 2
    assert result.failures == {TRANSPORT_ERROR: 2}
    assert result.ttft is None and result.itl is None
    assert result.output_throughput == 0


def test_unreachable_server_fails_every_request_without_crashing() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    # Nothing listens on the port now.
    url = f"http://127.0.0.1:{port}"
    result = bench(url, model="m", concurrency=2, num_prompts=3, output_len=2)
    assert result.num_failed == 3
    assert result.failures == {TRANSPORT_ERROR: 3}
    assert all(r.status is None for r in result.records)
    assert result.request_throughput == 0
    with pytest.raises(ValueError, match="--model"):
        bench(url, num_prompts=1)


def test_cancelled_requests_close_their_streams(server: ScriptedServer) -> None:
    url, scenario = server.add(gap=0.01)
    result = bench(
        url,
        model="m",
        concurrency=6,
        num_prompts=6,
        output_len=100,
        cancel_rate=0.5,
        cancel_after=3,
        seed=7,
    )

    cancelled = [r for r in result.records if r.outcome == "cancelled"]
    assert {r.index for r in cancelled} == cancel_indices(6, 0.5, seed=7)
    assert result.num_cancelled == 3
    assert result.num_completed == 3
    assert result.num_failed == 0
    assert all(r.num_chunks == 3 and r.error is None for r in cancelled)
    # The server saw those clients go before their streams ended.
    wait_for(lambda: scenario.num_disconnects + scenario.num_finished == 6)
    assert scenario.num_disconnects == 3
    assert scenario.num_finished == 3
    # Cancelled requests are left out of latency and throughput.
    assert result.ttft.count == result.tpot.count == 3
    assert result.itl.count == 3 * 99
    assert result.total_output_tokens == 300


def test_concurrency_cap_is_reached_and_never_exceeded(server: ScriptedServer) -> None:
    # The server holds the first three streams until three are open, so a client that sends fewer
    # at a time shows max_in_flight < 3 and one that sends more shows > 3.
    url, scenario = server.add(gate=3, first_delay=0.0, gap=0.0)
    result = bench(url, model="m", concurrency=3, num_prompts=9, output_len=2)

    assert result.num_completed == 9
    assert scenario.max_in_flight == 3


def test_poisson_arrivals_issue_every_request_no_earlier_than_planned(
    server: ScriptedServer,
) -> None:
    url, scenario = server.add(first_delay=0.0, gap=0.0)
    result = bench(url, model="m", concurrency=10, num_prompts=10, output_len=2, request_rate=50.0)

    assert scenario.num_requests == 10
    assert result.num_completed == 10
    planned = arrival_offsets(10, 50.0, seed=0)
    assert [r.scheduled for r in result.records] == planned
    assert all(r.start >= r.scheduled for r in result.records)
    starts = [r.start for r in result.records]
    assert starts == sorted(starts)
    assert "@ 50 req/s" in format_table([result])


def test_warmup_requests_are_sent_but_not_measured(server: ScriptedServer) -> None:
    url, scenario = server.add(first_delay=0.0, gap=0.0)
    result = bench(url, model="m", num_prompts=3, output_len=2, warmup=2)

    assert scenario.num_requests == 5
    assert len(result.records) == 3
    warm = {body["messages"][0]["content"] for body in scenario.bodies[:2]}
    measured = {body["messages"][0]["content"] for body in scenario.bodies[2:]}
    assert not warm & measured
    # Measured prompts do not depend on how many warmup requests ran before them.
    assert measured == set(build_prompts(5, 16, seed=0)[2:])


def test_given_prompts_are_sent_in_order_and_repeated(server: ScriptedServer) -> None:
    url, scenario = server.add(first_delay=0.0, gap=0.0)
    questions = ("What is a heap?", "What is a trie?")
    result = bench(url, model="m", num_prompts=4, output_len=2, warmup=1, prompts=questions)

    assert result.num_completed == 4
    sent = [body["messages"][0]["content"] for body in scenario.bodies]
    assert sorted(sent) == sorted([*questions, *questions, questions[0]])
    # The warmup takes the first; the measured ones go on from there.
    assert sent[0] == questions[0]
    with pytest.raises(ValueError, match="prompts"):
        BenchConfig(prompts=())


# ---------------------------------------------------------------- reporting and CLI


def test_format_table_has_one_row_per_result(server: ScriptedServer) -> None:
    url, _ = server.add(first_delay=0.0, gap=0.0)
    results = [bench(url, model="m", concurrency=c, num_prompts=2, output_len=2) for c in (1, 2)]
    lines = format_table(results).splitlines()
    assert len(lines) == 2 + len(results)
    for line, result in zip(lines[2:], results, strict=True):
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        assert len(cells) == 12
        assert cells[0] == str(result.config.concurrency)
        assert cells[1] == "2"
        assert cells[-1] == "0"
    assert all(line.count("|") == 13 for line in lines)


def test_cli_runs_end_to_end_and_writes_json(server: ScriptedServer, tmp_path: Path) -> None:
    url, scenario = server.add(first_delay=0.0, gap=0.005)
    out = tmp_path / "result.json"
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), OPENAI_API_KEY="")
    completed = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvserve",
            "bench",
            "--url",
            url,
            "--concurrency",
            "2",
            "--num-prompts",
            "4",
            "--input-len",
            "12",
            "--output-len",
            "3",
            "--json",
            str(out),
        ],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert completed.returncode == 0, completed.stderr
    assert "Successful requests:" in completed.stdout
    assert scenario.num_requests == 4

    data = json.loads(out.read_text())
    assert data["config"]["num_prompts"] == 4
    assert data["config"]["request_rate"] == "inf"
    assert data["config"]["model"] == f"model-{url.rsplit('/', 1)[1]}"
    assert data["metrics"]["completed"] == 4
    assert data["metrics"]["total_output_tokens"] == 12
    assert data["metrics"]["num_itl_samples"] == 8
    assert len(data["records"]) == 4
    for record in data["records"]:
        assert record["outcome"] == "completed"
        assert record["status"] == 200
        assert len(record["itls_ms"]) == 2
        assert record["ttft_ms"] <= record["e2e_ms"]


def test_cli_exit_code_when_nothing_completes(server: ScriptedServer, capsys) -> None:
    import argparse

    url, _ = server.add(reject_every=1)
    parser = argparse.ArgumentParser()
    loadgen.add_arguments(parser)
    args = parser.parse_args(["--url", url, "--model", "m", "--num-prompts", "2"])
    assert loadgen.run(args) == 1
    assert "429: 2" in capsys.readouterr().out
    assert loadgen.run(parser.parse_args(["--url", url, "--concurrency", "0"])) == 2


def test_scripted_server_speaks_what_the_openai_client_parses(server: ScriptedServer) -> None:
    import openai

    url, _ = server.add(first_delay=0.0, gap=0.0)
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    try:
        chunks = list(
            client.chat.completions.create(
                model="m",
                messages=[{"role": "user", "content": "one two three"}],
                max_tokens=3,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        texts = client.completions.create(model="m", prompt="one two", max_tokens=2, stream=True)
        completion_text = "".join(c.choices[0].text for c in texts if c.choices)
    finally:
        client.close()
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == " w0 w1 w2"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == 3
    assert chunks[-1].usage.prompt_tokens == 3 + CHAT_TEMPLATE_TOKENS
    assert completion_text == " w0 w1"


def test_importing_the_load_generator_does_not_import_torch() -> None:
    code = "import sys, kvserve.bench.loadgen; sys.exit('torch' in sys.modules)"
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    assert subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env=env).returncode == 0


def test_a_run_without_output_len_sends_no_max_tokens() -> None:
    from kvserve.bench.loadgen import BenchConfig, request_body

    body = request_body(BenchConfig(output_len=None), "m", "hello")
    assert "max_tokens" not in body and body["messages"][0]["content"] == "hello"
    assert request_body(BenchConfig(output_len=7), "m", "hello")["max_tokens"] == 7


def test_sampled_runs_give_each_request_its_own_repeatable_seed() -> None:
    from kvserve.bench.loadgen import BenchConfig, request_body

    greedy = request_body(BenchConfig(), "m", "hello", 3)
    assert greedy["temperature"] == 0.0 and "seed" not in greedy
    sampled = BenchConfig(temperature=0.7, seed=2)
    seeds = [request_body(sampled, "m", "hello", i)["seed"] for i in range(4)]
    assert len(set(seeds)) == 4
    assert seeds == [request_body(sampled, "m", "hello", i)["seed"] for i in range(4)]
    assert request_body(sampled, "m", "hello", 0)["temperature"] == 0.7
    assert request_body(BenchConfig(temperature=0.7, seed=3), "m", "hello", 0)["seed"] != seeds[0]
