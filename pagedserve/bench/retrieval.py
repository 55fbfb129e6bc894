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
"""

from __future__ import annotations

import argparse
import random
import re
from dataclasses import asdict, dataclass

import torch
from tqdm.auto import tqdm

from pagedserve.bench.common import machine_summary, write_result
from pagedserve.config import KV_CACHE_DTYPES

NAMES = ["Alice", "Bruno", "Chiara", "Dmitri", "Esther", "Farid", "Greta", "Hiroshi", "Ingrid", "Jonas", "Kemal",
         "Leila", "Marek", "Nadia", "Oskar", "Priya", "Quentin", "Rosa", "Stefan", "Tomoko"]
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
    p.add_argument("--lengths", nargs="+", type=int, default=[1024, 2048, 4096, 7168],
                   help="prompt lengths in tokens (each below the model's context)")
    p.add_argument("--needles", type=int, default=20, help="needles per length (>= 1)")
    p.add_argument("--needles-per-context", type=int, default=1,
                   help="k: needles hidden in one context and asked of it (prefix-cached; 1 = classic test)")
    p.add_argument("--depths", nargs="+", type=float, default=[0.1, 0.3, 0.5, 0.7, 0.9],
                   help="needle depths, as fractions of the filler (0 = start, 1 = end)")
    p.add_argument("--seed", type=int, default=0, help="seed for names, codes and filler offsets")
    p.add_argument("--corpus", default=None, help="directory of .rst.txt/.txt filler text (default: the Python "
                                                  "tutorial from python3.11-doc)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
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
    mean_prompt_tokens: float
    kv_bytes_per_token: int


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


def measure_retrieval(model: str, kvs: list[str], contexts: list[Context], dtype: str, quantization: str,
                      max_model_len: int, on_kv_done=None) -> tuple[list[RetrievalRow], list[dict]]:
    """Recall per KV precision and length; ``on_kv_done(rows, answers)`` after each precision (a long
    run's partial results are then on disk)."""
    from pagedserve.config import EngineConfig
    from pagedserve.engine.frontend.engine import Engine

    rows, answers = [], []
    total = sum(len(c.needles) for c in contexts)
    for kv in kvs:
        engine = Engine(EngineConfig(model=model, dtype=dtype, quantization=quantization, kv_cache_dtype=kv,
                                     kv_cache_memory="1GiB", max_model_len=max_model_len,
                                     enable_prefix_caching=True))
        label = engine.core.kv_dtype if kv == "auto" else kv  # e.g. float32
        stats: dict[int, list[int]] = {}
        lengths: dict[int, list[int]] = {}
        with tqdm(total=total, desc=f"KV {kv}", unit="needle") as bar:
            for c, ctx in enumerate(contexts):
                got = answer_context(engine, ctx)
                for n, a, p in zip(ctx.needles, got, ctx.prompts):
                    ok = recalled(a, n.code)
                    stats.setdefault(ctx.length, []).append(int(ok))
                    lengths.setdefault(ctx.length, []).append(len(p))
                    answers.append({"kv": label, "context": c, "length": ctx.length, "depth": n.depth,
                                    "name": n.name, "code": n.code, "answer": a, "recalled": ok,
                                    "other_needle": not ok and any(recalled(a, m.code) for m in ctx.needles)})
                bar.update(len(ctx.needles))
        if engine.core.block_manager.num_used_blocks:
            raise RuntimeError(f"{engine.core.block_manager.num_used_blocks} KV blocks still in use after the run")
        for length, hits in stats.items():
            rows.append(RetrievalRow(kv=label, length=length, needles=len(hits),
                                     recalled=sum(hits), recall=sum(hits) / len(hits),
                                     mean_prompt_tokens=sum(lengths[length]) / len(lengths[length]),
                                     kv_bytes_per_token=engine.core.kv_bytes_per_token))
            tqdm.write(f"KV {rows[-1].kv}, {length} tokens: recall {rows[-1].recalled}/{rows[-1].needles}")
        del engine
        if on_kv_done is not None:
            on_kv_done(rows, answers)
    return rows, answers


def format_table(rows: list[RetrievalRow]) -> str:
    """Recall as markdown: one row per KV precision, one column per context length."""
    lengths = sorted({r.length for r in rows})
    kvs = list(dict.fromkeys(r.kv for r in rows))
    by = {(r.kv, r.length): r for r in rows}
    head = "| KV | B/token | " + " | ".join(f"{n:,} tokens" for n in lengths) + " |"
    lines = [head, "|---|---|" + "---|" * len(lengths)]
    for kv in kvs:
        cells = [f"{100 * by[kv, n].recall:.0f}% ({by[kv, n].recalled}/{by[kv, n].needles})" for n in lengths]
        lines.append(f"| {kv} | {by[kv, lengths[0]].kv_bytes_per_token:,} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


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


def run_retrieval(args: argparse.Namespace) -> int:
    from transformers import AutoTokenizer

    from pagedserve.bench.corpus import CORPUS_NAME, load_prose
    from pagedserve.models.loader import load_hf_config, resolve_model_dir

    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = resolve_model_dir(args.model)
    context = int(getattr(load_hf_config(model_dir), "max_position_embeddings", 0) or 0)
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

    def save(rows, answers):
        write_result(args.json_out, {"benchmark": "retrieval", "model": args.model, "corpus": corpus,
                                     "rows": [asdict(r) for r in rows], "answers": answers,
                                     "settings": {k: v for k, v in vars(args).items() if k != "func"}})

    rows, answers = measure_retrieval(str(model_dir), args.kv, contexts, args.dtype, args.quantization, max_len, save)
    print(f"\nneedle retrieval on {args.model} ({args.dtype}, weights {args.quantization}; {machine_summary()}): "
          f"{args.needles} needles per length, {args.needles_per_context} per context, depths "
          f"{', '.join(f'{d:.0%}' for d in args.depths)}; filler: {corpus}; greedy, chat template")
    print(format_table(rows))
    print()
    print(depth_table(answers))
    misses = [a for a in answers if not a["recalled"]]
    print(f"\nmisses: {len(misses)}; of them answered with another needle's code of the same context: "
          f"{sum(a['other_needle'] for a in misses)}")
    return 0
