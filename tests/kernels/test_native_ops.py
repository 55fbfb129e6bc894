"""The native layer kernels (RMSNorm + residual, rotary, SiLU-and-multiply, causal softmax) against the
torch code they replace: bit-identical in bf16, within float rounding in float32, and the whole model too."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from pagedserve.kernels import kernel_error, native_ops
from pagedserve.models.attention import AttentionMetadata
from pagedserve.models.llama import MLP, LlamaForCausalLM, ModelArchitecture, RMSNorm, RotaryEmbedding

OPS = native_ops()
pytestmark = pytest.mark.skipif(OPS is None, reason=f"native kernels unavailable: {kernel_error()}")
DTYPES = [torch.bfloat16, torch.float32]


def _arch(**kw) -> ModelArchitecture:
    base = dict(model_type="llama", hidden_size=128, intermediate_size=192, num_layers=2, num_heads=4,
                num_kv_heads=2, head_dim=32, vocab_size=300, rms_norm_eps=1e-6, rope_theta=10000.0,
                rope_scaling=None, max_position_embeddings=512, tie_word_embeddings=False, qkv_bias=False,
                qk_norm=False, sliding_window=None)
    return ModelArchitecture(**(base | kw))


def _same(got: torch.Tensor, want: torch.Tensor) -> bool:
    if got.dtype == torch.bfloat16:
        return torch.equal(got, want)
    return torch.allclose(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_with_and_without_residual(dtype):
    torch.manual_seed(0)
    norm = RMSNorm(128, 1e-6)
    norm.weight.data = torch.rand(128) + 0.5
    norm = norm.to(dtype)
    x, res = torch.randn(37, 128).to(dtype), torch.randn(37, 128).to(dtype)
    want = norm(x)
    want_h, want_res = norm(x, res.clone())
    norm.ops = OPS
    assert _same(norm(x), want)
    got_res = res.clone()
    got_h, returned = norm(x, got_res)
    assert returned is got_res  # the sum is written in place: the next residual, no new tensor
    assert _same(got_h, want_h) and _same(got_res, want_res)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scaling", [None, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}])
def test_rotary_in_place_on_fused_qkv_views(dtype, scaling):
    torch.manual_seed(1)
    rot = RotaryEmbedding(_arch(rope_scaling=scaling), 512)
    qkv = torch.randn(29, (4 + 2 + 2) * 32).to(dtype)
    positions = torch.randint(0, 512, (29,))
    q, k = qkv[:, :128].view(29, 4, 32), qkv[:, 128:192].view(29, 2, 32)  # strided, as in the model
    want_q, want_k = rot(positions, q, k)
    rot.ops = OPS
    got_qkv = qkv.clone()
    got_q, got_k = rot(positions, got_qkv[:, :128].view(29, 4, 32), got_qkv[:, 128:192].view(29, 2, 32))
    assert _same(got_q, want_q) and _same(got_k, want_k)
    assert torch.equal(got_qkv[:, 192:], qkv[:, 192:])  # V is left alone
    with pytest.raises(RuntimeError, match="out of range"):
        rot(torch.full((29,), 512), got_q, got_k)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(dtype):
    torch.manual_seed(2)
    mlp = MLP(_arch()).to(dtype)
    x = torch.randn(23, 128).to(dtype)
    want = mlp(x)
    mlp.ops = OPS
    assert _same(mlp(x), want)


@pytest.mark.parametrize("dtype", DTYPES)
def test_whole_model_same_with_native_ops(dtype):
    """Two layers over a flat batch through the paged cache: logits equal with and without kernels."""
    torch.manual_seed(3)
    arch = _arch()
    model = LlamaForCausalLM(arch, 512, "reference").to(dtype).eval()
    model.layers[0].self_attn.rotary.float()  # as the loader keeps the cos/sin tables
    tokens = 21
    block_size, blocks = 8, 4
    caches = [(torch.zeros(blocks, block_size, 2, 32, dtype=dtype), torch.zeros(blocks, block_size, 2, 32, dtype=dtype))
              for _ in range(arch.num_layers)]
    meta = AttentionMetadata(slot_mapping=torch.arange(tokens), num_decodes=0,
                             decode_block_tables=torch.zeros(0, 1, dtype=torch.long),
                             decode_context_lens=torch.zeros(0, dtype=torch.long), decode_mask=None,
                             prefills=[(0, tokens, tokens, torch.arange(3))])
    ids, positions = torch.randint(0, 300, (tokens,)), torch.arange(tokens)
    with torch.inference_mode():
        want = model.compute_logits(model(ids, positions, caches, meta))
        model.use_native_ops(OPS)
        got = model.compute_logits(model(ids, positions, caches, meta))
    assert _same(got, want)


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("q_len,ctx", [(1, 1), (7, 7), (5, 30), (33, 40)])
def test_native_causal_softmax_matches_masked_softmax(dtype, atol, q_len, ctx):
    scores = torch.randn(3, 2, q_len, ctx).to(dtype)
    future = torch.arange(ctx)[None] > torch.arange(ctx - q_len, ctx)[:, None]
    want = scores.masked_fill(future, float("-inf")).softmax(-1)
    got = scores.clone()
    OPS.causal_softmax_(got, q_len)
    assert torch.allclose(got.float(), want.float(), atol=atol)
    assert torch.all(got[..., future] == 0)


def test_kernels_run_on_every_torch_thread():
    """The kernels' at::parallel_for spreads over torch's threads (it ran on one thread alone while
    the library was built without OpenMP: the decode kernel took as long on two threads as on one)."""
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert OPS.parallel_threads(64) == 2
        torch.set_num_threads(1)
        assert OPS.parallel_threads(64) == 1
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("threads", [1, 2, 4])
def test_work_pool_runs_every_chunk_exactly_once(threads):
    """The native decode step's pool (work_pool.h): thousands of back-to-back jobs, as a step's
    kernels post them, each item of each job run once (none lost, none run twice by two threads,
    no chunk of one job taken by a thread still finishing the last), and workers taking chunks
    beside the calling thread (4 threads on a 2-core machine too; the first job's caller waits,
    bounded, for a worker to take a chunk, so a loaded machine cannot starve them out of the test)."""
    counts, ran, _ = OPS.work_pool_counts(threads, 20000, 97)
    assert torch.equal(counts, torch.full((97,), 20000, dtype=torch.int32))
    assert ran == 1 if threads == 1 else 2 <= ran <= threads
    assert OPS.work_pool_counts(threads, 0, 5)[0].sum() == 0  # no job, nothing run


def _one_layer_stack(threads: int):
    """A decode stack of one dense Llama layer (hidden 64, one head of 64, MLP 128) on its own pool,
    and a decode step for it: (stack, step arguments)."""
    torch.manual_seed(0)
    hidden, inter = 64, 128
    stack = torch.classes.pagedserve.DecodeStack(1, 1, hidden, inter, 1e-6, 0.125, torch.ones(8, hidden),
                                                 torch.zeros(8, hidden), torch.rand(hidden) + 0.5, threads)
    stack.add_layer(torch.rand(hidden) + 0.5, torch.rand(hidden) + 0.5, None, None,
                    torch.zeros(1, 2, 16, hidden), torch.zeros(1, 2, 16, hidden), 0, 0, None, None, "", [])
    for name, rows, cols in (("qkv", 3 * hidden, hidden), ("o", hidden, hidden), ("gate_up", 2 * inter, hidden),
                             ("down", hidden, inter)):
        stack.set_linear(0, name, "dense", [torch.randn(rows, cols) / cols ** 0.5], [], [], None, False, 0)
    one = torch.zeros(1, dtype=torch.long)
    return stack, (torch.randn(1, hidden), one, [one], [torch.zeros(1, 1, dtype=torch.long)], [one + 1], [None], [])


@pytest.mark.parametrize("threads", [2, 1, 0])
def test_a_decode_stacks_pool_counts_where_its_time_went(threads):
    """pool_times (work_pool.h's PoolTimes), counted between count_pool_times(True) and (False)
    only: the jobs a decode step split, their chunks, the ones the caller ran alone, and the ticks
    in each, consistent with each other: the caller's wait for a worker within its jobs' time, the
    workers' busy ticks within the jobs they helped with, the clock moving on. A stack on torch's
    threads (0) has no pool: every count 0."""
    torch.manual_seed(0)
    hidden, inter, rows, steps = 64, 128, 8, 20
    stack = torch.classes.pagedserve.DecodeStack(1, 1, hidden, inter, 1e-6, 0.125, torch.ones(8, hidden),
                                                 torch.zeros(8, hidden), torch.rand(hidden) + 0.5, threads)
    stack.add_layer(torch.rand(hidden) + 0.5, torch.rand(hidden) + 0.5, None, None, torch.zeros(1, rows, 16, hidden),
                    torch.zeros(1, rows, 16, hidden), 0, 0, None, None, "", [])
    for name, out, cols in (("qkv", 3 * hidden, hidden), ("o", hidden, hidden), ("gate_up", 2 * inter, hidden),
                            ("down", hidden, inter)):
        stack.set_linear(0, name, "dense", [torch.randn(out, cols) / cols ** 0.5], [], [], None, False, 0)
    seqs = torch.arange(rows)

    def step():  # 8 sequences, one token each, at the first slot of a block of their own
        stack.forward(torch.randn(rows, hidden), torch.zeros(rows, dtype=torch.long), [seqs * 16],
                      [seqs.view(rows, 1)], [torch.ones(rows, dtype=torch.long)], [None], [])

    step()  # not counted: a pool counts only when asked to
    before = dict(stack.pool_times())
    stack.count_pool_times(True)
    for _ in range(steps):
        step()
    stack.count_pool_times(False)
    after = dict(stack.pool_times())
    step()  # not counted either
    assert {key: value for key, value in stack.pool_times().items() if key != "now"} == \
        {key: value for key, value in after.items() if key != "now"}
    counts = ("jobs", "chunks", "alone_jobs", "job", "caller_wait", "alone", "between", "worker_busy")
    assert set(after) == {"threads", "now", *counts} and after["threads"] == max(threads, 1)
    assert after["now"] > before["now"] and all(before[key] == 0 for key in counts)
    if threads == 0:
        assert all(after[key] == 0 for key in counts)
        return
    # each step runs its norms, rotary, SiLU and attention on the pool: split over 2 threads, or alone on 1
    assert after["jobs"] + after["alone_jobs"] >= 4 * steps and after["alone"] > 0 and after["between"] > 0
    if threads == 1:
        assert after["jobs"] == after["chunks"] == after["job"] == after["worker_busy"] == 0
        return
    assert after["jobs"] >= steps and after["chunks"] >= 2 * after["jobs"]  # the 8 rows' norm, at least
    assert 0 <= after["caller_wait"] <= after["job"] and 0 <= after["worker_busy"] <= after["job"]
    # every tick counted lies between the two readings of the clock
    assert after["job"] + after["alone"] + after["between"] <= after["now"] - before["now"]


def test_a_decode_stack_refuses_kv_pools_it_does_not_know():
    """add_layer names the pools' kind and their other tensors: an unknown kind, or the wrong count
    of tensors for a known one, is a one-line error."""
    stack = torch.classes.pagedserve.DecodeStack(1, 1, 64, 128, 1e-6, 0.125, torch.ones(8, 64), torch.zeros(8, 64),
                                                 torch.ones(64), 1)
    pool = torch.zeros(2, 16, 1, 64, dtype=torch.int8)
    norms = (torch.ones(64), torch.ones(64), None, None)
    with pytest.raises(RuntimeError, match="KV pools are the model dtype's, int8, fp8 or int4, not int5"):
        stack.add_layer(*norms, pool, pool, 0, 0, None, None, "int5", [])
    with pytest.raises(RuntimeError, match="int8 KV pools take 2 more tensors, got 1"):
        stack.add_layer(*norms, pool, pool, 0, 0, None, None, "int8", [torch.zeros(2, 16, 1)])
    with pytest.raises(RuntimeError, match="int4 KV pools take 7 more tensors, got 2"):
        stack.add_layer(*norms, pool, pool, 0, 0, None, None, "int4", [torch.zeros(1), torch.zeros(1)])
    assert stack.num_layers() == 0


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_uses_and_drops_a_decode_stack_it_inherited():
    """A multiprocessing worker forked from a process holding a decode stack inherits its pool but
    not the pool's threads: the child computes on its own thread and drops the stack without
    joining threads it does not have. (A gateway test's worker once died in ~WorkPool there: the
    child's C library had handed the parent's thread records to the child's own new threads.)
    The child first sets torch to one thread, as torch's own forked DataLoader workers do: the
    stack's dense linears are torch's matmuls, and on an Intel CPU MKL runs even this one-row
    product on OpenMP's team, which libgomp cannot rebuild in a forked child (it hung there)."""
    import gc
    import threading
    import time

    stack, step = _one_layer_stack(threads=2)
    want = stack.forward(step[0].clone(), *step[1:])  # the stack adds into x, the residual stream
    pid = os.fork()
    if pid == 0:  # the child: exit status 0 only if it computed the same and dropped the stack
        code = 1
        try:
            torch.set_num_threads(1)
            release = threading.Event()  # threads of the child's own, alive while the stack goes
            helpers = [threading.Thread(target=release.wait, daemon=True) for _ in range(4)]
            for t in helpers:
                t.start()
            got = stack.forward(step[0].clone(), *step[1:])
            del stack
            gc.collect()
            release.set()
            code = 0 if torch.equal(got, want) else 2
        finally:
            os._exit(code)
    deadline = time.monotonic() + 30
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    if done[0] == 0:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        pytest.fail("the child hung dropping the stack")
    assert os.WIFEXITED(done[1]) and os.WEXITSTATUS(done[1]) == 0, done[1]


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2 if hasattr(os, "sched_getaffinity") else True,
                    reason="needs two usable cores and Linux thread affinity")
def test_work_pool_workers_take_openmp_places_not_the_callers_core():
    """Where the step's OpenMP threads are pinned one per core (as `serve` and `bench compare` pin
    them, before torch starts), the pool's worker runs on OpenMP thread 1's core: a worker that
    inherited the caller's pin would share its one core (the default model decoded at 42 tok/s
    instead of 95). Run in a fresh process, since the pinning must precede torch's start."""
    cpus = sorted(os.sched_getaffinity(0))[:2]
    env = {**os.environ, "OMP_NUM_THREADS": "2", "OMP_PROC_BIND": "close",
           "OMP_PLACES": ",".join(f"{{{c}}}" for c in cpus)}
    code = ("import os, torch; from pagedserve.kernels import native_ops; ops = native_ops(); "
            "n = ops.work_pool_counts(2, 200, 97)[2]; print(sorted(os.sched_getaffinity(0)), n)")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    main_cpus, pool_cpus = done.stdout.strip().rsplit(" ", 1)
    assert main_cpus == f"[{cpus[0]}]"  # OpenMP pinned the caller itself to one core
    assert int(pool_cpus) == 2  # and the worker ran on the other
