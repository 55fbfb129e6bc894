"""The token ids that end a completion, read from a model directory's files without transformers.

The engine core needs only these ids of the tokenizer, and building transformers' ``AutoTokenizer``
(plus a ``GenerationConfig``) for them cost its start-up the whole transformers import. The ids
are: the tokenizer's EOS token (``tokenizer_config.json``'s ``eos_token``, a string or an
AddedToken dict; legacy ``special_tokens_map.json`` overrides it where transformers lets it),
resolved to its id through the added tokens or the vocabulary, plus ``generation_config.json``'s
``eos_token_id`` (an int or a list).

:func:`eos_ids_from_files` answers None where the files do not settle it (no tokenizer.json, an
EOS token the files do not name or cannot resolve): the caller then asks transformers, so odd
tokenizers keep exactly the old answer. tests/models/test_hf_config.py checks both agree on every
model directory the suite uses.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any


def _read_json(path: Path) -> Any:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None


def _top_level_value(text: str, key: str) -> Any:
    """``json.loads(text)[key]`` (None if absent), parsing the object's members only up to ``key``:
    tokenizer.json puts its added tokens ahead of megabytes of vocabulary and merges."""
    decoder = json.JSONDecoder()
    ws = json.decoder.WHITESPACE.match
    pos = ws(text, 0).end()
    if text[pos:pos + 1] != "{":
        raise ValueError("tokenizer.json is not a JSON object")
    pos = ws(text, pos + 1).end()
    while text[pos:pos + 1] == '"':
        name, pos = decoder.raw_decode(text, pos)
        pos = ws(text, pos).end()
        if text[pos:pos + 1] != ":":
            raise ValueError("tokenizer.json is not valid JSON")
        value, pos = decoder.raw_decode(text, ws(text, pos + 1).end())
        if name == key:
            return value
        pos = ws(text, pos).end()
        if text[pos:pos + 1] != ",":
            break
        pos = ws(text, pos + 1).end()
    return None


def _token_text(token: Any) -> str | None:
    """An ``eos_token`` entry as text: a string, or a serialized AddedToken's ``content``."""
    if isinstance(token, dict):
        token = token.get("content")
    return token if isinstance(token, str) else None


def _tokenizer_eos(tokenizer_dir: Path) -> int | None:
    """The EOS token's id from the tokenizer files; None if they don't settle it."""
    config = _read_json(tokenizer_dir / "tokenizer_config.json")
    if not isinstance(config, dict) or not (tokenizer_dir / "tokenizer.json").is_file():
        return None
    eos = config.get("eos_token")
    if "added_tokens_decoder" not in config:  # transformers merges the legacy map only then
        legacy = _read_json(tokenizer_dir / "special_tokens_map.json")
        if isinstance(legacy, dict) and legacy.get("eos_token") is not None:
            eos = legacy["eos_token"]
    text = _token_text(eos)
    if text is None:
        return None  # unnamed: the tokenizer class may have its own default
    for token_id, token in (config.get("added_tokens_decoder") or {}).items():
        if _token_text(token) == text:
            return int(token_id)
    # Not among the config's added tokens: tokenizer.json's own list (it comes before the large
    # vocabulary, so only the file's head is parsed), then its vocabulary.
    raw = (tokenizer_dir / "tokenizer.json").read_text(encoding="utf-8")
    for token in _top_level_value(raw, "added_tokens") or []:
        if token.get("content") == text:
            return int(token["id"])
    vocab = (json.loads(raw).get("model") or {}).get("vocab")
    if isinstance(vocab, dict) and text in vocab:
        return int(vocab[text])
    return None


def generation_eos(model_dir: Path) -> list[int]:
    """``generation_config.json``'s ``eos_token_id`` as a list (empty without the file or the key)."""
    try:
        config = _read_json(Path(model_dir) / "generation_config.json")
    except ValueError:  # not JSON: as transformers' loader fails on it, it adds nothing
        return []
    ids = config.get("eos_token_id") if isinstance(config, dict) else None
    return [int(ids)] if isinstance(ids, int) else [int(i) for i in ids or []]


def eos_ids_from_files(tokenizer_dir: str | Path, model_dir: str | Path) -> set[int] | None:
    """The tokenizer's EOS id plus generation_config.json's, or None if the files don't settle the
    tokenizer's (see the module docstring)."""
    eos = _tokenizer_eos(Path(tokenizer_dir))  # None for a hub id too (no files): transformers fetches it
    return None if eos is None else {eos, *generation_eos(Path(model_dir))}


def eos_ids_from_transformers(tokenizer_dir: str | Path, model_dir: str | Path) -> set[int]:
    """The same answer through transformers' tokenizer and generation config (module docstring)."""
    from transformers import AutoTokenizer, GenerationConfig

    eos = AutoTokenizer.from_pretrained(tokenizer_dir).eos_token_id
    ids = set() if eos is None else {int(eos)}
    with contextlib.suppress(OSError, ValueError):  # no generation_config.json: the tokenizer's EOS is all there is
        gen_eos = GenerationConfig.from_pretrained(model_dir).eos_token_id
        ids.update([gen_eos] if isinstance(gen_eos, int) else (gen_eos or []))
    return ids
