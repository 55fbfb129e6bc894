"""Planner and engine agree exactly on the KV pool for every KV precision, scales included.

Quantized pools (fp8, int8, int4) store a float16 scale per K and V vector besides the elements;
the planner used to leave those out (int8 ``small``: it said 6,144 B/token and 16 seats where the
engine sizes 6,336 B/token and seats 15).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pagedserve.planner import sizing
from pagedserve.bench.plan_check import CheckConfig, run_check
from pagedserve.planner.shapes import standard_shape

KV_DTYPES = ("auto", "fp8", "int8", "int4")
MIB = 2**20


@pytest.mark.parametrize("name", ["tiny", "small"])
@pytest.mark.parametrize("kv_cache_dtype", KV_DTYPES)
def test_planner_bytes_per_token_equal_the_allocated_pool(name: str, kv_cache_dtype: str) -> None:
    from pagedserve.kv.cache import allocate_kv_caches, num_blocks_for_budget
    from pagedserve.kv.quant import kv_cache_bytes_per_token

    shape = standard_shape(name)
    precision = "bf16" if kv_cache_dtype == "auto" else kv_cache_dtype
    planner_bpt = shape.kv_pool_bytes_per_token(precision)
    engine_bpt = kv_cache_bytes_per_token(shape.num_layers, shape.num_kv_heads, shape.head_dim, kv_cache_dtype,
                                          torch.bfloat16)
    assert planner_bpt == engine_bpt
    budget, block = 3 * MIB + 777, 16
    blocks = num_blocks_for_budget(budget, block, engine_bpt)
    assert sizing.num_kv_blocks(budget, planner_bpt, block) == blocks
    # The bytes the engine's pools really hold, every layer's K and V with their scales.
    pools = allocate_kv_caches(shape.num_layers, blocks, block, shape.num_kv_heads, shape.head_dim,
                               torch.bfloat16, torch.device("cpu"), kv_cache_dtype, tail_slots=3)
    held = sum(k.nbytes + v.nbytes for k, v in pools)
    assert held == blocks * block * planner_bpt + 3 * shape.kv_tail_bytes_per_sequence(precision)


def test_int8_small_worked_figure() -> None:
    shape = standard_shape("small")  # 12 layers, 4 KV heads, 64 dims
    assert shape.kv_pool_bytes_per_token("int8") == 6_144 + 2 * 12 * 4 * 2 == 6_336
    # int4: a scale per V vector (96 B) and per key channel of each 16-token block (384 B a token)
    assert shape.kv_pool_bytes_per_token("int4") == 3_072 + 96 + 384
    assert 12_288 / shape.kv_pool_bytes_per_token("int4") > 3.45
    assert shape.kv_tail_bytes_per_sequence("int4") == 16 * 12_288 and shape.kv_tail_bytes_per_sequence("int8") == 0
    assert shape.kv_pool_bytes_per_token("bf16") == 12_288  # no scales in 16-bit KV
    assert sizing.worst_case_seats(384 * MIB, shape.kv_pool_bytes_per_token("int8"), 4096) == 15
    with pytest.raises(sizing.SizingError, match="even head_dim"):
        sizing.kv_pool_bytes_per_token(2, 2, 15, "int4")


@pytest.mark.parametrize("kv_cache_dtype", KV_DTYPES)
def test_plan_check_matches_a_real_engine_for_every_kv_dtype(tiny_model_dir: Path, kv_cache_dtype: str) -> None:
    result = run_check(CheckConfig(model=str(tiny_model_dir), kv_cache_memory=MIB + 4321, max_model_len=256,
                                   kv_cache_dtype=kv_cache_dtype, sizing_only=True))
    s = result["sizing"]
    assert s.matches, s
    assert s.engine_seats == s.engine_blocks * 16 // 256 > 0


def test_plan_seats_cli_quotes_the_engines_figure(run_cli) -> None:
    code, out, _ = run_cli("plan", "seats", "--model", "small", "--kv-dtype", "int8", "--free-memory", "384MiB",
                           "--max-model-len", "4096", "--json")
    assert code == 0
    import json

    payload = json.loads(out)
    assert payload["bytes_per_token"] == 6_336 and payload["worst_case_seats"] == 15
