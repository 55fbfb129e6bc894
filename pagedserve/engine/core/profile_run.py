"""The profile step behind ``--kv-cache-memory auto`` on CUDA: measure, before the KV pool exists,
how much memory the largest step the scheduler can form takes beyond the weights.

The step is ``max_num_batched_tokens`` prompt tokens, cut into whole prompts of at most
``max_model_len - 1`` tokens (each one chunk attending to all of itself, the most attention work
a chunk can do), followed by the logits of ``max_num_seqs`` sampled rows and their softmax (the
sampler's largest tensors). It runs over a one-block KV pool, every token written to slot 0 and
every block table pointing at block 0: what it reads is garbage, but every tensor it allocates has
the size it will have in service. Its peak allocation above where it started is the activation
term of :func:`pagedserve.engine.core.memory.profiled_kv_budget`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedserve.config import EngineConfig
from pagedserve.kv.cache import allocate_kv_caches
from pagedserve.models.attention import AttentionMetadata
from pagedserve.models.llama import LlamaForCausalLM


@dataclass(frozen=True)
class ProfileStep:
    """The profile step's batch: the model's inputs and the rows whose logits are sampled."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    sampled_rows: torch.Tensor
    block_size: int

    @property
    def num_tokens(self) -> int:
        return self.input_ids.numel()


def prefill_metadata(slot_mapping: torch.Tensor, prefills: list) -> AttentionMetadata:
    """The attention inputs of a batch of prompt chunks alone (no decode rows)."""
    empty = torch.zeros(0, dtype=torch.long, device=slot_mapping.device)
    return AttentionMetadata(slot_mapping=slot_mapping, num_decodes=0, decode_block_tables=empty.view(0, 1),
                             decode_context_lens=empty, decode_mask=None, prefills=prefills)


def profile_step(c: EngineConfig, device: torch.device) -> ProfileStep:
    """The largest step the scheduler can form under the resolved config ``c`` (see the module's docstring)."""
    longest = max(1, c.max_model_len - 1)  # a prompt leaves room for one output token
    lens = [longest] * (c.max_num_batched_tokens // longest)
    if c.max_num_batched_tokens % longest:
        lens.append(c.max_num_batched_tokens % longest)
    prefills, start = [], 0
    for n in lens:
        prefills.append((start, n, n, torch.zeros(-(-n // c.block_size), dtype=torch.long, device=device)))
        start += n
    meta = prefill_metadata(torch.zeros(start, dtype=torch.long, device=device), prefills)
    positions = torch.cat([torch.arange(n, device=device) for n in lens])
    rows = torch.arange(max(0, start - c.max_num_seqs), start, device=device)
    return ProfileStep(torch.zeros(start, dtype=torch.long, device=device), positions, meta, rows, c.block_size)


@torch.inference_mode()
def run_profile_step(model: LlamaForCausalLM, step: ProfileStep, kv_dtype: torch.dtype, kv_cache_dtype: str,
                     device: torch.device) -> torch.Tensor:
    """One forward pass over ``step`` on a one-block KV pool (the model's KV heads, ``kv_dtype`` pools
    of ``kv_cache_dtype``), then the sampler's largest tensors; returns the probabilities (the tests
    check they are finite)."""
    caches = allocate_kv_caches(len(model.layers), 1, step.block_size, model.arch.num_kv_heads, model.arch.head_dim,
                                kv_dtype, device, kv_cache_dtype)
    hidden = model(step.input_ids, step.positions, caches, step.meta)
    probs = model.compute_logits(hidden[step.sampled_rows]).softmax(dim=-1)
    probs.cumsum(dim=-1)  # the sampler's running sum: a second vocabulary-wide tensor alive at once
    return probs


def measure_peak_activation(model: LlamaForCausalLM, step: ProfileStep, kv_dtype: torch.dtype, kv_cache_dtype: str,
                            device: torch.device) -> int:
    """Bytes the profile step allocates at its peak beyond what was allocated before it (CUDA)."""
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    run_profile_step(model, step, kv_dtype, kv_cache_dtype, device)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    torch.cuda.empty_cache()  # the step's blocks go back to the card before mem_get_info is read
    return peak
