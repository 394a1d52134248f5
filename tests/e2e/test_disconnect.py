"""A client that leaves frees its slot and blocks within one step: mid-stream, mid-non-stream
and while queued. Logged as 499; never counted as a server error.

Steps are held at a gate, so "within one step" is exact: once the server has seen the client
go, the test lets one step run and the request must be gone after it. Every case runs in every
dialect (chat, Anthropic messages, Responses).
"""

from __future__ import annotations

import pytest

from tests.e2e.dialects import DIALECTS, Dialect

pytestmark = [pytest.mark.slow, pytest.mark.parametrize("dialect", DIALECTS, ids=str)]


def _long(dialect: Dialect, *, stream: bool = False, max_tokens: int = 200) -> dict:
    return dialect.request("Tell me a long story.", max_tokens, stream=stream)


@pytest.fixture(scope="module")
def server(server_factory, engine_config):
    server = server_factory(engine_config(max_num_seqs=1, max_queue_per_slot=2))
    yield server
    server.stop()


def _cancel_seen(server, request_id: str) -> bool:
    def check() -> bool:
        state = server.state.engine.get(request_id)
        return state is not None and state.cancel_reason is not None

    return server.call(check)


def _assert_freed_after_one_step(server, gate, request_id: str, until) -> None:
    engine = server.state.engine
    # Called while a step holding the request waits at the gate: the client's exit is seen
    # during that step, and must take effect at the boundary right after it.
    until(lambda: _cancel_seen(server, request_id), message="the server did not see the client go")
    num_plans = len(gate.plans)
    assert request_id in gate.plans[-1]
    gate.step()
    until(lambda: server.call(lambda: engine.get(request_id) is None), timeout=10)
    # The gate lets no further step run, so slot and blocks came back after that one step.
    assert server.call(engine.is_idle)
    assert all(request_id not in plan for plan in gate.plans[num_plans:])


def _assert_logged_499_without_5xx(
    server, dialect: Dialect, access_log, metrics, request_id: str | None
) -> None:
    lines = access_log.with_status(499)
    assert len(lines) == 1
    if request_id is not None:
        assert lines[0].startswith(request_id)
    samples = metrics(server)
    assert not any(name.startswith("kvserve:http_server_errors") for name in samples)
    assert samples[f'kvserve:http_requests_total{{endpoint="{dialect.path}",status="499"}}'] >= 1


def test_client_leaving_mid_stream(
    server, dialect, gate_factory, raw_client, access_log, metrics, until
):
    gate = gate_factory(server)
    client = raw_client(server.port)
    client.post(dialect.path, _long(dialect, stream=True))
    gate.step()  # prefill: the first token
    gate.step()
    status, headers = client.read_head()
    assert status == 200
    client.read_events(2)  # the opening event and content are out
    request_id = headers["x-request-id"]
    gate.wait_blocked()  # the next step, with this request in it, is held
    assert all(plan == (request_id,) for plan in gate.plans)
    client.close()
    _assert_freed_after_one_step(server, gate, request_id, until)
    until(lambda: access_log.line_for(request_id) is not None)
    _assert_logged_499_without_5xx(server, dialect, access_log, metrics, request_id)


def test_client_leaving_mid_non_stream(
    server, dialect, gate_factory, raw_client, access_log, metrics, until
):
    gate = gate_factory(server)
    client = raw_client(server.port)
    client.post(dialect.path, _long(dialect))
    gate.step()
    gate.step()
    gate.wait_blocked()
    request_id = gate.plans[0][0]
    assert all(plan == (request_id,) for plan in gate.plans)
    client.close()
    _assert_freed_after_one_step(server, gate, request_id, until)
    until(lambda: access_log.line_for(request_id) is not None)
    _assert_logged_499_without_5xx(server, dialect, access_log, metrics, request_id)


def test_client_leaving_while_queued(
    server, dialect, gate_factory, raw_client, access_log, metrics, until
):
    engine = server.state.engine
    gate = gate_factory(server)
    running = raw_client(server.port)
    running.post(dialect.path, _long(dialect, max_tokens=3))
    gate.wait_blocked()
    queued = raw_client(server.port)
    queued.post(dialect.path, _long(dialect, stream=True))
    until(lambda: server.call(lambda: engine.num_waiting) == 1)
    queued.close()
    # A queued request holds no slot: it leaves the queue at once, no step needed.
    until(lambda: server.call(lambda: engine.num_waiting) == 0, timeout=10)
    assert server.call(lambda: engine.num_requests) == 1
    until(lambda: access_log.with_status(499) != [])
    gate.open()
    status, _ = running.read_head()
    assert status == 200
    until(lambda: server.call(engine.is_idle))
    # The queued request never ran.
    assert {request_id for plan in gate.plans for request_id in plan} == {gate.plans[0][0]}
    _assert_logged_499_without_5xx(server, dialect, access_log, metrics, None)
