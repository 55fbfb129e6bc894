"""Every fast attention backend against the plain-torch reference, on the same paged inputs.
(The native kernels themselves are tested in tests/kernels.)"""

from __future__ import annotations

import pytest
import torch

from pagedserve.models.attention import (ATTENTION_BACKENDS, FUSED_DECODE_MAX_GROUP, fused_attention,
                                         reference_attention, write_kv)
from tests.helpers.paged_inputs import head_major, paged_batch, quantized


@pytest.mark.parametrize("backend", sorted(set(ATTENTION_BACKENDS) - {"reference"}))
@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_backend_matches_reference(backend, dtype, atol):
    q, k, v, meta = paged_batch([1, 5, 17, 33], [(7, 7), (5, 30), (1, 9)], dtype=dtype)
    want = reference_attention(q, k, v, meta, 0.3)
    got = ATTENTION_BACKENDS[backend](q, k, v, meta, 0.3)
    assert torch.allclose(got.float(), want.float(), atol=atol)


@pytest.mark.parametrize("backend", ["matmul", "fused"])
def test_long_chunks_in_causal_blocks_match_the_reference(backend):
    """Chunks of more than _CAUSAL_BLOCK_ROWS queries go in blocks, each against the keys up to its last
    query (a whole prompt, and a chunk after a cached prefix), with the reference's values."""
    from pagedserve.models import attention

    assert attention._causal_block_rows(torch.float32) < 300 and attention._causal_block_rows(torch.bfloat16) < 300
    q, k, v, meta = paged_batch([3], [(300, 300), (290, 410)], block_size=16, heads=6, kvh=2, num_blocks=64)
    want = reference_attention(q, k, v, meta, 0.2)
    got = ATTENTION_BACKENDS[backend](q, k, v, meta, 0.2)
    assert torch.allclose(got, want, atol=1e-5)


def test_reference_matches_dense_causal_attention():
    """One contiguous prompt: the paged reference equals plain causal attention."""
    q, k, v, meta = paged_batch([], [(12, 12)], kvh=2, heads=2)
    out = reference_attention(q, k, v, meta, 0.5)
    table = meta.prefills[0][3]
    kk = k[table].flatten(0, 1)[:12].transpose(0, 1)
    vv = v[table].flatten(0, 1)[:12].transpose(0, 1)
    dense = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1), kk, vv, is_causal=True, scale=0.5)
    assert torch.allclose(out, dense.transpose(0, 1), atol=1e-5)


def test_write_kv_puts_each_token_in_its_slot():
    k_cache = torch.zeros(4, 2, 1, 3)
    v_cache = torch.zeros(4, 2, 1, 3)
    k = torch.arange(9, dtype=torch.float32).view(3, 1, 3)
    slots = torch.tensor([5, 0, 6])  # block 2 slot 1, block 0 slot 0, block 3 slot 0
    write_kv(k_cache, v_cache, k, -k, slots)
    assert torch.equal(k_cache[2, 1, 0], k[0, 0])
    assert torch.equal(k_cache[0, 0, 0], k[1, 0])
    assert torch.equal(v_cache[3, 0, 0], -k[2, 0])


@pytest.mark.parametrize("kind", ["auto", "int8"])
def test_fused_backend_decodes_wider_query_groups_through_matmul(kind):
    # 16 query heads on one KV head: more than the kernel's register-held group, so the fused
    # backend must answer through the matmul path, not fail inside the step loop.
    heads = 2 * FUSED_DECODE_MAX_GROUP
    q, k, v, meta = paged_batch([1, 17, 40], [(5, 30)], block_size=16, kvh=1, heads=heads, hd=64)
    k_pool, v_pool = (head_major(k), head_major(v)) if kind == "auto" else (quantized(k, kind), quantized(v, kind))
    want = reference_attention(q, k_pool if kind != "auto" else k, v_pool if kind != "auto" else v, meta, 0.125)
    got = fused_attention(q, k_pool, v_pool, meta, 0.125)
    assert torch.allclose(got, want, atol=1e-5)
