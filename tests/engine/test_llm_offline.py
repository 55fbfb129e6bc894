"""The offline ``LLM`` API in vLLM's forms: prompt dicts, chat, and the RequestOutput fields."""

from __future__ import annotations

import math

import pytest

from pagedserve import LLM, SamplingParams
from tests.conftest import assert_no_leaks


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(str(tiny_model_dir), num_kv_blocks=128, max_model_len=512)


def test_cumulative_logprob_is_the_sum_of_the_returned_logprobs(llm):
    params = SamplingParams(max_tokens=12, temperature=0.8, seed=3, ignore_eos=True, logprobs=2, n=2)
    out = llm.generate("The quick brown fox", params, use_tqdm=False)[0]
    for c in out.outputs:
        assert len(c.logprobs) == len(c.token_ids) == 12
        assert c.cumulative_logprob == pytest.approx(sum(lp.logprob for lp in c.logprobs), abs=1e-4)
        assert c.cumulative_logprob < 0 and math.isfinite(c.cumulative_logprob)
    # As in vLLM: no logprobs asked for, no cumulative logprob either.
    plain = llm.generate("The quick brown fox", SamplingParams(max_tokens=4), use_tqdm=False)[0]
    assert plain.outputs[0].cumulative_logprob is None and plain.outputs[0].logprobs is None
    assert_no_leaks(llm.engine)


def test_cumulative_logprob_stops_with_a_stop_string(llm):
    # A stop string ends the completion part-way through the core's tokens: the sum follows the
    # tokens kept, not the ones the core produced past the stop (stream_interval makes that likely).
    free = llm.generate("Once upon", SamplingParams(max_tokens=20, temperature=0, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].text
    stop = free[len(free) // 2: len(free) // 2 + 2]
    if not stop.strip():
        pytest.skip("the tiny model's text has no usable stop string here")
    out = llm.generate("Once upon", SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, stop=[stop],
                                                   logprobs=0), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop"
    assert out.cumulative_logprob == pytest.approx(sum(lp.logprob for lp in out.logprobs), abs=1e-4)
    assert_no_leaks(llm.engine)
