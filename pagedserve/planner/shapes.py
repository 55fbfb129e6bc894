"""A model's shape — the few numbers the serving arithmetic needs — from wherever it is written.

Sources, in the order :func:`load_model_shape` tries them: a standard model name (``small``), a
``config.json`` file, a local model directory or a Hugging Face hub id (through
``transformers.AutoConfig``). Explicit numbers build a :class:`ModelShape` directly.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagedserve.planner.sizing import kv_bytes_per_token, kv_pool_bytes_per_token, kv_tail_bytes_per_sequence


class ModelShapeError(ValueError):
    """A model's shape could not be found or makes no sense."""


@dataclass(frozen=True)
class ModelShape:
    """The dimensions of a Llama-family decoder that decide its memory and compute.

    ``params`` overrides the count derived from the dimensions (for MoE models, or when only
    the headline figure is known); ``hidden_size`` 0 with no ``params`` means the size is unknown
    (enough for KV sizing, which needs only layers, KV heads and head dim).
    """

    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int = 0
    num_heads: int = 0
    intermediate_size: int = 0
    vocab_size: int = 0
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    max_position_embeddings: int = 0
    params: int | None = None

    def __post_init__(self) -> None:
        for field in ("num_layers", "num_kv_heads", "head_dim"):
            if getattr(self, field) < 1:
                raise ModelShapeError(f"{field} must be >= 1, got {getattr(self, field)}")

    def kv_bytes_per_token(self, bytes_per_element: float) -> float:
        """KV element bytes per token at ``bytes_per_element`` (no quantization scales: the
        formula's first term; sizing uses :meth:`kv_pool_bytes_per_token`)."""
        return kv_bytes_per_token(self.num_layers, self.num_kv_heads, self.head_dim, bytes_per_element)

    def kv_pool_bytes_per_token(self, precision: str, block_size: int = 16) -> int:
        """Bytes one token takes in the engine's KV pool at ``precision`` (bf16, fp8, int8, int4, ...),
        quantized formats' scales included: exactly what the engine sizes its pool by."""
        return kv_pool_bytes_per_token(self.num_layers, self.num_kv_heads, self.head_dim, precision, block_size)

    def kv_tail_bytes_per_sequence(self, precision: str, block_size: int = 16) -> int:
        """Bytes each running sequence holds besides its blocks (int4's float16 tail block; else 0)."""
        return kv_tail_bytes_per_sequence(self.num_layers, self.num_kv_heads, self.head_dim, precision, block_size)

    @property
    def embedding_params(self) -> int:
        """Parameters of the input embedding table (a lookup reads one row per token, not all)."""
        return self.vocab_size * self.hidden_size

    @property
    def total_params(self) -> int:
        """All parameters, as a checkpoint stores them (tied embeddings counted once)."""
        if self.params is not None:
            return self.params
        if self.hidden_size < 1:
            raise ModelShapeError(f"the size of {self.name!r} is unknown: give --params or a full model config")
        h, q_dim, kv_dim = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        attention = h * q_dim + 2 * h * kv_dim + q_dim * h
        if self.qkv_bias:
            attention += q_dim + 2 * kv_dim
        mlp = 3 * h * self.intermediate_size  # gate, up, down
        layer = attention + mlp + 2 * h  # two RMSNorm weights
        lm_head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return self.embedding_params + self.num_layers * layer + h + lm_head

    @property
    def matmul_params(self) -> int:
        """Parameters every token multiplies through: all but an untied input embedding table.

        This is the P of "2 × P FLOPs per token" and the weight bytes one decode step reads: an
        untied embedding is a row lookup, while a tied one is also the LM head and is read whole.
        """
        if self.params is not None or self.tie_word_embeddings:
            return self.total_params
        return self.total_params - self.embedding_params


    @property
    def lm_head_params(self) -> int:
        """Parameters of the LM head (the tied embedding when tied); 0 when only a count is known."""
        return 0 if self.params is not None else self.vocab_size * self.hidden_size

    @property
    def body_params(self) -> int:
        """Matmul parameters of the decoder body: every prompt token goes through these in a prefill,
        while the LM head runs only for the last position (the one that is sampled)."""
        return self.matmul_params - self.lm_head_params


def shape_from_config(config: dict[str, Any], name: str = "model") -> ModelShape:
    """A :class:`ModelShape` from a Hugging Face ``config.json`` dictionary (Llama, Mistral, Qwen2/3)."""
    if "text_config" in config and "num_hidden_layers" not in config:
        config = {**config["text_config"], "tie_word_embeddings": config.get("tie_word_embeddings", False)}
    try:
        hidden = int(config["hidden_size"])
        layers = int(config["num_hidden_layers"])
        heads = int(config["num_attention_heads"])
    except KeyError as missing:
        raise ModelShapeError(f"config of {name!r} has no {missing.args[0]!r}: not a decoder config "
                              "this planner understands; give --layers/--kv-heads/--head-dim instead") from None
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or hidden // heads)
    model_type = str(config.get("model_type", ""))
    return ModelShape(
        name=name, num_layers=layers, num_kv_heads=kv_heads, head_dim=head_dim, hidden_size=hidden,
        num_heads=heads, intermediate_size=int(config.get("intermediate_size", 4 * hidden)),
        vocab_size=int(config.get("vocab_size", 0)),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        qkv_bias=bool(config.get("attention_bias", model_type == "qwen2")),
        max_position_embeddings=int(config.get("max_position_embeddings", 0) or 0),
    )


def standard_shape(name: str) -> ModelShape:
    """The shape of one of docs/WORKLOADS.md's standard models (``tiny``, ``small``, ``qwen05-shape``)."""
    from pagedserve.models.standard import STANDARD_MODELS

    if name not in STANDARD_MODELS:
        raise ModelShapeError(f"unknown standard model {name!r}; known: {', '.join(STANDARD_MODELS)}")
    m = STANDARD_MODELS[name]
    return ModelShape(
        name=name, num_layers=m.num_layers, num_kv_heads=m.num_kv_heads, head_dim=m.head_dim,
        hidden_size=m.hidden_size, num_heads=m.num_heads, intermediate_size=m.intermediate_size,
        vocab_size=m.vocab_size, tie_word_embeddings=m.tie_word_embeddings,
        max_position_embeddings=m.max_position_embeddings,
    )


def load_model_shape(model: str) -> ModelShape:
    """A shape from a standard name, a ``config.json`` path, a model directory or a hub id."""
    from pagedserve.models.standard import STANDARD_MODELS

    if model in STANDARD_MODELS:
        return standard_shape(model)
    path = Path(model).expanduser()
    if path.is_file():
        try:
            return shape_from_config(json.loads(path.read_text()), name=path.parent.name or model)
        except json.JSONDecodeError as err:
            raise ModelShapeError(f"{path} is not valid JSON: {err}") from None
    if path.is_dir() and (path / "config.json").is_file():
        return shape_from_config(json.loads((path / "config.json").read_text()), name=path.name)
    try:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(model)
    except Exception as err:  # noqa: BLE001 - transformers raises many kinds; one clear message here
        raise ModelShapeError(f"cannot load a config for {model!r} (not a standard name, a config.json, "
                              f"a model directory or a reachable hub id): {err}") from None
    return shape_from_config(config.to_dict(), name=model)
