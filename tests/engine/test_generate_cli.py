"""``pagedserve generate`` as a user runs it (a subprocess each), and ``pagedserve --version``.

A start-up failure (wrong path, unsupported architecture, a KV budget that holds no block, a
context past the model's) is one ``cannot start:`` line and exit status 2, never a traceback.
"""

from __future__ import annotations

import concurrent.futures
import json
import subprocess
import sys
from importlib.metadata import version

import pytest


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pagedserve", *args], capture_output=True, text=True, timeout=240)


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("gpt2")
    (d / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"],
                                               "n_layer": 1, "n_embd": 8, "n_head": 2, "vocab_size": 10}))
    return d


CASES = {"missing": "is neither a GGUF file nor a directory", "gpt2": "unsupported model type 'gpt2'",
         "tiny-kv": "holds no block", "tiny-len": "exceeds the model's limit",
         "spec-k": "num_speculative_tokens must be an integer in [1, 16], got 17"}


@pytest.fixture(scope="module")
def startup_runs(tiny_model_dir, gpt2_dir, tmp_path_factory) -> dict[str, subprocess.CompletedProcess[str]]:
    """Every case's ``generate`` run, started together: each spends seconds importing torch before it
    fails, and one after another they took the suite ~12 s."""
    args = {"missing": ["--model", str(tmp_path_factory.mktemp("missing") / "nope")],
            "gpt2": ["--model", str(gpt2_dir)],
            "tiny-kv": ["--model", str(tiny_model_dir), "--kv-cache-memory", "1KiB"],
            "tiny-len": ["--model", str(tiny_model_dir), "--max-model-len", "100000000"],
            "spec-k": ["--model", str(tiny_model_dir), "--speculative", "ngram", "--num-speculative-tokens", "17"]}
    with concurrent.futures.ThreadPoolExecutor(len(CASES)) as pool:
        # No native-kernel build in these short runs: the errors come before any kernel is used.
        runs = {case: pool.submit(_run, "generate", *args[case], "--no-native-kernels", "--prompt", "hi",
                                  "--max-tokens", "2") for case in CASES}
        return {case: run.result() for case, run in runs.items()}


@pytest.mark.parametrize("case, expect", CASES.items())
def test_startup_errors_are_one_line(case, expect, startup_runs):
    proc = startup_runs[case]
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if " ERROR " in line]
    assert len(errors) == 1 and "cannot start: " in errors[0] and expect in errors[0], proc.stderr
    assert proc.stdout == ""


def test_version_comes_from_the_package_metadata(capsys):
    from pagedserve.cli import main

    with pytest.raises(SystemExit) as exit_info:  # argparse's version action exits 0 after printing
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"pagedserve {version('pagedserve')}"
