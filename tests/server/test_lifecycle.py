"""The lifecycle's rules without a model: the options' checks, which X-Request-Id is taken,
how signals move the server through its drain, what a drain refuses and how it is counted."""

from __future__ import annotations

import signal

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvserve.config import ServerConfig, parse_origins
from kvserve.server.app import Server, create_app
from kvserve.server.core import Exchange, ServerState
from kvserve.server.metrics import ServerMetrics
from kvserve.server.middleware import client_request_id
from kvserve.server.protocol import APIError


def test_the_shutdown_timeout_is_zero_or_more_seconds():
    assert ServerConfig().shutdown_timeout == 30
    assert ServerConfig(shutdown_timeout=0).shutdown_timeout == 0
    for bad in (-1.0, float("nan")):
        with pytest.raises(ValueError, match="--shutdown-timeout"):
            ServerConfig(shutdown_timeout=bad)


def test_allowed_origins_are_origins():
    assert parse_origins(None) == ()
    assert parse_origins(" https://a.example, http://localhost:5173 ,,") == (
        "https://a.example",
        "http://localhost:5173",
    )
    ServerConfig(allowed_origins=("https://a.example", "http://127.0.0.1:3000", "*"))
    for bad in ("https://a.example/", "a.example", "https://a.example/app", "null"):
        with pytest.raises(ValueError, match="is not an origin"):
            ServerConfig(allowed_origins=(bad,))


def test_any_origin_is_refused_with_an_api_key():
    ServerConfig(api_key="k", allowed_origins=("https://a.example",))
    with pytest.raises(ValueError, match="cannot be combined with --api-key"):
        ServerConfig(api_key="k", allowed_origins=("*",))


@pytest.mark.parametrize(
    ("value", "taken"),
    [
        (b"abc", "abc"),
        (b"req-1.2_3:4/5+6=7@8", "req-1.2_3:4/5+6=7@8"),
        (b"x" * 128, "x" * 128),
        (b"x" * 129, None),
        (b"", None),
        (b"two words", None),
        (b"tab\there", None),
        (b"nul\x00", None),
        (b"caf\xc3\xa9", None),
        (b"a;b", None),
        (b"<script>", None),
    ],
)
def test_which_request_ids_are_taken(value, taken):
    assert client_request_id([(b"content-type", b"text/plain"), (b"x-request-id", value)]) == taken


def test_only_the_first_request_id_counts():
    headers = [(b"x-request-id", b"bad id"), (b"x-request-id", b"good")]
    assert client_request_id(headers) is None
    assert client_request_id([]) is None


def test_the_access_line_names_the_clients_id_and_the_internal_one():
    exchange = Exchange("0123abcd", "POST", "/v1/completions", 0.0, client_id="mine")
    exchange.status = 200
    line = exchange.log_line(1.0)
    assert line.startswith("mine POST /v1/completions 200 ")
    assert line.endswith(" internal_id=0123abcd")
    plain = Exchange("0123abcd", "GET", "/health", 0.0)
    plain.status = 200
    assert plain.log_id == "0123abcd"
    assert plain.log_line(1.0).startswith("0123abcd GET") and "internal_id" not in plain.log_line(1)


def _state() -> ServerState:
    return ServerState(ServerConfig(), lambda observer: None)


def test_a_drain_refuses_waiting_requests_and_new_ones():
    state = _state()
    refused: list[str] = []

    def refuse(name: str, waiting: bool):
        def call() -> bool:
            if waiting:
                refused.append(name)
            return waiting

        return call

    with state.queued("a", refuse("a", True)), state.queued("b", refuse("b", False)):
        assert state.begin_drain() == 1
    assert refused == ["a"]
    assert state.draining and not state.ready
    with state.queued("c", refuse("c", True)):
        pass  # left the queue before any drain: nothing to refuse
    assert state.begin_drain() == 0
    exchange = Exchange("id", "POST", "/v1/completions", 0.0)
    with pytest.raises(APIError) as caught:
        state.refuse_if_draining(exchange)
    error = caught.value
    assert error.status == 503 and error.code == "shutting_down"
    assert error.headers == {"Retry-After": "1"}
    assert "the server is shutting down" in error.message
    assert exchange.shutting_down


def test_a_drains_503_is_a_rejection_not_a_server_error():
    metrics = ServerMetrics()
    metrics.embedding_endpoints = frozenset({"/v1/embeddings"})
    metrics.observe_http("/v1/chat/completions", 503, shutting_down=True, model_name="m")
    metrics.observe_http("/v1/embeddings", 503, shutting_down=True, model_name="m")
    metrics.observe_http("/v1/chat/completions", 503)
    text, _ = metrics.render()
    samples = {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text.decode())
        for sample in family.samples
    }
    reason = (("model_name", "m"), ("reason", "shutting_down"))
    assert samples[("kvserve:request_rejections_total", reason)] == 1
    assert samples[("kvserve:embedding_rejections_total", reason)] == 1
    endpoint = (("endpoint", "/v1/chat/completions"),)
    assert samples[("kvserve:http_server_errors_total", endpoint)] == 1
    assert ("kvserve:http_server_errors_total", (("endpoint", "/v1/embeddings"),)) not in samples
    assert samples[("kvserve:server_draining", ())] == 0


def _server(**config) -> Server:
    app = create_app(ServerConfig(**config), lambda observer: None)
    return Server(app, host="127.0.0.1", port=0)


def test_signals_drain_then_hurry_then_force():
    server = _server(shutdown_timeout=7)
    assert server.shutdown_timeout == 7
    server.handle_exit(signal.SIGTERM, None)
    assert server.should_exit and server._drain_asked and not server._hurry
    server.handle_exit(signal.SIGTERM, None)  # during the drain: stop waiting
    assert server._hurry and not server.force_exit
    server._drain_over = True
    server.handle_exit(signal.SIGINT, None)  # after it: stop waiting for connections too
    assert server.force_exit


def test_a_stop_that_is_no_signal_does_not_drain():
    server = _server()
    server.should_exit = True  # as a test harness or a failed load stops it
    server.handle_exit(signal.SIGTERM, None)
    assert not server._drain_asked and server.force_exit
