"""Small random-weight Hugging Face checkpoints of every supported architecture, for parity tests."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from pagedserve.models.standard import shared_tokenizer_dir

COMMON = dict(vocab_size=32000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
              bos_token_id=1, eos_token_id=2, rms_norm_eps=1e-6,
              # A wide init makes next-token distributions peaky, so greedy parity is not decided
              # by float rounding between near-equal logits.
              initializer_range=0.25)

ARCHITECTURES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "llama3-rope": ("LlamaConfig", "LlamaForCausalLM", {"rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}, "rope_theta": 500000.0}),
    "llama-tied": ("LlamaConfig", "LlamaForCausalLM", {"tie_word_embeddings": True}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": None}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 32}),
}


def checkpoint_config(arch: str):
    """The transformers config :func:`build_checkpoint` builds ``arch``'s checkpoint with."""
    import transformers

    config_cls, _, extra = ARCHITECTURES[arch]
    return getattr(transformers, config_cls)(**{**COMMON, **extra})


def build_checkpoint(arch: str, out_dir: Path, seed: int = 0) -> Path:
    """Save a float32 random-weight checkpoint of ``arch`` with the standard tokenizer."""
    import transformers

    model_cls = ARCHITECTURES[arch][1]
    config = checkpoint_config(arch)
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).float()
    if arch == "qwen2":  # biases start at zero; give them values so the qkv-bias path is exercised
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    if arch == "qwen3":
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.q_norm.weight.normal_(1, 0.3)
                layer.self_attn.k_norm.weight.normal_(1, 0.3)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    for f in shared_tokenizer_dir().iterdir():
        shutil.copy(f, out_dir / f.name)
    return out_dir


def load_hf(model_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
