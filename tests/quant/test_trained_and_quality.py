"""A 20-step training run, then the quality measurements on it: parity, KL, agreement, the CLI table."""

from __future__ import annotations

import argparse
import json
import math

import pytest
import torch

from pagedserve.bench import quality
from pagedserve.config import EngineConfig
from pagedserve.engine.frontend.engine import Engine
from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.bench.trained import TrainSpec, load_heldout_tokens, split_sources, train_model
from pagedserve.kernels import native_ops

SPEC = TrainSpec(name="test", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128,
                 context_len=64, batch_size=4, steps=20, warmup_steps=2, learning_rate=3e-3, max_seconds=None)


@pytest.fixture(scope="module")
def trained_dir(tmp_path_factory):
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp("trained")
    report = train_model(SPEC, out, progress=False)
    torch.set_num_threads(before)
    return out, report


def test_held_out_files_are_never_trained_on():
    train, heldout = split_sources(10)
    assert heldout and train and not set(train) & set(heldout)
    assert len(heldout) == len(train + heldout) // 10


def test_training_learns_and_saves_a_loadable_checkpoint(trained_dir):
    out, report = trained_dir
    assert report["steps"] == 20
    # Starting from ln(4096) = 8.3 nats, 20 steps already learn the token frequencies.
    assert report["final_train_loss"] < 7.5 and report["heldout_loss_fp32"] < 7.5
    assert json.loads((out / "TRAINING.json").read_text())["parameters"] == report["parameters"]
    assert len(load_heldout_tokens(out)) == report["heldout_tokens"]
    assert (out / "tokenizer.json").exists() and (out / "config.json").exists()


def test_window_scoring_matches_transformers_and_identical_runs_agree(trained_dir):
    from transformers import AutoModelForCausalLM

    out, _ = trained_dir
    engine = Engine(EngineConfig(model=str(out), dtype="float32", num_kv_blocks=16, enable_prefix_caching=False,
                                 max_model_len=256))
    windows = quality.heldout_windows(load_heldout_tokens(out), 2, 48)
    ppl, lps = quality.score_windows(engine, windows)
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        want = hf(input_ids=torch.tensor([windows[0][:-1]])).logits[0].log_softmax(-1)
    assert torch.allclose(lps[0], want, atol=1e-3)
    assert 1 < ppl < 4096
    assert quality.mean_kl(lps, lps) == pytest.approx(0.0, abs=1e-6)
    assert quality.top1_agreement(lps, lps) == 1.0
    assert quality.agreement([[1, 2, 3]], [[1, 2, 3]]) == 1.0 and quality.agreement([[1, 2]], [[1, 5]]) == 0.5
    engine.add_request("x", [5, 6, 7], SamplingParams(max_tokens=2))
    with pytest.raises(RuntimeError):
        quality.window_logprobs(engine, windows[0])  # not idle: its blocks are someone's


def test_windows_scored_in_chunks_go_through_the_decode_kernels(trained_dir, tiny_ggufs):
    """Chunks read the earlier ones from the cache: on a float model the log-probabilities are the
    whole window's (to summation order). On a GGUF kept quantized a whole window's prefill (more
    rows than GGUFLinear gives the integer kernels) goes through a GEMM, chunks of 16 rows through
    the integer kernels: int16 activations hardly move the log-probabilities between the two, int8
    ones do. On the AVX2 path the GEMM computes at the activations' precision too (gguf_gemm_int16 /
    gguf_gemm_int8); with no vector path it is dequantize + torch's float32 GEMM either way."""
    out, _ = trained_dir
    engine = Engine(EngineConfig(model=str(out), dtype="float32", num_kv_blocks=16, enable_prefix_caching=False,
                                 max_model_len=256))
    window = quality.heldout_windows(load_heldout_tokens(out), 1, 48)[0][:-1]
    whole = quality.window_logprobs(engine, window)
    assert torch.allclose(quality.window_logprobs(engine, window, chunk=16), whole, atol=1e-4)
    assert quality.window_logprobs(engine, window, chunk=5).shape == whole.shape  # a short last chunk

    from pagedserve.models.loader import resolve_model_dir

    # Kept quantized and computed in float32, as `bench quality` scores a GGUF: bf16 rounding would hide it.
    gguf = quality.gguf_compute_view(str(resolve_model_dir(str(tiny_ggufs("Q4_1", tokenizer=True)))), "float32")
    from pagedserve.kernels import isa_paths, limit_isa
    from pagedserve.models.gguf_linear import kernel_rows_default

    # a whole prefill past the kernels' rows, on the AVX2 path where the CPU runs it: there the Q4_1
    # layers' kernels hand over at 128 rows (int8: 32) to the integer GEMM (AVX-512's take every row
    # count); with no vector path, dequantize + torch's float32 GEMM
    isa = "avx2" if "avx2" in isa_paths() else "scalar"
    ids = list(range(5, 5 + kernel_rows_default(isa, torch.float32, "Q4_1") + 32))
    lps = {}
    try:
        for act in ("int16", "int8"):
            e = Engine(EngineConfig(model=gguf, gguf_activations=act, num_kv_blocks=16, enable_prefix_caching=False,
                                    max_model_len=256, cpu_isa=isa))
            lps[act] = quality.window_logprobs(e, ids), quality.window_logprobs(e, ids, chunk=16)
    finally:
        limit_isa("auto")
    int16_moved = (lps["int16"][1] - lps["int16"][0]).abs().max().item()
    int8_moved = (lps["int8"][1] - lps["int16"][0]).abs().max().item()
    assert int8_moved > 10 * int16_moved and int8_moved > 1e-3, (int16_moved, int8_moved)
    gemm_moved = (lps["int8"][0] - lps["int16"][0]).abs().max().item()  # one prefill each
    assert gemm_moved > 10 * int16_moved if isa == "avx2" else gemm_moved == 0, (int16_moved, gemm_moved)


def test_quality_command_prints_the_table(trained_dir, capsys, tmp_path):
    out, _ = trained_dir
    # bfloat16 on every CPU: the byte arithmetic below is bf16's (auto computes in float32 on a CPU
    # without native bf16, where the lookup table is float32)
    args = argparse.Namespace(model=str(out), weights=["none", "int8"], kv=["auto", "int8"], dtype="bfloat16",
                              corpus=None,
                              windows=2,
                              window_len=32, chunk=0, gguf_activations="int16", prompts=2, prompt_len=16,
                              gen_tokens=6, kv_budget="1MiB", threads=None,
                              max_model_len=256, decode_tokens=4, repeats=1, json_out=str(tmp_path / "q.json"))
    assert quality.run_quality(args) == 0
    text = capsys.readouterr().out
    assert "| weights | KV | perplexity" in text and "| int8 | int8 |" in text
    rows = json.loads((tmp_path / "q.json").read_text())["rows"]
    dtype = rows[0]["model_dtype"]  # "none" and "auto" are labelled with the checkpoint's own dtype
    assert dtype in ("bfloat16", "float32") and f"| {dtype} | {dtype} |" in text and f"| {dtype} | int8 |" in text
    assert [(r["weights"], r["kv"]) for r in rows] == [("none", "auto"), ("none", "int8"), ("int8", "auto"),
                                                      ("int8", "int8")]
    ref = rows[0]
    assert ref["mean_kl"] == pytest.approx(0, abs=1e-9) and ref["greedy_agreement"] == 1.0
    assert ref["top1_agreement"] == 1.0 and all(0.5 < r["top1_agreement"] <= 1 for r in rows)
    for r in rows[1:]:
        assert math.isfinite(r["perplexity"]) and r["mean_kl"] >= 0
        assert abs(r["ppl_change"]) < 0.05  # int8 on a barely trained model: a few percent at most
    assert rows[1]["seats"] > 1.7 * ref["seats"]
    # The tied model keeps its bf16 embedding table for lookups, and its logits read that same table
    # (a tied head is never prepacked: models/packed.py), plus the head's int8 screen for greedy
    # steps (models/head_screen.py: a byte a weight, a scale and a bound a row), so ref = body + 1
    # table + the screen on every CPU with the native kernels. Quantized, the head is an int8 copy
    # (and has no screen), and int8 halves every matmul weight:
    # bytes = half the body + the table + half the table (+ scales).
    table = SPEC.vocab_size * SPEC.hidden_size * 2
    screen = (SPEC.vocab_size * SPEC.hidden_size + 8 * SPEC.vocab_size) if native_ops() is not None else 0
    body = ref["weight_bytes"] - table - screen
    assert rows[2]["weight_bytes"] == pytest.approx(body / 2 + 1.5 * table, rel=0.03)


def test_bench_parsers_register_both_commands():
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="bench")
    quality.add_parser(sub)
    args = parser.parse_args(["quality", "--weights", "int4", "--kv", "fp8"])
    assert args.func is quality.run_quality and args.weights == ["int4"]
    args = parser.parse_args(["quant-decode", "--models", "tiny", "--repeats", "1"])
    assert args.func is quality.run_quant_decode
