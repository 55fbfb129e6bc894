"""Which architecture class reads a config: the Llama family's or Gemma 3's, by ``model_type``."""

from __future__ import annotations

from pagedserve.models.gemma3 import MODEL_TYPE as GEMMA3, Gemma3Architecture
from pagedserve.models.llama import ModelArchitecture


def architecture_from_hf_config(cfg) -> ModelArchitecture:
    """The model's shape from its config: :class:`Gemma3Architecture` for ``gemma3_text``, else
    :class:`ModelArchitecture` (which refuses a model type it does not know, in one line)."""
    cls = Gemma3Architecture if getattr(cfg, "model_type", None) == GEMMA3 else ModelArchitecture
    return cls.from_hf_config(cfg)
