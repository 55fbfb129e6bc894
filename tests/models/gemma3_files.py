"""A tiny random-weight Gemma 3 GGUF: the 270M file's tokenizer (so its prepared tokenizer, built
once per machine, is reused as it is), six layers of hidden 64 with a 32-token window on four of
them (layers 2 and 5 global: one full KV group and two window groups), every 2-D tensor Q8_0.
Serving it takes seconds; what it computes is noise, which is all a test of paging needs."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

from pagedserve.config import cache_dir
from tests.helpers.references import build_once

TINY = dict(hidden=64, heads=2, kv_heads=1, head_dim=32, intermediate=128, layers=6, pattern=3, window=32,
            context=1024)
_FORMAT = 1  # bump when what is written changes


def tiny_gemma3_gguf(real_gguf: Path) -> Path:
    """The tiny file, written once per machine into the project cache (reading the 262k-token
    vocabulary out of ``real_gguf`` takes the ``gguf`` reader seconds)."""
    st = Path(real_gguf).stat()
    key = hashlib.sha256(f"{real_gguf}:{st.st_size}:{st.st_mtime_ns}:{TINY}:{_FORMAT}".encode()).hexdigest()[:12]
    out = cache_dir() / "test-models" / f"tiny-gemma3-{key}.gguf"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    return build_once(out, lambda tmp: _write(real_gguf, tmp))


def _write(real_gguf: Path, out: Path) -> None:
    import gguf
    from gguf import GGMLQuantizationType as T
    from gguf import GGUFValueType as V
    from gguf import quants

    reader = gguf.GGUFReader(real_gguf)
    w = gguf.GGUFWriter(str(out), "gemma3")
    t = TINY
    w.add_context_length(t["context"])
    w.add_embedding_length(t["hidden"])
    w.add_block_count(t["layers"])
    w.add_feed_forward_length(t["intermediate"])
    w.add_head_count(t["heads"])
    w.add_head_count_kv(t["kv_heads"])
    w.add_key_length(t["head_dim"])
    w.add_value_length(t["head_dim"])
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(1_000_000.0)
    w.add_sliding_window(t["window"])
    w.add_sliding_window_pattern(t["pattern"])
    for name, field in reader.fields.items():  # the tokenizer exactly as the real file has it
        if name.startswith("tokenizer."):
            sub = field.types[1] if field.types[0] == V.ARRAY else None
            w.add_key_value(name, field.contents(), field.types[0], sub_type=sub)
    vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    rng = np.random.default_rng(0)
    h, hd, inter = t["hidden"], t["head_dim"], t["intermediate"]

    def q8(name: str, rows: int, cols: int) -> None:
        x = rng.normal(0, 0.2, (rows, cols)).astype(np.float32)
        w.add_tensor(name, quants.quantize(x, T.Q8_0), raw_dtype=T.Q8_0)

    def norm(name: str, size: int) -> None:  # llama.cpp stores Gemma's 1 + w
        w.add_tensor(name, (1 + rng.normal(0, 0.1, size)).astype(np.float32))

    q8("token_embd.weight", vocab, h)
    for i in range(t["layers"]):
        p = f"blk.{i}."
        for n in ("attn_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm"):
            norm(p + n + ".weight", h)
        norm(p + "attn_q_norm.weight", hd)
        norm(p + "attn_k_norm.weight", hd)
        q8(p + "attn_q.weight", t["heads"] * hd, h)
        q8(p + "attn_k.weight", t["kv_heads"] * hd, h)
        q8(p + "attn_v.weight", t["kv_heads"] * hd, h)
        q8(p + "attn_output.weight", h, t["heads"] * hd)
        q8(p + "ffn_gate.weight", inter, h)
        q8(p + "ffn_up.weight", inter, h)
        q8(p + "ffn_down.weight", h, inter)
    norm("output_norm.weight", h)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
