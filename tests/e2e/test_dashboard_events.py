"""The engine event stream (`GET /v1/engine/events`) of a live server under the load generator's
load: its slot and pool states agree with /metrics taken while the engine is held still, every
admitted request appears with its finish reason, no prompt text leaks, a viewer that stops
reading is dropped while the engine steps on, and the stream is behind --api-key."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections import Counter

import httpx
import pytest

from kvserve.bench.loadgen import BenchConfig, BenchResult, build_prompts, run_benchmark
from kvserve.config import ServerConfig
from kvserve.engine.pool_events import PoolMirror
from tests.e2e.conftest import scrape

pytestmark = pytest.mark.slow

NUM_SLOTS = 3
CONCURRENCY = 5
NUM_PROMPTS = 12
INPUT_LEN = 40
OUTPUT_LEN = 6
SEED = 7


class EventReader:
    """Reads the event stream in a thread: every event parsed, and the raw text kept. Each
    event gains `blocks`: the pool as its viewer pictures it then (`PoolMirror`), each owner's
    held blocks, the shared blocks' counts and the cached-free blocks."""

    def __init__(self, url: str, headers: dict[str, str] | None = None) -> None:
        self.events: list[dict] = []
        self.mirror = PoolMirror()
        self.raw: list[str] = []
        self.status: int | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._client = httpx.Client(timeout=httpx.Timeout(60, read=None), trust_env=False)
        self._thread = threading.Thread(target=self._read, args=(url, headers or {}), daemon=True)
        self._thread.start()

    def _read(self, url: str, headers: dict[str, str]) -> None:
        with self._client.stream("GET", url + "/v1/engine/events", headers=headers) as response:
            self.status = response.status_code
            for line in response.iter_lines():
                if self._stop.is_set():
                    return
                with self._lock:
                    self.raw.append(line)
                    if line.startswith("data: "):
                        event = json.loads(line.removeprefix("data: "))
                        self.mirror.apply(event)
                        event["blocks"] = {
                            "tables": {o: self.mirror.held(o) for o in self.mirror.tables},
                            "shared": dict(self.mirror.shared),
                            "cached_free": sorted(self.mirror.cached_free),
                        }
                        self.events.append(event)

    def snapshot(self) -> list[dict]:
        with self._lock:
            return list(self.events)

    def wait_for(self, predicate, timeout: float = 30.0) -> dict:
        """The first event (in arrival order) satisfying `predicate`."""
        deadline = time.monotonic() + timeout
        seen = 0
        while time.monotonic() < deadline:
            events = self.snapshot()
            for event in events[seen:]:
                if predicate(event):
                    return event
            seen = len(events)
            time.sleep(0.02)
        raise TimeoutError("no such event arrived")

    def close(self) -> None:
        self._stop.set()
        self._client.close()
        self._thread.join(10)


def run_load(url: str, **overrides) -> tuple[threading.Thread, list[BenchResult]]:
    config = BenchConfig(
        url=url,
        concurrency=overrides.get("concurrency", CONCURRENCY),
        num_prompts=overrides.get("num_prompts", NUM_PROMPTS),
        input_len=INPUT_LEN,
        output_len=overrides.get("output_len", OUTPUT_LEN),
        seed=overrides.get("seed", SEED),
        timeout=120,
    )
    results: list[BenchResult] = []
    thread = threading.Thread(target=lambda: results.append(asyncio.run(run_benchmark(config))))
    thread.start()
    return thread, results


def metrics_state(server) -> dict[str, int]:
    samples = scrape(server)
    total = int(samples["kvserve:num_kv_blocks"])
    return {
        "running": int(samples["kvserve:num_requests_running"]),
        "waiting": int(samples["kvserve:num_requests_waiting"]),
        "used": total - int(samples["kvserve:num_free_kv_blocks"]),
        "finished": int(
            sum(
                value
                for name, value in samples.items()
                if name.startswith("kvserve:request_success_total")
            )
        ),
    }


def event_state(event: dict) -> dict[str, int]:
    blocks = {block for table in event["blocks"]["tables"].values() for block in table}
    assert len(blocks) == event["pool"]["num_used"], "the tables and the used count disagree"
    busy = [slot for slot in event["slots"] if slot is not None]
    assert len(busy) == event["num_running"]
    assert len(event["queue"]) == event["num_waiting"]
    return {"running": event["num_running"], "waiting": event["num_waiting"], "used": len(blocks)}


def compare_when_still(server, reader: EventReader) -> dict[str, int]:
    """/metrics and the stream's next event, taken while nothing can change."""
    scraped = metrics_state(server)
    after = time.time()
    event = reader.wait_for(lambda e: e["wall"] > after)
    seen = event_state(event)
    assert seen == {key: scraped[key] for key in seen}, (seen, scraped, event["step"])
    return seen


@pytest.fixture(scope="module")
def server(server_factory, engine_config):
    return server_factory(engine_config(max_num_seqs=NUM_SLOTS, max_queue_per_slot=2))


def test_events_agree_with_metrics_under_load_and_carry_no_prompt(
    server, gate_factory, until
) -> None:
    engine = server.state.engine
    reader = EventReader(server.url)
    try:
        first = reader.wait_for(lambda e: True)
        assert first["type"] == "snapshot"
        assert first["config"]["max_num_seqs"] == NUM_SLOTS
        assert first["pool"]["num_blocks"] == engine.pool.num_blocks
        gate = gate_factory(server)
        finished_before = metrics_state(server)["finished"]
        thread, results = run_load(server.url)
        num_checks = 0
        max_busy = 0
        while True:
            finished = metrics_state(server)["finished"] - finished_before
            left = NUM_PROMPTS - finished
            if left == 0:
                break
            # Hold still: every client that can be in flight is, and a step waits at the gate
            # (only a step can end a request, and only an end lets a client send another).
            until(
                lambda left=left: (
                    server.call(lambda: engine.num_requests) == min(CONCURRENCY, left)
                ),
            )
            gate.wait_blocked()
            seen = compare_when_still(server, reader)
            max_busy = max(max_busy, seen["running"])
            num_checks += 1
            for _ in range(3):
                if server.call(lambda: engine.num_running) == 0:
                    break
                # The step's tokens are delivered (and its ends released) on the loop after
                # the device finished it; wait for that before looking again.
                target = server.call(lambda: engine.num_steps) + 1
                gate.step()
                until(lambda target=target: server.call(lambda: engine.num_steps) >= target)
        gate.open()
        thread.join(120)
        assert results and results[0].num_completed == NUM_PROMPTS, results
        until(lambda: server.call(engine.is_idle))
        idle = compare_when_still(server, reader)
        assert idle == {"running": 0, "waiting": 0, "used": 0}
        assert num_checks >= 3 and max_busy == NUM_SLOTS
        reader.wait_for(lambda e: e["type"] == "update" and e["step"] == engine.num_steps)
    finally:
        reader.close()
    events = reader.snapshot()
    admitted = [entry["request_id"] for e in events[1:] for entry in e["admitted"]]
    finished = {entry["request_id"]: entry for e in events[1:] for entry in e["finished"]}
    assert len(admitted) == len(set(admitted)) == NUM_PROMPTS
    assert set(admitted) == set(finished)
    for entry in finished.values():
        assert entry["reason"] in ("stop", "length")
        assert 1 <= entry["num_output_tokens"] <= OUTPUT_LEN
    in_slots = {s["request_id"] for e in events for s in e["slots"] if s is not None}
    assert in_slots <= set(admitted)
    steps = [step for e in events[1:] for step in e["steps"]]
    assert {request_id for step in steps for request_id, *_ in step[2]} == set(admitted)
    assert sum(e["num_tokens"] for e in events[1:]) == sum(
        entry["num_output_tokens"] for entry in finished.values()
    )
    # Coalesced: never more than ten events in any second (the snapshot aside).
    times = [e["time"] for e in events[1:]]
    assert all(b - a >= 0.09 for a, b in zip(times, times[1:], strict=False))
    text = "\n".join(reader.raw)
    for prompt in build_prompts(NUM_PROMPTS, INPUT_LEN, SEED):
        assert prompt not in text
        assert " ".join(prompt.split()[:4]) not in text


def test_a_viewer_that_stops_reading_is_dropped_and_the_engine_steps_on(
    server_factory, engine_config, raw_client, until
) -> None:
    # The smallest socket buffers on both ends and a small write buffer for the stuck
    # connection (as in the slow-consumer test of the generation streams), so a viewer that
    # does not read blocks the server's writes after a few events instead of after megabytes.
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1)
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    server = server_factory(engine_config(max_num_seqs=NUM_SLOTS), sock=listener)
    events = server.app.state.engine_events
    engine = server.state.engine
    events.buffer_size = 4
    reader = None
    try:
        stuck = raw_client(server.port, receive_buffer=1)
        stuck.sock.sendall(b"GET /v1/engine/events HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert stuck.read_head()[0] == 200

        def shrink_write_buffers() -> None:
            for connection in server.server.server_state.connections:
                connection.transport.set_write_buffer_limits(high=1024)

        server.call(shrink_write_buffers)
        reader = EventReader(server.url)
        until(lambda: server.call(lambda: events.num_viewers) == 2)
        thread, results = run_load(server.url, output_len=48, num_prompts=6)
        until(lambda: server.call(lambda: events.num_dropped) == 1, timeout=120)
        steps_at_drop = server.call(lambda: engine.num_steps)
        assert server.call(lambda: events.num_viewers) == 1  # the reading one stays
        thread.join(120)
        assert results[0].num_completed == 6, [(r.status, r.error) for r in results[0].records]
        # The engine steps on, and the viewer that reads sees it.
        thread, results = run_load(server.url, output_len=8, num_prompts=4, seed=SEED + 1)
        thread.join(120)
        assert results[0].num_completed == 4
        assert server.call(lambda: engine.num_steps) > steps_at_drop
        reader.wait_for(lambda e: e["type"] == "update" and e["step"] > steps_at_drop)
        # The dropped viewer's connection is cut: what was sent drains, then the end.
        stuck.sock.settimeout(30)
        while stuck.sock.recv(65536):
            pass
    finally:
        if reader is not None:
            reader.close()
        server.stop()


def test_the_stream_needs_the_api_key_and_the_page_holds_no_data(server_factory, engine_config):
    server = server_factory(engine_config(), ServerConfig(api_key="sesame"))
    try:
        refused = httpx.get(server.url + "/v1/engine/events", timeout=10)
        assert refused.status_code == 401
        reader = EventReader(server.url, {"Authorization": "Bearer sesame"})
        try:
            first = reader.wait_for(lambda e: True)
            assert reader.status == 200 and first["type"] == "snapshot"
        finally:
            reader.close()
        page = httpx.get(server.url + "/dashboard", timeout=10)
        assert page.status_code == 200
        assert "a view, not a control panel" in page.text.lower()
        assert "/v1/engine/events" in page.text
        # Self-contained: no script, style or image from elsewhere.
        assert "src=" not in page.text and "href=" not in page.text
        assert "http://" not in page.text.replace("http://www.w3.org/2000/svg", "")
        assert "https://" not in page.text
    finally:
        server.stop()


class Untouchable:
    """Raises on any attribute read: proof that a hook looked at nothing."""

    def __getattr__(self, name: str):
        raise AssertionError(f"read {name!r} with no viewer connected")


def test_with_no_viewer_the_hooks_read_nothing_but_the_history_counts_tokens() -> None:
    from types import SimpleNamespace

    from kvserve.engine.events import EngineEvents

    events = EngineEvents()
    touch = Untouchable()
    events.on_admitted(touch)
    events.on_finished(touch)
    events.on_rejected("queue_full")
    events.on_step(touch, 0.01)
    # A token is counted in the history (for a viewer's charts later), and nothing else.
    arrived = SimpleNamespace(last_token_at=None, request=SimpleNamespace(arrival_time=10.0))
    events.on_token(arrived, 10.25, 1)
    assert events.num_events == 0 and events.num_viewers == 0
    assert events.history.to_json(12.0)["ttft_ms"] == [[10.25, 250]]


def test_a_viewer_that_connects_after_requests_ended_sees_their_first_tokens(
    server_factory, engine_config, until
) -> None:
    server = server_factory(engine_config(max_num_seqs=NUM_SLOTS))
    engine = server.state.engine
    try:
        for index in range(3):
            reply = httpx.post(
                server.url + "/v1/completions",
                json={"prompt": f"Story {index}:", "max_tokens": 4, "ignore_eos": True},
                timeout=120,
            )
            assert reply.status_code == 200
        until(lambda: server.call(engine.is_idle))
        time.sleep(1.0)  # the last tokens' second is a whole one
        reader = EventReader(server.url)
        try:
            snapshot = reader.wait_for(lambda e: True)
        finally:
            reader.close()
        history = snapshot["history"]
        assert len(history["ttft_ms"]) == 3
        assert all(0 < ms < 120_000 for _, ms in history["ttft_ms"])
        assert all(when <= snapshot["time"] for when, _ in history["ttft_ms"])
        assert sum(tokens for _, tokens in history["tokens"]) == 12
    finally:
        server.stop()


def test_shared_and_cached_blocks_are_marked(server_factory, engine_config, until) -> None:
    server = server_factory(engine_config(max_num_seqs=NUM_SLOTS))
    engine = server.state.engine
    assert engine.pool.cache is not None  # prefix caching is on by default
    reader = EventReader(server.url)
    prompt = " ".join(build_prompts(1, 200, SEED)[0].split())  # several full blocks

    def ask(max_tokens: int) -> None:
        reply = httpx.post(
            server.url + "/v1/completions",
            json={"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True},
            timeout=120,
        )
        assert reply.status_code == 200

    try:
        first = reader.wait_for(lambda e: True)
        assert first["config"]["prefix_caching"] is True
        ask(2)
        until(lambda: server.call(engine.is_idle))
        # Released, its prompt's full blocks stay cached, owned by nobody.
        cached = reader.wait_for(lambda e: e["blocks"]["cached_free"] and e["num_running"] == 0)
        assert cached["pool"]["num_used"] == 0 and cached["blocks"]["tables"] == {}
        # Two at once: the second takes the first's cached blocks, and they share them.
        threads = [threading.Thread(target=ask, args=(40,)) for _ in range(2)]
        for thread in threads:
            thread.start()
        shared = reader.wait_for(lambda e: e["num_running"] == 2 and e["blocks"]["shared"])
        tables = shared["blocks"]["tables"]
        first_id, second_id = (slot["request_id"] for slot in shared["slots"] if slot)
        both = set(tables[first_id]) & set(tables[second_id])
        # Every owner counts: until its copy has run, a request that continues a published
        # tail also holds that tail block under a second owner (its copy source).
        held = Counter(block_id for table in tables.values() for block_id in table)
        assert both and all(held[block_id] == 2 for block_id in both)
        marked = shared["blocks"]["shared"]
        assert marked == {block_id: count for block_id, count in held.items() if count > 1}
        assert all(count == 2 for count in marked.values())
        for thread in threads:
            thread.join(120)
    finally:
        reader.close()
        server.stop()
    text = "\n".join(reader.raw)
    assert " ".join(prompt.split()[:4]) not in text


def test_embedding_requests_are_reported_apart(server_factory, loaded_minilm):
    """An embedding-only engine has a stream too: its snapshot has no slots or pool, and each
    embedding request is reported as such (its inputs and tokens, never its text)."""
    server = server_factory(loaded=loaded_minilm)
    reader = EventReader(server.url)
    try:
        snapshot = reader.wait_for(lambda e: e["type"] == "snapshot")
        assert snapshot["config"]["generates"] is False
        assert snapshot["slots"] == [] and snapshot["embeddings"] == {"waiting": 0, "running": 0}
        body = {"input": ["a secret sentence", "another one"]}
        assert httpx.post(server.url + "/v1/embeddings", json=body).status_code == 200
        update = reader.wait_for(lambda e: e.get("embedded"))
        (job,) = update["embedded"]
        assert (job["outcome"], job["num_inputs"]) == ("done", 2)
        assert job["num_tokens"] > 2
        assert reader.wait_for(lambda e: e.get("embedding_batches", 0) >= 1)
        assert not any("secret" in line for line in reader.raw)
    finally:
        reader.close()
        server.stop()
