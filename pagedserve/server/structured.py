"""The request's structured-output fields → one engine-level :class:`StructuredOutputsParams`.

OpenAI's ``response_format``, vLLM's ``structured_outputs`` and its older ``guided_*`` fields all
say the same thing; a request may use one of them (two constraints cannot both hold). A tool
choice of ``required`` or a named function is a constraint too: a JSON schema of the call
(:func:`tool_call_spec`), so even a random-weight model returns a call that parses.

The JSON the server asks for itself (a forced call) is generated compactly: no whitespace between
tokens (:func:`compact_json_spec`), so the whole output budget goes to the call and a random model
closes it within a few dozen tokens. A client's ``response_format`` keeps the engine's bounded
whitespace (at most 16 characters in one place), which a model trained to pretty-print may use.
"""

from __future__ import annotations

import json
from typing import Any

from pagedserve import errors
from pagedserve.engine.sampling_params import MAX_GRAMMAR_CHARS, StructuredOutputsParams
from pagedserve.server import protocol as p

# A function without a parameters schema takes any JSON object.
ANY_OBJECT: dict[str, Any] = {"type": "object"}


def _params(param: str, **fields: Any) -> StructuredOutputsParams:
    """Build the engine's params, blaming ``param`` (the field the client sent) for what is wrong."""
    if isinstance(fields.get("json"), dict):
        text = json.dumps(fields["json"], ensure_ascii=False, separators=(",", ":"))
        if len(text) > MAX_GRAMMAR_CHARS:
            raise errors.InvalidRequest(f"{param}: the JSON schema is {len(text)} characters as JSON, over the "
                                        f"limit of {MAX_GRAMMAR_CHARS}.", param=param)
        fields["json"] = text
    try:
        spec = StructuredOutputsParams(**fields)
        spec.validate()  # here, once, so the error names the field the client sent
        return spec
    except errors.InvalidRequest as exc:
        raise errors.InvalidRequest(exc.message.replace("structured_outputs", param), param=param) from None


def requested_spec(req: p.SamplingFields) -> tuple[StructuredOutputsParams | None, str | None]:
    """The one constraint the request's fields ask for, and the field it came from."""
    found: list[tuple[str, StructuredOutputsParams]] = []
    rf = req.response_format
    if rf is not None and rf.type == "json_object":
        found.append(("response_format", _params("response_format", json_object=True)))
    elif rf is not None and rf.type == "json_schema":
        if rf.json_schema is None or rf.json_schema.schema_ is None:
            raise errors.InvalidRequest("response_format of type json_schema needs json_schema.schema.",
                                        param="response_format.json_schema")
        found.append(("response_format.json_schema",
                      _params("response_format.json_schema", json=rf.json_schema.schema_)))
    elif rf is not None and rf.json_schema is not None:
        raise errors.InvalidRequest("response_format.json_schema is only allowed with type json_schema.",
                                    param="response_format.json_schema")
    so = req.structured_outputs
    if so is not None:
        fields = {k: v for k, v in (("json", so.json_), ("regex", so.regex), ("choice", so.choice),
                                    ("grammar", so.grammar)) if v is not None}
        if so.json_object:
            fields["json_object"] = True
        found.append(("structured_outputs", _params("structured_outputs", **fields)))
    for name, kind in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                       ("guided_grammar", "grammar")):
        value = getattr(req, name)
        if value is not None:
            found.append((name, _params(name, **{kind: value})))
    if len(found) > 1:
        raise errors.InvalidRequest(f"Only one output constraint per request: got {', '.join(n for n, _ in found)}.",
                                    param=found[1][0])
    return (found[0][1], found[0][0]) if found else (None, None)


# xgrammar (0.2.9) lets a string with maxLength / minLength hold raw control characters, which JSON
# forbids; the engine closes the class for the schemas it compiles, and so does the grammar here.
_LOOSE_JSON_CHAR = r'[^\"\\\r\n]'
_STRICT_JSON_CHAR = r'[^\0-\x1f\"\\\r\n]'


def compact_json_spec(spec: StructuredOutputsParams) -> StructuredOutputsParams:
    """``spec``'s JSON schema as an EBNF grammar without free whitespace (xgrammar's own conversion,
    on the tokenizer worker's thread: it loads xgrammar, as the schema check does); the schema
    itself when that grammar would be over the size bound."""
    import xgrammar as xgr

    assert spec.json is not None
    text = str(xgr.Grammar.from_json_schema(spec.json, any_whitespace=False, separators=(",", ":")))
    text = text.replace(_LOOSE_JSON_CHAR, _STRICT_JSON_CHAR)
    if len(text) > MAX_GRAMMAR_CHARS:
        return spec
    return StructuredOutputsParams(grammar=text)


def _arguments_schema(tool: p.Tool) -> dict[str, Any]:
    return tool.function.parameters if tool.function.parameters is not None else ANY_OBJECT


def tool_call_spec(tools: list[p.Tool], choice: str | p.NamedToolChoice,
                   parallel: bool | None) -> StructuredOutputsParams:
    """The constraint for ``tool_choice`` ``required`` or a named function.

    Named: the output is the function's arguments (an object of its ``parameters`` schema).
    Required: a JSON array of ``{"name": ..., "arguments": {...}}`` objects, one or more (exactly
    one with ``parallel_tool_calls: false``), each naming one of the tools.
    """
    if isinstance(choice, p.NamedToolChoice):
        tool = next(t for t in tools if t.function.name == choice.function.name)
        return _params("tools", json=_arguments_schema(tool))
    calls = [{"type": "object", "properties": {"name": {"const": t.function.name}, "arguments": _arguments_schema(t)},
              "required": ["name", "arguments"], "additionalProperties": False} for t in tools]
    schema: dict[str, Any] = {"type": "array", "items": calls[0] if len(calls) == 1 else {"anyOf": calls},
                              "minItems": 1}
    if parallel is False:
        schema["maxItems"] = 1
    return _params("tools", json=schema)
