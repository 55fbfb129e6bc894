"""Memory and speed sizing: KV bytes per token, seats, weight bytes, decode and prefill bounds.

Every function here is a formula, with no fudge factor: bounds are bounds (a real engine
reaches a fraction of them, which ``pagedserve plan check`` measures), and counts are floors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# The KV formula lives with the KV cache; the planner's API re-exports it.
from pagedserve.kv.sizing import (  # noqa: F401
    KV_ELEMENT_BYTES, QUANTIZED_KV, SizingError, hybrid_kv_bytes_per_sequence, kv_bytes_per_token, kv_element_bytes,
    kv_pool_bytes_per_token, kv_scale_bytes_per_token, kv_tail_bytes_per_sequence, window_blocks,
)

# Bytes per weight for each weight precision; quantized ones also carry per-group scales.
WEIGHT_ELEMENT_BYTES = {"fp32": 4.0, "float32": 4.0, "bf16": 2.0, "bfloat16": 2.0, "fp16": 2.0,
                        "float16": 2.0, "fp8": 1.0, "int8": 1.0, "int4": 0.5}
QUANTIZED = frozenset({"fp8", "int8", "int4"})

# The precisions tables show, one row each (aliases left out).
KV_PRECISIONS = ("bf16", "fp8", "int8", "int4")
WEIGHT_PRECISIONS = ("bf16", "int8", "int4")


def kv_bytes_per_request(bytes_per_token: float, context_len: int) -> float:
    """KV bytes one request holds at ``context_len`` tokens."""
    _check_positive(bytes_per_token=bytes_per_token)
    if context_len < 0:
        raise SizingError(f"context_len must be >= 0, got {context_len}")
    return bytes_per_token * context_len


def worst_case_seats(free_bytes: float, bytes_per_token: float, max_model_len: int,
                     per_sequence_bytes: float = 0) -> int:
    """Requests a KV budget holds when each reserves ``max_model_len`` tokens up front, plus
    ``per_sequence_bytes`` each (int4's float16 tail block: :func:`kv_tail_bytes_per_sequence`)."""
    _check_positive(bytes_per_token=bytes_per_token, max_model_len=max_model_len)
    if free_bytes < 0:
        raise SizingError(f"free memory must be >= 0, got {free_bytes}")
    return int(free_bytes // (bytes_per_token * max_model_len + per_sequence_bytes))


def num_kv_blocks(free_bytes: float, bytes_per_token: float, block_size: int) -> int:
    """Blocks of ``block_size`` tokens a KV budget holds — the engine's own pool-sizing rule."""
    _check_positive(bytes_per_token=bytes_per_token, block_size=block_size)
    if free_bytes < 0:
        raise SizingError(f"free memory must be >= 0, got {free_bytes}")
    return int(free_bytes // (block_size * bytes_per_token))


def seats_at_max_len(num_blocks: int, block_size: int, max_model_len: int) -> int:
    """Requests of ``max_model_len`` tokens a pool of blocks holds at once (the engine's rule)."""
    _check_positive(block_size=block_size, max_model_len=max_model_len)
    return num_blocks * block_size // max_model_len


def blocks_per_sequence(num_tokens: int, block_size: int) -> int:
    """Blocks a sequence of ``num_tokens`` takes: its last block is partly empty (tail waste)."""
    _check_positive(block_size=block_size)
    return math.ceil(num_tokens / block_size)


def paged_seats(free_bytes: float, bytes_per_token: float, block_size: int, mean_len: int,
                per_sequence_bytes: float = 0) -> int:
    """Requests of ``mean_len`` tokens a paged pool holds: each takes ``ceil(mean_len/block_size)``
    blocks, and ``per_sequence_bytes`` besides (int4's tail)."""
    _check_positive(mean_len=mean_len, bytes_per_token=bytes_per_token, block_size=block_size)
    if free_bytes < 0:
        raise SizingError(f"free memory must be >= 0, got {free_bytes}")
    per_request = blocks_per_sequence(mean_len, block_size) * block_size * bytes_per_token + per_sequence_bytes
    return int(free_bytes // per_request)


def tail_waste_bytes(bytes_per_token: float, block_size: int) -> float:
    """Most KV bytes paging can leave empty per sequence: ``block_size − 1`` tokens of its last block."""
    _check_positive(bytes_per_token=bytes_per_token, block_size=block_size)
    return (block_size - 1) * bytes_per_token


def reservation_utilization(mean_len: float, reserved_len: int) -> float:
    """Fraction of a worst-case reservation actually used: mean length ÷ reserved length."""
    _check_positive(reserved_len=reserved_len)
    if not 0 <= mean_len <= reserved_len:
        raise SizingError(f"mean length must be in [0, {reserved_len}], got {mean_len}")
    return mean_len / reserved_len


@dataclass(frozen=True)
class ReservationPlan:
    """What worst-case reservation does to a KV budget, next to paging.

    ``reserved_bytes``/``used_bytes``/``idle_bytes`` are per request; ``*_total`` are for ``users``.
    """

    bytes_per_token: float
    max_model_len: int
    mean_len: float
    users: int
    block_size: int
    reserved_bytes: float
    used_bytes: float
    utilization: float
    reserved_total: float
    used_total: float
    idle_total: float
    tail_waste_bytes: float


def reservation_plan(bytes_per_token: float, max_model_len: int, mean_len: float, users: int,
                     block_size: int = 16) -> ReservationPlan:
    """Memory reserved, used and left idle when ``users`` requests each reserve ``max_model_len``."""
    if users < 0:
        raise SizingError(f"users must be >= 0, got {users}")
    reserved = kv_bytes_per_request(bytes_per_token, max_model_len)
    used = bytes_per_token * mean_len
    return ReservationPlan(
        bytes_per_token=bytes_per_token, max_model_len=max_model_len, mean_len=mean_len, users=users,
        block_size=block_size, reserved_bytes=reserved, used_bytes=used,
        utilization=reservation_utilization(mean_len, max_model_len), reserved_total=users * reserved,
        used_total=users * used, idle_total=users * (reserved - used),
        tail_waste_bytes=tail_waste_bytes(bytes_per_token, block_size),
    )


def weight_element_bytes(precision: str) -> float:
    """Bytes per weight for ``bf16``/``fp16``/``fp32``/``fp8``/``int8``/``int4``."""
    try:
        return WEIGHT_ELEMENT_BYTES[precision.lower()]
    except KeyError:
        raise SizingError(f"unknown weight precision {precision!r}; known: {', '.join(WEIGHT_ELEMENT_BYTES)}") from None


def weight_bytes(params: float, precision: str, group_size: int | None = None, scale_bytes: float = 2.0) -> float:
    """Bytes of a model's weights: 2P at 16-bit, P at 8-bit, 0.5P at 4-bit.

    With ``group_size`` a quantized precision also stores one ``scale_bytes`` scale per group of
    that many weights (e.g. 4-bit with 128-weight groups and bf16 scales adds P/64 bytes);
    16- and 32-bit weights have no scales, so the group size does not apply to them.
    """
    _check_positive(params=params)
    core = params * weight_element_bytes(precision)
    if group_size is None or precision.lower() not in QUANTIZED:
        return core
    _check_positive(group_size=group_size)
    return core + math.ceil(params / group_size) * scale_bytes


def kv_memory_left(card_bytes: float, weights: float, overhead_bytes: float = 0.0,
                   memory_fraction: float = 1.0) -> float:
    """Bytes left for the KV cache on a card: ``card × fraction − weights − overhead`` (≥ 0 or an error)."""
    if not 0 < memory_fraction <= 1:
        raise SizingError(f"memory fraction must be in (0, 1], got {memory_fraction}")
    left = card_bytes * memory_fraction - weights - overhead_bytes
    if left < 0:
        raise SizingError(f"the weights ({weights:.4g} B) and overhead ({overhead_bytes:.4g} B) do not fit in "
                          f"{card_bytes * memory_fraction:.4g} B of card memory")
    return left


def decode_bytes_per_step(weights: float, bytes_per_token: float = 0.0, context_len: int = 0, batch: int = 1) -> float:
    """Bytes one decode step reads: every weight once, plus each stream's KV at its context length."""
    _check_positive(batch=batch)
    return weights + batch * bytes_per_token * context_len


def decode_tokens_per_s(bandwidth: float, weights: float, bytes_per_token: float = 0.0,
                        context_len: int = 0, batch: int = 1) -> float:
    """Most decode tokens/s one stream can get: bandwidth ÷ bytes read per step.

    A step makes one token for each of ``batch`` streams, so the batch's total is ``batch`` times
    this; the weights are read once per step whatever the batch, which is why batching pays.
    """
    _check_positive(bandwidth=bandwidth)
    return bandwidth / decode_bytes_per_step(weights, bytes_per_token, context_len, batch)


def prefill_seconds(params: float, prompt_tokens: int, flops: float, head_params: float = 0.0) -> float:
    """Least seconds a prefill takes: ``2 × params × prompt tokens ÷ FLOP/s``.

    Attention's own (quadratic) FLOPs are left out. ``head_params`` splits off an LM head that
    runs once, for the one position sampled, rather than for every prompt token (then
    ``params`` is the decoder body alone); with the default 0, ``params`` covers everything.
    """
    _check_positive(params=params, flops=flops)
    if prompt_tokens < 0 or head_params < 0:
        raise SizingError(f"prompt_tokens and head_params must be >= 0, got {prompt_tokens}, {head_params}")
    return 2.0 * (params * prompt_tokens + head_params) / flops


def _check_positive(**values: float) -> None:
    for name, value in values.items():
        if not value > 0 or math.isinf(value):
            raise SizingError(f"{name} must be a positive finite number, got {value}")
