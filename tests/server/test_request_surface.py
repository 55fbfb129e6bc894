"""The rest of the OpenAI / vLLM request surface through the official client against the shared
server: logit_bias, several prompts in one request, echo, prompt_logprobs, best_of, /detokenize
and /version (the bad-input cases of each are in test_bad_input.py). The shared fixture checks no KV block is left behind."""

from __future__ import annotations

import httpx
import openai
import pytest

NO_EOS = {"ignore_eos": True}  # random weights: lengths exact instead of EOS-dependent


def _tokens(url: str, text: str, special: bool = False) -> list[int]:
    """The ids of ``text``; with ``special``, as the engine sees a prompt (a BOS the tokenizer adds)."""
    r = httpx.post(f"{url}/tokenize", json={"prompt": text, "add_special_tokens": special}, timeout=10)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def _stream_texts(client: openai.OpenAI, **kw: object) -> tuple[dict[int, str], dict[int, str], object]:
    texts: dict[int, str] = {}
    finish: dict[int, str] = {}
    usage = None
    for chunk in client.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
        usage = chunk.usage or usage
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    return texts, finish, usage


def test_logit_bias_forces_and_bans_tokens(client: openai.OpenAI, model_name: str, server_url: str) -> None:
    kw = dict(model=model_name, prompt="Bias test", max_tokens=6, temperature=0, logprobs=0, extra_body=NO_EOS)
    free = client.completions.create(**kw).choices[0]
    first = free.logprobs.tokens[0]
    first_id = _tokens(server_url, "Bias test" + first)[-1]
    # +100 on one token: greedy picks it every step (also sampled: its probability is ~1).
    forced_id = 1234
    forced = client.completions.create(**{**kw, "logit_bias": {str(forced_id): 100}}).choices[0]
    r = httpx.post(f"{server_url}/detokenize", json={"tokens": [forced_id] * 6}, timeout=10)
    assert forced.text == r.json()["prompt"]
    sampled = client.completions.create(**{**kw, "temperature": 1.0, "seed": 3,
                                           "logit_bias": {str(forced_id): 100}}).choices[0]
    assert sampled.text == forced.text
    # -100 on the greedy first token: it is never picked.
    banned = client.completions.create(**{**kw, "logit_bias": {str(first_id): -100}}).choices[0]
    assert banned.logprobs.tokens[0] != first
    # Chat takes it too; a row without bias in the same batch is not affected.
    chat = client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=3, temperature=0, logit_bias={str(forced_id): 100},
                                          extra_body=NO_EOS)
    three = httpx.post(f"{server_url}/detokenize", json={"tokens": [forced_id] * 3}, timeout=10).json()["prompt"]
    assert chat.choices[0].message.content == three
    assert client.completions.create(**kw).choices[0].text == free.text


def test_several_prompts_are_indexed_prompt_times_n_plus_j(client: openai.OpenAI, model_name: str,
                                                            server_url: str) -> None:
    prompts = ["The first prompt", "Another, longer second prompt", "3"]
    kw = dict(model=model_name, max_tokens=5, temperature=0, extra_body=NO_EOS)
    singles = [client.completions.create(prompt=p, **kw) for p in prompts]
    both = client.completions.create(prompt=prompts, n=2, **kw)
    assert [c.index for c in both.choices] == list(range(6))
    for i, single in enumerate(singles):
        for j in range(2):  # greedy: both choices of prompt i equal prompt i's single answer
            assert both.choices[i * 2 + j].text == single.choices[0].text
    assert both.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles)
    assert both.usage.completion_tokens == 6 * 5
    # Streamed: the same texts under the same indices, usage in the last chunk.
    texts, finish, usage = _stream_texts(client, prompt=prompts, n=2, **kw)
    assert texts == {c.index: c.text for c in both.choices}
    assert finish == {i: "length" for i in range(6)}
    assert usage.model_dump() == both.usage.model_dump()
    # Lists of token-id lists are several prompts too.
    ids = [_tokens(server_url, p) for p in prompts[:2]]
    by_ids = client.completions.create(prompt=ids, **kw)
    assert [c.text for c in by_ids.choices] == [
        client.completions.create(prompt=i, **kw).choices[0].text for i in ids]


def test_detokenize_round_trips_tokenize_and_version(server_url: str, model_name: str) -> None:
    text = "Hello, paged world!"
    ids = _tokens(server_url, text)
    r = httpx.post(f"{server_url}/detokenize", json={"model": model_name, "tokens": ids}, timeout=10)
    assert r.status_code == 200 and r.json() == {"prompt": text}, r.text
    assert httpx.post(f"{server_url}/detokenize", json={"tokens": []}, timeout=10).json() == {"prompt": ""}
    import pagedserve

    v = httpx.get(f"{server_url}/version", timeout=10)
    assert v.status_code == 200 and v.json() == {"version": pagedserve.__version__}


def test_echo_prepends_the_prompt_with_its_logprobs(client: openai.OpenAI, model_name: str, server_url: str) -> None:
    prompt = "Echo this prompt"
    ids = _tokens(server_url, prompt, special=True)
    kw = dict(model=model_name, prompt=prompt, max_tokens=4, temperature=0, extra_body=NO_EOS)
    plain = client.completions.create(**kw).choices[0]
    echoed = client.completions.create(echo=True, logprobs=2, **kw)
    c = echoed.choices[0]
    assert c.text == prompt + plain.text
    lp = c.logprobs
    assert len(lp.tokens) == len(ids) + 4 and "".join(lp.tokens[:len(ids)]).endswith(prompt)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v is not None and v <= 0 for v in lp.token_logprobs[1:])
    assert all(len(t) <= 2 for t in lp.top_logprobs[1:])
    assert lp.text_offset[len(ids)] == len(prompt)  # the generated tokens' offsets continue past the prompt
    assert lp.text_offset == sorted(lp.text_offset)
    assert echoed.usage.completion_tokens == 4 and echoed.usage.prompt_tokens == len(ids)
    # max_tokens 0 with echo: the prompt and its logprobs only (what evaluation harnesses send).
    only = client.completions.create(**{**kw, "max_tokens": 0}, echo=True, logprobs=0)
    assert only.choices[0].text == prompt and len(only.choices[0].logprobs.tokens) == len(ids)
    assert only.choices[0].logprobs.token_logprobs == lp.token_logprobs[:len(ids)]
    assert only.usage.completion_tokens == 0
    # Streamed: the prompt comes first, then the same text and logprobs as non-streamed.
    text, tokens, offsets = "", [], []
    for chunk in client.completions.create(stream=True, echo=True, logprobs=2, **kw):
        for ch in chunk.choices:
            text += ch.text
            if ch.logprobs:
                tokens += ch.logprobs.tokens
                offsets += ch.logprobs.text_offset
    assert text == c.text and tokens == lp.tokens and offsets == lp.text_offset
    # Several token-id prompts: each choice echoes its own prompt.
    plain_ids = _tokens(server_url, prompt)
    two = client.completions.create(model=model_name, prompt=[plain_ids, plain_ids[:2]], max_tokens=1, echo=True,
                                    logprobs=0, extra_body=NO_EOS)
    head = httpx.post(f"{server_url}/detokenize", json={"tokens": plain_ids[:2]}, timeout=10).json()["prompt"]
    assert two.choices[0].text.startswith(prompt) and two.choices[1].text.startswith(head)
    # Counted in tokens, not characters: one generated token of a random model can be as long as the rest.
    assert [len(ch.logprobs.tokens) for ch in two.choices] == [len(plain_ids) + 1, 3]


def test_prompt_logprobs_vllm_shape(client: openai.OpenAI, model_name: str, server_url: str) -> None:
    prompt = "Prompt logprobs, please"
    ids = _tokens(server_url, prompt, special=True)
    r = client.completions.create(model=model_name, prompt=prompt, max_tokens=2, extra_body={"prompt_logprobs": 3})
    plp = r.model_dump()["choices"][0]["prompt_logprobs"]
    assert len(plp) == len(ids) and plp[0] is None
    for token, entry in zip(ids[1:], plp[1:]):
        assert str(token) in entry and 1 <= len(entry) <= 4
        assert entry[str(token)]["rank"] >= 1 and entry[str(token)]["logprob"] <= 0
        assert sorted(e["rank"] for k, e in entry.items() if k != str(token))[:1] in ([1], [])
    echoed = client.completions.create(model=model_name, prompt=prompt, max_tokens=0, echo=True, logprobs=0)
    assert [entry[str(t)]["logprob"] for t, entry in zip(ids[1:], plp[1:])] == pytest.approx(
        echoed.choices[0].logprobs.token_logprobs[1:], abs=1e-5)
    chat = client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=2, extra_body={"prompt_logprobs": 0})
    chat_plp = chat.model_dump()["prompt_logprobs"]
    assert chat_plp[0] is None and len(chat_plp) == chat.usage.prompt_tokens
    assert all(len(e) == 1 for e in chat_plp[1:])


def test_best_of_returns_the_most_likely_of_best_of(client: openai.OpenAI, model_name: str) -> None:
    kw = dict(model=model_name, prompt="Pick the best", max_tokens=6, temperature=1.0, seed=11, extra_body=NO_EOS)
    pool = client.completions.create(n=5, logprobs=0, **kw)
    ranked = sorted(pool.choices, key=lambda c: sum(c.logprobs.token_logprobs), reverse=True)
    best = client.completions.create(n=2, best_of=5, **kw)
    assert [c.index for c in best.choices] == [0, 1]
    # Same seed: the same five samples, of which the two most likely come back, most likely first.
    assert [c.text for c in best.choices] == [c.text for c in ranked[:2]]
    assert best.choices[0].logprobs is None  # not asked for
    assert best.usage.completion_tokens == 5 * 6  # every sampled token is work done
    two = client.completions.create(prompt=["Pick the best", "Pick the best"], n=1, best_of=5,
                                    **{k: v for k, v in kw.items() if k != "prompt"})
    assert [c.index for c in two.choices] == [0, 1]
