"""The triton backend inside the engine: the real model and runner, the pools written by the KV
write kernel and read by the decode and prefill kernels (under Triton's interpreter on CPU), against
the reference backend; and a decode step padded as a CUDA graph replays it."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from pagedserve.config import EngineConfig  # noqa: E402
from pagedserve.engine.core.cuda_graphs import DecodeBuffers, graph_batch_sizes, padded_batch_size  # noqa: E402
from pagedserve.engine.frontend.engine import Engine  # noqa: E402
from pagedserve.engine.sampling_params import SamplingParams  # noqa: E402
from tests.conftest import assert_no_leaks, run_all  # noqa: E402

SHARED = "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n"
PROMPTS = {"a": SHARED, "b": SHARED + "print(fibonacci(10))",  # b after a: a prefix hit on a's blocks
           "c": "import os\nimport sys\nprint(os.getcwd(), sys.argv, 'a somewhat longer prompt')"}


def _engine(tiny_model_dir, backend, device, chunk=24, **kw):
    return Engine(EngineConfig(model=str(tiny_model_dir), dtype="float32", device=str(device),
                               attention_backend=backend, num_kv_blocks=48, max_model_len=128, block_size=16,
                               max_num_batched_tokens=chunk, **kw))


def _greedy(engine):
    """``a`` alone, then ``b`` (which finds a's blocks cached) and ``c`` together."""
    done = {}
    for batch in (["a"], ["b", "c"]):
        for rid in batch:
            engine.add_request(rid, PROMPTS[rid], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
        done |= run_all(engine)
    assert_no_leaks(engine)
    return {rid: out.outputs[0].token_ids for rid, out in done.items()}


def test_engine_on_triton_kernels_answers_as_the_reference(tiny_model_dir, device):
    """Prompt chunks of at most 24 tokens (chunked prefill), a shared first block (a prefix hit),
    then decodes: the same greedy tokens as the plain-torch reference, and every block back."""
    triton_engine = _engine(tiny_model_dir, "triton", device, cuda_graphs=False)
    assert triton_engine.core.config.attention_backend == "triton"
    want = _greedy(_engine(tiny_model_dir, "reference", "cpu"))
    assert _greedy(triton_engine) == want
    assert triton_engine.stats().prefix_hit_tokens > 0


@torch.inference_mode()
def test_a_decode_step_padded_for_a_graph_gives_the_rows_the_same_hidden_states(tiny_model_dir, device):
    """The rows a CUDA graph replays are the step's rows plus padding: the padding must neither write
    KV nor change the real rows. Run here eagerly over the same persistent buffers a graph reads."""
    engine = _engine(tiny_model_dir, "triton", device, chunk=128, cuda_graphs=False)
    for rid, prompt in PROMPTS.items():
        engine.add_request(rid, prompt, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    sched = engine.core.scheduler
    while sched.waiting or any(s.num_computed_tokens < s.num_prompt_tokens for s in sched.running):
        engine.step()  # prompt chunks, until every sequence decodes
    plan = sched.schedule()
    assert [n for _, n in plan.scheduled] == [1, 1, 1]
    runner = engine.core.runner
    step = runner.prepare(plan)
    rows = step.meta.num_decodes
    pools_before = [k.data.clone() for k, _ in runner.kv_caches]
    eager = runner.model(step.input_ids, step.positions, runner.kv_caches, step.meta)
    pools_after = [k.data.clone() for k, _ in runner.kv_caches]
    size = padded_batch_size(rows, graph_batch_sizes(8))
    assert size > rows  # 3 rows pad to 4
    buffers = DecodeBuffers(8, -(-128 // 16), torch.device(device))
    buffers.load(step, size)
    padded = runner.model(*buffers.inputs(size)[:2], runner.kv_caches, buffers.inputs(size)[2])
    torch.testing.assert_close(padded[:rows], eager, atol=1e-5, rtol=0)
    assert any(not torch.equal(a, b) for a, b in zip(pools_before, pools_after))  # the step wrote its K
    assert all(torch.equal(k.data, a) for (k, _), a in zip(runner.kv_caches, pools_after))  # padding wrote none
    for rid in PROMPTS:  # the planned step is dropped: its blocks must come back all the same
        engine.abort(rid)
    assert_no_leaks(engine)
