"""KV bytes per token: the one formula the engine sizes its pool with and the planner quotes.

Plain arithmetic, no torch: the planner imports it from here (sizing lives with the KV cache it
describes; the planner depends on kv/, never the other way round).
"""

from __future__ import annotations

# Bytes per stored element for each KV precision (int4 packs two values in a byte).
KV_ELEMENT_BYTES = {"float32": 4.0, "fp32": 4.0, "bf16": 2.0, "bfloat16": 2.0, "fp16": 2.0, "float16": 2.0,
                    "fp8": 1.0, "int8": 1.0, "int4": 0.5}
# A quantized cache stores float16 scales: one per K and per V vector (int8, fp8; int4's V). int4's
# K stores per block, head and channel a float8 step and an int8 zero point (kv/int4.py).
SCALE_BYTES = 2
INT4_KEY_CHANNEL_BYTES = 2
QUANTIZED_KV = frozenset({"fp8", "int8", "int4"})
DEFAULT_BLOCK_SIZE = 16  # EngineConfig.block_size's default


class SizingError(ValueError):
    """Inputs to a sizing formula that make no sense (negative memory, unknown precision, ...)."""


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, bytes_per_element: float) -> float:
    """KV cache bytes one token occupies: K and V, in every layer, for every KV head."""
    return 2 * num_layers * num_kv_heads * head_dim * bytes_per_element


def kv_element_bytes(precision: str) -> float:
    """Bytes per KV element for ``bf16``/``fp16``/``fp8``/``int8``/``int4`` (or ``fp32``)."""
    try:
        return KV_ELEMENT_BYTES[precision.lower()]
    except KeyError:
        raise SizingError(f"unknown KV precision {precision!r}; known: {', '.join(KV_ELEMENT_BYTES)}") from None


def kv_scale_bytes_per_token(num_layers: int, num_kv_heads: int) -> int:
    """Bytes of scales one token adds to a quantized cache: one per K and V vector, per layer."""
    return 2 * num_layers * num_kv_heads * SCALE_BYTES


def kv_pool_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, precision: str,
                            block_size: int = DEFAULT_BLOCK_SIZE) -> int:
    """The bytes one token really takes in a KV pool of ``precision``: what the engine sizes its
    pool by and the planner quotes, so the two agree exactly.

    The elements (:func:`kv_bytes_per_token`), plus, for a quantized precision (fp8, int8,
    int4), one float16 scale per K and per V vector (:func:`kv_scale_bytes_per_token`): int8 KV
    is not half of bf16 but half plus ``4 / head_dim`` of it. int4's keys instead take a float8
    step and an int8 zero point per channel per ``block_size`` tokens (``2 × head_dim / block_size``
    bytes a token and head: 8 at head_dim 64 in blocks of 16, so 40 + 34 bytes against bf16's 256,
    ×0.289), rounded up to whole bytes. int4 also holds :func:`kv_tail_bytes_per_sequence` per
    running sequence.
    """
    name = precision.lower()
    elements = kv_bytes_per_token(num_layers, num_kv_heads, head_dim, kv_element_bytes(name))
    if name not in QUANTIZED_KV:
        return int(elements)
    if name != "int4":
        return int(elements) + kv_scale_bytes_per_token(num_layers, num_kv_heads)
    if head_dim % 2:
        raise SizingError(f"int4 KV packs two values per byte and needs an even head_dim, got {head_dim}")
    key_scales = -(-num_layers * num_kv_heads * head_dim * INT4_KEY_CHANNEL_BYTES // block_size)
    return int(elements) + int(key_scales) + num_layers * num_kv_heads * SCALE_BYTES


def kv_tail_bytes_per_sequence(num_layers: int, num_kv_heads: int, head_dim: int, precision: str,
                               block_size: int = DEFAULT_BLOCK_SIZE) -> int:
    """The bytes int4 KV holds per running sequence besides its blocks: its open block's K and V at
    float16 (kv/int4.py's tail: one block of a 16-bit cache); 0 for the other precisions."""
    is_int4 = precision.lower() == "int4"
    return int(kv_bytes_per_token(num_layers, num_kv_heads, head_dim, 2)) * block_size if is_int4 else 0


def window_blocks(window: int, block_size: int) -> int:
    """Most blocks a sliding-window layer ever needs for one sequence: its next query at position
    ``L`` sees keys ``L - window + 1 .. L``: ``window`` positions, which straddle at most
    ``ceil((window - 1) / block_size) + 1`` blocks (33 for Gemma 3's 512 in blocks of 16)."""
    if window < 1 or block_size < 1:
        raise SizingError(f"window and block_size must be >= 1, got {window} and {block_size}")
    return -(-(window - 1) // block_size) + 1


def hybrid_kv_bytes_per_sequence(context_len: int, block_size: int, layer_bytes_per_token: float,
                                 full_layers: int, window_layers: dict[int, int] | None = None,
                                 free_window_blocks: bool = True) -> float:
    """KV bytes one sequence of ``context_len`` tokens holds when its layers form groups: the
    ``full_layers`` keep a block per ``block_size`` tokens of the whole context; each sliding
    layer (``window_layers``: window → number of layers), once blocks wholly outside its window are
    freed, keeps at most :func:`window_blocks` (without freeing, as many as a full layer).

    ``layer_bytes_per_token``: one layer's K and V per token (:func:`kv_pool_bytes_per_token` with
    ``num_layers=1``). Gemma 3 270M (3 global + 15 window-512 layers) at 4,000 tokens, 16-token
    blocks: 18 × 250 = 4,500 layer-blocks without freeing, 3 × 250 + 15 × 33 = 1,245 with it: 3.6×
    the seats at one budget."""
    if context_len < 0 or full_layers < 0:
        raise SizingError(f"context_len and full_layers must be >= 0, got {context_len} and {full_layers}")
    blocks = -(-context_len // block_size)
    layer_blocks = full_layers * blocks
    for window, layers in (window_layers or {}).items():
        layer_blocks += layers * (min(blocks, window_blocks(window, block_size)) if free_window_blocks else blocks)
    return layer_blocks * block_size * layer_bytes_per_token
