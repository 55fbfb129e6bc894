"""``--dtype auto`` by the CPU: 16-bit checkpoints compute in bfloat16 only where the CPU multiplies
bf16 natively, in float32 elsewhere with the KV pools kept bfloat16; float32 checkpoints stay
float32; an explicit dtype is taken as asked. The engine on this machine agrees with the rule."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from pagedserve.models import loader

CPU = torch.device("cpu")


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("saved", ["bfloat16", "float16", "float32"])
def test_auto_follows_the_checkpoint_and_the_cpu(saved, native, monkeypatch):
    monkeypatch.setattr(loader, "cpu_has_native_bf16", lambda cpu_isa="auto": native)
    dtype, why, kv = loader.resolve_dtype("auto", SimpleNamespace(dtype=saved), CPU)
    if saved == "float32":
        assert (dtype, kv) == (torch.float32, torch.float32)
    elif native:
        assert (dtype, kv) == (torch.bfloat16, torch.bfloat16) and "native bf16" in why
    else:
        assert (dtype, kv) == (torch.float32, torch.bfloat16) and "no native bf16" in why


def test_an_explicit_dtype_is_taken_as_asked(monkeypatch):
    monkeypatch.setattr(loader, "cpu_has_native_bf16", lambda cpu_isa="auto": False)
    assert loader.resolve_dtype("bfloat16", SimpleNamespace(dtype="float32"), CPU) == \
        (torch.bfloat16, "asked for with --dtype", torch.bfloat16)
    gpu = loader.resolve_dtype("auto", SimpleNamespace(dtype="bfloat16"), torch.device("cuda"))
    assert gpu[0] == torch.bfloat16 and gpu[2] == torch.bfloat16  # GPUs are not this rule's concern


def test_the_engine_on_this_cpu_computes_and_pages_as_the_rule_says(tiny_model_dir):
    """tiny is a bf16 checkpoint: KV is bfloat16 everywhere (2 bytes), compute follows the CPU."""
    from pagedserve.config import EngineConfig
    from pagedserve.engine.frontend.engine import Engine
    from pagedserve.engine.sampling_params import SamplingParams
    from pagedserve.kernels import cpu_has_native_bf16

    e = Engine(EngineConfig(model=str(tiny_model_dir), kv_cache_memory="1MiB"))
    assert e.core.dtype == (torch.bfloat16 if cpu_has_native_bf16() else torch.float32)
    assert e.core.kv.dtype == "bfloat16" and e.core.kv.bytes_per_token == 256
    e.add_request("a", list(range(1, 40)), SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    while e.has_unfinished_requests():
        e.step()
    assert e.core.block_manager.num_free_blocks == e.core.kv.num_blocks  # every block back


@pytest.mark.parametrize("cpu_isa", ["avx2", "scalar"])
def test_a_cpu_isa_below_avx512_chooses_as_a_cpu_without_native_bf16(cpu_isa):
    """``--cpu-isa avx2`` stands for an AVX2-only CPU whatever this one has: float32 compute, bf16 KV;
    the reason names the cap where the CPU itself has native bf16, the CPU where it has none."""
    from pagedserve.kernels import cpu_has_native_bf16

    dtype, why, kv = loader.resolve_dtype("auto", SimpleNamespace(dtype="bfloat16"), CPU, cpu_isa)
    assert (dtype, kv) == (torch.float32, torch.bfloat16)
    who = f"--cpu-isa {cpu_isa} stands for a CPU with" if cpu_has_native_bf16() else "this CPU has"
    assert f"{who} no native bf16" in why
    with pytest.raises(ValueError, match="cpu_isa must be one of auto, amx, avx512, avx2, scalar"):
        from pagedserve.config import EngineConfig

        EngineConfig(model="m", cpu_isa="avx3")
