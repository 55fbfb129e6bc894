"""The engine's behaviour switches are config fields with flags, passed down explicitly (issue 33):
``--no-native-kernels``, ``--pack-weights`` and ``--group-kernels`` reach ``EngineConfig`` and
change what the engine builds; nothing reads them from the environment."""

from __future__ import annotations

import argparse

import pytest
import torch
from torch import nn

from pagedserve.config import EngineConfig
from pagedserve.engine.args import add_engine_args, engine_config_from_args
from pagedserve.engine.core.engine_core import EngineCore
from pagedserve.engine.frontend.engine import Engine
from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.kernels import native_ops
from pagedserve.models.packed import PackedLinear, PanelLinear, TileLinear, can_pack
from pagedserve.models.quant import Int4Linear
from tests.conftest import assert_no_leaks, run_all


def _config(model_dir, *flags: str) -> EngineConfig:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    return engine_config_from_args(parser.parse_args(["--model", str(model_dir), *flags]))


def _small(model_dir, **kwargs) -> EngineConfig:
    return EngineConfig(model=str(model_dir), num_kv_blocks=32, max_model_len=128, max_num_seqs=2, **kwargs)


def _layers(core: EngineCore, kind: type) -> list[nn.Module]:
    return [m for m in core.runner.model.modules() if isinstance(m, kind)]


def test_flags_reach_the_config_with_the_old_defaults(tiny_model_dir):
    default = _config(tiny_model_dir)
    assert (default.native_kernels, default.pack_weights, default.group_kernels) == (True, "auto", False)
    given = _config(tiny_model_dir, "--no-native-kernels", "--pack-weights", "panel", "--group-kernels")
    assert (given.native_kernels, given.pack_weights, given.group_kernels) == (False, "panel", True)
    with pytest.raises(SystemExit):  # argparse refuses a value outside the choices
        _config(tiny_model_dir, "--pack-weights", "fast")
    with pytest.raises(ValueError, match="pack_weights must be one of auto, onednn, panel, none"):
        EngineConfig(model="m", pack_weights="fast")
    with pytest.raises(ValueError, match="native_kernels must be true or false"):
        EngineConfig(model="m", native_kernels="no")  # type: ignore[arg-type]


def test_without_native_kernels_the_engine_runs_on_torch_alone(tiny_model_dir):
    engine = Engine(_small(tiny_model_dir, native_kernels=False))
    core = engine.core
    assert core.config.attention_backend == "matmul"  # auto: the fused kernel is not asked for
    assert core.runner.model.native_decode is None
    assert not _layers(core, PanelLinear)
    engine.add_request("a", "def f(x):", SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    engine.add_request("b", "import os", SamplingParams(max_tokens=4, temperature=0.8, seed=3, ignore_eos=True))
    done = run_all(engine)
    assert [len(done[r].outputs[0].token_ids) for r in ("a", "b")] == [6, 4]
    assert_no_leaks(engine)
    engine.close()
    with pytest.raises(ValueError, match="--no-native-kernels"):
        EngineCore(_small(tiny_model_dir, native_kernels=False, attention_backend="fused"))


def test_pack_weights_chooses_the_linear_layout(tiny_model_dir):
    for choice in ("none", "auto", "onednn", "panel"):
        core = EngineCore(_small(tiny_model_dir, dtype="float32", decode_weights="float32", pack_weights=choice))
        packed, panels = _layers(core, PackedLinear), _layers(core, PanelLinear)
        if choice == "none":
            assert not packed and not panels
        elif choice in ("auto", "onednn"):  # float32: oneDNN either way
            assert not panels and bool(packed) == can_pack(core.dtype, core.device)
        elif native_ops() is not None:
            assert panels  # float32 linears go to the native panel kernel
        core.close()
    for choice in ("onednn", "auto"):  # bf16: tiles where the CPU has AMX-BF16, else oneDNN
        core = EngineCore(_small(tiny_model_dir, dtype="bfloat16", pack_weights=choice))
        tiles = _layers(core, TileLinear)
        ops = native_ops()
        assert bool(tiles) == (choice == "auto" and ops is not None and bool(ops.tile_linear_usable()))
        core.close()


def test_group_kernels_are_opt_in(tiny_model_dir):
    cores = {on: EngineCore(_small(tiny_model_dir, quantization="int4", group_kernels=on)) for on in (False, True)}
    off = _layers(cores[False], Int4Linear)
    assert off and all(layer.group_ops is None and layer.packed_for_cpu for layer in off)
    if native_ops() is not None:
        on = _layers(cores[True], Int4Linear)
        assert on and all(layer.group_ops is not None and not layer.packed_for_cpu for layer in on)
    for core in cores.values():
        core.close()


@pytest.mark.skipif(native_ops() is None, reason="the head screen is a native kernel")
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_the_head_screen_gives_greedy_steps_the_same_tokens_and_leaves_the_rest_alone(tiny_model_dir, dtype):
    """--no-head-screen reaches the config; with the screen (the default) plain greedy steps go
    through it and produce the full head's tokens, and a request with logprobs in the batch keeps the
    whole head: the same tokens and logprobs either way."""
    assert _config(tiny_model_dir).head_screen and not _config(tiny_model_dir, "--no-head-screen").head_screen
    with pytest.raises(ValueError, match="head_screen must be true or false"):
        EngineConfig(model="m", head_screen="off")  # type: ignore[arg-type]
    results = {}
    for on in (True, False):
        engine = Engine(_small(tiny_model_dir, dtype=dtype, head_screen=on))
        model = engine.core.runner.model
        assert (model.head_screen is not None) == on
        screened = []
        if on:  # count the steps that took it (the real kernel still runs)
            screen_logits = model.head_screen.logits
            model.head_screen.logits = lambda h, stack=None: screened.append(h.shape[0]) or screen_logits(h, stack)
            assert model.native_decode is not None  # and its stack gives the registered op's bits
            h = torch.randn(3, model.head_screen.weight.shape[1]).to(model.head_screen.weight.dtype)
            assert torch.equal(screen_logits(h, model.native_decode.stack), screen_logits(h))
        greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
        for i, prompt in enumerate(("def f(x):", "import os", "class A:")):
            engine.add_request(f"g{i}", prompt, greedy)
        done = run_all(engine)
        steps_alone = len(screened)
        engine.add_request("lp", "for i in", SamplingParams(max_tokens=6, temperature=0, logprobs=2, ignore_eos=True))
        engine.add_request("g", "while True:", greedy)
        done |= run_all(engine)
        results[on] = {r: (out.outputs[0].token_ids, [(lp.token_id, round(lp.logprob, 5)) for lp in out.outputs[0].logprobs or []])
                       for r, out in done.items()}
        if on:
            assert steps_alone > 0 and all(rows <= model.head_screen.max_rows for rows in screened)
            assert len(screened) - steps_alone <= 12 - 6  # with "lp" running no step was screened
        assert_no_leaks(engine)
        engine.close()
    assert results[True] == results[False]


@pytest.mark.skipif(native_ops() is None, reason="the head screen is a native kernel")
@pytest.mark.parametrize("model", ["tiny", "default"])
def test_a_gguf_q8_0_heads_screen_gives_batched_greedy_steps_the_same_tokens(model, request):
    """A GGUF file's Q8_0 head (the tiny model's untied output; the default model's tied table, real
    weights whose logits have real near-ties) takes plain-greedy steps of several rows through its
    int8 screen: the full head's tokens with the screen on or off; a step with a logprobs request in
    it keeps the whole head."""
    from pagedserve.models.head_screen import GGUF_SCREEN_MIN_ROWS, GGUFHeadScreen

    path = (request.getfixturevalue("tiny_ggufs")("Q8_0", tokenizer=True) if model == "tiny"
            else request.getfixturevalue("smollm2_gguf"))
    streams = GGUF_SCREEN_MIN_ROWS + 2
    results = {}
    for on in (True, False):
        engine = Engine(EngineConfig(model=str(path), num_kv_blocks=64, max_model_len=128, max_num_seqs=streams,
                                     head_screen=on))
        model = engine.core.runner.model
        screened = []
        if on:
            assert isinstance(model.head_screen, GGUFHeadScreen)
            screen_logits = model.head_screen.logits
            model.head_screen.logits = lambda h, stack=None: screened.append(h.shape[0]) or screen_logits(h, stack)
        else:
            assert model.head_screen is None
        greedy = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
        for i in range(streams):
            engine.add_request(f"g{i}", f"def f{i}(x):", greedy)
        done = run_all(engine)
        alone = len(screened)
        engine.add_request("lp", "for i in", SamplingParams(max_tokens=4, temperature=0, logprobs=2, ignore_eos=True))
        for i in range(streams - 1):
            engine.add_request(f"h{i}", f"class C{i}:", greedy)
        done |= run_all(engine)
        results[on] = {r: (out.outputs[0].token_ids, [(lp.token_id, round(lp.logprob, 5)) for lp in out.outputs[0].logprobs or []])
                       for r, out in done.items()}
        if on:
            assert alone > 0 and all(rows >= GGUF_SCREEN_MIN_ROWS for rows in screened)
            assert len(screened) - alone <= 10 - 4  # with "lp" running no step was screened
        assert_no_leaks(engine)
        engine.close()
    assert results[True] == results[False]
