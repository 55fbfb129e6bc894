"""pagedserve's tokenizer (pagedserve/tokenizer.py) against transformers' AutoTokenizer, the
reference: identical ids, text, vocabulary, special ids and rendered chat templates on every model
directory the suite serves, on small directories exercising each tokenizer_config.json feature it
reads, and falling back to AutoTokenizer where it cannot be exact. Also: a front end's imports and
tokenizer load bring in neither transformers nor torch."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from pagedserve.tokenizer import FastTokenizer, UnsupportedTokenizer, load_tokenizer

TEXTS = [
    "",
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "def f(x):\n    return x ** 2  # squared\n",
    "Grüße aus Köln, naïve café, 日本語のテキスト, русский текст, العربية",
    "emoji 🎉👍🏽 family 👨‍👩‍👧 flags 🇫🇷🇯🇵",
    "   leading, \t\ttabs,  double  spaces,\n\n\nnewlines   and trailing   ",
    "<s>inside</s> <unk> <|im_start|>user\nhi<|im_end|> <|endoftext|> [CLS] <img>",
    "don't , isn't . 're ? !",
    "x" * 300,
]

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi 🎉 naïve"}],
    [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "one"},
     {"role": "assistant", "content": "two"}, {"role": "user", "content": "three"}],
    [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b", "name": None},
     {"role": "user", "content": "c\n\n  d"}],
]

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city (°C)",
                                          "parameters": {"type": "object", "properties": {
                                              "city": {"type": "string"}}, "required": ["city"]}}}]

# A template exercising what templates of real models use: tools through tojson (non-ASCII kept),
# namespace, loop controls, raise_exception, the generation block and a special token variable.
TOOL_TEMPLATE = (
    "{%- set ns = namespace(system=false) -%}"
    "{%- if tools %}<tools>{{ tools | tojson }}</tools>\n{% endif -%}"
    "{%- for m in messages %}"
    "{%- if m.role == 'system' %}{% set ns.system = true %}{% endif -%}"
    "{%- if m.role not in ['system', 'user', 'assistant', 'tool'] %}{{ raise_exception('bad role ' + m.role) }}{% endif -%}"
    "{%- if m.role == 'assistant' %}{% generation %}<a>{{ m.content }}{{ eos_token }}{% endgeneration %}"
    "{%- else %}<{{ m.role }}>{{ m.content | trim }}\n{% endif -%}"
    "{%- if loop.index > 20 %}{% break %}{% endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt %}<a>{% endif %}{{ ns.system }}{{ custom_kwarg | default('') }}"
)


def _compare(ours: FastTokenizer, theirs) -> None:  # type: ignore[no-untyped-def]
    assert len(ours) == len(theirs)
    assert ours.vocab_size == theirs.vocab_size
    assert ours.get_vocab() == theirs.get_vocab()
    assert ours.get_added_vocab() == theirs.get_added_vocab()
    assert ours.all_special_tokens == theirs.all_special_tokens
    assert ours.all_special_ids == theirs.all_special_ids
    assert ours.special_tokens_map == theirs.special_tokens_map
    for name in ("bos", "eos", "unk", "pad", "sep", "cls", "mask"):
        assert getattr(ours, f"{name}_token") == getattr(theirs, f"{name}_token"), name
        assert getattr(ours, f"{name}_token_id") == getattr(theirs, f"{name}_token_id"), name
    assert ours.chat_template == theirs.chat_template
    for text in TEXTS:
        for special in (True, False):
            ids = theirs.encode(text, add_special_tokens=special)
            assert ours.encode(text, add_special_tokens=special) == ids, (text, special)
            assert ours(text, add_special_tokens=special)["input_ids"] == ids
            assert ours._tokenizer.encode_batch([text], add_special_tokens=special)[0].ids == ids
            for skip in (True, False):
                assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip)
    every_special = theirs.all_special_ids + theirs.encode("mixed text", add_special_tokens=False)
    for skip in (True, False):
        assert ours.decode(every_special, skip_special_tokens=skip) == theirs.decode(every_special,
                                                                                      skip_special_tokens=skip)
    if theirs.chat_template is not None:
        _compare_chat(ours, theirs)


def _compare_chat(ours: FastTokenizer, theirs, **kwargs) -> None:  # type: ignore[no-untyped-def]
    for conversation in CONVERSATIONS:
        for generation_prompt in (True, False):
            expected = theirs.apply_chat_template(conversation, tokenize=False,
                                                  add_generation_prompt=generation_prompt, **kwargs)
            assert ours.apply_chat_template(conversation, tokenize=False, add_generation_prompt=generation_prompt,
                                            **kwargs) == expected
            ids = theirs.apply_chat_template(conversation, add_generation_prompt=generation_prompt,
                                             return_dict=False, **kwargs)
            assert ours.apply_chat_template(conversation, add_generation_prompt=generation_prompt, return_dict=False,
                                            **kwargs) == ids
            assert ours.apply_chat_template(conversation, add_generation_prompt=generation_prompt,
                                            **kwargs)["input_ids"] == ids
    last = CONVERSATIONS[2][:-1]
    assert ours.apply_chat_template(last, tokenize=False, continue_final_message=True, **kwargs) == \
        theirs.apply_chat_template(last, tokenize=False, continue_final_message=True, **kwargs)


def _with_model_type(tmp: Path, source: Path, model_type: str) -> Path:
    """``source``'s tokenizer files beside a config.json of ``model_type`` (what AutoTokenizer reads)."""
    out = tmp / model_type
    out.mkdir()
    for f in source.iterdir():
        if f.name.startswith(("tokenizer", "chat_template", "special_tokens", "added_tokens")):
            shutil.copy(f, out / f.name)
    (out / "config.json").write_text(json.dumps({"model_type": model_type}))
    return out


# ---- the model directories the suite serves ----------------------------------------------------


@pytest.fixture(scope="module")
def suite_dirs(tiny_model_dir, tiny_ggufs, tmp_path_factory) -> dict[str, Path]:  # type: ignore[no-untyped-def]
    from pagedserve.models.gguf import prepare_gguf_dir
    from pagedserve.models.standard import shared_tokenizer_dir

    tmp = tmp_path_factory.mktemp("tokenizers")
    dirs = {
        "tiny": tiny_model_dir,
        # every STANDARD_MODELS entry (and every checkpoint tests/checkpoints.py builds) carries this tokenizer
        "standard": _with_model_type(tmp, shared_tokenizer_dir(), "llama"),
        "trained-toy": shared_tokenizer_dir(4096),
        "tiny-gguf": prepare_gguf_dir(tiny_ggufs("Q8_0", tokenizer=True)),  # the file tests/models prepare too
    }
    for arch in ("mistral", "qwen3"):
        dirs[arch] = _with_model_type(tmp, tiny_model_dir, arch)
    return dirs


@pytest.mark.parametrize("name", ["tiny", "standard", "trained-toy", "tiny-gguf", "mistral", "qwen3"])
def test_identical_to_transformers_on_the_suites_model_dirs(suite_dirs, name):
    d = suite_dirs[name]
    ours = FastTokenizer.from_dir(d)
    theirs = AutoTokenizer.from_pretrained(d)
    assert type(theirs).__name__ == "TokenizersBackend"
    _compare(ours, theirs)


def test_identical_on_the_default_model_smollm2(smollm2_gguf):
    from pagedserve.models.gguf import prepare_gguf_dir

    d = prepare_gguf_dir(smollm2_gguf)
    ours, theirs = FastTokenizer.from_dir(d), AutoTokenizer.from_pretrained(d)
    _compare(ours, theirs)
    _compare_chat(ours, theirs, tools=TOOLS)  # its template ignores tools: both must ignore them alike


def test_chat_template_override_and_tools_render_identically(tiny_model_dir):
    """``serve --chat-template``: the override replaces the model's template in both."""
    ours, theirs = load_tokenizer(str(tiny_model_dir), chat_template=TOOL_TEMPLATE), AutoTokenizer.from_pretrained(
        tiny_model_dir)
    theirs.chat_template = TOOL_TEMPLATE
    assert isinstance(ours, FastTokenizer)
    for tools in (None, TOOLS):
        _compare_chat(ours, theirs, tools=tools, custom_kwarg="«extra»")
    bad = [{"role": "robot", "content": "x"}]
    with pytest.raises(Exception, match="bad role robot"):
        ours.apply_chat_template(bad, tokenize=False)
    with pytest.raises(Exception, match="bad role robot"):
        theirs.apply_chat_template(bad, tokenize=False)


# ---- tokenizer_config.json features, one small directory each ---------------------------------


def _wordpiece_dir(out: Path, config: dict, tokenizer_json_extra: bool = False) -> Path:
    """A WordPiece tokenizer (not BPE: transformers applies clean_up_tokenization_spaces to it)."""
    from tokenizers import (
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
    )

    vocab = {t: i for i, t in enumerate(["[UNK]", "[CLS]", "[SEP]", "[PAD]", "[MASK]", "hello", "world", ",", ".",
                                         "don", "'", "t", "is", "##n", "!", "?", "the", "a", "re"])}
    tok = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    tok.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
                                                       special_tokens=[("[CLS]", 1), ("[SEP]", 2)])
    if tokenizer_json_extra:
        tok.add_special_tokens(["[CLS]", "[SEP]"])
    out.mkdir()
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "TokenizersBackend", **config}))
    return out


FEATURES = {
    "clean-up-spaces": {"clean_up_tokenization_spaces": True, "unk_token": "[UNK]", "cls_token": "[CLS]",
                        "sep_token": "[SEP]", "pad_token": "[PAD]", "mask_token": "[MASK]"},
    "no-clean-up": {"clean_up_tokenization_spaces": False, "unk_token": "[UNK]", "sep_token": "[SEP]"},
    "extra-special-list": {"unk_token": "[UNK]", "additional_special_tokens": ["<img>", "<tool>"],
                           "eos_token": "[SEP]"},
    "model-specific-token": {"unk_token": "[UNK]", "image_token": "<img>", "eos_token": "</s>"},
    "added-tokens-decoder": {"unk_token": "[UNK]", "bos_token": "[CLS]", "added_tokens_decoder": {
        "1": {"content": "[CLS]", "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
              "special": True},
        "19": {"content": "<|user|>", "lstrip": False, "normalized": False, "rstrip": True, "single_word": False,
               "special": False}}},
    "addedtoken-object": {"unk_token": "[UNK]", "eos_token": {
        "__type": "AddedToken", "content": "[SEP]", "lstrip": False, "normalized": False, "rstrip": False,
        "single_word": False, "special": True}},
    "split-special-tokens": {"unk_token": "[UNK]", "sep_token": "[SEP]", "split_special_tokens": True},
    "add-bos-ignored": {"unk_token": "[UNK]", "bos_token": "[CLS]", "add_bos_token": False, "add_eos_token": True,
                        "eos_token": "[SEP]"},
    "config-template": {"unk_token": "[UNK]", "chat_template": TOOL_TEMPLATE},
    "named-templates": {"unk_token": "[UNK]", "chat_template": [
        {"name": "default", "template": "{% for m in messages %}{{ m.content }};{% endfor %}"},
        {"name": "tool_use", "template": TOOL_TEMPLATE}]},
}


@pytest.mark.parametrize("feature", sorted(FEATURES))
def test_identical_for_each_config_feature(feature, tmp_path):
    d = _wordpiece_dir(tmp_path / feature, FEATURES[feature], tokenizer_json_extra=feature == "clean-up-spaces")
    ours, theirs = FastTokenizer.from_dir(d), AutoTokenizer.from_pretrained(d)
    _compare(ours, theirs)
    if feature == "named-templates":
        _compare_chat(ours, theirs, tools=TOOLS)  # tools pick the tool_use template


def test_template_files_take_priority_over_the_config(tmp_path):
    d = _wordpiece_dir(tmp_path / "files", FEATURES["config-template"])
    (d / "chat_template.jinja").write_text("{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}")
    (d / "chat_template.json").write_text(json.dumps({"chat_template": "processor only: ignored"}))
    ours, theirs = FastTokenizer.from_dir(d), AutoTokenizer.from_pretrained(d)
    assert ours.chat_template == theirs.chat_template and "[{{ m.role }}]" in ours.chat_template
    _compare_chat(ours, theirs)
    (d / "additional_chat_templates").mkdir()
    (d / "additional_chat_templates" / "tool_use.jinja").write_text(TOOL_TEMPLATE)
    ours, theirs = FastTokenizer.from_dir(d), AutoTokenizer.from_pretrained(d)
    assert isinstance(ours.chat_template, dict) and ours.chat_template == theirs.chat_template
    _compare_chat(ours, theirs, tools=TOOLS)


# ---- what it leaves to transformers ------------------------------------------------------------


def test_falls_back_to_transformers_where_it_cannot_be_exact(tiny_model_dir, tmp_path, caplog):
    qwen2 = _with_model_type(tmp_path, tiny_model_dir, "qwen2")  # transformers substitutes Qwen2Tokenizer
    no_json = tmp_path / "slow"
    no_json.mkdir()
    shutil.copy(tiny_model_dir / "tokenizer_config.json", no_json / "tokenizer_config.json")
    other_class = _wordpiece_dir(tmp_path / "bert", {"unk_token": "[UNK]"})
    cfg = json.loads((other_class / "tokenizer_config.json").read_text())
    (other_class / "tokenizer_config.json").write_text(json.dumps({**cfg, "tokenizer_class": "BertTokenizer"}))
    for d, why in ((qwen2, "model_type 'qwen2'"), (no_json, "no tokenizer.json"), (other_class, "BertTokenizer")):
        with pytest.raises(UnsupportedTokenizer, match=why):
            FastTokenizer.from_dir(d)
    caplog.set_level("INFO", logger="pagedserve.tokenizer")
    fallback = load_tokenizer(str(qwen2))
    assert not isinstance(fallback, FastTokenizer)
    assert [r.message for r in caplog.records if "AutoTokenizer" in r.message] == [
        f"tokenizer of {qwen2}: loading transformers' AutoTokenizer (model_type 'qwen2' may get a tokenizer "
        "class of its own)"]
    assert fallback.encode("hello") == AutoTokenizer.from_pretrained(qwen2).encode("hello")


# ---- the front end's start path ----------------------------------------------------------------


def test_preloaded_tokenizers_are_handed_out_once_each_for_their_directory(tiny_model_dir, tmp_path):
    from pagedserve.tokenizer import TokenizerPreload

    preload = TokenizerPreload(str(tiny_model_dir), count=2)
    assert preload.take(str(tmp_path)) is None  # another directory: the caller loads its own
    first = preload.take(str(tiny_model_dir) + "/.")  # the same directory, spelt otherwise
    second = load_tokenizer(str(tiny_model_dir), chat_template="{{ messages[0].content }}", preload=preload)
    assert isinstance(first, FastTokenizer) and isinstance(second, FastTokenizer) and first is not second
    assert second.chat_template == "{{ messages[0].content }}" and first.chat_template != second.chat_template
    assert preload.take(str(tiny_model_dir)) is None  # both handed out
    assert TokenizerPreload("not-a-directory").take("not-a-directory") is None
    _compare(first, AutoTokenizer.from_pretrained(tiny_model_dir))


_FRONT_IMPORTS = """
import sys
import pagedserve.cli, pagedserve.server.cli
from pagedserve.engine.frontend.mp_client import MPEngineClient
from pagedserve.server.app import build_app
from pagedserve.server.api_servers import run_api_server
from pagedserve.server.tokenization import TokenizerWorker
from pagedserve.server.serving import OpenAIServing
from pagedserve.tokenizer import load_tokenizer
worker = TokenizerWorker(sys.argv[1])
loop_side = load_tokenizer(sys.argv[1])
worker.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
worker.close()
print(sorted(m for m in ("torch", "transformers") if m in sys.modules))
"""


def test_a_front_end_imports_neither_transformers_nor_torch(tiny_model_dir):
    """What a `pagedserve serve` front imports to start, plus its tokenizers loaded and a chat
    template rendered: neither module appears (each costs seconds of CPU per server start)."""
    out = subprocess.run([sys.executable, "-c", _FRONT_IMPORTS, str(tiny_model_dir)], capture_output=True,
                         text=True, timeout=120, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stderr
