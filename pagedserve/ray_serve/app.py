"""The Serve application: the front and the engine replicas, bound with their Ray settings; and
starting it on a cluster (a local one, or one that is already running)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from pagedserve.config import EngineConfig
from pagedserve.ray_serve.settings import RaySettings
from pagedserve.server.config import ServerConfig

ROUTER_CLASS = "pagedserve.ray_serve.router:PagedServeRouter"


def build_application(engine_config: EngineConfig, server_config: ServerConfig, settings: RaySettings) -> Any:
    """``front → engine replicas`` as a bound Serve application (``serve.run`` it)."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from pagedserve.ray_serve.front import OpenAIFront
    from pagedserve.ray_serve.replica import EngineReplica

    router = RequestRouterConfig(
        request_router_class=ROUTER_CLASS,
        request_router_kwargs={"affinity_slack_s": settings.affinity_slack_s,
                               "default_service_s": settings.default_service_s},
        request_routing_stats_period_s=settings.routing_stats_period_s,
        request_routing_stats_timeout_s=max(1.0, 4 * settings.routing_stats_period_s))
    scaling: dict[str, Any]
    if settings.autoscaling:
        scaling = {"autoscaling_config": {"min_replicas": settings.min_replicas,
                                          "max_replicas": settings.max_replicas,
                                          "initial_replicas": max(settings.min_replicas or 0, 1),
                                          "target_ongoing_requests": settings.target_ongoing_requests}}
    else:
        scaling = {"num_replicas": settings.num_replicas}
    engine = serve.deployment(
        EngineReplica, name="engine", max_ongoing_requests=settings.max_ongoing_requests,
        # Applies where the handle is: the front refuses (503 queue_full) past this many waiting.
        max_queued_requests=settings.max_queued_requests, request_router_config=router,
        # On shutdown Ray waits this long for the replica's lifespan, which drains the engine.
        graceful_shutdown_timeout_s=server_config.shutdown_timeout_s + 5,
        graceful_shutdown_wait_loop_s=settings.drain_check_s,
        ray_actor_options={"num_cpus": settings.replica_num_cpus, "num_gpus": settings.replica_num_gpus},
        **scaling)
    replica_cap = settings.max_replicas if settings.autoscaling else settings.num_replicas
    front = serve.deployment(
        OpenAIFront, name="front", num_replicas=settings.front_replicas,
        # The front holds every request until it ends. Its cap is twice what the replicas and their
        # queue hold, so a request past those reaches the front and gets its 503 queue_full (OpenAI's
        # body) rather than waiting in Ray's proxy.
        max_ongoing_requests=2 * ((replica_cap or 1) * settings.max_ongoing_requests
                                  + max(0, settings.max_queued_requests)) + 16,
        graceful_shutdown_wait_loop_s=settings.drain_check_s,
        ray_actor_options={"num_cpus": settings.front_num_cpus})
    return front.bind(engine.bind(engine_config, server_config), max_body_bytes=server_config.max_body_bytes,
                      retries=settings.retries)


def package_root() -> str:
    """The directory that holds the ``pagedserve`` package this process runs."""
    return str(Path(__file__).resolve().parents[2])


def init_ray(address: str | None = None, num_cpus: float | None = None, env_vars: dict[str, str] | None = None,
             **kwargs: Any) -> None:
    """Connect to the cluster at ``address``, or start a local one. A local cluster's workers are
    given this process's pagedserve (on ``PYTHONPATH``) and ``env_vars``; a remote cluster's nodes
    must have pagedserve installed (docs/SCALE_OUT.md)."""
    import ray

    if address is None:
        path = os.pathsep.join(p for p in (package_root(), os.environ.get("PYTHONPATH", "")) if p)
        kwargs.setdefault("runtime_env", {"env_vars": {"PYTHONPATH": path, **(env_vars or {})}})
        ray.init(num_cpus=num_cpus, include_dashboard=False, **kwargs)
    else:
        ray.init(address=address, **kwargs)


def start(engine_config: EngineConfig, server_config: ServerConfig, settings: RaySettings) -> str:
    """Start Serve's HTTP proxy on ``server_config``'s host and port and deploy the application
    (returns once every replica is up); the base URL."""
    from ray import serve

    serve.start(http_options={"host": server_config.host, "port": server_config.port})
    serve.run(build_application(engine_config, server_config, settings), name=settings.app_name,
              route_prefix="/")
    return f"http://{server_config.host}:{server_config.port}"
