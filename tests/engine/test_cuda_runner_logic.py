"""The CUDA runner's logic that does not need a GPU: the padded batch sizes graphs are captured for,
the persistent decode buffers a graph replays over, the profile step and the arithmetic of
``--kv-cache-memory auto`` on a card. (The kernels and a padded step through the real model are in
tests/gpu, under Triton's interpreter; capture and replay themselves run on the card only.)"""

from __future__ import annotations

import pytest
import torch

from pagedserve.config import EngineConfig
from pagedserve.engine.args import add_engine_args, engine_config_from_args
from pagedserve.engine.core.cuda_graphs import PAD_SLOT, DecodeBuffers, graph_batch_sizes, padded_batch_size
from pagedserve.engine.core.memory import ProfiledKVBudget, profiled_kv_budget
from pagedserve.engine.core.profile_run import profile_step, run_profile_step
from pagedserve.engine.core.runner import ModelInput
from pagedserve.models.attention import AttentionMetadata

MIB, GIB = 2**20, 2**30


@pytest.mark.parametrize("max_num_seqs,sizes", [
    (1, [1]), (3, [1, 2, 3]), (8, [1, 2, 4, 8]), (12, [1, 2, 4, 8, 12]),
    (64, [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]), (20, [1, 2, 4, 8, 16, 20])])
def test_graph_batch_sizes_climb_to_max_num_seqs(max_num_seqs, sizes):
    assert graph_batch_sizes(max_num_seqs) == sizes


def test_a_batch_pads_to_the_smallest_size_that_holds_it():
    sizes = graph_batch_sizes(64)
    assert [padded_batch_size(n, sizes) for n in (1, 2, 3, 5, 8, 9, 17, 63, 64)] == [1, 2, 4, 8, 8, 16, 24, 64, 64]
    assert padded_batch_size(65, sizes) is None  # more rows than any graph (speculative rows): eager


def _decode_input(rows: int, width: int, seed: int) -> ModelInput:
    g = torch.Generator().manual_seed(seed)
    tables = torch.randint(1, 100, (rows, width), generator=g)
    lens = torch.randint(1, width * 16 + 1, (rows,), generator=g)
    meta = AttentionMetadata(torch.randint(0, 1600, (rows,), generator=g), rows, tables, lens, None, [])
    return ModelInput(torch.randint(0, 500, (rows,), generator=g), lens - 1, meta, torch.arange(rows), [])


def test_decode_buffers_are_reused_and_pad_every_row_past_the_batch():
    buffers = DecodeBuffers(max_batch=16, max_blocks=8, device=torch.device("cpu"))
    ids, positions, meta = buffers.inputs(8)
    addresses = [t.data_ptr() for t in (ids, positions, meta.slot_mapping, meta.decode_block_tables,
                                        meta.decode_context_lens)]
    buffers.load(_decode_input(7, 5, seed=0), 8)
    step = _decode_input(3, 2, seed=1)  # a smaller batch after a larger one: old rows must not survive
    buffers.load(step, 8)
    again = buffers.inputs(8)
    assert again[0] is ids and again[2] is meta  # the very views the graph was captured on
    assert [t.data_ptr() for t in (again[0], again[1], again[2].slot_mapping, again[2].decode_block_tables,
                                   again[2].decode_context_lens)] == addresses
    assert torch.equal(ids[:3], step.input_ids) and torch.equal(positions[:3], step.positions)
    assert torch.equal(meta.slot_mapping[:3], step.meta.slot_mapping)
    assert torch.equal(meta.decode_block_tables[:3, :2], step.meta.decode_block_tables)
    assert torch.equal(meta.decode_context_lens[:3], step.meta.decode_context_lens)
    # Padding rows: no KV written (slot -1), nothing attended (context 0), token 0 at position 0.
    assert (meta.slot_mapping[3:] == PAD_SLOT).all() and (meta.decode_context_lens[3:] == 0).all()
    assert (ids[3:] == 0).all() and (positions[3:] == 0).all()
    assert meta.num_decodes == 8 and meta.decode_block_tables.shape == (8, 8) and not meta.prefills


def test_decode_buffers_refuse_a_batch_they_cannot_hold():
    buffers = DecodeBuffers(max_batch=4, max_blocks=2, device=torch.device("cpu"))
    with pytest.raises(ValueError, match="does not fit"):
        buffers.load(_decode_input(3, 3, seed=0), 4)  # wider tables than max_model_len allows
    with pytest.raises(ValueError, match="does not fit"):
        buffers.load(_decode_input(3, 2, seed=0), 2)  # padded to fewer rows than it has


def test_profiled_budget_subtracts_every_term_and_says_so():
    b = profiled_kv_budget(total=80 * GIB, free=78 * GIB, weights=GIB, peak_activation=3 * GIB, fraction=0.9,
                           graphs=256 * MIB, cap=100 * GIB, profile_tokens=8192)
    assert b.in_use == 2 * GIB
    assert b.budget == int(0.9 * 80 * GIB) - 2 * GIB - 3 * GIB - 256 * MIB
    text = b.describe()
    for term in ("0.9 × 80.00 GiB total", "2.00 GiB in use", "weights 1.00 GiB", "3.00 GiB peak of a 8192-token",
                 "256.0 MiB for CUDA graphs"):
        assert term in text, text


def test_profiled_budget_is_capped_by_the_seats_and_never_negative():
    capped = profiled_kv_budget(80 * GIB, 79 * GIB, GIB, GIB, 0.9, 0, cap=5 * GIB, profile_tokens=1024)
    assert capped.budget == 5 * GIB and "capped" in capped.describe()
    full = profiled_kv_budget(80 * GIB, 10 * GIB, GIB, 4 * GIB, 0.5, 0, cap=5 * GIB, profile_tokens=1024)
    assert isinstance(full, ProfiledKVBudget) and full.budget == 0


@pytest.mark.parametrize("tokens,max_model_len", [(1024, 256), (100, 4096), (300, 101)])
def test_profile_step_is_the_largest_batch_the_scheduler_forms(tokens, max_model_len):
    config = EngineConfig("m", max_num_batched_tokens=tokens, max_model_len=max_model_len, max_num_seqs=64,
                          block_size=16)
    step = profile_step(config, torch.device("cpu"))
    assert step.num_tokens == tokens
    assert sum(q for _, q, _, _ in step.meta.prefills) == tokens
    for start, q_len, ctx, table in step.meta.prefills:  # whole prompts, each leaving room for an output token
        assert q_len == ctx <= max_model_len - 1 and table.numel() == -(-ctx // 16)
        assert torch.equal(step.positions[start:start + q_len], torch.arange(q_len))
    assert step.sampled_rows.numel() == min(64, tokens)


def test_profile_step_runs_through_the_model(tiny_model_dir):
    from pagedserve.models.llama import ModelArchitecture
    from pagedserve.models.hf_config import read_hf_config
    from pagedserve.models.loader import load_model

    arch = ModelArchitecture.from_hf_config(read_hf_config(tiny_model_dir))
    config = EngineConfig(str(tiny_model_dir), max_model_len=256, attention_backend="matmul",
                          max_num_batched_tokens=300, max_num_seqs=8)
    model = load_model(tiny_model_dir, arch, torch.float32, torch.device("cpu"), config)
    step = profile_step(config, torch.device("cpu"))
    probs = run_profile_step(model, step, torch.float32, "auto", torch.device("cpu"))
    assert probs.shape == (8, arch.vocab_size) and torch.isfinite(probs).all()


def test_the_cuda_flags_reach_the_config():
    import argparse

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--model", "m", "--no-cuda-graphs", "--gpu-memory-utilization", "0.8",
                              "--attention-backend", "triton"])
    config = engine_config_from_args(args)
    assert (config.cuda_graphs, config.kv_cache_memory_fraction, config.attention_backend) == (False, 0.8, "triton")
    assert engine_config_from_args(parser.parse_args(["--model", "m"])).cuda_graphs is True
    assert engine_config_from_args(parser.parse_args(["--model", "m", "--enforce-eager"])).cuda_graphs is False
    assert "CUDA graphs" in parser.format_help()
    with pytest.raises(ValueError, match="cuda_graphs"):
        EngineConfig(model="m", cuda_graphs="no")


def test_triton_refuses_int4_pools_and_auto_on_cpu_never_picks_it():
    from pagedserve.engine.core.builder import _resolve_attention_backend

    with pytest.raises(ValueError, match="triton"):
        _resolve_attention_backend(EngineConfig("m", attention_backend="triton", kv_cache_dtype="int4"),
                                   torch.device("cpu"))
    assert _resolve_attention_backend(EngineConfig("m"), torch.device("cpu")) in ("fused", "matmul")
