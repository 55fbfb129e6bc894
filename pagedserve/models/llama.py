"""The Llama family over a flat token batch: Llama 2/3, Mistral, Qwen2 (qkv bias), Qwen3 (q/k norm).

The model sees one flat batch of ``T`` tokens from many sequences (no padding); attention reads
each sequence's context through the paged KV cache. Q/K/V and gate/up projections are fused
into one matmul each, which matters on CPU where every kernel launch has a fixed cost.

On CPU the norms, the rotary embedding and SiLU-and-multiply run as native kernels when they are
built (:mod:`pagedserve.kernels`, set by :meth:`LlamaForCausalLM.use_native_ops`); the torch code
next to each is the fallback and the reference they are tested against. The residual stream is
carried beside the hidden states, so each norm also does the residual add (one pass, not two).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.models.attention import AttentionBackend, AttentionMetadata, load_attention_backend
from pagedserve.models.head_screen import HeadScreen
from pagedserve.models.meta import meta_without_init
from pagedserve.models.native_decode import NativeDecode


@dataclass
class ModelArchitecture:
    """The shape of a Llama-family model, read from a Hugging Face config."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    sliding_window: int | None

    @classmethod
    def from_hf_config(cls, cfg) -> "ModelArchitecture":
        model_type = cfg.model_type
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"unsupported model type {model_type!r}; supported: {sorted(SUPPORTED_MODEL_TYPES)}")
        window = getattr(cfg, "sliding_window", None)
        if model_type in ("qwen2", "qwen3") and not getattr(cfg, "use_sliding_window", False):
            window = None
        rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
        return cls.from_shared_fields(cfg, rope, getattr(cfg, "rope_theta", None) or 10000.0, sliding_window=window,
                                      qkv_bias=model_type == "qwen2" or bool(getattr(cfg, "attention_bias", False)),
                                      qk_norm=model_type == "qwen3")

    @classmethod
    def from_shared_fields(cls, cfg, rope: dict, default_theta: float, **fields) -> "ModelArchitecture":
        """The fields every family reads alike from ``cfg`` (``head_dim`` and ``num_key_value_heads``
        derived where it has none, as the Llama family's configs do), the rotary base and scaling
        from ``rope`` (its ``rope_theta``, else ``default_theta``), and the family's own ``fields``."""
        rope = dict(rope)
        rope_theta = float(rope.pop("rope_theta", None) or default_theta)
        scaled = rope.get("rope_type", rope.get("type", "default")) != "default"
        heads = cfg.num_attention_heads
        return cls(model_type=cfg.model_type, vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
                   intermediate_size=cfg.intermediate_size, num_layers=cfg.num_hidden_layers, num_heads=heads,
                   num_kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
                   head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
                   rms_norm_eps=cfg.rms_norm_eps, rope_theta=rope_theta, rope_scaling=rope if scaled else None,
                   max_position_embeddings=cfg.max_position_embeddings,
                   tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)), **fields)


SUPPORTED_MODEL_TYPES = {"llama", "mistral", "qwen2", "qwen3"}


def rope_inv_freq(dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """Inverse frequencies per rotary pair of a ``dim``-wide head, with ``llama3`` or ``linear`` scaling applied."""
    # float32 throughout, as transformers computes it, so positions rotate bit-for-bit alike.
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind in (None, "default"):
        return inv_freq
    factor = float(scaling["factor"])
    if kind == "linear":
        return inv_freq / factor
    if kind == "llama3":
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"unsupported rope scaling type {kind!r} (supported: default, linear, llama3)")


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin per position, applied the Hugging Face way (rotate halves)."""

    ops = None  # native kernels (pagedserve.kernels), or None for the torch path

    def __init__(self, arch: ModelArchitecture, max_positions: int):
        super().__init__()
        inv_freq = rope_inv_freq(arch.head_dim, arch.rope_theta, arch.rope_scaling)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq.float())
        emb = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.ops is not None:  # in place, on the views of the fused QKV output
            self.ops.rotary_embedding(q, k, positions, self.cos, self.sin)
            return q, k
        cos = self.cos[positions].unsqueeze(1).to(q.dtype)  # [T, 1, d]
        sin = self.sin[positions].unsqueeze(1).to(q.dtype)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


class RMSNorm(nn.Module):
    ops = None  # native kernels (pagedserve.kernels), or None for the torch path

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """``norm(x)``; with ``residual``, ``(norm(x + residual), x + residual)``: the sum is the
        next residual (the native kernel writes it into ``residual`` in place)."""
        if self.ops is not None and x.dim() == 2 and x.stride(-1) == 1:
            out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
            self.ops.rms_norm(out, x, residual, self.weight, self.eps)
            return out if residual is None else (out, residual)
        if residual is not None:
            residual = x + residual
            return self._norm(residual), residual
        return self._norm(x)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # Computed in float32 then cast back, as transformers does, for parity in bf16.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, arch: ModelArchitecture, rotary: RotaryEmbedding):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = arch.num_heads, arch.num_kv_heads, arch.head_dim
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(arch.hidden_size, self.q_size + 2 * self.kv_size, bias=arch.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, arch.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, arch.rms_norm_eps) if arch.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, arch.rms_norm_eps) if arch.qk_norm else None
        self.rotary = rotary
        self.scale = self.head_dim ** -0.5

    def forward(self, x: torch.Tensor, positions: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata, backend: AttentionBackend) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.query_key_heads(q, k, t)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        q, k = self.rotary(positions, q, k)
        backend.write(*kv, k, v, meta.slot_mapping)
        return self.o_proj(backend.attend(q, *kv, meta, self.scale).reshape(t, self.q_size))


    def query_key_heads(self, q: torch.Tensor, k: torch.Tensor, t: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The fused projection's query and key columns as ``[T, heads, head_dim]``, QK-normed where
        the model has it (Qwen3)."""
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k


class MLP(nn.Module):
    ops = None  # native kernels (pagedserve.kernels), or None for the torch path

    def __init__(self, arch: ModelArchitecture):
        super().__init__()
        self.gate_up_proj = nn.Linear(arch.hidden_size, 2 * arch.intermediate_size, bias=False)
        self.down_proj = nn.Linear(arch.intermediate_size, arch.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.ops is not None and gate_up.dim() == 2 and gate_up.is_contiguous():
            h = torch.empty(gate_up.shape[0], gate_up.shape[1] // 2, dtype=gate_up.dtype, device=gate_up.device)
            self.ops.silu_and_mul(h, gate_up)
            return self.down_proj(h)
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


def input_norm(norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's input norm and the residual stream after it (the first layer's is the embeddings)."""
    return (norm(x), x) if residual is None else norm(x, residual)


class DecoderLayer(nn.Module):
    GGUF_NORMS = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}  # blk.<i>.<name>.weight
    NATIVE_MATH = "llama"  # the native decode stack's arithmetic for this layer (models/native_decode.py)
    ATTENTION, FEED_FORWARD = Attention, MLP  # the modules built as self_attn and mlp (Gemma 3's subclass theirs)

    def __init__(self, arch: ModelArchitecture, rotary: RotaryEmbedding):
        super().__init__()
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.self_attn = self.ATTENTION(arch, rotary)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.mlp = self.FEED_FORWARD(arch)

    def native_norms(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """The native decode stack's norm weights: the input norm, the residual-adding norm before
        the MLP, and norms of the attention's and the MLP's outputs (none here)."""
        return self.input_layernorm.weight, self.post_attention_layernorm.weight, None, None

    def forward(self, x, residual, positions, kv, meta, backend):
        """``(mlp output, residual)``: the layer's output is their sum, left for the next norm to add."""
        h, residual = input_norm(self.input_layernorm, x, residual)
        h, residual = self.post_attention_layernorm(self.self_attn(h, positions, kv, meta, backend), residual)
        return self.mlp(h), residual


class LlamaForCausalLM(nn.Module):
    """Llama-family decoder over a flat batch with a paged KV cache."""

    def __init__(self, arch: ModelArchitecture, max_positions: int, attention_backend: str = "sdpa",
                 rotary: RotaryEmbedding | None = None):
        """``rotary``: tables built beforehand, for a model built on the meta device (:meth:`on_meta`)."""
        super().__init__()
        self.arch = arch
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size)
        self.layers = self.build_layers(arch, rotary if rotary is not None else self.rotary_tables(arch, max_positions))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.lm_head = None if arch.tie_word_embeddings else nn.Linear(arch.hidden_size, arch.vocab_size, bias=False)
        self.attention = load_attention_backend(attention_backend)
        self.native_decode: NativeDecode | None = None  # set by enable_native_decode
        self.head_screen: HeadScreen | None = None  # set at load (models/loader.py): greedy steps' LM head

    @classmethod
    def on_meta(cls, arch: ModelArchitecture, max_positions: int, attention_backend: str,
                device: torch.device) -> "LlamaForCausalLM":
        """The model with its weights on the meta device, never initialized (the loader fills every
        one), and its rotary tables (the one thing no checkpoint holds) computed for real on
        ``device``: on meta they would go through torch's reference ops, importing torch._dynamo."""
        with torch.device(device):
            rotary = cls.rotary_tables(arch, max_positions)
        with meta_without_init():
            return cls(arch, max_positions, attention_backend, rotary=rotary)

    @staticmethod
    def rotary_tables(arch: ModelArchitecture, max_positions: int) -> RotaryEmbedding:
        return RotaryEmbedding(arch, max_positions)

    def build_layers(self, arch: ModelArchitecture, rotary: RotaryEmbedding) -> nn.ModuleList:
        return nn.ModuleList(DecoderLayer(arch, rotary) for _ in range(arch.num_layers))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states ``[T, hidden]`` after the final norm, for every token of the batch."""
        x, residual = self.embed_tokens(input_ids), None
        native = self.native_decode
        if native is not None and (plans := native.step_plans(x.shape[0], [meta], kv_caches)) is not None:
            return native(x, positions, [meta], plans)  # the layers below, in one native call
        for layer, kv in zip(self.layers, kv_caches):
            x, residual = layer(x, residual, positions, kv, meta, self.attention)
        return self.norm(x, residual)[0] if residual is not None else self.norm(x)

    def use_native_ops(self, ops) -> None:
        """Route norms, rotary embedding and SiLU-and-multiply through ``ops`` (the
        ``torch.ops.pagedserve`` kernels, CPU only), or back to torch with ``None`` (an MLP whose
        forward computes another activation, Gemma 3's GeGLU, does not read them)."""
        for m in self.modules():
            if isinstance(m, (RMSNorm, RotaryEmbedding, MLP)):
                m.ops = ops

    def enable_native_decode(self, kv_caches: list, ops) -> str:
        """Run decode steps over ``kv_caches`` through one native call for all layers where it can
        (:mod:`pagedserve.models.native_decode`); returns what was decided and why."""
        self.native_decode, why = NativeDecode.build(self, kv_caches, ops)
        return why if self.native_decode is not None else f"python ({why})"

    def compute_logits(self, hidden: torch.Tensor, argmax_only: bool = False) -> torch.Tensor:
        """Logits in float32 for the rows that will be sampled (not every prompt token). With
        ``argmax_only`` (a step whose rows are all plain greedy) a few rows may go through the head's
        screen (:mod:`pagedserve.models.head_screen`): the same argmax, every other logit -inf."""
        screen, native = self.head_screen, self.native_decode
        if argmax_only and screen is not None and screen.takes(hidden.shape[0]):
            return screen.logits(hidden, None if native is None else native.stack)
        if native is not None and hidden.shape[0] <= native.head_rows:  # the same bits, on the stack's threads
            return native.stack.logits(hidden)
        if self.lm_head is None:  # tied: the embedding matrix, kept in the model dtype
            return F.linear(hidden, self.embed_tokens.weight).float()
        return self.lm_head(hidden).float()  # an nn.Linear, or its quantized twin
