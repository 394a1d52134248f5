"""The simulator's pictures: a self-contained interactive HTML page and a static PNG overview.

The page embeds every scenario's frames as JSON and draws them with the components it shares
with the live dashboard (kvserve/view), inlined: no network, no CDN, so it opens from a file
anywhere. The PNG shows, per scenario,
which request holds how much of the pool at each step and each request's timeline.
"""

from __future__ import annotations

import colorsys
import json
from collections.abc import Sequence
from importlib import resources
from pathlib import Path
from typing import Any

from kvserve.sim.simulator import QUEUE_REASONS, SimulationResult, Workload
from kvserve.view import inline_components

# Distinguishable on white and on each other (Tableau 10 without its grey).
PALETTE = (
    "#4e79a7",
    "#f28e2b",
    "#59a14f",
    "#e15759",
    "#b07aa1",
    "#edc948",
    "#76b7b2",
    "#9c755f",
    "#ff9da7",
)


def request_colors(workload: Workload) -> dict[str, str]:
    """A colour per request id, in workload order; past the palette, evenly spread hues."""
    colors: dict[str, str] = {}
    for index, request in enumerate(workload.requests):
        if index < len(PALETTE):
            colors[request.request_id] = PALETTE[index]
            continue
        hue = (index * 0.618034) % 1.0
        red, green, blue = colorsys.hls_to_rgb(hue, 0.45, 0.6)
        channels = (round(channel * 255) for channel in (red, green, blue))
        colors[request.request_id] = "#" + "".join(f"{channel:02x}" for channel in channels)
    return colors


def page_data(results: Sequence[SimulationResult]) -> dict[str, Any]:
    """What the page embeds: the workload, a colour per request and every scenario's frames."""
    if not results:
        raise ValueError("no simulation results to draw")
    workload = results[0].workload
    if any(result.workload != workload for result in results):
        raise ValueError("every scenario on one page must run the same workload")
    return {
        "workload": workload.to_dict(),
        "colors": request_colors(workload),
        "queue_reasons": QUEUE_REASONS,
        "scenarios": [result.to_dict() for result in results],
    }


def render_html(results: Sequence[SimulationResult]) -> str:
    """One self-contained HTML page stepping through `results` side by side."""
    template = inline_components(
        resources.files("kvserve.sim").joinpath("page.html").read_text(encoding="utf-8")
    )
    # "</" inside a <script> element would end it early; JSON allows the escaped form.
    data = json.dumps(page_data(results), separators=(",", ":")).replace("</", "<\\/")
    return template.replace("__SIM_DATA__", data)


def write_html(path: str | Path, results: Sequence[SimulationResult]) -> Path:
    """Write `render_html(results)` to `path` and return the path."""
    path = Path(path)
    path.write_text(render_html(results), encoding="utf-8")
    return path


def write_png(path: str | Path, results: Sequence[SimulationResult], dpi: int = 120) -> Path:
    """A static overview: per scenario, blocks held by each request at every step (left) and
    each request's timeline from arrival to return (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    if not results:
        raise ValueError("no simulation results to draw")
    workload = results[0].workload
    colors = request_colors(workload)
    request_ids = [request.request_id for request in workload.requests]
    num_steps = max(result.num_steps for result in results)
    figure, axes = plt.subplots(
        len(results),
        2,
        figsize=(13, 2.7 * len(results) + 0.9),
        sharex="col",
        squeeze=False,
        gridspec_kw={"width_ratios": [1.15, 1.0]},
    )
    for row, result in enumerate(results):
        _draw_occupancy(axes[row][0], result, colors, request_ids, num_steps)
        _draw_timelines(axes[row][1], result, colors, num_steps)
        axes[row][0].set_title(result.scenario.title, loc="left", fontsize=10.5, weight="bold")
        axes[row][1].set_title(_headline(result), loc="left", fontsize=10)
    axes[-1][0].set_xlim(-0.6, num_steps - 0.4)
    # Room on the right for the labels after each timeline.
    axes[-1][1].set_xlim(-0.6, num_steps + 6)
    for column in (0, 1):
        axes[-1][column].set_xlabel("step")
    handles = [Patch(color=colors[request_id], label=request_id) for request_id in request_ids]
    handles += [
        Patch(facecolor="#d9dde3", label="waiting at the door"),
        Patch(facecolor="white", edgecolor="#c62828", hatch="///", label="stuck"),
    ]
    if any(outcome.preempted_steps for result in results for outcome in result.requests):
        from matplotlib.lines import Line2D

        handles.append(
            Line2D([], [], color="#c62828", marker="x", linestyle="none", label="preempted")
        )
    figure.legend(handles=handles, loc="lower center", ncol=len(handles), frameon=False)
    figure.suptitle(
        f"{len(workload.requests)} requests, {workload.num_slots} slots, "
        f"{workload.num_blocks} KV blocks of {workload.block_size} positions, prefill chunk "
        f"{workload.prefill_chunk}, at most {workload.max_num_batched_tokens} rows per step"
        + (
            f", {workload.reserve_tokens} answer positions reserved by partial reservation"
            if any(result.scenario.admission == "partial" for result in results)
            else ""
        )
        + "\n"
        "left: KV blocks each request holds at every step (dashed: the whole pool); right: "
        "each request from arrival (grey: waiting, pale: prompt, solid: answer; in steps)",
        fontsize=10.5,
    )
    figure.tight_layout(rect=(0, 0.05, 1, 0.98))
    path = Path(path)
    figure.savefig(path, dpi=dpi)
    plt.close(figure)
    return path


def _headline(result: SimulationResult) -> str:
    returned = sum(outcome.status == "returned" for outcome in result.requests)
    text = f"{returned} of {len(result.requests)} returned"
    if result.stuck_step is not None:
        text += f"; pool exhausted, stuck from step {result.stuck_step}"
    else:
        text += f" in {result.num_steps} steps"
    return text


def _draw_occupancy(
    axis: Any, result: SimulationResult, colors: dict, request_ids: list, num_steps: int
) -> None:
    from matplotlib.ticker import MaxNLocator

    steps = [frame.step for frame in result.frames]
    bottom = [0] * len(steps)
    for request_id in request_ids:
        held = [frame.block_owners.count(request_id) for frame in result.frames]
        if not any(held):
            continue
        axis.bar(steps, held, bottom=bottom, width=0.85, color=colors[request_id])
        bottom = [base + count for base, count in zip(bottom, held, strict=True)]
    num_blocks = result.workload.num_blocks
    axis.axhline(num_blocks, color="#333", linewidth=1, linestyle="--")
    axis.set_ylim(0, num_blocks * 1.18)
    axis.set_ylabel("KV blocks held")
    axis.yaxis.set_major_locator(MaxNLocator(integer=True))
    if result.stuck_step is not None:
        # Nothing changes once stuck, so the band runs to the end of the axis.
        axis.axvspan(result.stuck_step - 0.5, num_steps - 0.4, color="#c62828", alpha=0.12)
        axis.annotate(
            "pool exhausted: stuck for good",
            (result.stuck_step - 0.3, num_blocks * 1.06),
            color="#c62828",
            fontsize=9,
            weight="bold",
        )


def _draw_timelines(axis: Any, result: SimulationResult, colors: dict, num_steps: int) -> None:
    last_step = result.num_steps - 1
    labels = []
    for index, outcome in enumerate(result.requests):
        y = len(result.requests) - 1 - index
        labels.append((y, outcome.request_id))
        color = colors[outcome.request_id]
        start = outcome.arrival_step
        admitted = outcome.admitted_step
        waited_until = admitted if admitted is not None else last_step + 1
        if waited_until > start:
            axis.barh(y, waited_until - start, left=start - 0.5, color="#d9dde3", height=0.6)
        if admitted is None:
            if outcome.status == "stuck":
                _stuck_bar(axis, y, start - 0.5, num_steps - 0.5)
                axis.text(num_steps - 0.2, y, "stuck", va="center", fontsize=8, color="#c62828")
            continue
        first = outcome.first_token_step
        prefill_end = first if first is not None else last_step
        axis.barh(
            y,
            prefill_end + 1 - admitted,
            left=admitted - 0.5,
            color=color,
            alpha=0.4,
            height=0.6,
        )
        if first is not None and outcome.returned_step is not None:
            axis.barh(y, outcome.returned_step - first, left=first + 0.5, color=color, height=0.6)
        elif first is not None:
            axis.barh(y, last_step - first, left=first + 0.5, color=color, height=0.6)
        for step in outcome.preempted_steps:
            axis.plot(step, y, marker="x", color="#c62828", markersize=7, markeredgewidth=2)
        if outcome.status == "stuck":
            begin = result.stuck_step if result.stuck_step is not None else last_step
            _stuck_bar(axis, y, begin - 0.5, num_steps - 0.5)
            axis.text(num_steps - 0.2, y, "stuck", va="center", fontsize=8, color="#c62828")
        elif outcome.time_to_return is not None:
            axis.text(
                outcome.returned_step + 0.8,
                y,
                f"TTFT {outcome.time_to_first_token}, return {outcome.time_to_return}",
                va="center",
                fontsize=7.5,
                color="#333",
            )
    axis.set_yticks([y for y, _ in labels], [label for _, label in labels])
    axis.set_ylim(-0.7, len(result.requests) - 0.3)


def _stuck_bar(axis: Any, y: float, left: float, right: float) -> None:
    axis.barh(
        y,
        right - left,
        left=left,
        height=0.6,
        facecolor="none",
        edgecolor="#c62828",
        hatch="///",
        linewidth=0.8,
    )
