"""Token-for-token and logit parity with Hugging Face transformers (float32, greedy)."""

from __future__ import annotations

import pytest
import torch

from pagedserve.config import EngineConfig
from pagedserve.engine.frontend.engine import Engine
from pagedserve.engine.frontend.llm import LLM
from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.models import attention
from tests.checkpoints import ARCHITECTURES, load_hf
from tests.conftest import assert_no_leaks

MAX_NEW = 20


def _prompts(lengths, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 32000, (n,), generator=g).tolist() for n in lengths]


def _hf_greedy(hf, prompt, max_new=MAX_NEW):
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=max_new, min_new_tokens=max_new, do_sample=False)
    return out[0, len(prompt):].tolist()


def _run(engine: Engine, prompts, params):
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return [done[str(i)] for i in range(len(prompts))]


GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_greedy_matches_transformers_mixed_batch(arch, checkpoint_dir):
    """Prompts of mixed lengths run together, block size 8 < prompts so tables span many blocks."""
    model_dir = checkpoint_dir(arch)
    hf = load_hf(model_dir)
    prompts = _prompts([5, 37, 70, 16, 9])
    engine = Engine(EngineConfig(model=str(model_dir), dtype="float32", num_kv_blocks=128, block_size=8))
    outs = _run(engine, prompts, GREEDY)
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == _hf_greedy(hf, prompt)
    assert_no_leaks(engine)


def test_parity_under_preemption(checkpoint_dir):
    """A pool far too small for the batch forces preemption and recompute; output is unchanged."""
    model_dir = checkpoint_dir("llama")
    hf = load_hf(model_dir)
    prompts = _prompts([30, 25, 40, 33, 20, 28], seed=2)
    engine = Engine(EngineConfig(model=str(model_dir), dtype="float32", num_kv_blocks=14, block_size=8,
                                 enable_prefix_caching=False))
    outs = _run(engine, prompts, GREEDY)
    assert engine.core.scheduler.num_preemptions > 0
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == _hf_greedy(hf, prompt)
    assert_no_leaks(engine)


def test_parity_with_chunked_prefill_and_prefix_hits(checkpoint_dir):
    """Budget (16 tokens) far below the prompts, and later prompts sharing a cached prefix."""
    model_dir = checkpoint_dir("qwen2")
    hf = load_hf(model_dir)
    shared = _prompts([48], seed=3)[0]
    tails = _prompts([7, 12, 3], seed=4)
    engine = Engine(EngineConfig(model=str(model_dir), dtype="float32", num_kv_blocks=64, block_size=8,
                                 max_num_batched_tokens=16))
    first = _run(engine, [shared + tails[0]], GREEDY)[0]
    assert first.num_cached_tokens == 0
    later = _run(engine, [shared + t for t in tails[1:]], GREEDY)
    assert all(out.num_cached_tokens == 48 for out in later)
    for tail, out in zip(tails, [first] + later):
        assert out.outputs[0].token_ids == _hf_greedy(hf, shared + tail)
    assert engine.core.block_manager.prefix_hit_tokens == 2 * 48
    assert_no_leaks(engine)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("backend", ["reference", "sdpa"])
def test_logits_match_transformers(arch, backend, checkpoint_dir):
    """Log-probabilities of each generated token and the top-5 alternatives, within 1e-4."""
    model_dir = checkpoint_dir(arch)
    hf = load_hf(model_dir)
    prompt = _prompts([23], seed=5)[0]
    engine = Engine(EngineConfig(model=str(model_dir), dtype="float32", num_kv_blocks=32, block_size=4,
                                 attention_backend=backend))
    out = _run(engine, [prompt], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=5))[0]
    ref = hf.generate(torch.tensor([prompt]), max_new_tokens=8, min_new_tokens=8, do_sample=False,
                      output_logits=True, return_dict_in_generate=True)
    for step, lp in enumerate(out.outputs[0].logprobs):
        hf_lp = ref.logits[step][0].float().log_softmax(-1)
        assert lp.token_id == int(ref.sequences[0, len(prompt) + step])
        assert abs(lp.logprob - float(hf_lp[lp.token_id])) < 1e-4
        top_vals, top_ids = hf_lp.topk(5)
        assert [t for t, _ in lp.top] == top_ids.tolist()
        assert torch.allclose(torch.tensor([v for _, v in lp.top]), top_vals, atol=1e-4)
    assert_no_leaks(engine)


@pytest.mark.parametrize("kv", ["int8", "fp8", "int4"])
def test_quantized_kv_fused_decodes_match_matmul(kv, checkpoint_dir, monkeypatch):
    """The fused kernel reads the quantized pools in place, matmul gathers and dequantizes them:
    the same greedy tokens (prompts over many blocks of 8, some ending mid-block), through the
    Python model's decode steps (the kernel counted) and the native decode stack's alike."""
    ops = attention.native_ops()
    if ops is None:
        pytest.skip("native kernels unavailable")
    name = "paged_decode_attention_int4" if kv == "int4" else "paged_decode_attention_quantized"
    calls = []

    def counted(*args):
        calls.append(args)
        return getattr(ops, name)(*args)

    class CountedOps:  # the native namespace with the quantized decode kernel counted
        def __getattr__(self, attr):
            return counted if attr == name else getattr(ops, attr)

    monkeypatch.setattr(attention, "native_ops", CountedOps)  # native_ops() returns the counting view
    model_dir = checkpoint_dir("llama")
    prompts = _prompts([5, 37, 70, 16, 9], seed=10)
    tokens = {}
    for run, backend, native in (("fused", "fused", False), ("matmul", "matmul", False), ("stack", "fused", True)):
        engine = Engine(EngineConfig(model=str(model_dir), dtype="float32", num_kv_blocks=128, block_size=8,
                                     kv_cache_dtype=kv, attention_backend=backend, native_decode=native))
        tokens[run] = [out.outputs[0].token_ids for out in _run(engine, prompts, GREEDY)]
        assert_no_leaks(engine)
        if run == "fused":
            assert calls  # fused decodes went through the kernel, not the matmul fallback
    assert tokens["fused"] == tokens["matmul"] == tokens["stack"]


def test_bfloat16_close_to_float32(checkpoint_dir):
    """bf16 runs the same model: its greedy token is among float32's top 5, with a close logprob."""
    model_dir = checkpoint_dir("llama")
    prompt = _prompts([30], seed=6)[0]
    params = SamplingParams(max_tokens=1, temperature=0, logprobs=5)
    lps = {}
    for dtype in ("float32", "bfloat16"):
        engine = Engine(EngineConfig(model=str(model_dir), dtype=dtype, num_kv_blocks=16))
        lps[dtype] = _run(engine, [prompt], params)[0].outputs[0].logprobs[0]
        assert_no_leaks(engine)
    fp32_top = dict(lps["float32"].top)
    assert lps["bfloat16"].token_id in fp32_top
    assert abs(fp32_top[lps["bfloat16"].token_id] - lps["bfloat16"].logprob) < 0.1


def test_n_samples_share_prompt_and_are_seed_reproducible(checkpoint_dir):
    model_dir = checkpoint_dir("llama")
    prompt = _prompts([13], seed=7)[0]  # 13 tokens, block 8: the prompt's last block is partial
    llm = LLM(str(model_dir), dtype="float32", num_kv_blocks=64, block_size=8)
    params = SamplingParams(n=4, max_tokens=12, temperature=1.0, seed=42, ignore_eos=True)
    a = llm.generate([prompt], params, use_tqdm=False)[0]
    # The same seed with other work in the batch gives the same tokens.
    noise = _prompts([20, 9], seed=8)
    b = llm.generate([noise[0], prompt, noise[1]],
                     [SamplingParams(max_tokens=5, temperature=1.0), params,
                      SamplingParams(max_tokens=30, temperature=0.7)], use_tqdm=False)[1]
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    assert len({tuple(c.token_ids) for c in a.outputs}) > 1  # the branches differ from each other
    assert [c.index for c in a.outputs] == [0, 1, 2, 3]
    c = llm.generate([prompt], SamplingParams(n=4, max_tokens=12, temperature=1.0, seed=43, ignore_eos=True),
                     use_tqdm=False)[0]
    assert [x.token_ids for x in c.outputs] != [x.token_ids for x in a.outputs]
    assert_no_leaks(llm.engine)


def test_n_greedy_branches_equal_single_greedy(checkpoint_dir):
    """With copy-on-write, each greedy branch must equal the plain greedy continuation."""
    model_dir = checkpoint_dir("mistral")
    hf = load_hf(model_dir)
    prompt = _prompts([11], seed=9)[0]
    engine = Engine(EngineConfig(model=str(model_dir), dtype="float32", num_kv_blocks=64, block_size=8))
    out = _run(engine, [prompt], SamplingParams(n=3, max_tokens=MAX_NEW, temperature=0, ignore_eos=True))[0]
    want = _hf_greedy(hf, prompt)
    assert all(c.token_ids == want for c in out.outputs)
    assert_no_leaks(engine)
