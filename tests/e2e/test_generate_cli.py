"""`kvserve generate`: the terminal command answers, token by token."""

from __future__ import annotations

import argparse
import io
import os
import subprocess
import sys

from kvserve.engine import generate_cli


def test_generate_answers_the_capital_of_france():
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvserve",
            "generate",
            "What is the capital of France?",
            "--max-tokens",
            "32",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout
    assert "prompt tokens" in result.stderr  # the closing usage line


def test_generate_writes_each_delta_as_it_comes(monkeypatch, loaded_default):
    """The answer reaches stdout in many flushed writes, not one block at the end."""
    import kvserve.engine.llm as llm_module

    writes: list[str] = []

    class Recorder(io.StringIO):
        def write(self, text: str) -> int:
            writes.append(text)
            return len(text)

        def flush(self) -> None:
            writes.append("<flush>")

    real_llm = llm_module.LLM
    monkeypatch.setattr(
        llm_module, "LLM", lambda config=None: real_llm(config=config, loaded=loaded_default)
    )
    monkeypatch.setattr(sys, "stdout", Recorder())
    parser = argparse.ArgumentParser()
    generate_cli.add_arguments(parser)
    args = parser.parse_args(["Name three colours.", "--max-tokens", "12"])
    assert generate_cli.run(args) == 0
    text_writes = [w for w in writes if w not in ("<flush>", "\n", "")]
    assert len(text_writes) >= 5
    # every piece of text is followed by a flush before the next one is written
    for i, w in enumerate(writes[:-1]):
        if w not in ("<flush>", "\n", ""):
            assert writes[i + 1] == "<flush>"
