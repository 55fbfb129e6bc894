"""The two engine clients run the same core loop behind the same front end, so they pass the same
tests: the in-process client (the core loop on a thread) and the multiprocess one (the core loop
in its own process), each built by the factory the server uses, against the offline Engine."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from pagedserve import errors
from pagedserve.config import EngineConfig
from pagedserve.engine.frontend import factory
from pagedserve.engine.frontend.client import EngineClient, RequestFailed
from pagedserve.engine.frontend.engine import Engine
from pagedserve.engine.outputs import RequestOutput
from pagedserve.engine.sampling_params import SamplingParams
from tests.conftest import run_all
from tests.helpers.faults import Poisoned

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
PROMPTS = [[11 + i, 200 + 3 * i, 31, 999 + i, 7] * (2 + i) for i in range(3)]
KINDS = ["in_process", "core_process"]


def _config(model_dir) -> EngineConfig:  # type: ignore[no-untyped-def]
    return EngineConfig(model=str(model_dir), dtype="float32", num_kv_blocks=128, max_model_len=256, max_num_seqs=4)


def _client(kind: str, config: EngineConfig) -> EngineClient:
    """A client over a core whose step raises for requests named poison* (tests/helpers/faults.py)."""
    poisoned = Poisoned("execute", "poison")
    if kind == "in_process":
        return factory.in_process(config, core_factory=poisoned)
    return factory.connect(factory.spawn_core_process(config, core_factory=poisoned).wait_ready())


def _serve(kind: str, config: EngineConfig, body: Callable[[EngineClient], Awaitable[object]]) -> object:
    async def main() -> object:
        client = _client(kind, config)
        await client.start()
        try:
            result = await body(client)
            await _idle(client)
            assert client.stats().kv_blocks_used == 0, "every block back"
            return result
        finally:
            await client.shutdown()
            client.kill()
    return asyncio.run(main())


async def _idle(client: EngineClient, timeout_s: float = 30.0) -> None:
    """Wait (bounded) until the core reports nothing running, waiting or held."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while asyncio.get_running_loop().time() < deadline:
        s = client.stats()
        if s.num_running == s.num_waiting == s.kv_blocks_used == 0:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"the core did not go idle: {client.stats()}")


async def _run(client: EngineClient, request_id: str, prompt: list[int], params: SamplingParams) -> RequestOutput:
    stream = await client.add_request(request_id, prompt, params)
    async with stream:
        outs = [out async for out in stream]
    return outs[-1]


@pytest.fixture(scope="module")
def offline(tiny_model_dir) -> list[list[int]]:  # type: ignore[no-untyped-def]
    """Each prompt's greedy tokens from the offline Engine, run alone."""
    engine = Engine(_config(tiny_model_dir))
    tokens = []
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"alone{i}", prompt, GREEDY)
        tokens.append(run_all(engine)[f"alone{i}"].outputs[0].token_ids)
    return tokens


@pytest.mark.parametrize("kind", KINDS)
def test_parity_prefix_and_a_fault_that_fails_alone(kind: str, tiny_model_dir, offline: list[list[int]]) -> None:
    async def body(client: EngineClient) -> None:
        alone = [await _run(client, f"p{i}", p, GREEDY) for i, p in enumerate(PROMPTS)]
        assert [out.outputs[0].token_ids for out in alone] == offline
        again = await _run(client, "again", PROMPTS[2], GREEDY)
        assert again.outputs[0].token_ids == offline[2] and again.num_cached_tokens > 0  # from the prefix cache

        async def poisoned() -> str:
            with pytest.raises(RequestFailed, match="injected execute fault") as info:
                await _run(client, "poison-1", [5, 6, 7, 8], GREEDY)
            return str(info.value)

        results = await asyncio.gather(poisoned(), *(_run(client, f"c{i}", p, GREEDY) for i, p in enumerate(PROMPTS)))
        assert all(out.error is None and out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 10
                   for out in results[1:])
        await _idle(client)
        assert client.stats().failed_requests == 1

    _serve(kind, _config(tiny_model_dir), body)


@pytest.mark.parametrize("kind", KINDS)
def test_leaving_a_stream_aborts_and_refusals_are_typed(kind: str, tiny_model_dir) -> None:
    long = SamplingParams(max_tokens=200, ignore_eos=True)

    async def body(client: EngineClient) -> None:
        stream = await client.add_request("left", [5, 6, 7], long)
        async with stream:
            async for out in stream:
                if len(out.outputs[0].token_ids) >= 3:
                    break  # the client went away: the request is aborted, its blocks freed
        await _idle(client)
        with pytest.raises(errors.RequestTooLong):
            await client.add_request("too-long", [5] * 300, GREEDY)
        with pytest.raises(errors.InvalidRequest, match="empty"):
            await client.add_request("empty", [], GREEDY)
        running = await client.add_request("dup", [5, 6], long)
        with pytest.raises(errors.DuplicateRequestId):
            await client.add_request("dup", [5, 6], long)
        running.abort()

    _serve(kind, _config(tiny_model_dir), body)
