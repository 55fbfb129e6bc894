"""``pagedserve serve-ray``: the OpenAI server on Ray Serve (replicas placed, restarted and
autoscaled by Ray). Imports Ray only when the command runs, so ``pagedserve --help`` works without it."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import threading

from pagedserve.config import parse_bytes

logger = logging.getLogger("pagedserve.ray_serve")

_EPILOG = """examples:
  pagedserve serve-ray --default-model tiny --num-replicas 2          # a local Ray cluster on this machine
  ray start --head --port 6379                                        # on the head node, then on each worker:
  ray start --address HEAD:6379                                       #   (pagedserve and the model on every node)
  pagedserve serve-ray --address auto --model /models/Qwen2.5-0.5B-Instruct \\
      --min-replicas 1 --max-replicas 8 --target-ongoing-requests 16 --host 0.0.0.0 --port 8000
"""


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:  # type: ignore[type-arg]
    """Register ``serve-ray`` (engine flags from ``pagedserve.engine.args`` plus Ray's)."""
    from pagedserve.engine.args import add_engine_args

    p = subparsers.add_parser(
        "serve-ray", help="serve a model on Ray Serve: many engine replicas, one OpenAI endpoint",
        description="Serve a model over the OpenAI API on a Ray cluster (pip install 'pagedserve[ray]'): a front "
                    "deployment reads each request and routes it with the gateway's wait estimate and prefix "
                    "affinity to one of N engine replicas, each running pagedserve's own server app. Answers "
                    "carry x-pagedserve-replica. See docs/SCALE_OUT.md.",
        epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(p)
    s = p.add_argument_group("server")
    s.add_argument("--host", default="127.0.0.1", help="address Ray's HTTP proxy listens on (default 127.0.0.1)")
    s.add_argument("--port", type=int, default=8000, help="port Ray's HTTP proxy listens on (default 8000)")
    s.add_argument("--api-key", default=os.environ.get("PAGEDSERVE_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: $PAGEDSERVE_API_KEY, or none)")
    s.add_argument("--served-model-name", default=None, help="model name clients send (default: the engine's)")
    s.add_argument("--max-body-bytes", type=parse_bytes, default="4MiB",
                   help="refuse request bodies larger than this with 413 (default 4MiB)")
    s.add_argument("--shutdown-timeout", type=float, default=5.0,
                   help="seconds a stopping replica gives in-flight requests before aborting them (default 5)")
    s.add_argument("--default-model", choices=["smollm2", "tiny", "small"], default="smollm2",
                   help="model served when --model is not given (as for 'pagedserve serve'; default smollm2)")
    r = p.add_argument_group("ray")
    r.add_argument("--address", default=None,
                   help="Ray cluster to join ('auto', or HEAD:PORT); default: start a local cluster on this machine")
    r.add_argument("--num-cpus", type=float, default=None, help="CPUs of the local cluster (default: all)")
    r.add_argument("--num-replicas", type=int, default=1, help="engine replicas, without autoscaling (default 1)")
    r.add_argument("--min-replicas", type=int, default=None, help="autoscaling: fewest replicas (with --max-replicas)")
    r.add_argument("--max-replicas", type=int, default=None, help="autoscaling: most replicas (with --min-replicas)")
    r.add_argument("--target-ongoing-requests", type=float, default=8.0,
                   help="autoscaling: requests per replica Ray scales toward (default 8)")
    r.add_argument("--max-ongoing-requests", type=int, default=64,
                   help="requests one replica holds at once (default 64; >= --max-num-seqs)")
    r.add_argument("--max-queued-requests", type=int, default=256,
                   help="requests waiting for a replica slot before the front answers 503 queue_full "
                        "(default 256; -1: no limit)")
    r.add_argument("--replica-cpus", type=float, default=1.0, help="CPUs Ray reserves per replica (default 1)")
    r.add_argument("--replica-gpus", type=float, default=0.0, help="GPUs Ray reserves per replica (default 0)")
    r.add_argument("--front-replicas", type=int, default=1, help="front (ingress) replicas (default 1)")
    r.add_argument("--affinity-slack", type=float, default=0.25, metavar="S",
                   help="keep a prompt prefix on its last replica while that replica's estimated wait is within "
                        "S seconds of the best (default 0.25, as the gateway)")
    r.add_argument("--default-service-s", type=float, default=2.0,
                   help="seconds a request holds a seat, until measured (default 2)")
    r.add_argument("--routing-stats-period", type=float, default=0.5,
                   help="seconds between the load reports Ray collects from each replica (default 0.5)")
    r.add_argument("--retries", type=int, default=1,
                   help="times a request whose replica died before answering is sent again (default 1)")
    r.add_argument("--drain-check", type=float, default=2.0, metavar="S",
                   help="seconds a stopping replica waits before checking that its requests are done, and "
                        "between checks (time for routers to stop sending it any; default 2, Ray's)")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    """Start (or join) the cluster, deploy, serve until SIGINT/SIGTERM, shut Serve down."""
    from pagedserve.engine.args import engine_config_from_args
    from pagedserve.models.standard import ensure_standard_model
    from pagedserve.ray_serve.settings import RaySettings
    from pagedserve.server.config import ServerConfig

    try:
        settings = RaySettings(
            num_replicas=args.num_replicas, min_replicas=args.min_replicas, max_replicas=args.max_replicas,
            target_ongoing_requests=args.target_ongoing_requests, max_ongoing_requests=args.max_ongoing_requests,
            max_queued_requests=args.max_queued_requests, replica_num_cpus=args.replica_cpus,
            replica_num_gpus=args.replica_gpus, front_replicas=args.front_replicas,
            affinity_slack_s=args.affinity_slack, default_service_s=args.default_service_s,
            routing_stats_period_s=args.routing_stats_period, retries=args.retries, drain_check_s=args.drain_check)
        if not args.model:
            if args.default_model == "smollm2":
                from pagedserve.models.default import ensure_default_model
                args.model = str(ensure_default_model())
            else:
                args.model = str(ensure_standard_model(args.default_model))
                args.served_model_name = args.served_model_name or f"pagedserve-{args.default_model}-random"
        server = ServerConfig(host=args.host, port=args.port, served_model_name=args.served_model_name,
                              api_key=args.api_key, max_body_bytes=args.max_body_bytes,
                              shutdown_timeout_s=args.shutdown_timeout)
        engine = engine_config_from_args(args)
    except (ValueError, OSError, RuntimeError) as exc:
        logger.error("cannot start: %s", exc)
        return 2
    try:
        from ray import serve
    except ImportError:
        logger.error("Ray Serve is not installed: pip install 'pagedserve[ray]'")
        return 2
    import ray

    from pagedserve.ray_serve.app import init_ray, start

    init_ray(args.address, args.num_cpus)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        url = start(engine, server, settings)
        logger.info("serving %s on %s with %s", args.model, url,
                    f"{settings.min_replicas}-{settings.max_replicas} replicas (autoscaling)"
                    if settings.autoscaling else f"{settings.num_replicas} replica(s)")
        stop.wait()
    finally:
        serve.shutdown()
        ray.shutdown()
    return 0
