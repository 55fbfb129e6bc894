"""oneDNN-prepacked linears: the same numbers as ``nn.Linear``, with every weight byte counted."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pagedserve.models.llama import LlamaForCausalLM, ModelArchitecture
from pagedserve.models.packed import PackedLinear, can_pack, pack_linears
from pagedserve.models.quant import weight_bytes

pytestmark = pytest.mark.skipif(not can_pack(torch.float32, torch.device("cpu")),
                                reason="this torch build has no oneDNN")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 7, 300])
def test_packed_linear_equals_nn_linear(dtype, bias, rows):
    if not can_pack(dtype, torch.device("cpu")):
        pytest.skip(f"oneDNN cannot pack {dtype} here")
    torch.manual_seed(0)
    linear = nn.Linear(96, 160, bias=bias).to(dtype)
    x = torch.randn(rows, 96).to(dtype)
    want = linear(x)
    got = PackedLinear.from_linear(linear)(x)
    if dtype == torch.bfloat16:  # same kernel family, same accumulation: bit-identical
        assert torch.equal(got, want)
    else:
        assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)
    # any leading shape, as nn.Linear accepts
    x3 = torch.randn(2, rows, 96).to(dtype)
    assert torch.allclose(PackedLinear.from_linear(linear)(x3).float(), linear(x3).float(), atol=1e-2)


def _arch(tied: bool) -> ModelArchitecture:
    return ModelArchitecture(model_type="llama", hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                             num_kv_heads=2, head_dim=16, vocab_size=500, rms_norm_eps=1e-6, rope_theta=10000.0,
                             rope_scaling=None, max_position_embeddings=256, tie_word_embeddings=tied,
                             qkv_bias=True, qk_norm=False, sliding_window=None)


@pytest.mark.parametrize("tied", [False, True])
def test_pack_linears_packs_every_linear_and_counts_its_bytes(tied):
    if not can_pack(torch.bfloat16, torch.device("cpu")):
        pytest.skip("oneDNN cannot pack torch.bfloat16 on this CPU (no AVX-512): nothing is packed")
    torch.manual_seed(0)
    model = LlamaForCausalLM(_arch(tied), 256, "reference").to(torch.bfloat16).eval()
    hidden = torch.randn(5, 64).to(torch.bfloat16)
    before = model.compute_logits(hidden)
    bytes_before = weight_bytes(model)
    linears = sum(isinstance(m, nn.Linear) for m in model.modules())
    packed = pack_linears(model)
    assert packed == linears  # a tied head is not packed: a packed copy would hold the table twice
    assert not any(type(m) is nn.Linear for m in model.modules())
    assert (model.lm_head is None) == tied
    assert torch.equal(model.compute_logits(hidden), before)
    assert weight_bytes(model) == bytes_before
