"""A decode step's decoder layers as one native call (``pagedserve/kernels/decode_stack.cpp``).

The Python model makes about a dozen calls per layer per step (norms, the linears, the rotary
embedding, the KV write, attention, conversions), each microseconds of interpreter and dispatcher
work, and between two kernels torch's worker threads idle long enough to fall asleep. On the
default model (30 layers, ~15 ms of kernels per token on a 2-core AVX2 EPYC) that overhead was as
large as the kernels. :class:`NativeDecode` hands a decode step's layers to one C++ object holding
every layer's weights and KV pools, which runs the same kernels back to back.

It computes what the Python path computes, call for call (same kernels, same conversions: the same
bits, tested), and takes only what it can (:meth:`NativeDecode.build` says why not, :meth:`NativeDecode.runs`
which steps); everything else runs through the Python model, which stays the reference.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedserve.kv.cache import HeadMajorKVCache
from pagedserve.kv.int4 import Int4KVCache, TailMap, WritePlan
from pagedserve.kv.quant import QuantizedKVCache, kv_dtype_name
from pagedserve.models.attention import FUSED_DECODE_MAX_GROUP, AttentionMetadata, fused_attention, write_kv
from pagedserve.models.gguf_linear import GGUFLinear
from pagedserve.models.half_linear import HalfWeightLinear
from pagedserve.models.packed import PackedLinear, TileLinear

UNLIMITED_ROWS = 1 << 30


def linear_spec(layer: nn.Module, dtype: torch.dtype) -> tuple[tuple, int] | str:
    """``((kind, weights, formats, widths, bias, residual, gemm_above), rows it takes)`` for
    ``DecodeStack.set_linear``, or why ``layer`` has no native decode path. A GGUF linear that runs
    ``gguf_gemm`` takes any number of rows (more than ``kernel_rows`` through the GEMM, as in Python)."""
    if isinstance(layer, GGUFLinear):
        weights = [getattr(layer, f"weight{i}") for i in range(len(layer.formats))]
        formats = [f"{fmt}:rows16" if rows16 else fmt for fmt, rows16 in zip(layer.formats, layer.rows16)]
        gemm_above = layer.kernel_rows if layer.gemm else 0
        return (("gguf", weights, formats, list(layer.widths), layer.bias, layer.residual, gemm_above),
                UNLIMITED_ROWS if layer.gemm else layer.kernel_rows)
    if isinstance(layer, HalfWeightLinear):
        if layer.ops is None or dtype != torch.float32:
            return "16-bit decode weights without their kernel"
        return ("half", [layer.weight], [], [], layer.bias, False, 0), layer.max_kernel_rows
    if isinstance(layer, TileLinear):
        return ("tile", [layer.tiles], [], [layer.out_features], layer.bias, False, 0), UNLIMITED_ROWS
    if isinstance(layer, PackedLinear):
        return ("onednn", [layer.packed_weight], [], [layer.out_features], layer.bias, False, 0), UNLIMITED_ROWS
    if type(layer) is nn.Linear:
        return ("dense", [layer.weight], [], [], layer.bias, False, 0), UNLIMITED_ROWS
    return f"{type(layer).__name__} layers have no native decode path"


def head_spec(model: nn.Module, dtype: torch.dtype) -> tuple[tuple, int] | str:
    """The LM head's :func:`linear_spec` (a tied plain embedding: its table, as ``compute_logits``
    multiplies it), or why it has none."""
    if model.lm_head is not None:
        return linear_spec(model.lm_head, dtype)
    if type(model.embed_tokens) is nn.Embedding:
        return ("dense", [model.embed_tokens.weight], [], [], None, False, 0), UNLIMITED_ROWS
    return f"a tied {type(model.embed_tokens).__name__} table"


def _pool_parts(k: HeadMajorKVCache | QuantizedKVCache | Int4KVCache, v) -> tuple[str, list[torch.Tensor]]:
    """``DecodeStack.add_layer``'s ``kv_kind`` and ``kv_parts`` for a layer's K and V pools."""
    if isinstance(k, QuantizedKVCache):
        return k.kv_cache_dtype, [k.scales, v.scales]
    if isinstance(k, Int4KVCache):
        return "int4", [k.scales, k.zero_points, k.key_bits, v.scales, k.tail, v.tail, v.rotation]
    return "", []


class NativeDecode:
    """A model's decoder layers and KV pools in one ``torch.classes.pagedserve.DecodeStack``."""

    def __init__(self, stack, kv_caches: list, max_rows: int, head_rows: int, what: str,
                 tails: TailMap | None = None, plan_order: list[int] | None = None):
        self.stack = stack
        self.kv_caches = kv_caches  # the pools it was built over: a step over other pools is not its
        self.max_rows = max_rows
        self.head_rows = head_rows  # the LM head's rows it computes (0: none, compute_logits' own path)
        self.what = what
        self.tails = tails  # int4 pools' shared tail map, which plans each step's writes; None otherwise
        self.plan_order = plan_order or [0]  # KV groups in the order the layers first write them

    @classmethod
    def build(cls, model: nn.Module, kv_caches: list, ops, threads: int | None = None
              ) -> tuple["NativeDecode | None", str]:
        """The native decode path over ``model`` (a ``LlamaForCausalLM``, Gemma 3's included: each
        decoder layer class names its arithmetic, ``NATIVE_MATH``, and its norms' roles,
        ``native_norms``) and ``kv_caches``, or
        ``None``; and why, for the engine's log. ``threads``: the step's threads in the stack's own
        pool; 0 runs its kernels on torch's OpenMP threads. By default torch's thread count, or 0
        where torch computes a layer's linears (oneDNN-packed or plain) or the prompt chunks'
        ``tile_linear`` runs on torch's threads: their matmuls run on OpenMP's team anyway, and a pool
        beside that team spun on the cores OpenMP's threads wanted (``small`` in bf16 on a Zen 4, W2:
        90 decode tokens/s with both, 105-109 on OpenMP alone; with tiles on a Sapphire Rapids-class
        Xeon, W1: 686 output tokens/s with both, 835 on OpenMP alone)."""
        if ops is None:
            return None, "the native kernels are unavailable"
        arch = model.arch
        if model.attention.attend is not fused_attention or model.attention.write is not write_kv:
            return None, "the attention backend is not 'fused'"
        if arch.num_heads > FUSED_DECODE_MAX_GROUP * arch.num_kv_heads:
            return None, f"more than {FUSED_DECODE_MAX_GROUP} query heads per KV head"
        if not all(pool.data.device.type == "cpu" for pair in kv_caches for pool in pair):
            return None, "the KV pools are not on the CPU"
        if not all(isinstance(k, (HeadMajorKVCache, QuantizedKVCache))
                   or (isinstance(k, Int4KVCache) and k.native is not None and v.rotation is not None)
                   for k, v in kv_caches):
            return None, "int4 KV pools without their native write or their values' rotation"
        dtype = model.norm.weight.dtype  # the compute dtype: norms stay in it whatever the linears hold
        specs, max_rows = [], UNLIMITED_ROWS
        for layer in model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            named = {"qkv": attn.qkv_proj, "o": attn.o_proj, "gate_up": mlp.gate_up_proj, "down": mlp.down_proj}
            layer_specs = {}
            for name, linear in named.items():
                spec = linear_spec(linear, dtype)
                if isinstance(spec, str):
                    return None, spec
                layer_specs[name], rows = spec
                max_rows = min(max_rows, rows)
            specs.append(layer_specs)
        kinds = sorted({spec[0] for layer_specs in specs for spec in layer_specs.values()})
        if threads is None:
            threads = 0 if {"onednn", "dense", "tile"} & set(kinds) else torch.get_num_threads()
        rotary = model.layers[0].self_attn.rotary
        stack = torch.classes.pagedserve.DecodeStack(
            arch.num_heads, arch.num_kv_heads, arch.head_dim, arch.intermediate_size, model.norm.eps,
            model.layers[0].self_attn.scale, rotary.cos, rotary.sin, model.norm.weight, threads)
        if model.layers[0].NATIVE_MATH == "gemma3":
            stack.use_gemma3_math()
        ropes = {id(rotary): 0}  # each RoPE table once (Gemma 3: a global and a local one)
        groups = getattr(model, "layer_group", None) or [0] * len(model.layers)  # KV groups (kv/groups.py)
        for i, (layer, (k_pool, v_pool), layer_specs) in enumerate(zip(model.layers, kv_caches, specs)):
            attn = layer.self_attn
            if id(attn.rotary) not in ropes:
                ropes[id(attn.rotary)] = stack.add_rope(attn.rotary.cos, attn.rotary.sin)
            input_norm, pre_mlp_norm, attn_out_norm, mlp_out_norm = layer.native_norms()
            stack.add_layer(input_norm, pre_mlp_norm, None if attn.q_norm is None else attn.q_norm.weight,
                            None if attn.k_norm is None else attn.k_norm.weight, k_pool.data, v_pool.data,
                            groups[i], ropes[id(attn.rotary)], attn_out_norm, mlp_out_norm,
                            *_pool_parts(k_pool, v_pool))
            for name, spec in layer_specs.items():
                stack.set_linear(i, name, *spec)
        head = head_spec(model, dtype)
        head_rows = 0
        if not isinstance(head, str):
            spec, head_rows = head
            stack.set_linear(-1, "head", *spec)
        rows = "any number of" if max_rows == UNLIMITED_ROWS else f"up to {max_rows}"
        team = f"its own pool of {threads} threads" if threads else "OpenMP's threads"
        precision = _pool_parts(*kv_caches[0])[0] or kv_dtype_name("auto", kv_caches[0][0].dtype)
        what = (f"native: {len(specs)} layers in one call per decode step ({rows} rows; "
                f"{', '.join(kinds)} linears, {precision} KV pools; "
                f"on {team}); " + ("the LM head too" if head_rows else f"the LM head in Python ({head})"))
        plan_order = list(dict.fromkeys(groups))  # the KV groups in the order the layers first write them
        tails = kv_caches[0][0].tails if isinstance(kv_caches[0][0], Int4KVCache) else None
        return cls(stack, kv_caches, max_rows, head_rows, what, tails, plan_order), what

    def step_plans(self, num_tokens: int, metas: list[AttentionMetadata], kv_caches: list) -> list | None:
        """``None`` when the stack does not take this step; else what :meth:`__call__` hands it
        besides the step's metadata: over int4 pools their write plans' tensors, ``[]`` otherwise.
        It takes decodes only, few enough rows, its own pools, and over int4 pools a write the
        native kernel carries out (not a rolled-back block's: a speculative step's rejected tokens,
        written again, read the quantized pool). ``metas``: one per KV group, or the one of a model
        without groups.

        The plans are made here, once per KV group, in the order the Python layers would ask for
        them (the first layer of each group); the Python path, should it run the step, finds them
        by slot mapping (kv/int4.py: TailMap.plan)."""
        if metas[0].prefills or num_tokens > self.max_rows or kv_caches is not self.kv_caches:
            return None
        if self.tails is None:
            return []
        plans = {g: self.tails.plan(metas[g].slot_mapping) for g in self.plan_order}
        if any(plan.reads_pool for plan in plans.values()):
            return None
        return [t for g in sorted(plans) for t in _plan_tensors(plans[g])]

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, metas: list[AttentionMetadata],
                 plans: list[torch.Tensor]) -> torch.Tensor:
        """Hidden states after the final norm for the decode rows whose embeddings are ``x``; ``metas``:
        one per KV group (a sliding group's its window view), or the one of a model without groups;
        ``plans``: :meth:`step_plans`'."""
        return self.stack.forward(x, positions, [m.slot_mapping for m in metas],
                                  [m.decode_block_tables for m in metas], [m.decode_context_lens for m in metas],
                                  [m.decode_first for m in metas], plans)


def _plan_tensors(plan: WritePlan) -> tuple[torch.Tensor, ...]:
    """A write plan as ``DecodeStack.forward`` takes it (decode_stack.cpp's kInt4Plan order)."""
    return (plan.full_blocks, plan.full_slots, plan.full_rows, plan.full_tokens, plan.tail_rows, plan.tail_tokens,
            plan.decode_slots)
