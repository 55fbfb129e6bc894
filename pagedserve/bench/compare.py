"""``pagedserve bench compare``: pagedserve against llama.cpp on the same GGUF file, on this machine.

Rows (tokens/s, higher is better):

* **decode**: one stream, a 16-token prompt, 256 greedy output tokens (ignore_eos); the rate of
  the tokens after the first. llama.cpp: ``llama-bench -p 0 -n 256`` (``avg_ts``).
* **prefill**: a cold 512-token prompt (no prefix-cache hit), max_tokens=1 after a warm-up;
  512 ÷ time to first token. llama.cpp: ``llama-bench -p 512 -n 0``.
* **batch**: 16 streams of 64-token prompts, 128 output tokens each; the generation rate, i.e.
  the tokens after every stream's first ÷ the time after it. llama.cpp:
  ``llama-batched-bench -npp 64 -ntg 128 -npl 16`` (``S_TG t/s``).

Every round of every engine is a fresh process (pagedserve's: ``python -m
pagedserve.bench.compare --worker ROW ...``, which loads the model with the offline engine and
prints one JSON line), with the same thread count, and the engines alternate A B A B within each
row, so drift on a shared machine (another job, thermal limits) hits them alike; each figure is
the median of ``--rounds`` rounds. vLLM-CPU and OpenVINO GenAI are optional decode-row columns,
run only when their venvs exist under the peers directory and ``--hf-checkpoint`` names the
model as a Hugging Face directory (neither runs GGUF files reliably).

Under each file's decode row, its roofline (``bench/roofline.py``): the memory read bandwidth of
the same thread count, measured once before any engine runs, over the bytes a token reads from
the file, and each engine's median as a share of that ceiling; the engines that run
``--hf-checkpoint`` get a second ceiling over the bytes a token reads from the checkpoint.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

# no torch: the worker pins its threads before torch loads
from pagedserve.config import CPU_ISAS, GGUF_ACTIVATIONS, KV_CACHE_DTYPES

ROWS = ("decode", "prefill", "batch", "w1")
DEFAULT_ROWS = ROWS[:3]
# The /proc/cpuinfo flags that decide which kernels either engine can use, in the order printed.
ISA_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni",
             "amx_tile", "amx_int8", "amx_bf16")
LLAMA_BINARIES = ("llama-bench", "llama-batched-bench")
PAGEDSERVE, LLAMA_CPP, VLLM, OPENVINO = "pagedserve", "llama.cpp", "vllm", "openvino"
# W1 (docs/WORKLOADS.md) runs on the --hf-checkpoint only, pagedserve there and the optional peers
# (continuous-batching offline APIs; llama.cpp's tools batch equal lengths only).
W1_ROW = "w1"
# pagedserve on the --hf-checkpoint, beside the peers that run it: their ratios are taken against it.
PAGEDSERVE_CHECKPOINT = "pagedserve-hf"
# The optional peers: venv under the peers directory, and the driver script run by its python.
OPTIONAL_PEERS = {VLLM: ("venv-vllm", "vllm_decode.py"), OPENVINO: ("venv-openvino", "openvino_decode.py")}
DTYPES = ("auto", "float32", "bfloat16", "float16")
# The checkpoint engines' KV precision (--kv-cache-dtype): pagedserve's setting, and OpenVINO GenAI's
# KV_CACHE_PRECISION to match (openvino_kv_precision).
# vLLM-CPU keeps its own default, the model dtype.
KV_PRECISIONS = ("auto", "int8", "fp8")
# What torch's own libraries read at start-up to stay within a --cpu-isa (oneDNN, MKL, ATen's
# vectorized kernels): the worker runs under these, so that the CPU it stands for is stood for whole.
TORCH_ISA_ENV = {
    "avx512": {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16", "MKL_ENABLE_INSTRUCTIONS": "AVX512",
               "ATEN_CPU_CAPABILITY": "avx512"},
    "avx2": {"ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"},
    "scalar": {"ONEDNN_MAX_CPU_ISA": "SSE41", "MKL_ENABLE_INSTRUCTIONS": "SSE4_2", "ATEN_CPU_CAPABILITY": "default"},
}


@dataclass(frozen=True)
class Shape:
    """One row's request shape: ``streams`` requests of ``prompt`` tokens, ``output`` tokens each."""

    prompt: int
    output: int
    streams: int = 1


def shapes(decode_tokens: int = 256) -> dict[str, Shape]:
    return {"decode": Shape(16, decode_tokens), "prefill": Shape(512, 1), "batch": Shape(64, 128, 16)}


def peers_dir() -> Path:
    from pagedserve.config import cache_dir

    return cache_dir() / "peers"


# ---------------------------------------------------------------- arguments


def _int_at_least(low: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value

    return parse


_positive_int = _int_at_least(1)


def _rows(text: str) -> list[str]:
    rows = [r.strip() for r in text.split(",") if r.strip()]
    bad = [r for r in rows if r not in ROWS]
    if not rows or bad:
        raise argparse.ArgumentTypeError(f"rows are a comma-separated subset of {','.join(ROWS)}, got {text!r}")
    return list(dict.fromkeys(rows))  # each once, in the order given


def _quant_types(text: str) -> list[str]:
    types = [t.strip() for t in text.split(",") if t.strip()]
    if not types or not all(t.replace("_", "").isalnum() for t in types):
        raise argparse.ArgumentTypeError(f"llama-quantize type names such as Q8_0,Q4_K_M, got {text!r}")
    return types


def add_parser(bench) -> None:
    p = bench.add_parser(
        "compare", help="pagedserve against llama.cpp on the same GGUF file (decode, prefill, 16-stream batch)",
        description="pagedserve against llama.cpp's llama-bench / llama-batched-bench on the same GGUF file and "
                    "thread count, each round a fresh process, engines alternating A B A B, medians of --rounds "
                    "rounds and their ratio per row. Rows: decode (16-token prompt, 256 greedy tokens), prefill "
                    "(cold 512-token prompt, time to first token), batch (16 streams x 128 tokens, 64-token "
                    "prompts, generation rate). llama.cpp comes from scripts/setup_peers.sh llamacpp. Optional "
                    "decode-row columns: vLLM-CPU and OpenVINO GenAI (scripts/setup_peers.sh vllm / openvino), "
                    "only with --hf-checkpoint, since neither runs GGUF files reliably; pagedserve then runs "
                    "that checkpoint too (a pagedserve-hf column, the peers' ratios taken against it). Under "
                    "the decode row: its ceiling (the memory read bandwidth of the same threads over the bytes "
                    "a token reads) and each engine's share of it; with --hf-checkpoint, a second one over the "
                    "checkpoint's bytes for the engines that run it, and a third for pagedserve-hf's greedy "
                    "tokens, whose LM head is read through its int8 screen.")
    p.add_argument("--model", default=None,
                   help="GGUF file both engines load (default: the default model, SmolLM2-135M-Instruct Q4_1)")
    p.add_argument("--dtype", default="auto", choices=DTYPES, help="pagedserve's --dtype (default auto)")
    p.add_argument("--gguf-activations", default="int16", choices=list(GGUF_ACTIVATIONS),
                   help="pagedserve's --gguf-activations: int16 (its default) or int8 (llama.cpp's own activation "
                        "precision) (default int16)")
    p.add_argument("--rows", type=_rows, default=list(DEFAULT_ROWS),
                   help="comma-separated: decode,prefill,batch,w1 (default decode,prefill,batch); w1 is W1 of "
                        "docs/WORKLOADS.md (64 requests, prompts 64-512, outputs 32-256, output tokens/s of one run "
                        "after a warm-up) on --hf-checkpoint, pagedserve against vLLM-CPU and OpenVINO GenAI where "
                        "their venvs exist")
    p.add_argument("--rounds", type=_positive_int, default=3, metavar="N",
                   help="rounds per engine and row; medians reported (default 3)")
    p.add_argument("--threads", type=_positive_int, default=None, metavar="N",
                   help="threads of every engine (default: the usable cores)")
    # At least 2: the rate is of the tokens after the first.
    p.add_argument("--decode-tokens", type=_int_at_least(2), default=256, metavar="N",
                   help="output tokens of the decode row (default 256; fewer for a quick check)")
    p.add_argument("--cpu-isa", default="auto", choices=list(CPU_ISAS),
                   help="run pagedserve as on a CPU with at most this instruction set (its --cpu-isa, and torch's "
                        "oneDNN / MKL / ATen held to the same through their environment variables), against "
                        "llama.cpp built for it: avx2 takes $PAGEDSERVE_CACHE/peers/llamacpp-avx2/bin "
                        "(scripts/setup_peers.sh llamacpp-avx2) unless --llama-cpp says otherwise; not with "
                        "--hf-checkpoint, whose peers run every instruction this CPU has (default auto)")
    p.add_argument("--llama-cpp", default=None, metavar="DIR",
                   help="directory of llama-bench and llama-batched-bench "
                        "(default: $PAGEDSERVE_CACHE/peers/llamacpp/bin, or llamacpp-avx2/bin with --cpu-isa avx2)")
    p.add_argument("--quantize", type=_quant_types, default=[], metavar="TYPES",
                   help="also run the rows on these requantizations of the model (e.g. Q8_0,Q4_K_M), made once with "
                        "llama-quantize --allow-requantize into $PAGEDSERVE_CACHE/peers/models")
    p.add_argument("--hf-checkpoint", default=None, metavar="DIR",
                   help="the same model as a Hugging Face directory: adds vLLM-CPU and OpenVINO GenAI decode columns "
                        "where their venvs exist under the peers directory (they do not run GGUF files reliably)")
    p.add_argument("--hf-dtype", default="auto", choices=DTYPES,
                   help="pagedserve's --dtype on the --hf-checkpoint (default auto; float32 decodes a bf16 "
                        "checkpoint from its 16-bit weights on the decode stack's own threads, the fastest one "
                        "stream measured on a CPU with native bf16, docs/BENCHMARKS.md)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=list(KV_PRECISIONS),
                   help="the --hf-checkpoint engines' KV precision, alike: pagedserve's --kv-cache-dtype, and OpenVINO "
                        "GenAI's KV_CACHE_PRECISION to match (int8 / fp8: its u8; auto: 16 bits for a 16-bit "
                        "checkpoint, bf16 on a CPU with native bf16 and f16 elsewhere, f32 otherwise, where its "
                        "plugin's own default is u8); vLLM-CPU keeps its default, the model dtype (default auto)")
    p.add_argument("--json", dest="json_out", default=None, help="write the result as JSON to this file")
    p.set_defaults(func=run)


# ---------------------------------------------------------------- the machine


def cpu_summary(cpuinfo: str) -> dict:
    """The CPU's model name and which of ``ISA_FLAGS`` it has, from /proc/cpuinfo's text."""
    model, flags = "unknown CPU", set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and model == "unknown CPU":
            model = value.strip()
        elif key == "flags" and not flags:
            flags = set(value.split())
    return {"model": model, "isa": [f for f in ISA_FLAGS if f in flags]}


def read_cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:  # not Linux: the summary says "unknown CPU"
        return ""


# ---------------------------------------------------------------- commands and their output


def missing_binaries(bin_dir: Path, names: tuple[str, ...]) -> list[str]:
    return [n for n in names if not os.access(bin_dir / n, os.X_OK)]


def batched_bench_supports_jsonl(bin_dir: Path) -> bool:
    """Whether this build of llama-batched-bench has ``--output-format jsonl`` (older ones print a table only)."""
    try:
        help_text = subprocess.run([str(bin_dir / "llama-batched-bench"), "--help"], capture_output=True,
                                   text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return "jsonl" in help_text.stdout + help_text.stderr


def llama_cpp_command(bin_dir: Path, row: str, shape: Shape, model: Path, threads: int, jsonl: bool) -> list[str]:
    t = str(threads)
    if row == "batch":
        cmd = [str(bin_dir / "llama-batched-bench"), "-m", str(model), "-c", "4096", "-b", "2048", "-ub", "512",
               "-npp", str(shape.prompt), "-ntg", str(shape.output), "-npl", str(shape.streams), "-t", t, "-fa", "on"]
        return cmd + (["--output-format", "jsonl"] if jsonl else [])
    prompt, gen = (0, shape.output) if row == "decode" else (shape.prompt, 0)
    return [str(bin_dir / "llama-bench"), "-m", str(model), "-t", t, "-fa", "1", "-p", str(prompt), "-n", str(gen),
            "-r", "1", "-o", "json"]


def worker_command(row: str, shape: Shape | None, model: str, dtype: str, threads: int,
                   gguf_activations: str = "int16", requests: Path | None = None, cpu_isa: str = "auto",
                   kv_cache_dtype: str = "auto") -> list[str]:
    """The pagedserve worker's command: a row's ``shape``, or for W1 its ``requests`` file; under a
    ``cpu_isa`` below this CPU's, torch's libraries held to it too (``env``, so the printed command
    reproduces the run)."""
    torch_env = [f"{k}={v}" for k, v in TORCH_ISA_ENV.get(cpu_isa, {}).items()]
    cmd = (["env", *torch_env] if torch_env else []) + [
        sys.executable, "-m", "pagedserve.bench.compare", "--worker", row, "--model", str(model), "--dtype", dtype,
        "--threads", str(threads)] + (["--cpu-isa", cpu_isa] if cpu_isa != "auto" else []) + (
        ["--kv-cache-dtype", kv_cache_dtype] if kv_cache_dtype != "auto" else [])
    if requests is not None:
        return cmd + ["--requests", str(requests)]
    assert shape is not None
    return cmd + ["--prompt", str(shape.prompt), "--output", str(shape.output), "--streams", str(shape.streams),
                  "--gguf-activations", gguf_activations]


def openvino_kv_precision(kv_cache_dtype: str, checkpoint: str, cpu_isa: list[str] | None = None) -> str:
    """OpenVINO GenAI's KV_CACHE_PRECISION for pagedserve's ``kv_cache_dtype`` on ``checkpoint``:
    u8 for 8 bits; for ``auto``, pagedserve's own bytes: 16 bits for a 16-bit checkpoint (bf16 where
    the CPU has native bf16, ``cpu_isa``'s flags, else f16, which every x86 plugin stores), f32
    otherwise."""
    from pagedserve.bench.plan_check import checkpoint_dtype

    if kv_cache_dtype != "auto":
        return "u8"
    if checkpoint_dtype(Path(checkpoint)) not in ("bfloat16", "float16"):
        return "f32"
    flags = cpu_summary(read_cpuinfo())["isa"] if cpu_isa is None else cpu_isa
    return "bf16" if {"avx512_bf16", "amx_bf16"} & set(flags) else "f16"


def peer_command(peer: str, shape: Shape | None, checkpoint: str, threads: int,
                 requests: Path | None = None, kv_cache_dtype: str = "auto") -> list[str]:
    venv, driver = OPTIONAL_PEERS[peer]
    cmd = [str(peers_dir() / venv / "bin" / "python"), str(Path(__file__).with_name("peer_drivers") / driver),
           "--model", checkpoint, "--threads", str(threads)]
    if requests is not None:
        cmd += ["--requests", str(requests)]
    else:
        assert shape is not None
        cmd += ["--prompt", str(shape.prompt), "--output", str(shape.output)]
    if peer == OPENVINO:  # its export of the checkpoint, made once, one per checkpoint path
        digest = hashlib.sha1(str(Path(checkpoint).resolve()).encode()).hexdigest()[:10]
        cmd += ["--ir", str(peers_dir() / "openvino-ir" / f"{Path(checkpoint).name}-{digest}"),
                "--kv-precision", openvino_kv_precision(kv_cache_dtype, checkpoint)]
    return cmd


def parse_llama_bench(stdout: str) -> float:
    """``avg_ts`` of llama-bench's ``-o json`` output (a list with one entry per test; we run one)."""
    try:
        tests = json.loads(stdout)
    except json.JSONDecodeError as e:
        raise ValueError(f"llama-bench printed no JSON ({e}): {stdout[-300:]!r}") from None
    if not isinstance(tests, list) or len(tests) != 1 or "avg_ts" not in tests[0]:
        raise ValueError(f"expected one llama-bench test with avg_ts, got {stdout[-300:]!r}")
    return float(tests[0]["avg_ts"])


def parse_batched_bench(output: str) -> float:
    """``S_TG t/s`` (generation tokens/s) of llama-batched-bench's one result, from its jsonl line
    (``speed_tg``) or, on builds without jsonl, its markdown table."""
    rates = []
    for line in output.splitlines():
        line = line.strip()
        if line.startswith("{") and '"speed_tg"' in line:
            rates.append(float(json.loads(line)["speed_tg"]))
        elif line.startswith("|"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            # | PP | TG | B | N_KV | T_PP s | S_PP t/s | T_TG s | S_TG t/s | T s | S t/s |; the header
            # and the ---- rule have no number in the first cell
            if len(cells) == 10 and cells[0].isdigit():
                rates.append(float(cells[7]))
    if len(rates) != 1:
        raise ValueError(f"expected one llama-batched-bench result, found {len(rates)}: {output[-300:]!r}")
    return rates[0]


def parse_json_line(stdout: str) -> float:
    """``tok_s`` of the last JSON line a pagedserve worker or a peer driver printed (vLLM logs its
    shutdown to stdout after the driver's line)."""
    for line in reversed(stdout.strip().splitlines()):
        if not line.startswith("{"):
            continue
        try:
            return float(json.loads(line)["tok_s"])
        except (ValueError, KeyError, TypeError):
            continue
    raise ValueError(f"expected a JSON line with tok_s, got {stdout[-300:]!r}")


def parse_output(engine: str, row: str, stdout: str) -> float:
    if engine == LLAMA_CPP:
        return parse_batched_bench(stdout) if row == "batch" else parse_llama_bench(stdout)
    return parse_json_line(stdout)


class KilledBySignal(RuntimeError):
    """A round whose process died on a signal (a crash, not an error it reported)."""


def without_repack(cmd: list[str]) -> list[str] | None:
    """The same llama.cpp command with its weight repacking off, or None where it is off already.
    Repacking is what puts llama.cpp's weights into its extra buffer types, its AMX one among
    them: on an AMX Xeon (llama-cpp-python 0.3.36's llama.cpp) ggml_backend_amx_mul_mat crashed
    with SIGSEGV on every batch of more than one token, while --repack 0 ran."""
    flag = ["--no-repack"] if Path(cmd[0]).name == "llama-batched-bench" else ["--repack", "0"]
    return None if flag[0] in cmd else cmd + flag


def run_command(engine: str, row: str, cmd: list[str]) -> float:
    """One round: run ``cmd`` to its end and read its tokens/s."""
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode < 0:
        raise KilledBySignal(f"{engine} ({row} row) was killed by signal {-proc.returncode}: {shlex.join(cmd)}")
    if proc.returncode != 0:
        raise RuntimeError(f"{engine} ({row} row) exited with status {proc.returncode}: {shlex.join(cmd)}\n"
                           f"{(proc.stderr or proc.stdout)[-2000:]}")
    # llama-batched-bench prints its result through llama.cpp's log, on stdout or stderr depending
    # on the build: read both (the model-loading lines around it are not results).
    text = proc.stdout + "\n" + proc.stderr if (engine, row) == (LLAMA_CPP, "batch") else proc.stdout
    return parse_output(engine, row, text)


# ---------------------------------------------------------------- rounds and the table


def schedule(plan: dict[str, dict[str, list[str]]], rounds: int) -> list[tuple[str, int, str]]:
    """(row, round, engine) in the order run: a row's rounds one after another, every engine once
    per round in the same order (A B A B), so slow drift on a shared machine hits each alike."""
    return [(row, k, engine) for row, engines in plan.items() for k in range(1, rounds + 1) for engine in engines]


def measure(plan: dict[str, dict[str, list[str]]], rounds: int, run=run_command, log=print) -> dict[str, dict]:
    """Every round of ``plan`` (row → engine → command); tokens/s by row and engine, a list per round.
    Where llama.cpp crashes with its weights repacked, the round runs again with repacking off, and
    so does every later round of that row (``plan`` keeps the command run, for the report)."""
    results: dict[str, dict[str, list[float]]] = {row: {e: [] for e in engines} for row, engines in plan.items()}
    for row, k, engine in schedule(plan, rounds):
        try:
            rate = run(engine, row, plan[row][engine])
        except KilledBySignal as crash:
            if engine != LLAMA_CPP or (fallback := without_repack(plan[row][engine])) is None:
                raise
            log(f"  {row:8} {crash}; its rounds of this row run with repacking off "
                f"({shlex.join(fallback[len(plan[row][engine]):])}), which keeps its weights out of the AMX "
                f"and repacked paths")
            plan[row][engine] = fallback
            rate = run(engine, row, fallback)
        results[row][engine].append(rate)
        log(f"  {row:8} round {k}/{rounds}  {engine:13} {rate:10.1f} tok/s")
    return results


def summarize(results: dict[str, dict[str, list[float]]]) -> dict[str, dict]:
    """Medians per row and engine, and pagedserve's median over each other engine's: llama.cpp's
    against pagedserve on the GGUF file, the optional peers' against pagedserve on their checkpoint
    (``PAGEDSERVE_CHECKPOINT``) where it ran, else on the file."""
    summary = {}
    for row, engines in results.items():
        medians = {e: statistics.median(r) for e, r in engines.items() if r}
        ratios = {}
        for e, m in medians.items():
            ours = PAGEDSERVE_CHECKPOINT if e in OPTIONAL_PEERS and PAGEDSERVE_CHECKPOINT in medians else PAGEDSERVE
            if e not in (PAGEDSERVE, PAGEDSERVE_CHECKPOINT) and ours in medians and m > 0:
                ratios[f"{ours}/{e}"] = medians[ours] / m
        summary[row] = {"engines": {e: {"rounds": r, "median": medians[e]} for e, r in engines.items() if r},
                        "ratios": ratios}
    return summary


def format_table(summary: dict[str, dict]) -> str:
    """Rows x engines: each engine's median tokens/s with every round's figure, then the ratios."""
    engines = list(dict.fromkeys(e for s in summary.values() for e in s["engines"]))
    ratios = list(dict.fromkeys(name for s in summary.values() for name in s["ratios"]))
    cells = [["row", *(f"{e} tok/s (rounds)" for e in engines), *ratios]]
    for row, s in summary.items():
        figures = [f"{s['engines'][e]['median']:.1f} ({', '.join(f'{r:.1f}' for r in s['engines'][e]['rounds'])})"
                   if e in s["engines"] else "-" for e in engines]
        cells.append([row, *figures, *(f"{s['ratios'][n]:.2f}x" if n in s["ratios"] else "-" for n in ratios)])
    widths = [max(len(line[i]) for line in cells) for i in range(len(cells[0]))]
    return "\n".join("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths)))
                     for line in cells)


def decode_ceiling(decode: dict, bandwidth: float, token_bytes: int, engines: set[str] | None = None) -> dict:
    """The decode row's roofline: tokens/s at ``bandwidth`` reading ``token_bytes`` a token, and the
    median of each engine (of ``engines``, all where None) as a share of it."""
    tok_s = bandwidth / token_bytes
    return {"bytes_per_token": token_bytes, "tok_s": tok_s,
            "shares": {e: v["median"] / tok_s for e, v in decode["engines"].items() if engines is None or e in engines}}


def format_ceiling(ceiling: dict, of: str = "decode ceiling") -> str:
    shares = ", ".join(f"{e} {share:.2f}" for e, share in ceiling["shares"].items())
    return (f"{of}: {ceiling['tok_s']:.1f} tok/s (the read bandwidth over {ceiling['bytes_per_token'] / 1e6:.1f} "
            f"MB a token); share of it: {shares}")


# ---------------------------------------------------------------- files


def quantized_file(bin_dir: Path, source: Path, qtype: str, threads: int, out_dir: Path) -> tuple[Path, list[str]]:
    """``source`` requantized to ``qtype`` by llama-quantize, made once (renamed into place when
    complete, so an interrupted run leaves no half file behind); the path and the command."""
    dest = out_dir / f"{source.stem}.{qtype}.gguf"
    part = dest.with_suffix(".gguf.part")
    cmd = [str(bin_dir / "llama-quantize"), "--allow-requantize", str(source), str(part), qtype, str(threads)]
    if not dest.exists():
        out_dir.mkdir(parents=True, exist_ok=True)
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"llama-quantize to {qtype} failed (status {proc.returncode}): {shlex.join(cmd)}\n"
                               f"{(proc.stderr or proc.stdout)[-2000:]}")
        os.replace(part, dest)
    return dest, cmd


def resolve_gguf(model: str | None) -> Path:
    """The GGUF file to compare on: ``model``, or the default model (fetched once if missing)."""
    if model is None:
        from pagedserve.models.default import ensure_default_model

        return ensure_default_model()
    path = Path(model)
    if not (path.is_file() and path.suffix == ".gguf"):
        raise ValueError(f"--model must be a GGUF file both engines can load, got {model}")
    return path


def optional_peers(hf_checkpoint: str | None) -> tuple[list[str], list[str]]:
    """The optional peers to run (their venv exists and a checkpoint directory is given), and a
    line for each one skipped."""
    run, skipped = [], []
    for peer, (venv, _) in OPTIONAL_PEERS.items():
        python = peers_dir() / venv / "bin" / "python"
        if not python.exists():
            continue  # not set up: nothing to say, these columns are optional
        if hf_checkpoint is None:
            skipped.append(f"{peer}: skipped (its venv exists; --hf-checkpoint DIR gives it the model)")
        else:
            run.append(peer)
    return run, skipped


def write_w1_requests(path: Path) -> Path:
    """W1's requests (token ids and output lengths, docs/WORKLOADS.md) as JSON for every engine to
    read: the peers' drivers run in their own venvs, without pagedserve."""
    from pagedserve.bench.workloads import w1_offline

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps([{"prompt": r.prompt_token_ids, "output": r.output_len} for r in w1_offline()]))
    return path


def build_plan(files: list[Path], args, bin_dir: Path, threads: int, jsonl: bool, peers: list[str],
               w1_requests: Path | None = None) -> dict:
    """file → row → engine → command, engines in the order they alternate."""
    plan = {}
    for file in files:
        rows = {}
        for row in args.rows:
            if row == W1_ROW:  # the checkpoint's engines only, once
                if file == files[0] and args.hf_checkpoint is not None and w1_requests is not None:
                    rows[row] = {PAGEDSERVE_CHECKPOINT: worker_command(row, None, args.hf_checkpoint, args.hf_dtype,
                                                                       threads, requests=w1_requests,
                                                                       kv_cache_dtype=args.kv_cache_dtype)}
                    rows[row] |= {p: peer_command(p, None, args.hf_checkpoint, threads, w1_requests,
                                                  args.kv_cache_dtype) for p in peers}
                continue
            shape = shapes(args.decode_tokens)[row]
            engines = {PAGEDSERVE: worker_command(row, shape, str(file), args.dtype, threads, args.gguf_activations,
                                                  cpu_isa=args.cpu_isa),
                       LLAMA_CPP: llama_cpp_command(bin_dir, row, shape, file, threads, jsonl)}
            if row == "decode" and file == files[0] and peers:  # the optional peers run the checkpoint, not a GGUF
                engines[PAGEDSERVE_CHECKPOINT] = worker_command(row, shape, args.hf_checkpoint, args.hf_dtype, threads,
                                                                kv_cache_dtype=args.kv_cache_dtype)
                engines |= {p: peer_command(p, shape, args.hf_checkpoint, threads, kv_cache_dtype=args.kv_cache_dtype)
                            for p in peers}
            rows[row] = engines
        plan[str(file)] = rows
    return plan


def run(args: argparse.Namespace) -> int:
    from pagedserve.bench.common import write_result
    from pagedserve.engine.process_placement import usable_cores

    if args.cpu_isa != "auto" and args.hf_checkpoint is not None:
        print(f"error: --cpu-isa {args.cpu_isa} holds pagedserve and llama.cpp to that instruction set; the "
              "--hf-checkpoint peers (vLLM-CPU, OpenVINO GenAI) would run all of this CPU's: leave one out",
              file=sys.stderr)
        return 2
    build = "llamacpp-avx2" if args.cpu_isa == "avx2" else "llamacpp"
    bin_dir = Path(args.llama_cpp) if args.llama_cpp else peers_dir() / build / "bin"
    needed = LLAMA_BINARIES + (("llama-quantize",) if args.quantize else ())
    if missing := missing_binaries(bin_dir, needed):
        print(f"llama.cpp's {', '.join(missing)} not found in {bin_dir}: run scripts/setup_peers.sh {build} "
              f"(or pass --llama-cpp DIR)", file=sys.stderr)
        return 2
    try:
        model = resolve_gguf(args.model)
    except (ValueError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.hf_checkpoint is not None and not Path(args.hf_checkpoint).is_dir():
        print(f"error: --hf-checkpoint must be a Hugging Face checkpoint directory, got {args.hf_checkpoint}",
              file=sys.stderr)
        return 2
    if W1_ROW in args.rows and args.hf_checkpoint is None:
        print("error: the w1 row runs on a Hugging Face checkpoint: give --hf-checkpoint DIR", file=sys.stderr)
        return 2
    threads = args.threads or usable_cores()
    cpu = cpu_summary(read_cpuinfo())
    print(f"CPU: {cpu['model']}; ISA: {' '.join(cpu['isa']) or 'none of ' + ' '.join(ISA_FLAGS)}; threads: {threads}")
    if args.cpu_isa != "auto":
        print(f"run as a CPU with at most {args.cpu_isa}: pagedserve --cpu-isa {args.cpu_isa} (torch's libraries "
              f"likewise), llama.cpp from {bin_dir}")
    peers, skipped = optional_peers(args.hf_checkpoint)
    for line in skipped:
        print(line)
    if peers:
        kv = {PAGEDSERVE_CHECKPOINT: args.kv_cache_dtype, OPENVINO: openvino_kv_precision(args.kv_cache_dtype,
                                                                                         args.hf_checkpoint),
              VLLM: "its default (the model dtype)"}
        print("KV precision on the checkpoint: " + "; ".join(f"{e} {kv[e]}" for e in (PAGEDSERVE_CHECKPOINT, *peers)))
    try:
        report = compare(args, model, bin_dir, threads, peers)
    except (RuntimeError, ValueError) as e:  # a run that failed or printed no result: its own words, no traceback
        print(f"error: {e}", file=sys.stderr)
        return 1
    report["cpu"] = cpu
    write_result(args.json_out, report)
    return 0


def compare(args, model: Path, bin_dir: Path, threads: int, peers: list[str]) -> dict:
    """Make the requantized files, run every file's rows and print their tables; the report."""
    from pagedserve.bench.roofline import (BUFFER_BYTES, READS, checkpoint_bytes_per_token, decode_bytes_per_token,
                                           read_bandwidth)

    files, prepared = [model], []
    for qtype in args.quantize:
        path, cmd = quantized_file(bin_dir, model, qtype, threads, peers_dir() / "models")
        files.append(path)
        prepared.append(shlex.join(cmd))
    jsonl = "batch" in args.rows and batched_bench_supports_jsonl(bin_dir)
    w1_requests = write_w1_requests(peers_dir() / "w1-requests.json") if W1_ROW in args.rows else None
    plan = build_plan(files, args, bin_dir, threads, jsonl, peers, w1_requests)
    report = {"threads": threads, "rounds": args.rounds, "dtype": args.dtype, "hf_dtype": args.hf_dtype,
              "cpu_isa": args.cpu_isa, "gguf_activations": args.gguf_activations,
              "kv_cache_dtype": args.kv_cache_dtype, "quantize_commands": prepared,
              "files": []}
    token_bytes = {file: decode_bytes_per_token(file) for file, rows in plan.items() if "decode" in rows}
    # The checkpoint's engines (its column and the optional peers) read the checkpoint's bytes instead
    checkpoint_engines = {PAGEDSERVE_CHECKPOINT, *peers}
    checkpoint_bytes = checkpoint_bytes_per_token(args.hf_checkpoint) if args.hf_checkpoint and peers else None
    screened_bytes = checkpoint_bytes_per_token(args.hf_checkpoint, head_screen=True) if checkpoint_bytes else None
    if any(token_bytes.values()) or checkpoint_bytes:  # measured before any engine runs, on a quiet machine
        report["read_bandwidth"] = read_bandwidth(threads)
        print(f"memory read bandwidth, {threads} threads: {report['read_bandwidth'] / 1e9:.1f} GB/s "
              f"(NumPy sums over 2 x {BUFFER_BYTES >> 20} MiB, median of {READS})")
    start = time.perf_counter()
    for file, rows in plan.items():
        rounds = f"{args.rounds} round{'s' if args.rounds > 1 else ''}"
        on = f"; the w1 row on {args.hf_checkpoint}" if W1_ROW in rows else ""
        print(f"\n{Path(file).name} ({os.path.getsize(file) / 2**20:.1f} MiB){on}, {rounds} per engine, alternating:")
        summary = summarize(measure(rows, args.rounds))
        print("\n" + format_table(summary))
        if token_bytes.get(file):
            gguf_engines = set(summary["decode"]["engines"]) - checkpoint_engines
            summary["decode"]["ceiling"] = decode_ceiling(summary["decode"], report["read_bandwidth"], token_bytes[file],
                                                          gguf_engines)
            print(format_ceiling(summary["decode"]["ceiling"]))
        if checkpoint_bytes and "decode" in summary and checkpoint_engines & set(summary["decode"]["engines"]):
            summary["decode"]["checkpoint_ceiling"] = decode_ceiling(
                summary["decode"], report["read_bandwidth"], checkpoint_bytes, checkpoint_engines)
            print(format_ceiling(summary["decode"]["checkpoint_ceiling"], "the checkpoint's decode ceiling"))
            if PAGEDSERVE_CHECKPOINT in summary["decode"]["engines"]:  # greedy: its head's int8 screen
                summary["decode"]["screened_ceiling"] = decode_ceiling(
                    summary["decode"], report["read_bandwidth"], screened_bytes, {PAGEDSERVE_CHECKPOINT})
                print(format_ceiling(summary["decode"]["screened_ceiling"],
                                     "with pagedserve's LM head screen (a greedy token, models/head_screen.py)"))
        print("commands:")
        for row, engines in rows.items():
            for engine, cmd in engines.items():
                print(f"  {row:8} {engine:13} {shlex.join(cmd)}")
        report["files"].append({"model": file, "rows": summary,
                                "commands": {row: {e: shlex.join(c) for e, c in engines.items()}
                                             for row, engines in rows.items()}})
    print(f"\n{time.perf_counter() - start:.0f} s in all")
    return report


# ---------------------------------------------------------------- the pagedserve worker


@dataclass
class Timing:
    first_s: float  # from adding the requests to every one's first token
    gen_s: float  # after that, to the end
    gen_tokens: int  # tokens generated after that


def timed_run(engine, prompts: list[list[int]], max_tokens: int | list[int]) -> Timing:
    """Every prompt submitted at once (greedy, ``max_tokens`` each, or one count per prompt) and
    run to its end."""
    from pagedserve.engine.sampling_params import SamplingParams

    counts_asked = max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(prompts)
    start = time.perf_counter()
    for i, (prompt, n) in enumerate(zip(prompts, counts_asked, strict=True)):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
    counts: dict[str, int] = {}
    first_at, first_tokens = None, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            counts[out.request_id] = len(out.outputs[0].token_ids)
        if first_at is None and len(counts) == len(prompts) and min(counts.values()) > 0:
            first_at, first_tokens = time.perf_counter(), sum(counts.values())
    end = time.perf_counter()
    if first_at is None:  # a request finished without a token: nothing to time
        raise RuntimeError("a request produced no token")
    return Timing(first_at - start, end - first_at, sum(counts.values()) - first_tokens)


def worker_rate(engine, row: str, shape: Shape, seed: int = 0) -> float:
    """One row's tokens/s on a loaded engine: a short warm-up of the same shape, then one timed run."""
    import numpy as np

    from pagedserve.bench.workloads import random_prompt

    rng = np.random.default_rng(seed)

    def prompts() -> list[list[int]]:  # fresh random prompts each run: no prefix-cache hit either way
        return [random_prompt(rng, shape.prompt, engine.core.arch.vocab_size) for _ in range(shape.streams)]

    # The warm-up loads kernels and sizes buffers for these batch shapes; a few tokens do that.
    timed_run(engine, prompts(), min(shape.output, 4))
    t = timed_run(engine, prompts(), shape.output)
    if row == "prefill":
        return shape.prompt * shape.streams / t.first_s
    if t.gen_tokens == 0:
        raise RuntimeError(f"the {row} row needs at least 2 output tokens to time generation")
    return t.gen_tokens / t.gen_s


def w1_rate(engine, requests: list[dict]) -> float:
    """Output tokens/s of W1's ``requests`` (``prompt`` ids, ``output`` length each) submitted at once
    and run to the end, after a warm-up of the first eight for a few tokens (as the peers' drivers)."""
    prompts, outputs = [r["prompt"] for r in requests], [r["output"] for r in requests]
    timed_run(engine, prompts[:8], [min(n, 4) for n in outputs[:8]])
    t = timed_run(engine, prompts, outputs)
    return sum(outputs) / (t.first_s + t.gen_s)


def worker(argv: list[str]) -> int:
    """``python -m pagedserve.bench.compare --worker ROW ...``: load the model, time one round, print JSON."""
    p = argparse.ArgumentParser(prog="python -m pagedserve.bench.compare")
    p.add_argument("--worker", required=True, choices=ROWS)
    p.add_argument("--model", required=True)
    p.add_argument("--dtype", default="auto", choices=DTYPES)
    p.add_argument("--threads", type=_positive_int, required=True)
    p.add_argument("--prompt", type=_positive_int, default=None)
    p.add_argument("--output", type=_positive_int, default=None)
    p.add_argument("--streams", type=_positive_int, default=1)
    p.add_argument("--gguf-activations", default="int16", choices=list(GGUF_ACTIVATIONS))
    p.add_argument("--requests", default=None, help="the w1 row's requests (JSON, write_w1_requests)")
    p.add_argument("--cpu-isa", default="auto", choices=list(CPU_ISAS))
    p.add_argument("--kv-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPES))  # int4 too, by hand
    args = p.parse_args(argv)
    if (args.worker == W1_ROW) != (args.requests is not None):
        p.error("--requests goes with --worker w1, and only with it")
    if args.worker != W1_ROW and (args.prompt is None or args.output is None):
        p.error(f"--worker {args.worker} needs --prompt and --output")
    from pagedserve.engine.process_placement import bind_step_threads

    # As `serve` does by default: one step thread pinned per core when the step uses every core.
    # It sets OpenMP's environment, so it must come before torch is imported.
    bind_step_threads(args.threads)
    from pagedserve.config import EngineConfig
    from pagedserve.engine.frontend.engine import Engine

    t0 = time.perf_counter()
    # No prefix caching: every prompt is cold, as llama-bench's are.
    engine = Engine(EngineConfig(model=args.model, dtype=args.dtype, num_threads=args.threads,
                                 enable_prefix_caching=False, gguf_activations=args.gguf_activations,
                                 cpu_isa=args.cpu_isa, kv_cache_dtype=args.kv_cache_dtype))
    load_s = time.perf_counter() - t0
    # As the engine core process does once it is built (engine/core/proc.py): what loading made
    # lives until exit, so the cyclic GC's collections during the run walk only per-step objects.
    gc.collect()
    gc.freeze()
    if args.requests is not None:
        rate = w1_rate(engine, json.loads(Path(args.requests).read_text()))
    else:
        rate = worker_rate(engine, args.worker, Shape(args.prompt, args.output, args.streams))
    print(json.dumps({"row": args.worker, "tok_s": rate, "dtype": str(engine.core.dtype).removeprefix("torch."),
                      "threads": args.threads, "load_s": load_s}))
    return 0


if __name__ == "__main__":
    sys.exit(worker(sys.argv[1:]))
