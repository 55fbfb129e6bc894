"""How fast one decode stream could go on this machine: its memory's read bandwidth ÷ the bytes a
token reads.

One stream reads every weight once per token, so no engine decodes faster than the bandwidth its
threads can pull from memory divided by the model's bytes. ``bench compare`` prints that ceiling
beside each decode row and every engine's share of it: a ratio between two engines says who is
ahead, the share says how much either could still gain here (docs/BENCHMARKS.md).

The bandwidth is measured, not looked up: NumPy sums (which release the GIL) over buffers much
larger than any cache, split across a pool of ``threads`` that stays up between reads, the median
of several reads. A VM's share of the host's memory is not on any spec sheet.
"""

from __future__ import annotations

import json
import statistics
import struct
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

BUFFER_BYTES = 256 << 20  # two of them, read in turn: 512 MiB, past the largest server L3s' share of one VM
READS = 8


def read_bandwidth(threads: int, buffer_bytes: int = BUFFER_BYTES, reads: int = READS) -> float:
    """Bytes per second that ``threads`` threads read from memory together (median of ``reads``)."""
    buffers = [np.ones(buffer_bytes // 8) for _ in range(2)]  # written once: every page is backed
    times = []
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(np.sum, np.array_split(buffers[1], threads)))  # the threads started before timing
        for i in range(reads):
            parts = np.array_split(buffers[i % 2], threads)
            start = time.perf_counter()
            list(pool.map(np.sum, parts))
            times.append(time.perf_counter() - start)
    return buffer_bytes // 8 * 8 / statistics.median(times)


def decode_bytes_per_token(gguf_path: str | Path) -> int | None:
    """The bytes of a GGUF file's tensors that one decode token reads: all of them, less the token
    embedding table where the file has its own LM head (``output.weight``; a lookup reads one row),
    or None where the path is no GGUF file (a directory, a truncated file). Read through the loader's
    tensor index (``open_gguf_tensors``: milliseconds, where ``gguf.GGUFReader`` parses the
    vocabulary for seconds)."""
    from pagedserve.models.gguf import open_gguf_tensors

    try:
        tensors = open_gguf_tensors(Path(gguf_path)).tensors
    except (OSError, ValueError, struct.error):  # what the index raises on what is no GGUF file
        return None
    names = {t.name for t in tensors}
    return sum(int(t.n_bytes) for t in tensors if not (t.name == "token_embd.weight" and "output.weight" in names))


def checkpoint_bytes_per_token(directory: str | Path, head_screen: bool = False) -> int | None:
    """The same for a Hugging Face checkpoint directory: its ``*.safetensors`` tensors' bytes as
    stored (the dtype the engines that run it read), less the embedding table where the model has
    its own ``lm_head``; None where the directory holds no safetensors file or an unreadable one.
    With ``head_screen``, what a greedy token of pagedserve's reads where its LM head has a screen
    (models/head_screen.py): the head's int8 copy, a byte a weight and a scale and a bound a row,
    in place of the head (its few computed rows left out). Read from each file's header (8 bytes of
    length, then JSON with every tensor's byte offsets and shape): nothing is loaded."""
    entries: dict[str, tuple[int, list[int]]] = {}
    try:
        for file in sorted(Path(directory).glob("*.safetensors")):
            with open(file, "rb") as f:
                (length,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(length))
            entries |= {name: (end - start, entry["shape"]) for name, entry in header.items() if name != "__metadata__"
                        for start, end in [entry["data_offsets"]]}
    except (OSError, ValueError, struct.error, KeyError, TypeError):
        return None
    if not entries:
        return None
    untied = any(name.endswith("lm_head.weight") for name in entries)
    head = "lm_head.weight" if untied else "embed_tokens.weight"
    total = 0
    for name, (nbytes, shape) in entries.items():
        if untied and name.endswith("embed_tokens.weight"):
            continue
        if head_screen and name.endswith(head) and len(shape) == 2:
            nbytes = shape[0] * shape[1] + 8 * shape[0]
        total += nbytes
    return total
