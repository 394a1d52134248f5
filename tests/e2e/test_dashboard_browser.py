"""The live dashboard in headless Chromium against a running server under the load generator's
load: it shows as many busy slots as /metrics reports, a burst past the queue shows its 429s in
the event log, pausing freezes the drawing, speculative steps' guessed rows are outlined, and
the page reaches nothing but its own server.

With KVSERVE_UPDATE_SCREENSHOTS=1 the busy page is saved as docs/dashboard.png (the README's
picture)."""

from __future__ import annotations

import asyncio
import dataclasses
import io
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

import httpx
import numpy
import pytest
from PIL import Image

from kvserve.config import SpeculativeConfig
from tests.e2e.conftest import scrape
from tests.e2e.test_dashboard_events import run_load
from tests.sim.browser import browser  # noqa: F401  (a fixture)

pytestmark = pytest.mark.slow

NUM_SLOTS = 3
QUEUE_PER_SLOT = 1
CONCURRENCY = NUM_SLOTS + 2  # every slot busy and two waiting, one place left in the queue
NUM_PROMPTS = 14
BURST = 6
SCREENSHOT = Path(__file__).resolve().parents[2] / "docs" / "dashboard.png"

READ = """() => {
  const summary = document.getElementById("summary").dataset;
  return {
    step: summary.step === "" ? null : Number(summary.step),
    running: summary.running === "" ? null : Number(summary.running),
    used: summary.used === "" ? null : Number(summary.used),
    busy: [...document.querySelectorAll("#slots .slot")].filter((s) => s.dataset.request).length,
    queued: document.querySelectorAll("#queue .queued").length,
    owned: [...document.querySelectorAll("#pool .block")].filter((b) => b.dataset.owner).length,
    refusals: [...document.querySelectorAll("#log .refusal")].map(
      (r) => [r.dataset.status, r.dataset.reason]),
  };
}"""


def running(server) -> int:
    return int(scrape(server)["kvserve:num_requests_running"])


def test_the_dashboard_draws_the_live_engine(
    server_factory,
    engine_config,
    gate_factory,
    browser: Any,  # noqa: F811
    until,
) -> None:
    # Prompt-lookup speculation on, so the strip also shows verification rows.
    config = dataclasses.replace(
        engine_config(max_num_seqs=NUM_SLOTS, max_queue_per_slot=QUEUE_PER_SLOT),
        speculative=SpeculativeConfig(num_speculative_tokens=4, disable_when_slower=False),
    )
    server = server_factory(config)
    engine = server.state.engine
    context = browser.new_context(viewport={"width": 1400, "height": 1050})
    page = context.new_page()
    outside: list[str] = []
    errors: list[str] = []

    def only_the_server(route: Any) -> None:
        if route.request.url.startswith(server.url + "/"):
            route.continue_()
        else:
            outside.append(route.request.url)
            route.abort()

    page.route("**/*", only_the_server)
    page.on("pageerror", lambda error: errors.append(str(error)))
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    gate = gate_factory(server)
    load = None
    try:
        page.goto(server.url + "/dashboard")
        page.wait_for_selector("body[data-connected=true]")
        load, results = run_load(
            server.url, concurrency=CONCURRENCY, num_prompts=NUM_PROMPTS, output_len=12
        )

        def still() -> None:
            until(lambda: server.call(lambda: engine.num_requests) == CONCURRENCY)
            gate.wait_blocked()

        def page_agrees_with_metrics() -> dict:
            # The engine is held between steps, so /metrics and the page's newest event
            # describe the same step; the page follows within the coalescing interval.
            expected = running(server)
            used = engine.pool.num_blocks - int(scrape(server)["kvserve:num_free_kv_blocks"])
            page.wait_for_function(
                "([running, used]) => { const s = document.getElementById('summary').dataset;"
                " return Number(s.running) === running && Number(s.used) === used"
                " && document.querySelectorAll('#slots .slot:not([data-request=\"\"])').length"
                " === running; }",
                arg=[expected, used],
                timeout=10_000,
            )
            drawn = page.evaluate(READ)
            assert drawn["busy"] == drawn["running"] == expected == NUM_SLOTS
            assert drawn["owned"] == used
            return drawn

        still()
        page_agrees_with_metrics()
        for _ in range(4):
            target = server.call(lambda: engine.num_steps) + 1
            gate.step()
            until(lambda target=target: server.call(lambda: engine.num_steps) >= target)
            still()
            page_agrees_with_metrics()

        # A burst past the queue: one place is left, the rest are refused at the door.
        statuses: list[int] = []

        def one(index: int) -> None:
            reply = httpx.post(
                server.url + "/v1/completions",
                json={"prompt": f"Burst number {index}:", "max_tokens": 2},
                timeout=120,
            )
            statuses.append(reply.status_code)

        burst = [threading.Thread(target=one, args=(i,)) for i in range(BURST)]
        for thread in burst:
            thread.start()
        until(lambda: statuses.count(429) == BURST - 1)
        page.wait_for_function(
            'n => document.querySelectorAll(\'#log .refusal[data-status="429"]'
            '[data-reason="queue_full"]\').length === n',
            arg=BURST - 1,
            timeout=10_000,
        )
        for _ in range(3):
            gate.step()
        page.wait_for_timeout(1200)  # the charts gain a few points
        shot = page.screenshot(full_page=True)
        image = Image.open(io.BytesIO(shot)).convert("RGB")
        pixels = numpy.asarray(image).reshape(-1, 3)
        assert len(numpy.unique(pixels, axis=0)) > 50  # a drawing, not a blank page
        if os.environ.get("KVSERVE_UPDATE_SCREENSHOTS") == "1":
            SCREENSHOT.write_bytes(shot)

        # Paused, the page keeps its drawing while the engine moves on; resumed, it catches up.
        page.click("#pause")
        frozen = page.evaluate(READ)
        steps_before = server.call(lambda: engine.num_steps)
        for _ in range(3):
            gate.step()
        until(lambda: server.call(lambda: engine.num_steps) >= steps_before + 3)
        page.wait_for_timeout(1200)  # a heartbeat and the steps' events have arrived
        assert page.evaluate(READ) == frozen
        page.click("#pause")
        page.wait_for_function(
            "step => Number(document.getElementById('summary').dataset.step) > step",
            arg=frozen["step"],
            timeout=10_000,
        )

        gate.open()
        load.join(120)
        for thread in burst:
            thread.join(120)
        assert results[0].num_completed == NUM_PROMPTS
        assert sorted(statuses) == [200] + [429] * (BURST - 1)
        # A prompt that repeats itself: its steps verify guessed rows, outlined in the strip
        # with the number the step kept.
        reply = httpx.post(
            server.url + "/v1/completions",
            json={"prompt": "1, 2, 3, " * 12, "max_tokens": 24, "temperature": 0},
            timeout=120,
        )
        assert reply.status_code == 200
        page.wait_for_function(
            "() => [...document.querySelectorAll('#strip rect.guess')]"
            ".some((r) => / \\d+ guesses \\(\\d+ kept\\)/.test(r.textContent))",
            timeout=10_000,
        )
        until(lambda: server.call(engine.is_idle))
        page.wait_for_function(
            "() => document.getElementById('summary').dataset.running === '0'"
            " && document.getElementById('summary').dataset.used === '0'",
            timeout=10_000,
        )
    finally:
        gate.open()
        if load is not None:
            load.join(120)
        context.close()
        server.stop()
    assert outside == [], "the page tried to reach another server"
    assert errors == [], "the page reported errors"


def test_the_dashboard_marks_preempted_requests_and_growth_blocks(
    server_factory,
    gate_factory,
    browser: Any,  # noqa: F811
    until,
) -> None:
    from kvserve.config import CacheConfig, DeviceConfig, EngineConfig, SchedulerConfig

    # Four chats in a pool of 8 blocks of 16 positions, each admitted with its prompt and 4
    # answer positions: they outgrow the pool within a few dozen steps and the latest arrivals
    # are preempted.
    config = EngineConfig(
        device=DeviceConfig(device="cpu"),
        cache=CacheConfig(block_size=16, num_kv_blocks=8),
        scheduler=SchedulerConfig(
            max_num_seqs=4, max_model_len=128, admission="partial", reserve_tokens=4
        ),
    )
    server = server_factory(config)
    engine = server.state.engine
    context = browser.new_context(viewport={"width": 1400, "height": 1050})
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    gate = gate_factory(server)
    threads = []
    try:
        page.goto(server.url + "/dashboard")
        page.wait_for_selector("body[data-connected=true]")
        for index in range(4):
            thread = threading.Thread(
                target=httpx.post,
                args=(server.url + "/v1/completions",),
                kwargs={
                    "json": {
                        "prompt": f"Count slowly, {index}:",
                        "max_tokens": 60,
                        "ignore_eos": True,
                        "temperature": 0,
                    },
                    "timeout": 300,
                },
            )
            thread.start()
            threads.append(thread)
        until(lambda: server.call(lambda: engine.num_requests) == 4)
        for _ in range(200):
            if server.call(lambda: engine.num_preempted) > 0:
                break
            gate.step()
        gate.wait_blocked()

        def held() -> tuple[int, int, list[str]]:
            preempted = [seq.seq_id for seq in engine.scheduler.preempted]
            growth = sum(
                len(engine.pool.table(seq.seq_id)) - engine.kv.num_reserved(seq.seq_id)
                for seq in engine.scheduler.running
            )
            return engine.num_steps, growth, preempted

        step, growth, preempted = server.call(held)
        assert preempted and growth > 0
        page.wait_for_function(
            "n => Number(document.getElementById('summary').dataset.preempted) === n",
            arg=len(preempted),
            timeout=10_000,
        )
        drawn = page.evaluate(
            """() => ({
              preempted: [...document.querySelectorAll("#queue .queued.preempted")].map(
                (q) => q.dataset.request),
              growth: document.querySelectorAll('#pool .block[data-growth="true"]').length,
            })"""
        )
        assert drawn["preempted"] == preempted
        # Growth blocks that several sequences hold are drawn once; none are here.
        assert drawn["growth"] == growth
        gate.open()
        for thread in threads:
            thread.join(300)
        until(lambda: server.call(engine.is_idle))
        assert server.call(lambda: engine.num_preemptions) > 0
    finally:
        gate.open()
        for thread in threads:
            thread.join(300)
        context.close()
        server.stop()
    assert errors == [], "the page reported errors"


def recorded_stream(num_blocks: int, num_slots: int, *, past_requests: int = 0) -> tuple[str, dict]:
    """An event stream of a synthetic engine (kvserve/bench/events_bench.py) as the server sends
    it: the snapshot (after `past_requests` requests had their first tokens, nobody watching)
    and three updates; and the pool's truth at the end."""
    from types import SimpleNamespace

    from kvserve.bench.events_bench import SyntheticEngine
    from kvserve.engine.events import EngineEvents
    from kvserve.server.sse import event

    async def record() -> tuple[str, dict]:
        engine = SyntheticEngine(num_blocks, num_slots)
        prompt_tokens = int(0.9 * num_blocks / num_slots) * 16 - 64
        for _ in range(num_slots):
            engine.admit(prompt_tokens)
        events = EngineEvents(max_rate=1e-3, heartbeat=1e6)
        events.bind(engine)  # type: ignore[arg-type]
        now = time.monotonic()
        for k in range(past_requests):
            arrived = SimpleNamespace(
                last_token_at=None, request=SimpleNamespace(arrival_time=now - 20 + k)
            )
            events.on_token(arrived, now - 20 + k + 0.1 * (k + 1))
        viewer = events.connect()
        texts = await viewer.next_batch()
        for _ in range(3):
            engine.decode(20)
            engine.finish(engine.sequences[0])
            engine.admit(prompt_tokens)
            events.flush()
            texts += await viewer.next_batch()
        events.close_all()
        pool = engine.pool
        owners = {owner for owner in pool.owners() if pool.num_held(owner)}
        return "".join(event(text) for text in texts), {
            "used": pool.num_used,
            "cached": pool.num_cached_free,
            "owners": len(owners),
        }

    # Playwright's loop runs in this thread: the engine's loop gets one of its own.
    with ThreadPoolExecutor(1) as executor:
        return executor.submit(asyncio.run, record()).result()


def test_a_large_pool_is_drawn_as_a_compact_map(
    browser: Any,  # noqa: F811
) -> None:
    """The page against recorded streams (no server: every request is answered here): a pool of
    10^5 blocks is drawn on one canvas, in cells, with the counts of the stream's pool; the
    charts start from the snapshot's history; a small pool gets its tiles."""
    from kvserve.server.dashboard import dashboard_html

    origin = "http://kvserve.test"
    big, big_truth = recorded_stream(100_000, 64, past_requests=4)
    small, small_truth = recorded_stream(512, 4)
    streams = [big]  # what the next connection to the stream gets

    def answer(route: Any) -> None:
        url = route.request.url
        if url.startswith(origin + "/dashboard"):
            route.fulfill(status=200, content_type="text/html", body=dashboard_html())
        elif url == origin + "/v1/models":
            route.fulfill(status=200, json={"object": "list", "data": [{"id": "synthetic"}]})
        elif url == origin + "/v1/engine/events":
            route.fulfill(status=200, content_type="text/event-stream", body=streams[0])
        else:
            route.abort()

    context = browser.new_context(viewport={"width": 1400, "height": 1050})
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.route("**/*", answer)
    try:
        page.goto(origin + "/dashboard")
        page.wait_for_function(
            "() => document.getElementById('pool').dataset.mode === 'cells'", timeout=10_000
        )
        drawn = page.evaluate(
            """() => {
              const pool = document.getElementById("pool");
              const canvas = pool.querySelector("canvas");
              const pixels = canvas.getContext("2d").getImageData(0, 0, canvas.width, canvas.height).data;
              const colors = new Set();
              for (let i = 0; i < pixels.length; i += 4) colors.add(pixels[i] << 16 | pixels[i + 1] << 8 | pixels[i + 2]);
              const box = canvas.getBoundingClientRect();
              canvas.dispatchEvent(new MouseEvent("mousemove", { clientX: box.left + 1, clientY: box.top + 1 }));
              return { ...pool.dataset, tiles: pool.querySelectorAll(".block").length,
                       width: canvas.width, height: canvas.height, colors: colors.size,
                       info: pool.querySelector(".pool-info").textContent,
                       ttft: Number(document.getElementById("chart-ttft").dataset.points),
                       tps: Number(document.getElementById("chart-tps").dataset.points) };
            }"""
        )
        assert drawn["tiles"] == 0 and drawn["height"] <= 320
        assert (
            int(drawn["used"]) == big_truth["used"] and int(drawn["cached"]) == big_truth["cached"]
        )
        assert int(drawn["owners"]) == big_truth["owners"] == 64
        assert int(drawn["perCell"]) * (drawn["width"] // 8) * (drawn["height"] // 8) >= 100_000
        assert drawn["colors"] > 20  # the owners' colours, cached, free
        assert drawn["info"].startswith("blocks 0\u2013")
        assert drawn["ttft"] == 4 and drawn["tps"] >= 10  # the history, before any new request
        # The 1.5B model's pool at 64 slots still gets a square per block; 10^5 blocks, cells.
        layouts = page.evaluate("() => [25413, 100000].map((n) => KVView.poolLayout(n, 700, 320))")
        assert [(layout["mode"], layout["perCell"]) for layout in layouts] == [
            ("blocks", 1),
            ("cells", 29),
        ]
        assert layouts[0]["rows"] * layouts[0]["px"] <= 320 and layouts[0]["px"] >= 2

        streams[0] = small
        page.click("#connect")
        page.wait_for_function(
            "() => document.getElementById('pool').dataset.mode === 'tiles'", timeout=10_000
        )
        assert page.evaluate("() => document.querySelectorAll('#pool .block').length") == 512
        owned = page.evaluate(
            "() => document.querySelectorAll('#pool .block[data-owner]:not([data-owner=\"\"])').length"
        )
        assert owned == small_truth["used"]
    finally:
        context.close()
    assert errors == [], errors


def test_the_model_picker_lists_the_models_and_switches_the_stream(
    browser: Any,  # noqa: F811
) -> None:
    """With two models listed by /v1/models, the page (opened with ?model=) shows them in a
    picker and reads that model's stream, sending the API key to both; picking the other
    reconnects with ?model= and rewrites the address; with one model listed there is no picker
    and the stream is asked without ?model=."""
    from kvserve.server.dashboard import dashboard_html

    origin = "http://kvserve.test"
    big, _ = recorded_stream(100_000, 64)
    small, small_truth = recorded_stream(512, 4)
    streams = {"qwen2.5-coder:1.5b": big, "smol": small}
    listed = [{"id": name, "object": "model", "owned_by": "kvserve"} for name in streams]
    asked: list[tuple[str, str | None]] = []

    def answer(route: Any) -> None:
        request = route.request
        url = request.url
        asked.append((url, request.headers.get("authorization")))
        if url.startswith(origin + "/dashboard"):
            route.fulfill(status=200, content_type="text/html", body=dashboard_html())
        elif url == origin + "/v1/models":
            route.fulfill(status=200, json={"object": "list", "data": listed})
        elif url.startswith(origin + "/v1/engine/events"):
            query = parse_qs(urlparse(url).query)
            name = query.get("model", ["qwen2.5-coder:1.5b"])[0]
            route.fulfill(status=200, content_type="text/event-stream", body=streams[name])
        else:
            route.abort()

    context = browser.new_context(viewport={"width": 1400, "height": 1050})
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.route("**/*", answer)
    try:
        page.goto(origin + "/dashboard?model=qwen2.5-coder%3A1.5b#key=sesame")
        page.wait_for_function(
            "() => document.getElementById('pool').dataset.mode === 'cells'", timeout=10_000
        )
        drawn = page.evaluate(
            """() => ({ picker: !document.getElementById("model-picker").hidden,
                       options: [...document.querySelectorAll("#model option")].map((o) => o.value),
                       picked: document.getElementById("model").value,
                       model: document.body.dataset.model })"""
        )
        assert drawn["picker"] and drawn["options"] == list(streams)
        assert drawn["picked"] == drawn["model"] == "qwen2.5-coder:1.5b"
        events_asked = [(url, key) for url, key in asked if "/v1/engine/events" in url]
        assert events_asked == [
            (origin + "/v1/engine/events?model=qwen2.5-coder%3A1.5b", "Bearer sesame")
        ]
        assert (origin + "/v1/models", "Bearer sesame") in asked

        page.select_option("#model", "smol")
        page.wait_for_function(
            "() => document.getElementById('pool').dataset.mode === 'tiles'", timeout=10_000
        )
        assert page.evaluate("() => document.querySelectorAll('#pool .block').length") == 512
        owned = page.evaluate(
            "() => document.querySelectorAll('#pool .block[data-owner]:not([data-owner=\"\"])').length"
        )
        assert owned == small_truth["used"]
        assert page.evaluate("() => location.search + location.hash") == "?model=smol#key=sesame"
        assert asked[-1] == (origin + "/v1/engine/events?model=smol", "Bearer sesame")

        # One model: no picker, and the stream without ?model= (the server's default).
        listed[1:] = []
        asked.clear()
        page.goto(origin + "/dashboard")
        page.wait_for_function(
            "() => document.getElementById('pool').dataset.mode === 'cells'", timeout=10_000
        )
        assert page.evaluate("() => document.getElementById('model-picker').hidden")
        assert [url for url, _ in asked if "/v1/engine/events" in url] == [
            origin + "/v1/engine/events"
        ]
    finally:
        context.close()
    assert errors == [], errors
