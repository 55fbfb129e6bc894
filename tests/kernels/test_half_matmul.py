"""16-bit weights for float32 decode (``half_matmul.cpp``, ``models/half_linear.py``).

The kernel on every instruction-set path this CPU runs against the scalar path and against
``F.linear`` over the widened weight (float16 and bfloat16 storage, decode-sized row counts, odd
output counts, K a multiple of 8 and not, bias, 1 and 2 threads, strided rows); the layer's two
paths; the ``decode_weights`` config field and ``--decode-weights`` flag; and which layer a float32
model's linears become on this CPU with each flag value."""

from __future__ import annotations

import argparse
import logging

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from pagedserve import kernels
from pagedserve.config import EngineConfig
from pagedserve.engine.args import add_engine_args, engine_config_from_args
from pagedserve.kernels import isa_paths, kernel_error, native_ops
from pagedserve.models import half_linear, loader
from pagedserve.models.architectures import architecture_from_hf_config
from pagedserve.models.half_linear import HalfWeightLinear, choose_decode_weights
from pagedserve.models.hf_config import read_hf_config
from pagedserve.models.quant import QuantizedEmbedding, weight_bytes

OPS = native_ops()
needs_kernels = pytest.mark.skipif(OPS is None, reason=f"native kernels unavailable: {kernel_error()}")
PATHS = isa_paths()
STORED = [torch.float16, torch.bfloat16]
ROWS = [1, 2, 3, 5, 8, 16]
SHAPES = [(37, 64), (33, 100), (5, 7), (130, 264)]  # (N odd or not, K a multiple of 8 or not)


def _operands(n: int, k: int, m: int, dtype: torch.dtype, bias: bool):
    torch.manual_seed(n * 1000 + k * 10 + m)
    w = torch.randn(n, k).to(dtype)
    return w, torch.randn(m, k), torch.randn(n) if bias else None


def _run(x, w, b, isa: str) -> torch.Tensor:
    y = torch.full((x.shape[0], w.shape[0]), float("nan"))
    OPS.half_linear(y, x, w, b, isa)
    return y


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    """float32 sums of up to 264 products: a few ulps of the largest term apart."""
    return torch.allclose(got.double(), want.double(), rtol=1e-5, atol=1e-5 * want.abs().max().item())


@needs_kernels
def test_this_cpu_runs_the_scalar_path_and_names_the_others():
    assert PATHS[0] == "scalar" and set(PATHS) <= {"scalar", "avx2", "avx512", "amx"}
    if "avx2" in kernels._cpu_flags().split() and "f16c" in kernels._cpu_flags().split():
        assert "avx2" in PATHS
    if "amx" in PATHS:  # AVX-512 plus tiles, where Linux granted them (cpu_isa.h)
        assert "avx512" in PATHS and {"amx_tile", "amx_int8"} <= set(kernels._cpu_flags().split())
    w, x, b = _operands(8, 16, 1, torch.float16, False)
    with pytest.raises(RuntimeError, match="half_linear: unknown instruction-set path 'sse'"):
        _run(x, w, b, "sse")
    for isa in {"avx2", "avx512", "amx"} - set(PATHS):
        with pytest.raises(RuntimeError, match=f"half_linear: this CPU cannot run the {isa} path"):
            _run(x, w, b, isa)


@needs_kernels
@pytest.mark.parametrize("isa", PATHS)
@pytest.mark.parametrize("dtype", STORED, ids=["f16", "bf16"])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_kernel_matches_the_scalar_path_and_the_widened_matmul(isa, dtype, bias, threads):
    for n, k in SHAPES:
        for m in ROWS:
            w, x, b = _operands(n, k, m, dtype, bias)
            got = _run(x, w, b, isa)
            want = F.linear(x.double(), w.double(), None if b is None else b.double())
            assert _close(got, want), (isa, n, k, m)
            assert _close(got, _run(x, w, b, "scalar")), (isa, n, k, m)
            assert _close(got, F.linear(x, w.float(), b)), (isa, n, k, m)


@needs_kernels
@pytest.mark.parametrize("isa", PATHS)
@pytest.mark.parametrize("dtype", STORED, ids=["f16", "bf16"])
def test_a_row_gets_the_same_bits_whatever_rows_share_its_call(isa, dtype, threads):
    """One accumulator per (row, output) summed in one order on every tile shape: a decode row's
    result does not depend on its batch (what lets speculative decoding's verifying batch agree with
    the one-token step)."""
    w, x, b = _operands(77, 200, 16, dtype, True)
    batch = _run(x, w, b, isa)
    for i in range(16):
        assert torch.equal(_run(x[i:i + 1], w, b, isa)[0], batch[i]), i
    assert torch.equal(_run(x[5:8], w, b, isa), batch[5:8])


@needs_kernels
@pytest.mark.parametrize("isa", PATHS)
def test_kernel_reads_strided_rows_and_refuses_bad_operands(isa):
    w, _, b = _operands(40, 32, 1, torch.bfloat16, True)
    wide = torch.randn(9, 96)
    x = wide[:, 16:48]  # rows of 32, 96 apart (a split of a fused projection's output)
    assert _close(_run(x, w, b, isa), F.linear(x, w.float(), b))
    for bad, match in (((torch.randn(9, 31), w, b), "weight must be"), ((x.double(), w, b), "x must be"),
                       ((x, w.float(), b), "weight must be"), ((x, w.t(), b), "weight must be"),
                       ((x, w, b.to(torch.bfloat16)), "bias must be"), ((x, w, torch.randn(39)), "bias must be")):
        with pytest.raises(RuntimeError, match=f"half_linear: {match}"):
            _run(*bad, isa)
    with pytest.raises(RuntimeError, match="half_linear: out must be"):
        OPS.half_linear(torch.empty(9, 40, dtype=torch.bfloat16), x, w, b, isa)


# ---- the layer -------------------------------------------------------------------------------

class _Counting:
    """The native ops namespace, counting the layer's kernel calls."""

    def __init__(self):
        self.calls = 0

    def half_linear(self, *args):
        self.calls += 1
        return OPS.half_linear(*args)


@needs_kernels
@pytest.mark.parametrize("dtype", STORED, ids=["f16", "bf16"])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_layer_takes_the_kernel_for_decode_rows_and_the_float32_gemm_beyond(monkeypatch, dtype, bias):
    monkeypatch.setattr(half_linear, "_WIDEN_BLOCK_BYTES", 4 * 64 * 40)  # 40 output rows per block: 3 blocks
    torch.manual_seed(0)
    linear = nn.Linear(64, 100, bias=bias)
    ops = _Counting()
    layer = HalfWeightLinear.from_linear(linear, dtype, ops)
    assert layer.weight.dtype == dtype and layer.weight.shape == (100, 64)
    assert layer.bias is None if not bias else layer.bias.dtype == torch.float32
    assert torch.equal(layer.dequantized_weight(torch.float32), linear.weight.detach().to(dtype).float())
    widened = nn.Linear(64, 100, bias=bias)
    widened.weight.data = layer.dequantized_weight(torch.float32)
    if bias:
        widened.bias.data = linear.bias.detach()
    for rows, kernel_calls in ((1, 1), (7, 1), (half_linear.KERNEL_MAX_ROWS, 1),
                               (half_linear.KERNEL_MAX_ROWS + 1, 0), (300, 0)):
        ops.calls = 0
        x = torch.randn(rows, 64)
        got = layer(x)
        assert ops.calls == kernel_calls, rows
        assert got.shape == (rows, 100) and got.dtype == torch.float32
        assert torch.allclose(got, widened(x), rtol=1e-5, atol=1e-5), rows
    x3 = torch.randn(2, 3, 64)  # any leading shape, as nn.Linear takes
    assert torch.allclose(layer(x3), widened(x3), rtol=1e-5, atol=1e-5)


def test_layer_without_the_kernels_and_its_refusals():
    torch.manual_seed(0)
    linear = nn.Linear(24, 10)
    layer = HalfWeightLinear.from_linear(linear, torch.bfloat16, None)  # no native ops: torch's GEMM always
    x = torch.randn(3, 24)
    assert torch.allclose(layer(x), F.linear(x, linear.weight.to(torch.bfloat16).float(), linear.bias), atol=1e-6)
    assert torch.equal(layer.rows(torch.tensor([4, 1]), torch.float32), layer.weight[[4, 1]].float())
    with torch.no_grad():
        linear.weight[2, 3] = 1e5  # past float16's 65504: it would be inf
    with pytest.raises(ValueError, match="exceeds torch.float16's range"):
        HalfWeightLinear.from_linear(linear, torch.float16, None)
    assert HalfWeightLinear.from_linear(linear, torch.bfloat16, None).weight.isfinite().all()
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        HalfWeightLinear.from_linear(linear, torch.float32, None)


# ---- configuration ---------------------------------------------------------------------------

def test_decode_weights_config_field_and_flag():
    assert EngineConfig(model="m").decode_weights == "auto"
    for value in ("auto", "float32", "float16", "bfloat16"):
        assert EngineConfig(model="m", decode_weights=value).decode_weights == value
    for bad in ("fp16", "int8", None):
        with pytest.raises(ValueError, match="decode_weights must be one of auto, float32, float16, bfloat16"):
            EngineConfig(model="m", decode_weights=bad)
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_config_from_args(parser.parse_args(["--model", "m"])).decode_weights == "auto"
    args = parser.parse_args(["--model", "m", "--decode-weights", "float16"])
    assert engine_config_from_args(args).decode_weights == "float16"
    with pytest.raises(SystemExit):
        parser.parse_args(["--model", "m", "--decode-weights", "half"])


CPU = torch.device("cpu")


@pytest.mark.parametrize("requested, checkpoint, want", [
    ("auto", torch.bfloat16, torch.bfloat16), ("auto", torch.float16, torch.float16),
    ("auto", torch.float32, None), ("auto", None, None),
    ("float32", torch.bfloat16, None), ("float16", torch.float32, torch.float16),
    ("bfloat16", torch.float32, torch.bfloat16), ("float16", torch.bfloat16, torch.float16)])
def test_choose_decode_weights_for_a_float32_model(requested, checkpoint, want):
    dtype, why = choose_decode_weights(requested, checkpoint, torch.float32, CPU, "none", True)
    assert dtype == want, why
    assert ("lossless" in why) == (want is not None and want == checkpoint)
    assert ("rounded" in why) == (want is not None and want != checkpoint)


@pytest.mark.parametrize("case, args", [
    ("not a CPU", dict(device=torch.device("cuda"))),
    ("bf16 compute", dict(compute_dtype=torch.bfloat16)), ("quantized", dict(quantization="int4")),
    ("no kernel", dict(kernel=False))])
def test_choose_decode_weights_changes_nothing_elsewhere(case, args):
    base = dict(requested="float16", checkpoint_dtype=torch.bfloat16, compute_dtype=torch.float32, device=CPU,
                quantization="none", kernel=True)
    assert choose_decode_weights(**base)[0] == torch.float16  # the case alone makes the difference
    dtype, why = choose_decode_weights(**{**base, **args})
    assert dtype is None and why, case


# ---- wiring: which layers a float32 model gets on this CPU ------------------------------------

@pytest.fixture(scope="module")
def bf16_checkpoint(checkpoint_dir, tmp_path_factory):
    """The float32 ``llama`` parity checkpoint saved again in bfloat16 (its config too)."""
    src = checkpoint_dir("llama")
    out = tmp_path_factory.mktemp("llama-bf16")
    for f in src.iterdir():
        if f.suffix == ".safetensors":
            save_file({k: v.to(torch.bfloat16) for k, v in load_file(f).items()}, out / f.name)
        else:
            (out / f.name).write_bytes(f.read_bytes())
    return out


def _load(model_dir, decode_weights: str, caplog):
    arch = architecture_from_hf_config(read_hf_config(model_dir))
    config = EngineConfig(str(model_dir), max_model_len=128, attention_backend="reference", decode_weights=decode_weights)
    with caplog.at_level(logging.INFO, logger="pagedserve.models.loader"):
        model = loader.load_model(model_dir, arch, torch.float32, CPU, config)
    line = [r.getMessage() for r in caplog.records if r.getMessage().startswith("decode weights: ")]
    caplog.clear()
    assert len(line) == 1  # one startup line says what was chosen and why
    return model, line[0]


def _linear_kinds(model) -> set[str]:
    names = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
    return {type(m).__name__ if not isinstance(m, HalfWeightLinear) else f"half {str(m.weight.dtype)[6:]}"
            for name, m in model.named_modules() if name.rpartition(".")[2] in names + ("lm_head",)}


@needs_kernels
@pytest.mark.parametrize("flag", ["auto", "float32", "float16", "bfloat16"])
def test_which_linear_a_float32_model_gets_on_this_cpu(checkpoint_dir, bf16_checkpoint, caplog, flag):
    """float32 and bf16 checkpoints computed in float32 (on any CPU, native bf16 or not): auto
    stores the bf16 checkpoint's weights as bf16 (lossless) and keeps the float32 one float32;
    float16 and bfloat16 store both 16-bit; float32 stores neither."""
    for model_dir, stored in ((checkpoint_dir("llama"), torch.float32), (bf16_checkpoint, torch.bfloat16)):
        model, line = _load(model_dir, flag, caplog)
        want = {"auto": stored if stored != torch.float32 else None, "float32": None,
                "float16": torch.float16, "bfloat16": torch.bfloat16}[flag]
        kinds = _linear_kinds(model)
        if want is None:
            assert not any(k.startswith("half") for k in kinds), (flag, kinds)
            assert line.startswith("decode weights: float32 ("), line
        else:
            assert kinds == {f"half {str(want)[6:]}"}, (flag, kinds)
            assert line.startswith(f"decode weights: {str(want)[6:]} ("), line
            assert ("lossless" in line) == (want == stored), line


@needs_kernels
@pytest.mark.parametrize("native", [False, True])
def test_a_cpu_with_native_bf16_decodes_a_float32_model_from_16_bit_weights_too(monkeypatch, bf16_checkpoint,
                                                                                 caplog, native):
    """Native bf16 changes the default compute dtype (bfloat16), not what a model asked to compute
    in float32 stores: there too a bf16 checkpoint decodes from its bf16 weights (on a Sapphire
    Rapids-class Xeon the fastest one-stream path, docs/BENCHMARKS.md)."""
    monkeypatch.setattr(loader, "cpu_has_native_bf16", lambda: native)
    model, line = _load(bf16_checkpoint, "auto", caplog)
    assert _linear_kinds(model) == {"half bfloat16"}
    assert line.startswith("decode weights: bfloat16 (") and "lossless" in line, line


@needs_kernels
def test_a_bf16_checkpoint_decodes_the_same_logits_from_half_the_bytes(bf16_checkpoint, checkpoint_dir, caplog):
    """Lossless: the bf16 checkpoint computed in float32 from its bf16 weights as stored gives the
    float32-stored model's logits up to summation order, from half the linear bytes; a tied LM
    head becomes one 16-bit table for lookups and logits."""
    full, _ = _load(bf16_checkpoint, "float32", caplog)
    half, _ = _load(bf16_checkpoint, "auto", caplog)
    ids = torch.tensor([5, 17, 300, 9, 31999])
    hidden = full.embed_tokens(ids)
    assert torch.equal(half.embed_tokens(ids), hidden)
    want = full.compute_logits(hidden)
    assert torch.allclose(half.compute_logits(hidden), want, rtol=1e-4, atol=1e-4 * want.abs().max().item())
    for name, m in full.named_modules():
        if isinstance(m, nn.Linear) or type(m).__name__ in ("PackedLinear", "PanelLinear"):
            other = half.get_submodule(name)
            assert isinstance(other, HalfWeightLinear), name
            x = torch.randn(3, other.in_features)
            assert torch.allclose(other(x), m(x), rtol=1e-4, atol=1e-4), name
    assert weight_bytes(half) < weight_bytes(full) * 0.75  # the linears (most of the bytes) at 2 of 4 bytes

    tied, line = _load(checkpoint_dir("llama-tied"), "float16", caplog)
    assert isinstance(tied.lm_head, HalfWeightLinear) and isinstance(tied.embed_tokens, QuantizedEmbedding)
    assert tied.embed_tokens.table is tied.lm_head  # one table, held once
    assert tied.lm_head.weight.dtype == torch.float16 and "rounded" in line
    ref, _ = _load(checkpoint_dir("llama-tied"), "float32", caplog)
    assert torch.allclose(tied.embed_tokens(ids), ref.embed_tokens(ids), rtol=1e-3, atol=1e-4)
    want = ref.compute_logits(hidden)
    assert torch.allclose(tied.compute_logits(hidden), want, rtol=1e-2, atol=1e-2 * want.abs().max().item())
