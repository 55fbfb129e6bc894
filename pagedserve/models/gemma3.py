"""Gemma 3 (text) over a flat token batch with a paged KV cache, loaded from a GGUF file.

What differs from the Llama family (:mod:`pagedserve.models.llama`, whose norm, rotary embedding
and attention backends are reused as they are, and whose decoder layer, attention and MLP modules
are subclassed: the fused QKV projection, rotary and paged-attention calls written once):

* every layer norms four times: before and after attention, before and after the MLP, the
  attention and MLP outputs normed before they join the residual stream;
* RMSNorm scales by ``1 + w``. llama.cpp's converter stores ``1 + w`` in the GGUF file already
  (transformers' GGUF loader subtracts the 1 back), so the file's weights go into the Llama
  ``RMSNorm`` (``x̂ · w``) unchanged, and its native kernel serves here too;
* QK-norm: queries and keys RMS-normed per head before the rotary embedding;
* the MLP is GeGLU: ``down(gelu_tanh(gate) · up)``;
* token embeddings are multiplied by ``√hidden`` (rounded to the compute dtype, as transformers
  does); the LM head is the embedding table itself (tied), unscaled;
* attention scores scale by ``query_pre_attn_scalar ** -0.5``;
* layers alternate local and global attention: a sliding-window layer sees the last ``window``
  positions only (a query at p sees keys > p − window) and rotates with the local RoPE base
  (10,000), the global layers with the file's ``rope.freq_base`` (1,000,000 for Gemma 3) and any
  rope scaling. Which layers slide is ``layer_types`` (from the GGUF's
  ``attention.sliding_window_pattern`` when present, else every 6th layer global, the rule
  llama.cpp and transformers apply to Gemma 3).

Sliding layers read the KV cache through :func:`~pagedserve.models.attention.window_view` (built
once per step): decodes read only the blocks covering their window, prompt chunks are masked by it.
Decode steps run in the native decode stack (:mod:`~pagedserve.models.native_decode`, the layer's
``NATIVE_MATH`` and ``native_norms``) where the engine builds it; this model stays its reference.

Weights come from the GGUF file through the Llama family's loader
(:func:`pagedserve.models.gguf.load_gguf_model`, with this layer's ``GGUF_NORMS``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.kv.groups import kv_groups, layer_slots
from pagedserve.models.attention import AttentionMetadata, window_view
from pagedserve.models.llama import (MLP, Attention, DecoderLayer, LlamaForCausalLM, ModelArchitecture, RMSNorm,
                                     RotaryEmbedding, input_norm)

MODEL_TYPE = "gemma3_text"
SLIDING, FULL = "sliding_attention", "full_attention"
# transformers' Gemma3TextConfig defaults for the keys read here: its save_pretrained writes only
# the keys that differ from them (tests/models/test_gemma3.py checks these against AutoConfig).
DEFAULTS = dict(vocab_size=262_208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                num_attention_heads=8, num_key_value_heads=4, head_dim=256, hidden_activation="gelu_pytorch_tanh",
                max_position_embeddings=131_072, rms_norm_eps=1e-6, tie_word_embeddings=True, attention_bias=False,
                query_pre_attn_scalar=256, sliding_window=4096, sliding_window_pattern=6, layer_types=None,
                final_logit_softcapping=None, attn_logit_softcapping=None, use_bidirectional_attention=False)
DEFAULT_THETA = {FULL: 1_000_000.0, SLIDING: 10_000.0}


@dataclass
class Gemma3Architecture(ModelArchitecture):
    """A Gemma 3 text model's shape. ``sliding_window`` (the Llama field the engine caps
    ``max_model_len`` by, for models whose window it does not implement) stays None: the window is
    per layer here, in ``layer_windows``, and implemented."""

    layer_windows: tuple[int | None, ...] = ()  # per layer: its window, or None (global attention)
    local_rope_theta: float = DEFAULT_THETA[SLIDING]
    query_pre_attn_scalar: float = 256.0
    final_logit_softcapping: float | None = None

    @classmethod
    def from_hf_config(cls, cfg) -> "Gemma3Architecture":
        """From a ``gemma3_text`` config (transformers' object or :class:`~pagedserve.models.hf_config.HFConfig`,
        whose keys missing from config.json take transformers' defaults)."""
        if getattr(cfg, "model_type", None) != MODEL_TYPE:
            raise ValueError(f"not a Gemma 3 text config: model_type {getattr(cfg, 'model_type', None)!r}")
        # the keys read here, each transformers' default where the config has none
        c = SimpleNamespace(model_type=MODEL_TYPE, **{key: DEFAULTS[key] if getattr(cfg, key, None) is None
                                                      else getattr(cfg, key) for key in DEFAULTS})
        if c.attn_logit_softcapping is not None:
            raise ValueError("attention logit soft-capping (Gemma 2) is not supported")
        if c.use_bidirectional_attention:
            raise ValueError("bidirectional attention (EmbeddingGemma) is not supported")
        if c.hidden_activation != "gelu_pytorch_tanh":
            raise ValueError(f"unsupported Gemma 3 activation {c.hidden_activation!r} (supported: gelu_pytorch_tanh)")
        layers = c.num_hidden_layers
        types = c.layer_types or [SLIDING if (i + 1) % int(c.sliding_window_pattern) else FULL for i in range(layers)]
        if len(types) != layers or set(types) - {SLIDING, FULL}:
            raise ValueError(f"layer_types must name {layers} layers, each {SLIDING!r} or {FULL!r}: {types}")
        rope = getattr(cfg, "rope_parameters", None) or {}
        local = dict(rope.get(SLIDING) or {})
        if local.get("rope_type", "default") != "default":
            raise ValueError(f"rope scaling on Gemma 3's sliding layers is not supported: {local}")
        return cls.from_shared_fields(
            c, rope.get(FULL) or {}, DEFAULT_THETA[FULL], qkv_bias=bool(c.attention_bias), qk_norm=True,
            sliding_window=None, layer_windows=tuple(int(c.sliding_window) if t == SLIDING else None for t in types),
            local_rope_theta=float(local.get("rope_theta", DEFAULT_THETA[SLIDING])),
            query_pre_attn_scalar=float(c.query_pre_attn_scalar), final_logit_softcapping=c.final_logit_softcapping)


class Gemma3Attention(Attention):
    """The Llama family's attention with the ``query_pre_attn_scalar`` scale (a layer's window is
    in the metadata it attends with: :func:`~pagedserve.models.attention.window_view`)."""

    def __init__(self, arch: Gemma3Architecture, rotary: RotaryEmbedding):
        super().__init__(arch, rotary)  # arch.qk_norm is True: q_norm and k_norm are built
        self.scale = arch.query_pre_attn_scalar ** -0.5

    def query_key_heads(self, q: torch.Tensor, k: torch.Tensor, t: int) -> tuple[torch.Tensor, torch.Tensor]:
        # One row per (token, head): the 2-D shape the native norm kernel takes.
        q = self.q_norm(q.reshape(-1, self.head_dim)).view(t, self.num_heads, self.head_dim)
        k = self.k_norm(k.reshape(-1, self.head_dim)).view(t, self.num_kv_heads, self.head_dim)
        return q, k


class Gemma3MLP(MLP):
    """GeGLU: ``down(gelu_tanh(gate) · up)``, gate and up as one matmul (the Llama MLP's layers;
    its native kernel is SiLU's, so this one stays in torch)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class Gemma3DecoderLayer(DecoderLayer):
    """The Llama layer's norms and modules (Gemma's attention and MLP), and the norms of the
    attention's and the MLP's outputs before they join the residual stream."""

    # norm -> its GGUF tensor (blk.<i>.<name>.weight): 1 + w, as the file stores it
    GGUF_NORMS = {"input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
                  "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm"}
    NATIVE_MATH = "gemma3"  # the decode stack's Gemma arithmetic: QK-norm by rows, GeGLU
    ATTENTION, FEED_FORWARD = Gemma3Attention, Gemma3MLP

    def __init__(self, arch: Gemma3Architecture, rotary: RotaryEmbedding):
        super().__init__(arch, rotary)
        self.pre_feedforward_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.post_feedforward_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)

    def native_norms(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The native decode stack's norm weights (DecoderLayer.native_norms' roles)."""
        return (self.input_layernorm.weight, self.pre_feedforward_layernorm.weight,
                self.post_attention_layernorm.weight, self.post_feedforward_layernorm.weight)

    def forward(self, x, residual, positions, kv, meta, backend):
        """``(normed MLP output, residual)``: the layer's output is their sum, left for the next
        norm to add (the residual-adding norm is one pass, native where built)."""
        h, residual = input_norm(self.input_layernorm, x, residual)
        a = self.post_attention_layernorm(self.self_attn(h, positions, kv, meta, backend))
        h, residual = self.pre_feedforward_layernorm(a, residual)
        return self.post_feedforward_layernorm(self.mlp(h)), residual


class Gemma3ForCausalLM(LlamaForCausalLM):
    """Gemma 3's decoder: the Llama model's embedding, final norm, LM head and native kernels, with
    Gemma's layers, scaled embeddings, windows and soft-capped logits."""

    def __init__(self, arch: Gemma3Architecture, max_positions: int, attention_backend: str = "sdpa",
                 rotary: tuple[RotaryEmbedding, RotaryEmbedding] | None = None):
        """``rotary``: the (global, local) tables built beforehand, for a model built on the meta device."""
        if attention_backend == "triton":  # its kernels attend to whole contexts
            raise ValueError("Gemma 3's sliding windows are masked by the reference, sdpa, matmul and fused attention "
                             "backends, not triton: pass --attention-backend sdpa")
        super().__init__(arch, max_positions, attention_backend, rotary)
        # KV groups (kv/groups.py): with per-group tables the runner passes one metadata per group
        self.kv_groups = kv_groups(arch.layer_windows)
        self.layer_group = [g for g, _ in layer_slots(self.kv_groups)]

    @staticmethod
    def rotary_tables(arch: Gemma3Architecture, max_positions: int) -> tuple[RotaryEmbedding, RotaryEmbedding]:
        local = dataclasses.replace(arch, rope_theta=arch.local_rope_theta, rope_scaling=None)  # unscaled
        return RotaryEmbedding(arch, max_positions), RotaryEmbedding(local, max_positions)

    def build_layers(self, arch: Gemma3Architecture, rotary: tuple[RotaryEmbedding, RotaryEmbedding]) -> nn.ModuleList:
        glob, local = rotary  # (rotary_tables: the global and the local layers' tables)
        return nn.ModuleList(Gemma3DecoderLayer(arch, glob if w is None else local) for w in arch.layer_windows)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list,
                meta: AttentionMetadata | list[AttentionMetadata]) -> torch.Tensor:
        """Hidden states ``[T, hidden]`` after the final norm, for every token of the batch.
        ``meta``: one for every layer (one block table per sequence), or one per KV group."""
        x = self.embed_tokens(input_ids)
        # √hidden in the compute dtype, as transformers rounds it (bf16: 25.25, not 25.298)
        x = x * torch.tensor(self.arch.hidden_size ** 0.5, dtype=x.dtype)
        metas = meta if isinstance(meta, list) else [meta] * len(self.kv_groups)
        views = [m if g.window is None else window_view(m, g.window, kv_caches[0][0].shape[1])  # block size
                 for m, g in zip(metas, self.kv_groups)]  # once per step, not per layer
        native = self.native_decode
        if native is not None and (plans := native.step_plans(x.shape[0], views, kv_caches)) is not None:
            return native(x, positions, views, plans)  # the layers below, in one native call
        residual = None
        for layer, kv, g in zip(self.layers, kv_caches, self.layer_group):
            x, residual = layer(x, residual, positions, kv, views[g], self.attention)
        return self.norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor, argmax_only: bool = False) -> torch.Tensor:
        """Logits in float32 for the rows that will be sampled, soft-capped where the config says
        (monotone: an ``argmax_only`` screen's argmax stays the argmax)."""
        logits = super().compute_logits(hidden, argmax_only)
        cap = self.arch.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap


# ---- from a GGUF file -----------------------------------------------------------------------

def gemma3_config_from_gguf(reader):
    """transformers' ``Gemma3TextConfig`` from a ``gemma3`` GGUF file's metadata (the fields every
    architecture shares read by :func:`pagedserve.models.gguf.gguf_config_fields`)."""
    from transformers import Gemma3TextConfig

    from pagedserve.models.gguf import GGUFError, gguf_config_fields

    kw, full, meta, _ = gguf_config_fields(reader, "gemma3", rope_theta=DEFAULT_THETA[FULL], head_dim=256)
    layers, head_dim = kw["num_hidden_layers"], kw["head_dim"]
    if int(meta("attention.value_length", head_dim)) != head_dim:
        raise GGUFError("Gemma 3 with different key and value lengths is not supported")
    # not in the metadata: the architecture's rule (llama.cpp's and transformers')
    pattern = meta("attention.sliding_window_pattern", DEFAULTS["sliding_window_pattern"])
    if isinstance(pattern, list):  # per layer: true where the layer slides
        if len(pattern) != layers:
            raise GGUFError(f"attention.sliding_window_pattern names {len(pattern)} layers, the model has {layers}")
        types = [SLIDING if p else FULL for p in pattern]
    else:
        types = [SLIDING if (i + 1) % int(pattern) else FULL for i in range(layers)]
    local = {"rope_type": "default", "rope_theta": float(meta("rope.freq_base_swa", DEFAULT_THETA[SLIDING]))}
    config = Gemma3TextConfig(
        **kw, sliding_window=int(meta("attention.sliding_window")), layer_types=types,
        query_pre_attn_scalar=head_dim, final_logit_softcapping=meta("final_logit_softcapping", None),
        architectures=["Gemma3ForCausalLM"])
    config.rope_parameters = {FULL: full, SLIDING: local}  # after: the constructor's may be rewritten
    return config
