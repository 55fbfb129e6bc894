"""The runner's decode-only inputs (``ModelRunner._prepare_decodes``, a few tensor calls) are the
general path's (``_prepare_any``) tensor for tensor, step after step of a real engine: sequences of
several lengths crossing block boundaries, joining and leaving the batch."""

from __future__ import annotations

import torch

from pagedserve.config import EngineConfig
from pagedserve.engine.core.engine_core import EngineCore
from pagedserve.engine.sampling_params import SamplingParams
from tests.conftest import assert_no_leaks, run_all


def _same_inputs(fast, general) -> None:
    assert torch.equal(fast.input_ids, general.input_ids) and torch.equal(fast.positions, general.positions)
    assert fast.sample_indices is None and general.sample_indices is None  # every row samples
    assert fast.sampled_seqs == general.sampled_seqs and fast.prompt_spans is general.prompt_spans is None
    a, b = fast.meta, general.meta
    assert a.num_decodes == b.num_decodes and a.prefills == b.prefills == [] and a.window == b.window
    for name in ("slot_mapping", "decode_block_tables", "decode_context_lens", "decode_mask"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y), name


def test_decode_steps_get_the_general_paths_inputs(tiny_model_dir):
    core = EngineCore(EngineConfig(model=str(tiny_model_dir), block_size=4, num_kv_blocks=96, max_model_len=128,
                                   max_num_seqs=4, enable_prefix_caching=False))
    runner, seen = core.runner, {"decode": 0, "other": 0}
    prepare = runner.prepare

    def checked(plan):
        model_input = prepare(plan)
        if all(n == 1 and s.num_computed_tokens + 1 == s.num_tokens for s, n in plan.scheduled):
            _same_inputs(model_input, runner._prepare_any(plan))
            seen["decode"] += 1
        else:
            seen["other"] += 1
        return model_input

    runner.prepare = checked
    for i, (prompt_len, max_tokens) in enumerate([(3, 9), (4, 14), (5, 6), (11, 12), (16, 5), (1, 10)]):
        core.add_request(f"r{i}", list(range(7, 7 + prompt_len)), SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    outputs = run_all(core)
    assert len(outputs) == 6 and seen["decode"] >= 12 and seen["other"] >= 2
    assert_no_leaks(core)
