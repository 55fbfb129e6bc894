"""The statistics of paired pass/fail runs (bench/paired_stats.py) against values worked by hand,
and the journal that lets a long needle run stop and resume (bench/retrieval_journal.py)."""

from __future__ import annotations

import json

import pytest

from pagedserve.bench.paired_stats import compare_paired, mcnemar_exact_p, wilson_interval
from pagedserve.bench.retrieval_journal import Journal


def test_wilson_interval_matches_the_formula_and_stays_inside_zero_one():
    assert wilson_interval(5, 10) == pytest.approx((0.2366, 0.7634), abs=1e-4)
    low, high = wilson_interval(0, 10)
    assert low == 0.0 and high == pytest.approx(0.2775, abs=1e-4)  # not the collapsed (0, 0) of p ± z·se
    assert wilson_interval(100, 100)[1] == 1.0
    assert wilson_interval(0, 0) == (0.0, 1.0)
    with pytest.raises(ValueError):
        wilson_interval(11, 10)


def test_mcnemar_exact_p_is_the_two_sided_binomial_tail_of_the_discordant_pairs():
    assert mcnemar_exact_p(0, 5) == pytest.approx(2 / 32)
    assert mcnemar_exact_p(9, 1) == pytest.approx(2 * (1 + 10) / 1024)
    assert mcnemar_exact_p(10, 2) == pytest.approx(2 * (1 + 12 + 66) / 4096)
    assert mcnemar_exact_p(3, 3) == 1.0 and mcnemar_exact_p(0, 0) == 1.0


def test_paired_comparison_counts_the_discordant_needles_and_gives_the_agresti_min_interval():
    # 100 needles: 60 found by both, 10 by the baseline alone, 2 by the variant alone, 28 by neither.
    base = [True] * 60 + [True] * 10 + [False] * 2 + [False] * 28
    var = [True] * 60 + [False] * 10 + [True] * 2 + [False] * 28
    c = compare_paired(base, var)
    assert (c.items, c.both, c.only_baseline, c.only_variant) == (100, 60, 10, 2)
    assert c.difference == pytest.approx(-0.08)
    assert (c.low, c.high) == pytest.approx((-0.1460, -0.0108), abs=1e-3)
    assert c.p_value == pytest.approx(0.0386, abs=1e-4)
    assert "-8.0 points" in c.describe() and "lost 10 / gained 2" in c.describe()
    same = compare_paired(base, base)
    assert same.difference == 0 and same.low < 0 < same.high and same.p_value == 1.0
    with pytest.raises(ValueError):
        compare_paired([True], [True, False])


def test_journal_resumes_complete_units_and_drops_one_cut_short(tmp_path):
    path = tmp_path / "run.jsonl"
    settings = {"seed": 1, "lengths": [1024]}
    j = Journal(path, settings)
    j.add("int4", 0, [{"recalled": True}, {"recalled": False}])
    j.add("int4", 1, [{"recalled": True}])
    # A killed run: unit 2 started, one record written, then half a line.
    with path.open("a") as f:
        f.write(json.dumps({"variant": "int4", "unit": 2, "unit_start": True, "recalled": True}) + "\n")
        f.write('{"variant": "int4", "unit": 2, "rec')
    again = Journal(path, settings)
    assert again.done("int4", 0) and again.done("int4", 1) and not again.done("int4", 2)
    assert [r["recalled"] for r in again.records] == [True, False, True]
    # Unit 2 answered again after the cut: only the new attempt's records count.
    with path.open("a") as f:
        f.write("\n")
    again.add("int4", 2, [{"recalled": False}, {"recalled": False}])
    third = Journal(path, settings)
    assert third.done("int4", 2) and len(third.records) == 5
    with pytest.raises(ValueError, match="other settings"):
        Journal(path, {"seed": 2, "lengths": [1024]})
    memory = Journal(None, settings)
    memory.add("auto", 0, [{"recalled": True}])
    assert memory.done("auto", 0) and not path.with_name("none").exists()


def test_an_int4_runs_journal_names_the_int4_layout(tmp_path):
    """A journal of int4 answers is keyed by the int4 layout too: answers of another layout (an
    earlier one, or a candidate measured before it was chosen) are never resumed as this one's."""
    import argparse

    from pagedserve.bench.retrieval import run_settings
    args = argparse.Namespace(model="m", dtype="float32", quantization="none", lengths=[1024], needles=10,
                              needles_per_context=10, depths=[0.5], seed=0, kv=["auto", "int4"],
                              int4_key_bits="calibrated")
    with_int4 = run_settings(args, tmp_path, [])
    assert with_int4["int4_layout"] == "kmix-vrot+tail"
    args.int4_key_bits = "uniform"
    assert run_settings(args, tmp_path, [])["int4_layout"] == "kzero-vrot+tail"
    args.kv = ["auto", "int8"]
    assert "int4_layout" not in run_settings(args, tmp_path, [])
