"""Gemma 3 270M's chat rendering. The file is the base model: its metadata has no
``tokenizer.chat_template``, so there is no template of the file's to hold against transformers,
and pagedserve adds none (a chat request is answered as for any model without one). What a user
passes with ``serve --chat-template`` is held to transformers' rendering instead: a template in
Gemma 3's turn format (written here), over the tokenizer transformers converts from the GGUF, gives
the same text and ids through pagedserve's tokenizer loading and through its own renderer
(pagedserve.chat_templates, which serves tokenizers of up to 100k tokens) as through
transformers' ``apply_chat_template``, for conversations with a system turn, several turns, with
and without the generation prompt, and a continued final message."""

from __future__ import annotations

import pytest

from pagedserve.chat_templates import render, template_environment
from pagedserve.models.gguf import prepare_gguf_dir
from pagedserve.tokenizer import load_tokenizer
from tests.test_tokenizer_parity import CONVERSATIONS, _compare_chat

# Gemma 3's turn format: <start_of_turn>user|model, the system text folded into the first user turn.
GEMMA3_TURNS = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first = messages[0]['content'] | trim + '\n\n' -%}{%- set turns = messages[1:] -%}"
    "{%- else -%}{%- set first = '' -%}{%- set turns = messages -%}{%- endif -%}"
    "{%- for m in turns -%}"
    "{%- if (m['role'] == 'user') != loop.index is odd -%}"
    "{{ raise_exception('turns must alternate user, assistant, user, ...') }}{%- endif -%}"
    "{{ '<start_of_turn>' + ('model' if m['role'] == 'assistant' else 'user') + '\n' }}"
    "{{ (first if loop.first else '') + m['content'] | trim + '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif -%}"
)


@pytest.fixture(scope="module")
def gemma3_dir(gemma3_gguf):  # type: ignore[no-untyped-def]
    return prepare_gguf_dir(gemma3_gguf)


def test_the_file_has_no_chat_template(gemma3_gguf, gemma3_dir) -> None:  # type: ignore[no-untyped-def]
    """Not in its metadata (whose other strings are read), so not in the prepared directory
    transformers' converter wrote, where both tokenizer loaders would look for one."""
    import json

    from pagedserve.models.gguf import open_gguf_tensors

    fields = open_gguf_tensors(gemma3_gguf).fields
    assert fields["tokenizer.ggml.model"].contents() == "llama" and "tokenizer.chat_template" not in fields
    assert "chat_template" not in json.loads((gemma3_dir / "tokenizer_config.json").read_text())
    assert not list(gemma3_dir.glob("chat_template*")) and not (gemma3_dir / "additional_chat_templates").exists()


@pytest.mark.slow
def test_a_gemma3_template_renders_as_transformers_renders_it(gemma3_dir) -> None:  # type: ignore[no-untyped-def]
    from transformers import AutoTokenizer

    theirs = AutoTokenizer.from_pretrained(gemma3_dir)
    theirs.chat_template = GEMMA3_TURNS
    ours = load_tokenizer(str(gemma3_dir), chat_template=GEMMA3_TURNS)  # serve --chat-template
    _compare_chat(ours, theirs)
    compiled = template_environment().from_string(GEMMA3_TURNS)
    for conversation in CONVERSATIONS:
        for generation_prompt in (True, False):
            assert render(compiled, GEMMA3_TURNS, conversation, special_tokens=theirs.special_tokens_map,
                          add_generation_prompt=generation_prompt) == \
                theirs.apply_chat_template(conversation, tokenize=False, add_generation_prompt=generation_prompt)
    rendered = theirs.apply_chat_template(CONVERSATIONS[2], tokenize=False, add_generation_prompt=True)
    assert rendered == ("<bos><start_of_turn>user\nBe kind.\n\none<end_of_turn>\n<start_of_turn>model\ntwo<end_of_turn>\n"
                        "<start_of_turn>user\nthree<end_of_turn>\n<start_of_turn>model\n")
    with pytest.raises(Exception, match="turns must alternate"):
        ours.apply_chat_template([{"role": "assistant", "content": "x"}], tokenize=False)
