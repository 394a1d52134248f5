"""`kvserve cluster [MODEL ...]`: engine replicas on Ray Serve behind one endpoint.

Each model gets replicas of its own (`--replicas N` each, or one count per model); a replica
serves one model, and the ingress routes a request to the replicas of the model it names.
Every `kvserve serve` flag is accepted and passed to each replica (the engine flags) or to the
ingress (`--host`, `--port`: where clients connect). The cluster's own flags say how many
replicas, with what resources, on which Ray cluster. Needs the `cluster` extra (Ray Serve).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading

from kvserve.config import env_default

__all__ = [
    "add_arguments",
    "cluster_models",
    "cluster_settings",
    "parse_replicas",
    "replica_counts",
    "run",
    "served_names",
]

log = logging.getLogger("kvserve.cluster")

APP_NAME = "kvserve"


def parse_replicas(text: str) -> int | list[int]:
    """`--replicas`: one count for every model (`2`), or one per model in their order (`2,1`)."""
    try:
        counts = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a count, nor counts separated by commas"
        ) from None
    return counts[0] if len(counts) == 1 else counts


def cluster_models(serve_args: dict) -> list[str | None]:
    """The cluster's models in order, from `kvserve serve`'s settings: `models` (the positional
    MODELs), else the one `model` (None: the default model)."""
    models = serve_args.get("models")
    if models:
        return list(models)
    return [serve_args.get("model")]


def replica_counts(replicas: int | list[int] | str, num_models: int) -> list[int]:
    """Each model's replica count: one count for all, or one per model. ValueError says what
    is wrong with them."""
    if isinstance(replicas, str):  # a config file's "2,1"
        try:
            replicas = parse_replicas(replicas)
        except argparse.ArgumentTypeError as exc:
            raise ValueError(f"--replicas: {exc}") from None
    counts = [replicas] if isinstance(replicas, int) else list(replicas)
    if len(counts) == 1:
        counts *= num_models
    if len(counts) != num_models:
        models = "1 model" if num_models == 1 else f"{num_models} models"
        raise ValueError(
            f"--replicas gives {len(counts)} counts for {models}: give one count for all, or "
            "one per model"
        )
    if any(not isinstance(count, int) or count < 1 for count in counts):
        raise ValueError("--replicas must be at least 1 for every model")
    return counts


def served_names(models: list[str | None], served_model_name: str | None = None) -> list[str]:
    """The name each model is served under, as its replicas' servers name it: the catalogue
    name, the file's stem or the directory's name (`--served-model-name` for a single model).
    ValueError when two models would share a name, or `--served-model-name` is given for
    several (each model's requests must name it)."""
    from kvserve.model.paths import model_name, resolve_model_path

    if served_model_name and len(models) > 1:
        raise ValueError(
            "--served-model-name names one model; with several, each is served under its own "
            "name (its catalogue name, file stem or directory name)"
        )
    if served_model_name:
        return [served_model_name]
    names = [model_name(model, resolve_model_path(model)) for model in models]
    doubled = sorted({name for name in names if names.count(name) > 1})
    if doubled:
        raise ValueError(
            f"two models would be served as {', '.join(map(repr, doubled))}: requests could "
            "not tell them apart (rename a file or directory)"
        )
    return names


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`kvserve serve`'s flags, then the cluster's."""
    from kvserve.server.cli import add_arguments as add_serve_arguments

    add_serve_arguments(parser)
    e = env_default
    g = parser.add_argument_group("cluster")
    g.add_argument(
        "--replicas",
        type=parse_replicas,
        default=e("--replicas", 2, parse_replicas),
        metavar="N[,N...]",
        help="engine replicas of each model: one count for every model, or one per model in "
        "the order the models are given (default: 2)",
    )
    g.add_argument(
        "--address",
        default=os.environ.get("RAY_ADDRESS"),
        help="a Ray cluster to join, e.g. ray://head:10001 or auto (default: $RAY_ADDRESS; "
        "without either a local Ray is started)",
    )
    g.add_argument(
        "--cpus-per-replica",
        type=float,
        default=e("--cpus-per-replica", 1.0, float),
        help="CPUs Ray reserves for each replica (give --threads the same number)",
    )
    g.add_argument(
        "--gpus-per-replica",
        type=float,
        default=e("--gpus-per-replica", 0.0, float),
        help="GPUs Ray reserves for each replica (use with --device cuda)",
    )
    g.add_argument(
        "--load-threshold",
        type=int,
        default=e("--load-threshold", 4, int),
        help="requests (running + waiting) a prefix-holding replica may carry above the least "
        "loaded one before a request goes to the least loaded instead",
    )


def cluster_settings(args: argparse.Namespace) -> dict:
    """`build_app`'s settings from parsed flags: the serve flags by name, the cluster's own."""
    from kvserve.server.cli import add_arguments as add_serve_arguments

    probe = argparse.ArgumentParser()
    add_serve_arguments(probe)
    serve_names = set(vars(probe.parse_args([])))
    serve_args = {name: getattr(args, name) for name in sorted(serve_names)}
    if serve_args.get("threads") is None and not args.gpus_per_replica:
        # A replica's torch threads match what Ray reserved for it, not the whole machine.
        serve_args["threads"] = max(1, int(args.cpus_per_replica))
    return {
        "replicas": args.replicas,
        "cpus_per_replica": args.cpus_per_replica,
        "gpus_per_replica": args.gpus_per_replica,
        "host": args.host,
        "port": args.port,
        "load_threshold": args.load_threshold,
        "serve_args": serve_args,
    }


def run(args: argparse.Namespace) -> int:
    """Deploy, print where to connect, serve until SIGINT/SIGTERM, then tear down."""
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    models = cluster_models(vars(args))
    try:
        counts = replica_counts(args.replicas, len(models))
    except ValueError as exc:
        print(f"kvserve cluster: {exc}", file=sys.stderr)
        return 2
    from kvserve.cli import resolve_model_argument

    # Resolved (and pulled, with --pull) here; the replicas on this machine find them in place.
    problem = resolve_model_argument(args)
    if problem is not None:
        print(f"kvserve cluster: {problem}", file=sys.stderr)
        return 2
    try:
        names = served_names(models, args.served_model_name)
    except ValueError as exc:
        print(f"kvserve cluster: {exc}", file=sys.stderr)
        return 2
    try:
        import ray
        from ray import serve

        from kvserve.cluster.deployments import build_app
    except ImportError as exc:
        print(
            f"kvserve cluster needs Ray Serve: pip install 'kvserve[cluster]' ({exc})",
            file=sys.stderr,
        )
        return 2
    ray.init(address=args.address or None, include_dashboard=False)
    started_here = args.address is None
    try:
        serve.start(proxy_location="Disabled")
        handle = serve.run(build_app(cluster_settings(args)), name=APP_NAME, route_prefix=None)
        url = handle.url.remote().result()
        served = ", ".join(
            f"{count} replica(s) of '{name}'" for name, count in zip(names, counts, strict=True)
        )
        print(
            f"kvserve cluster: {served}\n"
            f"  listening on {url}  (OpenAI base URL: {url}/v1; replicas: {url}/cluster/replicas)",
            flush=True,
        )
        stop = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        stop.wait()
    finally:
        if started_here:
            serve.shutdown()
        else:
            serve.delete(APP_NAME)
        ray.shutdown()
    return 0
