"""Catalogue names where models are named: `LLM(model=NAME)`, `kvserve generate -m NAME`
(with `--pull`), `kvserve serve NAME` (served under that name). The model is the default
SmolLM2 file, split into two fake part packages of a local index and pulled from it."""

from __future__ import annotations

import hashlib
import os
import pickle
import signal
import subprocess
import sys
import textwrap

import httpx
import pytest

from kvserve import LLM, SamplingParams, hub
from kvserve.cli import main
from kvserve.model.paths import default_model_path
from tests.e2e.harness import OutputLines, free_port
from tests.hub.fake_index import build_wheel, write_simple_index

pytestmark = pytest.mark.slow

QUESTION = "What is the capital of France?"


def _entry(name: str, data: bytes) -> hub.Entry:
    return hub.Entry(
        name=name,
        description="the default model, in two parts",
        source=hub.WheelFile(hub.split_parts("smol-part{n}", 2, "1.0", "smol_part{n}/data/*.bin")),
        size=len(data),
        sha256=hashlib.sha256(data).hexdigest(),
        filename="smol.gguf",
    )


@pytest.fixture(scope="module")
def catalogue(tmp_path_factory):
    """Two catalogue names for the same parts: `fake:135m` pulled here, `fake-pull:135m`
    left for `--pull`. The environment points pip at the local index only, and the models
    directory at a temporary one; subprocesses inherit both."""
    root = tmp_path_factory.mktemp("names")
    data = default_model_path().read_bytes()
    half = len(data) // 2
    wheels = [
        build_wheel(root / "files", f"smol-part{n}", "1.0", {f"smol_part{n}/data/p.bin": piece})
        for n, piece in ((1, data[:half]), (2, data[half:]))
    ]
    index_url = write_simple_index(root / "index", wheels)
    entries = (_entry("fake:135m", data), _entry("fake-pull:135m", data))
    with pytest.MonkeyPatch.context() as patch:
        for name in list(os.environ):
            if name.startswith("PIP_"):
                patch.delenv(name)
        patch.setenv("PIP_CONFIG_FILE", os.devnull)
        patch.setenv("PIP_INDEX_URL", index_url)
        patch.setenv("KVSERVE_MODELS", str(root / "models"))
        patch.setattr(hub.catalogue, "CATALOGUE", (*hub.CATALOGUE, *entries))
        hub.pull(entries[0], progress=False)
        pickled = root / "entries.pickle"
        pickled.write_bytes(pickle.dumps(entries))
        yield pickled


def test_llm_takes_a_catalogue_name(catalogue):
    with LLM(model="fake:135m", dtype="float32", max_num_seqs=2, max_model_len=512) as llm:
        assert llm.engine.loaded.name == "fake:135m"
        assert llm.engine.loaded.path == hub.location(hub.lookup("fake:135m"))
        (output,) = llm.chat([{"role": "user", "content": QUESTION}], SamplingParams(max_tokens=12))
    assert "Paris" in output.outputs[0].text


def test_generate_pulls_with_pull_then_answers(catalogue, capsys):
    assert hub.present(hub.lookup("fake-pull:135m")) is None
    argv = ["generate", QUESTION, "-m", "fake-pull:135m", "--max-tokens", "12"]
    argv += ["--num-kv-blocks", "16", "--max-num-seqs", "1", "--max-model-len", "256"]
    argv += ["--quantization", "none", "--dtype", "float32"]  # no weights to prepare
    assert main([*argv, "--pull"]) == 0
    out, err = capsys.readouterr()
    assert "pulling fake-pull:135m" in err and "100%" in err
    assert "Paris" in out
    assert hub.present(hub.lookup("fake-pull:135m")) is not None


def test_serve_serves_a_catalogue_model_under_its_name(catalogue):
    port = free_port()
    code = textwrap.dedent(
        f"""
        import pickle, sys
        from kvserve.hub import catalogue
        catalogue.CATALOGUE += pickle.loads(open({str(catalogue)!r}, "rb").read())
        from kvserve.cli import main
        sys.exit(main(["serve", "fake:135m", "--host", "127.0.0.1", "--port", "{port}",
                       "--num-kv-blocks", "16", "--max-num-seqs", "1",
                       "--max-model-len", "256", "--quantization", "none",
                       "--dtype", "float32"]))
        """
    )
    process = subprocess.Popen(
        [sys.executable, "-c", code],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    try:
        stdout = OutputLines(process.stdout)
        stdout.wait_for("listening on", timeout=240)
        assert "kvserve: serving 'fake:135m'" in "".join(stdout.lines)
        url = f"http://127.0.0.1:{port}"
        models = httpx.get(url + "/v1/models", timeout=30).json()
        assert [m["id"] for m in models["data"]] == ["fake:135m"]
        question = {
            "model": "fake:135m",
            "messages": [{"role": "user", "content": QUESTION}],
            "max_tokens": 12,
            "temperature": 0,
        }
        reply = httpx.post(url + "/v1/chat/completions", json=question, timeout=60)
        assert reply.status_code == 200, reply.text
        assert "Paris" in reply.json()["choices"][0]["message"]["content"]
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=60) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
