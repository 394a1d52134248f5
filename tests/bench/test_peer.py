"""The llama-server helper: a build found by its stamp, the server started on a free loopback
port with the asked flags, waited for, and stopped. A small script stands in for the binary."""

from __future__ import annotations

import json
import sys
import textwrap

import httpx
import pytest

from kvserve.bench import peer

FAKE_SERVER = textwrap.dedent(
    f"""\
    #!{sys.executable}
    # Answers 503 (loading) on its first /v1/models, then 200, like llama-server.
    import http.server, json, sys
    args = sys.argv[1:]
    port = int(args[args.index("--port") + 1])
    if "--fail" in args:
        print("error: cannot load the model", flush=True)
        sys.exit(3)
    asked = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            asked.append(self.path)
            ready = self.path == "/v1/models" and len(asked) > 1
            body = json.dumps({{"argv": args}}).encode()
            self.send_response(200 if ready else 503)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    http.server.HTTPServer(("127.0.0.1", port), Handler).serve_forever()
    """
)


@pytest.fixture
def fake_binary(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path / "cache"))
    binary = tmp_path / "llama-server"
    binary.write_text(FAKE_SERVER)
    binary.chmod(0o755)
    return binary


def test_a_build_is_found_only_with_its_stamp(fake_binary):
    assert peer.built_binary() is None
    assert peer.binary_path().is_relative_to(peer.peer_dir())
    with (
        pytest.raises(RuntimeError, match="python -m kvserve.bench.peer build"),
        peer.running_server("model.gguf"),
    ):
        pass
    peer.binary_path().parent.mkdir(parents=True)
    peer.binary_path().write_bytes(fake_binary.read_bytes())
    peer.binary_path().chmod(0o755)
    stamp = peer.peer_dir() / "stamp.json"
    stamp.write_text(json.dumps(peer.build_stamp()))
    assert peer.built_binary() == peer.binary_path()
    assert peer.main(["path"]) == 0
    # Built with other flags (or on another CPU): not this build.
    stamp.write_text(json.dumps({**peer.build_stamp(), "cmake_flags": ["-DGGML_NATIVE=OFF"]}))
    assert peer.built_binary() is None
    assert peer.main(["path"]) == 1


def test_the_server_starts_with_the_flags_and_is_stopped(fake_binary, tmp_path):
    model = tmp_path / "m.gguf"
    with peer.running_server(
        model, binary=fake_binary, threads=2, parallel=8, context=4096, extra_args=["--foo"]
    ) as server:
        assert server.url.startswith("http://127.0.0.1:")
        assert server.base_url == server.url + "/v1"
        answer = httpx.get(server.base_url + "/models", timeout=10)
        assert answer.status_code == 200
        argv = answer.json()["argv"]
        assert argv[argv.index("-m") + 1] == str(model)
        assert argv[argv.index("--host") + 1] == "127.0.0.1"
        assert [argv[argv.index(flag) + 1] for flag in ("-t", "-np", "-c")] == ["2", "8", "4096"]
        assert argv[-1] == "--foo"
        assert server.start_seconds > 0
        assert server.rss_bytes() > 1 << 20
        process = server.process
    assert process.poll() is not None  # stopped when the block ended
    with pytest.raises(httpx.ConnectError):
        httpx.get(server.url + "/v1/models", timeout=5)


def test_a_server_that_exits_is_reported_with_its_output(fake_binary, tmp_path):
    with (
        pytest.raises(RuntimeError, match="exited with 3(.|\n)*cannot load the model"),
        peer.running_server(tmp_path / "m.gguf", binary=fake_binary, extra_args=["--fail"]),
    ):
        pass
