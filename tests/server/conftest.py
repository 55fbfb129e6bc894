"""The server tests share one real server (``python -m pagedserve serve`` on 127.0.0.1), started by
the root conftest's ``server_url``; after every test that used it, the engine must hold no KV blocks."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from tests.conftest import MAX_MODEL_LEN  # noqa: F401  (the shared server's context, for the tests)
from tests.conftest import NO_KEEP_ALIVE


@pytest.fixture(scope="module")
def client(server_url: str) -> Iterator[openai.OpenAI]:
    """The official OpenAI client pointed at the shared server, one per module (a new one builds an
    SSL context: see the root conftest's ``http``)."""
    with openai.OpenAI(base_url=f"{server_url}/v1", api_key="unused", max_retries=0, timeout=60,
                       http_client=openai.DefaultHttpxClient(limits=NO_KEEP_ALIVE)) as c:
        yield c
