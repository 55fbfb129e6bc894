"""Small GGUF files written from random-weight Hugging Face checkpoints, the way llama.cpp's
``convert_hf_to_gguf.py`` writes a Llama model (Q/K rows permuted for its interleaved rotary,
tied embeddings as no ``output.weight``), with the ``gguf`` package's writer and quantizers."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_LAYER = {
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def gguf_name(hf_name: str) -> str:
    if hf_name in _NAMES:
        return _NAMES[hf_name]
    _, _, i, rest = hf_name.split(".", 3)
    return f"blk.{i}.{_LAYER[rest]}"


def permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's permutation of Q/K rows (Hugging Face halves → interleaved pairs)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_weights(model_dir: Path) -> dict[str, np.ndarray]:
    return {k: v.float().numpy() for k, v in load_file(str(model_dir / "model.safetensors")).items()}


def write_gguf(model_dir: Path, out: Path, tensor_type: str = "F32", arch: str | None = None,
               tokenizer: bool = True) -> Path:
    """Write ``model_dir`` (a llama / qwen2 / qwen3 checkpoint with a byte-level BPE tokenizer) as a
    GGUF file whose 2-D weights are all ``tensor_type`` (norms and biases stay F32). Without
    ``tokenizer`` the file has weights and model metadata only (quick to parse; not servable)."""
    import gguf
    from gguf import GGMLQuantizationType as T
    from gguf import quants

    cfg = json.loads((model_dir / "config.json").read_text())
    model_type = cfg["model_type"]
    arch = arch or model_type
    w = gguf.GGUFWriter(str(out), arch)
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    rope = cfg.get("rope_parameters") or {}
    w.add_rope_freq_base(float(rope.get("rope_theta") or cfg.get("rope_theta") or 10000.0))
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    if tokenizer:
        _add_tokenizer(w, model_dir)
    qtype = T[tensor_type]
    for name, x in hf_weights(model_dir).items():
        if name == "lm_head.weight" and cfg.get("tie_word_embeddings"):
            continue
        if model_type == "llama" and (".q_proj." in name or ".k_proj." in name):
            x = permute(x, heads if ".q_proj." in name else kv_heads)
        if x.ndim == 1 or qtype == T.F32:
            w.add_tensor(gguf_name(name), x.astype(np.float32))
        elif qtype == T.F16:
            w.add_tensor(gguf_name(name), x.astype(np.float16))
        else:
            w.add_tensor(gguf_name(name), quants.quantize(x.astype(np.float32), qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def _add_tokenizer(w, model_dir: Path) -> None:
    tok = json.loads((model_dir / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    tokens = [None] * len(vocab)
    for piece, i in vocab.items():
        tokens[i] = piece
    special = {t["id"] for t in tok["added_tokens"] if t.get("special")}
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3 if i in special else 1 for i in range(len(tokens))])
    w.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in tok["model"]["merges"]])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)
    tc = json.loads((model_dir / "tokenizer_config.json").read_text())
    template = tc.get("chat_template")
    if template is None and (model_dir / "chat_template.jinja").exists():
        template = (model_dir / "chat_template.jinja").read_text()
    if template:
        w.add_chat_template(template)


def reference_weight(x: np.ndarray, tensor_type: str) -> torch.Tensor:
    """What a ``tensor_type`` GGUF tensor of ``x`` dequantizes to, by the ``gguf`` package's own
    quantizer and dequantizer (Hugging Face row order: the permutation moves whole rows)."""
    from gguf import GGMLQuantizationType as T
    from gguf import quants

    qtype = T[tensor_type]
    if x.ndim == 1 or qtype == T.F32:
        return torch.from_numpy(x.astype(np.float32))
    if qtype == T.F16:
        return torch.from_numpy(x.astype(np.float16).astype(np.float32))
    return torch.from_numpy(np.ascontiguousarray(quants.dequantize(quants.quantize(x.astype(np.float32), qtype), qtype),
                                                 dtype=np.float32))
