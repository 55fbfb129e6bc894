"""The standard random-weight checkpoints of docs/WORKLOADS.md, built locally (nothing is downloaded).

Each is a Llama-architecture model (``LlamaConfig`` + ``LlamaForCausalLM``, fixed seed, saved as
safetensors in bf16) with a byte-level BPE tokenizer (vocab 32,000) trained on the Python
standard library's own source files, which every machine with Python has.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from pagedserve.config import cache_dir

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StandardModel:
    name: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int = 32000
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    rope_theta: float = 10000.0


STANDARD_MODELS: dict[str, StandardModel] = {
    "tiny": StandardModel("tiny", 64, 2, 4, 2, 16, 128),
    "small": StandardModel("small", 768, 12, 12, 4, 64, 2048),
    "qwen05-shape": StandardModel("qwen05-shape", 896, 24, 14, 2, 64, 4864, tie_word_embeddings=True),
}


CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def _stdlib_sources() -> list[str]:
    import sysconfig

    return [str(p) for p in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))]


def train_tokenizer(out_dir: Path, vocab_size: int = 32000):
    """Train a byte-level BPE tokenizer on the standard library's source and save it (HF format).

    Token ids 0, 1, 2 are ``<unk>``, ``<s>`` (BOS, prepended on encode) and ``</s>`` (EOS),
    matching ``LlamaConfig``'s defaults.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train(_stdlib_sources(), trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", 1)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out_dir)
    return fast


def shared_tokenizer_dir(vocab_size: int = 32000) -> Path:
    """The stdlib BPE tokenizer with ``vocab_size`` tokens, trained once per cache (the default one
    is copied into every standard model; the trained model uses a smaller one)."""
    def build(tmp: Path) -> None:
        logger.info("training the BPE tokenizer (vocab %d) on the stdlib sources", vocab_size)
        train_tokenizer(tmp, vocab_size=vocab_size)

    return build_once(cache_dir() / f"tokenizer-bpe-{vocab_size}", "tokenizer.json", build)


def build_once(out: Path, marker: str, build: Callable[[Path], object]) -> Path:
    """``out``, built on first use by ``build(tmp)`` into a sibling directory that is then renamed
    into place, so a reader never sees half of it; once across processes (a file lock). ``marker``:
    the file whose presence means ``out`` is complete (``""``: ``out`` itself, a file ``build`` writes
    whole). A build that fails leaves nothing behind."""
    if not (out / marker).exists():
        with _build_lock(out):
            if not (out / marker).exists():
                tmp = out.with_name(out.name + f".tmp{os.getpid()}")
                shutil.rmtree(tmp, ignore_errors=True)
                try:
                    build(tmp)
                    shutil.rmtree(out, ignore_errors=True)  # an incomplete one (no marker)
                    tmp.rename(out)
                finally:  # a failed build (an unsupported GGUF, say) leaves no half-built directory
                    shutil.rmtree(tmp, ignore_errors=True)
    return out


@contextlib.contextmanager
def _build_lock(target: Path) -> Iterator[None]:
    """An exclusive file lock so parallel processes build a cached artefact once (closing the file
    releases it)."""
    import fcntl

    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.with_name(target.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def standard_hf_config(name: str):
    """The transformers ``LlamaConfig`` the named standard checkpoint is built with."""
    from transformers import LlamaConfig

    spec = STANDARD_MODELS[name]
    return LlamaConfig(
        vocab_size=spec.vocab_size, hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers, num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads, head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings, rope_theta=spec.rope_theta,
        tie_word_embeddings=spec.tie_word_embeddings, bos_token_id=1, eos_token_id=2,
    )


def build_standard_model(name: str, out_dir: Path, seed: int = 0) -> Path:
    """Write the named standard checkpoint (bf16 safetensors + tokenizer) into ``out_dir``."""
    import torch
    from transformers import LlamaForCausalLM

    config = standard_hf_config(name)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    shutil.copytree(shared_tokenizer_dir(), out_dir, dirs_exist_ok=True)
    (out_dir / "PAGEDSERVE_RANDOM_WEIGHTS").write_text(
        f"Standard model {name!r} of docs/WORKLOADS.md: random weights (seed {seed}); its text is meaningless.\n")
    return out_dir


def ensure_standard_model(name: str) -> Path:
    """The cached directory of a standard model, built on first use."""
    if name not in STANDARD_MODELS:
        raise ValueError(f"unknown standard model {name!r}; choose from {sorted(STANDARD_MODELS)}")
    def build(tmp: Path) -> None:
        logger.info("building the standard %r random-weight model in %s (first use)", name, tmp.parent)
        build_standard_model(name, tmp)

    return build_once(cache_dir() / "models" / name, "config.json", build)


def is_random_weight_model(model_dir: Path) -> bool:
    return (Path(model_dir) / "PAGEDSERVE_RANDOM_WEIGHTS").exists()
