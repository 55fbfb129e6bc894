"""``--cpu-isa``: the native kernels' ``auto`` dispatch takes at most the named path (a newer CPU run
as an older one), the choices that follow the path follow it too, and lifting the limit restores
the CPU's best. Every path this CPU runs is tried; the limit is lifted again after each test."""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels import best_isa, gguf_gemm_usable, isa_paths, limit_isa, native_ops

ops = native_ops()
pytestmark = pytest.mark.skipif(ops is None, reason="native kernels unavailable")


@pytest.fixture(autouse=True)
def lifted_after():
    yield
    limit_isa("auto")


@pytest.mark.parametrize("path", ["scalar", "avx2", "avx512", "amx"])
def test_auto_takes_at_most_the_limit(path):
    paths = isa_paths()
    limit_isa(path)
    # a limit above this CPU's best leaves its best
    want = path if path in paths else paths[-1]
    assert best_isa() == want
    assert gguf_gemm_usable(torch.float32) == (want != "scalar")
    if want in ("scalar", "avx2"):  # the bf16 GEMM and the AMX-BF16 tiles are AVX-512 paths
        assert not gguf_gemm_usable(torch.bfloat16)
        assert not ops.tile_linear_usable()
    limit_isa("auto")
    assert best_isa() == paths[-1]


def test_an_unknown_path_is_refused():
    with pytest.raises(RuntimeError, match="unknown instruction-set path 'avx3'"):
        ops.limit_isa("avx3")
    assert best_isa() == isa_paths()[-1]


@pytest.mark.parametrize("path", ["scalar", "avx2", "avx512"])
def test_a_kernel_asked_for_auto_computes_as_the_limited_path(path):
    """half_linear's auto under the limit gives the named path's bits exactly (the paths' sums run
    in different orders, so at least one pair of them differs in the last bits)."""
    if path not in isa_paths():
        pytest.skip(f"this CPU cannot run {path}")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 200, generator=g)
    w = torch.randn(70, 200, generator=g).bfloat16()
    named = torch.empty(3, 70)
    ops.half_linear(named, x, w, None, path)
    limit_isa(path)
    auto = torch.empty(3, 70)
    ops.half_linear(auto, x, w, None, "auto")
    assert torch.equal(auto, named)


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_1"])
def test_an_engine_under_avx2_lays_out_and_computes_as_on_an_avx2_cpu(kind, tiny_ggufs):
    """A GGUF model under ``cpu_isa="avx2"``: float32 compute from ``--dtype auto`` (no native bf16
    there), the layouts and row limits of the AVX2 kernels (Q8_0 planar: no AVX2 group kernel reads
    it in rows16), and the same greedy tokens as the CPU's own path in float32 (the integer kernels'
    sums are the same on every path); every block back."""
    from pagedserve.bench.quality import gguf_compute_view
    from pagedserve.config import EngineConfig
    from pagedserve.engine.frontend.engine import Engine
    from pagedserve.engine.sampling_params import SamplingParams
    from pagedserve.models.gguf_linear import GGUFLinear, kernel_rows_default, rows16_default, widest_format
    from pagedserve.models.loader import resolve_model_dir
    from tests.conftest import assert_no_leaks, run_all

    if "avx2" not in isa_paths():
        pytest.skip("this CPU cannot run the avx2 path")
    path = str(tiny_ggufs(kind, tokenizer=True))
    # the CPU's own path computing in float32 with the blocks kept: a copy of the prepared
    # directory whose config says float32 (an explicit --dtype would dequantize them)
    float32_view = gguf_compute_view(str(resolve_model_dir(path)), "float32")
    prompts = {"a": list(range(5, 40)), "b": list(range(100, 117))}
    tokens = {}
    for isa, model in [("avx2", path), ("auto", float32_view)]:
        engine = Engine(EngineConfig(model=model, cpu_isa=isa, num_kv_blocks=64))
        linears = [m for m in engine.core.runner.model.modules() if isinstance(m, GGUFLinear)]
        assert linears and engine.core.dtype == torch.float32
        if isa == "avx2":
            assert best_isa() == "avx2"
            assert all(lin.kernel_rows == kernel_rows_default("avx2", torch.float32, widest_format(lin.formats, lin.widths))
                       for lin in linears)
            assert all(r == (f in rows16_default("avx2")) for lin in linears for f, r in zip(lin.formats, lin.rows16))
        for rid, prompt in prompts.items():
            engine.add_request(rid, prompt, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
        tokens[isa] = {rid: list(out.outputs[0].token_ids) for rid, out in run_all(engine).items()}
        assert_no_leaks(engine)
    assert best_isa() == isa_paths()[-1]  # the second engine's auto lifted the limit
    assert tokens["avx2"] == tokens["auto"]


def test_int8_activations_under_avx2_give_the_layers_their_kernel_rows_and_the_head_int16(tiny_ggufs, caplog):
    """``gguf_activations="int8"`` under ``cpu_isa="avx2"``: every layer but the LM head takes int8
    activations and the rows measured against the int8 GEMM (FLOAT32_INT8_KERNEL_ROWS), the head
    int16 and int16's rows; the start-up log names the int8 GEMM; a prompt past the kernels' rows
    and a few decode steps run, and every block comes back."""
    import logging

    from pagedserve.config import EngineConfig
    from pagedserve.engine.frontend.engine import Engine
    from pagedserve.engine.sampling_params import SamplingParams
    from pagedserve.models.gguf_linear import GGUFLinear, kernel_rows_default, widest_format
    from tests.conftest import assert_no_leaks, run_all

    if "avx2" not in isa_paths():
        pytest.skip("this CPU cannot run the avx2 path")
    try:
        with caplog.at_level(logging.INFO, logger="pagedserve"):
            engine = Engine(EngineConfig(model=str(tiny_ggufs("Q4_1", tokenizer=True)), cpu_isa="avx2",
                                         gguf_activations="int8", num_kv_blocks=64))
        model = engine.core.runner.model
        layers = [m for m in model.modules() if isinstance(m, GGUFLinear) and m is not model.lm_head]
        assert layers and not any(m.residual for m in layers)
        assert all(m.kernel_rows == kernel_rows_default("avx2", torch.float32, widest_format(m.formats, m.widths),
                                                        "int8") for m in layers)
        if isinstance(model.lm_head, GGUFLinear):
            head = model.lm_head
            assert head.residual
            assert head.kernel_rows == kernel_rows_default("avx2", torch.float32, widest_format(head.formats, head.widths))
        assert "gguf_gemm_int8" in caplog.text
        engine.add_request("a", list(range(5, 5 + 2 * max(m.kernel_rows for m in layers))),
                           SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
        assert len(run_all(engine)["a"].outputs[0].token_ids) == 6
        assert_no_leaks(engine)
    finally:
        limit_isa("auto")
