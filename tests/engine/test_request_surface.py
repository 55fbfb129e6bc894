"""Engine side of the request surface: prompt logprobs (chunked prefill, prefix cache, n > 1) and
logit_bias in the batched sampler, on the standard `tiny` model."""

from __future__ import annotations

import pytest
import torch

from pagedserve.config import EngineConfig
from pagedserve.engine.frontend.engine import Engine
from pagedserve.engine.core.sampler import SamplingRow, sample
from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.errors import InvalidRequest
from tests.conftest import assert_no_leaks


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    # A 16-token step budget: a 70-token prompt is computed in five chunks.
    return Engine(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=64, max_model_len=256,
                               max_num_batched_tokens=16, dtype="float32"))


def run(engine, prompts: dict[str, list[int]], params: SamplingParams):
    for rid, ids in prompts.items():
        engine.add_request(rid, ids, params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert_no_leaks(engine)
    return done


PROMPT = [(i * 37) % 900 + 5 for i in range(70)]


def test_prompt_logprobs_match_the_next_token_distribution(engine):
    """Entry k of a chunked prompt's logprobs is the distribution a request of prompt[:k] samples from."""
    out = run(engine, {"p": PROMPT}, SamplingParams(max_tokens=1, prompt_logprobs=5, temperature=0))["p"]
    lps = out.prompt_logprobs
    assert lps is not None and len(lps) == len(PROMPT) and lps[0] is None
    for k in (1, 15, 16, 17, 40, 69):  # chunk edges included
        lp = lps[k]
        assert lp.token_id == PROMPT[k] and lp.logprob <= 0 and lp.rank >= 1 and len(lp.top) == 5
        ref = run(engine, {f"r{k}": PROMPT[:k]}, SamplingParams(max_tokens=1, logprobs=5, temperature=0))[f"r{k}"]
        top = ref.outputs[0].logprobs[0].top
        assert [t for t, _ in lp.top] == [t for t, _ in top]
        assert [v for _, v in lp.top] == pytest.approx([v for _, v in top], abs=1e-4)
        # rank 1 exactly when the prompt token is the most likely one
        assert (lp.rank == 1) == (lp.top[0][0] == PROMPT[k])


def test_prompt_logprobs_skip_the_prefix_cache_and_n_above_one(engine):
    params = SamplingParams(max_tokens=3, prompt_logprobs=0, n=2, temperature=1.0, seed=1)
    first = run(engine, {"a": PROMPT}, params)["a"]
    again = run(engine, {"b": PROMPT}, params)["b"]
    assert again.num_cached_tokens == 0  # computed again: cached blocks carry no logits
    assert [x.token_id for x in again.prompt_logprobs[1:]] == PROMPT[1:]
    assert [x.logprob for x in again.prompt_logprobs[1:]] == pytest.approx(
        [x.logprob for x in first.prompt_logprobs[1:]], abs=1e-5)
    assert all(x.top == [] for x in again.prompt_logprobs[1:]) and len(again.outputs) == 2
    # A request without prompt logprobs still finds the blocks those filled.
    plain = run(engine, {"c": PROMPT}, SamplingParams(max_tokens=1))["c"]
    assert plain.num_cached_tokens >= 64 and plain.prompt_logprobs is None


def test_logit_bias_batched_equals_row_by_row():
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    biases = [{3: 100.0}, None, {7: -100.0, 8: 5.5}, {49: 50.0}]
    rows = [SamplingRow(SamplingParams(temperature=0, logit_bias=b, logprobs=0), None, [1], [], []) for b in biases]
    batched = sample(logits, rows)
    singles = [sample(logits[i:i + 1], [r]).token_ids[0] for i, r in enumerate(rows)]
    assert batched.token_ids == singles
    assert batched.token_ids[0] == 3 and batched.token_ids[3] == 49
    assert batched.token_ids[1] == int(logits[1].argmax())
    assert batched.token_ids[2] not in (7,) and batched.token_ids[2] == int((logits[2] + torch.nn.functional.one_hot(
        torch.tensor(8), 50) * 5.5 - torch.nn.functional.one_hot(torch.tensor(7), 50) * 100).argmax())
    # logprobs stay those of the model's own distribution
    assert batched.logprobs[0].logprob == pytest.approx(float(logits[0].log_softmax(-1)[3]))


def test_logit_bias_bounds(engine):
    with pytest.raises(InvalidRequest, match="logit_bias"):
        SamplingParams(logit_bias={1: 100.5}).validate()
    with pytest.raises(InvalidRequest, match="at most 300"):
        SamplingParams(logit_bias={i: 1.0 for i in range(301)}).validate()
    with pytest.raises(InvalidRequest, match="finite"):
        SamplingParams(logit_bias={1: float("nan")}).validate()
    with pytest.raises(InvalidRequest, match="logit_bias token ids"):
        engine.add_request("big", [1, 2], SamplingParams(logit_bias={engine.core.arch.vocab_size: 1.0}))
    with pytest.raises(InvalidRequest, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21).validate()
    assert_no_leaks(engine)


def test_prompt_logprobs_survive_preemption(engine, tiny_model_dir):
    """Two requests that cannot both fit: one is preempted and recomputed; its prompt logprobs are
    still one entry per prompt token, equal to a run alone."""
    tight = Engine(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=7, max_model_len=256,
                                max_num_batched_tokens=16, dtype="float32"))
    other = [(i * 53) % 800 + 7 for i in range(70)]
    params = SamplingParams(max_tokens=24, ignore_eos=True, prompt_logprobs=1, temperature=0)
    both = run(tight, {"a": PROMPT, "b": other}, params)
    assert tight.core.scheduler.num_preemptions >= 1
    for rid, prompt in (("a", PROMPT), ("b", other)):
        alone = run(engine, {f"alone-{rid}": prompt}, params)[f"alone-{rid}"]
        got = both[rid].prompt_logprobs
        assert len(got) == len(prompt) and [x.token_id for x in got[1:]] == prompt[1:]
        assert [x.logprob for x in got[1:]] == pytest.approx([x.logprob for x in alone.prompt_logprobs[1:]], abs=1e-4)
        assert both[rid].outputs[0].token_ids == alone.outputs[0].token_ids
