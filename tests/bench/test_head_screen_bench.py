"""``pagedserve bench head-screen``: both engines timed round by round, the same tokens required, and
a model whose head has no screen refused with a one-line reason."""

from __future__ import annotations

import argparse
import json

import pytest

from pagedserve.bench import head_screen as head_screen_bench
from pagedserve.kernels import native_ops


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    head_screen_bench.add_parser(parser.add_subparsers(dest="bench"))
    return parser.parse_args(["head-screen", *argv])


@pytest.mark.skipif(native_ops() is None, reason="the head screen is a native kernel")
def test_times_both_heads_and_prints_the_ratio(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "screen.json"
    args = parse("--model", str(tiny_model_dir), "--rounds", "2", "--output-len", "6", "--rows", "1,3",
                 "--calls", "2", "--json", str(out))
    assert args.func(args) == 0
    result = json.loads(out.read_text())
    assert len(result["full_tok_s"]) == len(result["screen_tok_s"]) == 2
    assert all(r > 0 for r in result["full_tok_s"] + result["screen_tok_s"])
    assert [c["rows"] for c in result["calls"]] == [1, 3]
    assert all(c["screen_ms"] > 0 and c["full_ms"] > 0 for c in result["calls"])
    assert "the same tokens" in capsys.readouterr().out


@pytest.mark.skipif(native_ops() is None, reason="the head screen is a native kernel")
def test_a_gguf_q8_0_heads_screen_is_timed_by_its_streams_and_rows(tiny_ggufs, tmp_path, capsys):
    """One stream is below a GGUF screen's rows; --streams 6 runs six together through it (the
    same tokens both ways, else the run stops); --rows times single head calls."""
    out = tmp_path / "screen.json"
    args = parse("--model", str(tiny_ggufs("Q8_0", tokenizer=True)), "--rounds", "1", "--output-len", "3",
                 "--streams", "6", "--rows", "4,16", "--calls", "2", "--json", str(out))
    assert args.func(args) == 0
    result = json.loads(out.read_text())
    assert result["streams"] == 6 and len(result["screen_tok_s"]) == 1 and result["screen_tok_s"][0] > 0
    assert "6 streams of W2's shape" in capsys.readouterr().out
    assert [c["rows"] for c in result["calls"]] == [4, 16]
    assert all(c["screen_ms"] > 0 and c["full_ms"] > 0 for c in result["calls"])


def test_a_head_without_a_screen_and_bad_arguments_are_refused(tiny_ggufs):
    with pytest.raises(SystemExit, match="no screen"):  # a Q4_0 head keeps its blocks
        args = parse("--model", str(tiny_ggufs("Q4_0", tokenizer=True)), "--rounds", "1", "--output-len", "2")
        args.func(args)
    for bad in (["--rounds", "0"], ["--rows", "1,0"], ["--rows", "a"]):
        with pytest.raises(SystemExit, match="--r"):
            args = parse(*bad)
            args.func(args)
    for streams in ("0", "33"):
        with pytest.raises(SystemExit, match="--streams must be 1-32"):
            args = parse("--streams", streams)
            args.func(args)
