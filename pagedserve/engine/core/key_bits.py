"""Each int4 key channel's bits (kv/int4.py stores keys as bit planes), calibrated once per model.

A query leans on a few key channels, and a wide channel costs more score error per level than a
narrow one: a channel's share of the score error at b bits is about E[q_c²] · E[range_c²] / (2^b − 1)²,
with range_c the channel's spread over a block of post-RoPE keys. :func:`calibrate_key_bits` runs
the model once over a text shipped with the package (``key_bits_text.txt``: everyday prose, 3,072
tokens in independent chunks of 512) and records both factors per layer, KV head and channel;
:func:`allocate_bits` then gives each head's ``4 · head_dim`` bits out one at a time, to the channel
whose error the next bit cuts most (1 to 8 bits a channel). The bytes stay those of 4 bits
everywhere. On SmolLM2 (docs/QUANTIZATION.md) the engine's needle recall at 2k, 400 needles, went
from 6.8 points under float32's at 4 bits everywhere to level with it, and its perplexity cost from
+1.20 % to +0.24 %; examples/int4_kv_study.py found the bits the same calibrated on another text:
they follow the model.

The bits are cached under ``$PAGEDSERVE_CACHE/key-bits/``, keyed by the model directory's files,
the compute dtype, the weight quantization, the block size and the text: a model is calibrated
once (seconds), then read back.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from importlib import resources
from pathlib import Path

import torch

from pagedserve.config import EngineConfig, cache_dir
from pagedserve.kv.int4 import KEY_BITS, MAX_KEY_BITS
from pagedserve.engine.core.profile_run import prefill_metadata
from pagedserve.models.attention import AttentionBackend, AttentionMetadata
from pagedserve.models.llama import ModelArchitecture

logger = logging.getLogger(__name__)

CALIBRATION_TEXT = "key_bits_text.txt"
CALIBRATION_TOKENS, CHUNK = 3072, 512
_FORMAT = 1  # bump when the statistics or the allocation change: cached bits are then recomputed


def allocate_bits(weight: torch.Tensor, total: int, low: int = 1, high: int = MAX_KEY_BITS) -> torch.Tensor:
    """Bits per channel (``low`` .. ``high``, ``total`` in all) minimising ``sum_c weight_c / (2^b_c − 1)²``:
    from ``low`` everywhere, each next bit to the channel it helps most (the error is convex in b,
    so the greedy order is optimal)."""
    bits = torch.full(weight.shape, low, dtype=torch.long)

    def error(b: torch.Tensor) -> torch.Tensor:
        return weight / (2.0 ** b.float() - 1) ** 2

    while int(bits.sum()) < total:
        gain = torch.where(bits < high, error(bits) - error((bits + 1).clamp(max=high)), torch.tensor(-1.0))
        bits[int(gain.argmax())] += 1
    return bits


class _KeyStatistics:
    """An attention backend around the model's own that records, per layer (told apart by its K
    pool), the mean square of each query channel (over the query heads of a KV head) and of each
    key channel's range over a block."""

    def __init__(self, backend: AttentionBackend, pools: list, block_size: int):
        self.backend, self.block_size = backend, block_size
        self.layer_of = {id(k): i for i, (k, _) in enumerate(pools)}
        self.q2: dict[int, torch.Tensor] = {}
        self.r2: dict[int, torch.Tensor] = {}

    def _add(self, sums: dict[int, torch.Tensor], layer: int, x: torch.Tensor) -> None:
        sums[layer] = x if layer not in sums else sums[layer] + x

    def write(self, k_cache, v_cache, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        blocks = k.float().view(-1, self.block_size, *k.shape[1:])  # [blocks, bs, kvh, hd]: whole blocks only
        span = blocks.amax(1) - blocks.amin(1)
        self._add(self.r2, self.layer_of[id(k_cache)], (span ** 2).mean(0))
        self.backend.write(k_cache, v_cache, k, v, slot_mapping)

    def attend(self, q: torch.Tensor, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        kvh = k_cache.shape[2]
        grouped = q.float().view(q.shape[0], kvh, -1, q.shape[-1])  # [T, kvh, group, hd]
        self._add(self.q2, self.layer_of[id(k_cache)], (grouped ** 2).mean((0, 2)))
        return self.backend.attend(q, k_cache, v_cache, meta, scale)


@torch.inference_mode()
def calibrate_key_bits(model: torch.nn.Module, token_ids: list[int], num_kv_heads: int, head_dim: int,
                       block_size: int, dtype: torch.dtype, chunk: int = CHUNK) -> torch.Tensor:
    """``[layers, kv_heads, head_dim]`` uint8 key bits for ``model`` from ``token_ids`` (whole chunks
    of ``chunk`` tokens, each a sequence of its own from position 0)."""
    chunks = len(token_ids) // chunk
    if chunks < 1 or chunk % block_size:
        raise ValueError(f"key-bit calibration needs {chunk} tokens at least and a block size dividing {chunk}")
    dev = next(model.parameters()).device
    num_blocks = chunk // block_size
    pools = [tuple(torch.zeros(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=dev)
                   for _ in range(2)) for _ in model.layers]
    stats = _KeyStatistics(model.attention, pools, block_size)
    positions = torch.arange(chunk, device=dev)
    meta = prefill_metadata(positions, [(0, chunk, chunk, torch.arange(num_blocks, device=dev))])
    model.attention = AttentionBackend(stats.attend, stats.write)
    try:
        for c in range(chunks):
            model(torch.tensor(token_ids[c * chunk:(c + 1) * chunk], device=dev), positions, pools, meta)
    finally:
        model.attention = stats.backend
    bits = torch.empty(len(pools), num_kv_heads, head_dim, dtype=torch.uint8)
    for layer in range(len(pools)):
        weight = (stats.q2[layer] * stats.r2[layer]).cpu()
        for h in range(num_kv_heads):
            bits[layer, h] = allocate_bits(weight[h], KEY_BITS * head_dim).to(torch.uint8)
    return bits


def calibration_tokens(tokenizer_source: str) -> list[int]:
    """The shipped text's first :data:`CALIBRATION_TOKENS` tokens under the model's tokenizer (loaded
    here only, as the structured-output compiler loads it: the core otherwise sees token ids alone)."""
    from transformers import AutoTokenizer

    text = resources.files(__package__).joinpath(CALIBRATION_TEXT).read_text(encoding="utf-8")
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_source)
    return tokenizer.encode(text, add_special_tokens=False)[:CALIBRATION_TOKENS]


def _cache_key(model_dir: Path, *settings: object) -> str:
    text = resources.files(__package__).joinpath(CALIBRATION_TEXT).read_bytes()
    files = sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in Path(model_dir).iterdir() if p.is_file())
    blob = repr((str(Path(model_dir).resolve()), files, settings, hashlib.sha256(text).hexdigest(), _FORMAT))
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def model_key_bits(model: torch.nn.Module, model_dir: Path, tokenizer_source: str, arch: ModelArchitecture,
                   dtype: torch.dtype, c: EngineConfig) -> torch.Tensor:
    """The key bits of ``model`` (:func:`calibrate_key_bits` on the shipped text, in chunks of
    :data:`CHUNK` tokens or the whole blocks of the config's ``max_model_len`` if shorter), from the cache
    when this model, dtype, weight quantization and block size were calibrated before; logged either way."""
    chunk = min(CHUNK, c.max_model_len // c.block_size * c.block_size)
    key = _cache_key(model_dir, dtype, c.quantization, c.block_size, chunk)
    path = cache_dir() / "key-bits" / f"{Path(model_dir).name}-{key}.pt"
    if path.exists():
        bits = torch.load(path)
        logger.info("int4 KV: key bits per channel from %s", path)
    else:
        t0 = time.monotonic()
        tokens = calibration_tokens(tokenizer_source)
        bits = calibrate_key_bits(model, tokens, arch.num_kv_heads, arch.head_dim, c.block_size, dtype, chunk)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
        torch.save(bits, tmp)
        tmp.replace(path)  # whole or absent: a reader never sees half a file
        logger.info("int4 KV: key bits per channel calibrated on %d tokens of %s in %.1f s, cached in %s",
                    len(tokens) // chunk * chunk, CALIBRATION_TEXT, time.monotonic() - t0, path)
    counts = torch.bincount(bits.flatten().long(), minlength=MAX_KEY_BITS + 1)[1:].tolist()
    logger.info("int4 KV: key channels at 1..%d bits: %s (4 on average, the bytes of 4 bits everywhere)",
                MAX_KEY_BITS, " ".join(map(str, counts)))
    return bits
