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


GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


def test_every_prompt_form_gives_the_same_greedy_tokens(llm):
    text = "Paged attention stores keys"
    ids = llm.tokenizer.encode(text)
    forms = [text, {"prompt": text}, {"prompt_token_ids": ids}, ids, {"prompt": text, "cache_salt": "s"}]
    outs = llm.generate(forms, GREEDY, use_tqdm=False)
    assert len({o.request_id for o in outs}) == len(forms)
    first = outs[0].outputs[0].token_ids
    for out in outs:
        assert out.finished and out.prompt_token_ids == ids
        assert len(out.outputs) == 1
        c = out.outputs[0]
        assert (c.index, c.token_ids, c.finish_reason, c.stop_reason) == (0, first, "length", None)
        assert c.text == llm.tokenizer.decode(first, skip_special_tokens=True)
    assert [o.prompt for o in outs] == [text, text, None, None, text]
    # A single prompt in any form is a batch of one.
    for single in (text, {"prompt": text}, {"prompt_token_ids": ids}, ids):
        [one] = llm.generate(single, GREEDY, use_tqdm=False)
        assert one.outputs[0].token_ids == first
    assert_no_leaks(llm.engine)


@pytest.mark.parametrize("bad, match", [
    ({"prompt": "a", "prompt_token_ids": [1]}, "exactly one"),
    ({}, "exactly one"),
    ({"prompt": "a", "multi_modal_data": {}}, "unsupported prompt keys"),
    ({"prompt_token_ids": "abc"}, "list of integers"),
    ({"prompt_token_ids": [1, True]}, "list of integers"),
    ({"prompt": 5}, "must be a string"),
    (3.5, "a prompt is"),
])
def test_malformed_prompts_are_refused_and_nothing_stays_queued(llm, bad, match):
    from pagedserve.errors import InvalidRequest

    with pytest.raises(InvalidRequest, match=match):
        llm.generate(["fine first", bad], GREEDY, use_tqdm=False)
    assert_no_leaks(llm.engine)


def test_num_cached_tokens_counts_the_prefix_cache_hit(llm):
    long_prompt = "a fact about block tables " * 12  # well over two 16-token blocks
    first = llm.generate(long_prompt, GREEDY, use_tqdm=False)[0]
    again = llm.generate({"prompt": long_prompt}, GREEDY, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0
    n = len(again.prompt_token_ids)
    # Every full block of the prompt is reused (the last token is always recomputed to sample from).
    assert again.num_cached_tokens == (n - 1) // 16 * 16 > 0
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert_no_leaks(llm.engine)


def test_stop_token_sets_stop_reason(llm):
    ref = llm.generate("Stop here", GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    out = llm.generate("Stop here", SamplingParams(max_tokens=6, temperature=0, ignore_eos=True,
                                                   stop_token_ids=[ref[2]]), use_tqdm=False)[0].outputs[0]
    cut = ref.index(ref[2]) + 1
    assert (out.finish_reason, out.stop_reason, out.token_ids) == ("stop", ref[2], ref[:cut])
    assert_no_leaks(llm.engine)


def test_chat_applies_the_models_template(llm):
    conversation = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    rendered = llm.tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    assert rendered.endswith("<|assistant|>\n")  # the tiny model's template, generation prompt added
    [out] = llm.chat(conversation, GREEDY, use_tqdm=False)
    assert out.prompt == rendered
    ids = llm.tokenizer.encode(rendered, add_special_tokens=False)
    assert out.prompt_token_ids == ids and ids.count(llm.tokenizer.bos_token_id) == 1  # no second BOS
    assert out.outputs[0].token_ids == llm.generate({"prompt_token_ids": ids}, GREEDY,
                                                    use_tqdm=False)[0].outputs[0].token_ids
    # A list of conversations: one output each, in order, each with its own parameters.
    other = [{"role": "user", "content": "And a number?"}]
    outs = llm.chat([conversation, other], [GREEDY, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)],
                    use_tqdm=False)
    assert outs[0].outputs[0].token_ids == out.outputs[0].token_ids
    assert outs[1].prompt.startswith("<s><|user|>\nAnd a number?") and len(outs[1].outputs[0].token_ids) == 3
    # continue_final_message: the assistant's partial reply is continued, not closed.
    partial = [*other, {"role": "assistant", "content": "Seven"}]
    [cont] = llm.chat(partial, GREEDY, use_tqdm=False, add_generation_prompt=False, continue_final_message=True)
    assert cont.prompt.endswith("Seven")
    assert_no_leaks(llm.engine)


def test_chat_with_an_explicit_template_and_bad_conversations(llm):
    from pagedserve.errors import InvalidRequest

    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    [out] = llm.chat([{"role": "user", "content": "hi"}], GREEDY, use_tqdm=False, chat_template=template)
    assert out.prompt == "[user] hi\n"
    with pytest.raises(InvalidRequest, match="non-empty"):
        llm.chat([], GREEDY, use_tqdm=False)
    with pytest.raises(InvalidRequest, match="refused"):
        llm.chat([{"role": "user", "content": "x"}], GREEDY, use_tqdm=False,
                 chat_template="{{ raise_exception('roles must alternate') }}")
    assert_no_leaks(llm.engine)
