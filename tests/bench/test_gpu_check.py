"""scripts/gpu_check.sh --dry-run: the GPU check end to end on CPU, every step but the CUDA calls,
so the script a borrowed card runs is known to work before the card is there."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_check_dry_run_prints_the_table(tiny_model_dir):
    env = {**os.environ, "PYTHON": sys.executable}
    env.pop("TRITON_INTERPRET", None)  # the script's own pytest run decides, as it would on a card
    done = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--dry-run"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "tests collected" in out and "error" not in out.lower()
    header = next(line for line in out.splitlines() if line.startswith("| model |"))
    assert "HBM GB/s at batch 1" in header and "prefill TFLOP/s" in header
    row = next(line for line in out.splitlines() if line.startswith("| tiny |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert len(cells) == 9 and float(cells[2]) > 0 and float(cells[8]) > 0  # W2 and W1 tokens/s measured


def test_gpu_check_refuses_unknown_arguments():
    done = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--card"], cwd=ROOT,
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 2 and "usage" in done.stderr
