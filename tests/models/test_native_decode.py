"""The native decode step (models/native_decode.py, kernels/decode_stack.cpp) against the Python
model it replaces: the same bits, for every kind of linear layer and architecture it takes, and the
Python path wherever it declines."""

from __future__ import annotations

import dataclasses
import logging
import os

import pytest
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.kernels import gguf_gemm_usable, native_ops
from pagedserve.kv.cache import HeadMajorKVCache
from pagedserve.kv.quant import QuantizedKVCache
from pagedserve.models.attention import AttentionMetadata
from pagedserve.models.gguf_linear import ALL_ROWS, GGUFLinear
from pagedserve.models.native_decode import NativeDecode
from tests.conftest import assert_no_leaks

pytestmark = pytest.mark.skipif(native_ops() is None, reason="native kernels unavailable")


@pytest.fixture(scope="module")
def models(checkpoint_dir, tiny_model_dir, tiny_ggufs, request):
    """``models(case)`` → an in-process LLM of that case, built once per module."""
    sources = {
        "llama-onednn": lambda: (checkpoint_dir("llama"), {"dtype": "float32"}),
        "qwen2-bias": lambda: (checkpoint_dir("qwen2"), {"dtype": "float32"}),
        "qwen3-qk-norm": lambda: (checkpoint_dir("qwen3"), {"dtype": "float32"}),
        # Unpacked: where the CPU has native bf16 the loader would prepack bf16 for oneDNN.
        "tiny-bf16-dense": lambda: (tiny_model_dir, {"dtype": "bfloat16", "pack_weights": "none"}),
        "tiny-half-weights": lambda: (tiny_model_dir, {"dtype": "float32", "pack_weights": "none"}),  # bf16 checkpoint
        # AMX-BF16 tiles where the CPU has them (elsewhere oneDNN's packing, the llama case's path)
        "tiny-bf16-tiles": lambda: (tiny_model_dir, {"dtype": "bfloat16", "pack_weights": "auto"}),
        "gguf-q4_1": lambda: (tiny_ggufs("Q4_1", tokenizer=True), {}),
        "gguf-q8_0-int8": lambda: (tiny_ggufs("Q8_0", tokenizer=True), {"gguf_activations": "int8"}),
        # kept quantized, computed in float32 (as on a CPU without native bf16): the float32 gguf_gemm
        "gguf-q4_1-float32": lambda: (_float32_view(tiny_ggufs("Q4_1", tokenizer=True)), {}),
        # Gemma 3's layers (four norms, QK-norm by rows, GeGLU, two RoPE tables) over one full and
        # two window KV groups (window 32)
        "tiny-gemma3": lambda: (request.getfixturevalue("tiny_gemma3_gguf"), {}),
        # int8 / fp8 KV pools: the stack writes and reads them through the same kernels as Python
        "tiny-bf16-int8-kv": lambda: (tiny_model_dir, {"dtype": "bfloat16", "pack_weights": "none",
                                                       "kv_cache_dtype": "int8"}),
        "gguf-q4_1-fp8-kv": lambda: (tiny_ggufs("Q4_1", tokenizer=True), {"kv_cache_dtype": "fp8"}),
        # int4 pools: tails, bit-plane keys, rotated values, each step's write planned by the host
        "tiny-bf16-int4-kv": lambda: (tiny_model_dir, {"dtype": "bfloat16", "pack_weights": "none",
                                                       "kv_cache_dtype": "int4"}),
        "gguf-q4_1-int4-kv": lambda: (tiny_ggufs("Q4_1", tokenizer=True), {"kv_cache_dtype": "int4"}),
        "tiny-gemma3-int4-kv": lambda: (request.getfixturevalue("tiny_gemma3_gguf"), {"kv_cache_dtype": "int4"}),
    }
    built: dict[str, LLM] = {}

    def get(case: str, native: bool = True) -> LLM:
        key = f"{case}-{native}"
        if key not in built:
            path, options = sources[case]()
            built[key] = LLM(str(path), num_kv_blocks=96, block_size=8, max_model_len=256, native_decode=native,
                             **options)
        return built[key]

    return get


def _float32_view(gguf) -> str:
    from pagedserve.bench.quality import gguf_compute_view
    from pagedserve.models.loader import resolve_model_dir

    return gguf_compute_view(str(resolve_model_dir(str(gguf))), "float32")


CASES = ["llama-onednn", "qwen2-bias", "qwen3-qk-norm", "tiny-bf16-dense", "tiny-half-weights", "tiny-bf16-tiles",
         "gguf-q4_1", "gguf-q8_0-int8", "gguf-q4_1-float32", "tiny-gemma3", "tiny-bf16-int8-kv", "gguf-q4_1-fp8-kv"]
KINDS = {"llama-onednn": "onednn", "qwen2-bias": "onednn", "qwen3-qk-norm": "onednn", "tiny-bf16-dense": "dense",
         "tiny-half-weights": "half", "gguf-q4_1": "gguf", "gguf-q8_0-int8": "gguf", "gguf-q4_1-float32": "gguf",
         "tiny-gemma3": "gguf", "tiny-bf16-int8-kv": "dense", "gguf-q4_1-fp8-kv": "gguf",
         "tiny-bf16-tiles": "tile" if native_ops() is not None and native_ops().tile_linear_usable() else "onednn"}


def _decode_batch(model, rows: int, block_size: int, seed: int):
    """Random pools holding ``rows`` sequences' contexts (scattered blocks), and a decode step for
    them: its embeddings' token ids, positions, slots and metadata."""
    arch = model.arch
    g = torch.Generator().manual_seed(seed)
    like = model.native_decode.kv_caches[0][0]
    num_blocks = 3 * rows + 16  # up to 3 blocks a row, scattered
    pools = []
    for _ in range(arch.num_layers):
        pair = []
        for _ in range(2):
            if isinstance(like, QuantizedKVCache):  # random codes (fp8's bytes short of NaN) and scales
                pool = QuantizedKVCache.allocate(num_blocks, block_size, arch.num_kv_heads, arch.head_dim,
                                                 like.kv_cache_dtype, like.out_dtype, torch.device("cpu"), native_ops())
                codes = torch.randint(-127, 128, pool.data.shape, generator=g)
                if like.kv_cache_dtype == "fp8":  # e4m3's bytes but its NaNs (0x7F, 0xFF)
                    codes = torch.randint(0, 0x7F, pool.data.shape, generator=g) | (codes < 0) << 7
                pool.data.copy_(codes.to(pool.data.dtype))
                pool.scales.copy_(torch.rand(pool.scales.shape, generator=g) / 64 + 1e-3)
            else:
                pool = HeadMajorKVCache(num_blocks, block_size, arch.num_kv_heads, arch.head_dim, like.dtype,
                                        torch.device("cpu"))
                pool.data.copy_(torch.randn(pool.data.shape, generator=g))
            pair.append(pool)
        pools.append(tuple(pair))
    contexts = torch.randint(1, 3 * block_size, (rows,), generator=g)  # the new token included
    perm = torch.randperm(num_blocks, generator=g).tolist()
    width = int((contexts.max() + block_size - 1) // block_size)
    tables = torch.tensor([[perm.pop() for _ in range(width)] for _ in range(rows)])
    positions = contexts - 1
    slots = tables[torch.arange(rows), positions // block_size] * block_size + positions % block_size
    mask = (torch.arange(width * block_size)[None] < contexts[:, None])[:, None, None, :]
    meta = AttentionMetadata(slots, rows, tables, contexts, mask, [])
    ids = torch.randint(0, arch.vocab_size, (rows,), generator=g)
    return pools, ids, positions, meta


@pytest.mark.parametrize("case", CASES)
def test_native_decode_step_gives_the_python_models_bits(case, models):
    model = models(case).engine.core.runner.model
    native = model.native_decode
    assert native is not None, "the native path declined a model it takes"
    assert KINDS[case] in native.what
    # torch's matmuls run on OpenMP's team, and so do the prompt chunks' tile linears: the stack's
    # other kernels join it rather than a pool beside it
    assert ("on OpenMP's threads" in native.what) == (KINDS[case] in ("onednn", "dense", "tile")), native.what
    assert native.head_rows > 0 and "the LM head too" in native.what
    # 8 rows past every GGUF layer's integer kernels' (32; by format in float32, where some never hand
    # over: ALL_ROWS): through gguf_gemm where it runs
    past = 8 + max((m.kernel_rows for m in model.modules() if isinstance(m, GGUFLinear) and m.kernel_rows < ALL_ROWS),
                   default=32)
    if case == "gguf-q4_1-float32":
        assert model.norm.weight.dtype == torch.float32
        assert all(m.gemm == gguf_gemm_usable(torch.float32) for m in model.modules() if isinstance(m, GGUFLinear))
    for rows, seed in ((1, 0), (5, 1), (min(native.max_rows, 32), 2), (min(native.max_rows, past), 3)):
        pools, ids, positions, meta = _decode_batch(model, rows, 8, seed)
        python_pools = [tuple(_copy(p) for p in pair) for pair in pools]
        model.native_decode, _ = NativeDecode.build(model, pools, native_ops())  # over these pools
        try:
            got = model(ids, positions, pools, meta)
            got_logits = model.compute_logits(got)
            model.native_decode = None  # the Python model: the reference
            want = model(ids, positions, python_pools, meta)
            want_logits = model.compute_logits(want)
        finally:
            model.native_decode = native
        assert torch.equal(got, want), f"{case}, {rows} rows: hidden states differ by {(got - want).abs().max()}"
        assert got_logits.dtype == torch.float32 and torch.equal(got_logits, want_logits)
        for (k, v), (pk, pv) in zip(pools, python_pools):  # the KV writes too, scales included
            assert torch.equal(k.data, pk.data) and torch.equal(v.data, pv.data)
            if isinstance(k, QuantizedKVCache):
                assert torch.equal(k.scales, pk.scales) and torch.equal(v.scales, pv.scales)


def _copy(pool: HeadMajorKVCache | QuantizedKVCache) -> HeadMajorKVCache | QuantizedKVCache:
    if isinstance(pool, QuantizedKVCache):
        return dataclasses.replace(pool, data=pool.data.clone(), scales=pool.scales.clone())
    kvh, nb, bs, hd = pool.data.shape
    twin = HeadMajorKVCache(nb, bs, kvh, hd, pool.dtype, torch.device("cpu"))
    twin.data.copy_(pool.data)
    return twin


PROMPTS = ["The quick brown fox", "Paged attention stores keys and values in blocks", "1 2 3 4 5 6 7 8 9"]


@pytest.mark.parametrize("case", ["tiny-gemma3", "tiny-gemma3-int4-kv"])
def test_gemma3_decodes_alike_either_way_across_its_windows(case, models):
    """Gemma 3 through the native stack against its Python model, end to end: prompts longer than
    the tiny model's 32-token window, decoded past it, so the window layers' views start inside a
    block and their groups give blocks back (the null block in their tables) while both decode;
    over int4 pools, one write plan per KV group and step, made in the Python layers' order."""
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=2)
    prompts = [{"prompt_token_ids": [(7 * i + 3 * j) % 500 + 2 for j in range(n)]}
               for i, n in enumerate((41, 57, 70, 33, 48, 65))]
    results, engines = [], []
    for native in (True, False):
        llm = models(case, native)
        assert (llm.engine.core.runner.model.native_decode is not None) == native
        outs = llm.generate(prompts, params, use_tqdm=False)
        results.append([(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs])
        assert_no_leaks(llm.engine)
        engines.append(llm.engine)
    assert results[0] == results[1]
    _assert_same_pools(*engines)


@pytest.mark.parametrize("case", ["qwen3-qk-norm", "tiny-half-weights", "gguf-q4_1", "tiny-bf16-int8-kv",
                                  "tiny-bf16-int4-kv", "gguf-q4_1-int4-kv"])
def test_engine_generates_the_same_tokens_and_logprobs_either_way(case, models):
    """The same tokens and log-probabilities through the native stack and the Python model, and
    the same KV pool bytes after (int4: blocks, steps, zero points, scales and tails: the decodes'
    writes as each step's plan laid them out, blocks filled by decodes included)."""
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=2)
    results, engines = [], []
    for native in (True, False):
        llm = models(case, native)
        assert (llm.engine.core.runner.model.native_decode is not None) == native
        if native and "int4" in case:
            assert "int4 KV pools" in llm.engine.core.runner.model.native_decode.what
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        results.append([(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs])
        assert_no_leaks(llm.engine)
        engines.append(llm.engine)
    assert results[0] == results[1]
    _assert_same_pools(*engines)


def _assert_same_pools(a, b) -> None:
    """Two engines' KV pools hold the same bytes (every tensor of each pool: data, scales, tails ...)."""
    for pair_a, pair_b in zip(a.core.runner.kv_caches, b.core.runner.kv_caches, strict=True):
        for x, y in zip(pair_a, pair_b):
            for f in ("data", "scales", "zero_points", "tail"):
                if not isinstance(getattr(x, f, None), torch.Tensor):
                    continue
                assert torch.equal(getattr(x, f).view(torch.uint8), getattr(y, f).view(torch.uint8)), f


def test_native_decode_declines_what_it_cannot_run(tiny_model_dir, caplog):
    with caplog.at_level(logging.INFO, logger="pagedserve.engine.core"):
        matmul = LLM(str(tiny_model_dir), num_kv_blocks=32, max_model_len=128, attention_backend="matmul")
    assert matmul.engine.core.runner.model.native_decode is None
    assert "decode step: python (the attention backend is not 'fused')" in caplog.text
    # It still generates, through the Python model, and gives every block back.
    out = matmul.generate(PROMPTS[:1], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
    assert_no_leaks(matmul.engine)


def test_native_decode_declines_int4_pools_without_their_native_write(models):
    """int4 pools written by torch's ops (built without the native kernels) would not be written as
    the stack writes: the stack declines them, and says why."""
    from pagedserve.kv.cache import allocate_kv_caches

    model = models("tiny-bf16-int4-kv").engine.core.runner.model
    arch = model.arch
    torch_written = allocate_kv_caches(arch.num_layers, 8, 8, arch.num_kv_heads, arch.head_dim, torch.bfloat16,
                                       torch.device("cpu"), "int4", 2)
    native, why = NativeDecode.build(model, torch_written, native_ops())
    assert native is None and why == "int4 KV pools without their native write or their values' rotation"


def test_native_decode_takes_decode_steps_only(models):
    llm = models("gguf-q4_1")
    native = llm.engine.core.runner.model.native_decode
    pools = llm.engine.core.runner.kv_caches
    decode = AttentionMetadata(torch.zeros(2, dtype=torch.long), 2, torch.zeros(2, 1, dtype=torch.long),
                               torch.ones(2, dtype=torch.long), None, [])
    with_chunk = AttentionMetadata(decode.slot_mapping, 1, decode.decode_block_tables[:1],
                                   decode.decode_context_lens[:1], None, [(1, 1, 1, torch.zeros(1, dtype=torch.long))])
    assert native.step_plans(2, [decode], pools) == []  # taken; no int4 plans to hand over
    assert native.step_plans(2, [with_chunk], pools) is None  # a prompt chunk in the step: the Python model
    assert native.step_plans(native.max_rows + 1, [decode], pools) is None  # more rows than the GGUF kernels take
    assert native.step_plans(2, [decode], [tuple(pair) for pair in pools]) is None  # pools it was not built over


# Run in a process of its own: OpenMP's workers are told apart from the decode pool's by name and
# from every other thread by there being no other (a test process holds servers' and clients').
_OPENMP_PROBE = r"""
import os, sys, threading
import torch
torch.set_num_threads(2)
from pagedserve.config import EngineConfig
from pagedserve.engine.frontend.engine import Engine
from pagedserve.engine.sampling_params import SamplingParams
from tests.conftest import assert_no_leaks
from tests.helpers.waiting import wait_until

def others():  # every thread but this one and the decode stack's pool: OpenMP's workers
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/comm") as f:
            if int(tid) != threading.get_native_id() and f.read().strip() != "pagedserve-pool":
                yield tid

def state(tid):  # R running (an OpenMP worker spinning after a region), S sleeping
    with open(f"/proc/self/task/{tid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]

def asleep():
    # A sleeping worker wakes only for the next region, and blocks again after it: each time one
    # more voluntary context switch.
    wait_until(lambda: all(state(t) in "SD" for t in others()), timeout=10, interval=0.02,
               what="OpenMP's workers to sleep")
    switches = {}
    for tid in others():
        with open(f"/proc/self/task/{tid}/status") as f:
            switches[tid] = next(int(l.split()[1]) for l in f if l.startswith("voluntary_ctxt_switches"))
    return switches

engine = Engine(EngineConfig(model=sys.argv[1], num_kv_blocks=400, block_size=8, max_model_len=256,
                             enable_prefix_caching=False))
streams = int(sys.argv[2])
native = engine.core.runner.model.native_decode
if native is None or native.max_rows < streams:  # such steps run the Python model, on torch's (OpenMP's) threads
    print("skip", "no native decode stack" if native is None else f"the native stack takes up to {native.max_rows} rows")
    sys.exit(0)
probe = torch.ones(1 << 22)
probe.add_(1)  # 4M values: split across OpenMP's threads, so its team exists
idle = asleep()
probe.add_(1)
woken = asleep()
assert any(woken[t] > idle[t] for t in idle), f"no thread but this one ran an OpenMP region: {idle} {woken}"
params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
for i in range(streams):  # a 16-stream batch: the logits' rows were an OpenMP region of their own
    engine.add_request(str(i), [5 + i, 17, 33, 9, 41 + i, 2], params)
started = set()
while len(started) < streams:  # the prompts (in chunks): torch's ops, on OpenMP's threads
    started.update(out.request_id for out in engine.step() if out.outputs[0].token_ids)
settled = asleep()
steps = 0
while engine.has_unfinished_requests():
    engine.step()
    steps += 1
after = asleep()
assert steps >= 10, steps
assert after == settled, f"decode steps woke OpenMP's workers (voluntary switches): {settled} -> {after}"
assert_no_leaks(engine)
print("ok", steps)
"""


@pytest.mark.parametrize("streams", [16, 48])
def test_decode_steps_open_no_openmp_region(smollm2_gguf, streams):
    """A decode step's work outside the native stack (the runner's inputs, the embedding lookup,
    the logits' rows) stays off OpenMP: a region wakes OpenMP's worker, which then spins on the core
    the stack's pool thread computes on. On the default model's file, 16 streams: the runner's
    torch.repeat_interleave, the embedding rows' dequantization and the index picking the rows to
    sample each opened one, every step. 48 streams (past the integer kernels' rows where gguf_gemm
    runs): the embedding rows' dequantization again and the stack's copy of q, from 32k values.
    Where the stack takes fewer rows than that (a CPU with AMX-BF16, whose prompt chunks over GGUF
    weights run torch's GEMM, not gguf_gemm: up to the integer kernels' 32), such steps run the
    Python model on torch's threads, and the case does not apply."""
    import subprocess
    import sys
    from pathlib import Path

    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("OpenMP runs no worker thread on one CPU")
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", _OPENMP_PROBE, str(smollm2_gguf), str(streams)], capture_output=True,
                         text=True,
                         timeout=240, cwd=root, env={**os.environ, "PYTHONPATH": str(root)})
    assert out.returncode == 0, out.stderr[-3000:]
    if out.stdout.startswith("skip"):
        pytest.skip(f"{streams} streams: {out.stdout.strip().removeprefix('skip ')}")
    assert out.stdout.startswith("ok")
