"""The int4 KV kernels alone, against int8's: one layer of `small` (12 query / 4 KV heads of 64), 64
sequences of 300 tokens decoded through the fused kernel (each instruction-set path of the int4 one),
and the block writes of a 512-token prompt chunk and of 64 decodes that each fill a block; medians.
docs/BENCHMARKS.md ("int4 KV with calibrated key bits, as bit planes") ran it from two checkouts,
one process each, alternated.

    python examples/int4_kv_kernel_timing.py [--threads 2]
"""
import argparse
import statistics
import time

import torch

from pagedserve.kernels import kernel_error, native_ops
from pagedserve.kv.cache import allocate_kv_caches
from pagedserve.models.attention import AttentionMetadata, _decode_fused, write_kv

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--threads", type=int, default=2)
args = parser.parse_args()
torch.set_num_threads(args.threads)
ops = native_ops()
if ops is None:
    raise SystemExit(f"the native kernels are unavailable: {kernel_error()}")
SEQS, LEN, HEADS, KV_HEADS, HEAD_DIM, BS = 64, 300, 12, 4, 64, 16
g = torch.Generator().manual_seed(0)
blocks_per_seq = -(-LEN // BS)
num_blocks = SEQS * blocks_per_seq + 1
tables = torch.arange(1, num_blocks).view(SEQS, blocks_per_seq)
pos = torch.arange(LEN)
slots = (tables[:, pos // BS] * BS + pos % BS).flatten()
k = torch.randn(SEQS * LEN, KV_HEADS, HEAD_DIM, generator=g)
k[..., 5] *= 10  # one wide channel, as post-RoPE keys have
v = torch.randn(SEQS * LEN, KV_HEADS, HEAD_DIM, generator=g)
q = torch.randn(SEQS, HEADS, HEAD_DIM, generator=g)
lens = torch.full((SEQS,), LEN)
meta = AttentionMetadata(slots[:0], SEQS, tables, lens, None, [])


def median_ms(fn, calls: int, warmup: int = 5) -> float:
    times = []
    for _ in range(calls + warmup):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times[warmup:]) * 1e3


def pools(kind: str, blocks: int = num_blocks):
    return allocate_kv_caches(1, blocks, BS, KV_HEADS, HEAD_DIM, torch.float32, torch.device("cpu"), kind, SEQS + 1,
                              native_ops=ops)[0]


for kind in ("int8", "int4"):
    kp, vp = pools(kind)
    for lo in range(0, SEQS * LEN, 4800):
        write_kv(kp, vp, k[lo:lo + 4800], v[lo:lo + 4800], slots[lo:lo + 4800])
    print(f"decode {kind}: {median_ms(lambda: _decode_fused(q, kp, vp, meta, 0.125), 35):.3f} ms")
    if kind == "int4":
        bits = [kp.key_bits] if getattr(kp, "key_bits", None) is not None else []  # (a checkout before them)
        for isa in ("avx2", "avx512", "scalar"):
            out = torch.empty_like(q)
            call = [out, q, kp.data, vp.data, kp.scales, kp.zero_points, *bits, vp.scales, kp.tail, vp.tail,
                    kp.tail_slots(), tables, lens, 0.125, isa]
            print(f"decode int4 {isa}: {median_ms(lambda: ops.paged_decode_attention_int4(*call), 20):.3f} ms")

x = k[:512]


def write_chunk():
    kp, vp = pools("int4", 40)
    t = time.perf_counter()
    write_kv(kp, vp, x, x, torch.arange(512))
    return time.perf_counter() - t


def write_filling_decodes():
    kp, vp = pools("int4", 2 * SEQS)
    for s in range(SEQS):  # each sequence's first 15 rows in its tail slot
        write_kv(kp, vp, x[:15], x[:15], torch.arange(s * BS, s * BS + 15))
    t = time.perf_counter()
    write_kv(kp, vp, x[:SEQS], x[:SEQS], torch.arange(SEQS) * BS + 15)
    return time.perf_counter() - t


for name, fn in (("a 512-token chunk", write_chunk), ("64 decodes each filling a block", write_filling_decodes)):
    times = [fn() for _ in range(30)]
    print(f"int4 write, {name} (K and V): {statistics.median(times[3:]) * 1e3:.3f} ms")
