"""The engine core's heap settings: a freed step temporary is reused, not mapped and faulted in again."""

import json
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallopt")

# In a fresh interpreter: optionally keep_step_memory(), then a 48 MiB block malloc'd, written, freed,
# and again; the minor page faults of the second round are printed. 48 MiB sits above glibc's own
# mmap threshold ceiling (32 MiB), so without the call every round is freshly mapped memory. (Plain
# malloc: torch's allocator asks for aligned blocks, which a micro-test fragments by chance.)
_ROUNDS = """
import ctypes, json, resource, sys
from pagedserve.engine.core.heap import keep_step_memory
threshold = keep_step_memory() if sys.argv[1] == "keep" else None
size = 48 * 2**20 if threshold is None or threshold >= 64 * 2**20 else threshold // 2
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
def round_():
    block = libc.malloc(size)
    ctypes.memset(block, 1, size)
    libc.free(block)
round_()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
round_()
print(json.dumps({"threshold": threshold, "size": size,
                  "faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before}))
"""


def _second_round(mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", _ROUNDS, mode], capture_output=True, text=True, timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_freed_temporary_is_reused_without_page_faults():
    kept = _second_round("keep")
    assert kept["threshold"] is not None
    pages = kept["size"] // 4096
    assert kept["faults"] < pages // 10, kept  # the heap's block again: no new pages
    if kept["size"] == 48 * 2**20:  # glibc's default maps it afresh: every page faults again
        default = _second_round("default")
        assert default["faults"] > pages // 2, default
