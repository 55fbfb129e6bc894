"""A small Llama-architecture model that has learned something: trained locally on the stdlib sources.

Random-weight models make every quality figure meaningless (their next-token distributions are
near uniform). This module trains a few-million-parameter Llama (tied embeddings, GQA, the
standard BPE tokenizer) on the Python standard library's own source files, which every machine
with Python has, so perplexity, greedy agreement and KL divergence of quantized variants mean
something offline. One file in ten (by sorted name) is held out and never trained on; its
tokens are saved beside the checkpoint (``heldout_tokens.pt``) for evaluation.

The tokenizer is the standard byte-level BPE recipe (``standard.train_tokenizer``) with a 4,096-token
vocabulary: with 32,000 the output layer and its softmax dominate every training step on a CPU
(measured ~12 s per 4,096-token step on 2 cores, against ~1 s here).

It is bench tooling (``bench quality``, ``bench train-model``), not a model the engine implements:
the engine never imports it, it loads the checkpoint it writes like any other.

The result is cached under ``$PAGEDSERVE_CACHE/models/trained-<name>`` after the first run
(a few minutes on 2 CPU cores); ``ensure_trained_model()`` returns its directory.
"""

from __future__ import annotations

import json
import logging
import math
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from pagedserve.models.standard import _stdlib_sources, build_once, cache_dir, shared_tokenizer_dir

logger = logging.getLogger(__name__)

HELDOUT_FILE = "heldout_tokens.pt"
REPORT_FILE = "TRAINING.json"


@dataclass(frozen=True)
class TrainSpec:
    """Shape of the model and the training run; the cache directory is named after ``name``."""

    name: str = "stdlib-small"
    hidden_size: int = 256
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 768
    vocab_size: int = 4096
    context_len: int = 256
    batch_size: int = 8
    steps: int = 1500
    learning_rate: float = 2e-3
    warmup_steps: int = 30
    heldout_every: int = 10  # every n-th source file (sorted by name) is held out
    seed: int = 0
    # A wall-clock cap keeps the first run to minutes on a busy 2-core machine; the learning-rate
    # schedule follows whichever of steps and seconds runs out first, so it still decays fully.
    max_seconds: float | None = 900.0


DEFAULT_SPEC = TrainSpec()


def split_sources(heldout_every: int) -> tuple[list[str], list[str]]:
    """The stdlib source files, split into (train, held-out) by position in sorted order."""
    files = _stdlib_sources()
    heldout = [f for i, f in enumerate(files) if i % heldout_every == heldout_every - 1]
    train = [f for i, f in enumerate(files) if i % heldout_every != heldout_every - 1]
    return train, heldout


def tokenize_files(tokenizer, files: list[str]) -> torch.Tensor:
    """One long token stream: each file's ids (BOS first) followed by EOS."""
    texts = [Path(f).read_text(encoding="utf-8", errors="replace") for f in files]
    ids: list[int] = []
    for enc in tokenizer(texts)["input_ids"]:
        ids.extend(enc)
        ids.append(tokenizer.eos_token_id)
    return torch.tensor(ids, dtype=torch.long)


def _hf_config(spec: TrainSpec):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=spec.vocab_size, hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers, num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads, head_dim=spec.hidden_size // spec.num_heads,
        max_position_embeddings=4096, rope_theta=10000.0, tie_word_embeddings=True,
        bos_token_id=1, eos_token_id=2, initializer_range=0.02)


def _lr(step: int, elapsed: float, spec: TrainSpec) -> float:
    """Linear warm-up, then cosine decay to a tenth, over steps or over ``max_seconds``, whichever ends first."""
    if step < spec.warmup_steps:
        return spec.learning_rate * (step + 1) / spec.warmup_steps
    progress = (step - spec.warmup_steps) / max(1, spec.steps - spec.warmup_steps)
    if spec.max_seconds:
        progress = max(progress, elapsed / spec.max_seconds)
    return spec.learning_rate * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


@torch.no_grad()
def heldout_loss(model, tokens: torch.Tensor, context_len: int, max_windows: int = 16) -> float:
    """Mean next-token cross-entropy over non-overlapping held-out windows (HF model, float32)."""
    n = min(max_windows, (len(tokens) - 1) // context_len)
    windows = tokens[: n * context_len + 1]
    x = windows[:-1].view(n, context_len)
    y = windows[1:].view(n, context_len)
    logits = model(input_ids=x).logits
    return float(torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), y.flatten()))


def train_model(spec: TrainSpec, out_dir: Path, progress: bool = True) -> dict:
    """Train ``spec`` on the stdlib sources and save a bf16 checkpoint, tokenizer and held-out tokens."""
    from tqdm.auto import tqdm
    from transformers import AutoTokenizer, LlamaForCausalLM

    t0 = time.monotonic()
    tok_dir = shared_tokenizer_dir(spec.vocab_size)
    tokenizer = AutoTokenizer.from_pretrained(tok_dir)
    train_files, heldout_files = split_sources(spec.heldout_every)
    train_tokens = tokenize_files(tokenizer, train_files)
    heldout_tokens = tokenize_files(tokenizer, heldout_files)

    torch.manual_seed(spec.seed)
    model = LlamaForCausalLM(_hf_config(spec)).float().train()
    optim = torch.optim.AdamW(model.parameters(), lr=spec.learning_rate, betas=(0.9, 0.95), weight_decay=0.1)
    gen = torch.Generator().manual_seed(spec.seed)
    span = spec.context_len + 1
    losses: list[float] = []
    train_start = time.monotonic()
    steps_done = 0
    with tqdm(total=spec.steps, desc=f"training {spec.name}", unit="step", disable=not progress) as bar:
        for step in range(spec.steps):
            starts = torch.randint(0, len(train_tokens) - span, (spec.batch_size,), generator=gen)
            batch = torch.stack([train_tokens[s:s + span] for s in starts.tolist()])
            for group in optim.param_groups:
                group["lr"] = _lr(step, time.monotonic() - train_start, spec)
            # bf16 autocast roughly doubles CPU matmul speed; the master weights stay float32.
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits = model(input_ids=batch[:, :-1]).logits
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten())
            optim.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optim.step()
            losses.append(loss.item())
            steps_done = step + 1
            bar.update(1)
            bar.set_postfix(loss=f"{losses[-1]:.3f}")
            if spec.max_seconds is not None and time.monotonic() - train_start > spec.max_seconds:
                break
    train_seconds = time.monotonic() - train_start
    model.eval()
    val = heldout_loss(model, heldout_tokens, spec.context_len)

    out_dir.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(out_dir, safe_serialization=True)
    for f in tok_dir.iterdir():
        shutil.copy(f, out_dir / f.name)
    torch.save(heldout_tokens, out_dir / HELDOUT_FILE)
    report = {
        "spec": asdict(spec),
        "parameters": sum(p.numel() for p in model.parameters()),
        "train_files": len(train_files), "heldout_files": len(heldout_files),
        "train_tokens": len(train_tokens), "heldout_tokens": len(heldout_tokens),
        "steps": steps_done, "tokens_seen": steps_done * spec.batch_size * spec.context_len,
        "final_train_loss": sum(losses[-20:]) / len(losses[-20:]),
        "heldout_loss_fp32": val, "heldout_perplexity_fp32": math.exp(val),
        "train_seconds": round(train_seconds, 1), "total_seconds": round(time.monotonic() - t0, 1),
        "threads": torch.get_num_threads(),
    }
    (out_dir / REPORT_FILE).write_text(json.dumps(report, indent=2))
    logger.info("trained %s: %d params, %d steps in %.0fs, held-out perplexity %.2f",
                spec.name, report["parameters"], steps_done, train_seconds, report["heldout_perplexity_fp32"])
    return report


def trained_model_dir(spec: TrainSpec = DEFAULT_SPEC) -> Path:
    """Where the trained checkpoint of ``spec`` is cached."""
    return cache_dir() / "models" / f"trained-{spec.name}"


def ensure_trained_model(spec: TrainSpec = DEFAULT_SPEC, progress: bool = True) -> Path:
    """The cached trained checkpoint's directory, training it on first use (minutes on 2 cores)."""
    def build(tmp: Path) -> None:
        logger.info("training %s on the stdlib sources into %s (first use)", spec.name, trained_model_dir(spec))
        train_model(spec, tmp, progress=progress)

    return build_once(trained_model_dir(spec), REPORT_FILE, build)


def load_heldout_tokens(model_dir: Path) -> torch.Tensor:
    """The held-out token stream saved beside a trained checkpoint."""
    path = Path(model_dir) / HELDOUT_FILE
    if not path.exists():
        raise FileNotFoundError(f"{model_dir} has no {HELDOUT_FILE}: it is not a model from pagedserve.bench.trained")
    return torch.load(path)
