"""The engine's transformers-free readers agree with transformers on every model directory the suite uses.

``read_hf_config`` (config.json with per-model-type defaults) must give the same
``ModelArchitecture``, the same ``auto`` dtype and the same context length as ``AutoConfig``;
``eos_token_ids`` (read from the tokenizer and generation config files) the same ids as
``AutoTokenizer`` + ``GenerationConfig``. Config-only directories stand in for the checkpoints
whose weights don't matter here (a config is what both sides read), so nothing is trained or built
beyond the tiny model and the default model's prepared directory.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pagedserve.engine.core.builder import eos_token_ids
from pagedserve.models.eos import eos_ids_from_transformers
from pagedserve.models.hf_config import read_hf_config
from pagedserve.models.llama import ModelArchitecture
from pagedserve.models.loader import resolve_dtype
from pagedserve.models.standard import STANDARD_MODELS, shared_tokenizer_dir, standard_hf_config
from tests.checkpoints import ARCHITECTURES, checkpoint_config

# Hand-written config.json files: what a checkpoint may leave out, and the legacy spellings.
MINIMAL = {"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2, "intermediate_size": 128}
HAND_WRITTEN = {
    **{f"{t}-minimal": {"model_type": t, **MINIMAL} for t in ("llama", "mistral", "qwen2", "qwen3")},
    "llama-legacy-rope": {"model_type": "llama", **MINIMAL, "rope_theta": 500000.0, "torch_dtype": "float16",
                          "rope_scaling": {"type": "linear", "factor": 2.0}},
    "llama3-rope-outside-length": {"model_type": "llama", **MINIMAL, "max_position_embeddings": 1024,
                                   "original_max_position_embeddings": 256,
                                   "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                    "high_freq_factor": 4.0}},
    "llama-nulls": {"model_type": "llama", **MINIMAL, "head_dim": None, "num_key_value_heads": None,
                    "dtype": "bfloat16", "attention_bias": True},
    "mistral-window": {"model_type": "mistral", **MINIMAL, "sliding_window": 128, "num_key_value_heads": 2},
    "qwen2-window-on": {"model_type": "qwen2", **MINIMAL, "use_sliding_window": True, "sliding_window": 64},
    "qwen3-window-on": {"model_type": "qwen3", **MINIMAL, "use_sliding_window": True, "head_dim": 16,
                        "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}},
}


def _config_dir(root: Path, name: str, config) -> Path:
    """A directory holding just ``config`` (a transformers config or a dict) as config.json."""
    d = root / name
    d.mkdir()
    if isinstance(config, dict):
        (d / "config.json").write_text(json.dumps(config))
    else:
        config.save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def model_dirs(tiny_model_dir, smollm2_gguf, tmp_path_factory) -> dict[str, Path]:
    """Every kind of model directory the suite loads: tiny, each standard model, the default
    model's prepared GGUF directory, each parity-test architecture, the trained toy, and the
    hand-written configs above."""
    from pagedserve.models.gguf import prepare_gguf_dir
    from pagedserve.bench.trained import DEFAULT_SPEC, _hf_config

    root = tmp_path_factory.mktemp("configs")
    dirs = {"tiny": tiny_model_dir, "smollm2-gguf": prepare_gguf_dir(smollm2_gguf)}
    dirs.update({f"standard-{n}": _config_dir(root, f"standard-{n}", standard_hf_config(n)) for n in STANDARD_MODELS})
    dirs.update({f"checkpoint-{a}": _config_dir(root, f"checkpoint-{a}", checkpoint_config(a)) for a in ARCHITECTURES})
    dirs["trained"] = _config_dir(root, "trained", _hf_config(DEFAULT_SPEC))
    dirs.update({n: _config_dir(root, n, c) for n, c in HAND_WRITTEN.items()})
    return dirs


def test_light_config_equals_autoconfig_on_every_field_the_engine_reads(model_dirs):
    from transformers import AutoConfig

    assert len(model_dirs) == 2 + len(STANDARD_MODELS) + len(ARCHITECTURES) + 1 + len(HAND_WRITTEN)
    for name, d in model_dirs.items():
        ours, theirs = read_hf_config(d), AutoConfig.from_pretrained(d)
        assert ModelArchitecture.from_hf_config(ours) == ModelArchitecture.from_hf_config(theirs), name
        for device in ("cpu", "cuda"):
            assert resolve_dtype("auto", ours, torch.device(device)) == \
                resolve_dtype("auto", theirs, torch.device(device)), name
        assert ours.max_position_embeddings == theirs.max_position_embeddings, name  # bench retrieval reads it


def test_light_config_refuses_what_the_engine_cannot_run_in_one_line(tmp_path):
    d = _config_dir(tmp_path, "gpt2", {"model_type": "gpt2", "n_layer": 1, "n_embd": 8})
    with pytest.raises(ValueError, match=r"^unsupported model type 'gpt2'; supported: \['llama'"):
        ModelArchitecture.from_hf_config(read_hf_config(d))
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        read_hf_config(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="has no 'model_type'"):
        read_hf_config(tmp_path)


def test_eos_ids_from_files_equal_transformers(tiny_model_dir, smollm2_gguf, tmp_path):
    from pagedserve.models.eos import eos_ids_from_files
    from pagedserve.models.gguf import prepare_gguf_dir
    from pagedserve.bench.trained import DEFAULT_SPEC, trained_model_dir

    # The shared BPE tokenizer is what every standard model and parity checkpoint copies; here with
    # a generation config naming two ids, and once with none at all.
    shared = tmp_path / "shared"
    shutil.copytree(shared_tokenizer_dir(), shared)
    (shared / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    bare = tmp_path / "bare"
    shutil.copytree(shared_tokenizer_dir(), bare)
    # An EOS written as a serialized AddedToken, and one outside the config's added tokens.
    added = tmp_path / "added"
    shutil.copytree(shared_tokenizer_dir(), added)
    config = json.loads((added / "tokenizer_config.json").read_text())
    config["eos_token"] = {"content": "def", "lstrip": False, "rstrip": False, "normalized": True,
                           "single_word": False, "special": False, "__type": "AddedToken"}
    (added / "tokenizer_config.json").write_text(json.dumps(config))
    dirs = [tiny_model_dir, prepare_gguf_dir(smollm2_gguf), shared, bare, added]
    if (trained_model_dir(DEFAULT_SPEC) / "tokenizer.json").exists():
        dirs.append(trained_model_dir(DEFAULT_SPEC))
    for d in dirs:
        assert eos_ids_from_files(d, d) is not None, d  # settled by the files: no transformers
        assert eos_token_ids(str(d), str(d)) == eos_ids_from_transformers(d, d), d
    assert eos_token_ids(str(shared), str(shared)) == {2, 7}
    assert eos_token_ids(str(added), str(added)) - {2} != set()  # "def" is an ordinary vocabulary token


def test_engine_core_starts_without_transformers(tiny_model_dir):
    """Building the core on the tiny model imports neither transformers nor torch._dynamo (which
    building a model on the meta device with its random initialization used to pull in): a
    subprocess, as this one has both loaded already."""
    code = ("import sys; from pagedserve.config import EngineConfig; from pagedserve.engine.core.engine_core import EngineCore; "
            f"EngineCore(EngineConfig(model={str(tiny_model_dir)!r}, num_kv_blocks=64, native_kernels=False)); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'transformers' or m == 'torch._dynamo'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout
