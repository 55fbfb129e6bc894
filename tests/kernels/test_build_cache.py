"""The kernel build cache: keyed by what the library depends on (so every virtualenv with the same
torch build shares one), built once under a file lock, every build and every load logged with its
directory.

The compiler is replaced by a stand-in that writes a file, so these run in milliseconds; the
real build is what every other test in this directory loads (the last test reads its links).
"""

from __future__ import annotations

import logging
import subprocess
import threading
import time
from pathlib import Path

import pytest

import pagedserve.kernels as kernels


class FakeToolchain:
    """Counts compilations and loads; a compilation takes ``seconds`` and writes a library file."""

    def __init__(self, seconds: float = 0.0):
        self.seconds = seconds
        self.compiled: list[Path] = []
        self.loaded: list[Path] = []
        self._lock = threading.Lock()

    def compile_into(self, work: Path) -> Path:
        time.sleep(self.seconds)
        out = work / f"{kernels.LIBRARY}.so"
        out.write_bytes(b"library")
        with self._lock:
            self.compiled.append(work)
        return out

    def load(self, path: Path) -> None:
        assert path.read_bytes() == b"library"  # never a half-written file
        with self._lock:
            self.loaded.append(path)


def test_built_once_then_loaded_and_both_logged(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    tools = FakeToolchain()
    build_dir = tmp_path / "kernels" / "k1"
    with caplog.at_level(logging.INFO, logger="pagedserve.kernels"):
        assert kernels._build_or_load(build_dir, tools.compile_into, tools.load) is True
        assert kernels._build_or_load(build_dir, tools.compile_into, tools.load) is False
    assert len(tools.compiled) == 1
    assert (build_dir / f"{kernels.LIBRARY}.so").read_bytes() == b"library"
    assert not any(p.name.startswith("build-") for p in build_dir.iterdir())  # the scratch dir is gone
    messages = [r.getMessage() for r in caplog.records]
    assert sum("compiling native kernels into" in m and str(build_dir) in m and "~1.5 min" in m for m in messages) == 1
    assert any(m.startswith("native kernels loaded from") and str(build_dir) in m for m in messages)


def test_concurrent_starts_build_once(tmp_path: Path) -> None:
    tools = FakeToolchain(seconds=0.3)
    build_dir = tmp_path / "kernels" / "k2"
    results: list[bool] = []
    threads = [threading.Thread(target=lambda: results.append(
        kernels._build_or_load(build_dir, tools.compile_into, tools.load))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == [False, False, False, True]  # one builder; the others waited, then loaded
    assert len(tools.compiled) == 1 and len(tools.loaded) == 3


def test_a_failed_build_leaves_no_library(tmp_path: Path) -> None:
    build_dir = tmp_path / "kernels" / "k3"

    def broken(work: Path) -> Path:
        (work / f"{kernels.LIBRARY}.so").write_bytes(b"half")
        raise RuntimeError("g++ failed")

    with pytest.raises(RuntimeError, match="g\\+\\+ failed"):
        kernels._build_or_load(build_dir, broken, FakeToolchain().load)
    assert not (build_dir / f"{kernels.LIBRARY}.so").exists()
    tools = FakeToolchain()  # the next start builds afresh
    assert kernels._build_or_load(build_dir, tools.compile_into, tools.load) is True


def test_key_covers_torch_build_compiler_and_flags_not_the_install_path(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    base = kernels.build_key()
    assert kernels.build_key() == base  # stable within an install
    monkeypatch.setattr(torch, "__file__", "/another/venv/lib/python3.11/site-packages/torch/__init__.py")
    assert kernels.build_key() == base  # the same torch build in another virtualenv shares the library
    monkeypatch.setattr(torch.version, "git_version", "0" * 40)
    other_build = kernels.build_key()
    monkeypatch.undo()
    monkeypatch.setattr(kernels, "_FLAGS", [*kernels._FLAGS, "-DEXTRA"])
    other_flags = kernels.build_key()
    monkeypatch.undo()
    monkeypatch.setenv("CXX", "/opt/other-compiler/bin/g++")
    other_compiler = kernels.build_key()
    assert len({base, other_build, other_flags, other_compiler}) == 4


def test_kernel_dir_is_under_the_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PAGEDSERVE_CACHE", str(tmp_path))
    assert kernels.kernel_dir() == tmp_path / "kernels" / kernels.build_key()


def test_the_library_names_torch_by_soname_and_carries_no_run_path() -> None:
    """What lets virtualenvs share a build (build_key leaves torch's install path out): the library
    finds torch's libraries as the copies already loaded, never through a path into one install."""
    if kernels.native_ops() is None:
        pytest.skip(f"native kernels unavailable: {kernels.kernel_error()}")
    dynamic = subprocess.run(["readelf", "-d", str(kernels.kernel_dir() / f"{kernels.LIBRARY}.so")],
                             capture_output=True, text=True, check=True).stdout
    assert "[libtorch_cpu.so]" in dynamic and "[libc10.so]" in dynamic
    assert "RPATH" not in dynamic and "RUNPATH" not in dynamic, dynamic
