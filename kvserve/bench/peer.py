"""llama.cpp's `llama-server`, the peer the benchmarks run beside kvserve on the same file.

Built once from the `llama-cpp-python` sdist's vendored llama.cpp (a pinned, reproducible
source that PyPI serves): cmake Release, `GGML_NATIVE=ON` (this CPU's instruction set),
`LLAMA_CURL=OFF`, `LLAMA_OPENSSL=OFF`, static libraries so the one binary runs from anywhere,
no web UI (its assets would be downloaded).
The binary lands in `<user cache dir>/peer/llama-cpp-python-<version>/bin/llama-server`
beside a stamp of what it was built from (version, flags, the CPU's flags); a later `build`
with the same stamp returns it at once. Sources and build tree are deleted after the build.

    python -m kvserve.bench.peer build          # ~10 min on 2 cores; prints the binary's path
    python -m kvserve.bench.peer path           # the path, or exit 1 if not built
    python -m kvserve.bench.peer serve MODEL.gguf -- -c 16384   # try it by hand

Benchmarks start it with `running_server(model, threads=2, parallel=8, context=N)`, which
picks a free 127.0.0.1 port, waits until `/v1/models` answers, yields a `PeerServer` (URL,
start seconds, resident memory) and stops the process after.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from kvserve.model.paths import user_cache_dir

LLAMA_CPP_PYTHON_VERSION = "0.3.36"
CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=ON",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    # Nothing downloaded at configure time: without these llama.cpp's cmake fetches the web
    # UI's assets from a Hugging Face bucket, and the examples' test models.
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
)
TARGET = "llama-server"


def peer_dir(version: str = LLAMA_CPP_PYTHON_VERSION) -> Path:
    """Where the built server of llama-cpp-python `version` lives."""
    return user_cache_dir() / "peer" / f"llama-cpp-python-{version}"


def binary_path(version: str = LLAMA_CPP_PYTHON_VERSION) -> Path:
    """The path `build` writes the binary to (built or not)."""
    return peer_dir(version) / "bin" / TARGET


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return " ".join(sorted(line.split(":", 1)[1].split()))
    except OSError:
        pass
    return ""


def build_stamp(version: str = LLAMA_CPP_PYTHON_VERSION) -> dict:
    """What a binary was built from. GGML_NATIVE compiles for this CPU, so its flags belong
    here: a cache directory shared with another machine rebuilds rather than crash there."""
    return {
        "llama_cpp_python": version,
        "cmake_flags": list(CMAKE_FLAGS),
        "target": TARGET,
        "cpu_flags": hashlib.sha256(_cpu_flags().encode()).hexdigest()[:16],
    }


def built_binary(version: str = LLAMA_CPP_PYTHON_VERSION) -> Path | None:
    """The binary when it was built here from the same stamp, else None."""
    binary = binary_path(version)
    stamp = peer_dir(version) / "stamp.json"
    try:
        if json.loads(stamp.read_text()) != build_stamp(version):
            return None
    except (OSError, ValueError):
        return None
    return binary if os.access(binary, os.X_OK) else None


def _run(argv: Sequence[str], log, **kwargs) -> None:
    log(f"$ {' '.join(map(str, argv))}")
    subprocess.run(list(map(str, argv)), check=True, **kwargs)


def _source_tree(sdist: Path, into: Path) -> Path:
    """Unpack the sdist (data only: no links out of `into`, no devices) and return its
    vendored llama.cpp."""
    with tarfile.open(sdist) as archive:
        archive.extractall(into, filter="data")
    found = sorted(into.glob("*/vendor/llama.cpp/CMakeLists.txt"))
    if not found:
        raise RuntimeError(f"{sdist.name} holds no vendor/llama.cpp")
    return found[0].parent


def build(
    version: str = LLAMA_CPP_PYTHON_VERSION,
    *,
    jobs: int | None = None,
    force: bool = False,
    log=print,
) -> Path:
    """Build `llama-server` from the llama-cpp-python `version` sdist unless it is built
    already (same stamp); returns the binary's path. Concurrent builds wait for each other
    (a lock file) and then find the binary built."""
    home = peer_dir(version)
    home.mkdir(parents=True, exist_ok=True)
    with open(home / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        found = built_binary(version)
        if found is not None and not force:
            return found
        started = time.monotonic()
        with tempfile.TemporaryDirectory(dir=home, prefix="build-") as work:
            work_dir = Path(work)
            # --no-binary: the source distribution, whose vendor/ holds llama.cpp.
            _run(
                [
                    sys.executable,
                    "-m",
                    "pip",
                    "download",
                    "--no-deps",
                    "--no-binary",
                    ":all:",
                    "--disable-pip-version-check",
                    "-d",
                    work_dir,
                    f"llama-cpp-python=={version}",
                ],
                log,
            )
            (sdist,) = work_dir.glob("llama_cpp_python-*.tar.gz")
            source = _source_tree(sdist, work_dir / "src")
            build_dir = work_dir / "build"
            generator = ["-G", "Ninja"] if shutil.which("ninja") else []
            _run(["cmake", "-S", source, "-B", build_dir, *generator, *CMAKE_FLAGS], log)
            _run(
                [
                    "cmake",
                    "--build",
                    build_dir,
                    "--target",
                    TARGET,
                    "--parallel",
                    str(jobs or os.cpu_count() or 1),
                ],
                log,
            )
            built = build_dir / "bin" / TARGET
            binary = binary_path(version)
            binary.parent.mkdir(parents=True, exist_ok=True)
            partial = binary.with_name(binary.name + ".partial")
            shutil.copy2(built, partial)
            os.replace(partial, binary)
        (home / "stamp.json").write_text(json.dumps(build_stamp(version), indent=1) + "\n")
        log(f"built {binary} in {time.monotonic() - started:.0f} s")
        return binary


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class PeerServer:
    """A running llama-server: where it listens and what it costs."""

    process: subprocess.Popen
    url: str  # http://127.0.0.1:PORT
    start_seconds: float  # from the process's start until /v1/models answered
    argv: list[str]

    @property
    def base_url(self) -> str:
        """The OpenAI base URL."""
        return self.url + "/v1"

    def rss_bytes(self) -> int:
        """The process's resident memory now (VmRSS)."""
        with open(f"/proc/{self.process.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        raise RuntimeError("no VmRSS line")


def server_argv(
    binary: Path,
    model: Path,
    port: int,
    *,
    threads: int,
    parallel: int,
    context: int,
    extra_args: Sequence[str] = (),
) -> list[str]:
    """llama-server's command line. `-c` is the context of all slots together: each of the
    `parallel` slots gets context / parallel positions."""
    return [
        str(binary),
        "-m",
        str(model),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "-t",
        str(threads),
        "-np",
        str(parallel),
        "-c",
        str(context),
        *extra_args,
    ]


@contextlib.contextmanager
def running_server(
    model: str | Path,
    *,
    threads: int = 2,
    parallel: int = 8,
    context: int = 16384,
    extra_args: Sequence[str] = (),
    binary: Path | None = None,
    timeout: float = 300.0,
) -> Iterator[PeerServer]:
    """llama-server on `model` on a free loopback port, answering `/v1/models`; stopped (SIGTERM,
    then SIGKILL after 30 s) when the block ends. Its output goes to a temporary file, shown when
    it fails to start. `binary` defaults to the built one (RuntimeError if not built: run
    `python -m kvserve.bench.peer build`)."""
    binary = binary or built_binary()
    if binary is None:
        raise RuntimeError(
            f"llama-server is not built: run `python -m kvserve.bench.peer build` "
            f"(it goes to {binary_path()})"
        )
    port = free_port()
    argv = server_argv(
        binary,
        Path(model),
        port,
        threads=threads,
        parallel=parallel,
        context=context,
        extra_args=extra_args,
    )
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryFile() as output:
        started = time.monotonic()
        process = subprocess.Popen(argv, stdout=output, stderr=subprocess.STDOUT)
        try:
            try:
                _wait_until_answering(process, url, timeout)
            except RuntimeError as exc:
                output.seek(0)
                tail = output.read().decode(errors="replace")[-3000:]
                raise RuntimeError(f"{exc}; its output ends:\n{tail}") from None
            yield PeerServer(process, url, time.monotonic() - started, argv)
        finally:
            _stop(process)


def _wait_until_answering(process: subprocess.Popen, url: str, timeout: float) -> None:
    """Poll /v1/models until 200 (llama-server answers 503 while it loads)."""
    deadline = time.monotonic() + timeout
    with httpx.Client(timeout=5) as client:
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"llama-server exited with {process.returncode}")
            try:
                if client.get(url + "/v1/models").status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"llama-server did not answer within {timeout:g} s")
            time.sleep(0.05)


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is not None:
        return
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kvserve.bench.peer", description=__doc__.splitlines()[0]
    )
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="build llama-server (once) and print its path")
    b.add_argument("--jobs", type=int, default=None, help="parallel compile jobs (default: cores)")
    b.add_argument("--force", action="store_true", help="rebuild even when built")
    sub.add_parser("path", help="print the built binary's path (exit 1 when not built)")
    s = sub.add_parser("serve", help="run the built llama-server on a model until Ctrl-C")
    s.add_argument("model")
    s.add_argument("-t", "--threads", type=int, default=2)
    s.add_argument("-np", "--parallel", type=int, default=8)
    s.add_argument("-c", "--context", type=int, default=16384)
    s.add_argument("extra", nargs="*", help="more llama-server flags (after --)")
    args = parser.parse_args(argv)
    if args.command == "build":

        def log(line: str) -> None:
            print(line, file=sys.stderr, flush=True)

        print(build(jobs=args.jobs, force=args.force, log=log))
        return 0
    if args.command == "path":
        found = built_binary()
        if found is None:
            print(f"not built (would be {binary_path()})", file=sys.stderr)
            return 1
        print(found)
        return 0
    with running_server(
        args.model,
        threads=args.threads,
        parallel=args.parallel,
        context=args.context,
        extra_args=args.extra,
    ) as server:
        print(
            f"llama-server on {server.url} (answered after {server.start_seconds:.1f} s, "
            f"{server.rss_bytes() / 2**20:.0f} MiB resident); Ctrl-C stops it",
            flush=True,
        )
        with contextlib.suppress(KeyboardInterrupt):
            server.process.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
