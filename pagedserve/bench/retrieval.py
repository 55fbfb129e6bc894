"""``pagedserve bench retrieval``: can the model still find a fact deep in a long context, per KV precision?

A *needle* — "The secret code for Alice is 4821." with a random name and a random 4-digit code —
is hidden at a chosen depth of filler prose (the Python tutorial, :mod:`pagedserve.bench.corpus`)
padded to a target prompt length. The model is asked, through its chat template, "What is the
secret code for Alice?" and answers greedily; a needle counts as recalled when its 4 digits are
in the answer. Per context length, ``--needles`` needles are spread over ``--depths``; recall is
reported per KV cache precision, every other setting the same, so a KV format that loses
long-range detail (bad quantization scales do) shows up as lost recall.

Cost: a 7k-token prompt is one long prefill per needle. ``--needles-per-context k`` hides k
needles (distinct names, at k different depths) in one context and asks k questions of it: the
context is prefilled once and prefix caching serves it to the other k − 1 questions (their KV is
the same cached, quantized blocks), which cuts the run time by about k. It also makes the task
harder (k − 1 other codes are distractors), so the table says which k was used; k = 1 is the
classic single-needle test.

Telling a loss from noise: every precision answers the same needles, so each is compared with the
baseline needle by needle (:mod:`pagedserve.bench.paired_stats`: the difference in points with
its 95 % interval and McNemar's p), and each recall carries its Wilson interval. At the default
100 needles per length a paired loss of ~15 points is resolved where 20 needles could not tell
±22. Hours of prefill on two cores: the answers are appended to a journal as each haystack is
answered (:mod:`pagedserve.bench.retrieval_journal`), ``--minutes`` stops a run between haystacks,
and the same command resumes it; the haystacks are taken lengths in turn, so a partial run has
answered every length alike.
"""

from __future__ import annotations

import argparse
import random
import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from pagedserve.bench.common import machine_summary, write_result
from pagedserve.bench.paired_stats import PairedComparison, compare_paired, wilson_interval
from pagedserve.bench.retrieval_journal import Journal, prompts_digest, settings_digest
from pagedserve.config import INT4_KEY_BITS, KV_CACHE_DTYPES, cache_dir
from pagedserve.kv.int4 import LAYOUTS as INT4_LAYOUTS

NAMES = ["Alice", "Bruno", "Chiara", "Dmitri", "Esther", "Farid", "Greta", "Hiroshi", "Ingrid", "Jonas", "Kemal",
         "Leila", "Marek", "Nadia", "Oskar", "Priya", "Quentin", "Rosa", "Stefan", "Tomoko"]
MAX_NEEDLES = 10_000
NEEDLE = "The secret code for {name} is {code}."
QUESTION = "What is the secret code for {name}? Answer with the number only."


def add_parser(bench) -> None:
    p = bench.add_parser(
        "retrieval", help="needle-in-a-haystack recall at 1k-7k tokens, per KV cache precision",
        description="Hides random 'The secret code for NAME is NNNN.' facts at several depths of filler prose "
                    "(the Python tutorial from Debian's python3.11-doc; --corpus for another directory) and asks "
                    "for them through the chat template, greedy; prints recall per context length and KV "
                    "precision. See docs/QUANTIZATION.md.")
    p.add_argument("--model", default="SmolLM2-135M-Instruct",
                   help="model: the default SmolLM2-135M-Instruct, a GGUF file or a model directory (needs a chat "
                        "template)")
    p.add_argument("--dtype", default="float32",
                   help="compute dtype (float32 | bfloat16 | auto); float32 on CPUs without native bf16 matmul")
    p.add_argument("--quantization", default="none", choices=["none", "int8", "int4"],
                   help="weight quantization (none: a GGUF's quantized tensors dequantized to --dtype)")
    p.add_argument("--kv", nargs="+", default=list(KV_CACHE_DTYPES), choices=KV_CACHE_DTYPES,
                   help="KV cache precisions to compare (auto = the model dtype)")
    p.add_argument("--int4-key-bits", default="calibrated", choices=list(INT4_KEY_BITS),
                   help="int4 KV's key bits per channel: calibrated per model (the engine's default) or 4 each "
                        "(the layout before); journals of the two are kept apart")
    p.add_argument("--lengths", nargs="+", type=int, default=[1024, 2048, 4096, 7168],
                   help="prompt lengths in tokens (each below the model's context)")
    p.add_argument("--needles", type=int, default=100,
                   help=f"needles per length (1-{MAX_NEEDLES}; 100 tells a ~15-point paired loss from noise)")
    p.add_argument("--needles-per-context", type=int, default=1,
                   help="k: needles hidden in one context and asked of it (prefix-cached; 1 = classic test)")
    p.add_argument("--depths", nargs="+", type=float, default=[0.1, 0.3, 0.5, 0.7, 0.9],
                   help="needle depths, as fractions of the filler (0 = start, 1 = end)")
    p.add_argument("--seed", type=int, default=0, help="seed for names, codes and filler offsets")
    p.add_argument("--corpus", default=None, help="directory of .rst.txt/.txt filler text (default: the Python "
                                                  "tutorial from python3.11-doc)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--baseline", default=None,
                   help="the KV precision the others are compared with, needle by needle (default: the first of --kv)")
    p.add_argument("--journal", default="auto",
                   help="file the answers are appended to as they come; a run given the same file (the same "
                        "settings) resumes where it stopped. auto: $PAGEDSERVE_CACHE/bench/retrieval-<settings>.jsonl; "
                        "none: keep nothing")
    p.add_argument("--minutes", type=float, default=None,
                   help="stop after about this many minutes (between haystacks) and print what is answered so far; "
                        "run the same command again to continue")
    p.add_argument("--json", dest="json_out", default=None, help="write the results as JSON to this file")
    p.set_defaults(func=run_retrieval)


@dataclass
class Needle:
    name: str
    code: str
    depth: float


@dataclass
class Context:
    """One haystack: its needles and the token ids of the question prompt for each."""

    length: int
    needles: list[Needle]
    prompts: list[list[int]]


@dataclass
class RetrievalRow:
    kv: str
    length: int
    needles: int
    recalled: int
    recall: float
    low: float  # 95 % Wilson interval of the recall
    high: float
    mean_prompt_tokens: float
    kv_bytes_per_token: int
    seconds: float  # wall time spent answering this cell's needles


def _chat_ids(tokenizer, user: str) -> list[int]:
    text = tokenizer.apply_chat_template([{"role": "user", "content": user}], tokenize=False,
                                         add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def build_context(tokenizer, sentences: list[str], sentence_tokens: list[int], length: int, needles: list[Needle],
                  start: int) -> Context:
    """Filler sentences from ``start`` (cycling) with the needles inserted at their depths, sized so
    that every question's chat prompt is about ``length`` tokens."""
    question_tokens = len(_chat_ids(tokenizer, "\n\n" + QUESTION.format(name=max(NAMES, key=len))))
    needle_tokens = sum(len(tokenizer.encode(" " + NEEDLE.format(name=n.name, code=n.code), add_special_tokens=False))
                        for n in needles)
    budget = length - question_tokens - needle_tokens
    filler, used, i = [], 0, start
    while used < budget:
        s = sentences[i % len(sentences)]
        filler.append(s)
        used += sentence_tokens[i % len(sentences)]
        i += 1
    # Insert deepest-first so earlier insertions do not shift later positions.
    body = list(filler)
    for n in sorted(needles, key=lambda n: n.depth, reverse=True):
        body.insert(round(n.depth * len(filler)), NEEDLE.format(name=n.name, code=n.code))
    document = " ".join(body)
    prompts = [_chat_ids(tokenizer, document + "\n\n" + QUESTION.format(name=n.name)) for n in needles]
    return Context(length, needles, prompts)


def split_sentences(paragraphs: list[str]) -> list[str]:
    out = []
    for p in paragraphs:
        out += [s for s in re.split(r"(?<=[.!?])\s+", p) if s]
    return out


def make_contexts(tokenizer, paragraphs: list[str], lengths: list[int], needles: int, per_context: int,
                  depths: list[float], seed: int) -> list[Context]:
    """Every haystack of the run, the same for every KV precision (seeded)."""
    if needles < 1 or per_context < 1:
        raise ValueError("--needles and --needles-per-context must be >= 1")
    if per_context > len(NAMES):
        raise ValueError(f"--needles-per-context is at most {len(NAMES)} (distinct names)")
    rng = random.Random(seed)
    sentences = split_sentences(paragraphs)
    # The filler must not contain a code-like fact of its own: drop sentences with 4-digit numbers.
    sentences = [s for s in sentences if not re.search(r"\b\d{4}\b", s)]
    sentence_tokens = [len(tokenizer.encode(" " + s, add_special_tokens=False)) for s in sentences]
    contexts = []
    for length in lengths:
        made = 0
        while made < needles:
            k = min(per_context, needles - made)
            names = rng.sample(NAMES, k)
            # k consecutive depths of the list, rotating, so each depth gets its share of needles
            ds = [depths[(made + j) % len(depths)] for j in range(k)]
            group = [Needle(name, f"{rng.randrange(1000, 10000)}", d) for name, d in zip(names, ds)]
            contexts.append(build_context(tokenizer, sentences, sentence_tokens, length, group,
                                          rng.randrange(len(sentences))))
            made += k
    return contexts


def recalled(answer: str, code: str) -> bool:
    return re.search(rf"(?<!\d){code}(?!\d)", answer) is not None


def answer_context(engine, ctx: Context, max_tokens: int = 16) -> list[str]:
    """Greedy answers to every question of one haystack: the first alone (it fills the prefix cache),
    then the rest together (their shared document comes from the cache)."""
    from pagedserve.engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    answers: dict[int, str] = {}
    for batch in ([0], list(range(1, len(ctx.prompts)))):
        for i in batch:
            engine.add_request(f"q{i}", ctx.prompts[i], params)
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    if out.error:
                        raise RuntimeError(f"retrieval request failed in the engine: {out.error}")
                    answers[int(out.request_id[1:])] = out.outputs[0].text
    return [answers[i] for i in range(len(ctx.prompts))]


def interleaved_order(contexts: list[Context]) -> list[int]:
    """Context indices taking the lengths in turn (1k, 2k, 4k, 7k, 1k, ...), so a run stopped part
    way has answered every length about equally."""
    by_length: dict[int, list[int]] = {}
    for i, c in enumerate(contexts):
        by_length.setdefault(c.length, []).append(i)
    queues = list(by_length.values())
    order = []
    for j in range(max(len(q) for q in queues)):
        order += [q[j] for q in queues if j < len(q)]
    return order


def measure_retrieval(model: str, kvs: list[str], contexts: list[Context], dtype: str, quantization: str,
                      max_model_len: int, journal: Journal | None = None, deadline: float | None = None,
                      int4_key_bits: str = "calibrated") -> list[dict]:
    """Answers every needle of ``contexts`` with each KV precision, one engine per precision, the
    haystacks in :func:`interleaved_order`; each haystack's answers go into ``journal`` as they
    come, and haystacks it already holds are skipped. Stops between haystacks once
    ``time.monotonic()`` passes ``deadline``. Returns every record in the journal."""
    from pagedserve.config import EngineConfig
    from pagedserve.engine.frontend.engine import Engine

    journal = journal if journal is not None else Journal(None, {})
    engines: dict[str, Engine] = {}
    todo = [(c, kv) for c in interleaved_order(contexts) for kv in kvs if not journal.done(kv, c)]
    total = sum(len(contexts[c].needles) for c, _ in todo)
    with tqdm(total=total, desc="needles", unit="needle") as bar:
        for c, kv in todo:
            if deadline is not None and time.monotonic() > deadline:
                break
            if kv not in engines:
                engines[kv] = Engine(EngineConfig(model=model, dtype=dtype, quantization=quantization,
                                                  kv_cache_dtype=kv, int4_key_bits=int4_key_bits,
                                                  kv_cache_memory="1GiB",
                                                  max_model_len=max_model_len, enable_prefix_caching=True))
            engine, ctx = engines[kv], contexts[c]
            started = time.perf_counter()
            got = answer_context(engine, ctx)
            seconds = (time.perf_counter() - started) / len(got)
            label = engine.core.kv.dtype if kv == "auto" else kv  # e.g. float32
            journal.add(kv, c, [
                {"kv": label, "length": ctx.length, "needle": j, "depth": n.depth, "name": n.name, "code": n.code,
                 "answer": a, "recalled": recalled(a, n.code), "prompt_tokens": len(p), "seconds": seconds,
                 "other_needle": not recalled(a, n.code) and any(recalled(a, m.code) for m in ctx.needles),
                 "kv_bytes_per_token": engine.core.kv.bytes_per_token}
                for j, (n, a, p) in enumerate(zip(ctx.needles, got, ctx.prompts))])
            bar.update(len(got))
    for kv, engine in engines.items():
        if engine.core.block_manager.num_used_blocks:
            raise RuntimeError(f"KV {kv}: {engine.core.block_manager.num_used_blocks} KV blocks still in use "
                               f"after the run")
    return journal.records


def summarize(records: list[dict]) -> list[RetrievalRow]:
    """One row per (KV precision, length) in the order first answered."""
    cells: dict[tuple[str, int], list[dict]] = {}
    for r in records:
        cells.setdefault((r["kv"], r["length"]), []).append(r)
    rows = []
    for (kv, length), rs in sorted(cells.items(), key=lambda item: item[0][1]):
        hits = sum(r["recalled"] for r in rs)
        low, high = wilson_interval(hits, len(rs))
        rows.append(RetrievalRow(kv=kv, length=length, needles=len(rs), recalled=hits, recall=hits / len(rs),
                                 low=low, high=high,
                                 mean_prompt_tokens=sum(r["prompt_tokens"] for r in rs) / len(rs),
                                 kv_bytes_per_token=rs[0]["kv_bytes_per_token"],
                                 seconds=sum(r["seconds"] for r in rs)))
    order = list(dict.fromkeys(r["kv"] for r in records))
    return sorted(rows, key=lambda row: (order.index(row.kv), row.length))


def paired_comparisons(records: list[dict], baseline: str) -> dict[tuple[str, int], PairedComparison]:
    """Each other precision against ``baseline`` per length, on the needles both answered."""
    by_needle = {(r["kv"], r["unit"], r["needle"]): r["recalled"] for r in records}
    lengths = {(r["unit"], r["needle"]): r["length"] for r in records}
    out = {}
    for kv in dict.fromkeys(r["kv"] for r in records):
        if kv == baseline:
            continue
        for length in sorted(set(lengths.values())):
            keys = [k for k, n in lengths.items() if n == length
                    and (baseline, *k) in by_needle and (kv, *k) in by_needle]
            if keys:
                out[kv, length] = compare_paired([by_needle[(baseline, *k)] for k in keys],
                                                 [by_needle[(kv, *k)] for k in keys])
    return out


def format_table(rows: list[RetrievalRow]) -> str:
    """Recall as markdown: one row per KV precision, one column per context length, each cell with
    its count and 95 % interval."""
    lengths = sorted({r.length for r in rows})
    kvs = list(dict.fromkeys(r.kv for r in rows))
    by = {(r.kv, r.length): r for r in rows}
    head = "| KV | B/token | " + " | ".join(f"{n:,} tokens" for n in lengths) + " |"
    lines = [head, "|---|---|" + "---|" * len(lengths)]
    for kv in kvs:
        cells = [(f"{100 * r.recall:.0f}% ({r.recalled}/{r.needles}; {100 * r.low:.0f}–{100 * r.high:.0f})"
                  if (r := by.get((kv, n))) else "-") for n in lengths]
        first = next(by[kv, n] for n in lengths if (kv, n) in by)
        lines.append(f"| {kv} | {first.kv_bytes_per_token:,} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def paired_table(comparisons: dict[tuple[str, int], PairedComparison], baseline: str) -> str:
    """Each precision's recall minus the baseline's on the same needles, per length."""
    lengths = sorted({n for _, n in comparisons})
    kvs = list(dict.fromkeys(kv for kv, _ in comparisons))
    lines = [f"| KV − {baseline} | " + " | ".join(f"{n:,} tokens" for n in lengths) + " |",
             "|---|" + "---|" * len(lengths)]
    for kv in kvs:
        cells = [comparisons[kv, n].describe() if (kv, n) in comparisons else "-" for n in lengths]
        lines.append(f"| {kv} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def cost_lines(rows: list[RetrievalRow]) -> list[str]:
    """Per precision: needles, prompt tokens and wall time spent."""
    out = []
    for kv in dict.fromkeys(r.kv for r in rows):
        mine = [r for r in rows if r.kv == kv]
        needles = sum(r.needles for r in mine)
        tokens = sum(r.mean_prompt_tokens * r.needles for r in mine)
        seconds = sum(r.seconds for r in mine)
        out.append(f"KV {kv}: {needles} needles, {tokens:,.0f} prompt tokens, {seconds / 60:.1f} min")
    return out


def depth_table(answers: list[dict]) -> str:
    """Recall by depth (all lengths together), per KV precision."""
    depths = sorted({a["depth"] for a in answers})
    kvs = list(dict.fromkeys(a["kv"] for a in answers))
    lines = ["| KV | " + " | ".join(f"depth {d:.0%}" for d in depths) + " |", "|---|" + "---|" * len(depths)]
    for kv in kvs:
        cells = []
        for d in depths:
            hits = [a["recalled"] for a in answers if a["kv"] == kv and a["depth"] == d]
            cells.append(f"{100 * sum(hits) / len(hits):.0f}%" if hits else "-")
        lines.append(f"| {kv} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def run_settings(args: argparse.Namespace, model_dir: Path, contexts: list[Context]) -> dict:
    """Everything that decides a run's questions and answers: its journal holds for these alone."""
    model_file = model_dir / "gguf_source.json"
    settings = {"model": args.model, "model_source": model_file.read_text() if model_file.exists() else str(model_dir),
                "dtype": args.dtype, "quantization": args.quantization, "lengths": args.lengths,
                "needles": args.needles, "needles_per_context": args.needles_per_context, "depths": args.depths,
                "seed": args.seed, "prompts": prompts_digest([p for c in contexts for p in c.prompts])}
    if "int4" in args.kv:  # answers of another int4 layout (kv/int4.py) are not this one's
        settings["int4_layout"] = INT4_LAYOUTS[args.int4_key_bits]
    return settings


def _journal_for(args: argparse.Namespace, model_dir: Path, contexts: list[Context]) -> Journal:
    """The run's journal, keyed by its :func:`run_settings`."""
    settings = run_settings(args, model_dir, contexts)
    if args.journal == "none":
        return Journal(None, settings)
    path = (cache_dir() / "bench" / f"retrieval-{settings_digest(settings)}.jsonl" if args.journal == "auto"
            else Path(args.journal))
    try:
        journal = Journal(path, settings)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    held = len(journal.records)
    print(f"journal: {path} ({'resuming with ' + str(held) + ' answers' if held else 'new'})")
    return journal


def run_retrieval(args: argparse.Namespace) -> int:
    from transformers import AutoTokenizer

    from pagedserve.bench.corpus import CORPUS_NAME, load_prose
    from pagedserve.models.hf_config import read_hf_config
    from pagedserve.models.loader import resolve_model_dir

    if not 1 <= args.needles <= MAX_NEEDLES:
        raise SystemExit(f"error: --needles must be in [1, {MAX_NEEDLES}]")
    baseline = args.baseline or args.kv[0]
    if baseline not in args.kv:
        raise SystemExit(f"error: --baseline {baseline} is not one of --kv")
    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = resolve_model_dir(args.model)
    context = int(getattr(read_hf_config(model_dir), "max_position_embeddings", 0) or 0)
    if context and max(args.lengths) + 16 > context:
        raise SystemExit(f"error: --lengths up to {max(args.lengths)} leave no room for the answer in the model's "
                         f"{context}-token context")
    if any(not 0 <= d <= 1 for d in args.depths):
        raise SystemExit("error: --depths are fractions in [0, 1]")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if getattr(tokenizer, "chat_template", None) is None:
        raise SystemExit(f"error: {args.model} has no chat template")
    try:
        paragraphs, corpus_dir = load_prose(args.corpus)
    except (FileNotFoundError, ValueError) as e:
        raise SystemExit(f"error: {e}") from None
    contexts = make_contexts(tokenizer, paragraphs, args.lengths, args.needles, args.needles_per_context,
                             args.depths, args.seed)
    max_len = max(len(p) for c in contexts for p in c.prompts) + 16
    corpus = CORPUS_NAME if args.corpus is None else str(corpus_dir)
    journal = _journal_for(args, model_dir, contexts)
    deadline = None if args.minutes is None else time.monotonic() + 60 * args.minutes
    records = measure_retrieval(str(model_dir), args.kv, contexts, args.dtype, args.quantization, max_len,
                                journal, deadline, args.int4_key_bits)
    rows = summarize(records)
    base_label = next((r["kv"] for r in records if r["variant"] == baseline), baseline)
    comparisons = paired_comparisons(records, base_label)
    expected = sum(len(c.needles) for c in contexts) * len(args.kv)
    write_result(args.json_out, {"benchmark": "retrieval", "model": args.model, "corpus": corpus,
                                 "rows": [asdict(r) for r in rows], "answers": records,
                                 "complete": len(records) == expected,
                                 "paired": {f"{kv}@{n}": asdict(c) for (kv, n), c in comparisons.items()},
                                 "settings": {k: v for k, v in vars(args).items() if k != "func"}})
    print(f"\nneedle retrieval on {args.model} ({args.dtype}, weights {args.quantization}; {machine_summary()}): "
          f"{args.needles} needles per length, {args.needles_per_context} per context, depths "
          f"{', '.join(f'{d:.0%}' for d in args.depths)}; filler: {corpus}; greedy, chat template")
    if len(records) < expected:
        print(f"PARTIAL: {len(records)} of {expected} answers so far; run the same command again to continue")
    if not rows:
        return 0
    print(format_table(rows))
    if comparisons:
        print(f"\npaired against {base_label} (needles both answered; 95 % Agresti–Min interval, McNemar's exact p):")
        print(paired_table(comparisons, base_label))
    print()
    print(depth_table(records))
    misses = [a for a in records if not a["recalled"]]
    print(f"\nmisses: {len(misses)}; of them answered with another needle's code of the same context: "
          f"{sum(a['other_needle'] for a in misses)}")
    print("\n".join(cost_lines(rows)))
    return 0
