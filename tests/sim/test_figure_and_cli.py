"""The page embeds the simulator's own data and nothing from the network; the PNG draws every
request; `kvserve simulate` prints the tables, writes the files and applies its flags."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import pytest
from PIL import Image

from kvserve.cli import main
from kvserve.sim import DEFAULT_WORKLOAD, SCENARIOS, RequestSpec, Workload, simulate_all
from kvserve.sim.figure import page_data, render_html, request_colors, write_png

DATA_OPEN = '<script id="sim-data" type="application/json">'


def embedded_data(html: str) -> dict:
    start = html.index(DATA_OPEN) + len(DATA_OPEN)
    end = html.index("</script>", start)
    return json.loads(html[start:end])


def test_the_page_embeds_the_runs_and_needs_no_network() -> None:
    results = simulate_all(DEFAULT_WORKLOAD)
    html = render_html(results)
    assert "http://" not in html and "https://" not in html and "//cdn" not in html
    assert not re.search(r"<(script|img|iframe)[^>]*\bsrc\s*=", html)
    assert "<link" not in html and "@import" not in html
    data = embedded_data(html)
    assert data == json.loads(json.dumps(page_data(results)))
    assert [s["scenario"]["name"] for s in data["scenarios"]] == [s.name for s in SCENARIOS]
    for scenario, result in zip(data["scenarios"], results, strict=True):
        assert len(scenario["frames"]) == result.num_steps
        assert scenario["stuck_step"] == result.stuck_step


def test_text_that_looks_like_markup_cannot_end_the_data_early() -> None:
    workload = replace(DEFAULT_WORKLOAD, description="</script><script>alert(1)</script>")
    html = render_html(simulate_all(workload))
    assert embedded_data(html)["workload"]["description"] == workload.description


def test_the_png_draws_every_request(tmp_path: Path) -> None:
    path = write_png(tmp_path / "overview.png", simulate_all(DEFAULT_WORKLOAD))
    image = Image.open(path).convert("RGB")
    assert image.width > 800 and image.height > 500
    present = {color for _, color in image.getcolors(maxcolors=1 << 20)}
    for request_id, hex_color in request_colors(DEFAULT_WORKLOAD).items():
        rgb = tuple(int(hex_color[i : i + 2], 16) for i in (1, 3, 5))
        assert rgb in present, request_id


def test_colors_stay_distinct_past_the_palette() -> None:
    requests = tuple(RequestSpec(f"q{i}", i, 2, 2) for i in range(25))
    colors = request_colors(Workload(requests=requests))
    assert len(set(colors.values())) == 25
    assert all(re.fullmatch(r"#[0-9a-f]{6}", color) for color in colors.values())


def test_simulate_prints_a_table_per_scenario(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate"]) == 0
    out = capsys.readouterr().out
    results = simulate_all(DEFAULT_WORKLOAD)
    for result in results:
        assert result.scenario.title in out
    stuck = [result for result in results if result.stuck_step is not None]
    assert [result.scenario.name for result in stuck] == ["slot-only"]
    assert f"stuck at step {stuck[0].stuck_step}" in out
    for request in DEFAULT_WORKLOAD.requests:
        found = re.findall(rf"^\s+{request.request_id}\s", out, flags=re.MULTILINE)
        assert len(found) == len(SCENARIOS)


def test_simulate_writes_the_page_and_the_png(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    html, png = tmp_path / "sim.html", tmp_path / "sim.png"
    assert main(["simulate", "--quiet", "--html", str(html), "--png", str(png)]) == 0
    assert embedded_data(html.read_text())["workload"] == DEFAULT_WORKLOAD.to_dict()
    assert Image.open(png).format == "PNG"
    assert "stuck at step" not in capsys.readouterr().out  # --quiet: no tables


def test_flags_override_the_workload(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert (
        main(["simulate", "--print-workload", "--num-kv-blocks", "40", "--max-num-seqs", "2"]) == 0
    )
    printed = Workload.from_dict(json.loads(capsys.readouterr().out))
    assert printed == replace(DEFAULT_WORKLOAD, num_blocks=40, num_slots=2)
    # A pool large enough for every answer at once: slot-only admission no longer gets stuck.
    assert main(["simulate", "--scenario", "slot-only", "--num-kv-blocks", "40"]) == 0
    out = capsys.readouterr().out
    assert "stuck" not in out and "free slot alone" in out and "reserve at admission" not in out
    path = tmp_path / "workload.json"
    path.write_text(json.dumps(printed.to_dict()))
    assert main(["simulate", "--workload", str(path), "--print-workload"]) == 0
    assert Workload.from_dict(json.loads(capsys.readouterr().out)) == printed


def test_a_bad_workload_file_is_reported(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"requests": [{"arrival_step": 0}]}))
    assert main(["simulate", "--workload", str(path)]) == 2
    assert "kvserve simulate:" in capsys.readouterr().err
    assert main(["simulate", "--workload", str(tmp_path / "missing.json")]) == 2
