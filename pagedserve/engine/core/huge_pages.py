"""The model's weights on 2 MiB pages.

A decode step on a CPU streams every weight byte once (the default model: 92 MiB a token, the
`small` model in bf16 250 MiB), and on 4 KiB pages that is a TLB miss every 64 cache lines and a
stop for the hardware prefetcher at every page's end. Linux backs a private anonymous mapping
with 2 MiB pages when it asks for them (``madvise(MADV_HUGEPAGE)``, honoured where transparent
huge pages are in ``madvise`` or ``always`` mode and the kernel finds free 2 MiB frames); elsewhere
the same mapping simply gets 4 KiB pages.

Layers build their weights in torch's ordinary allocations. After loading,
:func:`move_to_huge_pages` copies the large ones into one such mapping and points the tensors at
the copy: the same values and the same tensor objects, so modules, views and tied weights all
follow. It leaves tensors under :data:`MIN_BYTES` (norms, biases), opaque layouts (oneDNN's packed
weights, whose pointers the library holds) and other devices. The KV pools stay on 4 KiB pages
(kv/zeros.py): there a 2 MiB page is zeroed, and under ``defrag=madvise`` compacted for, at its
first touch inside a step, and W1 measured 5 % slower. Measured in docs/BENCHMARKS.md ("Weights on
2 MiB pages").
"""

from __future__ import annotations

import logging
import mmap
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from pagedserve.engine.core.heap import release_free_heap

logger = logging.getLogger(__name__)

MIN_BYTES = 64 << 10  # smaller tensors (norms, biases) stay where they are: few bytes, read from cache
_ALIGN = 64  # each storage starts on a cache line (and on any element size)
HUGE_PAGE = 2 << 20
TRIM_EVERY = 256 << 20  # old storages' bytes freed between two hand-backs of the heap's free pages
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def transparent_huge_pages() -> str:
    """The kernel's transparent huge page mode (``always``, ``madvise`` or ``never``), or
    ``unavailable`` where it does not say (not Linux, or a kernel without them)."""
    try:
        found = re.search(r"\[(\w+)\]", THP_SETTING.read_text())
    except OSError:
        return "unavailable"
    return found.group(1) if found else "unavailable"


def huge_page_buffer(nbytes: int) -> torch.Tensor:
    """``nbytes`` of uint8 in a private anonymous mapping that asks for 2 MiB pages, starting on a
    2 MiB boundary. The tensor keeps the mapping alive (``frombuffer`` holds a reference)."""
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mapping.madvise(mmap.MADV_HUGEPAGE)  # before any page is touched: the faults then take 2 MiB pages
    whole = torch.frombuffer(mapping, dtype=torch.uint8)
    start = -whole.data_ptr() % HUGE_PAGE
    return whole[start:start + nbytes]


def huge_page_bytes(address: int) -> int | None:
    """Bytes of the mapping holding ``address`` that sit on transparent huge pages
    (``/proc/self/smaps``'s AnonHugePages), or None where the kernel does not say."""
    try:
        lines = Path("/proc/self/smaps").read_text().splitlines()
    except OSError:
        return None
    inside = False
    for line in lines:
        span = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
        if span:
            inside = int(span.group(1), 16) <= address < int(span.group(2), 16)
        elif inside and line.startswith("AnonHugePages:"):
            return int(line.split()[1]) * 1024
    return None


@dataclass(frozen=True)
class Moved:
    """What :func:`move_to_huge_pages` did: ``bytes`` copied into a mapping that asked for 2 MiB
    pages, ``huge_bytes`` of it on them by the kernel's own count (None where it does not say), and
    why nothing moved when ``bytes`` is 0."""

    bytes: int
    huge_bytes: int | None
    why_not: str = ""


def _movable(t: torch.Tensor) -> bool:
    return (t.device.type == "cpu" and t.layout == torch.strided and not t.is_mkldnn and not t.is_meta
            and t.untyped_storage().nbytes() >= MIN_BYTES)


@torch.no_grad()
def move_to_huge_pages(tensors: list[torch.Tensor]) -> Moved:
    """Copy the storages of ``tensors`` (those of at least :data:`MIN_BYTES` on the CPU, in a plain
    layout) into one mapping on 2 MiB pages and point every tensor at its copy, views and shared
    storages included. The old storages are freed when nothing else holds them."""
    mode = transparent_huge_pages()
    if mode not in ("always", "madvise"):
        return Moved(0, None, f"transparent huge pages are {mode}")
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return Moved(0, None, "this Python cannot ask for huge pages (no mmap.MADV_HUGEPAGE)")
    by_storage: dict[int, list[torch.Tensor]] = {}
    for t in {id(t): t for t in tensors}.values():  # a tensor listed twice (a shared module) moves once
        if _movable(t):
            by_storage.setdefault(t.untyped_storage().data_ptr(), []).append(t)
    if not by_storage:
        return Moved(0, None, "no tensor of 64 KiB or more")
    # Storages starting at one address may differ in length (a view's own storage object): the
    # longest is copied.
    longest = {ptr: max((t.untyped_storage() for t in group), key=lambda s: s.nbytes())
               for ptr, group in by_storage.items()}
    offsets, total = {}, 0
    for ptr, storage in longest.items():
        offsets[ptr] = total
        total += -(-storage.nbytes() // _ALIGN) * _ALIGN
    buffer = huge_page_buffer(total)
    new = buffer.untyped_storage()
    base = buffer.data_ptr() - new.data_ptr()  # the buffer's byte offset in its mapping
    released = 0
    for ptr, group in by_storage.items():
        storage = longest.pop(ptr)
        start, size = offsets[ptr], storage.nbytes()
        buffer[start:start + size].copy_(torch.empty(0, dtype=torch.uint8).set_(storage, 0, (size,), (1,)))
        for t in group:
            t.set_(new, (base + start) // t.element_size() + t.storage_offset(), t.size(), t.stride())
        del storage  # the last reference to the old storage here: freed unless someone else holds it
        # The heap keeps freed memory resident (heap.py raised its thresholds): handed back as the
        # copy grows, so the move needs the weights plus TRIM_EVERY, not twice the weights.
        released += size
        if released >= TRIM_EVERY:
            release_free_heap()
            released = 0
    release_free_heap()
    on_huge = huge_page_bytes(buffer.data_ptr())  # the mapping's count: its unused tail too
    return Moved(total, None if on_huge is None else min(on_huge, total))


def move_model_to_huge_pages(model: torch.nn.Module) -> Moved:
    """:func:`move_to_huge_pages` over the model's parameters and buffers (every layer registers its
    weights as one or the other: GGUF blocks, packed tiles), logged in one line: what moved and how
    much of it the kernel put on 2 MiB pages."""
    tensors = [t for _, t in model.named_parameters(remove_duplicate=False)]
    tensors += [t for _, t in model.named_buffers(remove_duplicate=False) if t is not None]
    moved = move_to_huge_pages(tensors)
    if moved.bytes == 0:
        logger.info("weights stay on the default pages: %s", moved.why_not)
    else:
        on = "an unknown share" if moved.huge_bytes is None else f"{moved.huge_bytes / 2**20:.0f} MiB"
        logger.info("weights on 2 MiB pages: %.0f MiB moved into a MADV_HUGEPAGE mapping, %s of it on huge pages "
                    "(a decode step streams them with fewer TLB misses)", moved.bytes / 2**20, on)
    return moved
