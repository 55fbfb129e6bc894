"""Chat templates rendered without transformers, the way its ``apply_chat_template`` renders them.

A model's chat template is Jinja from the Hub, so it runs in jinja2's immutable sandbox with what
the templates expect of transformers' environment: ``trim_blocks`` and ``lstrip_blocks``, the
``loopcontrols`` extension, a ``{% generation %}`` block (which marks assistant text for training
masks and renders its body unchanged here), ``raise_exception(msg)``, ``strftime_now(fmt)``, a
``tojson`` filter that keeps non-ASCII characters (Jinja's own escapes them, and HTML characters,
which would change the prompt), and ``dict`` / ``namespace`` that cannot reach Python internals.

What the template sees: ``messages`` (each a plain dict, keys whose value is None dropped, the
reasoning text under ``reasoning_content`` and ``thinking`` alike), ``tools``, ``documents``,
``add_generation_prompt``, the tokenizer's named special tokens (``bos_token``, ``eos_token``, ...)
and any extra keyword arguments, which override the special tokens.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

# The names a message's reasoning may come under; templates read the first (gpt-oss ones, "thinking").
_REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")
# Marks the end of the final message with continue_final_message, to cut the rendered text there.
_CONTINUE_MARK = "CONTINUE_FINAL_MESSAGE_TAG "


class _GenerationBlock(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: renders its body (only training code needs the span)."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    @staticmethod
    def _render(caller: Any) -> str:
        return caller()


class _Dict:
    """``dict(...)`` in a template: builds a dict, with nothing else of the type reachable."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any) -> dict:
        return dict.fromkeys(*args)


class _Namespace(jinja2.utils.Namespace):
    """``namespace(...)`` that refuses attribute names starting with an underscore."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # jinja2's signature: self may be a keyword too
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a chat template may not set the namespace attribute {name!r}")


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def template_environment() -> ImmutableSandboxedEnvironment:
    """A fresh sandboxed environment with the globals and filters chat templates use."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _Dict()
    env.globals["namespace"] = _Namespace
    return env


def plain_data(value: Any) -> Any:
    """``value`` rebuilt from plain JSON types (what a sandboxed template may safely touch); other
    objects become a ``<TypeName>`` placeholder."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {plain_data(k): plain_data(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain_data(v) for v in value]
    if isinstance(value, tuple):
        return tuple(plain_data(v) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain_data(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):  # pydantic models
        return plain_data(value.model_dump())
    return f"<{type(value).__name__}>"


def _normalize_message(message: Any) -> dict[str, Any]:
    if callable(getattr(message, "model_dump", None)):
        message = message.model_dump()
    elif dataclasses.is_dataclass(message) and not isinstance(message, type):
        message = {f.name: getattr(message, f.name) for f in dataclasses.fields(message)}
    if not isinstance(message, Mapping):
        raise TypeError(f"chat messages must be dicts, got {message!r}")
    # Keys set to None are left out: templates test for a key's presence, and would print "None".
    out = plain_data({k: v for k, v in message.items() if v is not None})
    reasoning = next((out[k] for k in _REASONING_KEYS if out.get(k) is not None), None)
    if reasoning is not None:
        out = {"thinking": reasoning, **out, "reasoning_content": reasoning}
    return out


def render(template: jinja2.Template, template_source: str, messages: list[Any], *,
           special_tokens: Mapping[str, str], add_generation_prompt: bool = False,
           tools: list[dict] | None = None, documents: list[dict] | None = None,
           continue_final_message: bool | str = False, **kwargs: Any) -> str:
    """Render one conversation with a compiled chat ``template`` (``template_source`` is its text,
    which continue_final_message checks for the field it continues)."""
    if not messages:
        raise ValueError("cannot apply a chat template to an empty conversation")
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message and add_generation_prompt cannot both be set")
    if tools is not None and not all(isinstance(t, dict) for t in tools):
        raise ValueError("tools must be JSON schemas (dicts)")
    if documents is not None and not all(isinstance(d, dict) for d in documents):
        raise TypeError("documents must be dicts (with 'title' and 'text' keys)")
    chat = [_normalize_message(m) for m in messages]
    final = None
    if continue_final_message:
        field = continue_final_message if isinstance(continue_final_message, str) else "content"
        final = chat[-1].get(field)
        if not isinstance(final, str):
            raise ValueError(f"continue_final_message is set but the final message has no text {field!r} to continue")
        fields = [field]
        if field in _REASONING_KEYS:  # the reasoning is under several names: mark every copy
            fields = [k for k in _REASONING_KEYS if chat[-1].get(k) == final]
        if not any(f in template_source for f in fields):
            raise ValueError(f"continue_final_message is set to {field!r}, which the chat template does not read")
        for f in fields:
            chat[-1][f] = chat[-1][f] + _CONTINUE_MARK
    variables = {**special_tokens, **plain_data(kwargs)}
    text = template.render(messages=chat, tools=plain_data(tools), documents=plain_data(documents),
                           add_generation_prompt=add_generation_prompt, **variables)
    if final is not None:
        mark = _CONTINUE_MARK.strip()
        if final.strip() not in text or mark not in text:
            raise ValueError("continue_final_message is set but the chat template dropped part of the final message")
        at = text.rindex(mark)
        text = text[:at] if text[at:at + len(_CONTINUE_MARK)] == _CONTINUE_MARK else text[:at].rstrip()
    return text
