"""The admission benchmark's pieces that need no server: the scheduler-only sweep over the
first part reserved, and the table (a smoke run against servers is in the report of a run)."""

from __future__ import annotations

from kvserve.bench.admission_bench import (
    TOPICS,
    AdmissionRun,
    chat_questions,
    format_admission_table,
    format_sweep,
    sweep_reserve_tokens,
)
from kvserve.bench.loadgen import BenchConfig, BenchResult, LatencyStats


def test_a_larger_first_part_preempts_less_and_recomputes_less() -> None:
    points = sweep_reserve_tokens(
        (8, 512), (2_000,), concurrency=8, num_requests=24, max_model_len=1_024
    )
    small, large = points
    assert small.num_preemptions > large.num_preemptions
    assert small.rows_per_token > large.rows_per_token >= 0.99
    assert small.mean_running > large.mean_running  # ... and admits more at once
    assert "| 2000 | 8 |" in format_sweep(points)


def run(admission: str, tok_s: float) -> AdmissionRun:
    ttft = LatencyStats(1, 0.5, 0.5, 0.5, 0.0)
    result = BenchResult(
        BenchConfig(num_prompts=1, output_len=None), "now", 1.0, 1, 0, 0, 0, {}, 40, 90,
        1.0, tok_s, None, ttft, None, None, None, [],
    )  # fmt: skip
    return AdmissionRun(admission, result, 8192, 256, 1000, 32, 2**20, peak_running=7)


def test_the_table_gives_each_policy_and_the_ratio() -> None:
    table = format_admission_table([run("partial", 90.0), run("reserve", 30.0)], 64)
    assert "| partial | 90.0 |" in table and "| reserve | 30.0 |" in table
    assert "partial/reserve out tok/s: 3.00x" in table
    # Reserving whole answers of a request without max_tokens takes full contexts.
    assert "| 16.00 GiB |" in table  # 64 x 8192 / 32 blocks of 1 MiB


def test_the_chats_are_distinct_short_questions_one_per_stream() -> None:
    questions = chat_questions()
    assert len(set(questions)) == len(questions) == len(TOPICS) == 64
    assert all(q.startswith("In two or three sentences: what is ") for q in questions)
