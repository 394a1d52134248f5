"""A process that drains on SIGTERM, takes the client's X-Request-Id, and answers browsers
(CORS) when told to.

The drain is tested on `kvserve serve` as a process (real signals, real exit status). Its steps
pass through a hook that holds them while a file exists and can slow each one, so "still
running when the signal arrives" and "longer than the shutdown timeout" hold by construction,
whatever the machine's speed.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest

from kvserve.config import ServerConfig
from tests.e2e.harness import OutputLines, free_port

pytestmark = pytest.mark.slow

CHAT = "/v1/chat/completions"

# `kvserve serve` whose steps wait while the file argv[1] exists and then sleep argv[2] seconds.
_HOOKED_SERVE = """
import os, sys, time
from kvserve.engine import batch

hold, delay = sys.argv[1], float(sys.argv[2])
execute = batch.Batch.execute

def hooked(self, *args):
    while os.path.exists(hold):
        time.sleep(0.01)
    time.sleep(delay)
    return execute(self, *args)

batch.Batch.execute = hooked
from kvserve.cli import main
sys.exit(main(["serve", *sys.argv[3:]]))
"""


class Served:
    """`kvserve serve` in a process of its own, ready (its banner printed)."""

    def __init__(self, tmp_path: Path, flags: list[str], delay: float) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.hold = tmp_path / f"hold-{self.port}"
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "KVSERVE_DEVICE": "cpu"}
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-c",
                _HOOKED_SERVE,
                str(self.hold),
                str(delay),
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--max-model-len",
                "1024",
                "--num-kv-blocks",
                "128",
                *flags,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        self.stderr = OutputLines(self.process.stderr)
        OutputLines(self.process.stdout).wait_for("listening on", timeout=240)

    def hold_steps(self) -> None:
        self.hold.touch()

    def release_steps(self) -> None:
        self.hold.unlink(missing_ok=True)

    def signal(self, sig: int = signal.SIGTERM) -> None:
        self.process.send_signal(sig)

    def log(self) -> str:
        """Everything the process wrote to stderr, once it has exited; never a traceback."""
        text = "".join(self.stderr.until_closed(timeout=30))
        assert "Traceback" not in text, text
        return text

    def kill(self) -> None:
        self.release_steps()
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


@pytest.fixture
def serve(tmp_path):
    """`serve(*flags, delay=0.0) -> Served`; every process is killed at teardown."""
    started: list[Served] = []

    def start(*flags: str, delay: float = 0.0) -> Served:
        served = Served(tmp_path, list(flags), delay)
        started.append(served)
        return served

    yield start
    for served in started:
        served.kill()


def _chat(max_tokens: int, *, stream: bool = True) -> dict:
    return {
        "messages": [{"role": "user", "content": "Tell me a long story about the sea."}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": stream,
    }


class Streamer(threading.Thread):
    """One streamed chat request in a thread: its status once the head is in (and, for an
    error, its body), and every SSE event's data; `error` holds what broke the connection, if
    anything did."""

    def __init__(self, url: str, payload: dict) -> None:
        super().__init__(daemon=True)
        self.url, self.payload = url, payload
        self.status: int | None = None
        self.headers: httpx.Headers | None = None
        self.events: list[str] = []
        self.body = b""
        self.error: BaseException | None = None
        self.head = threading.Event()
        self.start()

    def run(self) -> None:
        try:
            with httpx.stream("POST", self.url + CHAT, json=self.payload, timeout=300) as response:
                if response.status_code != 200:
                    self.body = response.read()
                self.status, self.headers = response.status_code, response.headers
                self.head.set()
                if response.status_code != 200:
                    return
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        self.events.append(line.removeprefix("data: "))
        except BaseException as exc:  # reported by the test
            self.error = exc
        finally:
            self.head.set()

    def finished(self, timeout: float = 300) -> Streamer:
        self.join(timeout)
        assert not self.is_alive(), "the stream did not end"
        assert self.error is None, repr(self.error)
        return self


def _assert_shutting_down(response_status: int, headers, body: bytes) -> None:
    assert response_status == 503
    assert headers["retry-after"] == "1"
    error = json.loads(body)["error"]
    assert error["code"] == "shutting_down"
    assert "the server is shutting down" in error["message"]


def _assert_error_then_done(events: list[str]) -> None:
    """A stream cut by the engine's stop: an error event, then the terminator."""
    assert events[-1] == "[DONE]"
    assert "the server is shutting down" in json.loads(events[-2])["error"]["message"]


def test_sigterm_lets_running_streams_finish_and_refuses_new_requests(serve, metrics, until):
    max_tokens = 24
    served = serve("--max-num-seqs", "8", "--shutdown-timeout", "120")
    url = served.url
    model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
    served.hold_steps()  # admitted requests stay running until released
    streams = [Streamer(url, _chat(max_tokens)) for _ in range(8)]
    for stream in streams:
        assert stream.head.wait(120) and stream.status == 200
    queued = Streamer(url, _chat(max_tokens))  # no slot left: it waits in the queue
    until(lambda: metrics(served)["kvserve:num_requests_waiting"] == 1)

    served.signal(signal.SIGTERM)
    # Refused at once, while the running ones cannot have moved: no step runs.
    assert queued.head.wait(60)
    _assert_shutting_down(queued.status, queued.headers, queued.body)
    ready = httpx.get(url + "/ready")
    assert ready.status_code == 503 and ready.json() == {"status": "draining"}
    for path, payload in (
        (CHAT, _chat(4, stream=False)),
        ("/v1/completions", {"prompt": "Hi", "max_tokens": 4}),
        ("/api/chat", {"model": model, "messages": [{"role": "user", "content": "Hi"}]}),
        ("/v1/embeddings", {"input": "Hi"}),
    ):
        refused = httpx.post(url + path, json=payload, timeout=60)
        assert refused.status_code == 503, path
        assert refused.headers["retry-after"] == "1"
        assert "the server is shutting down" in refused.text
    samples = metrics(served)
    assert samples["kvserve:server_draining"] == 1
    assert samples['kvserve:request_rejections_total{reason="shutting_down"}'] == 4
    assert samples['kvserve:embedding_rejections_total{reason="shutting_down"}'] == 1
    # Refusals, not server errors (only the /ready probe's 503s count there, as ever).
    errors = {n for n in samples if n.startswith("kvserve:http_server_errors_total")}
    assert errors == {'kvserve:http_server_errors_total{endpoint="/ready"}'}
    assert served.process.poll() is None

    served.release_steps()
    for stream in streams:
        events = stream.finished().events
        assert events[-1] == "[DONE]"
        assert not any('"error"' in event for event in events)
        endings = [json.loads(e)["choices"][0]["finish_reason"] for e in events[:-1]]
        assert endings[-1] == "length"
    assert served.process.wait(timeout=120) == 0
    log = served.log()
    assert "draining: 8 running, up to 120 s (1 waiting for a slot refused with 503)" in log
    assert "drained in" in log
    with pytest.raises(httpx.ConnectError):
        httpx.get(url + "/health")


def test_a_stream_longer_than_the_shutdown_timeout_ends_with_an_error_event(serve, until):
    # At least 60 s of steps for its 600 tokens; the drain waits 1 s.
    served = serve("--max-num-seqs", "2", "--shutdown-timeout", "1", delay=0.1)
    stream = Streamer(served.url, _chat(600))
    until(lambda: len(stream.events) >= 3, timeout=120)
    served.signal(signal.SIGTERM)
    events = stream.finished(120).events
    _assert_error_then_done(events)
    assert served.process.wait(timeout=120) == 0
    log = served.log()
    assert "draining: 1 running, up to 1 s" in log
    assert "shutdown timeout (1 s): stopping now; 1 still running end with an error" in log


def test_a_second_sigterm_ends_the_drain_at_once(serve, until):
    # The drain would wait 300 s, the stream's 900 tokens at least 90 s.
    served = serve("--max-num-seqs", "2", "--shutdown-timeout", "300", delay=0.1)
    stream = Streamer(served.url, _chat(900))
    until(lambda: len(stream.events) >= 3, timeout=120)
    served.signal(signal.SIGTERM)
    until(lambda: httpx.get(served.url + "/ready").status_code == 503, timeout=30)
    served.stderr.wait_for("draining: 1 running, up to 300 s", timeout=30)
    served.signal(signal.SIGTERM)
    _assert_error_then_done(stream.finished(60).events)
    assert served.process.wait(timeout=60) == 0
    assert "second signal: stopping now; 1 still running end with an error" in served.log()


def test_any_origin_with_an_api_key_is_refused_at_start():
    process = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvserve",
            "serve",
            "--port",
            str(free_port()),
            "--api-key",
            "sesame",
            "--allowed-origins",
            "*",
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        timeout=120,
    )
    assert process.returncode == 2
    assert "--allowed-origins '*' cannot be combined with --api-key" in process.stderr


# --------------------------------------------------------------------------------------------
# X-Request-Id


@pytest.fixture(scope="module")
def server(server_factory):
    server = server_factory()
    yield server
    server.stop()


_GENERATED = re.compile(r"[0-9a-f]{32}")


def test_a_clients_request_id_is_echoed_and_logged(server, access_log, until):
    client_id = "trace-42:a/b+c=d@e.f_G"
    reply = httpx.post(
        server.url + CHAT,
        json=_chat(3, stream=False),
        headers={"X-Request-Id": client_id},
        timeout=60,
    )
    assert reply.status_code == 200
    assert reply.headers["x-request-id"] == client_id
    until(lambda: access_log.line_for(client_id) is not None)
    line = access_log.line_for(client_id)
    assert line.split()[1:4] == ["POST", CHAT, "200"]
    internal = re.search(r" internal_id=(\S+)$", line)[1]
    assert _GENERATED.fullmatch(internal)
    # The body's id is the server's own, as it would be without the header.
    assert reply.json()["id"] == f"chatcmpl-{internal}"


@pytest.mark.parametrize(
    "hostile",
    [b"x" * 129, b"abc\tdef", b"two words", "caf\u00e9".encode(), b"semi;colon"],
    ids=["too-long", "control-character", "space", "non-ascii", "punctuation"],
)
def test_a_hostile_request_id_is_replaced(server, raw_client, access_log, until, hostile):
    client = raw_client(server.port)
    body = json.dumps(_chat(2, stream=False)).encode()
    client.sock.sendall(
        b"POST " + CHAT.encode() + b" HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        b"Content-Type: application/json\r\nContent-Length: " + str(len(body)).encode() + b"\r\n"
        b"X-Request-Id: " + hostile + b"\r\n\r\n" + body
    )
    status, headers = client.read_head()
    assert status == 200
    generated = headers["x-request-id"]
    assert _GENERATED.fullmatch(generated)
    until(lambda: access_log.line_for(generated) is not None)
    assert "internal_id=" not in access_log.line_for(generated)
    assert not any(hostile.decode("latin-1") in line for line in access_log.lines)


def test_two_requests_with_one_request_id_do_not_collide(server, gate_factory, until):
    engine = server.state.engine
    gate = gate_factory(server)  # both are in the engine at once before either steps
    replies: list[httpx.Response] = []

    def send() -> None:
        replies.append(
            httpx.post(
                server.url + CHAT,
                json=_chat(3, stream=False),
                headers={"X-Request-Id": "same-id"},
                timeout=120,
            )
        )

    threads = [threading.Thread(target=send) for _ in range(2)]
    for thread in threads:
        thread.start()
    until(lambda: server.call(lambda: engine.num_requests) == 2)
    gate.open()
    for thread in threads:
        thread.join(120)
    assert [reply.status_code for reply in replies] == [200, 200]
    assert [reply.headers["x-request-id"] for reply in replies] == ["same-id", "same-id"]
    first, second = (reply.json()["id"] for reply in replies)
    assert first != second


# --------------------------------------------------------------------------------------------
# CORS

ORIGIN = "https://app.example.com"
API_KEY = "sesame"


@pytest.fixture(scope="module")
def cors_server(server_factory, engine_config):
    config = ServerConfig(api_key=API_KEY, allowed_origins=(ORIGIN, "http://localhost:5173"))
    server = server_factory(engine_config(), config)
    yield server
    server.stop()


def _preflight(url: str, origin: str) -> httpx.Response:
    return httpx.options(
        url + CHAT,
        headers={
            "Origin": origin,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type, x-request-id",
        },
    )


def test_a_preflight_from_an_allowed_origin_needs_no_key(cors_server, access_log, metrics):
    before = metrics(cors_server)
    preflight = _preflight(cors_server.url, ORIGIN)
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] == ORIGIN
    assert "POST" in preflight.headers["access-control-allow-methods"]
    allowed = preflight.headers["access-control-allow-headers"].lower()
    assert {"authorization", "content-type", "x-request-id"} <= set(allowed.split(", "))
    # Answered before the key check: neither logged nor counted, as an error or otherwise.
    after = metrics(cors_server)
    counted = f'kvserve:http_requests_total{{endpoint="{CHAT}",status="200"}}'
    assert after.get(counted) == before.get(counted)
    assert not any(name.startswith("kvserve:http_server_errors") for name in after)
    assert not any("OPTIONS" in line for line in access_log.lines)

    # The request itself still needs the key; its 401 is readable by the page.
    refused = httpx.post(cors_server.url + CHAT, json=_chat(2), headers={"Origin": ORIGIN})
    assert refused.status_code == 401
    assert refused.headers["access-control-allow-origin"] == ORIGIN
    reply = httpx.post(
        cors_server.url + CHAT,
        json=_chat(2, stream=False),
        headers={"Origin": ORIGIN, "Authorization": f"Bearer {API_KEY}"},
        timeout=60,
    )
    assert reply.status_code == 200
    assert reply.headers["access-control-allow-origin"] == ORIGIN
    exposed = reply.headers["access-control-expose-headers"].lower()
    assert {"x-request-id", "retry-after"} <= set(exposed.split(", "))


def test_a_disallowed_origin_gets_no_allow_origin(cors_server):
    preflight = _preflight(cors_server.url, "https://evil.example.com")
    assert "access-control-allow-origin" not in preflight.headers
    health = httpx.get(cors_server.url + "/health", headers={"Origin": "https://evil.example.com"})
    assert health.status_code == 200
    assert "access-control-allow-origin" not in health.headers


def test_no_cors_headers_by_default(server):
    preflight = _preflight(server.url, ORIGIN)
    assert preflight.status_code != 200
    health = httpx.get(server.url + "/health", headers={"Origin": ORIGIN})
    for response in (preflight, health):
        assert not any(name.startswith("access-control-") for name in response.headers)
