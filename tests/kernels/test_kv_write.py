"""The native KV writes (kernels/kv_write.cpp) against the torch paths: int8 / fp8 against
:meth:`~pagedserve.kv.quant.QuantizedKVCache.write`'s (:func:`~pagedserve.kv.quant.quantize_kv`),
the same codes and scales for every model dtype, strided rows, zero vectors and rounding ties; int4
against :meth:`~pagedserve.kv.int4.Int4KVCache.write`'s: the same bits in the blocks, steps, zero
points, scales and tail slots, write after write, and on rounding ties, with 4 bits a key channel
and with a mix of 1 to 8."""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels import kernel_error, native_ops
from pagedserve.kv.block_manager import BlockManager
from pagedserve.kv.cache import allocate_kv_caches
from pagedserve.kv.int4 import quantize_key_blocks, uniform_key_bits
from pagedserve.kv.quant import QuantizedKVCache, quantize_kv
from pagedserve.models.attention import write_kv
from tests.helpers.paged_inputs import mixed_key_bits

needs_kernels = pytest.mark.skipif(native_ops() is None, reason=f"native kernels unavailable: {kernel_error()}")
CPU = torch.device("cpu")
NO_ROWS = torch.zeros(0, dtype=torch.long)
NO_BITS = torch.zeros(0, dtype=torch.uint8)
KEY_BITS = {"uniform": uniform_key_bits, "mixed": mixed_key_bits}  # (kvh, hd) -> [kvh, hd] uint8


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_the_int8_and_fp8_write_stores_the_torch_writes_bits(kind, dtype):
    """Rows of every magnitude (1e-3 to 1e3, fp8's range and past it), a zero vector (the scale's
    floor), a vector whose codes sit on rounding ties (127 sets the scale to 1: 0.5, 1.5, 2.5, -3.5
    round to even), heads strided inside a wider row as the fused QKV output's are, scattered slots,
    and a second write over some of the same slots: codes and scales equal to the torch path's."""
    g = torch.Generator().manual_seed(3)
    torch_pool, native_pool = (QuantizedKVCache.allocate(12, 4, 3, 32, kind, dtype, CPU, ops)
                               for ops in (None, native_ops()))
    assert torch_pool.native is None and native_pool.native is not None
    for write in range(2):
        wide = (torch.randn(19, 3, 40, generator=g) * torch.logspace(-3, 3, 19)[:, None, None]).to(dtype)
        x = wide[:, :, 4:36]  # head_dim contiguous, rows and heads strided
        x[0] = 0
        x[1, 2] = torch.tensor([127.0, 0.5, 1.5, 2.5, -3.5] + [0.0] * 27, dtype=dtype)
        slots = torch.randperm(48, generator=g)[:19]
        torch_pool.write(slots, x)
        native_pool.write(slots, x)
        assert torch.equal(native_pool.data, torch_pool.data), f"write {write}: codes differ"
        assert torch.equal(native_pool.scales, torch_pool.scales), f"write {write}: scales differ"
    if kind == "int8":  # the last write's tie row as stored (scale 1): ties to even
        assert native_pool.data.view(-1, 3, 32)[slots[1], 2, :5].tolist() == [127, 0, 2, 2, -4]


@needs_kernels
def test_the_int8_write_refuses_what_it_cannot_store():
    """An unknown kind, the other kind's storage, a slot past the pool, a slot list of another
    length: a one-line error each, before anything is written."""
    ops = native_ops()
    pool = QuantizedKVCache.allocate(4, 4, 2, 32, "int8", torch.float32, CPU)
    fp8 = QuantizedKVCache.allocate(4, 4, 2, 32, "fp8", torch.float32, CPU)
    x = torch.ones(2, 2, 32)
    slots = torch.tensor([0, 5])
    for args, message in [((pool.data, pool.scales, slots, x, "int4"), "unknown kind int4"),
                          ((fp8.data, fp8.scales, slots, x, "int8"), "int8 data must be contiguous int8"),
                          ((pool.data, pool.scales, torch.tensor([0, 16]), x, "int8"), "slot 16 out of range"),
                          ((pool.data, pool.scales, torch.tensor([0]), x, "int8"), "one per token")]:
        with pytest.raises(RuntimeError, match=message):
            ops.quantized_kv_write(*args)
    assert not pool.data.any() and not pool.scales.view(torch.int16).any()


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_int4_rotation_is_the_matmul_and_a_rows_bits_whatever_its_batch(dtype):
    """int4_rotate: the values' Hadamard rotation in float32, within float32 rounding of torch's
    matmul, each row the same bits alone, in a batch, and read from a strided view (as the decode
    stack's V rows, a view into the fused QKV output, are)."""
    from pagedserve.kv.quant import hadamard_matrix

    ops = native_ops()
    g = torch.Generator().manual_seed(5)
    rotation = hadamard_matrix(64)
    wide = torch.randn(37, 3, 80, generator=g).to(dtype)
    x = wide[:, :, 8:72]
    got = ops.int4_rotate(x, rotation)
    assert got.dtype == torch.float32 and got.shape == x.shape
    torch.testing.assert_close(got, x.float() @ rotation, rtol=1e-5, atol=1e-5)
    for row in (0, 17, 36):
        assert torch.equal(ops.int4_rotate(x[row:row + 1].contiguous(), rotation), got[row:row + 1])
    with pytest.raises(RuntimeError, match=r"rotation must be a contiguous float32 \[head_dim, head_dim\]"):
        ops.int4_rotate(x, hadamard_matrix(32))


def _pairs(num_blocks=24, block_size=16, kvh=2, hd=32, tail_slots=3, key_bits=None):
    """Two K/V pool pairs of the same shape: one writing through torch, one through the kernel."""
    def pools(ops):
        k, v = allocate_kv_caches(1, num_blocks, block_size, kvh, hd, torch.float32, CPU, "int4", tail_slots,
                                  native_ops=ops)[0]
        return (k if key_bits is None else k.with_key_bits(key_bits)), v
    return pools(None), pools(native_ops())


def _same_storage(a, b) -> None:
    for name in ("data", "scales", "tail", "zero_points"):
        x, y = getattr(a, name), getattr(b, name)
        if x is not None:
            assert torch.equal(x.view(torch.uint8), y.view(torch.uint8)), name
    assert torch.equal(a.tails.slot_of, b.tails.slot_of)


@needs_kernels
@pytest.mark.parametrize("bits", ["uniform", "mixed"])
@pytest.mark.parametrize("bs", [16, 8, 4])
def test_the_native_write_stores_the_torch_writes_bits_step_after_step(bs, bits):
    """Three sequences through prompt chunks of every size, mixed decode steps with padding, a
    chunk that fills blocks whole, freed blocks' slots taken again, and a rollback (its reopened
    block goes through torch on both sides): every pool byte equal after every write. The token
    counts are 16's; smaller blocks fill more often in the same steps."""
    g = torch.Generator().manual_seed(7)
    num_blocks = 24 * 16 // bs
    (tk, tv), (nk, nv) = _pairs(num_blocks, bs, key_bits=KEY_BITS[bits](2, 32))
    assert tk.native is None and nk.native is not None
    bm = BlockManager(num_blocks, bs)
    bm.on_release = lambda ids: (tk.tails.release(ids), nk.tails.release(ids))
    pos = {1: 0, 2: 0, 3: 0}

    def step(lens: dict[int, int], pad: int = 0) -> None:
        slots = []
        for seq, n in lens.items():
            assert bm.allocate(seq, pos[seq] + n)
            table = torch.tensor(bm.block_ids(seq))
            p = torch.arange(pos[seq], pos[seq] + n)
            slots.append(table[p // bs] * bs + p % bs)
            pos[seq] += n
        mapping = torch.cat([*slots, torch.full((pad,), -1)])
        x = torch.randn(len(mapping), 2, 32, generator=g) * torch.linspace(0.1, 8, 32) + torch.linspace(-3, 5, 32)
        write_kv(tk, tv, x, x * 0.5, mapping)
        write_kv(nk, nv, x, x * 0.5, mapping)
        _same_storage(tk, nk)
        _same_storage(tv, nv)

    step({1: 5})
    step({1: 40, 2: 3})  # finishes 1's first block, fills two more whole, opens one; 2 takes the freed slot
    for _ in range(20):
        step({1: 1, 2: 1}, pad=2)  # decodes fill blocks from their tail slots
    step({3: 33})
    bm.free(2)
    for _ in range(12):
        step({1: 1, 3: 1})
    step({1: 3, 3: 1})  # 1 at 80: its block holding 75 quantized
    bm.truncate(1, 75)  # a rollback into that block: written again mid-block, it is reopened
    pos[1] = 75
    step({1: 2})
    step({1: 4, 3: 1})
    bm.free(1)
    bm.free(3)
    assert tk.tails.num_open == nk.tails.num_open == 0


@needs_kernels
@pytest.mark.parametrize("bits", ["uniform", "mixed"])
def test_the_kernel_rounds_ties_to_even_as_torch_does(bits):
    """Keys and values that sit exactly between two codes, with a step and a scale of 7/64: a
    multiply by its reciprocal lands off 10 of those ties (checked below), a division on them, so
    the kernel has to divide as torch does to give torch's codes (mixed bits: the 4-bit channels
    still on ties, the others on their own steps, each span divided by its channel's levels)."""
    key_bits = KEY_BITS[bits](1, 32)
    ops = native_ops()
    step = 0.109375
    ties = (torch.arange(16, dtype=torch.float32) + 0.5) * step
    assert (ties * (1 / step) != ties / step).sum() >= 8
    keys = torch.stack([ties, ties - 8 * step, ties.flip(0), ties * 2], -1).repeat(1, 1, 8).view(16, 1, 32)
    keys[:, 0, -1] = torch.linspace(-128, 127, 16) * 0.5  # an off-zero channel at the int8 zero point's edge
    row = torch.cat([ties[:14] - 7 * step, torch.tensor([7.0, -7.0]) * step])  # scale 7 step / 7
    values = row.repeat(16, 2).view(16, 1, 32)
    for x, per_channel in [(keys, True), (values, False)]:
        x16 = x.to(torch.float16)
        if per_channel:
            data = torch.zeros(2, 1, 32 * 16 // 2, dtype=torch.uint8)
            scales = torch.zeros(2, 1, 32, dtype=torch.float8_e4m3fn)
            zero_points, bits_arg = torch.zeros(2, 1, 32, dtype=torch.int8), key_bits
            want = quantize_key_blocks(x16.float().unsqueeze(0), key_bits)
        else:
            data = torch.zeros(2, 16, 1, 16, dtype=torch.uint8)
            scales, zero_points = torch.zeros(2, 16, 1, dtype=torch.float16), torch.zeros(0, dtype=torch.int8)
            bits_arg, want = NO_BITS, quantize_kv(x16.float().unsqueeze(0), "int4")
        tail = torch.zeros(1, 16, 1, 32, dtype=torch.float16)
        ops.int4_kv_write(x16, tail, data, scales, zero_points, bits_arg, torch.tensor([1]), torch.tensor([-1]),
                          torch.arange(16), torch.arange(16), NO_ROWS, NO_ROWS)
        assert torch.equal(data[1], want[0][0])
        assert torch.equal(scales[1].view(torch.uint8), want[1][0].view(torch.uint8))
        if per_channel:
            assert torch.equal(zero_points[1], want[2][0])
        assert not data[0].any() and not tail.any()  # nothing else written


@needs_kernels
def test_the_kernel_refuses_a_plan_out_of_range():
    ops = native_ops()
    (_, _), (k, _) = _pairs(num_blocks=4, tail_slots=2)
    x = torch.zeros(2, 2, 32, dtype=torch.float16)
    with pytest.raises(RuntimeError, match="tail row"):
        ops.int4_kv_write(x, k.tail, k.data, k.scales, k.zero_points, k.key_bits, NO_ROWS, NO_ROWS, NO_ROWS, NO_ROWS,
                          torch.tensor([2 * 16]), torch.tensor([0]))
    with pytest.raises(RuntimeError, match="full block"):
        ops.int4_kv_write(x, k.tail, k.data, k.scales, k.zero_points, k.key_bits, torch.tensor([4]),
                          torch.tensor([-1]), torch.tensor([0]), torch.tensor([0]), NO_ROWS, NO_ROWS)
    with pytest.raises(RuntimeError, match="token"):
        ops.int4_kv_write(x, k.tail, k.data, k.scales, k.zero_points, k.key_bits, NO_ROWS, NO_ROWS, NO_ROWS, NO_ROWS,
                          torch.tensor([0]), torch.tensor([2]))


@needs_kernels
@pytest.mark.parametrize("bad, message", [
    (torch.full((2, 32), 4, dtype=torch.int64), "key bits must be contiguous uint8"),  # dtype
    (torch.full((1, 32), 4, dtype=torch.uint8), "key bits must be contiguous uint8"),  # one head short
    (torch.full((2, 64), 4, dtype=torch.uint8)[:, ::2], "key bits must be contiguous uint8"),  # strided
    (torch.tensor([[0, 8] + [4] * 30] * 2, dtype=torch.uint8), "must be 1..8 a channel, got 0"),
    (torch.tensor([[9, 3] + [4] * 30] * 2, dtype=torch.uint8), "must be 1..8 a channel, got 9"),
    (torch.tensor([[4] * 32, [5] + [4] * 31], dtype=torch.uint8),
     r"must total 128 \(4 \* head_dim\) a KV head, got 129 for KV head 1"),
])
def test_the_kernel_refuses_bad_key_bits(bad, message):
    """Bits the planes cannot hold: each channel needs 1..8, and a head's 4 · head_dim in all to fill
    its bytes exactly (kv/int4.py: check_key_bits)."""
    ops = native_ops()
    (_, _), (k, v) = _pairs(num_blocks=4, tail_slots=2)
    x = torch.zeros(16, 2, 32, dtype=torch.float16)
    with pytest.raises(RuntimeError, match=message):
        ops.int4_kv_write(x, k.tail, k.data, k.scales, k.zero_points, bad, torch.tensor([0]), torch.tensor([-1]),
                          torch.arange(16), torch.arange(16), NO_ROWS, NO_ROWS)
    assert not k.data.any() and not k.scales.view(torch.uint8).any()  # refused before writing
    with pytest.raises(RuntimeError, match="key_bits must be empty for values"):
        ops.int4_kv_write(x, v.tail, v.data, v.scales, NO_ROWS.to(torch.int8), k.key_bits, NO_ROWS, NO_ROWS,
                          NO_ROWS, NO_ROWS, NO_ROWS, NO_ROWS)


@needs_kernels
def test_the_kernel_refuses_a_pool_of_the_other_layout():
    """Keys' data is bit planes [blocks, kvh, head_dim * bs / 2], values' [blocks, bs, kvh, head_dim / 2]:
    the same bytes, so each is checked against its own shape."""
    ops = native_ops()
    (_, _), (k, v) = _pairs(num_blocks=4, tail_slots=2)
    x = torch.zeros(1, 2, 32, dtype=torch.float16)
    with pytest.raises(RuntimeError, match=r"data must be contiguous uint8 \[blocks, kvh, head_dim \* bs / 2\]"):
        ops.int4_kv_write(x, k.tail, v.data, k.scales, k.zero_points, k.key_bits, NO_ROWS, NO_ROWS, NO_ROWS, NO_ROWS,
                          NO_ROWS, NO_ROWS)
    with pytest.raises(RuntimeError, match=r"data must be contiguous uint8 \[blocks, bs, kvh, head_dim / 2\]"):
        ops.int4_kv_write(x, v.tail, k.data, v.scales, NO_ROWS.to(torch.int8), NO_BITS, NO_ROWS, NO_ROWS, NO_ROWS,
                          NO_ROWS, NO_ROWS, NO_ROWS)


@needs_kernels
@pytest.mark.parametrize("bs", [16, 8, 4])
def test_the_native_key_read_gives_the_torch_reads_keys_for_every_width(bs):
    """``int4_key_values`` (what prompt chunks read of earlier blocks) returns exactly
    :func:`~pagedserve.kv.int4.key_block_values`' float32 keys, for channels of 1 to 8 bits, and a
    pool read through it (a block table's selection) equals one read through torch; bad bits are refused."""
    from pagedserve.kv.int4 import key_block_values

    g = torch.Generator().manual_seed(bs)
    bits = mixed_key_bits(3, 64, seed=bs)
    x = torch.randn(9, bs, 3, 64, generator=g) * torch.rand(1, 1, 3, 64, generator=g) * 20 + 3
    data, steps, zeros = quantize_key_blocks(x, bits)
    want = key_block_values(data, steps, zeros, bits)
    assert torch.equal(native_ops().int4_key_values(data, steps, zeros, bits), want)
    (tk, _), (nk, _) = _pairs(9, bs, kvh=3, hd=64, key_bits=bits)
    for k in (tk, nk):
        k.data[:], k.scales[:], k.zero_points[:] = data, steps, zeros
    table = torch.tensor([[4, 0, 8], [2, 2, 7]])
    assert torch.equal(nk[table].dequantize(), tk[table].dequantize())
    with pytest.raises(RuntimeError, match="key bits must total"):
        native_ops().int4_key_values(data, steps, zeros, torch.full((3, 64), 5, dtype=torch.uint8))
