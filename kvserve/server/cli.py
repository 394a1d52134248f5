"""`kvserve serve [MODEL]`: the HTTP server (OpenAI's, Anthropic's and Ollama's APIs) on
uvicorn. An encoder directory (a BERT-family sentence embedder) is served for embeddings only.

Every flag is also an environment variable `KVSERVE_<NAME>` (`--api-key` is `KVSERVE_API_KEY`).
The engine flags are the ones every engine command shares (`kvserve.cli.add_engine_arguments`);
the HTTP ones are added here.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
from typing import TYPE_CHECKING

from kvserve.cli import (
    add_engine_arguments,
    engine_config_from_args,
    parse_size,
    resolve_model_argument,
)
from kvserve.config import ServerConfig, env_default, parse_origins
from kvserve.server.tools import TOOL_CALL_PARSERS

if TYPE_CHECKING:  # the engine imports torch; `kvserve serve --help` should not
    from kvserve.engine.engine import Engine

__all__ = ["add_arguments", "banner", "run"]

log = logging.getLogger("kvserve.server")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The engine flags (positional MODEL first) plus the server's own."""
    add_engine_arguments(parser)
    e = env_default
    defaults = ServerConfig()
    g = parser.add_argument_group("server")
    g.add_argument("--host", default=e("--host", defaults.host), help="address to listen on")
    g.add_argument("--port", type=int, default=e("--port", defaults.port, int))
    g.add_argument(
        "--served-model-name",
        default=e("--served-model-name", None),
        help="the model name clients send and /v1/models lists (default: the model's name)",
    )
    g.add_argument(
        "--api-key",
        default=e("--api-key", None),
        help="require 'Authorization: Bearer KEY' or 'x-api-key: KEY' on the API "
        "(health, ready, metrics stay open)",
    )
    g.add_argument(
        "--max-body-bytes",
        type=parse_size,
        default=e("--max-body-bytes", defaults.max_body_bytes, parse_size),
        help="largest request body accepted, e.g. 8MiB (larger: 413)",
    )
    g.add_argument(
        "--shutdown-timeout",
        type=float,
        default=e("--shutdown-timeout", defaults.shutdown_timeout, float),
        help="seconds SIGTERM/SIGINT lets running requests finish before the rest end with an "
        "error (new requests get 503 meanwhile; a second signal stops at once)",
    )
    g.add_argument(
        "--allowed-origins",
        metavar="ORIGIN[,ORIGIN...]",
        default=e("--allowed-origins", None),
        help="origins browsers may call the API from (CORS), e.g. https://app.example.com; "
        "'*' for any (refused with --api-key); default: no CORS headers",
    )
    g.add_argument(
        "--log-level",
        default=e("--log-level", defaults.log_level),
        choices=("debug", "info", "warning", "error"),
    )
    g.add_argument(
        "--tool-call-parser",
        default=e("--tool-call-parser", None),
        choices=["auto", *sorted(TOOL_CALL_PARSERS)],
        help="how the model's tool calls are read: auto (default) by the chat template's "
        "family (Hermes/Qwen <tool_call>, Llama 3 JSON, Mistral [TOOL_CALLS])",
    )


def server_config_from_args(args: argparse.Namespace) -> ServerConfig:
    """The HTTP settings from parsed flags."""
    return ServerConfig(
        host=args.host,
        port=args.port,
        served_model_name=args.served_model_name,
        api_key=args.api_key or None,
        max_body_bytes=args.max_body_bytes,
        log_level=args.log_level,
        tool_call_parser=args.tool_call_parser,
        shutdown_timeout=args.shutdown_timeout,
        allowed_origins=parse_origins(args.allowed_origins),
    )


def banner(engine: Engine, model_name: str, url: str, server_config: ServerConfig) -> str:
    """The start-up lines: the model, the KV pool arithmetic, limits, and where to connect."""
    config = engine.config
    if not engine.generates:
        slots = config.scheduler.max_num_seqs
        return "\n".join(
            [
                f"kvserve: serving '{model_name}' for embeddings (it generates no text)",
                f"  model: {engine.loaded.summary()}",
                f"  queue: {slots * (1 + config.queue.max_queue_per_slot)} requests, wait "
                f"budget {config.queue.queue_timeout:g} s, "
                f"{config.scheduler.max_num_batched_tokens} tokens per forward pass",
                f"  API key: {'required' if server_config.api_key else 'not required'}",
                f"  {_lifecycle(server_config)}",
                f"  listening on {url}  (OpenAI base URL: {url}/v1; Ollama host: {url})",
            ]
        )
    pool = engine.pool_size
    slots = config.scheduler.max_num_seqs
    return "\n".join(
        [
            f"kvserve: serving '{model_name}'",
            f"  model: {engine.loaded.summary()}",
            f"  {engine.describe_precision()}",
            f"  {engine.describe_start()}",
            f"  memory plan: {engine.describe_memory()}",
            f"  {engine.loaded.describe_kernels()}",
            f"  {pool.describe()}",
            f"  pool bytes: {pool.num_blocks} blocks x {pool.bytes_per_block} bytes "
            f"= {pool.num_bytes} bytes; "
            + pool.capacity(engine.max_model_len, config.scheduler.reserve_tokens),
            f"  admission: {_admission(config.scheduler)}",
            f"  {_speculation(config.speculative)}",
            f"  slots: {slots}, queue: {config.queue.max_queue_per_slot} per slot "
            f"({slots * config.queue.max_queue_per_slot} waiters), wait budget "
            f"{config.queue.queue_timeout:g} s, max model len {engine.max_model_len}",
            f"  API key: {'required' if server_config.api_key else 'not required'}",
            f"  {_lifecycle(server_config)}",
            f"  listening on {url}  (OpenAI base URL: {url}/v1; Ollama host: {url})",
        ]
    )


def _lifecycle(server_config: ServerConfig) -> str:
    origins = server_config.allowed_origins
    cors = f"CORS for {', '.join(origins)}" if origins else "no CORS"
    return f"shutdown: running requests get {server_config.shutdown_timeout:g} s to finish; {cors}"


def _speculation(spec) -> str:
    if spec is None:
        return "speculative decoding: off (--speculative-config turns it on)"
    return spec.describe()


def _admission(scheduler) -> str:
    if scheduler.admission == "partial":
        return (
            f"partial (the prompt and the first {scheduler.reserve_tokens} answer positions "
            "reserved; answers grow from the free pool, the latest arrival preempted by "
            "recompute when it runs dry)"
        )
    return "reserve (the prompt and the whole answer budget reserved at admission)"


def listen(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port (an IPv6 host when it holds a colon)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def run(args: argparse.Namespace) -> int:
    """Serve until SIGINT/SIGTERM; 0 after a clean stop, 1 when the model failed to load."""
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        engine_config = engine_config_from_args(args)
        server_config = server_config_from_args(args)
    except ValueError as exc:
        print(f"kvserve serve: {exc}", file=sys.stderr)
        return 2
    # A model that is not here (a catalogue name not pulled, a wrong path) is refused before
    # the port opens; `--pull` fetches a catalogue model first.
    problem = resolve_model_argument(args)
    if problem is not None:
        print(f"kvserve serve: {problem}", file=sys.stderr)
        return 2
    # Listen before the heavy imports (torch, the engine): a client that connects during the
    # seconds they take waits in the backlog instead of being refused; /health then answers as
    # soon as the app runs, and /ready once the model is loaded.
    try:
        sock = listen(server_config.host, server_config.port)
    except OSError as exc:
        print(
            f"kvserve serve: cannot listen on {server_config.host}:{server_config.port}: {exc}",
            file=sys.stderr,
        )
        return 2

    from kvserve.engine.embedding import build_engine
    from kvserve.server.app import Server, create_app

    failed: list[BaseException] = []
    server: Server | None = None

    def url() -> str:
        port = server.bound_port if server is not None else None
        host = server_config.host
        if ":" in host:
            host = f"[{host}]"
        return f"http://{host}:{port or server_config.port}"

    def on_ready(engine: Engine) -> None:
        name = server_config.served_model_name or engine.loaded.name
        print(banner(engine, name, url(), server_config), flush=True)

    def on_load_error(error: BaseException) -> None:
        failed.append(error)
        if server is not None:
            server.should_exit = True

    app = create_app(
        server_config,
        lambda observer: build_engine(engine_config, observer),
        on_ready=on_ready,
        on_load_error=on_load_error,
    )
    server = Server(
        app, host=server_config.host, port=server_config.port, log_level=server_config.log_level
    )
    log.info(
        "loading %s; GET /ready answers 200 once it is loaded",
        engine_config.model or "the default model",
    )
    server.run(sockets=[sock])
    if app.state.kvserve.loading:
        # Stopped while the model loads in a thread nothing can interrupt. Finalizing the
        # interpreter under that thread can abort the process (a thread that logs during
        # finalization is a fatal error), and there is nothing to save yet: end here.
        log.info("stopped while the model was loading")
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    if failed:
        print(f"kvserve serve: the model failed to load: {failed[0]}", file=sys.stderr)
        return 1
    return 0
