"""W1 offline throughput: pagedserve's LLM.generate against Hugging Face static batching, same run."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from pagedserve.config import ATTENTION_BACKEND_NAMES, KV_CACHE_DTYPES
from pagedserve.bench.common import machine_summary, median, resolve_model, write_result
from pagedserve.bench.workloads import w1_offline


def add_parser(bench) -> None:
    p = bench.add_parser("throughput", help="W1: offline output tokens/s, pagedserve vs HF static batching",
                         description="W1 of docs/WORKLOADS.md: 64 requests (prompts 64-512, outputs 32-256 tokens, seed 0), "
                                     "greedy with ignore_eos. Reports output and total tokens/s of pagedserve's "
                                     "LLM.generate and of Hugging Face transformers' generate with static batching "
                                     "(batches of 16, left padding), measured in the same process, and their ratio.")
    p.add_argument("--model", default="small", help="standard model name or model directory (default small)")
    p.add_argument("--num-requests", type=int, default=64, help="requests in the batch (W1: 64)")
    p.add_argument("--repeats", type=int, default=1, help="timed pagedserve runs after the warm-up (median reported)")
    p.add_argument("--hf-batch-size", type=int, default=16, help="static batch size of the HF baseline")
    p.add_argument("--no-hf", action="store_true", help="skip the Hugging Face baseline")
    p.add_argument("--max-num-seqs", type=int, default=64, help="engine sequence cap")
    p.add_argument("--max-num-batched-tokens", type=int, default=None, help="engine token budget per step")
    p.add_argument("--kv-cache-memory", default="2GiB", help="engine KV pool budget")
    p.add_argument("--kv-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPES),
                   help="pagedserve's KV cache precision (auto = the model dtype; the HF baseline keeps its own)")
    p.add_argument("--dtype", default="auto", help="model dtype for both engines (auto = checkpoint's, bf16)")
    p.add_argument("--attention-backend", default="auto", choices=list(ATTENTION_BACKEND_NAMES),
                   help="pagedserve's paged attention implementation (auto = fused on CPU)")
    p.add_argument("--json-schema", default=None, metavar="FILE",
                   help="also run W1 with this JSON schema on every request (structured output; a request ends "
                        "where its document does, so counts differ) and print its output tokens/s as a ratio of "
                        "the unconstrained run's, measured in the same process")
    p.add_argument("--json", dest="json_out", default=None, help="write the result as JSON to this file")
    p.set_defaults(func=run)


def run_pagedserve(llm, reqs, json_schema: str | None = None) -> tuple[float, int]:
    from pagedserve import SamplingParams
    from pagedserve.engine.sampling_params import StructuredOutputsParams

    constraint = StructuredOutputsParams(json=json_schema) if json_schema is not None else None
    params = [SamplingParams(max_tokens=r.output_len, temperature=0, ignore_eos=True, structured_outputs=constraint)
              for r in reqs]
    start = time.perf_counter()
    outs = llm.generate([r.prompt_token_ids for r in reqs], params, use_tqdm=True)
    seconds = time.perf_counter() - start
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    if constraint is None:
        assert produced == sum(r.output_len for r in reqs), "ignore_eos run produced the wrong number of tokens"
    return seconds, produced


def run_hf_static(model_dir: str, reqs, batch_size: int, dtype) -> float:
    """HF generate over fixed batches, left-padded, each batch run to its longest output."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    pad = 0
    start = time.perf_counter()
    for b in tqdm(range(0, len(reqs), batch_size), desc="HF static batches", unit="batch"):
        batch = reqs[b:b + batch_size]
        width = max(len(r.prompt_token_ids) for r in batch)
        ids = torch.tensor([[pad] * (width - len(r.prompt_token_ids)) + r.prompt_token_ids for r in batch])
        mask = torch.tensor([[0] * (width - len(r.prompt_token_ids)) + [1] * len(r.prompt_token_ids) for r in batch])
        longest = max(r.output_len for r in batch)
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=longest, min_new_tokens=longest,
                           do_sample=False, pad_token_id=pad)
    return time.perf_counter() - start


def run(args: argparse.Namespace) -> int:
    from pagedserve import LLM

    model_dir = resolve_model(args.model)
    reqs = w1_offline(args.num_requests)
    prompt_tokens = sum(len(r.prompt_token_ids) for r in reqs)
    out_tokens = sum(r.output_len for r in reqs)
    llm = LLM(model_dir, dtype=args.dtype, kv_cache_memory=args.kv_cache_memory, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, attention_backend=args.attention_backend,
              kv_cache_dtype=args.kv_cache_dtype)
    schema = None
    if args.json_schema:
        from pagedserve.engine.sampling_params import StructuredOutputsParams
        from pagedserve.engine.core.structured import check

        schema = Path(args.json_schema).read_text()
        check(StructuredOutputsParams(json=schema), "--json-schema")
        run_pagedserve(llm, reqs[:8], schema)  # warm-up: compiles the grammar once
    run_pagedserve(llm, reqs[:8])  # warm-up
    times, runs = [], []
    # With a schema the two conditions alternate run by run, so a noisy stretch of the machine
    # lands on both sides of the ratio rather than on one.
    for _ in range(args.repeats):
        llm.engine.core.block_manager.reset_prefix_cache()  # random prompts share nothing, but be explicit
        seconds, _ = run_pagedserve(llm, reqs)
        times.append(seconds)
        if schema is not None:
            llm.engine.core.block_manager.reset_prefix_cache()
            runs.append(run_pagedserve(llm, reqs, schema))
    ps_seconds = median(times)
    result = {"workload": "W1", "model": args.model, "machine": machine_summary(), "requests": len(reqs),
              "prompt_tokens": prompt_tokens, "output_tokens": out_tokens,
              "pagedserve": {"seconds": ps_seconds, "output_tok_s": out_tokens / ps_seconds,
                             "total_tok_s": (out_tokens + prompt_tokens) / ps_seconds, "runs": times,
                             "dtype": str(llm.engine.core.dtype),
                             "attention_backend": llm.engine.core.config.attention_backend,
                             "kv_cache_dtype": llm.engine.core.kv.dtype}}
    print(f"\nW1 on {args.model}: {len(reqs)} requests, {prompt_tokens} prompt + {out_tokens} output tokens "
          f"({machine_summary()}; pagedserve attention backend: {llm.engine.core.config.attention_backend}, "
          f"KV {llm.engine.core.kv.dtype})")
    print(f"  pagedserve LLM.generate : {ps_seconds:7.1f} s  {out_tokens / ps_seconds:7.1f} output tok/s  "
          f"{(out_tokens + prompt_tokens) / ps_seconds:7.1f} total tok/s")
    if schema is not None:
        js_seconds, js_tokens = sorted(runs)[len(runs) // 2]
        js_rate = js_tokens / js_seconds
        ratio = js_rate / (out_tokens / ps_seconds)
        # Constrained requests end where their document closes, so they decode fewer tokens over
        # the same prompts: output tokens/s then also counts the thinner batches at the end, and
        # total tokens/s (prompt + output) is the rate at which the engine did the same work.
        js_total = (prompt_tokens + js_tokens) / js_seconds
        total_ratio = js_total / ((prompt_tokens + out_tokens) / ps_seconds)
        result["json_schema"] = {"file": args.json_schema, "seconds": js_seconds, "output_tokens": js_tokens,
                                 "output_tok_s": js_rate, "total_tok_s": js_total, "runs": [s for s, _ in runs],
                                 "ratio_to_unconstrained": ratio, "total_ratio_to_unconstrained": total_ratio}
        print(f"  with --json-schema      : {js_seconds:7.1f} s  {js_rate:7.1f} output tok/s  {js_total:7.1f} total "
              f"tok/s ({js_tokens} output tokens: requests end where their document does)")
        print(f"  ratio (schema / none)   : {ratio:.2f}x output tokens/s, {total_ratio:.2f}x total tokens/s")
    if not args.no_hf:
        hf_seconds = run_hf_static(model_dir, reqs, args.hf_batch_size, llm.engine.core.dtype)
        ratio = hf_seconds / ps_seconds
        result["hf_static"] = {"seconds": hf_seconds, "output_tok_s": out_tokens / hf_seconds,
                               "total_tok_s": (out_tokens + prompt_tokens) / hf_seconds,
                               "batch_size": args.hf_batch_size}
        result["ratio_output_tok_s"] = ratio
        print(f"  HF static batching ({args.hf_batch_size:>2}) : {hf_seconds:7.1f} s  "
              f"{out_tokens / hf_seconds:7.1f} output tok/s  {(out_tokens + prompt_tokens) / hf_seconds:7.1f} total tok/s")
        print(f"  ratio (pagedserve / HF) : {ratio:.2f}x output tokens/s")
    write_result(args.json_out, result)
    return 0
