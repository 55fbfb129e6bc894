"""A served model's tokenizer without transformers (and so without torch): :func:`load_tokenizer`.

Importing transformers' tokenizer code costs a process about 5 s of CPU (its configuration
modules import torch), which every ``pagedserve serve`` front paid at start-up although it only
tokenizes, detokenizes and renders chat templates. :class:`FastTokenizer` does those from the
model directory's files, the way transformers 5's ``AutoTokenizer`` (a ``TokenizersBackend``)
does them:

- ``tokenizer.json`` through the ``tokenizers`` library (the same Rust code transformers runs);
- ``tokenizer_config.json``: the named special tokens (``bos_token`` ... ``mask_token``, other
  ``*_token`` keys, ``extra_special_tokens`` / ``additional_special_tokens``), ``added_tokens_decoder``,
  ``clean_up_tokenization_spaces``, ``split_special_tokens`` and ``chat_template``. With a
  ``tokenizer.json``, transformers 5 ignores ``add_bos_token`` / ``add_eos_token`` (the file's
  post-processor decides), and so does this;
- ``chat_template.jinja`` and ``additional_chat_templates/*.jinja``, which take priority over the
  config's template (transformers' tokenizers do not read ``chat_template.json``, a processor file);
- chat templates rendered by :mod:`pagedserve.chat_templates`.

Whatever it cannot reproduce with certainty (no ``tokenizer.json``, a tokenizer class of its own,
a model type for which transformers substitutes its own class, remote code, legacy
``special_tokens_map.json``/``added_tokens.json`` files, a vocabulary over 100k tokens that
transformers may patch), :func:`load_tokenizer` loads with ``AutoTokenizer`` instead and logs one
line saying why. tests/test_tokenizer_parity.py holds the two to identical ids, text, vocabulary,
special ids and rendered templates on every model directory the suite uses.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Tokenizer, processors

logger = logging.getLogger(__name__)

# transformers' named special tokens, in its order (all_special_tokens and the template variables follow it).
SPECIAL_TOKEN_ATTRIBUTES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# Tokenizer classes that transformers 5 loads as a plain TokenizersBackend from tokenizer.json.
_PLAIN_CLASSES = {"TokenizersBackend", "PreTrainedTokenizerFast"}
# Model types (config.json) for which AutoTokenizer keeps the hub's TokenizersBackend class. For
# others (qwen2, phi3, ...) it may substitute a class of its own that rebuilds the backend.
_PLAIN_MODEL_TYPES = {"llama", "mistral", "qwen3"}
# Above this, transformers may rewrite a (Mistral) pre-tokenizer's regex at load.
_MAX_PLAIN_VOCAB = 100_000


class UnsupportedTokenizer(Exception):
    """The directory needs transformers' own loading to be reproduced exactly (the message says why)."""


def load_tokenizer(source: str, chat_template: str | None = None, preload: TokenizerPreload | None = None) -> Any:
    """The tokenizer of ``source`` (a model or tokenizer directory, or a hub id): a
    :class:`FastTokenizer` where it reproduces transformers' exactly, else transformers'
    ``AutoTokenizer``. ``chat_template`` (``serve --chat-template``) replaces the tokenizer's own.
    ``preload``: take an instance loaded ahead of time from there, if it loaded this source."""
    tokenizer: Any = preload.take(source) if preload is not None else None
    if tokenizer is None:
        try:
            tokenizer = FastTokenizer.from_dir(source)
        except UnsupportedTokenizer as why:
            logger.info("tokenizer of %s: loading transformers' AutoTokenizer (%s)", source, why)
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(source)
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    return tokenizer


def _directory_key(source: str | None) -> Path | None:
    if source is None:
        return None
    path = Path(source).expanduser()
    return path.resolve() if path.is_dir() else None


class TokenizerPreload:
    """``count`` tokenizers of a directory, loaded on a thread while the caller waits for something
    else: a front end waits seconds for its core to load the model, and loading its tokenizers only
    after that would add tenths of a second each to its start. :meth:`take` hands one out for the
    same directory (each to one thread only, as always), else None and the caller loads its own."""

    def __init__(self, source: str | None, count: int = 2):
        self._key = _directory_key(source)
        self._loaded: concurrent.futures.Future[list[FastTokenizer]] | None = None
        if self._key is not None:
            pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagedserve-tok-preload")
            self._loaded = pool.submit(self._load, str(self._key), count)
            pool.shutdown(wait=False)

    @staticmethod
    def _load(directory: str, count: int) -> list[FastTokenizer]:
        try:
            return [FastTokenizer.from_dir(directory) for _ in range(count)]
        except UnsupportedTokenizer:
            return []  # load_tokenizer loads transformers' (and says why) when it is asked

    def take(self, source: str) -> FastTokenizer | None:
        if self._loaded is None or _directory_key(source) != self._key:
            return None
        instances = self._loaded.result()
        return instances.pop() if instances else None  # list.pop is atomic: callers on two threads


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise UnsupportedTokenizer(f"cannot read {path.name}: {exc}") from None
    if not isinstance(data, dict):
        raise UnsupportedTokenizer(f"{path.name} is not a JSON object")
    return data


def _added_token(value: Any, what: str) -> AddedToken:
    """An AddedToken from its tokenizer_config.json form (``{"__type": "AddedToken", ...}``)."""
    fields = {k: v for k, v in value.items() if k != "__type"}
    try:
        return AddedToken(**fields)
    except TypeError as exc:
        raise UnsupportedTokenizer(f"{what}: {exc}") from None


def _special_value(value: Any, what: str) -> str | AddedToken:
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and value.get("__type") == "AddedToken":
        return _added_token(value, what)
    raise UnsupportedTokenizer(f"{what} is neither a string nor an AddedToken")


def _check_plain(directory: Path, config: dict[str, Any]) -> None:
    """Raise UnsupportedTokenizer where AutoTokenizer would not load a plain TokenizersBackend."""
    cls = config.get("tokenizer_class")
    if cls not in _PLAIN_CLASSES:
        raise UnsupportedTokenizer(f"tokenizer_class {cls!r} is not a plain TokenizersBackend")
    for key in ("auto_map", "fast_tokenizer_files"):
        if key in config:
            raise UnsupportedTokenizer(f"tokenizer_config.json has {key!r}")
    if "added_tokens_decoder" not in config:
        for legacy in ("special_tokens_map.json", "added_tokens.json"):
            if (directory / legacy).exists():
                raise UnsupportedTokenizer(f"legacy {legacy} without added_tokens_decoder")
    model_config = directory / "config.json"
    if model_config.exists():
        model_type = _read_json(model_config).get("model_type")
        if model_type is not None and model_type not in _PLAIN_MODEL_TYPES:
            raise UnsupportedTokenizer(f"model_type {model_type!r} may get a tokenizer class of its own")
    if (directory / "tekken.json").exists():
        raise UnsupportedTokenizer("a Mistral tekken.json")


def _chat_templates(directory: Path, config: dict[str, Any]) -> str | dict[str, str] | None:
    """The chat template(s) as transformers loads them: template files over the config's entry."""
    files: dict[str, str] = {}
    default = directory / "chat_template.jinja"
    if default.is_file():
        files["default"] = default.read_text(encoding="utf-8")
    extra = directory / "additional_chat_templates"
    if extra.is_dir():
        for path in sorted(extra.glob("*.jinja")):
            files[path.name.removesuffix(".jinja")] = path.read_text(encoding="utf-8")
    if files:
        return files["default"] if list(files) == ["default"] else files
    template = config.get("chat_template")
    if isinstance(template, (list, tuple)):  # [{"name": ..., "template": ...}, ...]
        return {t["name"]: t["template"] for t in template}
    return template


class FastTokenizer:
    """The subset of transformers' tokenizer API that pagedserve uses, on a ``tokenizers.Tokenizer``.

    ``_tokenizer`` (also ``backend_tokenizer``) is the Rust tokenizer itself, as in transformers:
    the server's hot paths call its ``encode_batch`` / ``decode`` directly. Not thread-safe (the
    Rust tokenizer is not either): each thread that tokenizes has its own instance.
    """

    def __init__(self, backend: Tokenizer, config: Mapping[str, Any], chat_template: str | dict[str, str] | None,
                 name_or_path: str = ""):
        self._tokenizer = backend
        self.name_or_path = name_or_path
        self.chat_template = chat_template
        self.clean_up_tokenization_spaces = bool(config.get("clean_up_tokenization_spaces", False))
        self._clean_up_bpe_anyway = bool(
            config.get("clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False))
        self.model_max_length = config.get("model_max_length")
        self._special: dict[str, str | AddedToken] = {}  # named special tokens, in transformers' order
        self._extra_special: list[str | AddedToken] = []
        self._compiled: dict[str, Any] = {}  # template text -> compiled jinja2 template
        self._added = self._read_added_tokens(config)
        self._read_special_tokens(config)
        self._add_tokens()
        if backend.post_processor is None:  # transformers installs a template adding nothing
            backend.post_processor = processors.TemplateProcessing(single="$A:0", pair="$A:0 $B:1",
                                                                   special_tokens=[])
        backend.encode_special_tokens = bool(config.get("split_special_tokens", False))

    @classmethod
    def from_dir(cls, source: str | Path) -> FastTokenizer:
        """Load from a directory; UnsupportedTokenizer where only transformers can reproduce it."""
        directory = Path(source)
        if not directory.is_dir():
            raise UnsupportedTokenizer("not a local directory")
        tokenizer_json = directory / "tokenizer.json"
        config_path = directory / "tokenizer_config.json"
        if not tokenizer_json.is_file():
            raise UnsupportedTokenizer("no tokenizer.json (a slow tokenizer)")
        if not config_path.is_file():
            raise UnsupportedTokenizer("no tokenizer_config.json")
        config = _read_json(config_path)
        _check_plain(directory, config)
        try:
            backend = Tokenizer.from_file(str(tokenizer_json))
        except Exception as exc:  # noqa: BLE001 - the Rust side raises plain Exception
            raise UnsupportedTokenizer(f"tokenizers cannot read tokenizer.json: {exc}") from None
        if backend.get_vocab_size(with_added_tokens=False) > _MAX_PLAIN_VOCAB and backend.pre_tokenizer is not None:
            raise UnsupportedTokenizer(f"a vocabulary over {_MAX_PLAIN_VOCAB:,} tokens")
        return cls(backend, config, _chat_templates(directory, config), str(source))

    # ---- loading ---------------------------------------------------------------------------

    def _read_special_tokens(self, config: Mapping[str, Any]) -> None:
        added = {str(t): t for _, t in self._added}
        for key in SPECIAL_TOKEN_ATTRIBUTES:
            if config.get(key) is not None:
                value = _special_value(config[key], key)
                # A named token that is also an added token takes the added token's properties.
                self._special[key] = added.get(str(value), value)
        # Other *_token strings are model-specific named special tokens (image_token, ...).
        for key, value in config.items():
            if key.endswith("_token") and key not in SPECIAL_TOKEN_ATTRIBUTES:
                if isinstance(value, dict):
                    raise UnsupportedTokenizer(f"{key} is an AddedToken (its order among special tokens differs)")
                if isinstance(value, str):
                    self._special[key] = value
        extra = config.get("extra_special_tokens") or config.get("additional_special_tokens")
        if isinstance(extra, dict):
            for key, value in extra.items():
                self._special[key] = _special_value(value, f"extra_special_tokens.{key}")
        elif isinstance(extra, (list, tuple)):
            self._extra_special = [_special_value(v, "extra_special_tokens") for v in extra]
        elif extra is not None:
            raise UnsupportedTokenizer("extra_special_tokens is neither a list nor a dict")

    def _read_added_tokens(self, config: Mapping[str, Any]) -> list[tuple[int, AddedToken]]:
        """The config's added_tokens_decoder by id; without one, transformers takes tokenizer.json's."""
        decoder = config.get("added_tokens_decoder")
        if decoder is None:
            return sorted(self._tokenizer.get_added_tokens_decoder().items())
        try:
            ordered = sorted(((int(i), t) for i, t in decoder.items()), key=lambda it: it[0])
        except (TypeError, ValueError):
            raise UnsupportedTokenizer("added_tokens_decoder has a non-integer id") from None
        return [(i, _added_token(t, f"added_tokens_decoder[{i}]")) for i, t in ordered]

    def _add_tokens(self) -> None:
        """Register the config's added tokens and any special token the backend lacks, as
        transformers does at load (the same ``add_tokens`` call on the same Rust tokenizer)."""
        to_add: list[Any] = [t for _, t in self._added]
        known = [t.content for t in self._tokenizer.get_added_tokens_decoder().values()]
        known += [str(t) for t in to_add]
        for value in [*self._special.values(), *self._extra_special]:
            if str(value) not in known and value not in to_add:
                to_add.append(value)
        if not to_add:
            return
        named = {str(v) for v in self._special.values()}
        tokens = []
        for token in to_add:
            if isinstance(token, str):
                token = AddedToken(token, special=True)
            elif not token.special and str(token) in named:
                token.special = True
            tokens.append(token)
        self._tokenizer.add_tokens(tokens)

    # ---- vocabulary and special tokens -----------------------------------------------------

    @property
    def backend_tokenizer(self) -> Tokenizer:
        return self._tokenizer

    @property
    def is_fast(self) -> bool:
        return True

    def __len__(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def vocab_size(self) -> int:
        """The base vocabulary, without added tokens (as transformers' ``vocab_size``)."""
        return self._tokenizer.get_vocab_size(with_added_tokens=False)

    def get_vocab(self) -> dict[str, int]:
        return self._tokenizer.get_vocab(with_added_tokens=True)

    def get_added_vocab(self) -> dict[str, int]:
        return {t.content: i for i, t in sorted(self._tokenizer.get_added_tokens_decoder().items())}

    def convert_tokens_to_ids(self, tokens: str | Sequence[str]) -> int | None | list[int | None]:
        if isinstance(tokens, str):
            index = self._tokenizer.token_to_id(tokens)
            return index if index is not None else self.unk_token_id
        return [self.convert_tokens_to_ids(t) for t in tokens]  # type: ignore[misc]

    def convert_ids_to_tokens(self, ids: int | Sequence[int], skip_special_tokens: bool = False) -> Any:
        if isinstance(ids, int):
            return self._tokenizer.id_to_token(ids)
        special = set(self.all_special_ids) if skip_special_tokens else set()
        return [self._tokenizer.id_to_token(i) for i in ids if i not in special]

    def _named(self, key: str) -> str | None:
        value = self._special.get(key)
        return None if value is None else str(value)

    def _named_id(self, key: str) -> int | None:
        token = self._named(key)
        return None if token is None else self.convert_tokens_to_ids(token)  # type: ignore[return-value]

    bos_token = property(lambda self: self._named("bos_token"))
    eos_token = property(lambda self: self._named("eos_token"))
    unk_token = property(lambda self: self._named("unk_token"))
    sep_token = property(lambda self: self._named("sep_token"))
    pad_token = property(lambda self: self._named("pad_token"))
    cls_token = property(lambda self: self._named("cls_token"))
    mask_token = property(lambda self: self._named("mask_token"))
    bos_token_id = property(lambda self: self._named_id("bos_token"))
    eos_token_id = property(lambda self: self._named_id("eos_token"))
    unk_token_id = property(lambda self: self._named_id("unk_token"))
    sep_token_id = property(lambda self: self._named_id("sep_token"))
    pad_token_id = property(lambda self: self._named_id("pad_token"))
    cls_token_id = property(lambda self: self._named_id("cls_token"))
    mask_token_id = property(lambda self: self._named_id("mask_token"))

    @property
    def special_tokens_map(self) -> dict[str, str]:
        """The named special tokens (model-specific ones included), as strings: the chat template sees these."""
        return {k: str(v) for k, v in self._special.items()}

    @property
    def extra_special_tokens(self) -> list[str]:
        return [str(t) for t in self._extra_special]

    @property
    def all_special_tokens(self) -> list[str]:
        """Named then extra special tokens, each once."""
        seen: dict[str, None] = {}
        for token in [*self._special.values(), *self._extra_special]:
            seen.setdefault(str(token))
        return list(seen)

    @property
    def all_special_ids(self) -> list[int]:
        return self.convert_tokens_to_ids(self.all_special_tokens)  # type: ignore[return-value]

    # ---- encode / decode -------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def __call__(self, text: str | list[str], add_special_tokens: bool = True) -> dict[str, Any]:
        """``{"input_ids", "attention_mask"}`` of one text (lists) or several (lists of lists)."""
        if isinstance(text, str):
            enc = self._tokenizer.encode(text, add_special_tokens=add_special_tokens)
            return {"input_ids": enc.ids, "attention_mask": enc.attention_mask}
        encs = self._tokenizer.encode_batch(list(text), add_special_tokens=add_special_tokens)
        return {"input_ids": [e.ids for e in encs], "attention_mask": [e.attention_mask for e in encs]}

    def decode(self, ids: int | Sequence[int], skip_special_tokens: bool = False,
               clean_up_tokenization_spaces: bool | None = None) -> str:
        if isinstance(ids, int):
            ids = [ids]
        text = self._tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)
        clean = self.clean_up_tokenization_spaces if clean_up_tokenization_spaces is None else clean_up_tokenization_spaces
        # transformers skips the clean-up for BPE models, where it would eat real spaces.
        if clean and (type(self._tokenizer.model).__name__ != "BPE" or self._clean_up_bpe_anyway):
            text = _clean_up_tokenization(text)
        return text

    def batch_decode(self, sequences: Sequence[Sequence[int]], skip_special_tokens: bool = False) -> list[str]:
        return [self.decode(s, skip_special_tokens=skip_special_tokens) for s in sequences]

    # ---- chat templates --------------------------------------------------------------------

    def get_chat_template(self, chat_template: str | None = None, tools: list[dict] | None = None) -> str:
        """The template text to render: a name or text passed in, else the tokenizer's (the
        ``tool_use`` one of several when there are tools, else ``default``)."""
        if isinstance(self.chat_template, dict):
            templates = self.chat_template
            if chat_template is not None and chat_template in templates:
                return templates[chat_template]
            if chat_template is None:
                if tools is not None and "tool_use" in templates:
                    return templates["tool_use"]
                if "default" in templates:
                    return templates["default"]
                raise ValueError("this model has several chat templates and none is named 'default'; pass one of "
                                 f"{sorted(templates)} as chat_template")
            return chat_template
        if chat_template is not None:
            return chat_template
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat template (tokenizer.chat_template is not set)")
        return self.chat_template

    def _compile(self, source: str) -> Any:
        compiled = self._compiled.get(source)
        if compiled is None:
            from pagedserve.chat_templates import template_environment

            compiled = self._compiled[source] = template_environment().from_string(source)
        return compiled

    def apply_chat_template(self, conversation: Sequence[Any], tools: list[dict] | None = None,
                            documents: list[dict] | None = None, chat_template: str | None = None,
                            add_generation_prompt: bool = False, continue_final_message: bool | str = False,
                            tokenize: bool = True, return_dict: bool = True, **kwargs: Any) -> Any:
        """Render one conversation: its text with ``tokenize=False``, else its ids (special tokens
        not added) as ``{"input_ids", "attention_mask"}``, or a plain list with ``return_dict=False``."""
        from pagedserve.chat_templates import render

        for unsupported in ("return_tensors", "return_assistant_tokens_mask", "padding",
                            "truncation", "max_length", "tokenizer_kwargs", "sanitize_control_tokens"):
            if kwargs.pop(unsupported, None):
                raise ValueError(f"apply_chat_template({unsupported}=...) is not supported by pagedserve's tokenizer")
        source = self.get_chat_template(chat_template, tools)
        if conversation and isinstance(conversation[0], (list, tuple)):
            raise ValueError("pass one conversation at a time")
        text = render(self._compile(source), source, list(conversation), special_tokens=self.special_tokens_map,
                      add_generation_prompt=add_generation_prompt, tools=tools, documents=documents,
                      continue_final_message=continue_final_message, **kwargs)
        if not tokenize:
            return text
        return self(text, add_special_tokens=False) if return_dict else self.encode(text, add_special_tokens=False)

    def __repr__(self) -> str:
        return f"FastTokenizer({self.name_or_path!r}, vocab={len(self)})"


def _clean_up_tokenization(text: str) -> str:
    """transformers' clean_up_tokenization_spaces: no space before punctuation and English contractions."""
    for spaced, joined in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                           (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(spaced, joined)
    return text
