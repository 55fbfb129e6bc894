"""A model directory's ``config.json`` read without transformers.

Importing transformers and building an ``AutoConfig`` costs the engine core seconds of CPU at every
start (its llama configuration module alone pulls in ``torch.distributed.tensor``), for a dozen
numbers. This module reads the file itself and fills in what a config.json may leave out with the
defaults transformers' own config classes use for the model types the engine runs (Llama,
Mistral, Qwen2, Qwen3), including transformers 5's move of ``rope_theta`` and the legacy
``rope_scaling`` into one ``rope_parameters`` dict (other model types keep exactly the keys their
file has). tests/models/test_hf_config.py checks the result against ``AutoConfig`` field by field.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# transformers' per-model-type defaults (its LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config)
# for the keys the engine reads. ``None`` marks a value derived after loading (below).
_COMMON = dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, rms_norm_eps=1e-6,
               tie_word_embeddings=False)
MODEL_TYPE_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": dict(_COMMON, vocab_size=32000, intermediate_size=11008, num_key_value_heads=None,
                  max_position_embeddings=2048, attention_bias=False, head_dim=None),
    "mistral": dict(_COMMON, vocab_size=32000, intermediate_size=14336, num_key_value_heads=8,
                    max_position_embeddings=4096 * 32, sliding_window=4096, head_dim=None),
    "qwen2": dict(_COMMON, vocab_size=151936, intermediate_size=22016, num_key_value_heads=32,
                  max_position_embeddings=32768, use_sliding_window=False, sliding_window=4096),
    "qwen3": dict(_COMMON, vocab_size=151936, intermediate_size=22016, num_key_value_heads=32, head_dim=128,
                  max_position_embeddings=32768, attention_bias=False, use_sliding_window=False,
                  sliding_window=4096),
}
DEFAULT_ROPE_THETA = 10000.0
# Rope types whose parameters carry the pretraining length (transformers adds it when absent).
_ROPE_TYPES_WITH_ORIGINAL_LENGTH = ("llama3", "yarn", "longrope")


class HFConfig:
    """A config.json as attributes (``cfg.hidden_size``), defaults filled in for supported types."""

    def __init__(self, values: dict[str, Any]):
        self.__dict__.update(values)

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)

    def __repr__(self) -> str:
        return f"HFConfig(model_type={getattr(self, 'model_type', None)!r})"


def read_hf_config(model_dir: Path) -> HFConfig:
    """``model_dir/config.json`` with transformers' defaults for its model type (see the module)."""
    path = Path(model_dir) / "config.json"
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"{model_dir} has no config.json: not a Hugging Face model directory") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(raw, dict) or "model_type" not in raw:
        raise ValueError(f"{path} has no 'model_type': not a model config this engine can read")
    return HFConfig(hf_config_values(raw))


def hf_config_values(raw: dict[str, Any]) -> dict[str, Any]:
    """The values transformers' config object would hold for these keys of a config.json."""
    defaults = MODEL_TYPE_DEFAULTS.get(raw.get("model_type"))
    if defaults is None:
        return dict(raw)  # not ours: refused by model_type, nothing else is read
    cfg = {**defaults, **raw}
    if cfg.get("head_dim", 0) is None and "head_dim" in defaults:  # Llama, Mistral: derived
        cfg["head_dim"] = cfg["hidden_size"] // cfg["num_attention_heads"]
    if cfg.get("num_key_value_heads") is None:
        cfg["num_key_value_heads"] = cfg["num_attention_heads"]
    if "use_sliding_window" in defaults and not cfg["use_sliding_window"]:
        cfg["sliding_window"] = None  # Qwen: the window is only in effect when switched on
    # transformers 5 keeps the checkpoint's dtype under ``dtype``; ``torch_dtype`` is its old name.
    cfg["dtype"] = cfg.get("dtype") or cfg.get("torch_dtype")
    cfg["rope_parameters"] = _rope_parameters(cfg)
    for legacy in ("torch_dtype", "rope_scaling", "rope_theta"):  # now in dtype and rope_parameters
        cfg.pop(legacy, None)
    return cfg


def _rope_parameters(cfg: dict[str, Any]) -> dict[str, Any]:
    """One dict of rotary parameters, as transformers 5 standardizes them: a legacy ``rope_scaling``
    takes precedence over ``rope_parameters``; ``rope_theta`` and ``rope_type`` (from the old
    ``type`` key) are filled in; scaled types get their pretraining length."""
    rope = dict(cfg.get("rope_scaling") or cfg.get("rope_parameters") or {})
    rope.setdefault("rope_theta", cfg.get("rope_theta", DEFAULT_ROPE_THETA))
    rope.setdefault("rope_type", rope.get("type", "default"))
    if rope["rope_type"] in _ROPE_TYPES_WITH_ORIGINAL_LENGTH:
        # A top-level original_max_position_embeddings is not consulted for these model types
        # (transformers reads it only for those whose config class declares it, as Phi-3's does).
        rope.setdefault("original_max_position_embeddings", cfg["max_position_embeddings"])
    return rope
