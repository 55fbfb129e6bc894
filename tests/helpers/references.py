"""transformers' side of a parity test, kept once per machine in the project cache: it depends only
on a model file, what the test asks of it and the library versions, and recomputing it costs
seconds to minutes per run (transformers' GGUF loader re-parses the file for every module)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any


def reference_path(name: str, model_file: Path, format: int, suffix: str = "", **what: Any) -> Path:
    """``$PAGEDSERVE_CACHE/test-references/<name>-<key><suffix>``, the key covering the file's bytes,
    ``what`` (JSON-serializable: prompts, steps), the transformers and torch versions and ``format``
    (bump it when the stored form changes). :func:`build_once` writes it."""
    import torch
    import transformers

    from pagedserve.config import cache_dir

    file_hash = hashlib.sha256()
    with open(model_file, "rb") as f:
        while chunk := f.read(1 << 24):
            file_hash.update(chunk)
    key = {"file": file_hash.hexdigest(), **what, "transformers": transformers.__version__,
           "torch": torch.__version__, "format": format}
    digest = hashlib.sha256(json.dumps(key).encode()).hexdigest()[:16]
    path = cache_dir() / "test-references" / f"{name}-{digest}{suffix}"
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def build_once(path: Path, write: Callable[[Path], None]) -> Path:
    """``path``, made by ``write(tmp)`` when absent: under the project cache's build lock, so two test
    processes do not both build it, and renamed into place, so no reader sees half of it."""
    from pagedserve.models.standard import _build_lock

    with _build_lock(path):
        if not path.exists():
            tmp = path.with_name(path.name + f".tmp{os.getpid()}")
            shutil.rmtree(tmp, ignore_errors=True)  # a directory a killed build left
            write(tmp)
            tmp.rename(path)
    return path
