"""`kvserve cluster [MODEL]`: N engine replicas on Ray Serve behind one OpenAI endpoint.

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

__all__ = ["add_arguments", "cluster_settings", "run"]

log = logging.getLogger("kvserve.cluster")

APP_NAME = "kvserve"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`kvserve serve`'s flags, then the cluster's."""
    from kvserve.server.cli import add_arguments as add_serve_arguments

    add_serve_arguments(parser)
    e = env_default
    g = parser.add_argument_group("cluster")
    g.add_argument("--replicas", type=int, default=e("--replicas", 2, int))
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
    if args.replicas < 1:
        print("kvserve cluster: --replicas must be at least 1", file=sys.stderr)
        return 2
    from kvserve.cli import resolve_model_argument

    # Resolved (and pulled, with --pull) here; the replicas on this machine find it in place.
    problem = resolve_model_argument(args)
    if problem is not None:
        print(f"kvserve cluster: {problem}", file=sys.stderr)
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
        print(
            f"kvserve cluster: {args.replicas} replica(s) of "
            f"'{args.served_model_name or args.model or 'the default model'}'\n"
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
