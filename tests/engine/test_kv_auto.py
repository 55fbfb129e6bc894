"""``kv_cache_memory="auto"``: the pool sized from free memory, each term logged; and the warning
when a pool cannot hold one request of ``max_model_len`` tokens."""

from __future__ import annotations

import dataclasses
import logging

import pytest

from pagedserve.config import EngineConfig
from pagedserve.engine.core import memory
from pagedserve.engine.frontend.engine import Engine
from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.models.hf_config import read_hf_config
from pagedserve.models.llama import ModelArchitecture
from tests.conftest import assert_no_leaks

MIB, GIB = 2**20, 2**30


@pytest.fixture
def no_psutil(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def fake_import(name, *args, **kwargs):
        if name == "psutil":
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", fake_import)


def test_cpu_free_memory_reads_memavailable_and_honours_a_cgroup_limit(monkeypatch, no_psutil):
    monkeypatch.setattr(memory, "_meminfo", lambda: {"MemAvailable": 10 * GIB, "MemTotal": 16 * GIB})
    monkeypatch.setattr(memory, "_cgroup_room", lambda: None)
    free = memory.cpu_free_memory(0.9)
    assert (free.available, free.total, free.usable) == (10 * GIB, 16 * GIB, int(0.9 * 10 * GIB))
    assert "MemAvailable" in free.source
    monkeypatch.setattr(memory, "_cgroup_room", lambda: 2 * GIB)  # a container allowed 2 GiB more
    free = memory.cpu_free_memory(0.5)
    assert (free.available, free.usable) == (2 * GIB, GIB) and "cgroup" in free.source


def test_cuda_rule_is_a_fraction_of_the_whole_card():
    # An 80 GiB card with 30 GiB in use (weights, other processes): 0.9 × 80 − 30 = 42 GiB usable.
    choice = memory.profiled_kv_budget(total=80 * GIB, free=50 * GIB, weights=GIB, peak_activation=GIB, fraction=0.9,
                                       graphs=0, cap=100 * GIB, profile_tokens=1024)
    assert choice.budget == int(0.9 * 80 * GIB) - 30 * GIB - GIB
    assert "0.9 × 80.00 GiB total − 30.00 GiB in use" in choice.describe()


def test_budget_is_capped_and_never_negative():
    free = memory.FreeMemory(usable=10 * GIB, available=12 * GIB, total=16 * GIB, source="test")
    assert memory.auto_kv_budget(free, 0.9, GIB, cap=MIB).budget == MIB
    assert "capped" in memory.auto_kv_budget(free, 0.9, GIB, cap=MIB).describe()
    assert memory.auto_kv_budget(free, 0.9, 20 * GIB, cap=GIB).budget == 0


def test_auto_sizes_the_engine_pool_from_memavailable(tiny_model_dir, monkeypatch, caplog, no_psutil):
    config = EngineConfig(model=str(tiny_model_dir), kv_cache_memory="auto", max_model_len=256, max_num_seqs=64,
                          kv_cache_memory_fraction=0.5)
    arch = ModelArchitecture.from_hf_config(read_hf_config(tiny_model_dir))
    reserve = memory.activation_reserve(arch, dataclasses.replace(config, max_num_batched_tokens=2048))  # CPU default
    # MemAvailable chosen so that 0.5 × it − reserve is exactly 600 KiB: below the cap (64 × 256 tokens).
    monkeypatch.setattr(memory, "_meminfo", lambda: {"MemAvailable": 2 * (reserve + 600 * 1024),
                                                     "MemTotal": 8 * GIB})
    monkeypatch.setattr(memory, "_cgroup_room", lambda: None)
    with caplog.at_level(logging.INFO, logger="pagedserve.engine.core"):
        engine = Engine(config)
    assert engine.core.config.kv_cache_memory == 600 * 1024
    assert engine.core.kv.num_blocks == 600 * 1024 // (16 * 256)
    line = next(r.getMessage() for r in caplog.records if "kv_cache_memory auto" in r.getMessage())
    assert "0.5 ×" in line and "MemAvailable" in line and "activation reserve" in line
    engine.add_request("a", [5] * 20, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    assert_no_leaks(engine)


def test_llm_auto_on_this_machine_is_capped_by_the_seats(tiny_model_dir):
    from pagedserve import LLM

    # The real machine's free memory, far more than 4 sequences × 128 tokens of tiny's KV (256 B/token).
    llm = LLM(str(tiny_model_dir), kv_cache_memory="auto", max_model_len=128, max_num_seqs=4)
    assert llm.engine.core.kv.num_blocks == 4 * 128 // 16
    out = llm.generate("hello", SamplingParams(max_tokens=3, temperature=0, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3
    assert_no_leaks(llm.engine)


def test_a_pool_shorter_than_max_model_len_warns_at_startup(tiny_model_dir, caplog):
    with caplog.at_level(logging.WARNING, logger="pagedserve.engine.core"):
        Engine(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=4, max_model_len=256))
    warning = next(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING
                   and "max_model_len" in r.getMessage())
    assert "holds 64 tokens, fewer than max_model_len 256" in warning
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="pagedserve.engine.core"):
        Engine(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=16, max_model_len=256))
    assert not any("fewer than max_model_len" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("command", ["serve", "generate"])
def test_the_flags_reach_the_config(command):
    from pagedserve.cli import build_parser
    from pagedserve.engine.args import engine_config_from_args

    args = build_parser().parse_args([command, "--model", "m", "--kv-cache-memory", "auto",
                                      "--kv-cache-memory-fraction", "0.6"])
    config = engine_config_from_args(args)
    assert (config.kv_cache_memory, config.kv_cache_memory_fraction) == ("auto", 0.6)
    args = build_parser().parse_args([command, "--model", "m", "--kv-cache-memory-fraction", "1.5"])
    with pytest.raises(ValueError, match="kv_cache_memory_fraction must be in"):
        engine_config_from_args(args)
