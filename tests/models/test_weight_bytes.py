"""The weight bytes the engine logs are the bytes it holds, and a tied embedding is held once.

A tied LM head used to get a prepacked (oneDNN) copy of the embedding matrix: SmolLM2 dequantized
to bf16 was logged as 310.6 MiB for 256.6 MiB of weights. Now the logits read the one table.
"""

from __future__ import annotations

import logging
import re

import pytest
import torch
from safetensors import safe_open

from pagedserve.models.packed import PackedLinear, PanelLinear, TileLinear, can_pack


def _checkpoint_bytes(model_dir, element_size: int | None = None) -> int:
    """Bytes of every tensor the checkpoint stores (each once), at ``element_size`` if given."""
    total = 0
    for f in model_dir.glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            for name in st.keys():
                t = st.get_slice(name)
                numel = 1
                for d in t.get_shape():
                    numel *= d
                total += numel * (element_size or torch.empty((), dtype=getattr(torch, {
                    "F32": "float32", "BF16": "bfloat16", "F16": "float16"}[t.get_dtype()])).element_size())
    return total


@pytest.mark.parametrize("dtype, size", [("float32", 4), ("bfloat16", 2)])
def test_tied_embedding_is_held_and_counted_once(checkpoint_dir, caplog, dtype, size):
    from pagedserve.config import EngineConfig
    from pagedserve.engine.core.engine_core import EngineCore

    model_dir = checkpoint_dir("llama-tied")
    with caplog.at_level(logging.INFO, logger="pagedserve.engine.core"):
        core = EngineCore(EngineConfig(model=str(model_dir), dtype=dtype, num_kv_blocks=8, max_model_len=128))
    model = core.runner.model
    assert model.lm_head is None  # the logits read the embedding table itself: no second copy
    stored = _checkpoint_bytes(model_dir, size)
    screen = model.head_screen  # greedy steps' int8 copy of the head (models/head_screen.py), over the same table
    assert screen is None or screen.weight.data_ptr() == model.embed_tokens.weight.data_ptr()
    extra = 0 if screen is None else screen.nbytes
    assert core.weight_bytes == stored + extra
    resident = {t.data_ptr(): t.nbytes for t in model.state_dict().values()}
    packed = sum(getattr(m, "packed_nbytes", 0) for m in model.modules())
    assert sum(resident.values()) + packed == stored
    if can_pack(getattr(torch, dtype), torch.device("cpu")):  # the other linears are still prepacked
        assert sum(isinstance(m, (PackedLinear, PanelLinear, TileLinear)) for m in model.modules()) == 2 * 4  # qkv, o, gate_up, down
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("loaded "))
    logged = float(re.search(r"weights as stored ([\d.]+) MiB", line).group(1))
    assert logged == round((stored + extra) / 2**20, 1)
