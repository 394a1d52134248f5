"""The Ray Serve application: for each model a deployment of `KVServeReplica`s (the first
model's is `KVServeReplica`, the second's `KVServeReplica_1`, ...), all behind one
`KVServeIngress`.

Each replica runs a whole kvserve server for one model (engine and HTTP app, exactly as
`kvserve serve MODEL` runs them) on a port of its own on its node, and announces itself to the
ingress about twice a second with its model and its running and waiting counts. Ray Serve
places the replicas (CPUs or GPUs each), checks their health (an engine that stopped fails it)
and restarts the ones that die.

The ingress deployment runs the prefix-routing proxy (`kvserve.cluster.ingress`) on the
cluster's public address. Ray Serve's own HTTP proxy is not used: every byte goes client ->
ingress -> replica over plain HTTP, streamed.

`build_app(args)` is the application builder for `serve run` / `serve deploy`
(examples/ray-serve-config.yaml); `kvserve cluster` calls it too.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from ray import serve

__all__ = ["INGRESS", "REPLICA", "KVServeIngress", "KVServeReplica", "build_app"]

log = logging.getLogger("kvserve.cluster")

INGRESS = "KVServeIngress"
REPLICA = "KVServeReplica"
HEARTBEAT_SECONDS = 0.5


@serve.deployment(
    name=REPLICA,
    health_check_period_s=2.0,
    health_check_timeout_s=30.0,
    graceful_shutdown_timeout_s=10.0,
    # Requests reach the replica over its own HTTP port, not through Serve.
    max_ongoing_requests=8,
    logging_config={"enable_access_log": False},
)
class KVServeReplica:
    """One kvserve server (engine + app) on this replica's node, on a free port."""

    def __init__(self, serve_args: dict[str, Any]) -> None:
        import ray

        from kvserve.cli import engine_config_from_args
        from kvserve.cluster.serving import ThreadedServer, serve_namespace
        from kvserve.engine.engine import Engine
        from kvserve.server.app import Server, create_app
        from kvserve.server.cli import server_config_from_args

        args = serve_namespace(serve_args)
        engine_config = engine_config_from_args(args)
        # The replica listens where the ingress can reach it: this node's address.
        host = ray.util.get_node_ip_address()
        args.host, args.port = host, 0
        server_config = server_config_from_args(args)
        app = create_app(server_config, lambda observer: Engine(engine_config, observer=observer))
        self.state = app.state.kvserve
        self.server = ThreadedServer(
            Server(app, host=host, port=0, log_level=server_config.log_level)
        ).start()
        self.server.wait_for(
            lambda: self.state.ready or self.state.load_error is not None,
            600.0,
            "the model did not load",
        )
        if self.state.load_error is not None:
            raise RuntimeError(f"the model failed to load: {self.state.load_error}")
        context = serve.get_replica_context()
        self.replica_id = context.replica_id.unique_id
        self.url = f"http://{host}:{self.server.port}"
        self.actor_name = ray.get_runtime_context().get_actor_name() or ""
        self._ingress = serve.get_deployment_handle(INGRESS, app_name=context.app_name)
        self._stopped = threading.Event()
        threading.Thread(target=self._announce, name="kvserve-announce", daemon=True).start()
        log.info("replica %s serving on %s", self.replica_id, self.url)

    def info(self) -> dict[str, Any]:
        """What the ingress routes by: where this replica listens and how busy it is."""
        engine = self.state.engine
        # Read from another thread: two integer reads, at worst a step stale.
        running = engine.num_running if engine is not None else 0
        waiting = engine.num_waiting if engine is not None else 0
        return {
            "replica_id": self.replica_id,
            "url": self.url,
            "actor_name": self.actor_name,
            "model": self.state.model_name or "",
            "running": running,
            "waiting": waiting,
            "ready": bool(self.state.ready and self.server.alive),
        }

    def _announce(self) -> None:
        while not self._stopped.wait(HEARTBEAT_SECONDS):
            try:
                self._ingress.register.remote(self.info())
            except Exception as exc:  # the ingress may be restarting; try again next beat
                log.debug("announce failed: %r", exc)

    def check_health(self) -> None:
        """Ray Serve's probe: a replica whose server or engine stopped is restarted."""
        if not self.server.alive:
            raise RuntimeError("the replica's HTTP server stopped")
        engine = self.state.engine
        if engine is not None and not engine.running:
            raise RuntimeError("the replica's engine stopped")

    def __del__(self) -> None:
        stopped = getattr(self, "_stopped", None)
        if stopped is not None:
            stopped.set()
        server = getattr(self, "server", None)
        if server is not None:
            server.stop()


@serve.deployment(
    name=INGRESS,
    num_replicas=1,
    ray_actor_options={"num_cpus": 0},
    health_check_period_s=2.0,
    max_ongoing_requests=1000,
    # Every replica announces itself twice a second; those calls are not worth a line each.
    logging_config={"enable_access_log": False},
)
class KVServeIngress:
    """The cluster's HTTP endpoint: the routing proxy on `host:port`."""

    def __init__(
        self,
        replicas: Any,
        serve_args: dict[str, Any],
        host: str = "127.0.0.1",
        port: int = 8000,
        load_threshold: int = 4,
    ) -> None:
        import uvicorn

        from kvserve.cluster.cli import cluster_models, served_names
        from kvserve.cluster.ingress import Ingress, ServedModel
        from kvserve.cluster.prompt import PromptHasher
        from kvserve.cluster.router import PrefixRouter
        from kvserve.cluster.serving import ThreadedServer, serve_namespace
        from kvserve.model.paths import resolve_model_path
        from kvserve.tokenizer import Tokenizer

        # Bound so that Serve deploys the replicas with the ingress; they are reached by HTTP.
        self._replicas = replicas
        args = serve_namespace(serve_args)
        models = cluster_models(serve_args)
        served = []
        # Each model's prompts are hashed by its own tokenizer, into its own router.
        for model, name in zip(models, served_names(models, args.served_model_name), strict=True):
            path = resolve_model_path(model)
            tokenizer = Tokenizer.from_hf_dir(path) if path.is_dir() else Tokenizer.from_gguf(path)
            hasher = PromptHasher(tokenizer, args.block_size)
            served.append(ServedModel(name, hasher, PrefixRouter(load_threshold=load_threshold)))
        self.ingress = Ingress(
            served, max_body_bytes=args.max_body_bytes, api_key=args.api_key or None
        )
        config = uvicorn.Config(
            self.ingress.app,
            host=host,
            port=port,
            http="h11",
            ws="none",
            lifespan="on",
            access_log=False,
            log_config=None,
            log_level=args.log_level,
        )
        self.server = ThreadedServer(uvicorn.Server(config)).start()
        self.host = host

    def register(self, payload: dict[str, Any]) -> None:
        """A replica's announcement; handed to the proxy's loop, which owns the table."""
        from kvserve.cluster.ingress import ReplicaInfo

        self.server.call_soon(self.ingress.register, ReplicaInfo(**payload))

    def url(self) -> str:
        """Where clients connect."""
        host = self.host if ":" not in self.host else f"[{self.host}]"
        return f"http://{host}:{self.server.port}"

    def check_health(self) -> None:
        if not self.server.alive:
            raise RuntimeError("the ingress's HTTP server stopped")

    def __del__(self) -> None:
        server = getattr(self, "server", None)
        if server is not None:
            server.stop()


def build_app(args: dict[str, Any]) -> serve.Application:
    """The application from plain settings (a `serve deploy` config's `args`):

    replicas: 2             cpus_per_replica: 1     gpus_per_replica: 0
    host: 127.0.0.1         port: 8000              load_threshold: 4
    serve_args: {threads: 1, max_num_seqs: 8, ...}  # `kvserve serve` settings, by name

    `serve_args.models` (a list) names several models, `serve_args.model` one; `replicas` is
    each model's count, or a list of counts, one per model.
    """
    from kvserve.cluster.cli import cluster_models, replica_counts

    known = {
        "replicas",
        "cpus_per_replica",
        "gpus_per_replica",
        "host",
        "port",
        "load_threshold",
        "serve_args",
    }
    unknown = sorted(set(args) - known)
    if unknown:
        raise ValueError(f"unknown cluster settings: {', '.join(unknown)}")
    serve_args = dict(args.get("serve_args") or {})
    models = cluster_models(serve_args)
    counts = replica_counts(args.get("replicas", 1), len(models))
    if serve_args.get("served_model_name") and len(models) > 1:
        raise ValueError("served_model_name names one model; several are served by their names")
    actor_options: dict[str, Any] = {"num_cpus": float(args.get("cpus_per_replica", 1))}
    if args.get("gpus_per_replica"):
        actor_options["num_gpus"] = float(args["gpus_per_replica"])
    replicas = [
        KVServeReplica.options(
            name=REPLICA if index == 0 else f"{REPLICA}_{index}",
            num_replicas=count,
            ray_actor_options=actor_options,
        ).bind({**serve_args, "model": model, "models": [model] if model is not None else []})
        for index, (model, count) in enumerate(zip(models, counts, strict=True))
    ]
    return KVServeIngress.bind(
        replicas,
        serve_args,
        host=str(args.get("host", "127.0.0.1")),
        port=int(args.get("port", 8000)),
        load_threshold=int(args.get("load_threshold", 4)),
    )
