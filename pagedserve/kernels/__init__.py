"""Native CPU kernels, compiled on first use for the machine that runs them.

* ``paged_attention.cpp`` — fused paged decode attention: each sequence's K and V blocks are read
  once, in place, through its block table, where the pure-torch path first copies them into a
  padded contiguous tensor (measured on W1's decode batches: 3x less time per layer).
  ``paged_attention_quantized.cpp`` is the same kernel (``paged_decode.h``) over the quantized
  pools (int8, fp8, int4), dequantizing each K and V vector with its scale as it reads.
* ``layer_ops.cpp`` — RMSNorm (with the residual add folded in), rotary embedding in place and
  SiLU-and-multiply: one pass each instead of several torch ops and temporaries.

The sources are compiled with ``torch.utils.cpp_extension`` (g++ and ninja, ~30 s on 2 cores) into
``$PAGEDSERVE_CACHE/kernels/<key>/``, keyed by the source, the torch version and the CPU's
instruction-set flags (the build uses ``-march=native``), so each machine builds once and later
processes only load the library. Without a compiler, or with ``PAGEDSERVE_KERNELS=0``, nothing is
built and :func:`paged_decode_kernel` returns ``None``: callers fall back to the pure-torch path.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import platform
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

from pagedserve.config import cache_dir

log = logging.getLogger("pagedserve.kernels")

# Separate translation units compile in parallel: the two decode entry points take about as long each.
_SOURCES = [Path(__file__).with_name(name)
            for name in ("paged_attention.cpp", "paged_attention_quantized.cpp", "layer_ops.cpp")]
_HEADERS = [Path(__file__).with_name(name)  # part of the build key, not compiled on their own
            for name in ("convert.h", "paged_decode.h")]
_FLAGS = ["-O3", "-march=native", "-ffast-math", "-std=c++20"]
_lock = threading.Lock()
_state: dict[str, object] = {}  # "ops": the loaded namespace, or "error": why there is none


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def build_key() -> str:
    """What the compiled library depends on: sources, compile flags, torch, Python, CPU features."""
    h = hashlib.sha256()
    for part in (*(p.read_bytes() for p in _SOURCES + _HEADERS), " ".join(_FLAGS).encode(), torch.__version__.encode(),
                 platform.python_version().encode(), platform.machine().encode(), _cpu_flags().encode()):
        h.update(part)
    return h.hexdigest()[:16]


def _put_ninja_on_path() -> None:
    """torch runs ``ninja`` from PATH; the pip package's binary sits in the venv's bin directory,
    which is not on PATH when the venv's python is run without activating it."""
    if shutil.which("ninja") is None:
        try:
            import ninja
        except ImportError:
            return
        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


def _build() -> object:
    from torch.utils import cpp_extension  # imported here: it pulls in setuptools

    _put_ninja_on_path()

    build_dir = cache_dir() / "kernels" / build_key()
    build_dir.mkdir(parents=True, exist_ok=True)
    name = "pagedserve_kernels"
    t0 = time.monotonic()
    # One build at a time per build directory, under a lock the kernel releases if its holder dies:
    # torch's own lock is a plain file that a killed build leaves behind, and every later start
    # would wait on it forever. Holding ours, any torch lock file there is such a leftover.
    with open(build_dir / "build.flock", "w") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)
        (build_dir / "lock").unlink(missing_ok=True)
        library = build_dir / f"{name}.so"
        if library.exists():
            # The directory's key covers every input, so a library there is this build: load it as it
            # is. (Going through cpp_extension.load again would let ninja rebuild it whenever the
            # sources sit at another path, e.g. a second checkout, overwriting a library in use.)
            torch.ops.load_library(str(library))
        else:
            log.info("compiling the native kernels into %s (once per machine, ~30 s)", build_dir)
            # Compiles and loads the library into this process (registering torch.ops.pagedserve.*).
            cpp_extension.load(name=name, sources=[str(p) for p in _SOURCES], extra_cflags=_FLAGS,
                               build_directory=str(build_dir), is_python_module=False, verbose=False)
    log.info("native kernels ready in %.1f s", time.monotonic() - t0)
    return torch.ops.pagedserve


def native_ops() -> object | None:
    """The ``torch.ops.pagedserve`` namespace once the kernels are built and loaded, or ``None`` when
    they are disabled or cannot be built here (the reason is logged once)."""
    if "ops" in _state or "error" in _state:
        return _state.get("ops")
    with _lock:
        if "ops" not in _state and "error" not in _state:
            if os.environ.get("PAGEDSERVE_KERNELS", "1") == "0":
                _state["error"] = "disabled by PAGEDSERVE_KERNELS=0"
            else:
                try:
                    _state["ops"] = _build()
                except Exception as e:  # no compiler, no ninja, a build error: run without the kernels
                    _state["error"] = f"{type(e).__name__}: {e}"
            if "error" in _state:
                log.warning("native kernels unavailable (%s); using the pure-torch paths",
                            str(_state["error"]).splitlines()[0])
    return _state.get("ops")


def paged_decode_kernel() -> Callable[..., None] | None:
    """``paged_decode_attention(out, q, k_pool, v_pool, block_tables, context_lens, scale)``, or ``None``."""
    ops = native_ops()
    return None if ops is None else ops.paged_decode_attention


def paged_decode_quantized_kernel() -> Callable[..., None] | None:
    """``paged_decode_attention_quantized(out, q, k_data, v_data, k_scales, v_scales, block_tables,
    context_lens, scale, kind)`` over :class:`~pagedserve.kv.quant.QuantizedKVCache` storage
    (``kind``: ``int8``, ``fp8`` or ``int4``), or ``None``."""
    ops = native_ops()
    return None if ops is None else ops.paged_decode_attention_quantized


def kernel_error() -> str | None:
    """Why :func:`native_ops` returned ``None``, if it did."""
    return _state.get("error")  # type: ignore[return-value]
