"""Every kind of bad request gets a 4xx with OpenAI's error body, and the server keeps serving."""

from __future__ import annotations

import json
from dataclasses import dataclass

import httpx
import pytest

from tests.server.conftest import MAX_MODEL_LEN


@dataclass
class Case:
    name: str
    path: str
    body: bytes
    status: int
    param: str | None = None
    code: str | None = None
    error_type: str = "invalid_request_error"


def js(obj: object) -> bytes:
    return json.dumps(obj).encode()


CMPL = "/v1/completions"
CHAT = "/v1/chat/completions"
RESP = "/v1/responses"
USER = [{"role": "user", "content": "hi"}]
CASES = [
    Case("malformed json", CMPL, b'{"prompt": "hi",', 400, code="invalid_json"),
    Case("not an object", CMPL, b'[1, 2, 3]', 400),
    Case("empty body", CMPL, b"", 400),
    Case("max_tokens as string", CMPL, js({"prompt": "hi", "max_tokens": "5"}), 400, "max_tokens"),
    Case("temperature as string", CMPL, js({"prompt": "hi", "temperature": "hot"}), 400, "temperature"),
    Case("stream as int", CMPL, js({"prompt": "hi", "stream": 1}), 400, "stream"),
    Case("messages not a list", CHAT, js({"messages": "hi"}), 400, "messages"),
    Case("unknown field", CMPL, js({"prompt": "hi", "max_tokenz": 5}), 400, "max_tokenz", "unknown_field"),
    Case("unknown model", CMPL, js({"model": "gpt-9", "prompt": "hi"}), 404, "model", "model_not_found"),
    Case("missing prompt", CMPL, js({"max_tokens": 5}), 400, "prompt"),
    Case("empty prompt", CMPL, js({"prompt": ""}), 400, "prompt"),
    Case("empty token prompt", CMPL, js({"prompt": []}), 400, "prompt"),
    Case("token id out of vocab", CMPL, js({"prompt": [1, 10_000_000]}), 400, "prompt"),
    Case("too many prompts", CMPL, js({"prompt": ["a"] * 65}), 400, "prompt"),
    Case("empty prompt in a list", CMPL, js({"prompt": ["a", ""]}), 400, "prompt[1]"),
    Case("token id out of vocab in a list", CMPL, js({"prompt": [[1], [2, 10_000_000]]}), 400, "prompt[1]"),
    Case("mixed prompt list", CMPL, js({"prompt": ["a", [1, 2]]}), 400, "prompt[0]"),
    Case("empty messages", CHAT, js({"messages": []}), 400, "messages"),
    Case("empty message content", CHAT, js({"messages": [{"role": "user", "content": ""}]}), 400,
         "messages[0].content"),
    Case("bad role", CHAT, js({"messages": [{"role": "wizard", "content": "hi"}]}), 400, "messages[0].role"),
    Case("max_tokens zero", CMPL, js({"prompt": "hi", "max_tokens": 0}), 400, "max_tokens"),
    Case("max_tokens negative", CHAT, js({"messages": USER, "max_tokens": -3}), 400, "max_tokens"),
    Case("max_completion_tokens zero", CHAT, js({"messages": USER, "max_completion_tokens": 0}), 400,
         "max_completion_tokens"),
    Case("max_tokens past context", CMPL, js({"prompt": "hi", "max_tokens": 100_000}), 400, "max_tokens",
         "context_length_exceeded"),
    Case("prompt over max_model_len", CMPL, js({"prompt": [5] * (MAX_MODEL_LEN + 10), "max_tokens": 1}), 400,
         "prompt", "context_length_exceeded"),
    Case("chat over max_model_len", CHAT, js({"messages": [{"role": "user", "content": "word " * 2000}]}), 400,
         "messages", "context_length_exceeded"),
    Case("n zero", CMPL, js({"prompt": "hi", "n": 0}), 400, "n"),
    Case("n too big", CMPL, js({"prompt": "hi", "n": 1000}), 400, "n"),
    Case("logprobs too big", CMPL, js({"prompt": "hi", "logprobs": 21}), 400, "logprobs"),
    Case("top_logprobs too big", CHAT, js({"messages": USER, "logprobs": True, "top_logprobs": 50}), 400,
         "top_logprobs"),
    Case("top_logprobs without logprobs", CHAT, js({"messages": USER, "top_logprobs": 2}), 400, "top_logprobs"),
    Case("temperature negative", CMPL, js({"prompt": "hi", "temperature": -1}), 400, "temperature"),
    Case("top_p zero", CMPL, js({"prompt": "hi", "top_p": 0}), 400, "top_p"),
    Case("too many stop strings", CMPL, js({"prompt": "hi", "stop": [f"s{i}" for i in range(17)]}), 400, "stop"),
    Case("invalid utf-8", CMPL, b'{"prompt": "caf\xe9 \xff"}', 400, code="invalid_encoding"),
    Case("nul in prompt", CMPL, js({"prompt": "a\u0000b"}), 400, "prompt"),
    Case("escape char in message", CHAT, js({"messages": [{"role": "user", "content": "x\u001by"}]}), 400,
         "messages[0].content"),
    Case("lone surrogate", CMPL, b'{"prompt": "a\\ud800b"}', 400, "prompt"),
    Case("control char in stop", CMPL, js({"prompt": "hi", "stop": ["\u0007"]}), 400, "stop[0]"),
    Case("body over the limit", CMPL, js({"prompt": "x" * 300_000}), 413, code="body_too_large"),
    Case("echo as string", CMPL, js({"prompt": "hi", "echo": "yes"}), 400, "echo"),
    Case("max_tokens zero without echo", CMPL, js({"prompt": "hi", "max_tokens": 0, "echo": False}), 400,
         "max_tokens"),
    Case("suffix unsupported", CMPL, js({"prompt": "hi", "suffix": " the end"}), 400, "suffix"),
    Case("logit_bias over 100", CMPL, js({"prompt": "hi", "logit_bias": {"5": 101}}), 400, "logit_bias.5"),
    Case("logit_bias NaN", CHAT, b'{"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"5": NaN}}', 400,
         "logit_bias.5"),
    Case("logit_bias value as string", CMPL, js({"prompt": "hi", "logit_bias": {"5": "10"}}), 400, "logit_bias.5"),
    Case("logit_bias key not a token id", CMPL, js({"prompt": "hi", "logit_bias": {"abc": 1}}), 400,
         "logit_bias.abc"),
    Case("logit_bias key 2**70", CMPL, js({"prompt": "hi", "logit_bias": {str(2**70): 1}}), 400),
    Case("logit_bias too many", CHAT, js({"messages": USER, "logit_bias": {str(i): 1 for i in range(301)}}), 400,
         "logit_bias"),
    Case("logit_bias id past the vocabulary", CMPL, js({"prompt": "hi", "logit_bias": {"9999999": 5}}), 400,
         "logit_bias"),
    Case("best_of below n", CMPL, js({"prompt": "hi", "n": 3, "best_of": 2}), 400, "best_of"),
    Case("best_of streamed", CMPL, js({"prompt": "hi", "best_of": 2, "stream": True}), 400, "best_of"),
    Case("best_of over max_num_seqs", CMPL, js({"prompt": "hi", "best_of": 100, "max_tokens": 2}), 400, "best_of"),
    Case("best_of 2**70", CMPL, js({"prompt": "hi", "best_of": 2**70}), 400, "best_of"),
    Case("prompt_logprobs too big", CMPL, js({"prompt": "hi", "prompt_logprobs": 21}), 400, "prompt_logprobs"),
    Case("prompt_logprobs negative", CHAT, js({"messages": USER, "prompt_logprobs": -1}), 400, "prompt_logprobs"),
    Case("prompt_logprobs as string", CMPL, js({"prompt": "hi", "prompt_logprobs": "3"}), 400, "prompt_logprobs"),
    Case("prompt_logprobs streamed", CHAT, js({"messages": USER, "prompt_logprobs": 1, "stream": True}), 400,
         "prompt_logprobs"),
    Case("detokenize id past the vocabulary", "/detokenize", js({"tokens": [1, 10_000_000]}), 400, "tokens"),
    Case("detokenize id 2**70", "/detokenize", js({"tokens": [2**70]}), 400, "tokens[0]"),
    Case("detokenize tokens as string", "/detokenize", js({"tokens": "1 2 3"}), 400, "tokens"),
    Case("detokenize without tokens", "/detokenize", js({"model": None}), 400, "tokens"),
    Case("detokenize unknown model", "/detokenize", js({"model": "gpt-9", "tokens": [1]}), 404, "model",
         "model_not_found"),
    Case("tool without function", CHAT, js({"messages": USER, "tools": [{"type": "function"}]}), 400,
         "tools[0].function"),
    Case("stream_options without stream", CMPL, js({"prompt": "hi", "stream_options": {"include_usage": True}}),
         400, "stream_options"),
    Case("priority as float", CMPL, js({"prompt": "hi", "priority": 1.5}), 400, "priority"),
    Case("cache_salt empty", CMPL, js({"prompt": "hi", "cache_salt": ""}), 400, "cache_salt"),
    Case("template kwarg reserved", CHAT, js({"messages": USER, "chat_template_kwargs": {"tokenize": True}}), 400,
         "chat_template_kwargs"),
    Case("malformed tool call in history", CHAT,
         js({"messages": [*USER, {"role": "assistant", "tool_calls": [{"id": "x"}]}]}), 400,
         "messages[1].tool_calls[0].function"),
    Case("tool calls on a user message", CHAT, js({"messages": [{"role": "user", "content": "hi", "tool_calls": [
        {"id": "x", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}), 400,
         "messages[0].tool_calls"),
    Case("too many tool calls in history", CHAT, js({"messages": [*USER, {"role": "assistant", "tool_calls": [
        {"id": f"c{i}", "type": "function", "function": {"name": "f", "arguments": "{}"}} for i in range(200)]}]}),
         400, "messages[1].tool_calls"),
    # Structured output and tools: every new field bounded and typed.
    Case("response_format type unknown", CHAT, js({"messages": USER, "response_format": {"type": "yaml"}}), 400,
         "response_format.type"),
    Case("json_schema schema not an object", CHAT, js({"messages": USER, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": 5}}}), 400, "response_format.json_schema.schema"),
    Case("json_schema name charset", CMPL, js({"prompt": "hi", "response_format": {
        "type": "json_schema", "json_schema": {"name": "a b", "schema": {}}}}), 400, "response_format.json_schema.name"),
    Case("json_schema too big", CHAT, js({"messages": USER, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "description": "d" * 70_000}}}}), 400,
         "response_format.json_schema"),
    Case("guided_json not compilable", CMPL, js({"prompt": "hi", "guided_json": {"type": 12}}), 400, "guided_json"),
    Case("guided_regex too long", CMPL, js({"prompt": "hi", "guided_regex": "a" * 70_000}), 400, "guided_regex"),
    Case("guided_regex as int", CMPL, js({"prompt": "hi", "guided_regex": 5}), 400, "guided_regex"),
    Case("guided_choice empty", CMPL, js({"prompt": "hi", "guided_choice": []}), 400, "guided_choice"),
    Case("too many guided_choice", CMPL, js({"prompt": "hi", "guided_choice": [f"c{i}" for i in range(300)]}), 400,
         "guided_choice"),
    Case("guided_choice entry too long", CMPL, js({"prompt": "hi", "guided_choice": ["c" * 2000]}), 400,
         "guided_choice[0]"),
    Case("guided_grammar as list", CHAT, js({"messages": USER, "guided_grammar": ["root"]}), 400, "guided_grammar"),
    Case("structured_outputs unknown field", CMPL, js({"prompt": "hi", "structured_outputs": {"yaml": "x"}}), 400,
         "structured_outputs.yaml", "unknown_field"),
    Case("structured_outputs empty", CMPL, js({"prompt": "hi", "structured_outputs": {}}), 400, "structured_outputs"),
    Case("structured_outputs.json_object as string", CMPL,
         js({"prompt": "hi", "structured_outputs": {"json_object": "yes"}}), 400, "structured_outputs.json_object"),
    Case("control char in guided_regex", CMPL, js({"prompt": "hi", "guided_regex": "a\u0001"}), 400,
         "guided_regex"),
    Case("too many tools", CHAT, js({"messages": USER, "tools": [
        {"type": "function", "function": {"name": f"f{i}"}} for i in range(200)]}), 400, "tools"),
    Case("tool name too long", CHAT, js({"messages": USER, "tools": [{"type": "function", "function": {
        "name": "f" * 100}}]}), 400, "tools[0].function.name"),
    Case("tool description too long", CHAT, js({"messages": USER, "tools": [{"type": "function", "function": {
        "name": "f", "description": "d" * 9000}}]}), 400, "tools[0].function.description"),
    Case("tool parameters not compilable", CHAT, js({"messages": USER, "tool_choice": "required", "tools": [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}]}), 400, "tools"),
    Case("tool_choice unknown", CHAT, js({"messages": USER, "tools": [{"type": "function", "function": {"name": "f"}}],
                                          "tool_choice": "sometimes"}), 400, "tool_choice"),
    Case("tool_choice names a missing function", CHAT, js({"messages": USER, "tools": [
        {"type": "function", "function": {"name": "f"}}], "tool_choice": {"type": "function", "function": {
            "name": "g"}}}), 400, "tool_choice"),
    Case("tool_choice without tools", CHAT, js({"messages": USER, "tool_choice": "required"}), 400, "tool_choice"),
    # Every field bounded to what the engine can hold (issue 13's probe cases first): a value the
    # sampler could not take is a 400 here, never a fault in a step.
    Case("top_k 2**70", CMPL, js({"prompt": "x", "max_tokens": 3, "top_k": 1180591620717411303424}), 400, "top_k"),
    Case("top_k 2**31", CHAT, js({"messages": USER, "top_k": 2**31}), 400, "top_k"),
    Case("n over max_num_seqs", CMPL, js({"prompt": "hi", "n": 100, "max_tokens": 2}), 400, "n"),
    Case("temperature NaN", CMPL, b'{"prompt": "hi", "temperature": NaN}', 400, "temperature"),
    Case("top_p Infinity", CMPL, b'{"prompt": "hi", "top_p": Infinity}', 400, "top_p"),
    Case("min_p NaN", CHAT, b'{"messages": [{"role": "user", "content": "hi"}], "min_p": NaN}', 400, "min_p"),
    Case("presence_penalty -Infinity", CMPL, b'{"prompt": "hi", "presence_penalty": -Infinity}', 400,
         "presence_penalty"),
    Case("frequency_penalty NaN", CMPL, b'{"prompt": "hi", "frequency_penalty": NaN}', 400, "frequency_penalty"),
    Case("repetition_penalty Infinity", CMPL, b'{"prompt": "hi", "repetition_penalty": Infinity}', 400,
         "repetition_penalty"),
    Case("seed 2**64", CMPL, js({"prompt": "hi", "seed": 2**64}), 400, "seed"),
    Case("seed below int64", CMPL, js({"prompt": "hi", "seed": -(2**63) - 1}), 400, "seed"),
    Case("max_tokens 2**70", CMPL, js({"prompt": "hi", "max_tokens": 2**70}), 400, "max_tokens"),
    Case("max_completion_tokens 2**64", CHAT, js({"messages": USER, "max_completion_tokens": 2**64}), 400,
         "max_completion_tokens"),
    Case("min_tokens 2**70", CMPL, js({"prompt": "hi", "min_tokens": 2**70}), 400, "min_tokens"),
    Case("logprobs 2**70", CMPL, js({"prompt": "hi", "logprobs": 2**70}), 400, "logprobs"),
    Case("priority 2**40", CMPL, js({"prompt": "hi", "priority": 2**40}), 400, "priority"),
    Case("huge stop list", CMPL, js({"prompt": "hi", "stop": [f"s{i}" for i in range(5000)]}), 400, "stop"),
    Case("stop string too long", CMPL, js({"prompt": "hi", "stop": "s" * 600}), 400, "stop"),
    Case("stop list string too long", CMPL, js({"prompt": "hi", "stop": ["ok", "s" * 600]}), 400, "stop[1]"),
    Case("too many stop_token_ids", CMPL, js({"prompt": "hi", "stop_token_ids": list(range(200))}), 400,
         "stop_token_ids"),
    Case("stop_token_id 2**40", CMPL, js({"prompt": "hi", "stop_token_ids": [2**40]}), 400, "stop_token_ids[0]"),
    Case("prompt token id 2**70", CMPL, js({"prompt": [1, 2**70]}), 400, "prompt[1]"),
    Case("request_id charset", CMPL, js({"prompt": "hi", "request_id": "a b\n"}), 400, "request_id"),
    Case("request_id too long", CMPL, js({"prompt": "hi", "request_id": "r" * 129}), 400, "request_id"),
    Case("cache_salt too long", CMPL, js({"prompt": "hi", "cache_salt": "s" * 300}), 400, "cache_salt"),
    Case("user too long", CMPL, js({"prompt": "hi", "user": "u" * 300}), 400, "user"),
    Case("control char in user", CHAT, js({"messages": USER, "user": "a\u001bb"}), 400, "user"),
    Case("model name too long", CMPL, js({"model": "m" * 2000, "prompt": "hi"}), 400, "model"),
    Case("too many messages", CHAT, js({"messages": USER * 3000}), 400, "messages"),
    Case("too many content parts", CHAT,
         js({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}] * 1100}]}), 400,
         "messages[0].content"),
    Case("message name too long", CHAT, js({"messages": [{"role": "user", "content": "hi", "name": "n" * 300}]}),
         400, "messages[0].name"),
    Case("too many template kwargs", CHAT, js({"messages": USER, "chat_template_kwargs": {f"k{i}": 1 for i in range(40)}}),
         400, "chat_template_kwargs"),
    Case("template kwarg too long", CHAT, js({"messages": USER, "chat_template_kwargs": {"k": "v" * 5000}}), 400,
         "chat_template_kwargs.k"),
    Case("template kwarg Infinity", CHAT,
         b'{"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"k": Infinity}}', 400,
         "chat_template_kwargs.k"),
    Case("too much metadata", CMPL, js({"prompt": "hi", "metadata": {f"k{i}": "v" for i in range(17)}}), 400,
         "metadata"),
    # The Responses API (docs/RESPONSES.md): OpenAI's error body too.
    Case("responses: unknown field", RESP, js({"input": "hi", "reasoning": {"effort": "low"}}), 400, "reasoning",
         "unknown_field"),
    Case("responses: missing input", RESP, js({"max_output_tokens": 2}), 400, "input"),
    Case("responses: empty input", RESP, js({"input": []}), 400, "input"),
    Case("responses: max_output_tokens zero", RESP, js({"input": "hi", "max_output_tokens": 0}), 400,
         "max_output_tokens"),
    Case("responses: max_output_tokens past context", RESP, js({"input": "hi", "max_output_tokens": 100_000}), 400,
         "max_tokens", "context_length_exceeded"),
    Case("responses: temperature above 2", RESP, js({"input": "hi", "temperature": 2.5}), 400, "temperature"),
    Case("responses: image part", RESP, js({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}),
         400, "input[0].message.content[0].type"),
    Case("responses: unknown item type", RESP, js({"input": [{"type": "reasoning", "summary": []}]}), 400, "input[0]"),
    Case("responses: extra field on an item", RESP,
         js({"input": [{"type": "function_call_output", "call_id": "c", "output": "x", "extra": 1}]}), 400,
         "input[0].function_call_output.extra"),
    Case("responses: json_schema without schema", RESP,
         js({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}}), 400, "text.format.schema"),
    Case("responses: truncation auto", RESP, js({"input": "hi", "truncation": "auto"}), 400, "truncation"),
    Case("responses: too many tools", RESP, js({"input": "hi", "tools": [
        {"type": "function", "name": f"f{i}"} for i in range(129)]}), 400, "tools"),
    Case("responses: built-in tool", RESP, js({"input": "hi", "tools": [{"type": "web_search"}]}), 400,
         "tools[0].type"),
    Case("responses: tool_choice without tools", RESP, js({"input": "hi", "tool_choice": "required"}), 400,
         "tool_choice"),
    Case("responses: bad previous_response_id", RESP, js({"input": "hi", "previous_response_id": "a b"}), 400,
         "previous_response_id"),
    Case("responses: unknown previous_response_id", RESP, js({"input": "hi", "previous_response_id": "resp_x"}),
         404, "response_id", "response_not_found", "not_found_error"),
    Case("responses: too much metadata", RESP, js({"input": "hi", "metadata": {f"k{i}": "v" for i in range(17)}}),
         400, "metadata"),
    Case("responses: unknown model", RESP, js({"input": "hi", "model": "gpt-9"}), 404, "model", "model_not_found"),
]

# The Messages API (docs/ANTHROPIC.md): Anthropic's error body, the field named in the message.
MSG = "/v1/messages"
ANTHROPIC_CASES = [
    ("malformed json", b'{"max_tokens": 4,', 400, "JSON"),
    ("missing max_tokens", js({"model": "m", "messages": USER}), 400, "max_tokens"),
    ("missing model", js({"max_tokens": 4, "messages": USER}), 400, "model"),
    ("max_tokens zero", js({"model": "m", "max_tokens": 0, "messages": USER}), 400, "max_tokens"),
    ("temperature above 1", js({"model": "m", "max_tokens": 4, "messages": USER, "temperature": 1.5}), 400,
     "temperature"),
    ("top_k negative", js({"model": "m", "max_tokens": 4, "messages": USER, "top_k": -1}), 400, "top_k"),
    ("too many stop sequences", js({"model": "m", "max_tokens": 4, "messages": USER, "stop_sequences": ["a"] * 17}),
     400, "stop_sequences"),
    ("thinking", js({"model": "m", "max_tokens": 4, "messages": USER, "thinking": {"type": "enabled"}}), 400,
     "thinking"),
    ("image block", js({"model": "m", "max_tokens": 4, "messages": [
        {"role": "user", "content": [{"type": "image", "source": {}}]}]}), 400, "messages[0].content[0]"),
    ("system role in messages", js({"model": "m", "max_tokens": 4, "messages": [{"role": "system", "content": "x"}]}),
     400, "messages[0].role"),
    ("tool_use from the user", js({"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]}), 400, "messages[0].content[0]"),
    ("tool_choice tool without name", js({"model": "m", "max_tokens": 4, "messages": USER, "tools": [
        {"name": "f", "input_schema": {"type": "object"}}], "tool_choice": {"type": "tool"}}), 400, "tool_choice.name"),
    ("tool_choice without tools", js({"model": "m", "max_tokens": 4, "messages": USER,
                                      "tool_choice": {"type": "any"}}), 400, "tool_choice"),
    ("empty messages", js({"model": "m", "max_tokens": 4, "messages": []}), 400, "messages"),
    ("control character", js({"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "a\u0001"}]}),
     400, "content"),
    ("metadata unknown key", js({"model": "m", "max_tokens": 4, "messages": USER, "metadata": {"x": 1}}), 400,
     "metadata"),
    ("max_tokens past context", js({"model": "m", "max_tokens": 100_000, "messages": USER}), 400, "max_tokens"),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_request_gets_openai_error(server_url: str, http: httpx.Client, case: Case) -> None:
    r = http.post(server_url + case.path, content=case.body, headers={"Content-Type": "application/json"})
    assert r.status_code == case.status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    err = body["error"]
    assert err["type"] == case.error_type, err
    assert len(err["message"]) > 15, err  # says what to fix, not just "bad request"
    if case.param is not None:
        assert err["param"] == case.param, err
    if case.code is not None:
        assert err["code"] == case.code, err
    # The server still answers the next valid request.
    ok = http.post(server_url + CMPL, json={"prompt": "still alive?", "max_tokens": 2})
    assert ok.status_code == 200, ok.text
    assert ok.json()["usage"]["completion_tokens"] >= 1


@pytest.mark.parametrize("name, body, status, field", ANTHROPIC_CASES, ids=[c[0] for c in ANTHROPIC_CASES])
def test_bad_messages_request_gets_anthropic_error(server_url: str, http: httpx.Client, model_name: str, name: str,
                                                   body: bytes, status: int, field: str) -> None:
    body = body.replace(b'"model": "m"', json.dumps({"model": model_name})[1:-1].encode())
    r = http.post(server_url + MSG, content=body,
                  headers={"Content-Type": "application/json", "anthropic-version": "2023-06-01"})
    assert r.status_code == status, r.text
    err = r.json()
    assert set(err) == {"type", "error"} and err["type"] == "error", err
    assert err["error"]["type"] == "invalid_request_error" and field in err["error"]["message"], err
    ok = http.post(server_url + MSG, json={"model": model_name, "max_tokens": 2, "messages": USER})
    assert ok.status_code == 200 and ok.json()["usage"]["output_tokens"] >= 1, ok.text


def test_unknown_path_and_method_use_the_error_body(server_url: str, http: httpx.Client) -> None:
    r = http.get(f"{server_url}/v1/nothing-here")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    r = http.get(f"{server_url}/v1/completions")
    assert r.status_code == 405 and "error" in r.json()


def test_issue_13_top_k_probe_leaves_the_server_serving(server_url: str, http: httpx.Client) -> None:
    """The request that used to overflow in the sampler and kill the step loop for good."""
    for _ in range(3):
        r = http.post(server_url + CMPL, json={"prompt": "x", "max_tokens": 3, "top_k": 1180591620717411303424})
        assert r.status_code == 400 and r.json()["error"]["param"] == "top_k", r.text
    assert http.get(f"{server_url}/health").status_code == 200
    ok = http.post(server_url + CMPL, json={"prompt": "x", "max_tokens": 3})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3, ok.text


@pytest.mark.parametrize("body", [
    {"prompt": "x", "max_tokens": 3, "top_k": 2**31 - 1},  # larger than the vocabulary: no cut
    {"prompt": "x", "max_tokens": 3, "seed": -1},  # any int64 (vLLM's range)
    {"prompt": "x", "max_tokens": 3, "seed": 2**63 - 1, "n": 2},  # seed + i past int64 is still a torch seed
    {"prompt": "x", "max_tokens": 3, "stop": ["s" * 512], "stop_token_ids": list(range(128))},
    {"prompt": "x", "max_tokens": 3, "temperature": 100, "presence_penalty": -2, "frequency_penalty": 2,
     "repetition_penalty": 10, "min_p": 1, "top_p": 1e-9},
    {"prompt": ["x"] * 64, "max_tokens": 1},  # the most prompts in one request
    {"prompt": "x", "max_tokens": 3, "n": 2, "best_of": 4, "echo": True, "logprobs": 20, "prompt_logprobs": 20,
     "logit_bias": {str(i): 100.0 if i % 2 else -100.0 for i in range(300)}},
], ids=["top_k int32 max", "negative seed", "int64 max seed", "longest stops", "extreme floats", "64 prompts",
        "largest logit_bias, best_of, echo, prompt_logprobs"])
def test_values_at_the_bounds_are_served(server_url: str, http: httpx.Client, body: dict) -> None:
    r = http.post(f"{server_url}{CMPL}", json=body)
    assert r.status_code == 200, r.text
    assert all(c["finish_reason"] for c in r.json()["choices"]), r.text
