"""Parity with Hugging Face transformers on CUDA: the engine on the triton backend (decodes replayed
from CUDA graphs, prompts eager) against transformers on the same card. Run by scripts/gpu_check.sh;
skipped without a GPU (the same model code is checked against transformers on CPU in
tests/engine/test_parity.py, and the kernels against the reference in this directory)."""

from __future__ import annotations

import pytest
import torch

from pagedserve.config import EngineConfig
from pagedserve.engine.frontend.engine import Engine
from pagedserve.engine.sampling_params import SamplingParams
from tests.checkpoints import load_hf
from tests.conftest import assert_no_leaks, run_all

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="parity on CUDA needs a GPU")

MAX_NEW = 16


def _prompts(lengths, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 32000, (n,), generator=g).tolist() for n in lengths]


def _engine(model_dir, dtype, **kw):
    return Engine(EngineConfig(model=str(model_dir), dtype=dtype, device="cuda", attention_backend="triton",
                               num_kv_blocks=256, block_size=16, max_num_seqs=8, max_model_len=512, **kw))


def _generate(engine, prompts, params):
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    done = run_all(engine)
    assert_no_leaks(engine)
    return [done[str(i)].outputs[0] for i in range(len(prompts))]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("graphs", [True, False])
def test_greedy_tokens_match_transformers_in_float32(arch, graphs, checkpoint_dir):
    model_dir = checkpoint_dir(arch)
    hf = load_hf(model_dir).cuda()
    prompts = _prompts([5, 37, 70, 16, 9], seed=1)
    engine = _engine(model_dir, "float32", cuda_graphs=graphs)
    outs = _generate(engine, prompts, SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        ref = hf.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW,
                          do_sample=False)
        assert out.token_ids == ref[0, len(prompt):].tolist()


@pytest.mark.parametrize("kv", ["auto", "int8", "fp8"])
def test_bf16_logprobs_are_close_to_transformers(kv, checkpoint_dir):
    """bf16 engine (bf16, int8 or fp8 KV) against transformers in bf16 scoring the same tokens: each
    generated token's logprob within 0.1, on average within 0.03."""
    model_dir = checkpoint_dir("llama")
    hf = load_hf(model_dir).to(device="cuda", dtype=torch.bfloat16)
    prompts = _prompts([40, 9, 100], seed=2)
    engine = _engine(model_dir, "bfloat16", kv_cache_dtype=kv)
    outs = _generate(engine, prompts, SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True, logprobs=1))
    diffs = []
    for prompt, out in zip(prompts, outs):
        ids = torch.tensor([prompt + out.token_ids], device="cuda")
        with torch.inference_mode():
            logits = hf(ids).logits[0, len(prompt) - 1:-1].float().log_softmax(-1)
        for step, lp in enumerate(out.logprobs):
            diffs.append(abs(lp.logprob - float(logits[step, lp.token_id])))
    assert max(diffs) < 0.1 and sum(diffs) / len(diffs) < 0.03, (max(diffs), sum(diffs) / len(diffs))
