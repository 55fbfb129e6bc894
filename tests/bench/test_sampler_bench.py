"""``pagedserve bench sampler``: both picks are timed at every batch size asked for, and a wrong
pick stops the run instead of being timed."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from pagedserve.bench import sampler as sampler_bench


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    sampler_bench.add_parser(parser.add_subparsers(dest="bench"))
    return parser.parse_args(["sampler", *argv])


def test_times_both_picks_at_each_batch_size(tmp_path, capsys):
    out = tmp_path / "picks.json"
    args = parse("--vocab", "1000", "--rows", "1,3", "--rounds", "2", "--calls", "5", "--json", str(out))
    assert args.func(args) == 0
    result = json.loads(out.read_text())
    assert result["vocab"] == 1000 and [r["rows"] for r in result["results"]] == [1, 3]
    for r in result["results"]:
        assert r["torch_us"] > 0 and r["ours_us"] > 0 and r["speedup"] == pytest.approx(r["torch_us"] / r["ours_us"])
    assert "row_argmax" in capsys.readouterr().out


def test_a_pick_that_disagrees_with_torch_is_an_error(monkeypatch):
    monkeypatch.setattr(sampler_bench, "row_argmax", lambda x: torch.zeros(x.shape[0], dtype=torch.long))
    with pytest.raises(AssertionError, match="disagrees"):
        sampler_bench.measure(1000, [4], rounds=1, calls=1)


def test_bad_arguments_are_refused():
    args = parse("--rows", "1,0")
    with pytest.raises(SystemExit):
        args.func(args)
