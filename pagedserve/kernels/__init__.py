"""Native CPU kernels, compiled on first use for the machine that runs them.

* ``paged_attention.cpp`` — fused paged decode attention: each sequence's K and V blocks are read
  once, in place, through its block table, where the pure-torch path first copies them into a
  padded contiguous tensor (measured on W1's decode batches: 3x less time per layer).
  ``paged_attention_quantized.cpp`` is the same kernel (``paged_decode.h``) over the quantized
  pools (int8, fp8), dequantizing each K and V vector with its scale as it reads, and over the int4
  layout (kv/int4.py): key blocks as bit planes at each channel's own width (``k_bits``; a block is
  scored plane by plane, each plane one 16-bit load of its bit for 16 tokens), per-token value rows
  and each sequence's float16 tail, with a scalar, an AVX2 and an AVX-512 path (``cpu_isa.h``).
  ``paged_attention.cpp`` also holds the prompt chunks' causal softmax pass (``causal_softmax_``).
* ``kv_write.cpp`` — a step's K or V rows into a quantized pool in one call, with the torch path's
  bits: ``quantized_kv_write`` for the int8 / fp8 pools (each vector's float16 scale and codes, as
  :meth:`~pagedserve.kv.quant.QuantizedKVCache.write` stores them; the decode stack calls it too),
  ``int4_kv_write`` as :meth:`~pagedserve.kv.int4.Int4KVCache.write` plans an int4 pool's (rows
  into tail slots, the blocks the step fills quantized, keys as bit planes); and
  ``int4_key_values``, key blocks read back as float for prompt chunks (the torch path's values,
  ~7x faster).
* ``layer_ops.cpp`` — RMSNorm (with the residual add folded in), rotary embedding in place and
  SiLU-and-multiply: one pass each instead of several torch ops and temporaries.
* ``panel_gemm.cpp`` — float32 linear layers over weights packed into 16-column panels
  (:class:`~pagedserve.models.packed.PanelLinear`): a register-blocked AVX2 kernel, faster than
  torch's oneDNN float32 path on an AVX2-only CPU for 1-8 rows but slower for 64-row decode
  batches, so used only with ``--pack-weights panel``.
* ``quant_matmul.cpp`` — ``y = x Wᵀ + b`` straight from the project's int4 (groups of 32, two
  nibbles per byte) and grouped int8 weights, AVX2 + FMA with a scalar fallback, float activations:
  the ``--quantization int4|int8`` layers with ``--group-kernels`` (docs/QUANTIZATION.md).
  GGUF files no longer come here: their blocks go to ``gguf_matmul``.
* ``gguf_matmul.cpp`` — ``y = x Wᵀ`` straight from GGUF's blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0,
  Q4_K, Q5_K, Q6_K; ``gguf_formats.h``): the activations quantized per 32 values to int8, multiplied
  with the blocks' integers in int32 (AVX2 maddubs, AVX-512 VNNI vpdpbusd; ``gguf_simd.inc``;
  AMX-INT8 tiles for batches of more than 4 rows, ``gguf_amx.inc``), each 32's sum scaled once;
  and the blocks dequantized for prefill GEMMs and lookups (:mod:`pagedserve.models.gguf_linear`):
  prompt chunks' GEMMs in bf16 (``gguf_gemm.inc``), float32 (``gguf_gemm_f32.inc``) and, on the
  AVX2 path, in integers at the kernels' activation precision (int16, or int8 with
  ``--gguf-activations int8``) over panels of 16 weight rows built once (``gguf_gemm_int.inc``).
* ``tile_matmul.cpp`` — bf16 linear layers over weights packed once into the AMX-BF16 tile
  instruction's pair order (:class:`~pagedserve.models.packed.TileLinear`, ``--pack-weights auto``
  where the CPU has AMX-BF16 or AVX512-BF16), for every row count a step has: on the tiles, or with
  ``vdpbf16ps`` reading the same bytes as 16-feature columns, with a scalar reference path.
* ``head_screen.cpp`` — a plain-greedy step's LM head through an int8 copy of it: every logit
  bounded from the copy, only the rows that can hold the argmax computed from the head's own weight
  (:mod:`pagedserve.models.head_screen`), on a scalar, an AVX2 and an AVX-512 path.
* ``gguf_head_screen.cpp`` — a plain-greedy step of several rows through a GGUF Q8_0 head: the head
  multiplied at int8 activations (the int16 ones' high byte), each logit's distance to its int16
  value bounded, and only the groups of 16 rows that can hold the int16 argmax computed at int16
  (``gguf_matmul16_pairs``, ``gguf_matmul16``'s bits for those pairs) (``GGUFHeadScreen`` in
  :mod:`pagedserve.models.head_screen`).
* ``decode_stack.cpp`` — a decode step's decoder layers in one call: a TorchScript class
  (``torch.classes.pagedserve.DecodeStack``) holding every layer's weights and KV pools (the model
  dtype's, int8, fp8 or int4), which runs the kernels above back to back through their C++ entry
  points (``kernel_ops.h``), as the Python model would call them one by one
  (:mod:`pagedserve.models.native_decode`).
* ``cpu_isa.cpp`` / ``cpu_isa.h`` — the run-time instruction-set choice: kernels that dispatch
  compile a scalar, an AVX2 and an AVX-512 path on every x86 machine (the GGUF matmul an AMX one
  too, taken where CPUID shows AMX-INT8 and Linux grants the tile state; the bf16 tile linear where
  it also shows AMX-BF16, and its ``vdpbf16ps`` path where CPUID shows AVX512-BF16) and take the best the CPU
  runs (:func:`best_isa`, logged through :func:`isa_summary`); the tests run each path the CPU can
  (:func:`isa_paths`).

The sources are compiled with ``torch.utils.cpp_extension`` (g++ and ninja, ~1.5 min on 2 cores) into
``$PAGEDSERVE_CACHE/kernels/<key>/``. The key covers everything the library depends on: the
sources' content, the compiler and its flags (the build uses ``-march=native``, so the CPU's
instruction-set flags too), torch's build (version and commit) and Python; not where torch is
installed (:func:`build_key`), so virtualenvs with the same torch share one library. A process whose key
has a library loads it at once; otherwise it builds under a file lock (one build per key at a
time; waiters then load the winner's library), in a scratch directory, and moves the finished
``.so`` into place with an atomic rename, so no process ever loads a half-written file. Every
build logs one line, and every load names the directory it used. Without a compiler nothing is
built and :func:`native_ops` returns ``None``: callers fall back to the pure-torch path.
An engine with ``--no-native-kernels`` (``EngineConfig.native_kernels``) never calls in here, so
nothing is built for it either.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import platform
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

from pagedserve.config import cache_dir

log = logging.getLogger("pagedserve.kernels")

# Separate translation units compile in parallel: the two decode entry points take about as long each.
_SOURCES = [Path(__file__).with_name(name)
            for name in ("paged_attention.cpp", "paged_attention_quantized.cpp", "layer_ops.cpp", "panel_gemm.cpp",
                         "quant_matmul.cpp", "half_matmul.cpp", "cpu_isa.cpp", "gguf_matmul.cpp",
                         "decode_stack.cpp", "kv_write.cpp", "tile_matmul.cpp", "head_screen.cpp",
                         "gguf_head_screen.cpp")]
_HEADERS = [Path(__file__).with_name(name)  # part of the build key, not compiled on their own
            for name in ("convert.h", "paged_decode.h", "cpu_isa.h", "gguf_formats.h", "gguf_simd.inc", "gguf_gemm.inc",
                         "gguf_gemm_f32.inc", "gguf_gemm_int.inc", "gguf_amx.inc", "kernel_ops.h", "work_pool.h", "int4_key_bits.h",
                         "simd_sum.h")]
# -fopenmp: ATen's at::parallel_for is a header template whose body is an OpenMP pragma; compiled
# without the flag the pragma is dropped and every kernel runs on the calling thread alone (measured:
# the decode kernel took as long on two threads as on one). The library then links libgomp.so.1 by
# name, which resolves to the copy torch has already loaded: one OpenMP runtime, one thread pool.
_FLAGS = ["-O3", "-march=native", "-ffast-math", "-std=c++20", "-fopenmp"]
_LINK_FLAGS = ["-fopenmp"]
LIBRARY = "pagedserve_kernels"
_lock = threading.Lock()
_state: dict[str, object] = {}  # "ops": the loaded namespace, or "error": why there is none (only one)


def _cpu_flags() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    return platform.processor()


def cpu_has_native_bf16(cpu_isa: str = "auto") -> bool:
    """Whether this CPU multiplies bf16 natively (AVX-512 BF16 or AMX); without either, torch
    emulates bf16 matmuls, several times slower than float32 (measured 7× on an AVX2 EPYC).
    ``cpu_isa`` (``--cpu-isa``) below ``avx512`` answers for the CPU it stands for: no."""
    return cpu_isa not in ("avx2", "scalar") and not {"avx512_bf16", "amx_bf16"}.isdisjoint(_cpu_flags().split())


def _compiler() -> str:
    """The C++ compiler torch will run (``$CXX``, else ``c++``), resolved to the real file."""
    name = os.environ.get("CXX", "c++")
    found = shutil.which(name)
    return os.path.realpath(found) if found else name


def build_key() -> str:
    """What the compiled library depends on: sources, compiler and flags, torch's build (version and
    commit), Python, CPU features. Not torch's install path: the library names torch's libraries by
    soname (no rpath) and resolves them to the copy already loaded, so every virtualenv with the same
    torch build shares one library instead of compiling its own (each fresh clone's .venv did)."""
    h = hashlib.sha256()
    for part in (*(p.read_bytes() for p in _SOURCES + _HEADERS), " ".join(_FLAGS + _LINK_FLAGS).encode(),
                 _compiler().encode(), torch.__version__.encode(), str(torch.version.git_version).encode(),
                 platform.python_version().encode(), platform.machine().encode(), _cpu_flags().encode()):
        h.update(part + b"\0")  # separated, so no two different part lists hash alike
    return h.hexdigest()[:16]


def kernel_dir() -> Path:
    """This process's build directory: ``$PAGEDSERVE_CACHE/kernels/<build_key()>``."""
    return cache_dir() / "kernels" / build_key()


def _compile(work: Path) -> Path:
    """Compile the kernels in the scratch directory ``work`` and load them; returns the library.

    The sources are copied in first, so the build never depends on where this checkout lives.
    """
    from torch.utils import cpp_extension  # imported here: it pulls in setuptools

    # torch runs ``ninja`` from PATH; the pip package's binary sits in the venv's bin directory,
    # which is not on PATH when the venv's python is run without activating it.
    if shutil.which("ninja") is None:
        with contextlib.suppress(ImportError):
            import ninja

            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    src = work / "src"
    src.mkdir()
    for path in _SOURCES + _HEADERS:
        shutil.copy2(path, src / path.name)
    # copies: load() appends torch's -L/-l flags to the ldflags list it is given, which would change
    # build_key() (and so kernel_dir()) for the rest of the process that compiled
    cpp_extension.load(name=LIBRARY, sources=[str(src / p.name) for p in _SOURCES], extra_cflags=list(_FLAGS),
                       extra_ldflags=list(_LINK_FLAGS), build_directory=str(work), is_python_module=False, verbose=False)
    return work / f"{LIBRARY}.so"


def _build_or_load(build_dir: Path, compile_into: Callable[[Path], Path] = _compile,
                   load: Callable[[Path], None] = torch.ops.load_library) -> bool:
    """Load ``build_dir``'s library into this process, compiling it first if there is none.

    True if this call compiled it. ``compile_into(work)`` builds and loads the library in a
    scratch directory and returns its path (the tests pass a stand-in).
    """
    library = build_dir / f"{LIBRARY}.so"
    if library.exists():
        load(library)
        log.info("native kernels loaded from %s", build_dir)
        return False
    build_dir.mkdir(parents=True, exist_ok=True)
    # One build per key at a time, under a lock the kernel releases if its holder dies (a killed
    # build leaves only its scratch directory behind, which the next build does not reuse).
    with open(build_dir / "build.flock", "w") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)
        if library.exists():  # built by the process we waited for
            load(library)
            log.info("native kernels loaded from %s (built by another process while this one waited)", build_dir)
            return False
        log.info("compiling native kernels into %s (~1.5 min on 2 cores, once per source, compiler and torch build)", build_dir)
        t0 = time.monotonic()
        with tempfile.TemporaryDirectory(prefix="build-", dir=build_dir, ignore_cleanup_errors=True) as work:
            os.replace(compile_into(Path(work)), library)  # atomic: loaders see no file or the whole file
        log.info("native kernels built in %.1f s", time.monotonic() - t0)
    return True


def native_ops() -> object | None:
    """The ``torch.ops.pagedserve`` namespace once the kernels are built and loaded, or ``None`` when
    they cannot be built here (the reason is logged once)."""
    if not _state:  # decided once: the lock only while deciding
        with _lock:
            if not _state:
                try:
                    _build_or_load(kernel_dir())
                    _state["ops"] = torch.ops.pagedserve
                except Exception as e:  # no compiler, no ninja, a build error: run without the kernels
                    _state["error"] = f"{type(e).__name__}: {e}"
                    log.warning("native kernels unavailable (%s); using the pure-torch paths",
                                _state["error"].splitlines()[0])
    return _state.get("ops")


def isa_paths() -> list[str]:
    """The instruction-set paths this CPU runs (``scalar`` always, then ``avx2``, ``avx512``,
    ``amx``), for the kernels that dispatch at run time (``cpu_isa.h``); ``[]`` without the native
    kernels."""
    ops = native_ops()
    return [] if ops is None else list(ops.isa_paths())


def best_isa() -> str | None:
    """The path ``auto`` takes on this CPU, or ``None`` without the native kernels."""
    ops = native_ops()
    return None if ops is None else str(ops.best_isa())


def limit_isa(cpu_isa: str) -> None:
    """Let the native kernels' ``auto`` dispatch take at most ``cpu_isa``'s path in this process
    (``--cpu-isa``; ``auto``: all this CPU runs). Builds the kernels only for a real limit: ``auto``
    lifts one where they are loaded and is nothing otherwise."""
    ops = native_ops() if cpu_isa != "auto" else _state.get("ops")
    if ops is not None:
        ops.limit_isa("amx" if cpu_isa == "auto" else cpu_isa)


def gguf_gemm_usable(dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether prompt chunks over GGUF weights computing in ``dtype`` run the native GEMM here
    (``gguf_gemm``), rather than dequantizing each weight whole for torch's GEMM: in bf16 on AVX-512
    BF16 without AMX-BF16 (whose tiles torch's GEMM uses), in float32 on the AVX2 and AVX-512 paths."""
    ops = native_ops()
    if ops is None:
        return False
    if dtype == torch.bfloat16:
        return bool(ops.gguf_gemm_usable())
    return dtype == torch.float32 and str(ops.best_isa()) != "scalar"


_ISA_WORDS = {"scalar": "the scalar reference (no AVX2 here)", "avx2": "AVX2 maddubs/madd",
              "avx512": "AVX-512 VNNI",
              "amx": "AMX-INT8 tiles for batches of more than 4 rows, AVX-512 VNNI for fewer"}


def isa_summary() -> str:
    """The integer kernels' path on this CPU in words, for the start-up log (``auto``: cpu_isa.h)."""
    isa = best_isa()
    return "unavailable" if isa is None else f"{isa} ({_ISA_WORDS.get(isa, isa)})"


def kernel_error() -> str | None:
    """Why :func:`native_ops` returned ``None``, if it did."""
    return _state.get("error")  # type: ignore[return-value]
