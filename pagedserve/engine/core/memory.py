"""``kv_cache_memory="auto"``: size the KV pool from the memory this machine has free.

Like vLLM's ``--gpu-memory-utilization``, a fraction (``kv_cache_memory_fraction``, 0.9 by
default) says how much of the memory may be used; the pool gets that part, less an activation
reserve, measured *after* the weights are loaded (so they are already out of it):

* CUDA: ``fraction × total − in use now − reserve`` (``torch.cuda.mem_get_info``): the engine
  takes the card up to the fraction, counting its weights and whatever else is on it.
* CPU: ``fraction × available − reserve``, where *available* is the smaller of the kernel's
  ``MemAvailable`` (``/proc/meminfo``; psutil's figure where psutil is installed) and what a
  cgroup (container) limit leaves: other processes' memory is theirs, so only free memory counts.

On CPU the reserve is an estimate (:func:`activation_reserve`): the largest step's float32
activations and attention scores, the sampler's logits, and 256 MiB of headroom. On CUDA it is
measured, as vLLM does (:class:`ProfiledKVBudget`: the peak of a profile step,
``engine/core/profile_run.py``, plus an allowance for the CUDA graphs captured after it). The pool
is also capped at what ``max_num_seqs`` sequences of ``max_model_len`` tokens could ever fill.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path

HEADROOM = 256 * 2**20  # allocator slack, Python and torch's own buffers


@dataclass(frozen=True)
class FreeMemory:
    """What can be used now (bytes) and where the figure came from."""

    usable: int  # the fraction already applied, before the reserve
    available: int
    total: int
    source: str


@dataclass(frozen=True)
class AutoKVBudget:
    """The pool size ``auto`` chose, and each term of the choice (for the log line)."""

    budget: int
    free: FreeMemory
    fraction: float
    reserve: int
    cap: int

    def describe(self) -> str:
        capped = " (capped: max_num_seqs × max_model_len tokens fill no more)" if self.budget == self.cap else ""
        f = self.free
        return (f"kv_cache_memory auto = {_size(self.budget)}{capped}: {self.fraction:g} × {_size(f.available)} "
                f"available of {_size(f.total)} ({f.source}, after loading the weights) − {_size(self.reserve)} "
                "activation reserve")


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _meminfo() -> dict[str, int]:
    values = {}
    with contextlib.suppress(OSError):  # not Linux: no figures
        for line in Path("/proc/meminfo").read_text().splitlines():
            key, _, rest = line.partition(":")
            parts = rest.split()
            if parts and parts[0].isdigit():
                values[key] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    return values


def _cgroup_room() -> int | None:
    """Bytes a cgroup v2 (or v1) memory limit still leaves this process, if one applies."""
    for limit_file, usage_file in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            limit_text = Path(limit_file).read_text().strip()
            usage = int(Path(usage_file).read_text().strip())
        except (OSError, ValueError):
            continue
        if limit_text == "max" or not limit_text.isdigit() or int(limit_text) >= 2**60:
            return None  # no limit (v1 writes a huge number for "none")
        return max(0, int(limit_text) - usage)
    return None


def cpu_free_memory(fraction: float) -> FreeMemory:
    try:
        import psutil  # optional: used where installed

        vm = psutil.virtual_memory()
        available, total, source = int(vm.available), int(vm.total), "psutil available"
    except ImportError:
        info = _meminfo()
        if "MemAvailable" in info:
            available, total, source = info["MemAvailable"], info.get("MemTotal", 0), "/proc/meminfo MemAvailable"
        else:  # not Linux: free pages, which undercounts reclaimable cache but never overcounts
            page = os.sysconf("SC_PAGE_SIZE")
            available = os.sysconf("SC_AVPHYS_PAGES") * page
            total, source = os.sysconf("SC_PHYS_PAGES") * page, "free physical pages"
    room = _cgroup_room()
    if room is not None and room < available:
        available, source = room, f"{source}, lowered to the cgroup limit's room"
    return FreeMemory(int(fraction * available), available, total, source)


def activation_reserve(arch, config) -> int:
    """An upper estimate of one step's transient memory, in bytes (float32 throughout), for the model's
    architecture under the resolved engine config (its token budget, ``max_num_seqs``, ``max_model_len``)."""
    a, tokens, max_model_len = arch, config.max_num_batched_tokens, config.max_model_len
    per_token = (4 * a.hidden_size + (a.num_heads + 2 * a.num_kv_heads) * a.head_dim + a.num_heads * a.head_dim
                 + 3 * a.intermediate_size)
    # A prompt chunk's scores against its whole context (the matmul and reference backends build them).
    scores = a.num_heads * min(tokens, max_model_len) * max_model_len
    logits = 3 * config.max_num_seqs * a.vocab_size  # logits, the sampler's softmax and its working copy
    return 4 * (tokens * per_token + scores + logits) + HEADROOM


def auto_kv_budget(free: FreeMemory, fraction: float, reserve: int, cap: int) -> AutoKVBudget:
    return AutoKVBudget(max(0, min(free.usable - reserve, cap)), free, fraction, reserve, cap)


def choose_auto_kv_budget(arch, config, kv_bytes_per_token: int, tail_bytes: int = 0) -> AutoKVBudget:
    """The ``auto`` pool on CPU for this model and resolved engine config, once the weights are loaded
    (CUDA's is measured: :func:`profiled_kv_budget`)."""
    fraction = config.kv_cache_memory_fraction
    free = cpu_free_memory(fraction)
    return auto_kv_budget(free, fraction, activation_reserve(arch, config),
                          kv_budget_cap(config, kv_bytes_per_token, tail_bytes))


# Left free for the decode CUDA graphs, captured after the pool: their activations for the largest
# batch (max_num_seqs rows) share one memory pool, tens of MiB for the models here; the capture
# logs what it really took.
CUDA_GRAPH_ALLOWANCE = 256 * 2**20


@dataclass(frozen=True)
class ProfiledKVBudget:
    """The pool ``auto`` chose on CUDA after a profile run, and each term of the choice (for the log)."""

    budget: int
    total: int  # the card's memory
    fraction: float  # of total the engine may take (--kv-cache-memory-fraction / --gpu-memory-utilization)
    in_use: int  # in use on the card before the pool: this process's weights and torch's context, other processes
    weights: int  # the model's weights (part of in_use)
    peak_activation: int  # the profile step's peak allocation above what it started with
    profile_tokens: int  # prompt tokens in the profile step (max_num_batched_tokens)
    graphs: int  # left for the decode CUDA graphs (0 without them)
    cap: int  # what max_num_seqs × max_model_len tokens could ever fill

    def describe(self) -> str:
        capped = " (capped: max_num_seqs × max_model_len tokens fill no more)" if self.budget == self.cap else ""
        return (f"kv_cache_memory auto = {_size(self.budget)}{capped}: {self.fraction:g} × {_size(self.total)} "
                f"total − {_size(self.in_use)} in use (weights {_size(self.weights)} included; "
                f"torch.cuda.mem_get_info) − {_size(self.peak_activation)} peak of a {self.profile_tokens}-token "
                f"profile step − {_size(self.graphs)} for CUDA graphs")


def profiled_kv_budget(total: int, free: int, weights: int, peak_activation: int, fraction: float, graphs: int,
                       cap: int, profile_tokens: int) -> ProfiledKVBudget:
    """``fraction × total − in use − peak activation − graphs``, at least 0 and at most ``cap``."""
    in_use = total - free
    usable = int(fraction * total) - in_use - peak_activation - graphs
    return ProfiledKVBudget(max(0, min(usable, cap)), total, fraction, in_use, weights, peak_activation,
                            profile_tokens, graphs, cap)


def kv_budget_cap(config, kv_bytes_per_token: int, tail_bytes: int = 0) -> int:
    """The most KV bytes ``max_num_seqs`` sequences of ``max_model_len`` tokens can hold, and
    ``tail_bytes`` besides (int4's tail blocks, kv/int4.py)."""
    blocks_per_seq = -(-config.max_model_len // config.block_size)
    return config.max_num_seqs * blocks_per_seq * config.block_size * kv_bytes_per_token + tail_bytes
