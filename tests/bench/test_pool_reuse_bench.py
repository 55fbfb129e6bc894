"""``pagedserve bench pool-reuse``: W1's runs on one engine report their rate and how their block
tables lie, and end with every block free (the bench stops on a leak); bad arguments are refused."""

from __future__ import annotations

import argparse
import json

import pytest

from pagedserve.bench import pool_reuse
from pagedserve.kv.block_manager import BlockManager


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    pool_reuse.add_parser(parser.add_subparsers(dest="bench"))
    return parser.parse_args(["pool-reuse", *argv])


def test_neighbours_counts_ascending_and_descending_pairs():
    bm = BlockManager(num_blocks=8, block_size=2, enable_prefix_caching=False)
    assert bm.allocate(1, 8) and bm.allocate(2, 2)  # 1: blocks 0..3; 2: block 4
    assert bm.allocate(1, 10)  # 4 is held: the next block, 5
    assert bm.block_ids(1) == [0, 1, 2, 3, 5]
    assert pool_reuse.neighbours(bm, [1, 2]) == (3, 0, 4)
    bm.tables[1].reverse()  # as a prompt lays out a run a finished sequence gave back (tail first)
    assert pool_reuse.neighbours(bm, [1]) == (0, 3, 4)
    assert pool_reuse.neighbours(bm, []) == (0, 0, 0)


def test_runs_report_rate_and_block_order(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "reuse.json"
    args = parse("--model", str(tiny_model_dir), "--runs", "2", "--kv-cache-memory", "64MiB", "--json", str(out))
    assert args.func(args) == 0
    result = json.loads(out.read_text())
    assert len(result["runs"]) == 2 and result["later_ratio"] > 0
    assert all(r["tok_s"] > 0 and 0 <= r["ascending"] + r["descending"] <= 1 for r in result["runs"])
    assert result["runs"][0]["ascending"] > 0.5  # a fresh pool: prompts in ascending runs
    assert "runs 2-2: median" in capsys.readouterr().out


def test_fewer_than_two_runs_and_bad_sizes_are_refused(capsys):
    args = parse("--runs", "1")
    with pytest.raises(SystemExit, match="--runs must be >= 2"):
        args.func(args)
    with pytest.raises(SystemExit):
        parse("--kv-cache-memory", "lots")
    assert "cannot parse memory size 'lots'" in capsys.readouterr().err
