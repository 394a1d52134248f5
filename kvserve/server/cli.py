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
from kvserve.collector import collector_paused, keep_for_good
from kvserve.config import ServerConfig, env_default, parse_origins
from kvserve.server.tools import TOOL_CALL_PARSERS

if TYPE_CHECKING:  # the engine imports torch; `kvserve serve --help` should not
    from collections.abc import Callable

    from fastapi import FastAPI

    from kvserve.engine.engine import Engine
    from kvserve.server.app import Server

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
    m = parser.add_argument_group("several models")
    m.add_argument(
        "--models-dir",
        metavar="DIR",
        default=e("--models-dir", None),
        help="serve every .gguf file and model directory in DIR too (each loaded on first use)",
    )
    m.add_argument(
        "--preload",
        metavar="NAME[,NAME...]",
        action="append",
        default=None,
        help="load these models at start (default: a lone model is; of several, none)",
    )
    m.add_argument(
        "--keep-alive",
        metavar="DURATION",
        default=e("--keep-alive", None),
        help="how long a model stays loaded after its last request, e.g. 5m, 30s, 0 (at "
        "once), -1 (until the server stops); default: a lone model stays, several get 5m; "
        "an Ollama request's keep_alive overrides it for its model",
    )
    m.add_argument(
        "--max-loaded-models",
        type=int,
        default=e("--max-loaded-models", None, int),
        help="most models loaded at once; the least recently used idle one unloads for a new "
        "one (default: no limit)",
    )
    m.add_argument(
        "--max-loaded-bytes",
        type=parse_size,
        default=e("--max-loaded-bytes", None, parse_size),
        help="most bytes of weights and KV pools loaded at once, e.g. 8GiB (default: no limit)",
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


SEVERAL_KEEP_ALIVE = 300.0
"""Seconds an idle model of several stays loaded by default (Ollama's 5 minutes)."""


def model_arguments(args: argparse.Namespace) -> list[str | None]:
    """The models to serve: the positional ones, then those in --models-dir (sorted by name,
    skipping what is already named)."""
    models: list[str | None] = list(getattr(args, "models", None) or [args.model])
    directory = getattr(args, "models_dir", None)
    if directory:
        from pathlib import Path

        root = Path(directory).expanduser()
        if not root.is_dir():
            raise ValueError(f"--models-dir: {directory} is not a directory")
        found = [
            str(path)
            for path in sorted(root.iterdir())
            if (path.is_file() and path.suffix == ".gguf")
            or (path.is_dir() and (path / "config.json").exists())
        ]
        if not found:
            raise ValueError(f"--models-dir: {directory} holds no .gguf file or model directory")
        models = [m for m in models if m is not None] + found
    return models or [None]


def build_registry(args: argparse.Namespace, engine_config, server_config: ServerConfig):
    """The served models (ModelRegistry) from the flags: each with its engine settings,
    name, keep-alive and whether it loads at start."""
    import dataclasses

    from kvserve.engine.embedding import build_engine
    from kvserve.model.paths import model_name, resolve_model_path
    from kvserve.server.models import ModelRegistry, ServedModel, parse_keep_alive

    arguments = model_arguments(args)
    several = len(arguments) > 1
    if several and server_config.served_model_name:
        raise ValueError("--served-model-name names one model; several are served by their names")
    keep_alive: float | None = SEVERAL_KEEP_ALIVE if several else None
    if args.keep_alive not in (None, ""):
        try:
            keep_alive = parse_keep_alive(args.keep_alive)
        except ValueError:
            raise ValueError(
                f"--keep-alive: {args.keep_alive!r} is not a duration such as 5m, 30s or -1"
            ) from None
    preload = {name for value in args.preload or () for name in value.split(",") if name}
    served: list[ServedModel] = []
    for argument in arguments:
        path = resolve_model_path(argument)
        name = server_config.served_model_name or model_name(argument, path)
        files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
        config = dataclasses.replace(engine_config, model=argument)
        served.append(
            ServedModel(
                name,
                lambda observer, config=config: build_engine(config, observer),
                keep_alive=keep_alive,
                estimate_bytes=sum(f.stat().st_size for f in files),
                path=path,
                preload=not several or name in preload or "all" in preload,
            )
        )
    unknown = preload - {m.name for m in served} - {"all"}
    if unknown:
        names = ", ".join(m.name for m in served)
        raise ValueError(f"--preload: {', '.join(sorted(unknown))} not served (served: {names})")
    for flag, value in (
        ("--max-loaded-models", args.max_loaded_models),
        ("--max-loaded-bytes", args.max_loaded_bytes),
    ):
        if value is not None and value < 1:
            raise ValueError(f"{flag} must be at least 1")
    return ModelRegistry(
        served,
        max_loaded_models=args.max_loaded_models,
        max_loaded_bytes=args.max_loaded_bytes,
        load_timeout=engine_config.queue.queue_timeout,
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


def import_app() -> tuple[type[Server], Callable[..., FastAPI]]:
    """The server's heavy imports (torch, the engine, FastAPI), made with the collector paused
    and kept out of its later walks (kvserve.collector): 0.3-0.7 s less on 2 cores."""
    with collector_paused():
        from kvserve.server.app import Server, create_app

        keep_for_good()
    return Server, create_app


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

    Server, create_app = import_app()

    failed: list[BaseException] = []
    server: Server | None = None

    def url() -> str:
        port = server.bound_port if server is not None else None
        host = server_config.host
        if ":" in host:
            host = f"[{host}]"
        return f"http://{host}:{port or server_config.port}"

    def on_ready(engine: Engine) -> None:
        name = next(m.name for m in registry.models if m.engine is engine)
        print(banner(engine, name, url(), server_config), flush=True)

    def on_load_error(error: BaseException) -> None:
        failed.append(error)
        if server is not None:
            server.should_exit = True

    try:
        registry = build_registry(args, engine_config, server_config)
    except (ValueError, FileNotFoundError) as exc:
        print(f"kvserve serve: {exc}", file=sys.stderr)
        return 2
    app = create_app(server_config, registry, on_ready=on_ready, on_load_error=on_load_error)
    server = Server(
        app, host=server_config.host, port=server_config.port, log_level=server_config.log_level
    )
    if len(registry.models) == 1:
        log.info(
            "loading %s; GET /ready answers 200 once it is loaded",
            engine_config.model or "the default model",
        )
    else:
        log.info(
            "serving %d models (%s), each loaded on its first request%s",
            len(registry.models),
            ", ".join(m.name for m in registry.models),
            "".join(f"; loading {m.name} now" for m in registry.models if m.preload),
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
