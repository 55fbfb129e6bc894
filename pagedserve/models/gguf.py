"""GGUF files (llama.cpp's and Ollama's format) as models: metadata, tokenizer and weights.

A ``.gguf`` file (or a directory holding exactly one) is turned once into a prepared Hugging
Face-style directory in the project cache (:func:`prepare_gguf_dir`): ``config.json`` from the
GGUF metadata, the tokenizer (``tokenizer.json``, its config and the chat template, converted by
transformers' GGUF tokenizer converter), ``generation_config.json`` with the EOS ids, and
``gguf_source.json`` pointing back at the file. The engine then sees an ordinary model directory;
:func:`load_gguf_model` reads the weights straight from the (memory-mapped) GGUF file.

Weights, by GGUF tensor type:

* ``F32``, ``F16``, ``BF16`` → the model dtype.
* ``Q4_0``, ``Q4_1``, ``Q5_0``, ``Q5_1``, ``Q8_0``, ``Q4_K``, ``Q5_K``, ``Q6_K`` with the native
  kernels (a CPU where they build) → :class:`~pagedserve.models.gguf_linear.GGUFLinear`: the
  file's blocks as they are, one segment per format when a fused layer's parts differ.
* Without them: ``Q8_0`` → :class:`Int8GroupedLinear` (``w = q × s`` per group of 32 input
  columns, the int8 values as stored); ``Q4_0`` (``w = (q − 8) × d``) and ``Q4_1`` (``w = q × d +
  m``) → :class:`Int4Linear` with group 32 (``w = (q − 8) × s + z``): the same nibbles, ``s = d``
  and ``z = 0`` (Q4_0) or ``z = m + 8d`` (Q4_1).
* Other types the ``gguf`` package can dequantize → dequantized to the model dtype, with a
  warning naming them; any other type is an error naming it.

Quantized tensors are kept quantized when ``keep_quantized`` (the engine's default: ``--dtype
auto`` and ``--quantization none``): no full-precision copy is ever made. With an explicit
``--dtype`` they are dequantized to it, and with ``--quantization int8|int4`` the dequantized
model is then quantized the project's way, as for any checkpoint.

llama.cpp's converter permutes the rows of Llama's Q and K projections (its rotary pairs are
interleaved, Hugging Face's are halves); the loader undoes it, on quantized rows too (blocks run
along the input dimension, so a row permutation moves whole blocks).
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
import logging
import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import torch
from torch import nn

from pagedserve.config import cache_dir
from pagedserve.kernels import best_isa, gguf_gemm_usable, isa_summary, native_ops
from pagedserve.models.gguf_linear import BLOCKS as KERNEL_FORMATS
from pagedserve.models.gguf_linear import ALL_ROWS, GGUFLinear, kernel_rows_default, row_bytes, widest_format
from pagedserve.models.llama import LlamaForCausalLM, ModelArchitecture, rope_inv_freq
from pagedserve.models.standard import build_once
from pagedserve.models.quant import (INT4_GROUP_SIZE, Int4Linear, Int8GroupedLinear, QuantizedEmbedding,
                                     int4_cpu_layout_is_opaque)

logger = logging.getLogger(__name__)

SOURCE_FILE = "gguf_source.json"
_PREPARED_FORMAT = 1  # bump when the prepared directory's contents change

# GGUF architecture → (Hugging Face config class, model_type, Q/K rows permuted by llama.cpp's converter)
ARCHITECTURES = {
    "llama": ("LlamaConfig", "llama", True),
    "qwen2": ("Qwen2Config", "qwen2", False),
    "qwen3": ("Qwen3Config", "qwen3", False),
    "gemma3": ("Gemma3TextConfig", "gemma3_text", False),  # its own module: pagedserve.models.gemma3
}
# Types loaded as they are: floats to the model dtype; these quantized ones into the project's formats.
FLOAT_TYPES = ("F32", "F16", "BF16")
KEPT_TYPES = ("Q8_0", "Q4_0", "Q4_1")


class GGUFError(ValueError):
    """A GGUF file this loader cannot use (architecture, tensor type, missing tensor), said in one line."""


# ---- finding and preparing ----------------------------------------------------------------

def find_gguf_file(path: Path) -> Path | None:
    """``path`` if it is a ``.gguf`` file; the one ``.gguf`` in a directory without Hugging Face
    weights; None otherwise. Several candidates or a split file are errors."""
    path = Path(path).expanduser()
    if path.is_dir() and not any(path.glob("*.safetensors")):
        candidates = sorted(path.glob("*.gguf"))
        if len(candidates) > 1:
            raise GGUFError(f"{path} holds {len(candidates)} GGUF files ({', '.join(c.name for c in candidates[:4])}"
                            f"{', ...' if len(candidates) > 4 else ''}): pass the one to load")
    else:
        candidates = [path] if path.is_file() and path.suffix.lower() == ".gguf" else []
    if not candidates:
        return None
    gguf = candidates[0]
    if "-of-" in gguf.stem and gguf.stem.rsplit("-of-", 1)[-1].isdigit():
        raise GGUFError(f"{gguf.name} is one part of a split GGUF, which is not supported: merge it first "
                        "(llama.cpp's llama-gguf-split --merge)")
    return gguf


def gguf_source(model_dir: Path) -> Path | None:
    """The GGUF file behind a prepared directory, or None for an ordinary checkpoint directory."""
    src = Path(model_dir) / SOURCE_FILE
    return Path(json.loads(src.read_text())["gguf_file"]) if src.exists() else None


def prepare_gguf_dir(gguf_path: Path) -> Path:
    """The prepared Hugging Face-style directory of ``gguf_path``, built once into the cache
    (``$PAGEDSERVE_CACHE/gguf/<name>-<key>``, keyed by the file's path, size and mtime)."""
    gguf_path = Path(gguf_path).expanduser().resolve()
    st = gguf_path.stat()
    key = hashlib.sha256(f"{gguf_path}:{st.st_size}:{st.st_mtime_ns}:{_PREPARED_FORMAT}".encode()).hexdigest()[:12]
    return build_once(cache_dir() / "gguf" / f"{gguf_path.stem}-{key}", SOURCE_FILE,
                      functools.partial(_write_prepared_dir, gguf_path))


def open_gguf(path: Path):
    """A ``gguf.GGUFReader`` over ``path`` (memory-mapped), one per file and process: parsing the
    metadata of a 50k-token vocabulary takes the reader seconds, so it is done once."""
    from gguf import GGUFReader

    return _cached_per_file(GGUFReader, path)


def open_gguf_tensors(path: Path):
    """The tensors and scalar metadata of ``path`` (:class:`~pagedserve.models.gguf_index.GGUFTensorIndex`):
    what loading the weights reads, in milliseconds where the full reader takes seconds."""
    from pagedserve.models.gguf_index import GGUFTensorIndex

    return _cached_per_file(GGUFTensorIndex, path)


def _cached_per_file(reader_cls, path: Path):
    path = Path(path).resolve()
    st = path.stat()
    return _open_cached(reader_cls, path, st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=8)
def _open_cached(reader_cls, path: Path, size: int, mtime_ns: int):  # size, mtime: a rewritten file is read anew
    return reader_cls(path)


def _write_prepared_dir(gguf_path: Path, out: Path) -> None:
    logger.info("preparing %s: config, tokenizer and chat template from its metadata, into %s (once)",
                gguf_path.name, out.parent)
    out.mkdir(parents=True)
    reader = open_gguf(gguf_path)
    config = hf_config_from_gguf(reader)
    config.save_pretrained(out)
    gen = {"bos_token_id": config.bos_token_id, "eos_token_id": _eos_ids(reader)}
    (out / "generation_config.json").write_text(json.dumps({k: v for k, v in gen.items() if v is not None}, indent=2))
    shutil.copytree(_prepared_tokenizer(gguf_path, reader), out, dirs_exist_ok=True)
    (out / SOURCE_FILE).write_text(json.dumps({
        "gguf_file": str(gguf_path), "name": _field(reader, "general.name", gguf_path.stem),
        "file_type": _field(reader, "general.file_type", None),
        "tensor_types": dict(Counter(t.tensor_type.name for t in reader.tensors)),
        "tensor_bytes": int(sum(int(t.n_bytes) for t in reader.tensors)),
    }, indent=2))


def _prepared_tokenizer(gguf_path: Path, reader) -> Path:
    """transformers' conversion of the GGUF tokenizer, saved once per distinct tokenizer (it takes
    seconds for a 50k vocabulary; GGUF files sharing a tokenizer share the result)."""
    h = hashlib.sha256()
    for name in sorted(k for k in reader.fields if k.startswith("tokenizer.")):
        h.update(name.encode())
        for part in reader.fields[name].parts:
            h.update(part.tobytes())

    def build(tmp: Path) -> None:
        if "tokenizer.ggml.model" not in reader.fields:
            raise GGUFError(f"{gguf_path.name} has no tokenizer in its metadata")
        from transformers import AutoTokenizer

        try:
            tok = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        except Exception as e:  # noqa: BLE001 - transformers raises many kinds; say which tokenizer
            raise GGUFError(f"cannot convert the {_field(reader, 'tokenizer.ggml.model', '?')!r} tokenizer of "
                            f"{gguf_path.name}: {e}") from e
        tok.save_pretrained(tmp)

    return build_once(cache_dir() / "gguf" / "tokenizers" / h.hexdigest()[:16], "tokenizer_config.json", build)


# ---- metadata -----------------------------------------------------------------------------

_MISSING = object()


def _field(reader, key: str, default=_MISSING):
    field = reader.fields.get(key)
    if field is None and default is _MISSING:
        raise GGUFError(f"GGUF metadata lacks {key!r}")
    return default if field is None else field.contents()


def gguf_architecture(reader) -> str:
    arch = _field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise GGUFError(f"unsupported GGUF architecture {arch!r}; supported: {', '.join(sorted(ARCHITECTURES))}")
    return arch


def _eos_ids(reader) -> list[int] | int | None:
    values = (_field(reader, f"tokenizer.ggml.{name}_token_id", None) for name in ("eos", "eot", "eom"))
    ids = list(dict.fromkeys(int(v) for v in values if v is not None))  # in order, each once
    return ids[0] if len(ids) == 1 else (ids or None)


def hf_config_from_gguf(reader):
    """A transformers config (``LlamaConfig``, ``Qwen2Config``, ``Qwen3Config``; ``Gemma3TextConfig`` by
    :func:`pagedserve.models.gemma3.gemma3_config_from_gguf`) from GGUF metadata."""
    import transformers

    arch = gguf_architecture(reader)
    if arch == "gemma3":
        from pagedserve.models.gemma3 import gemma3_config_from_gguf

        return gemma3_config_from_gguf(reader)
    config_cls, model_type, _ = ARCHITECTURES[arch]
    kw, rope, meta, tensors = gguf_config_fields(reader, arch, rope_theta=10000.0,
                                                 other_scaling="Llama 3's rope_freqs")
    rotary_dim = int(meta("rope.dimension_count", kw["head_dim"]))
    if rotary_dim != kw["head_dim"]:
        raise GGUFError(f"partial rotary embeddings ({rotary_dim} of {kw['head_dim']} dims) are not supported")
    if "rope_freqs.weight" in tensors:
        rope.update(_llama3_rope_from_factors(_dequantize(tensors["rope_freqs.weight"]).numpy(), rope["rope_theta"],
                                              kw["head_dim"]))
    if arch == "llama":
        kw["attention_bias"] = "blk.0.attn_q.bias" in tensors
    config = getattr(transformers, config_cls)(**kw, architectures=[config_cls.replace("Config", "ForCausalLM")])
    config.rope_parameters = rope  # set after: transformers 5 validates and may rewrite the constructor's
    return config


def gguf_config_fields(reader, arch: str, rope_theta: float, head_dim: int | None = None, other_scaling: str = ""):
    """What every architecture reads alike from GGUF metadata: the transformers config's common
    keyword arguments, the (full-attention) rope parameters, a reader of ``<arch>.<key>`` values
    and the tensors by name. ``rope_theta`` and ``head_dim``: the architecture's defaults."""
    tensors = {t.name: t for t in reader.tensors}
    meta = lambda key, default=_MISSING: _field(reader, f"{arch}.{key}", default)  # noqa: E731
    embed = tensors.get("token_embd.weight")
    if embed is None:
        raise GGUFError("GGUF file lacks tensor 'token_embd.weight'")
    heads, hidden = int(meta("attention.head_count")), int(meta("embedding_length"))
    types = {t.tensor_type.name for t in reader.tensors if len(t.shape) > 1}
    kw = dict(
        vocab_size=int(meta("vocab_size", None) or int(embed.shape[1])), hidden_size=hidden,
        intermediate_size=int(meta("feed_forward_length")), num_hidden_layers=int(meta("block_count")),
        num_attention_heads=heads, num_key_value_heads=int(meta("attention.head_count_kv", heads)),
        head_dim=int(meta("attention.key_length", head_dim or hidden // heads)),
        rms_norm_eps=float(meta("attention.layer_norm_rms_epsilon")),
        max_position_embeddings=int(meta("context_length")), tie_word_embeddings="output.weight" not in tensors,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id", None), eos_token_id=_eos_ids(reader),
        pad_token_id=_field(reader, "tokenizer.ggml.padding_token_id", None),
        dtype="bfloat16" if types - set(FLOAT_TYPES) else {"F32": "float32", "F16": "float16",
                                                           "BF16": "bfloat16"}[embed.tensor_type.name],
    )
    rope = {"rope_type": "default", "rope_theta": float(meta("rope.freq_base", rope_theta))}
    scaling = meta("rope.scaling.type", None)
    if scaling == "linear":
        rope.update(rope_type="linear", factor=float(meta("rope.scaling.factor")))
    elif scaling not in (None, "none"):
        raise GGUFError(f"unsupported GGUF rope scaling {scaling!r} for {arch} (supported: none, linear"
                        f"{', ' + other_scaling if other_scaling else ''})")
    return kw, rope, meta, tensors


def _llama3_rope_from_factors(factors: np.ndarray, theta: float, head_dim: int) -> dict:
    """Llama 3's rope scaling parameters from llama.cpp's ``rope_freqs`` tensor (one divisor per
    rotary frequency). In the smoothed band ``1/f`` is linear in ``1/wavelength``, which fixes the
    band's ends; every (low, high, original length) with those ends gives the same divisors, so
    low_freq_factor = 1 is chosen and the rest follows. The result is checked against the tensor."""
    import math

    inv = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    wavelen = 2 * math.pi / inv
    f = factors.astype(np.float64)
    factor = float(f.max())
    band = (f > 1.0 + 1e-6) & (f < factor - 1e-6 * factor)
    if factor <= 1.0 + 1e-6:
        return {}
    if band.sum() >= 2:
        # 1/f = 1/factor + s (1 - 1/factor), s = (L/λ - low) / (high - low): fit a = L/(high-low), b = low/(high-low)
        s = (1.0 / f[band] - 1.0 / factor) / (1.0 - 1.0 / factor)
        a, c = np.polyfit(1.0 / wavelen[band], s, 1)  # s = a/λ - b
        b = -c
        low, high, orig = 1.0, 1.0 + 1.0 / b, a / b
    else:  # a sharp step: any band inside the gap between the last 1 and the first ``factor`` fits
        first_scaled = float(wavelen[f > 1.0 + 1e-6].min())
        last_plain = float(wavelen[f <= 1.0 + 1e-6].max()) if (f <= 1.0 + 1e-6).any() else first_scaled / 2
        low, orig = 1.0, first_scaled * 0.999
        high = orig / (last_plain * 1.001)
    params = {"rope_type": "llama3", "factor": factor, "low_freq_factor": float(low), "high_freq_factor": float(high),
              "original_max_position_embeddings": float(orig)}
    got = rope_inv_freq(head_dim, theta, params).double().numpy()
    if not np.allclose(inv / got, f, rtol=1e-4):
        raise GGUFError("rope_freqs tensor is not of Llama 3's scaling form; unsupported")
    return params


# ---- tensors --------------------------------------------------------------------------------

def can_load(qtype) -> bool:
    """Whether tensors of this GGML type load (natively, or dequantized by the ``gguf`` package)."""
    from gguf import quants

    return qtype.name in FLOAT_TYPES + KEPT_TYPES or qtype in quants._type_traits


def _raw(t) -> torch.Tensor:
    """A tensor's bytes (a copy out of the memory map), rows first."""
    return torch.from_numpy(np.array(t.data, copy=True))


def _rows(t) -> tuple[int, int]:
    """``(rows, row length)`` of a GGUF tensor (its ``shape`` is ggml's, innermost first)."""
    dims = [int(d) for d in t.shape]
    if len(dims) == 1:
        return 1, dims[0]
    if len(dims) != 2:
        raise GGUFError(f"tensor {t.name!r} has {len(dims)} dimensions; only 1 and 2 are supported")
    return dims[1], dims[0]


def _dequantize(t) -> torch.Tensor:
    """The tensor as float32, ``[rows, row length]`` (1-D tensors stay 1-D)."""
    kind = t.tensor_type.name
    n, k = _rows(t)
    if kind in ("F32", "F16"):
        w = torch.from_numpy(np.array(t.data, dtype=np.float32))
    elif kind == "BF16":
        w = _raw(t).view(torch.bfloat16).float()
    else:  # Q8_0, Q4_0 and Q4_1 included: the package computes them as exact float32 products too
        from gguf import quants

        if not can_load(t.tensor_type):
            raise GGUFError(f"unsupported GGUF tensor type {kind} (tensor {t.name!r})")
        w = torch.from_numpy(np.ascontiguousarray(quants.dequantize(t.data, t.tensor_type), dtype=np.float32))
    return w.reshape(k) if len(t.shape) == 1 else w.reshape(n, k)


def _unpack(t) -> tuple[torch.Tensor, ...]:
    """Q8_0 (float16 d, 32 × int8), Q4_0 (d, 16 bytes) or Q4_1 (d, float16 m, 16 bytes) blocks → (q
    ``[N, K]``, d float32 ``[N, K/32]``) for Q8_0, q int8; for Q4 q uint8 in [0, 15] and a third,
    the zero point z of ``w = (q − 8) × d + z``: 0 for Q4_0, ``m + 8d`` for Q4_1 (exact in float32).
    In a Q4 block, byte j holds element j in its low nibble and element j + 16 in its high one."""
    n, k = _rows(t)
    kind = t.tensor_type.name
    size = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}[kind]
    b = _raw(t).view(n, k // 32, size)
    d = b[..., 0:2].contiguous().view(torch.float16).squeeze(-1).float()
    if kind == "Q8_0":
        return b[..., 2:].contiguous().view(torch.int8).reshape(n, k), d
    z = b[..., 2:4].contiguous().view(torch.float16).squeeze(-1).float() + 8 * d if kind == "Q4_1" else \
        torch.zeros_like(d)
    qs = b[..., size - 16:]
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1).reshape(n, k), d, z


def _unpermute_rows(x: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation (interleaved rotary pairs → Hugging Face's halves)."""
    rows = x.shape[0]
    return x.reshape(heads, rows // heads // 2, 2, *x.shape[1:]).transpose(1, 2).reshape(x.shape)


class _Part:
    """One GGUF tensor feeding (part of) a layer, with the head count to unpermute its rows by."""

    def __init__(self, tensor, heads: int | None = None):
        self.tensor, self.heads = tensor, heads

    def fix(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.heads is None else _unpermute_rows(x, self.heads)


class GGUFBuilder:
    """Turns the GGUF's tensors into our modules for every architecture's loader, tracking which were
    used and how they were loaded (the arguments are :func:`load_gguf_model`'s)."""

    def __init__(self, reader, arch: ModelArchitecture, dtype: torch.dtype, device: torch.device, keep_quantized: bool,
                 permuted: bool, native_kernels: bool | None, packed_for_cpu: bool | None, group_kernels: bool = False):
        for t in reader.tensors:
            if not can_load(t.tensor_type):
                raise GGUFError(f"unsupported GGUF tensor type {t.tensor_type.name} (tensor {t.name!r})")
        self.tensors = {t.name: t for t in reader.tensors}
        self.arch, self.dtype, self.device = arch, dtype, device
        self.keep, self.permuted = keep_quantized, permuted
        # the native kernels (default: on a CPU): GGUF blocks kept as they are (GGUFLinear)
        self.ops = native_ops() if native_kernels is not False and device.type == "cpu" else None
        self.group_ops = self.ops if group_kernels else None  # for int4 / int8 layers (--group-kernels)
        # the types that stay quantized when keep (else dequantized): as blocks with the kernels, else int8 / int4
        self.keeps = KERNEL_FORMATS if self.ops is not None else KEPT_TYPES
        # prompt chunks through the native GEMM (gguf_gemm_usable): bf16 on AVX-512 BF16 without AMX, float32
        self.gemm = self.ops is not None and gguf_gemm_usable(dtype)
        self.isa = best_isa()
        # int4 layout: the CPU kernel's (default: on a CPU), or the portable one
        self.packed_for_cpu = device.type == "cpu" if packed_for_cpu is None else packed_for_cpu
        self.used: set[str] = set()
        self.loaded: Counter = Counter()  # "Q4_1 -> int4" etc., for the log line
        self.dequantized: Counter = Counter()  # types with no native format here, dequantized

    def get(self, name: str):
        t = self.tensors.get(name)
        if t is None:
            raise GGUFError(f"GGUF file lacks tensor {name!r}")
        self.used.add(name)
        return t

    def _check(self, t, shape: tuple[int, ...]) -> None:
        n, k = _rows(t)
        got = (k,) if len(t.shape) == 1 else (n, k)
        if got != shape:
            raise GGUFError(f"tensor {t.name!r} has shape {list(got)}, the metadata implies {list(shape)}")

    def parameter(self, name: str, shape: tuple[int, ...]) -> nn.Parameter:
        """A float tensor of the file (a norm's weight, a float embedding table) in the model dtype."""
        t = self.get(name)
        self._check(t, shape)
        self._count(t, str(self.dtype).removeprefix("torch."), dequantize=True)
        return nn.Parameter(_dequantize(t).to(device=self.device, dtype=self.dtype))

    def attention_and_mlp(self, layer: nn.Module, i: int) -> None:
        """Layer ``i``'s fused QKV (and its bias where the architecture has one), output projection,
        QK-norm weights, fused gate/up and down projections, from the ``blk.<i>.`` tensors."""
        a, p, attn, mlp = self.arch, f"blk.{i}.", layer.self_attn, layer.mlp
        hq, hkv, hd = a.num_heads, a.num_kv_heads, a.head_dim
        heads = {"q": hq, "k": hkv} if self.permuted else {}  # rows to unpermute, by projection

        def qkv(kind: str) -> list[_Part]:
            return [_Part(self.get(f"{p}attn_{x}.{kind}"), heads.get(x)) for x in "qkv"]
        attn.qkv_proj = self.linear(qkv("weight"), [hq * hd, hkv * hd, hkv * hd], a.hidden_size,
                                    qkv("bias") if a.qkv_bias else None)
        attn.o_proj = self.linear([_Part(self.get(p + "attn_output.weight"))], [a.hidden_size], hq * hd)
        if a.qk_norm:
            attn.q_norm.weight = self.parameter(p + "attn_q_norm.weight", (hd,))
            attn.k_norm.weight = self.parameter(p + "attn_k_norm.weight", (hd,))
        mlp.gate_up_proj = self.linear([_Part(self.get(p + "ffn_gate.weight")), _Part(self.get(p + "ffn_up.weight"))],
                                       [a.intermediate_size] * 2, a.hidden_size)
        mlp.down_proj = self.linear([_Part(self.get(p + "ffn_down.weight"))], [a.hidden_size], a.intermediate_size)

    def _count(self, t, target: str, dequantize: bool) -> None:
        kind = t.tensor_type.name
        self.loaded[f"{kind} -> {target}"] += 1
        if dequantize and kind not in FLOAT_TYPES and not (kind in self.keeps and not self.keep):
            self.dequantized[kind] += 1

    def _blocks(self, parts: list[_Part], in_features: int, bias: torch.Tensor | None) -> GGUFLinear:
        """The parts' GGUF blocks as they are, one segment per run of parts of one format."""
        segments = []
        for kind, run in itertools.groupby(parts, key=lambda p: p.tensor.tensor_type.name):
            rows = []
            for p in run:
                rows.append(p.fix(_raw(p.tensor).view(_rows(p.tensor)[0], row_bytes(kind, in_features))))
                self._count(p.tensor, f"{kind} blocks", dequantize=False)
            segments.append((kind, torch.cat(rows)))
        return GGUFLinear(segments, in_features, bias, self.ops, gemm=self.gemm)

    def linear(self, parts: list[_Part], out_sizes: list[int], in_features: int, bias: list[_Part] | None = None,
               packed_for_cpu: bool | None = None) -> nn.Module:
        """One (fused) linear layer from ``parts`` stacked along the output dimension."""
        for p, rows in zip(parts, out_sizes):
            self._check(p.tensor, (rows, in_features))
        b = None if bias is None else torch.cat([p.fix(_dequantize(p.tensor)) for p in bias]).to(
            device=self.device, dtype=self.dtype)
        kinds = {p.tensor.tensor_type.name for p in parts}
        if self.keep and self.ops is not None and kinds <= set(KERNEL_FORMATS):
            return self._blocks(parts, in_features, b)
        kind = kinds.pop() if len(kinds) == 1 else None
        if self.keep and kind in KEPT_TYPES:
            int8 = kind == "Q8_0"
            unpacked = [[p.fix(x) for x in _unpack(p.tensor)] for p in parts]  # q, scales (int4: zeros), unpermuted
            for p in parts:
                self._count(p.tensor, f"{'int8' if int8 else 'int4'} groups of 32", dequantize=False)
            q, *scales = [torch.cat(arrays).to(self.device) for arrays in zip(*unpacked)]
            if int8:
                return Int8GroupedLinear(q, scales[0], b, 32, self.dtype, self.group_ops)
            return Int4Linear(q.to(torch.int32), *scales, b, INT4_GROUP_SIZE, self.dtype,
                              self.packed_for_cpu if packed_for_cpu is None else packed_for_cpu, self.group_ops)
        weight = torch.cat([p.fix(_dequantize(p.tensor)) for p in parts]).to(device=self.device, dtype=self.dtype)
        for p in parts:
            self._count(p.tensor, str(self.dtype).removeprefix("torch."), dequantize=True)
        linear = nn.Linear(in_features, weight.shape[0], bias=b is not None, device="meta")
        linear.weight, linear.bias = nn.Parameter(weight), None if b is None else nn.Parameter(b)
        return linear  # finish_gguf_model turns gradients off

    def quantized_table(self, t) -> nn.Module | None:
        """A kept-quantized embedding table as a lookup-capable layer, or None for a float one."""
        if not self.keep or t.tensor_type.name not in self.keeps:
            return None
        return self.linear([_Part(t)], [self.arch.vocab_size], self.arch.hidden_size, packed_for_cpu=False)


def load_gguf_model(gguf_path: Path, arch: ModelArchitecture, dtype: torch.dtype, device: torch.device,
                    max_positions: int, attention_backend: str, keep_quantized: bool = True,
                    packed_for_cpu: bool | None = None, native_kernels: bool | None = None,
                    activations: str = "int16", group_kernels: bool = False) -> LlamaForCausalLM:
    """Build the model (the Llama family's, or Gemma 3's) from a GGUF file's tensors, without ever
    materializing random weights. ``keep_quantized`` and ``native_kernels`` (default: on a CPU where
    they build): which tensors stay quantized, and as what (module docstring). ``packed_for_cpu``
    (default: on a CPU) lays int4 weights out for the CPU kernel; False keeps the readable layout
    (tests compare it with the GGUF's values). ``activations``: the GGUF kernels' (``int16`` or
    ``int8``; an LM head takes int16); ``group_kernels``: ``--group-kernels``."""
    reader = open_gguf_tensors(gguf_path)  # the vocabulary's arrays are not parsed: seconds saved
    gguf_arch = gguf_architecture(reader)
    b = GGUFBuilder(reader, arch, dtype, device, keep_quantized, ARCHITECTURES[gguf_arch][2], native_kernels,
                    packed_for_cpu, group_kernels)
    model_cls = LlamaForCausalLM
    if gguf_arch == "gemma3":
        from pagedserve.models.gemma3 import Gemma3ForCausalLM as model_cls
    model = model_cls.on_meta(arch, max_positions, attention_backend, device)
    b.used.add("rope_freqs.weight")  # read into config.json's rope parameters
    for i, layer in enumerate(model.layers):
        for norm, name in layer.GGUF_NORMS.items():
            getattr(layer, norm).weight = b.parameter(f"blk.{i}.{name}.weight", (arch.hidden_size,))
        b.attention_and_mlp(layer, i)
    model.norm.weight = b.parameter("output_norm.weight", (arch.hidden_size,))
    load_embedding_and_head(model, b, dtype)
    return finish_gguf_model(model, b, gguf_path, dtype, activations)


def load_embedding_and_head(model: nn.Module, b: GGUFBuilder, dtype: torch.dtype) -> None:
    """``model.embed_tokens`` from ``token_embd``, kept quantized where it has a format here, and the
    LM head: ``output.weight``, or the embedding table itself when tied."""
    a = b.arch
    embed = b.get("token_embd.weight")
    table = b.quantized_table(embed)
    if table is not None:
        model.embed_tokens = QuantizedEmbedding(table, dtype)
        if a.tie_word_embeddings:
            if isinstance(table, Int4Linear) and b.packed_for_cpu and int4_cpu_layout_is_opaque(b.device, group_ops=b.group_ops):
                # The lookups read the readable nibbles; torch's int4 CPU kernel (no native kernels
                # here) wants its own opaque layout for the logits matmul.
                model.lm_head = b.linear([_Part(embed)], [a.vocab_size], a.hidden_size)
                logger.info("tied %s embedding: a second int4 copy in the CPU kernel's layout for the logits",
                            embed.tensor_type.name)
            else:
                model.lm_head = table  # one table for lookups and logits
    else:
        model.embed_tokens.weight = b.parameter("token_embd.weight", (a.vocab_size, a.hidden_size))
    if not a.tie_word_embeddings:
        model.lm_head = b.linear([_Part(b.get("output.weight"))], [a.vocab_size], a.hidden_size)


def finish_gguf_model(model: nn.Module, b: GGUFBuilder, gguf_path: Path, dtype: torch.dtype, activations: str):
    """The loaded model, checked (every tensor of the file used, every parameter filled) and logged:
    the LM head's output in float32, the GGUF kernels' ``activations`` set (int16 on the LM head)."""
    if isinstance(model.lm_head, (Int8GroupedLinear, GGUFLinear)):
        model.lm_head.float_output = True  # compute_logits wants float32 anyway
    # Each layer's activations (an LM head's always at ~16 bits: near-tied logits keep their order) and
    # its rows for the integer kernels, by the activations and the format holding most of its weights
    kernel_rows: dict[str, int] = {}  # by that format (the LM head's apart), for the log
    for m in model.modules():
        if isinstance(m, GGUFLinear):
            head = m is model.lm_head
            m.residual = activations == "int16" or head
            fmt = widest_format(m.formats, m.widths)
            m.kernel_rows = kernel_rows_default(b.isa, dtype if b.gemm else None, fmt, "int16" if m.residual else "int8")
            kernel_rows[f"LM head {fmt}" if head and activations != "int16" else fmt] = m.kernel_rows
    unused = sorted(set(b.tensors) - b.used)
    if unused:
        raise GGUFError(f"GGUF file has tensors this model does not use: {unused[:5]}")
    left = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if left:
        raise GGUFError(f"not filled from the GGUF file: {left[:5]}")
    if b.dequantized:
        logger.warning("GGUF tensor types with no quantized format here, dequantized to %s: %s",
                       str(dtype).removeprefix("torch."), ", ".join(f"{k} x{v}" for k, v in sorted(b.dequantized.items())))
    if b.gemm and dtype == torch.float32 and b.isa == "avx2" and activations == "int8":
        chunks = ("int8 GEMM over the panels' weight bytes (gguf_gemm_int8; Q8_0, Q6_K and the LM head the "
                  "int16 one, Q6_K past 32 rows the float32 gguf_gemm)")
    elif b.gemm and dtype == torch.float32 and b.isa == "avx2":
        chunks = "int16 GEMM over panels widened in cache (gguf_gemm_int16; Q6_K past 32 rows the float32 gguf_gemm)"
    elif b.gemm:
        chunks = f"{str(dtype).removeprefix('torch.')} GEMM over panels dequantized in cache (gguf_gemm)"
    else:
        chunks = "dequantize + torch's GEMM"
    # by format where they differ (float32 on the AVX2 and AVX-512 paths); ALL_ROWS: never handed over
    limited = {fmt: n for fmt, n in sorted(kernel_rows.items()) if n < ALL_ROWS}
    rows = sorted(set(limited.values()))
    past = (f"more than {rows[0]} rows" if len(rows) == 1 else
            "more rows than " + ", ".join(f"{n} ({fmt})" for fmt, n in limited.items()))
    unlimited = [fmt for fmt, n in sorted(kernel_rows.items()) if n >= ALL_ROWS]
    every = f"{', '.join(unlimited)} in the integer kernels at every row count" if unlimited else ""
    kernels = ("; GGUF kernels: " + isa_summary() + (f", prompt chunks of {past}: {chunks}" if rows else "")
               + (f"; {every}" if every else "")) if b.ops is not None and kernel_rows else ""
    logger.info("loaded %s: %s%s", Path(gguf_path).name, ", ".join(f"{k} x{v}" for k, v in sorted(b.loaded.items())),
                kernels)
    return model.eval().requires_grad_(False)
