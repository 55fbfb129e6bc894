"""The answers of a long benchmark run, kept on disk as they come, so the run can stop and resume.

A needle run at ≥ 100 needles per cell and four context lengths is hours of prefill on a 2-core
machine. Each answered haystack appends its records (one JSON line per needle) to a journal; a
run given the same journal skips the haystacks it already holds and answers the rest. The first
line records the run's settings, including a digest of every prompt, so a journal is only ever
resumed by the run that wrote it (another corpus, tokenizer or seed is a one-line error).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path


def settings_digest(settings: dict) -> str:
    """A short stable name for a run's settings (the default journal's file name)."""
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]


def prompts_digest(prompts: list[list[int]]) -> str:
    h = hashlib.sha256()
    for p in prompts:
        h.update(json.dumps(p).encode())
    return h.hexdigest()[:16]


class Journal:
    """Records keyed by (variant, unit): ``done`` says whether a unit was answered for a variant,
    ``add`` appends its records (and flushes: a killed run loses at most the unit in flight).
    ``path`` None keeps them in memory only."""

    def __init__(self, path: Path | None, settings: dict):
        self.path = path
        self._units: dict[tuple[str, int], list[dict]] = {}  # complete units only
        if path is None:
            return
        if path.exists() and path.stat().st_size:
            lines = path.read_text().splitlines()
            header = json.loads(lines[0])
            if header.get("settings") != json.loads(json.dumps(settings)):
                raise ValueError(f"{path} was written by a run with other settings; give another --journal "
                                 f"or delete it")
            # A unit's records run from its unit_start to its unit_complete line; a unit cut short by
            # a killed run (or its half-written last line) is dropped, and answered again.
            pending: dict[tuple[str, int], list[dict]] = {}
            for line in lines[1:]:
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    continue
                key = (rec["variant"], rec["unit"])
                if rec.get("unit_start"):
                    pending[key] = []
                pending.setdefault(key, []).append(rec)
                if rec.get("unit_complete"):
                    self._units[key] = pending.pop(key)
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps({"settings": settings}) + "\n")

    @property
    def records(self) -> list[dict]:
        """Every record of the complete units, in the order they were answered."""
        return [r for unit in self._units.values() for r in unit]

    def done(self, variant: str, unit: int) -> bool:
        return (variant, unit) in self._units

    def add(self, variant: str, unit: int, records: list[dict]) -> None:
        """One unit's records (at least one), written at once and flushed."""
        if not records:
            raise ValueError("a unit has at least one record")
        records = [{**r, "variant": variant, "unit": unit} for r in records]
        records[0]["unit_start"] = True
        records[-1]["unit_complete"] = True
        if self.path is not None:
            with self.path.open("a") as f:
                f.write("".join(json.dumps(r) + "\n" for r in records))
        self._units[(variant, unit)] = records
