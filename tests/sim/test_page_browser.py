"""The simulator's page in a real browser: Debian's headless Chromium driven by Playwright.

Clicking through the page must draw, for every scenario, exactly the state the simulator
computes in Python for that step: block owners and fill, slot contents, the queue and the rows.
The page must not reach the network, and a screenshot must show a drawing, not a blank page.
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy
import pytest
from PIL import Image

from kvserve.sim import DEFAULT_WORKLOAD, SimulationResult, simulate_all
from kvserve.sim.figure import request_colors, write_html
from tests.sim.browser import browser  # noqa: F401  (a fixture)

READ_STATE = """() => ({
  step: Number(document.getElementById("step-label").dataset.step),
  scenarios: [...document.querySelectorAll(".scenario")].map((section) => ({
    name: section.dataset.scenario,
    step: Number(section.dataset.step),
    stuck: section.classList.contains("is-stuck"),
    owners: [...section.querySelectorAll(".pool .block")].map((b) => b.dataset.owner),
    fill: [...section.querySelectorAll(".pool .block")].map((b) => Number(b.dataset.fill)),
    shared: [...section.querySelectorAll(".pool .block")].map(
      (b) => b.classList.contains("shared")),
    cached: [...section.querySelectorAll(".pool .block")].map((b) => b.dataset.cached === "true"),
    growth: [...section.querySelectorAll(".pool .block")].map((b) => b.dataset.growth === "true"),
    slots: [...section.querySelectorAll(".slots .slot")].map((s) => s.dataset.request),
    queued: [...section.querySelectorAll(".queue .queued")].map((q) => q.dataset.request),
    preempted: [...section.querySelectorAll(".queue .queued.preempted")].map(
      (q) => q.dataset.request),
    rows: [...section.querySelectorAll(".rows .row:not(.unused)")].map(
      (r) => [r.dataset.request, r.dataset.kind]),
    status: section.querySelector(".status").textContent,
  })),
})"""


def expected_state(result: SimulationResult, step: int) -> dict[str, Any]:
    """What the page must draw for `result` at `step`, computed from the Python run."""
    frame = result.frames[min(step, result.num_steps - 1)]
    rows = []
    for row in frame.rows:
        kind = "prefill" if row.is_prefill else "decode"
        rows += [[row.request_id, kind]] * row.num_tokens
    return {
        "name": result.scenario.name,
        "step": frame.step,
        "stuck": frame.stuck,
        "owners": [owner or "" for owner in frame.block_owners],
        "fill": list(frame.block_fill),
        "shared": [refs > 1 for refs in frame.block_refs],
        "cached": [
            owner is None and cached
            for owner, cached in zip(frame.block_owners, frame.block_cached, strict=True)
        ],
        "growth": [
            owner is not None and growth
            for owner, growth in zip(frame.block_owners, frame.block_growth, strict=True)
        ],
        "slots": [slot.request_id if slot else "" for slot in frame.slots],
        "queued": [*frame.resuming_ids, *frame.queued_ids],
        "preempted": list(frame.resuming_ids),
        "rows": rows,
    }


def drawn(state: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        {key: value for key, value in scenario.items() if key != "status"}
        for scenario in state["scenarios"]
    ]


@pytest.fixture(scope="module")
def results() -> list[SimulationResult]:
    return simulate_all(DEFAULT_WORKLOAD)


@pytest.fixture
def page(browser: Any, results: list[SimulationResult], tmp_path: Path) -> Iterator[Any]:  # noqa: F811
    path = write_html(tmp_path / "simulator.html", results)
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    page = context.new_page()
    outside: list[str] = []
    errors: list[str] = []

    def only_the_file(route: Any) -> None:
        url = route.request.url
        if url.startswith("file://"):
            route.continue_()
        else:
            outside.append(url)
            route.abort()

    page.route("**/*", only_the_file)
    page.on("pageerror", lambda error: errors.append(str(error)))
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.goto(path.resolve().as_uri())
    page.wait_for_selector("body[data-ready=true]")
    yield page
    context.close()
    assert outside == [], "the page tried to reach the network"
    assert errors == [], "the page reported errors"


def test_next_step_draws_the_simulators_next_state(
    page: Any, results: list[SimulationResult]
) -> None:
    before = page.evaluate(READ_STATE)
    assert before["step"] == 0
    assert drawn(before) == [expected_state(result, 0) for result in results]
    page.click("#next")
    after = page.evaluate(READ_STATE)
    assert after["step"] == 1
    assert drawn(after) == [expected_state(result, 1) for result in results]
    assert drawn(after) != drawn(before)


def test_stepping_forwards_and_backwards_through_the_stuck_pool(
    page: Any, results: list[SimulationResult]
) -> None:
    slot_only = next(result for result in results if result.scenario.name == "slot-only")
    stuck_step = slot_only.stuck_step
    assert stuck_step is not None
    seen_changes = 0
    previous = drawn(page.evaluate(READ_STATE))
    for step in range(1, stuck_step + 1):
        page.click("#next")
        state = page.evaluate(READ_STATE)
        assert state["step"] == step
        assert drawn(state) == [expected_state(result, step) for result in results]
        seen_changes += drawn(state) != previous
        previous = drawn(state)
    assert seen_changes == stuck_step
    # The prefix-caching panel drew blocks shared by several requests and cached ones.
    prefix = next(i for i, result in enumerate(results) if result.scenario.name == "prefix")
    assert any(
        any(expected_state(results[prefix], step)["shared"]) for step in range(stuck_step + 1)
    )
    stuck_panel = page.evaluate(READ_STATE)["scenarios"][2]
    assert stuck_panel["stuck"] and f"stuck at step {stuck_step}" in stuck_panel["status"]
    assert "" not in stuck_panel["owners"]  # every block taken
    page.click("#prev")
    state = page.evaluate(READ_STATE)
    assert state["step"] == stuck_step - 1 and not state["scenarios"][2]["stuck"]
    assert drawn(state) == [expected_state(result, stuck_step - 1) for result in results]
    # The slider jumps anywhere, including past a scenario's last step (its last frame stays).
    last = max(result.num_steps for result in results) - 1
    page.locator("#slider").fill(str(last))
    state = page.evaluate(READ_STATE)
    assert state["step"] == last
    assert drawn(state) == [expected_state(result, last) for result in results]
    page.keyboard.press("Home")
    assert page.evaluate(READ_STATE)["step"] == 0


def test_the_partial_panel_draws_a_preemption_and_the_resumption(
    page: Any, results: list[SimulationResult]
) -> None:
    index, partial = next(
        (i, result) for i, result in enumerate(results) if result.scenario.name == "partial"
    )
    step = next(frame.step for frame in partial.frames if frame.preempted_ids)
    page.locator("#slider").fill(str(step))
    state = page.evaluate(READ_STATE)
    assert drawn(state) == [expected_state(result, step) for result in results]
    panel = state["scenarios"][index]
    victims = list(partial.frames[step].preempted_ids)
    assert victims and panel["preempted"] == victims and panel["queued"][: len(victims)] == victims
    assert any(panel["growth"])
    assert all(victim not in panel["owners"] for victim in victims)
    assert "preempted: " + ", ".join(victims) in panel["status"]
    page.click("#next")
    state = page.evaluate(READ_STATE)
    panel = state["scenarios"][index]
    assert panel["preempted"] == [] and "resumed (recomputing)" in panel["status"]
    assert [row for row in panel["rows"] if row[0] in victims][0] == [victims[0], "prefill"]


def test_the_screenshot_shows_the_drawing(page: Any, results: list[SimulationResult]) -> None:
    for _ in range(6):
        page.click("#next")
    image = Image.open(io.BytesIO(page.screenshot(full_page=True))).convert("RGB")
    pixels = numpy.asarray(image).reshape(-1, 3)
    distinct = {tuple(int(c) for c in color) for color in numpy.unique(pixels, axis=0)}
    assert len(distinct) > 50
    assert float(pixels.mean(axis=1).std()) > 20
    # Every request that holds a block at this step is drawn in its own colour.
    frame = results[1].frames[6]
    colors = request_colors(DEFAULT_WORKLOAD)
    owners = {owner for owner in frame.block_owners if owner is not None}
    assert owners
    for owner in owners:
        hex_color = colors[owner]
        rgb = tuple(int(hex_color[i : i + 2], 16) for i in (1, 3, 5))
        assert rgb in distinct, owner
