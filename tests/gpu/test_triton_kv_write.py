"""The Triton KV write against the torch write paths: the same slots, the same bits."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from pagedserve.kernels.triton_paged.kv_write import write_kv  # noqa: E402
from pagedserve.kernels.triton_paged.pools import PoolView  # noqa: E402
from pagedserve.kv.cache import HeadMajorKVCache  # noqa: E402
from pagedserve.kv.quant import QuantizedKVCache  # noqa: E402
from tests.gpu.conftest import gpu_only  # noqa: E402


def _step(tokens, kvh, hd, dtype, device, num_slots, seed=0):
    """Random K and V for ``tokens`` tokens at distinct random slots, the last one a padding row (-1)."""
    g = torch.Generator().manual_seed(seed)
    k = (3 * torch.randn(tokens, kvh, hd, generator=g)).to(dtype).to(device)
    v = torch.randn(tokens, kvh, hd, generator=g).to(dtype).to(device)
    slots = torch.randperm(num_slots, generator=g)[:tokens]
    slots[-1] = -1
    return k, v, slots.to(device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_float_pools_get_each_token_in_its_slot(dtype, device):
    nb, bs, kvh, hd = 6, 16, 2, 64
    k, v, slots = _step(20, kvh, hd, dtype, device, nb * bs)
    head_major = [HeadMajorKVCache(nb, bs, kvh, hd, dtype, device) for _ in range(2)]
    token_major = [torch.zeros(nb, bs, kvh, hd, dtype=dtype, device=device) for _ in range(2)]
    write_kv(PoolView.head_major(head_major[0].data), PoolView.head_major(head_major[1].data), k, v, slots)
    write_kv(PoolView.token_major(token_major[0]), PoolView.token_major(token_major[1]), k, v, slots)

    want_k = torch.zeros(nb * bs, kvh, hd, dtype=dtype, device=device)
    want_v = torch.zeros_like(want_k)
    want_k[slots[:-1]], want_v[slots[:-1]] = k[:-1], v[:-1]  # the padding row writes nothing
    all_blocks = torch.arange(nb, device=device)
    for got_k, got_v in ((head_major[0][all_blocks], head_major[1][all_blocks]), (token_major[0], token_major[1])):
        assert torch.equal(got_k.reshape(nb * bs, kvh, hd), want_k)
        assert torch.equal(got_v.reshape(nb * bs, kvh, hd), want_v)


def _quantized_pair(kind, dtype, device, nb=6, bs=16, kvh=2, hd=64):
    return [QuantizedKVCache.allocate(nb, bs, kvh, hd, kind, dtype, device) for _ in range(2)]


def _check_same_bits(kind, dtype, device):
    k, v, slots = _step(30, 2, 64, dtype, device, 6 * 16)
    torch_pools, triton_pools = _quantized_pair(kind, dtype, device), _quantized_pair(kind, dtype, device)
    real = slots >= 0
    torch_pools[0].write(slots[real], k[real])
    torch_pools[1].write(slots[real], v[real])
    write_kv(*(PoolView.token_major(p.data, kind, p.scales) for p in triton_pools), k, v, slots)
    for want, got in zip(torch_pools, triton_pools):
        assert torch.equal(got.scales, want.scales)
        assert torch.equal(got.data, want.data)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_int8_write_stores_the_torch_paths_bits(dtype, device):
    _check_same_bits("int8", dtype, device)


@gpu_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fp8_write_stores_the_torch_paths_bits(dtype, device):
    _check_same_bits("fp8", dtype, device)


def test_mismatched_k_and_v_pools_are_refused(device):
    k_pool = torch.zeros(2, 16, 1, 16, device=device)
    v_pool = HeadMajorKVCache(2, 16, 1, 16, torch.float32, device)
    k = torch.zeros(1, 1, 16, device=device)
    with pytest.raises(ValueError, match="one layout"):
        write_kv(PoolView.token_major(k_pool), PoolView.head_major(v_pool.data), k, k,
                 torch.zeros(1, dtype=torch.long, device=device))
