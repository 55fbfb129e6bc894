"""``pagedserve bench gguf-kernels``: every shape is timed three ways, four with the float32 gguf_gemm
(five with AVX-512 BF16), at every row count asked for, in the layout GGUFLinear gives it here or the
one asked for, on the CPU's best path or one named; ``--dequantize`` times every vector path
against the scalar one; the weights it times are valid GGUF rows of their format, and bad arguments
are one-line refusals."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest
import torch

from pagedserve.bench import gguf_kernels
from pagedserve.kernels import best_isa, gguf_gemm_usable, isa_paths, kernel_error, native_ops
from pagedserve.models.gguf_linear import BLOCKS, rows16_default

pytestmark = pytest.mark.skipif(native_ops() is None, reason=f"native kernels unavailable: {kernel_error()}")


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    gguf_kernels.add_parser(parser.add_subparsers(dest="bench"))
    return parser.parse_args(["gguf-kernels", *argv])


def test_times_every_shape_three_ways_at_each_row_count(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(gguf_kernels, "SHAPES", [("Q4_1", 40, 64), ("Q6_K", 24, 256)])
    out = tmp_path / "kernels.json"
    args = parse("--rows", "1,5", "--rounds", "2", "--calls", "2", "--json", str(out))
    assert args.func(args) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["format"], r["rows"]) for r in rows] == [("Q4_1", 1), ("Q4_1", 5), ("Q6_K", 1), ("Q6_K", 5)]
    assert all(r["kernel_us"] > 0 and r["dequant_gemm_us"] > 0 and r["float_us"] > 0 for r in rows)
    # the float32 gguf_gemm on every vector path; a fifth way, the bf16 one, where this CPU runs it
    assert all((r["gemm_f32_us"] > 0) if best_isa() != "scalar" else r["gemm_f32_us"] is None for r in rows)
    assert all((r["gemm_us"] > 0) if gguf_gemm_usable() else r["gemm_us"] is None for r in rows)
    chosen = rows16_default(best_isa())  # the layout GGUFLinear gives each format on this CPU
    assert [r["layout"] for r in rows] == [("rows16" if r["format"] in chosen else "planar") for r in rows]
    text = capsys.readouterr().out
    assert "GEMM/kernel" in text and "int8 activations" in text
    assert ("kernel/gguf_gemm" in text) == gguf_gemm_usable()
    args = parse("--rows", "1", "--rounds", "1", "--calls", "1", "--gguf-activations", "int16")
    assert args.func(args) == 0 and "int16 activations" in capsys.readouterr().out
    for layout in ("planar", "rows16"):
        args = parse("--rows", "3", "--rounds", "1", "--calls", "1", "--layout", layout, "--json", str(out))
        assert args.func(args) == 0
        assert {r["layout"] for r in json.loads(out.read_text())["rows"]} == {layout}
    with pytest.raises(SystemExit):
        parse("--gguf-activations", "int4")


@pytest.mark.parametrize("isa", [p for p in isa_paths() if p != "amx"])
def test_a_named_path_times_its_own_kernels_and_layouts(isa, tmp_path, capsys, monkeypatch):
    """--isa: the integer kernels, the dequantization and the float32 GEMM on that path (the bf16 GEMM
    on the CPU's own only), each format in the layout GGUFLinear gives it there."""
    monkeypatch.setattr(gguf_kernels, "SHAPES", [("Q8_0", 16, 64), ("Q4_K", 16, 256)])
    out = tmp_path / "isa.json"
    args = parse("--rows", "2", "--rounds", "1", "--calls", "1", "--isa", isa, "--json", str(out))
    assert args.func(args) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["layout"] for r in rows] == [("rows16" if r["format"] in rows16_default(isa) else "planar") for r in rows]
    assert all(r["gemm_us"] is None and ((r["gemm_f32_us"] > 0) if isa != "scalar" else r["gemm_f32_us"] is None)
               for r in rows)
    assert f"({isa} path" in capsys.readouterr().out


def test_dequantize_times_every_vector_path_against_the_scalar_reference(tmp_path, capsys):
    out = tmp_path / "dequantize.json"
    timed = gguf_kernels.measure_dequantize(["Q4_1", "Q6_K"], rounds=1, calls=1, dtype=torch.bfloat16,
                                            out_features=32)
    vector_paths = [p for p in isa_paths() if p not in ("scalar", "amx")]
    assert [(t.format, t.path) for t in timed] == [(f, p) for f in ("Q4_1", "Q6_K") for p in vector_paths]
    assert all(t.us > 0 and t.scalar_us > 0 and t.dtype == "bfloat16" for t in timed)
    args = parse("--dequantize", "--rounds", "1", "--calls", "1", "--layout", "planar", "--json", str(out))
    assert args.func(args) == 0
    rows = json.loads(out.read_text())["dequantize"]
    assert {r["format"] for r in rows} == set(BLOCKS) and {r["layout"] for r in rows} == {"planar"}
    assert "x scalar" in capsys.readouterr().out


def test_a_files_matrices_are_timed_and_summed_per_row_count(tiny_ggufs, tmp_path, capsys):
    """--model: the file's layer matrices by shape and format (embedding and head aside), each timed
    once and counted as often as the file holds it in the per-row-count totals."""
    path = tiny_ggufs("Q4_1")
    counted = gguf_kernels.file_shapes(path)
    assert counted and all(fmt == "Q4_1" and n > 0 for (fmt, _, _), n in counted)
    out = tmp_path / "file.json"
    args = parse("--model", str(path), "--rows", "2,40", "--rounds", "1", "--calls", "1", "--json", str(out))
    assert args.func(args) == 0
    result = json.loads(out.read_text())
    assert [t["rows"] for t in result["totals"]] == [2, 40]
    per_shape = {(r["format"], r["out_features"], r["in_features"], r["rows"]): r["kernel_us"] for r in result["rows"]}
    want = sum(n * per_shape[(*shape, 2)] for shape, n in counted)
    assert result["totals"][0]["kernel_us"] == pytest.approx(want)
    assert "layer matrices, each way's total per row count" in capsys.readouterr().out
    args = parse("--model", str(tmp_path / "missing.gguf"))
    assert args.func(args) == 2 and "is not a file" in capsys.readouterr().out


@pytest.mark.parametrize("fmt", ["Q4_1", "Q8_0", "Q4_K", "Q6_K"])
def test_the_timed_weights_are_valid_rows_of_their_format(fmt):
    from gguf import GGMLQuantizationType, quants

    rows = gguf_kernels.random_gguf_rows(fmt, 8, 256)
    w = quants.dequantize(rows.numpy(), GGMLQuantizationType[fmt])
    assert w.shape == (8, 256) and np.isfinite(w).all() and np.abs(w).max() > 0


@pytest.mark.parametrize("argv", [["--rows", "1,x"], ["--rows", "0"], ["--rounds", "0"], ["--calls", "0"]])
def test_bad_arguments_are_refused_in_one_line(argv, capsys):
    args = parse(*argv)
    assert args.func(args) == 2
    out = capsys.readouterr().out
    assert out.startswith("error:") and out.count("\n") == 1
