"""The multiprocess client end to end: Hugging Face parity, prefix hits, priority, stop strings and
aborts through a real core process, and nothing left in the pool afterwards."""

from __future__ import annotations

import asyncio
import os
import sys

import pytest
import torch

from pagedserve import errors
from pagedserve.config import EngineConfig
from pagedserve.engine.frontend.core_launch import EngineStartupError, spawn_core_process
from pagedserve.engine.frontend.mp_client import MPEngineClient
from pagedserve.engine.sampling_params import SamplingParams
from tests.checkpoints import load_hf

MAX_NEW = 16
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)


def start_core_process(config: EngineConfig):
    """Spawn the core and wait until it has loaded the model (or failed to)."""
    return spawn_core_process(config).wait_ready()


def _hf_greedy(hf, prompt: list[int]) -> list[int]:
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW, do_sample=False)
    return out[0, len(prompt):].tolist()


async def _collect(client: MPEngineClient, request_id: str, prompt: list[int], params: SamplingParams,
                   priority: int = 0):
    stream = await client.add_request(request_id, prompt, params, priority)
    final = None
    async with stream:
        async for out in stream:
            final = out
    return final


async def _idle(client: MPEngineClient) -> None:
    for _ in range(200):
        s = client.stats()
        if s.kv_blocks_used == 0 and s.num_running == 0 and s.num_waiting == 0:
            return
        await asyncio.sleep(0.02)


def test_parity_prefix_and_priority_through_the_core_process(checkpoint_dir):
    model_dir = checkpoint_dir("llama")
    hf = load_hf(model_dir)
    g = torch.Generator().manual_seed(3)
    shared = torch.randint(3, 32000, (40,), generator=g).tolist()
    prompts = [shared + torch.randint(3, 32000, (n,), generator=g).tolist() for n in (5, 9, 17, 3)]
    core = start_core_process(EngineConfig(model=str(model_dir), dtype="float32", num_kv_blocks=128, block_size=8))

    async def main():
        client = MPEngineClient(core)
        await client.start()
        try:
            first = await _collect(client, "warm", prompts[0], GREEDY)
            rest = await asyncio.gather(*(_collect(client, f"p{i}", p, GREEDY, priority=i % 2)
                                          for i, p in enumerate(prompts)))
            await _idle(client)
            return first, rest, client.stats()
        finally:
            await client.shutdown()

    first, rest, stats = asyncio.run(main())
    expected = [_hf_greedy(hf, p) for p in prompts]
    assert first.outputs[0].token_ids == expected[0]
    assert [out.outputs[0].token_ids for out in rest] == expected
    assert all(out.num_cached_tokens >= 40 - 8 for out in rest)  # the shared prefix came from the cache
    assert stats.kv_blocks_used == 0 and stats.num_running == 0
    assert not core.process.is_alive()


def test_stop_strings_aborts_and_refusals_through_the_core_process(tiny_model_dir):
    core = start_core_process(EngineConfig(model=str(tiny_model_dir), dtype="float32", num_kv_blocks=64,
                                           max_model_len=256, max_num_seqs=4, num_threads=1))
    assert core.facts.num_threads == 1  # --num-threads reaches the core's process, not this one

    async def main():
        client = MPEngineClient(core)
        await client.start()
        try:
            params = SamplingParams(n=2, max_tokens=24, temperature=0.0, ignore_eos=True)
            probe = await _collect(client, "probe", [5, 6, 7, 8], params)
            stop = probe.outputs[0].text[4:7]
            stopped = await _collect(client, "stopped", [5, 6, 7, 8],
                                     SamplingParams(n=2, max_tokens=24, temperature=0.0, ignore_eos=True, stop=[stop]))
            stream = await client.add_request("left", [9, 9, 9], SamplingParams(max_tokens=200, ignore_eos=True))
            async with stream:
                async for out in stream:
                    if len(out.outputs[0].token_ids) >= 3:
                        break
            with pytest.raises(errors.InvalidRequest, match="max_num_seqs"):
                await client.add_request("too-many", [1, 2], SamplingParams(n=5))
            with pytest.raises(errors.RequestTooLong):
                await client.add_request("too-long", list(range(3, 300)), GREEDY)
            await _idle(client)
            return probe, stop, stopped, client.stats()
        finally:
            await client.shutdown()

    probe, stop, stopped, stats = asyncio.run(main())
    assert stop and all(c.finish_reason == "stop" and c.stop_reason == stop for c in stopped.outputs)
    assert [c.text for c in stopped.outputs] == [c.text[:c.text.index(stop)] for c in probe.outputs]
    assert stats.kv_blocks_used == 0 and stats.num_running == 0 and stats.num_waiting == 0


def test_a_core_that_cannot_start_says_why_in_one_line(tmp_path):
    with pytest.raises(EngineStartupError) as info:
        start_core_process(EngineConfig(model=str(tmp_path / "no-such-model")))
    assert "\n" not in str(info.value) and "no-such-model" in str(info.value)


@pytest.mark.parametrize("bad", [0, 1025, 2.5, True])
def test_num_threads_is_bounded(bad):
    with pytest.raises(ValueError, match="num_threads"):
        EngineConfig(model="x", num_threads=bad)


def test_num_threads_flag_reaches_the_config():
    import argparse

    from pagedserve.engine.args import add_engine_args, engine_config_from_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_config_from_args(parser.parse_args(["--model", "x"])).num_threads is None
    assert engine_config_from_args(parser.parse_args(["--model", "x", "--num-threads", "1"])).num_threads == 1


def _thread_priorities(pid: int) -> set[tuple[int, int]]:
    """(niceness, scheduling policy) of every thread of process ``pid``."""
    out = set()
    for tid in os.listdir(f"/proc/{pid}/task"):
        fields = open(f"/proc/{pid}/task/{tid}/stat").read().rsplit(")", 1)[1].split()
        out.add((int(fields[16]), int(fields[38])))  # stat fields 19 (nice) and 41 (policy)
    return out


def _one_step_then(core, read_threads):
    """Run one request through ``core`` (so that torch's worker threads exist), then read its threads
    with ``read_threads(pid)``: (the output, what was read, the engine's stats), the core shut down."""

    async def main():
        client = MPEngineClient(core)
        await client.start()
        try:
            out = await _collect(client, "r", [5, 6, 7, 8], SamplingParams(max_tokens=4, temperature=0.0,
                                                                          ignore_eos=True))
            return out, read_threads(core.process.pid), client.stats()
        finally:
            await client.shutdown()

    return asyncio.run(main())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="niceness and SCHED_BATCH as Linux has them")
def test_engine_core_nice_lowers_every_core_thread_and_only_the_core(tiny_model_dir):
    core = start_core_process(EngineConfig(model=str(tiny_model_dir), dtype="float32", num_kv_blocks=64,
                                           max_model_len=256, max_num_seqs=4, num_threads=2, engine_core_nice=7))

    out, threads, stats = _one_step_then(core, _thread_priorities)
    assert len(out.outputs[0].token_ids) == 4
    assert threads == {(7, os.SCHED_BATCH)}  # main, ZMQ I/O and torch's threads alike
    assert os.getpriority(os.PRIO_PROCESS, 0) == 0 and os.sched_getscheduler(0) == os.SCHED_OTHER  # not this one
    assert stats.kv_blocks_used == 0


@pytest.mark.parametrize("bad", [-1, 20, 2.5, True])
def test_engine_core_nice_is_bounded(bad):
    with pytest.raises(ValueError, match="engine_core_nice"):
        EngineConfig(model="x", engine_core_nice=bad)


def test_serve_runs_the_core_at_normal_priority_by_default_and_the_flag_lowers_it():
    import argparse

    from pagedserve.engine.args import engine_config_from_args
    from pagedserve.server.cli import add_parser

    sub = argparse.ArgumentParser().add_subparsers()
    serve = add_parser(sub)
    assert engine_config_from_args(serve.parse_args(["--model", "x"])).engine_core_nice == 0
    assert engine_config_from_args(serve.parse_args(["--model", "x", "--engine-core-nice", "10"])).engine_core_nice == 10
    with pytest.raises(SystemExit):
        serve.parse_args(["--model", "x", "--engine-core-nice", "20"])


def _thread_cpus(pid: int) -> dict[str, list[frozenset[int]]]:
    """The CPUs each thread of process ``pid`` may run on, by thread name."""
    out: dict[str, list[frozenset[int]]] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/comm") as f:
            name = f.read().strip()
        out.setdefault(name, []).append(frozenset(os.sched_getaffinity(int(tid))))
    return out


@pytest.fixture
def no_openmp_placement(monkeypatch):
    """No OpenMP affinity or thread count in the environment (restored afterwards, whatever is set)."""
    from pagedserve.engine.process_placement import OPENMP_AFFINITY_VARIABLES

    for name in (*OPENMP_AFFINITY_VARIABLES, "OMP_NUM_THREADS"):
        monkeypatch.setenv(name, "")  # recorded as it was, so what bind_step_threads sets is undone too
        monkeypatch.delenv(name)
    return monkeypatch


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="thread affinity as Linux has it")
def test_bind_step_threads_pins_only_one_thread_per_core(no_openmp_placement):
    from pagedserve.engine.process_placement import bind_step_threads, usable_cores

    cores = usable_cores()
    assert 1 <= cores <= len(os.sched_getaffinity(0))
    assert not bind_step_threads(cores + 1) and "OMP_PROC_BIND" not in os.environ
    if cores >= 2:
        assert not bind_step_threads(cores - 1) and "OMP_PROC_BIND" not in os.environ  # servers sharing cores
    no_openmp_placement.setenv("OMP_NUM_THREADS", str(cores + 1))
    assert not bind_step_threads(None)
    no_openmp_placement.setenv("OMP_NUM_THREADS", str(cores))
    no_openmp_placement.setenv("GOMP_CPU_AFFINITY", "0")  # the user's own placement wins
    assert not bind_step_threads(None) and "OMP_PROC_BIND" not in os.environ
    no_openmp_placement.delenv("GOMP_CPU_AFFINITY")
    no_openmp_placement.delenv("OMP_NUM_THREADS")
    if cores >= 2:
        assert bind_step_threads(None)
        assert (os.environ["OMP_NUM_THREADS"], os.environ["OMP_PROC_BIND"], os.environ["OMP_PLACES"]) == \
            (str(cores), "close", "cores")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="thread affinity as Linux has it")
def test_a_pinned_core_has_one_step_thread_per_core_and_unpinned_zmq_threads(tiny_ggufs, no_openmp_placement):
    from pagedserve.engine.process_placement import usable_cores

    if usable_cores() < 2:
        pytest.skip("one core: nothing to pin")
    everywhere = frozenset(os.sched_getaffinity(0))
    # A GGUF model: its decode stack has a pool of its own on every CPU (a stack whose linears torch
    # computes runs on OpenMP's threads instead, models/native_decode.py)
    core = start_core_process(EngineConfig(model=str(tiny_ggufs("Q4_1", tokenizer=True)), num_kv_blocks=64,
                                           max_model_len=256, max_num_seqs=4, bind_step_threads=True))
    assert core.facts.threads_pinned and core.facts.num_threads == usable_cores()

    out, (threads, main_core), stats = _one_step_then(
        core, lambda pid: (_thread_cpus(pid), frozenset(os.sched_getaffinity(pid))))
    assert len(out.outputs[0].token_ids) == 4 and stats.kv_blocks_used == 0
    # The native decode stack's pool workers (kernels/work_pool.h) take the places of OpenMP's
    # threads 1..n-1: one per core, none on the main thread's.
    pool = threads.pop("pagedserve-pool", [])
    pinned = [cpus for sets in threads.values() for cpus in sets if cpus != everywhere]
    # One OpenMP step thread per core, each on its own: disjoint sets that cover every CPU the process
    # may use. No other thread is pinned (ZMQ's started after the main thread was: they got every CPU back).
    assert len(pinned) == len(set(pinned)) == usable_cores() and frozenset().union(*pinned) == everywhere
    assert sum(len(cpus) for cpus in pinned) == len(everywhere)
    assert len(pool) == len(set(pool)) == usable_cores() - 1 and all(cpus in pinned for cpus in pool)
    assert main_core in pinned and main_core not in pool
    assert threads["ZMQbg/IO/0"] == threads["ZMQbg/Reaper"] == [everywhere]
    assert frozenset(os.sched_getaffinity(0)) == everywhere  # this process is untouched


def test_serve_pins_step_threads_by_default_and_the_flag_turns_it_off():
    import argparse

    from pagedserve.engine.args import engine_config_from_args
    from pagedserve.server.cli import add_parser

    sub = argparse.ArgumentParser().add_subparsers()
    serve = add_parser(sub)
    assert engine_config_from_args(serve.parse_args(["--model", "x"])).bind_step_threads is True
    assert engine_config_from_args(serve.parse_args(["--model", "x", "--no-bind-step-threads"])).bind_step_threads \
        is False
    assert EngineConfig(model="x").bind_step_threads is False  # the library's engine leaves threads alone
    with pytest.raises(ValueError, match="bind_step_threads"):
        EngineConfig(model="x", bind_step_threads="yes")
