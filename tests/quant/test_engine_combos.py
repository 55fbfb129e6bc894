"""Every weight × KV precision through the real scheduler: prefix caching, preemption, no leaked block."""

from __future__ import annotations

import pytest

from pagedserve.config import EngineConfig
from pagedserve.engine.frontend.engine import Engine
from pagedserve.engine.sampling_params import SamplingParams
from tests.conftest import assert_no_leaks

WEIGHTS = ["none", "int8", "int4"]
KVS = ["auto", "fp8", "int8", "int4"]


@pytest.mark.parametrize("kv", KVS)
@pytest.mark.parametrize("weights", WEIGHTS)
def test_combination_serves_with_prefix_hits_and_preemption_without_leaks(tiny_model_dir, weights, kv):
    # 10 blocks of 16 tokens; six requests of 40-token prompts (a shared 32-token prefix) growing to
    # 60 tokens need 4 blocks each, so the pool overflows and the scheduler must preempt.
    engine = Engine(EngineConfig(model=str(tiny_model_dir), quantization=weights, kv_cache_dtype=kv,
                                 num_kv_blocks=10, max_model_len=128, max_num_batched_tokens=128))
    prefix = list(range(100, 132))
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    engine.add_request("first", prefix + [7] * 8, params)
    while engine.has_unfinished_requests():
        engine.step()  # the first one alone: its full prefix blocks become cached
    for i in range(6):
        engine.add_request(str(i), prefix + [200 + i] * 8, params)
    finished = {}
    for _ in range(500):  # bounded: a deadlock fails the test instead of hanging it
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    assert len(finished) == 6 and all(len(o.outputs[0].token_ids) == 20 for o in finished.values())
    assert engine.core.block_manager.prefix_hit_tokens >= 32
    assert engine.core.scheduler.num_preemptions > 0
    assert_no_leaks(engine)
    # The prefix-cache key carries the real KV storage precision.
    assert engine.core.scheduler.config.kv_cache_dtype == ("bfloat16" if kv == "auto" else kv)


def test_pool_sizing_uses_real_bytes_so_int8_about_doubles_the_seats(tiny_model_dir):
    """The engine's own pool sizing, same budget: int8 / int4 KV against bf16 (tiny: head_dim 16)."""
    blocks, tails = {}, 0
    for kv in ("auto", "int8", "int4"):
        engine = Engine(EngineConfig(model=str(tiny_model_dir), kv_cache_dtype=kv, kv_cache_memory="4MiB",
                                     max_model_len=256, max_num_seqs=32))
        caches = engine.core.runner.kv_caches
        held = sum(k.nbytes + v.nbytes for k, v in caches)
        if kv == "int4":  # and a float16 tail block per seat, taken from the same budget
            tails = sum(k.tail.nbytes + v.tail.nbytes for k, v in caches)
            # 16 tokens at float16: 256 B each (layers × KV heads = 4, of 20 int4 bytes a token; 16 dims × K, V × 2 B)
            assert engine.core.kv.bytes_per_token == 4 * 20
            assert caches[0][0].tails.num_slots == 32 and tails == 32 * 16 * 4 * 16 * 2 * 2
        assert held == engine.core.kv.num_blocks * 16 * engine.core.kv.bytes_per_token + tails <= 4 * 2**20
        assert engine.stats().kv_bytes_per_token == engine.core.kv.bytes_per_token
        blocks[kv] = engine.core.kv.num_blocks
    # head_dim 16: int8 stores 16 + 2 scale bytes per vector against 32 (x1.78); int4 8 + 2 per K
    # (a scale per channel and 16 tokens) and per V vector (x3.2), in what the tails leave.
    assert blocks["int8"] / blocks["auto"] == pytest.approx(32 / 18, rel=0.01)
    assert blocks["int4"] / blocks["auto"] == pytest.approx(32 / 10 * (1 - tails / (4 * 2**20)), rel=0.01)


def test_bad_precision_values_are_refused_at_the_edge(tiny_model_dir):
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig(model=str(tiny_model_dir), kv_cache_dtype="int3")
    with pytest.raises(ValueError, match="quantization"):
        EngineConfig(model=str(tiny_model_dir), quantization="fp4")


def test_engine_flags_carry_both_dials():
    import argparse

    from pagedserve.engine.args import add_engine_args, engine_config_from_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    cfg = engine_config_from_args(parser.parse_args(["--model", "m", "--kv-cache-dtype", "int4",
                                                     "--quantization", "int8"]))
    assert (cfg.kv_cache_dtype, cfg.quantization) == ("int4", "int8")
    defaults = engine_config_from_args(parser.parse_args(["--model", "m"]))
    assert (defaults.kv_cache_dtype, defaults.quantization) == ("auto", "none")
    with pytest.raises(SystemExit):
        parser.parse_args(["--model", "m", "--kv-cache-dtype", "int2"])


def test_int4_pools_serve_branches_and_prefix_hits_alike_in_every_backend(checkpoint_dir):
    """int4 KV (keys per channel, values rotated, open blocks in float16 tails): in each attention
    backend, n=3 greedy branches (the prompt's partial last block, in a tail, copied on write into
    tails of their own) each equal the single greedy continuation, a request served the prompt's
    full (quantized) blocks from the prefix cache continues it the same way, and no block or tail
    slot leaks; and the backends agree with each other (the fused kernel reads the pools in place,
    the others gather them, the reference rotates each gathered value back)."""
    from tests.conftest import run_all

    prompt = list(range(300, 311))  # 11 tokens, block 8: the last block is partial
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    got = {}
    for backend in ("fused", "matmul", "sdpa", "reference"):
        engine = Engine(EngineConfig(model=str(checkpoint_dir("llama")), dtype="float32", kv_cache_dtype="int4",
                                     num_kv_blocks=64, block_size=8, attention_backend=backend))
        k_pool, v_pool = engine.core.runner.kv_caches[0]
        assert k_pool.per_channel and k_pool.rotation is None and v_pool.rotation is not None
        engine.add_request("single", prompt, greedy)
        single = run_all(engine)["single"].outputs[0].token_ids
        engine.add_request("branches", prompt, SamplingParams(n=3, max_tokens=12, temperature=0, ignore_eos=True))
        branches = [c.token_ids for c in run_all(engine)["branches"].outputs]
        assert engine.core.block_manager.prefix_hit_tokens >= 8
        assert branches == [single] * 3, backend
        assert_no_leaks(engine)
        got[backend] = single
    assert got["fused"] == got["matmul"] == got["sdpa"] == got["reference"]
