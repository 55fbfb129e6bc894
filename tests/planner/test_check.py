"""``plan check``: the planner's pool sizing equals a real engine's; the speed checks run and report."""

from __future__ import annotations

from pathlib import Path

import pytest

from pagedserve.bench.plan_check import CheckConfig, SpeedCheck, render_check, run_check
from pagedserve.cli import build_parser


@pytest.mark.parametrize(("budget", "block_size", "max_model_len"),
                         [(1 << 20, 16, None), (3_000_001, 32, 1024), (50_000, 1, 512)])
def test_planner_pool_equals_the_engines_for_tiny(tiny_model_dir: Path, budget: int, block_size: int,
                                                  max_model_len: int | None) -> None:
    result = run_check(CheckConfig(model=str(tiny_model_dir), kv_cache_memory=budget, block_size=block_size,
                                   max_model_len=max_model_len, sizing_only=True))
    sizing = result["sizing"]
    assert sizing.matches, sizing
    assert sizing.engine_blocks == budget // (block_size * 256)  # tiny: 256 B/token in bf16
    assert "decode" not in result


def test_speed_checks_run_the_engine_and_report_fractions(tiny_model_dir: Path) -> None:
    result = run_check(CheckConfig(model=str(tiny_model_dir), kv_cache_memory=1 << 20, prompt_tokens=64,
                                   decode_tokens=24, copy_bytes=64 << 20))
    decode: SpeedCheck = result["decode"]
    prefill: SpeedCheck = result["prefill"]
    assert result["bandwidth"] > 1e8 and result["flops"] > 1e6
    assert decode.measured > 0 and decode.predicted > 0 and decode.fraction_achieved > 0
    assert prefill.measured > 0 and prefill.predicted > 0 and prefill.fraction_achieved > 0
    # The decode bound really is bandwidth ÷ the bytes read per step (weights plus mean-context KV).
    per_step = result["weight_bytes_per_step"] + 256 * (16 + 24 // 2)
    assert decode.predicted == pytest.approx(result["bandwidth"] / per_step)
    text = render_check([result])
    assert "planner bound" in text and "achieved" in text and "yes" in text


def test_plan_check_cli_exits_0_when_sizing_matches(tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    parser = build_parser("plan")  # `plan check` is registered by the benchmarks' part (pagedserve/cli.py)
    args = parser.parse_args(["plan", "check", "--model", str(tiny_model_dir), "--kv-cache-memory", "2MiB",
                              "--sizing-only"])
    assert args.func(args) == 0
    assert "yes" in capsys.readouterr().out
    args = parser.parse_args(["plan", "check", "--model", "/no/such/model", "--sizing-only"])
    assert args.func(args) == 2
