"""``pagedserve plan …`` and ``pagedserve simulate``: tables, --json, --plot, clear errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Callable

import pytest

RunCli = Callable[..., tuple[int, str, str]]
WORKED = ("--layers", "40", "--kv-heads", "8", "--head-dim", "128")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_plan_kv_table_shows_the_worked_figures(run_cli: RunCli) -> None:
    code, out, _ = run_cli("plan", "kv", *WORKED, "--context", "4096", "--users", "10")
    assert code == 0
    bf16 = next(line for line in out.splitlines() if line.startswith("bf16"))
    assert "160 KiB" in bf16 and "163,840" in bf16 and "640 MiB" in bf16 and "6.25 GiB" in bf16
    # int4: 40 KiB of elements, a 2-byte scale per V vector (40 x 8 x 2 = 640 B) and per key channel
    # of each 16-token block (40 x 8 x 128 x 2 / 16 = 5,120 B); per sequence its open block at 16 bits
    # (16 x 160 KiB = 2.5 MiB).
    int4 = next(line for line in out.splitlines() if line.startswith("int4"))
    assert "46,720" in int4 and "2.5 MiB" in int4
    assert "0 B" in next(line for line in out.splitlines() if line.startswith("int8"))  # no per-sequence bytes


def test_plan_kv_json_and_plot(run_cli: RunCli, tmp_path: Path) -> None:
    code, out, _ = run_cli("plan", "kv", "--model", "small", "--kv-dtype", "bf16", "--json")
    assert code == 0
    assert json.loads(out)["rows"] == [{"kv_dtype": "bf16", "bytes_per_token": 12288.0, "bytes_per_sequence": 0,
                                        "bytes_per_request": 12288.0 * 4096, "bytes_for_users": 12288.0 * 4096}]
    chart = tmp_path / "kv.png"
    assert run_cli("plan", "kv", "--model", "small", "--plot", str(chart))[0] == 0
    assert chart.read_bytes().startswith(PNG_MAGIC)


def test_plan_seats_reports_refusal_utilization_idle_and_tail_waste(run_cli: RunCli, tmp_path: Path) -> None:
    chart = tmp_path / "seats.png"
    code, out, _ = run_cli("plan", "seats", *WORKED, "--free-memory", "9GiB", "--mean-len", "1200", "--users", "10",
                           "--plot", str(chart))
    assert code == 0
    assert "14 (request 15 refused)" in out
    assert "187.5 MiB of 640 MiB" in out and "29.3%" in out
    assert "4.42 GiB of 6.25 GiB" in out and "15 tok = 2.34 MiB" in out
    assert chart.read_bytes().startswith(PNG_MAGIC)


def test_plan_seats_from_a_card(run_cli: RunCli) -> None:
    code, out, _ = run_cli("plan", "seats", "--model", "small", "--card-memory", "24GiB", "--overhead", "2GiB",
                           "--json")
    assert code == 0
    data = json.loads(out)
    weights = 2 * 124_668_672
    assert data["free_bytes"] == 22 * 2**30 - weights
    assert data["worst_case_seats"] == int(data["free_bytes"] // (12288 * 4096))


def test_plan_weights_and_decode_show_the_8b_figures(run_cli: RunCli) -> None:
    code, out, _ = run_cli("plan", "weights", "--params", "8B", "--json")
    assert code == 0
    assert [r["bytes"] for r in json.loads(out)["rows"]] == [16e9, 8e9, 4e9]
    code, out, _ = run_cli("plan", "decode", "--params", "8B", "--bandwidth", "1008GB/s", "--weights-dtype", "int4")
    assert code == 0
    assert "252.0" in next(line for line in out.splitlines() if line.startswith("int4"))


def test_plan_prefill(run_cli: RunCli) -> None:
    code, out, _ = run_cli("plan", "prefill", "--params", "8B", "--prompt-tokens", "2048", "--flops", "400T", "--json")
    assert code == 0
    assert json.loads(out)["rows"][0]["seconds"] == pytest.approx(2 * 8e9 * 2048 / 400e12)


def test_plan_bucket(run_cli: RunCli) -> None:
    code, out, _ = run_cli("plan", "bucket", "--rate", "100", "--burst", "500", "--window", "60s",
                           "--offered-rate", "300", "--cost", "10")
    assert code == 0
    assert "6,500" in out and "650" in out


def test_plan_queue_solves_the_97_to_850_ms_pool_and_prints_it(run_cli: RunCli, tmp_path: Path) -> None:
    chart = tmp_path / "wait.png"
    code, out, _ = run_cli("plan", "queue", "--from-waits", "97ms", "850ms", "--loss", "0.3", "--plot", str(chart))
    assert code == 0
    assert "utilization 0.6416, service time 54.2 ms" in out
    assert "97 ms -> 850 ms" in out
    assert chart.read_bytes().startswith(PNG_MAGIC)


def test_plan_queue_says_when_a_loss_makes_the_pool_unbounded(run_cli: RunCli) -> None:
    code, out, _ = run_cli("plan", "queue", "--arrival-rate", "80", "--service-time", "100ms", "--servers", "10",
                           "--loss", "0.3")
    assert code == 0
    assert "grow without bound" in out and "Shed more than 10.00 arrivals/s" in out
    code, out, _ = run_cli("plan", "queue", "--arrival-rate", "80", "--service-time", "100ms", "--servers", "10",
                           "--loss", "0.3", "--json")
    assert json.loads(out)["capacity_drop"]["after"]["mean_wait"] is None  # inf is not JSON: null


def test_plan_queue_priority_tiers(run_cli: RunCli) -> None:
    code, out, _ = run_cli("plan", "queue", "--arrival-rate", "16", "--service-time", "50ms", "--tier-rates", "6", "10",
                           "--json")
    assert code == 0
    low, high = json.loads(out)["priority_waits"]
    assert low < high


def test_plan_shed(run_cli: RunCli) -> None:
    code, out, _ = run_cli("plan", "shed", "--arrival-rate", "90", "--service-time", "100ms", "--servers", "10",
                           "--target-utilization", "0.8", "--json")
    assert code == 0
    assert json.loads(out)["shed_rate"] == pytest.approx(10.0)


@pytest.mark.parametrize("argv", [
    ("plan", "kv", "--layers", "40"),
    ("plan", "seats", *WORKED),
    ("plan", "decode", "--params", "8X", "--bandwidth", "1TB/s"),
    ("plan", "queue", "--arrival-rate", "10", "--service-time", "fast"),
    ("plan", "shed", "--arrival-rate", "10", "--service-time", "50ms"),
    ("plan", "kv", "--model", "no-such-model-dir/"),
    ("simulate", "--tier", "paid=10"),
])
def test_bad_input_is_one_clear_line_and_exit_2(run_cli: RunCli, argv: tuple[str, ...]) -> None:
    code, out, err = run_cli(*argv)
    assert code == 2
    assert err.startswith("error: ") and "Traceback" not in err
    assert out == ""


def test_simulate_json_reports_tiers_and_formula(run_cli: RunCli) -> None:
    code, out, _ = run_cli("simulate", "--servers", "2", "--service-time", "50ms", "--tier", "paid:10,priority=0",
                           "--tier", "free:20,priority=1", "--requests", "100000", "--json")
    assert code == 0
    data = json.loads(out)
    tiers = {t["name"]: t for t in data["result"]["tiers"]}
    assert tiers["paid"]["offered"] + tiers["free"]["offered"] == 100_000
    assert tiers["paid"]["mean_wait"] < tiers["free"]["mean_wait"]
    assert set(data["formula_mean_waits"]) == {"paid", "free"}


def test_simulate_from_a_toml_config_with_two_pools(run_cli: RunCli, tmp_path: Path) -> None:
    config = tmp_path / "sim.toml"
    config.write_text("""
seed = 3
requests = 50000
[[pools]]
name = "provisioned"
servers = 2
service_time = "50ms"
[[pools]]
name = "shared"
servers = 4
service_time = "50ms"
service_dist = "lognormal"
service_cv = 0.5
[[tiers]]
name = "paid"
rate = 20
pool = "provisioned"
[[tiers]]
name = "free"
rate = 100
pool = "shared"
bucket_rate = 60
bucket_burst = 100
wait_budget = "200ms"
""")
    chart = tmp_path / "sim.png"
    code, out, _ = run_cli("simulate", "--config", str(config), "--plot", str(chart))
    assert code == 0
    assert "provisioned" in out and "shared" in out
    assert chart.read_bytes().startswith(PNG_MAGIC)
    code, out, _ = run_cli("simulate", "--config", str(config), "--json")
    free = next(t for t in json.loads(out)["result"]["tiers"] if t["name"] == "free")
    assert free["refused_by_bucket"] > 0


def test_the_pagedserve_entry_point_runs_plan() -> None:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    proc = subprocess.run([sys.executable, "-m", "pagedserve", "plan", "kv", *WORKED, "--json"],
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["rows"][0]["bytes_per_token"] == 163840


def test_plan_queue_from_waits_refuses_a_pool_it_does_not_solve(run_cli: RunCli) -> None:
    code, _, err = run_cli("plan", "queue", "--from-waits", "97ms", "850ms", "--loss", "0.3", "--servers", "4")
    assert code == 2 and "M/M/1" in err
    code, _, err = run_cli("plan", "queue", "--from-waits", "97ms", "850ms")
    assert code == 2 and "--loss" in err


def test_plan_queue_tier_rates_alone_set_the_arrival_rate(run_cli: RunCli) -> None:
    code, out, _ = run_cli("plan", "queue", "--service-time", "50ms", "--tier-rates", "6", "10", "--json")
    assert code == 0
    assert json.loads(out)["queue"]["arrival_rate"] == 16.0
