"""Sizing formulas: KV, seats, blocks, weights, decode and prefill bounds, model shapes."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pagedserve.models.standard import STANDARD_MODELS
from pagedserve.planner import sizing
from pagedserve.planner.shapes import ModelShape, ModelShapeError, load_model_shape, shape_from_config, standard_shape

GIB, MIB, KIB = 2**30, 2**20, 2**10

LLAMA3_8B = dict(model_type="llama", hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                 num_key_value_heads=8, intermediate_size=14336, vocab_size=128256, tie_word_embeddings=False,
                 max_position_embeddings=8192)
QWEN25_05B = dict(model_type="qwen2", hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
                  num_key_value_heads=2, intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True)


def test_kv_precisions_scale_bytes_per_token() -> None:
    bf16 = sizing.kv_bytes_per_token(32, 8, 128, sizing.kv_element_bytes("bf16"))
    assert sizing.kv_bytes_per_token(32, 8, 128, sizing.kv_element_bytes("fp16")) == bf16
    assert sizing.kv_bytes_per_token(32, 8, 128, sizing.kv_element_bytes("fp8")) == bf16 / 2
    assert sizing.kv_bytes_per_token(32, 8, 128, sizing.kv_element_bytes("int8")) == bf16 / 2
    assert sizing.kv_bytes_per_token(32, 8, 128, sizing.kv_element_bytes("int4")) == bf16 / 4


def test_unknown_precision_is_a_typed_error() -> None:
    with pytest.raises(sizing.SizingError, match="unknown KV precision"):
        sizing.kv_element_bytes("int3")
    with pytest.raises(sizing.SizingError, match="unknown weight precision"):
        sizing.weight_bytes(8e9, "nf5")


def test_seats_boundary_is_exact() -> None:
    per_request = 640 * MIB
    assert sizing.worst_case_seats(15 * per_request, 160 * KIB, 4096) == 15
    assert sizing.worst_case_seats(15 * per_request - 1, 160 * KIB, 4096) == 14
    assert sizing.worst_case_seats(0, 160 * KIB, 4096) == 0


@given(free=st.integers(0, 2**40), bpt=st.integers(1, 2**20), max_len=st.integers(1, 2**17))
def test_worst_case_seats_fit_and_one_more_does_not(free: int, bpt: int, max_len: int) -> None:
    seats = sizing.worst_case_seats(free, bpt, max_len)
    assert seats * bpt * max_len <= free < (seats + 1) * bpt * max_len


def test_paging_holds_more_seats_at_a_shorter_mean_length() -> None:
    bpt = 160 * KIB
    assert sizing.num_kv_blocks(9 * GIB, bpt, 16) == 3686
    assert sizing.paged_seats(9 * GIB, bpt, 16, 1200) == 3686 // 75 == 49
    assert sizing.paged_seats(9 * GIB, bpt, 16, 4096) == sizing.worst_case_seats(9 * GIB, bpt, 4096) == 14
    # A length one past a block boundary costs a whole extra block.
    assert sizing.paged_seats(9 * GIB, bpt, 16, 1201) == 3686 // 76


@pytest.mark.parametrize("name", sorted(STANDARD_MODELS))
@pytest.mark.parametrize("budget", [1 * MIB, 100 * MIB + 12345, 256 * MIB, 3 * GIB])
@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_blocks_and_seats_equal_the_engines_pool_rule_for_standard_models(name: str, budget: int,
                                                                         block_size: int) -> None:
    import torch

    from pagedserve.kv.cache import num_blocks_for_budget
    from pagedserve.kv.quant import kv_cache_bytes_per_token

    shape = standard_shape(name)
    for dtype in (torch.bfloat16, torch.float32):
        engine_bpt = kv_cache_bytes_per_token(shape.num_layers, shape.num_kv_heads, shape.head_dim, "auto", dtype)
        planner_bpt = shape.kv_bytes_per_token(torch.empty((), dtype=dtype).element_size())
        assert planner_bpt == engine_bpt
        engine_blocks = num_blocks_for_budget(budget, block_size, engine_bpt)
        assert sizing.num_kv_blocks(budget, planner_bpt, block_size) == engine_blocks
        assert sizing.seats_at_max_len(engine_blocks, block_size, 4096) == engine_blocks * block_size // 4096


def test_standard_models_kv_bytes_per_token_match_bench_md() -> None:
    assert standard_shape("tiny").kv_bytes_per_token(2) == 256
    assert standard_shape("small").kv_bytes_per_token(2) == 12 * KIB
    assert standard_shape("qwen05-shape").kv_bytes_per_token(2) == 12 * KIB


def test_reservation_plan_adds_up() -> None:
    plan = sizing.reservation_plan(12 * KIB, 4096, 1200, users=8, block_size=16)
    assert plan.reserved_total == 8 * 4096 * 12 * KIB
    assert plan.used_total + plan.idle_total == plan.reserved_total
    assert plan.tail_waste_bytes == 15 * 12 * KIB
    with pytest.raises(sizing.SizingError):
        sizing.reservation_plan(12 * KIB, 4096, 5000, users=1)


def test_weight_scales_apply_to_quantized_precisions_only() -> None:
    assert sizing.weight_bytes(1e9, "int8", group_size=64, scale_bytes=4) == 1e9 + 1e9 / 64 * 4
    assert sizing.weight_bytes(1e9, "fp16", group_size=64) == 2e9
    assert sizing.weight_bytes(1e9, "fp32") == 4e9


def test_kv_memory_left_after_weights_and_overhead() -> None:
    assert sizing.kv_memory_left(80e9, 16e9, 2e9) == 62e9
    assert sizing.kv_memory_left(80e9, 16e9, 0, memory_fraction=0.9) == pytest.approx(56e9)
    with pytest.raises(sizing.SizingError, match="do not fit"):
        sizing.kv_memory_left(24e9, 16e9 * 2, 0)


def test_decode_bound_counts_kv_reads_and_batching() -> None:
    one = sizing.decode_tokens_per_s(1000e9, 4e9)
    assert one == 250.0
    # 8 streams at 8,192 tokens of 128 KiB each read 8 GiB of KV per step on top of the weights.
    per_stream = sizing.decode_tokens_per_s(1000e9, 4e9, 128 * KIB, 8192, batch=8)
    assert per_stream == pytest.approx(1000e9 / (4e9 + 8 * 8192 * 128 * KIB))
    assert per_stream * 8 > one  # batching raises total throughput, since weights are read once


def test_prefill_seconds_is_two_flops_per_param_per_token() -> None:
    assert sizing.prefill_seconds(8e9, 2048, 400e12) == pytest.approx(2 * 8e9 * 2048 / 400e12)
    assert sizing.prefill_seconds(7e9, 2048, 400e12, head_params=1e9) == pytest.approx(2 * (7e9 * 2048 + 1e9) / 400e12)
    with pytest.raises(sizing.SizingError):
        sizing.prefill_seconds(8e9, 100, 0)


def test_shape_from_llama3_8b_config_counts_its_published_parameters() -> None:
    shape = shape_from_config(LLAMA3_8B, "llama3-8b")
    assert shape.total_params == 8_030_261_248
    assert shape.kv_bytes_per_token(2) == 128 * KIB
    assert shape.matmul_params == shape.total_params - 128256 * 4096  # the input embedding is a lookup


def test_shape_from_qwen25_05b_config_counts_bias_and_tied_head() -> None:
    shape = shape_from_config(QWEN25_05B, "qwen2.5-0.5b")
    assert shape.qkv_bias and shape.tie_word_embeddings
    assert shape.total_params == 494_032_768
    assert shape.matmul_params == shape.total_params  # the tied table is also the LM head


def test_standard_tiny_shape_counts_the_checkpoints_parameters(tiny_model_dir: Path) -> None:
    from safetensors import safe_open

    stored = 0
    for file in tiny_model_dir.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as f:
            stored += sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())
    assert load_model_shape(str(tiny_model_dir)).total_params == stored == standard_shape("tiny").total_params


def test_load_model_shape_reads_a_config_json_file(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(LLAMA3_8B))
    assert load_model_shape(str(tmp_path / "config.json")).total_params == 8_030_261_248
    assert load_model_shape(str(tmp_path)).num_kv_heads == 8


def test_load_model_shape_rejects_what_it_cannot_read(tmp_path: Path) -> None:
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    with pytest.raises(ModelShapeError, match="not valid JSON"):
        load_model_shape(str(bad))
    bad.write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(ModelShapeError, match="hidden_size"):
        load_model_shape(str(bad))
    with pytest.raises(ModelShapeError):
        load_model_shape(str(tmp_path / "missing-dir"))


def test_shape_without_size_refuses_to_guess_parameters() -> None:
    shape = ModelShape("custom", 40, 8, 128)
    assert shape.kv_bytes_per_token(2) == 163_840
    with pytest.raises(ModelShapeError, match="unknown"):
        _ = shape.total_params
    with pytest.raises(ModelShapeError):
        ModelShape("bad", 0, 8, 128)
