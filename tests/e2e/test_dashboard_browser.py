"""The live dashboard in headless Chromium against a running server under the load generator's
load: it shows as many busy slots as /metrics reports, a burst past the queue shows its 429s in
the event log, pausing freezes the drawing, and the page reaches nothing but its own server.

With KVSERVE_UPDATE_SCREENSHOTS=1 the busy page is saved as docs/dashboard.png (the README's
picture)."""

from __future__ import annotations

import io
import os
import threading
from pathlib import Path
from typing import Any

import httpx
import numpy
import pytest
from PIL import Image

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
    server = server_factory(
        engine_config(max_num_seqs=NUM_SLOTS, max_queue_per_slot=QUEUE_PER_SLOT)
    )
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
