"""The official ``openai`` client against the real server: completions and chat, streamed and not."""

from __future__ import annotations

import httpx
import openai
import pytest

NO_EOS = {"ignore_eos": True}  # random weights: make lengths exact instead of EOS-dependent


def tokenize(url: str, **body: object) -> int:
    r = httpx.post(f"{url}/tokenize", json=body, timeout=10)
    assert r.status_code == 200, r.text
    return r.json()["count"]


def test_models_lists_the_served_model(client: openai.OpenAI, model_name: str) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [model_name]


def test_completion_usage_adds_up(client: openai.OpenAI, model_name: str, server_url: str) -> None:
    prompt = "The quick brown fox jumps over the lazy dog"
    r = client.completions.create(model=model_name, prompt=prompt, max_tokens=12, temperature=0, extra_body=NO_EOS)
    choice = r.choices[0]
    assert isinstance(choice.text, str) and choice.text
    assert choice.finish_reason == "length"
    assert r.usage.completion_tokens == 12
    assert r.usage.prompt_tokens == tokenize(server_url, prompt=prompt)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.id.startswith("cmpl-") and r.model == model_name


def test_chat_usage_adds_up(client: openai.OpenAI, model_name: str, server_url: str) -> None:
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hello."}]
    r = client.chat.completions.create(model=model_name, messages=messages, max_completion_tokens=10,
                                       temperature=0, extra_body=NO_EOS)
    msg = r.choices[0].message
    assert msg.role == "assistant" and isinstance(msg.content, str)
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 10
    assert r.usage.prompt_tokens == tokenize(server_url, messages=messages)
    assert r.usage.total_tokens == r.usage.prompt_tokens + 10


def _stream_completion(client: openai.OpenAI, **kw: object) -> tuple[dict[int, str], dict[int, str], object]:
    texts: dict[int, str] = {}
    finish: dict[int, str] = {}
    usage = None
    chunks = client.completions.create(stream=True, stream_options={"include_usage": True}, **kw)
    for chunk in chunks:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    return texts, finish, usage


def _stream_chat(client: openai.OpenAI, **kw: object) -> tuple[dict[int, str], dict[int, str], object]:
    texts: dict[int, str] = {}
    finish: dict[int, str] = {}
    usage = None
    for chunk in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    return texts, finish, usage


def test_streamed_completion_equals_non_streamed(client: openai.OpenAI, model_name: str) -> None:
    kw = dict(model=model_name, prompt="Once upon a time", max_tokens=20, temperature=0.8, seed=1234,
              extra_body=NO_EOS)
    full = client.completions.create(**kw)
    texts, finish, usage = _stream_completion(client, **kw)
    assert texts == {0: full.choices[0].text}
    assert finish == {0: "length"}
    assert usage is not None and usage.model_dump() == full.usage.model_dump()


def test_streamed_chat_equals_non_streamed(client: openai.OpenAI, model_name: str) -> None:
    kw = dict(model=model_name, messages=[{"role": "user", "content": "Tell me a story."}], max_tokens=20,
              temperature=0.9, seed=99, extra_body=NO_EOS)
    full = client.chat.completions.create(**kw)
    texts, finish, usage = _stream_chat(client, **kw)
    assert texts == {0: full.choices[0].message.content}
    assert finish == {0: "length"}
    assert usage is not None and usage.completion_tokens == 20 == full.usage.completion_tokens
    assert usage.prompt_tokens == full.usage.prompt_tokens


def test_n_choices_streamed_and_not(client: openai.OpenAI, model_name: str) -> None:
    kw = dict(model=model_name, prompt="Numbers:", max_tokens=8, n=3, temperature=1.0, seed=5, extra_body=NO_EOS)
    full = client.completions.create(**kw)
    assert sorted(c.index for c in full.choices) == [0, 1, 2]
    assert full.usage.completion_tokens == 3 * 8
    assert full.usage.total_tokens == full.usage.prompt_tokens + 24
    texts, finish, usage = _stream_completion(client, **kw)
    assert texts == {c.index: c.text for c in full.choices}
    assert finish == {0: "length", 1: "length", 2: "length"}
    chat = client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=4, n=2, extra_body=NO_EOS)
    assert sorted(c.index for c in chat.choices) == [0, 1] and chat.usage.completion_tokens == 8


def test_seed_reproducible(client: openai.OpenAI, model_name: str) -> None:
    def sample(seed: int) -> str:
        r = client.completions.create(model=model_name, prompt="Random words:", max_tokens=16, temperature=1.0,
                                      seed=seed, extra_body=NO_EOS)
        return r.choices[0].text

    assert sample(7) == sample(7)
    assert sample(7) != sample(8)  # 16 near-uniform draws over 32k tokens: equal only by a miracle


def test_stop_string_cuts_the_output(client: openai.OpenAI, model_name: str) -> None:
    kw = dict(model=model_name, prompt="Stop test", temperature=0, extra_body=NO_EOS)
    free = client.completions.create(max_tokens=30, **kw).choices[0].text
    middle = len(free) // 2
    stop = free[middle:middle + 3]
    assert stop.strip(), f"pick a visible stop string from {free!r}"
    cut = client.completions.create(max_tokens=30, stop=[stop], **kw).choices[0]
    assert cut.finish_reason == "stop"
    assert cut.text == free[:free.index(stop)]
    streamed, finish, _ = _stream_completion(client, max_tokens=30, stop=stop, **kw)
    assert streamed == {0: cut.text} and finish == {0: "stop"}


def test_logprobs(client: openai.OpenAI, model_name: str) -> None:
    r = client.completions.create(model=model_name, prompt="abc", max_tokens=5, logprobs=2, temperature=0,
                                  extra_body=NO_EOS)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == 5
    assert all(v <= 0 for v in lp.token_logprobs)
    assert all(len(top) <= 2 for top in lp.top_logprobs)
    chat = client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": "x"}],
                                          max_tokens=4, logprobs=True, top_logprobs=3, extra_body=NO_EOS)
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(t.top_logprobs) <= 3 for t in content)


def test_prefix_cache_reported_in_usage(client: openai.OpenAI, model_name: str) -> None:
    prompt = list(range(1000, 1100))  # 100 token ids: several full blocks
    first = client.completions.create(model=model_name, prompt=prompt, max_tokens=2, extra_body=NO_EOS)
    second = client.completions.create(model=model_name, prompt=prompt, max_tokens=2, extra_body=NO_EOS)
    assert first.usage.prompt_tokens == second.usage.prompt_tokens == 100
    assert second.usage.prompt_tokens_details.cached_tokens >= 64
    salted = client.completions.create(model=model_name, prompt=prompt, max_tokens=2,
                                       extra_body={**NO_EOS, "cache_salt": "tenant-b", "priority": -1})
    assert salted.usage.prompt_tokens_details.cached_tokens == 0


@pytest.mark.parametrize("max_tokens", [1, 3])
def test_min_and_max_tokens(client: openai.OpenAI, model_name: str, max_tokens: int) -> None:
    r = client.completions.create(model=model_name, prompt="m", max_tokens=max_tokens,
                                  extra_body={"min_tokens": max_tokens, "top_k": 5, "min_p": 0.01,
                                              "repetition_penalty": 1.1, "user": "u1"})
    assert r.usage.completion_tokens == max_tokens


def test_multi_turn_with_the_clients_own_message_object(client: openai.OpenAI, model_name: str) -> None:
    messages: list = [{"role": "user", "content": "first turn"}]
    first = client.chat.completions.create(model=model_name, messages=messages, max_tokens=4, extra_body=NO_EOS)
    messages += [first.choices[0].message, {"role": "user", "content": "second turn"}]
    second = client.chat.completions.create(model=model_name, messages=messages, max_tokens=4, extra_body=NO_EOS)
    assert second.usage.prompt_tokens > first.usage.prompt_tokens  # the history is in the prompt
