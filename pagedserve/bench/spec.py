"""``pagedserve bench spec``: tokens/s with and without n-gram speculative decoding, same run.

Two workloads, each run on two engines built alike except for ``--speculative ngram``, in
interleaved repeats (off, on, off, on, ...) after a warm-up of each, so drift on a shared machine
hits both sides alike; medians and their ratio are reported, with the acceptance counters:

* **repeat**: a chat prompt holding a code passage and asking for it back with one rename, on
  the default real model (SmolLM2-135M-Instruct): the answer quotes its context, so prompt
  lookup finds the drafts. (A random-weight model does not repeat its prompt: no use here.)
* **W2** (docs/WORKLOADS.md): one request, 16-token random prompt, 256 output tokens, on the ``small``
  random-weight model, where drafts are rarely right: the cost of trying. Must-show: speculation
  loses at most 5 %.

Both are greedy, so both sides should produce the same tokens; the bench reports where they
first differ if they do (a batch of k + 1 rows may round a near-tie differently from one row).
Rate = output tokens after the first ÷ time after the first (decode tokens/s, as ``bench decode``).
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from pagedserve.bench.common import greedy_stream, machine_summary, median, resolve_model, write_result
from pagedserve.bench.workloads import w2_single_stream

PASSAGE = '''def merge_intervals(intervals):
    """Merge overlapping [start, end] intervals and return them sorted by start."""
    if not intervals:
        return []
    ordered = sorted(intervals, key=lambda pair: pair[0])
    merged = [list(ordered[0])]
    for start, end in ordered[1:]:
        last = merged[-1]
        if start <= last[1]:
            last[1] = max(last[1], end)
        else:
            merged.append([start, end])
    return merged


def total_covered(intervals):
    """Length of the union of the intervals."""
    return sum(end - start for start, end in merge_intervals(intervals))
'''
REPEAT_INSTRUCTION = ("Here is a Python module:\n\n```python\n{passage}```\n\nRewrite the whole module, unchanged "
                      "except that the function merge_intervals is renamed to combine_ranges everywhere. "
                      "Reply with the code only.")


def add_parser(bench) -> None:
    p = bench.add_parser("spec", help="tokens/s with and without n-gram speculative decoding",
                         description="Decode tokens/s with --speculative ngram off and on, interleaved repeats, "
                                     "medians and ratio: a prompt whose answer repeats its context (SmolLM2) "
                                     "and W2 (small model), where speculation should cost at most 5%%.")
    p.add_argument("--workloads", default="repeat,w2", help="comma-separated: repeat, w2 (default both)")
    p.add_argument("--repeat-model", default=None,
                   help="model of the repeat workload (default: SmolLM2-135M-Instruct, the default model)")
    p.add_argument("--w2-model", default="small", help="model of W2: a standard name or a directory (default small)")
    p.add_argument("--dtype", default="float32", help="model dtype (default float32)")
    p.add_argument("--num-speculative-tokens", type=int, default=4, metavar="K", help="drafts per step (default 4)")
    p.add_argument("--ngram-prompt-lookup-max", type=int, default=4, metavar="N")
    p.add_argument("--ngram-prompt-lookup-min", type=int, default=1, metavar="N")
    p.add_argument("--repeat-output-len", type=int, default=256, help="output tokens of the repeat prompt (default 256)")
    p.add_argument("--w2-output-len", type=int, default=256, help="output tokens of W2 (default 256, as docs/WORKLOADS.md)")
    p.add_argument("--repeats", type=int, default=5, help="timed runs per side after a warm-up (default 5)")
    p.add_argument("--json", dest="json_out", default=None, help="write the result as JSON to this file")
    p.set_defaults(func=run)


def _proposer_cost_us(tokens: list[int], args) -> float:
    """Microseconds of one proposal over a sequence of these tokens (what each decode step pays)."""
    from pagedserve.engine.core.ngram import propose

    arr = np.asarray(tokens, dtype=np.int64)
    n = 2000
    t0 = time.perf_counter()
    for _ in range(n):
        propose(arr, args.num_speculative_tokens, args.ngram_prompt_lookup_max, args.ngram_prompt_lookup_min)
    return (time.perf_counter() - t0) / n * 1e6


def compare(name: str, model: str, prompt_ids_for, output_len: int, args) -> dict:
    """Off/on engines of ``model``, interleaved timed runs; the result row."""
    from pagedserve.config import EngineConfig
    from pagedserve.engine.frontend.engine import Engine

    def engine(spec: bool) -> Engine:
        return Engine(EngineConfig(model=model, dtype=args.dtype, kv_cache_memory="256MiB",
                                   speculative="ngram" if spec else None,
                                   num_speculative_tokens=args.num_speculative_tokens,
                                   ngram_prompt_lookup_max=args.ngram_prompt_lookup_max,
                                   ngram_prompt_lookup_min=args.ngram_prompt_lookup_min))

    engines = {"off": engine(False), "on": engine(True)}
    prompt = prompt_ids_for(engines["off"])
    rates: dict[str, list[float]] = {"off": [], "on": []}
    outputs: dict[str, list[int]] = {}
    for side, eng in engines.items():  # warm-up (kernels, allocator), not timed
        _, outputs[side] = greedy_stream(eng, prompt, output_len)
    before = engines["on"].stats()
    for _ in range(args.repeats):
        for side, eng in engines.items():
            rate, tokens = greedy_stream(eng, prompt, output_len)
            rates[side].append(rate)
            if tokens != outputs[side]:
                raise RuntimeError(f"{name}: {side} run gave different greedy tokens from its warm-up")
    # Greedy with and without drafts should agree token for token; a batch of k + 1 rows can round
    # differently from one row, so a near-tie may flip: reported, not hidden.
    same = next((i for i, (a, b) in enumerate(zip(outputs["on"], outputs["off"])) if a != b), None)
    st = engines["on"].stats()
    drafted = st.spec_num_draft_tokens - before.spec_num_draft_tokens
    accepted = st.spec_num_accepted_tokens - before.spec_num_accepted_tokens
    steps = st.spec_num_drafts - before.spec_num_drafts
    off, on = median(rates["off"]), median(rates["on"])
    row = {"workload": name, "model": model, "dtype": str(engines["off"].dtype), "prompt_tokens": len(prompt),
           "output_tokens": output_len, "off_tok_s": rates["off"], "on_tok_s": rates["on"],
           "off_median": off, "on_median": on, "ratio": on / off,
           "draft_steps": steps, "draft_tokens": drafted, "accepted_tokens": accepted,
           "acceptance_rate": accepted / drafted if drafted else 0.0,
           "accepted_per_draft_step": accepted / steps if steps else 0.0,
           "first_divergence": same,
           "proposer_us": _proposer_cost_us(prompt + outputs["on"], args)}
    print(f"  {name:7} {off:9.1f} {on:9.1f} {on / off:7.3f}x  acceptance {100 * row['acceptance_rate']:5.1f}% "
          f"({accepted}/{drafted} draft tokens, {steps} drafting steps), proposer {row['proposer_us']:.1f} us/step"
          + ("" if same is None else f"; outputs differ from token {same}"))
    return row


def _repeat_prompt(engine) -> list[int]:
    messages = [{"role": "user", "content": REPEAT_INSTRUCTION.format(passage=PASSAGE)}]
    text = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return engine.tokenizer.encode(text, add_special_tokens=False)


def run(args: argparse.Namespace) -> int:
    from pagedserve.models.default import ensure_default_model

    if args.repeats < 1:
        print("--repeats must be >= 1")
        return 2
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    unknown = sorted(set(workloads) - {"repeat", "w2"})
    if unknown:
        print(f"unknown workloads {unknown}: use repeat, w2")
        return 2
    print(f"speculative decoding (ngram, K={args.num_speculative_tokens}, n-gram "
          f"{args.ngram_prompt_lookup_min}..{args.ngram_prompt_lookup_max}), {args.dtype}, {machine_summary()}, "
          f"median of {args.repeats} interleaved runs")
    print(f"  {'':7} {'off tok/s':>9} {'on tok/s':>9} {'ratio':>8}")
    rows = []
    if "repeat" in workloads:
        model = args.repeat_model or str(ensure_default_model())
        rows.append(compare("repeat", model, _repeat_prompt, args.repeat_output_len, args))
    if "w2" in workloads:
        req = w2_single_stream()
        rows.append(compare("w2", resolve_model(args.w2_model), lambda _e: req.prompt_token_ids,
                            args.w2_output_len, args))
    write_result(args.json_out, {"bench": "spec", "num_speculative_tokens": args.num_speculative_tokens,
                                 "ngram_prompt_lookup_max": args.ngram_prompt_lookup_max,
                                 "ngram_prompt_lookup_min": args.ngram_prompt_lookup_min,
                                 "repeats": args.repeats, "machine": machine_summary(), "rows": rows})
    return 0
