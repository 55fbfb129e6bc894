"""Gemma 3 270M from its Q4_K_M GGUF: the config as transformers reads it, and the engine against
transformers' own model on the same file (its GGUF loader, dequantized, float32) for prompts on
both sides of the 512-token sliding window.

transformers' side (its parse of the file, its greedy tokens and every step's log-probabilities)
takes minutes on a busy CPU and depends only on the file, the prompts and the library versions:
it is computed once per machine and kept in the project cache under a key of exactly those
(:func:`transformers_reference`). The engine runs and is compared against it every time."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pagedserve.models.gemma3 import DEFAULTS, Gemma3Architecture
from pagedserve.models.gguf import prepare_gguf_dir
from pagedserve.models.hf_config import read_hf_config
from tests.conftest import assert_no_leaks
from tests.helpers.kv_groups import group_blocks_in_use
from tests.helpers.references import build_once, reference_path

LICENSE = Path(__file__).resolve().parents[2] / "LICENSE"
# Prompt lengths on both sides of the 512-token window (the suite's budget: 2,000 tokens on a busy CPU
# take transformers minutes).
PROMPT_LENGTHS = [16, 530, 1100]
NEW_TOKENS = 4


def test_defaults_are_transformers_gemma3_text_defaults():
    """config.json holds only what differs from transformers' defaults: ours must be its."""
    from transformers import Gemma3TextConfig

    theirs = Gemma3TextConfig()
    for key, value in DEFAULTS.items():
        if key == "sliding_window_pattern":
            assert theirs._sliding_window_pattern == value
        elif key == "layer_types":  # derived from the pattern
            assert theirs.layer_types == ["sliding_attention" if (i + 1) % 6 else "full_attention"
                                          for i in range(theirs.num_hidden_layers)]
        else:
            assert getattr(theirs, key) == value, key


@pytest.fixture(scope="module")
def prompts(gemma3_gguf) -> list[list[int]]:
    """Token ids of the LICENSE text after BOS, one prompt per length (the prepared tokenizer.json
    read by ``tokenizers``: transformers' GemmaTokenizer over 262k tokens takes a minute to build)."""
    from tokenizers import Tokenizer

    prepared = prepare_gguf_dir(gemma3_gguf)
    ids = Tokenizer.from_file(str(prepared / "tokenizer.json")).encode(LICENSE.read_text() * 2,
                                                                        add_special_tokens=False).ids
    bos = read_hf_config(prepared).bos_token_id
    return [[bos] + ids[7 * i:7 * i + n - 1] for i, n in enumerate(PROMPT_LENGTHS)]


def _transformers_gemma3(gemma3_gguf: Path):
    """transformers' Gemma 3 on the file, from one parse of it by its own GGUF loader:
    ``(model, config)``, the model dequantized to float32, the config as transformers parsed it."""
    from transformers import AutoModelForCausalLM, Gemma3TextConfig
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    skeleton_config = Gemma3TextConfig.from_pretrained(prepare_gguf_dir(gemma3_gguf))  # names the tensors only
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(skeleton_config)
    parsed = load_gguf_checkpoint(str(gemma3_gguf), return_tensors=True, model_to_load=skeleton)
    config = Gemma3TextConfig(**{k: v for k, v in parsed["config"].items() if k != "model_type"})
    model = AutoModelForCausalLM.from_config(config).float().eval()
    missing, unexpected = model.load_state_dict(parsed["tensors"], strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    model.tie_weights()
    return model, config


@pytest.fixture(scope="module")
def transformers_reference(gemma3_gguf, prompts) -> dict:
    """transformers' parse of the file (``config``: its config dict) and, per prompt, its greedy
    tokens and each step's log-probabilities (``refs``; sliding windows by its own masks): from the
    cache when this machine computed them already for the same key (tests/helpers/references.py)."""
    from transformers import Gemma3TextConfig

    def write(tmp: Path) -> None:
        model, config = _transformers_gemma3(gemma3_gguf)
        refs = []
        with torch.no_grad():
            for p in prompts:
                out = model.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                     do_sample=False, output_logits=True, return_dict_in_generate=True)
                refs.append((out.sequences[0, len(p):].tolist(),
                             [step[0].float().log_softmax(-1) for step in out.logits]))
        torch.save({"config": config.to_dict(), "refs": refs}, tmp)

    path = reference_path("gemma3-270m", gemma3_gguf, format=1, suffix=".pt", prompts=prompts, new_tokens=NEW_TOKENS)
    saved = torch.load(build_once(path, write))
    return {"config": Gemma3TextConfig.from_dict(saved["config"]), "refs": saved["refs"]}


@pytest.mark.slow
def test_architecture_from_the_prepared_file_matches_transformers_config(gemma3_gguf, transformers_reference):
    """The prepared directory's config, read without transformers, gives the architecture that
    transformers' own parse of the GGUF does: 18 layers, every 6th global, window 512, two RoPE bases."""
    ours = Gemma3Architecture.from_hf_config(read_hf_config(prepare_gguf_dir(gemma3_gguf)))
    assert ours == Gemma3Architecture.from_hf_config(transformers_reference["config"])
    assert ours.layer_windows == tuple(None if (i + 1) % 6 == 0 else 512 for i in range(18))
    assert (ours.rope_theta, ours.local_rope_theta, ours.num_heads, ours.num_kv_heads, ours.head_dim) == \
        (1e6, 1e4, 4, 1, 256)
    assert ours.sliding_window is None  # the engine must not cap max_model_len at the window


@pytest.mark.slow
def test_gemma3_matches_transformers_across_the_window(gemma3_gguf, prompts, transformers_reference):
    """Dequantized float32 (transformers' reference precision): identical greedy tokens for
    prompts of 16, 530 and 1,100 tokens (across the window), every step's top-5 log-probabilities
    within 5e-4 of transformers' (measured: 4e-5); no KV block left behind."""
    from pagedserve.config import EngineConfig
    from pagedserve.engine.core.engine_core import EngineCore
    from pagedserve.engine.sampling_params import SamplingParams

    # The engine core alone, token ids in and out: a front end would only add Gemma 3's tokenizer
    # (transformers', 262k tokens), seconds to load and of no use here.
    core = EngineCore(EngineConfig(model=str(gemma3_gguf), dtype="float32", kv_cache_memory="160MiB",
                                   max_model_len=2048, max_num_batched_tokens=1024))
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=5)
    for i, prompt in enumerate(prompts):
        core.add_request(str(i), prompt, params)
    got: dict[str, tuple[list[int], list]] = {str(i): ([], []) for i in range(len(prompts))}
    while core.has_unfinished_requests():
        for out in core.step():
            assert out.error is None, out.error
            for seq in out.seqs:
                got[out.request_id][0].extend(seq.token_ids)
                got[out.request_id][1].extend(seq.logprobs or [])
    worst = 0.0
    for i, (want, ref_logprobs) in enumerate(transformers_reference["refs"]):
        token_ids, logprobs = got[str(i)]
        assert token_ids == want and len(logprobs) == NEW_TOKENS
        for lp, ref in zip(logprobs, ref_logprobs):
            ids = torch.tensor([t for t, _ in lp.top])
            worst = max(worst, float((torch.tensor([v for _, v in lp.top]) - ref[ids]).abs().max()))
    assert worst < 5e-4, worst
    assert_no_leaks(core)


@pytest.mark.slow
def test_window_groups_give_blocks_back_and_change_no_token(gemma3_gguf, prompts):
    """A 530-token prompt and 20 greedy tokens, then the same prompt again: with the window groups
    giving blocks back (kv/groups.py) the window groups hold at most 5 × 33 blocks once the prompt
    is in, flat while decoding, every group's blocks owned in the dashboard's block map; the second
    run hits the prefix cache in every group; the tokens are those of the one-table engine
    (windows only masked); no block leaks either way."""
    import numpy as np

    from pagedserve.config import EngineConfig
    from pagedserve.engine.block_map import OWNED, SHARED
    from pagedserve.engine.core.block_map_feed import build_block_map, split_group_bits
    from pagedserve.engine.core.engine_core import EngineCore
    from pagedserve.engine.sampling_params import SamplingParams
    from pagedserve.kv.sizing import window_blocks

    prompt = prompts[1]
    assert len(prompt) == 530
    # 20 tokens (once 24) are enough: the decode writes positions 530-548, across the point where each
    # window group gives a block back (543) and takes the next (544), with five steps after it.
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    tokens: dict[tuple[bool, str], list[int]] = {}
    for free in (True, False):
        # The engine core alone, token ids in and out: the front end would only add a tokenizer, and
        # Gemma 3's (transformers', 262k tokens) took seconds to load for each engine.
        # float32: on a CPU with native bf16 auto computes in bf16, where the 14th token is a near tie
        # (log-probabilities 0.003-0.013 apart) that the prompt's chunking decides: 256-token chunks
        # chose one token, one 530-token chunk and the warm run (18 tokens) the other.
        core = EngineCore(EngineConfig(model=str(gemma3_gguf), dtype="float32", kv_cache_memory="48MiB",
                                       max_model_len=2048, max_num_batched_tokens=256, free_window_blocks=free))
        bm = core.block_manager
        window_use = []
        for run in ("cold", "warm") if free else ("cold",):
            core.add_request(run, prompt, params)
            got = tokens[free, run] = []
            while core.has_unfinished_requests():
                for out in core.step():
                    assert out.error is None, out.error
                    got += [t for seq in out.seqs for t in seq.token_ids]
                if free and core.scheduler.running and core.scheduler.running[0].num_computed_tokens >= 530:
                    window_use.append(group_blocks_in_use(bm, window=True))
                    if len(window_use) == 1:  # the dashboard's block map owns every group's blocks
                        state = split_group_bits(np.frombuffer(build_block_map(core).state, np.uint8))[0]
                        assert int(np.isin(state, (OWNED, SHARED)).sum()) == bm.num_used_blocks
            assert len(got) == 20, (free, run, got)
        assert_no_leaks(core)
        if free:
            assert bm.prefix_hit_tokens >= 512
            assert max(window_use) <= 5 * window_blocks(512, 16)
            assert max(window_use) - min(window_use) <= 5  # flat: at most one block per group in flux
    assert tokens[True, "cold"] == tokens[False, "cold"] == tokens[True, "warm"]
