"""Fixtures shared by the model tests."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_ggufs(tiny_model_dir, tmp_path_factory):
    """``tiny_ggufs(kind)`` → the standard tiny model written as a GGUF of that tensor type (each file
    written once per session: quantizing in Python takes seconds)."""
    from tests.models.gguf_files import write_gguf

    out = tmp_path_factory.mktemp("gguf")
    made: dict[str, Path] = {}

    def get(kind: str, source: Path = tiny_model_dir, tag: str = "tiny", tokenizer: bool = False) -> Path:
        key = f"{tag}-{kind}-{tokenizer}"
        if key not in made:
            made[key] = write_gguf(source, out / f"{key}.gguf", kind, tokenizer=tokenizer)
        return made[key]

    return get
