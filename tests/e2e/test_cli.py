"""`kvserve serve` as a subprocess: banner, flags from the environment, a request answered,
and a clean stop on SIGINT / SIGTERM with a stream in flight."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from kvserve.model.kernels import load_kernels
from kvserve.model.loader import cpu_has_bf16
from tests.e2e.harness import OutputLines, free_port

pytestmark = pytest.mark.slow

API_KEY = "cli-test-key"


def test_the_port_accepts_connections_before_the_heavy_imports(tmp_path):
    """`kvserve serve` listens before it imports torch and the engine: a client that connects
    meanwhile waits in the backlog and is answered, never refused."""
    port = free_port()
    go = tmp_path / "go"
    held = tmp_path / "held"
    code = f"""
import importlib.abc, os, pathlib, sys, time

class HoldTheEngine(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "kvserve.engine.engine":
            pathlib.Path({str(held)!r}).touch()
            while not os.path.exists({str(go)!r}):
                time.sleep(0.02)
        return None

sys.meta_path.insert(0, HoldTheEngine())
from kvserve.cli import main
sys.exit(main(["serve", "--host", "127.0.0.1", "--port", "{port}",
               "--num-kv-blocks", "16", "--max-num-seqs", "1", "--max-model-len", "256"]))
"""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    process = subprocess.Popen(
        [sys.executable, "-c", code],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        deadline = time.monotonic() + 120
        while not held.exists():  # the engine's import has started and is held there
            assert process.poll() is None, process.stderr.read()
            assert time.monotonic() < deadline, "the engine import was never reached"
            time.sleep(0.02)
        # The engine is not imported yet, and the port already takes a connection.
        client = socket.create_connection(("127.0.0.1", port), timeout=120)
        with client:
            client.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n")
            go.touch()
            head = client.recv(4096).decode()
        assert head.startswith("HTTP/1.1 200"), head
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=120) == 0
    finally:
        go.touch()
        if process.poll() is None:
            process.kill()
            process.wait()


def test_a_stop_while_the_model_loads_exits_cleanly(tmp_path):
    """SIGINT while the model is still loading (held inside the load, in its thread): the
    process stops at once with status 0, without waiting for the load or aborting."""
    port = free_port()
    held = tmp_path / "held"
    code = f"""
import importlib.abc, pathlib, sys, threading, time

class HoldTheLoad(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "kvserve.model.gguf" and threading.current_thread() is not threading.main_thread():
            pathlib.Path({str(held)!r}).touch()
            while True:
                time.sleep(1)
        return None

sys.meta_path.insert(0, HoldTheLoad())
from kvserve.cli import main
sys.exit(main(["serve", "--host", "127.0.0.1", "--port", "{port}",
               "--num-kv-blocks", "16", "--max-num-seqs", "1", "--max-model-len", "256"]))
"""
    process = subprocess.Popen(
        [sys.executable, "-c", code],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    try:
        deadline = time.monotonic() + 120
        while not held.exists():
            assert process.poll() is None, process.stderr.read()
            assert time.monotonic() < deadline, "the load was never reached"
            time.sleep(0.02)
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
            assert client.get("/health").status_code == 200
            ready = client.get("/ready")
            assert ready.status_code == 503 and ready.json()["status"] == "loading"
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=60) == 0, process.stderr.read()
        assert "stopped while the model was loading" in process.stderr.read()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


@pytest.mark.parametrize(
    ("stop_signal", "int8"),
    [(signal.SIGINT, True), (signal.SIGTERM, False)],
    ids=["SIGINT-no-flags", "SIGTERM-quantization-none"],
)
def test_serve_subprocess(stop_signal, int8):
    port = free_port()
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        # Flags from the environment, as KVSERVE_<NAME>.
        "KVSERVE_API_KEY": API_KEY,
        "KVSERVE_NUM_KV_BLOCKS": "64",
        "KVSERVE_MAX_NUM_SEQS": "2",
        "KVSERVE_DEVICE": "cpu",
        # No drain: the stream in flight at the signal is ended by the engine's stop.
        "KVSERVE_SHUTDOWN_TIMEOUT": "0",
    }
    for name in ("KVSERVE_QUANTIZATION", "KVSERVE_KV_CACHE_DTYPE"):
        env.pop(name, None)
    if not int8:  # no flags is int8 on a CPU with the kernels; this asks for the float path
        env |= {"KVSERVE_QUANTIZATION": "none", "KVSERVE_KV_CACHE_DTYPE": "model"}
    process = subprocess.Popen(
        [sys.executable, "-m", "kvserve", "serve", "--port", str(port), "--max-model-len", "1024"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    stderr_lines: list[str] = []
    threading.Thread(target=lambda: stderr_lines.extend(process.stderr), daemon=True).start()
    try:
        stdout = OutputLines(process.stdout)
        url_line = stdout.wait_for("listening on", timeout=240)
        url = f"http://127.0.0.1:{port}"
        assert url in url_line
        banner = "".join(stdout.lines)
        assert "KV pool: 64 blocks x 32 positions" in banner
        assert "holds 2.0 full contexts of 1024 positions, or 8 typical answers of 256" in banner
        assert "admission: partial (the prompt and the first 256 answer positions" in banner
        assert "SmolLM2" in banner
        assert "shutdown: running requests get 0 s to finish; no CORS" in banner
        # The start's split and the memory plan, the pool's share read off its own line.
        assert re.search(
            r"started in [0-9.]+ s: kernels [0-9.]+ s, read [0-9.]+ s, weights and tokenizer [0-9.]+ s \(",
            banner,
        )
        plan = re.search(r"memory plan: weights ([0-9,]+) MiB \(([0-9.]+)x the file's", banner)
        assert plan and int(plan[1].replace(",", "")) > 0
        pool_bytes = int(re.search(r"pool bytes: .* = ([0-9]+) bytes", banner)[1])
        assert f"+ KV pool {pool_bytes / 2**20:,.0f} MiB + working buffers about" in banner

        assert httpx.get(url + "/ready").status_code == 200
        payload = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}
        assert httpx.post(url + "/v1/chat/completions", json=payload).status_code == 401
        headers = {"Authorization": f"Bearer {API_KEY}"}
        reply = httpx.post(url + "/v1/chat/completions", json=payload, headers=headers, timeout=60)
        assert reply.status_code == 200
        assert reply.json()["usage"]["completion_tokens"] <= 3
        question = {
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 12,
            "temperature": 0,
        }
        reply = httpx.post(url + "/v1/chat/completions", json=question, headers=headers, timeout=60)
        assert "Paris" in reply.json()["choices"][0]["message"]["content"]
        assert ("+ int8" in banner) == int8
        assert "CPU kernels for " in banner and "layers: " in banner
        # The CPU's own float dtype: bf16 where it multiplies bf16 natively, else float32.
        dtype = "bfloat16" if cpu_has_bf16() else "float32"
        if int8:  # the banner says what auto chose, and why, in one line
            assert "precision: linear layers int8 (auto: the checkpoint is quantized" in banner
            cache = "int8" if load_kernels().kv_int8 else dtype
            assert f"KV cache {cache} (auto:" in banner
        else:
            assert f"precision: linear layers {dtype} (asked for); KV cache {dtype}" in banner

        # A stream in flight when the signal arrives, with no time to finish, ends with an
        # error event and [DONE].
        long = {**payload, "max_tokens": 500, "ignore_eos": True, "stream": True}
        with httpx.stream(
            "POST", url + "/v1/chat/completions", json=long, headers=headers, timeout=60
        ) as response:
            assert response.status_code == 200
            events = []
            for line in response.iter_lines():
                if not line.startswith("data: "):
                    continue
                events.append(line.removeprefix("data: "))
                if len(events) == 3:
                    process.send_signal(stop_signal)
        assert events[-1] == "[DONE]"
        assert "shutting down" in json.loads(events[-2])["error"]["message"]
        assert process.wait(timeout=60) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert not any("Traceback" in line for line in stderr_lines), "".join(stderr_lines)
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{port}/health")


def test_serve_starts_warns_once_and_answers_with_an_unwritable_kernel_cache(tmp_path):
    """$KVSERVE_CACHE_DIR where nothing can be written (under a regular file, which even root
    cannot make a directory of): the kernels are built in a temporary directory instead, one
    warning says so, and the server answers; /ready names what was built and for which CPU."""
    blocker = tmp_path / "read-only"
    blocker.write_text("a file, not a directory")
    port = free_port()
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "KVSERVE_CACHE_DIR": str(blocker / "cache"),
        "KVSERVE_NUM_KV_BLOCKS": "16",
        "KVSERVE_MAX_NUM_SEQS": "1",
    }
    process = subprocess.Popen(
        [sys.executable, "-m", "kvserve", "serve", "--port", str(port), "--max-model-len", "256"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    stderr_lines: list[str] = []
    threading.Thread(target=lambda: stderr_lines.extend(process.stderr), daemon=True).start()
    try:
        OutputLines(process.stdout).wait_for("listening on", timeout=300)
        url = f"http://127.0.0.1:{port}"
        ready = httpx.get(url + "/ready").json()
        assert ready["status"] == "ready" and ready["kernels"]["families"]
        assert ready["kernels"]["cpu_extensions"] == list(load_kernels().cpu_extensions)
        question = {
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 12,
            "temperature": 0,
        }
        reply = httpx.post(url + "/v1/chat/completions", json=question, timeout=120)
        assert "Paris" in reply.json()["choices"][0]["message"]["content"]
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=60) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    warnings = [line for line in stderr_lines if "cannot be written" in line]
    assert len(warnings) == 1, "".join(stderr_lines)
    assert str(blocker / "cache" / "kernels") in warnings[0]


def test_serve_an_embedding_model_directory(minilm_dir):
    port = free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "KVSERVE_DEVICE": "cpu"}
    process = subprocess.Popen(
        [sys.executable, "-m", "kvserve", "serve", str(minilm_dir), "--port", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    try:
        stdout = OutputLines(process.stdout)
        stdout.wait_for("listening on", timeout=240)
        banner = "".join(stdout.lines)
        assert "for embeddings (it generates no text)" in banner
        assert "384 dimensions, mean pooling, normalized, inputs up to 256 tokens" in banner
        url = f"http://127.0.0.1:{port}"
        answer = httpx.post(url + "/v1/embeddings", json={"input": ["a", "b"]}, timeout=60)
        assert answer.status_code == 200 and len(answer.json()["data"]) == 2
        chat = {"messages": [{"role": "user", "content": "Hi"}]}
        refused = httpx.post(url + "/v1/chat/completions", json=chat, timeout=60)
        assert refused.status_code == 400 and "embedding model" in refused.text
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=60) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
