"""KV bytes per second the fused paged decode kernel reads, for a W1-like decode step of `small`
(12 layers, 4 KV heads of 64, 3 query heads each; bf16 pools, or with `--kv int8` int8 ones with a
float16 scale a row, or with `--kv int4` kv/int4.py's pools, keys as 4-bit planes, values as
nibbles): 64 sequences of 400 tokens, their blocks in the pool in order, in order
backwards or scattered at random, per block size and thread count. What it shows: whether the
kernel is bound by its instructions (the same rate from cache as from memory) or by how many cache
lines a core can have in flight (in-order blocks faster than scattered ones). docs/BENCHMARKS.md
("Decode attention on the Sapphire Rapids-class Xeon: bound by lines in flight"; "Where a reused
pool's blocks lie"; "Where a 64-row decode step of `small` goes").

    python examples/paged_decode_bandwidth.py                 # block sizes 16 and 128, 1 and 2 threads
    python examples/paged_decode_bandwidth.py --block-sizes 16 --threads 2 --layers 1   # from cache
    python examples/paged_decode_bandwidth.py --block-sizes 16 --threads 2 --kv int8     # int8 pools
    python examples/paged_decode_bandwidth.py --block-sizes 16 --threads 2 --kv int4     # int4 pools
"""
import argparse
import statistics
import time

import torch

from pagedserve.kernels import kernel_error, native_ops
from pagedserve.kv.cache import allocate_kv_caches

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--block-sizes", type=int, nargs="+", default=[16, 128], help="tokens per KV block")
parser.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="torch threads for the kernel")
parser.add_argument("--layers", type=int, default=12, help="layers' pools read per step (12: ~315 MB, past cache)")
parser.add_argument("--seqs", type=int, default=64, help="sequences in the step")
parser.add_argument("--context", type=int, default=400, help="tokens each sequence attends to")
parser.add_argument("--repeats", type=int, default=15, help="timed steps; the median is printed")
parser.add_argument("--kv", choices=["bf16", "int8", "int4"], default="bf16",
                    help="the pools' storage: bf16 (head-major blocks), int8 (token-major rows, "
                         "a float16 scale each) or int4 (kv/int4.py: key bit planes per block, value nibbles)")
args = parser.parse_args()

ops = native_ops()
if ops is None:
    raise SystemExit(f"the native kernels are unavailable: {kernel_error()}")
KV_HEADS, GROUP, HEAD_DIM = 4, 3, 64


def make_pools(blocks: int, bs: int) -> tuple:
    """One layer's K and V pools, as the kernel takes them: bf16 [heads, blocks, bs, head_dim]; int8
    [blocks, bs, heads, head_dim] with float16 scales [blocks, bs, heads] (kv/quant.py's layout);
    int4 kv/int4.py's pools, every block written (quantized) from random K and V."""
    if args.kv == "bf16":
        return tuple(torch.randn(KV_HEADS, blocks, bs, HEAD_DIM, dtype=torch.bfloat16) for _ in range(2))
    if args.kv == "int8":
        data = [torch.randint(-127, 128, (blocks, bs, KV_HEADS, HEAD_DIM), dtype=torch.int8) for _ in range(2)]
        scales = [(torch.rand(blocks, bs, KV_HEADS) * 0.01 + 1e-3).half() for _ in range(2)]
        return (*data, *scales)
    k, v = allocate_kv_caches(1, blocks, bs, KV_HEADS, HEAD_DIM, torch.float32, torch.device("cpu"), "int4")[0]
    slots = torch.arange(blocks * bs)
    for chunk in slots.split(1 << 16):
        k.write(chunk, torch.randn(len(chunk), KV_HEADS, HEAD_DIM))
        v.write(chunk, torch.randn(len(chunk), KV_HEADS, HEAD_DIM))
    return k.decode_kernel_pools(v)


def row_bytes(bs: int) -> float:
    """Bytes read per token, KV head and pool (K or V), on average."""
    if args.kv == "bf16":
        return HEAD_DIM * 2
    if args.kv == "int8":
        return HEAD_DIM + 2  # int8 values and a float16 scale
    # nibbles; the values' float16 scale (halved over K and V); the keys' step and zero point a channel and block
    return HEAD_DIM / 2 + 1 + HEAD_DIM / bs


def attend(out, q, pools, tables, lens) -> None:
    if args.kv == "bf16":
        ops.paged_decode_attention(out, q, *pools, tables, lens, HEAD_DIM ** -0.5)
    elif args.kv == "int8":
        ops.paged_decode_attention_quantized(out, q, *pools, tables, lens, HEAD_DIM ** -0.5, "int8")
    else:
        ops.paged_decode_attention_int4(out, q, *pools, tables, lens, HEAD_DIM ** -0.5, "auto")


torch.manual_seed(0)
with torch.inference_mode():
    for bs in args.block_sizes:
        per_seq = (args.context + bs - 1) // bs
        blocks = args.seqs * per_seq
        pools = [make_pools(blocks, bs) for _ in range(args.layers)]
        q = torch.randn(args.seqs, KV_HEADS * GROUP, HEAD_DIM, dtype=torch.bfloat16)
        out = torch.empty_like(q)
        lens = torch.full((args.seqs,), args.context, dtype=torch.long)
        kv_bytes = args.layers * args.seqs * args.context * KV_HEADS * row_bytes(bs) * 2
        for order in ("in order", "backwards", "scattered"):
            ids = torch.randperm(blocks) if order == "scattered" else torch.arange(blocks)
            tables = ids.view(args.seqs, per_seq)
            # backwards: each sequence's run in descending ids, as a prompt takes a run that a
            # finished sequence gave back (the free queue holds it tail first)
            tables = (tables.flip(1) if order == "backwards" else tables).contiguous()
            for threads in args.threads:
                torch.set_num_threads(threads)

                def step():
                    for layer in pools:
                        attend(out, q, layer, tables, lens)

                for _ in range(3):
                    step()
                times = []
                for _ in range(args.repeats):
                    start = time.perf_counter()
                    step()
                    times.append(time.perf_counter() - start)
                seconds = statistics.median(times)
                print(f"block size {bs:4d}, blocks {order:9s}, {threads} thread(s): {seconds * 1e3:7.2f} ms a step, "
                      f"{kv_bytes / seconds / 1e9:5.1f} GB/s of KV ({kv_bytes / 1e6:.0f} MB)")
