"""The quality floor (config.py, docs/QUANTIZATION.md): every weight × KV precision measured, and one
start-up warning, from a real engine, for a combination under it and none for one above it."""

from __future__ import annotations

import logging

from pagedserve.config import (KV_CACHE_DTYPES, MEASURED_PPL_COST, QUALITY_FLOOR, QUANTIZATIONS, EngineConfig,
                               quality_floor_alternative, under_quality_floor)
from pagedserve.engine.frontend.engine import Engine
from pagedserve.engine.sampling_params import SamplingParams
from tests.conftest import assert_no_leaks, run_all


def test_every_combination_the_flags_allow_is_measured():
    assert set(MEASURED_PPL_COST) == {(w, kv) for w in QUANTIZATIONS for kv in KV_CACHE_DTYPES}
    assert MEASURED_PPL_COST["none", "auto"] == 0.0  # the reference


def test_the_alternative_offered_is_above_the_floor_and_keeps_the_weights_where_it_can():
    under = [c for c in MEASURED_PPL_COST if under_quality_floor(*c) is not None]
    assert ("int4", "int4") in under  # the case, as measured
    for combo in under:
        alternative = quality_floor_alternative(*combo)
        assert under_quality_floor(*alternative) is None and alternative != combo
        assert MEASURED_PPL_COST[alternative] <= QUALITY_FLOOR


def _start(model_dir, quantization: str, kv: str, caplog) -> list[str]:
    """Start a real engine, serve one request, and return its start-up warnings."""
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="pagedserve.engine.core"):
        engine = Engine(EngineConfig(model=str(model_dir), quantization=quantization, kv_cache_dtype=kv,
                                     num_kv_blocks=16, max_model_len=128))
    engine.add_request("a", [5] * 20, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert len(run_all(engine)["a"].outputs[0].token_ids) == 4
    assert_no_leaks(engine)
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_an_engine_asked_for_a_combination_under_the_floor_warns_once_with_the_figure(tiny_model_dir, caplog):
    floor = [m for m in _start(tiny_model_dir, "int4", "int4", caplog) if "quality floor" in m]
    assert len(floor) == 1
    cost = MEASURED_PPL_COST["int4", "int4"]
    weights, kv = quality_floor_alternative("int4", "int4")
    assert floor[0].startswith("--quantization int4 with --kv-cache-dtype int4 is under the quality floor: "
                               f"+{100 * cost:.1f}% perplexity measured on SmolLM2-135M-Instruct, over the +3% floor")
    assert floor[0].endswith(f"; use --quantization {weights} --kv-cache-dtype {kv} instead "
                             f"({100 * MEASURED_PPL_COST[weights, kv]:+.1f}% there)")


def test_an_engine_above_the_floor_does_not_warn(tiny_model_dir, caplog):
    assert under_quality_floor("int8", "int4") is None
    assert not [m for m in _start(tiny_model_dir, "int8", "int4", caplog) if "quality floor" in m]


def test_the_quality_table_marks_the_rows_under_the_floor():
    from pagedserve.bench.quality import QualityRow, format_table

    def row(kv: str, change: float) -> QualityRow:
        return QualityRow("none", kv, "float32", 20 * (1 + change), change, 0.0, 1.0, 1.0, 2**20, 100, 4, float("nan"))

    rows = [row("auto", 0.0), row("int8", QUALITY_FLOOR), row("int4", QUALITY_FLOOR + 0.001)]
    lines = format_table(rows).splitlines()
    assert lines[0].endswith("| floor (+3%) |")
    assert [line.rsplit("|", 2)[1].strip() for line in lines[2:]] == ["above", "above", "**under**"]


def test_the_table_the_engine_warns_from_is_the_matrix_in_the_docs():
    """config.py's figures and docs/QUANTIZATION.md's floor matrix, cell by cell (float32 = none / auto)."""
    from pathlib import Path

    text = (Path(__file__).parents[2] / "docs" / "QUANTIZATION.md").read_text()
    matrix = text[text.index("## The quality floor"):text.index("## KV cache quantization")]
    documented = {}
    for line in matrix.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 12 and cells[0] in ("float32", "int8", "int4") and cells[1] in ("float32", *KV_CACHE_DTYPES):
            key = ("none" if cells[0] == "float32" else cells[0], "auto" if cells[1] == "float32" else cells[1])
            documented[key] = (float(cells[3].rstrip("%")) / 100, cells[11] == "**under**")
    assert set(documented) == set(MEASURED_PPL_COST)
    for key, (change, under) in documented.items():
        assert abs(MEASURED_PPL_COST[key] - change) <= 0.00006, key
        assert under == (under_quality_floor(*key) is not None), key
