"""Load a Llama-family model from a local Hugging Face directory, a hub id (safetensors) or a GGUF file."""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm.auto import tqdm

from pagedserve.config import EngineConfig
from pagedserve.kernels import cpu_has_native_bf16, native_ops
from pagedserve.models.gemma3 import Gemma3Architecture
from pagedserve.models.gguf import gguf_source, load_gguf_model
from pagedserve.models.half_linear import choose_decode_weights, store_linears_16bit
from pagedserve.models.head_screen import build_head_screen
from pagedserve.models.llama import LlamaForCausalLM, ModelArchitecture
from pagedserve.models.packed import pack_linears
from pagedserve.models.quant import quantize_model, weight_bytes

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_HUB_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt", "*.jinja"]


def resolve_model_dir(model: str, revision: str | None = None) -> Path:
    """The Hugging Face-style directory to load ``model`` from: a GGUF file's prepared directory, a
    local directory as is, a standard model built (or the default model and ``gemma-3-270m``
    fetched) on first use, else a hub id, downloaded (or taken from the HF cache)."""
    from pagedserve.models.default import DEFAULT_MODEL_NAME, ensure_default_model
    from pagedserve.models.gemma3_file import GEMMA3_MODEL_NAME, ensure_gemma3_model
    from pagedserve.models.gguf import find_gguf_file, prepare_gguf_dir
    from pagedserve.models.standard import STANDARD_MODELS, ensure_standard_model

    path = Path(model).expanduser()
    gguf = find_gguf_file(path)
    if gguf is not None:
        return prepare_gguf_dir(gguf)
    if path.is_dir():
        return path
    if path.exists() or model.startswith((".", "/", "~")):
        raise FileNotFoundError(f"model path {model!r} is neither a GGUF file nor a directory with a Hugging Face "
                                "checkpoint")
    if model in STANDARD_MODELS:
        return ensure_standard_model(model)
    if model.lower() == DEFAULT_MODEL_NAME.lower():
        return prepare_gguf_dir(ensure_default_model())
    if model.lower() == GEMMA3_MODEL_NAME:
        return prepare_gguf_dir(ensure_gemma3_model())
    from huggingface_hub import snapshot_download

    logger.info("fetching %s from the Hugging Face hub (or its local cache)", model)
    return Path(snapshot_download(model, revision=revision, allow_patterns=_HUB_PATTERNS))


def resolve_dtype(requested: str, hf_config, device: torch.device, cpu_isa: str = "auto"
                  ) -> tuple[torch.dtype, str, torch.dtype]:
    """The compute dtype, why it was chosen (the engine logs both), and the dtype of the KV pools'
    ``auto`` (the compute dtype, except that a 16-bit checkpoint computed in float32 only because
    this CPU lacks native bf16 keeps bfloat16 KV: float32 would halve the seats a budget holds).

    ``auto`` takes the checkpoint's dtype, except that 16-bit compute on a CPU depends on the CPU:
    bfloat16 where it multiplies bf16 natively (AVX-512 BF16 or AMX; a float16 checkpoint becomes
    bfloat16 there), float32 elsewhere, where torch emulates bf16 several times slower than float32
    (measured 7x on an AVX2 EPYC); ``cpu_isa`` (``--cpu-isa``) below ``avx512`` decides as for a CPU
    without it. Quantized GGUF weights stay quantized either way; their kernels quantize the
    activations themselves (:mod:`pagedserve.models.gguf_linear`)."""
    if requested != "auto":
        return DTYPES[requested], "asked for with --dtype", DTYPES[requested]
    # a name or a torch dtype; float32 when absent or none of DTYPES
    saved = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    saved = DTYPES.get(str(saved).removeprefix("torch."), torch.float32)
    name = str(saved).removeprefix("torch.")
    if saved in (torch.float16, torch.bfloat16) and device.type == "cpu":
        if cpu_has_native_bf16(cpu_isa):
            return (torch.bfloat16, f"auto: the checkpoint's {name}, computed in bfloat16 (this CPU has native bf16)",
                    torch.bfloat16)
        # the cap, not the CPU, is what leaves native bf16 out when the CPU itself has it
        cpu = f"--cpu-isa {cpu_isa} stands for a CPU with" if cpu_has_native_bf16() else "this CPU has"
        return torch.float32, (f"auto: the checkpoint is {name}, but {cpu} no native bf16 (AVX-512 BF16 or "
                               "AMX), where float32 is several times faster; KV stays bfloat16"), torch.bfloat16
    return saved, f"auto: the checkpoint's {name}", saved


def _read_checkpoint(model_dir: Path) -> dict[str, torch.Tensor]:
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {model_dir}")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in tqdm(list(f.keys()), desc=f"loading {file.name}", unit="tensor", leave=False,
                             disable=len(files) == 1 and len(f.keys()) < 200):
                tensors[name.removeprefix("model.")] = f.get_tensor(name)
    return tensors


# Our fused projections and the Hugging Face ones they concatenate, in order (the first names the group).
_FUSED = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
          "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}


def _fused_state_dict(raw: dict[str, torch.Tensor], arch: ModelArchitecture) -> dict[str, torch.Tensor]:
    """Map Hugging Face names onto ours, concatenating q/k/v and gate/up into fused weights."""
    out = {name: t for name, t in raw.items()
           if "rotary_emb" not in name and not (name == "lm_head.weight" and arch.tie_word_embeddings)}
    for name in list(out):
        for fused, parts in _FUSED.items():
            if f".{parts[0]}." in name:
                prefix, suffix = name.split(f".{parts[0]}.")
                out[f"{prefix}.{fused}.{suffix}"] = torch.cat([out.pop(f"{prefix}.{p}.{suffix}") for p in parts])
    return out


def load_model(model_dir: Path, arch: ModelArchitecture, dtype: torch.dtype, device: torch.device,
               c: EngineConfig) -> LlamaForCausalLM:
    """Build the model of ``arch`` on ``device`` in ``dtype`` and fill it from the checkpoint (its
    safetensors, or the GGUF file behind a prepared directory), as the engine's resolved config ``c``
    asks (its ``max_model_len`` and ``attention_backend``): ``quantization`` (:mod:`~pagedserve.models.quant`),
    ``decode_weights`` (:mod:`~pagedserve.models.half_linear`), ``gguf_activations``
    (:mod:`~pagedserve.models.gguf_linear`), ``pack_weights`` (:mod:`~pagedserve.models.packed`),
    ``native_kernels`` (False: nothing is compiled) and ``group_kernels``; a GGUF's quantized tensors
    stay quantized under ``dtype`` ``auto``, are dequantized to an asked-for one. Each choice is logged."""
    checkpoint_dtype = None  # unknown or mixed (a GGUF file): auto then keeps float32
    weight_format = c.quantization  # what choose_decode_weights is told the linears hold
    gguf = gguf_source(model_dir)
    if gguf is not None:  # a prepared GGUF directory: weights straight from the GGUF file
        keep = c.quantization == "none" and c.dtype == "auto"
        model = load_gguf_model(gguf, arch, dtype, device, c.max_model_len, c.attention_backend, keep_quantized=keep,
                                native_kernels=c.native_kernels and device.type == "cpu",
                                activations=c.gguf_activations, group_kernels=c.group_kernels)
        weight_format = "GGUF, kept quantized" if keep else weight_format
    elif isinstance(arch, Gemma3Architecture):
        raise ValueError(f"{model_dir}: Gemma 3 loads from its GGUF file only (--model gemma-3-270m, or a .gguf path)")
    else:
        # Built on the meta device and filled by assignment: no random initialization of weights
        # the checkpoint replaces anyway (the rotary tables: float32, then the model's dtype as before).
        model = LlamaForCausalLM.on_meta(arch, c.max_model_len, c.attention_backend, device)
        state = _fused_state_dict(_read_checkpoint(model_dir), arch)
        dtypes = {t.dtype for t in state.values() if t.is_floating_point()}
        checkpoint_dtype = dtypes.pop() if len(dtypes) == 1 else None  # None: the checkpoint mixes several
        missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
        if unexpected:
            raise ValueError(f"checkpoint has weights this model does not use: {sorted(unexpected)[:5]}")
        if missing:
            raise ValueError(f"checkpoint lacks weights: {sorted(missing)[:5]}")
        model.to(device=device, dtype=dtype)
    model.layers[0].self_attn.rotary.float()  # cos/sin tables stay float32
    model.eval().requires_grad_(False)
    # None (torch paths) off the CPU, with native_kernels off, or where the kernels can't be built
    ops = native_ops() if device.type == "cpu" and c.native_kernels else None
    if c.quantization != "none":
        full = weight_bytes(model)
        quantize_model(model, c.quantization, group_ops=ops if c.group_kernels else None)
        logger.info("weights quantized to %s at load: %.1f MiB (from %.1f MiB in %s)", c.quantization,
                    weight_bytes(model) / 2**20, full / 2**20, str(dtype).removeprefix("torch."))
    half, why = choose_decode_weights(c.decode_weights, checkpoint_dtype, dtype, device, weight_format,
                                      ops is not None and hasattr(ops, "half_linear"))
    logger.info("decode weights: %s (%s)", str(half if half is not None else dtype).removeprefix("torch."), why)
    if half is not None:  # before prepacking, which then finds no plain float32 linear left
        store_linears_16bit(model, half, ops)
    if device.type == "cpu" and c.head_screen:  # before prepacking, which leaves no plain head rows
        model.head_screen, why = build_head_screen(model, ops)
        logger.info("LM head screen: %s", why if model.head_screen is not None else f"none ({why})")
    if c.quantization == "none" and c.pack_weights != "none":
        # CPU: bf16 into the tile layout where the CPU has AMX-BF16 (W2 1.26x oneDNN's, W1 level) or
        # AVX512-BF16 (vdpbf16ps on a Zen 4: W2 1.51x, W1 +2-4 %), the rest prepacked for oneDNN.
        # Float32 panels are opt-in: through the server at rate inf (64-row decode batches,
        # 1,024-token prefill chunks) they measured 0.68x oneDNN's output tokens/s.
        pack_linears(model, ops, layout=c.pack_weights)
    if device.type == "cpu":
        model.use_native_ops(ops)
    return model
