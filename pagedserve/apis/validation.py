"""A pydantic refusal of another API's body, told the client the way the server tells it: the
field as the client wrote it (``messages[0].content[1].text``), without the union members pydantic
tried (``list[...]``, ``str``, a tag's class name), and what is wrong with it. For the gateway,
which validates these bodies itself (it cannot use the server's handlers)."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

_TYPE_NAMES = {"str", "int", "float", "bool", "none", "list", "dict"}


def field_path(loc: tuple[Any, ...]) -> str | None:
    parts: list[str] = []
    for item in loc:
        if isinstance(item, int):
            parts.append(f"[{item}]")
        elif any(c in str(item) for c in "[]()-") or str(item) in _TYPE_NAMES:
            continue
        else:
            parts.append(("." if parts else "") + str(item))
    return "".join(parts) or None


def first_problem(exc: ValidationError) -> tuple[str | None, str]:
    """``(field, message)`` of the complaint to fix first: not a union member's type mismatch ("should
    be a valid string", where a list was sent and an element of it is what is wrong), the deepest."""
    errs = exc.errors()
    if not errs:
        return None, "Invalid request."
    if any(e.get("type") == "json_invalid" for e in errs):
        return None, "The request body is not valid JSON; send a JSON object."
    about_values = [e for e in errs if not str(e.get("type", "")).endswith("_type")] or errs
    e = max(about_values, key=lambda e: len(e.get("loc", ())))
    where = field_path(tuple(e.get("loc", ())))
    what = "is not a supported field; remove it" if e.get("type") == "extra_forbidden" else \
        str(e.get("msg", "is invalid")).removeprefix("Value error, ")
    what = what[:1].lower() + what[1:]
    return where, f"Invalid request: '{where}' {what}." if where else f"Invalid request: {what}."
