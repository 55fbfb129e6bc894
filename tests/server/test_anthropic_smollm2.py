"""Anthropic's Messages API on the default real model (SmolLM2-135M-Instruct): a streamed answer's
text is the non-streamed one's at temperature 0 (the shared real-model server)."""

from __future__ import annotations

import anthropic

MODEL = "SmolLM2-135M-Instruct"


def test_streamed_text_equals_non_streamed(smollm2_server: str) -> None:
    with anthropic.Anthropic(base_url=smollm2_server, api_key="unused", max_retries=0, timeout=120) as client:
        kw = dict(model=MODEL, max_tokens=24,
                  system="You are a helpful assistant.",
                  messages=[{"role": "user", "content": "What is the capital of France?"}],
                  extra_body={"temperature": 0})
        whole = client.messages.create(**kw)  # type: ignore[arg-type]
        with client.messages.stream(**kw) as stream:  # type: ignore[arg-type]
            streamed = stream.get_final_message()
    text = whole.content[0].text
    assert "Paris" in text
    assert streamed.content[0].text == text and streamed.stop_reason == whole.stop_reason
    assert streamed.usage.output_tokens == whole.usage.output_tokens
