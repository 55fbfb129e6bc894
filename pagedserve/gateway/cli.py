"""``pagedserve gateway --config FILE``: run the gateway in front of the configured pools."""

from __future__ import annotations

import argparse
import gc
import logging
import sys

from pagedserve.gateway.config import ConfigError, load_config


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:  # type: ignore[type-arg]
    """Register ``gateway`` on the top-level CLI."""
    p = subparsers.add_parser(
        "gateway", help="OpenAI-compatible gateway: tiers, token buckets, pools, priority, shedding.",
        description="Run an OpenAI-compatible HTTP gateway in front of pools of engine replicas. API keys map "
                    "to tiers; each tier has a token bucket (LLM tokens), pools in order of preference, a "
                    "priority and a queue-wait budget. See docs/GATEWAY.md and examples/gateway.toml.")
    p.add_argument("--config", required=True, help="Gateway TOML file (keys, tiers, pools, settings).")
    p.add_argument("--redis-url", default=None,
                   help="Keep the token buckets in Redis (e.g. redis://127.0.0.1:6379/0) so several gateway "
                        "processes share them; overrides gateway.redis_url. Default: in-process buckets.")
    p.add_argument("--response-store", default=None, metavar="memory|redis://HOST:PORT/DB",
                   help="where POST /v1/responses keeps responses for previous_response_id, GET and DELETE: this "
                        "process's memory, or Redis, so that a follow-up may come through any gateway process "
                        "(overrides gateway.response_store; default memory; docs/RESPONSES.md)")
    p.add_argument("--response-ttl", type=float, default=None, metavar="S",
                   help="stored responses expire S seconds after they were made (overrides "
                        "gateway.response_ttl_s; default 3600)")
    p.add_argument("--host", default=None, help="Address to listen on (overrides gateway.host; default 127.0.0.1).")
    p.add_argument("--port", type=int, default=None, help="Port to listen on (overrides gateway.port; default 8080).")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    """Load and check the config, then serve until interrupted; exit code 2 on a config error."""
    try:
        config = load_config(args.config)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.redis_url:
        config.redis_url = args.redis_url
    if args.response_store:
        config.response_store = args.response_store
    if args.response_ttl is not None:
        if not 0 < args.response_ttl <= 30 * 86400:
            print(f"error: --response-ttl must be in (0, {30 * 86400}] seconds, got {args.response_ttl}",
                  file=sys.stderr)
            return 2
        config.response_ttl_s = args.response_ttl
    if args.host:
        config.host = args.host
    if args.port is not None:
        config.port = args.port
    # Logging is set up by the top-level CLI (``pagedserve --log-level``); INFO logs one line per decision.
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per poll would drown the decisions
    level = logging.getLevelName(logging.getLogger().getEffectiveLevel()).lower()

    import uvicorn

    from pagedserve.gateway.app import create_app

    app = create_app(config)
    gc.collect()  # startup objects live until exit: keep them out of the cyclic GC's walks
    gc.freeze()
    server = uvicorn.Server(uvicorn.Config(app, host=config.host, port=config.port, log_level=level,
                                           access_log=False, timeout_graceful_shutdown=5))
    app.state.dashboard.should_stop = lambda: server.should_exit  # open dashboard feeds end on shutdown
    server.run()
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run the gateway CLI on its own (``python -m pagedserve.gateway``)."""
    parser = argparse.ArgumentParser(prog="pagedserve")
    sub = parser.add_subparsers(dest="command", required=True)
    add_parser(sub)
    args = parser.parse_args(["gateway", *(sys.argv[1:] if argv is None else argv)])
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return int(args.func(args))
