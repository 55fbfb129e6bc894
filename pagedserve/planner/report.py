"""Output for the planner's CLI: aligned text tables for people, JSON for scripts."""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any, Sequence


def render_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], title: str | None = None) -> str:
    """A plain-text table: a header, a rule, one line per row; numbers right-aligned."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    numeric = [all(_looks_numeric(row[i]) for row in cells[1:]) and len(cells) > 1 for i in range(len(headers))]

    def line(row: list[str]) -> str:
        return "  ".join(c.rjust(w) if num else c.ljust(w) for c, w, num in zip(row, widths, numeric)).rstrip()

    out = [title] if title else []
    out.append(line(cells[0]))
    out.append("  ".join("-" * w for w in widths))
    out.extend(line(row) for row in cells[1:])
    return "\n".join(out)


def render_pairs(pairs: Sequence[tuple[str, Any]], title: str | None = None) -> str:
    """A two-column "what: value" table."""
    return render_table(["quantity", "value"], [(k, v) for k, v in pairs], title)


def to_jsonable(value: Any) -> Any:
    """Dataclasses, tuples and floats made JSON-safe (inf and nan become null)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        out = {f.name: to_jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
        for name in dir(type(value)):  # derived properties are part of the answer too
            if isinstance(getattr(type(value), name, None), property):
                out[name] = to_jsonable(getattr(value, name))
        return out
    if isinstance(value, dict):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_jsonable(v) for v in value]
    if isinstance(value, float) and (math.isinf(value) or math.isnan(value)):
        return None
    if hasattr(value, "item") and callable(value.item):  # numpy scalars
        return to_jsonable(value.item())
    if hasattr(value, "__fspath__"):
        return str(value)
    return value


def dumps(payload: Any) -> str:
    """Pretty JSON of any planner result."""
    return json.dumps(to_jsonable(payload), indent=2, sort_keys=False)


def _looks_numeric(text: str) -> bool:
    head = text.split(" ")[0].replace(",", "").rstrip("%x")
    try:
        float(head)
    except ValueError:
        return text in ("inf", "unbounded", "-")
    return True
