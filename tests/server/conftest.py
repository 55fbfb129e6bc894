"""One real server (``python -m pagedserve serve`` on 127.0.0.1) shared by the server tests.

After every test that used it, the engine must hold no KV blocks: a leak fails the test that
caused it, not a later one.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.helpers.servers import run_engine_server, wait_for_idle

# Small enough that "longer than the context" is cheap to send, big enough for real prompts.
MAX_MODEL_LEN = 256
SHARED_SERVER_ARGS = ("--max-model-len", str(MAX_MODEL_LEN), "--num-kv-blocks", "512",
                      "--max-body-bytes", "256KiB", "--log-level", "warning")


@pytest.fixture(scope="session")
def server_url(tiny_model_dir) -> Iterator[str]:  # type: ignore[no-untyped-def]
    """Base URL of the shared server (tiny random-weight model)."""
    with run_engine_server(tiny_model_dir, *SHARED_SERVER_ARGS, timeout=120) as url:
        yield url


@pytest.fixture(scope="session")
def model_name(server_url: str) -> str:
    """The name the shared server serves its model under."""
    return httpx.get(f"{server_url}/v1/models", timeout=10).json()["data"][0]["id"]


@pytest.fixture
def client(server_url: str) -> Iterator[openai.OpenAI]:
    """The official OpenAI client pointed at the shared server."""
    with openai.OpenAI(base_url=f"{server_url}/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture(autouse=True)
def _no_leaked_kv_blocks(request: pytest.FixtureRequest) -> Iterator[None]:
    """Every test that talked to the shared server must leave it with 0 KV blocks used."""
    yield
    if "server_url" in request.fixturenames:
        url = request.getfixturevalue("server_url")
        load = wait_for_idle(url)
        assert load["kv_blocks_used"] == 0, f"KV blocks leaked after {request.node.name}: {load}"
        assert load["running"] == 0 and load["waiting"] == 0, load
