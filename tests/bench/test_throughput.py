"""``pagedserve bench throughput`` (W1) end to end on a few `tiny` requests: both engines run, the
token counts add up, and the engine settings asked for are the ones measured."""

from __future__ import annotations

import argparse
import json

import pytest

from pagedserve.bench import throughput
from pagedserve.bench.workloads import w1_offline


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    throughput.add_parser(parser.add_subparsers(dest="bench"))
    return parser.parse_args(["throughput", *argv])


def test_w1_on_tiny_with_an_int8_kv_cache_and_the_hf_baseline(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "w1.json"
    args = parse("--model", str(tiny_model_dir), "--num-requests", "4", "--hf-batch-size", "2",
                 "--kv-cache-dtype", "int8", "--json", str(out))
    assert args.func(args) == 0
    result = json.loads(out.read_text())
    reqs = w1_offline(4)
    assert result["output_tokens"] == sum(r.output_len for r in reqs)
    assert result["prompt_tokens"] == sum(len(r.prompt_token_ids) for r in reqs)
    ps = result["pagedserve"]
    assert ps["kv_cache_dtype"] == "int8" and ps["output_tok_s"] > 0 and len(ps["runs"]) == 1
    assert result["hf_static"]["batch_size"] == 2 and result["ratio_output_tok_s"] > 0
    assert "KV int8" in capsys.readouterr().out


def test_kv_cache_dtype_choices_are_the_engines():
    assert parse().kv_cache_dtype == "auto"
    for bad in ("int3", "bf16"):
        with pytest.raises(SystemExit) as exc:
            parse("--kv-cache-dtype", bad)
        assert exc.value.code == 2
