"""Validation once per layer: ``SamplingParams.validate()`` runs once per request, whichever way
the request reaches the core (the offline Engine, the in-process client, HTTP through it), and
the core trusts what the front end checked."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import pytest

from pagedserve import errors
from pagedserve.config import EngineConfig
from pagedserve.engine.frontend.async_engine import AsyncEngine
from pagedserve.engine.core.engine_core import EngineCore
from pagedserve.engine.frontend.engine import Engine
from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.server.app import build_app
from pagedserve.server.config import ServerConfig
from tests.conftest import assert_no_leaks, run_all
from tests.helpers.servers import AppThread, wait_for_idle


@pytest.fixture
def validations(monkeypatch: pytest.MonkeyPatch) -> list[SamplingParams]:
    """Every SamplingParams.validate() call from now on (the real method still runs)."""
    calls: list[SamplingParams] = []
    real = SamplingParams.validate

    def counted(self: SamplingParams) -> None:
        calls.append(self)
        real(self)

    monkeypatch.setattr(SamplingParams, "validate", counted)
    return calls


@pytest.fixture(scope="module")
def core(tiny_model_dir) -> EngineCore:  # type: ignore[no-untyped-def]
    return EngineCore(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=64, max_model_len=256, max_num_seqs=4))


def test_the_offline_engine_validates_once(tiny_model_dir, validations: list[SamplingParams]) -> None:
    engine = Engine(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=32, max_model_len=256))
    engine.add_request("a", [5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True))
    run_all(engine)
    assert len(validations) == 1
    with pytest.raises(errors.InvalidRequest, match="top_p"):
        engine.add_request("bad", [5, 6], SamplingParams(top_p=0))
    assert not engine.has_unfinished_requests()
    assert_no_leaks(engine)


def test_the_in_process_client_validates_once_and_the_core_never(core: EngineCore,
                                                                 validations: list[SamplingParams]) -> None:
    async def main() -> None:
        client = AsyncEngine(core)
        await client.start()
        stream = await client.add_request("a", [5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True))
        async with stream:
            outs = [out async for out in stream]
        assert outs[-1].finished
        # Refused by the front end's check, before anything reaches the core.
        with pytest.raises(errors.InvalidRequest, match=r"prompt token ids must be in \[0, 32000\)"):
            await client.add_request("out-of-vocab", [5, 32000], SamplingParams(max_tokens=1))
        with pytest.raises(errors.RequestTooLong):
            await client.add_request("too-long", [5] * 300, SamplingParams(max_tokens=1))
        await client.shutdown()

    asyncio.run(main())
    assert len(validations) == 3  # one per request, the refused ones included
    assert not core.has_unfinished_requests()


def test_an_http_request_is_validated_once(core: EngineCore, validations: list[SamplingParams]) -> None:
    app = build_app(AsyncEngine(core), ServerConfig(served_model_name="tiny"))
    with AppThread(app, lifespan="on") as t:
        r = httpx.post(f"{t.url}/v1/completions", json={"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 3,
                                                        "ignore_eos": True}, timeout=60)
        assert r.status_code == 200, r.text
        assert wait_for_idle(t.url)["kv_blocks_used"] == 0
    assert len(validations) == 1


@pytest.fixture(autouse=True)
def _idle_core(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    if "core" in request.fixturenames:
        core = request.getfixturevalue("core")
        assert not core.has_unfinished_requests() and core.block_manager.num_used_blocks == 0
