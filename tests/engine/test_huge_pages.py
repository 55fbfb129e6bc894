"""Weights moved onto 2 MiB pages (engine/core/huge_pages.py): the same values and tensor objects,
views and shared storages kept together, small and opaque tensors left alone, and, where the
kernel's transparent huge pages are on, the copy really on 2 MiB pages by /proc's own count."""

from __future__ import annotations

import json
import logging
import platform
import subprocess
import sys

import pytest
import torch
from torch import nn

from pagedserve.engine.core.huge_pages import (HUGE_PAGE, MIN_BYTES, huge_page_buffer, move_model_to_huge_pages,
                                               move_to_huge_pages, transparent_huge_pages)

THP_ON = transparent_huge_pages() in ("always", "madvise")


class Toy(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.weight = nn.Parameter(torch.randn(1024, 1024), requires_grad=False)  # 4 MiB float32
        self.register_buffer("blocks", torch.randint(0, 255, (3000, 360), dtype=torch.uint8))  # ~1 MiB
        self.register_buffer("halves", torch.randn(512, 256).to(torch.bfloat16))  # 256 KiB
        self.register_buffer("norm", torch.randn(576))  # 2 KiB: stays


def test_buffer_starts_on_a_huge_page_boundary():
    b = huge_page_buffer(3 * HUGE_PAGE + 5)
    assert b.numel() == 3 * HUGE_PAGE + 5 and b.data_ptr() % HUGE_PAGE == 0
    assert int(b.sum()) == 0  # fresh anonymous memory reads as zeros


@pytest.mark.skipif(not THP_ON, reason=f"transparent huge pages are {transparent_huge_pages()}")
def test_tensors_keep_values_views_and_identity_and_land_on_huge_pages():
    model = Toy()
    view = model.weight[10:20, 5:]  # a view of a moved storage: follows it
    before = {n: t.clone() for n, t in list(model.named_parameters()) + list(model.named_buffers())}
    norm_ptr, weight_obj = model.norm.data_ptr(), model.weight
    moved = move_to_huge_pages([*model.parameters(), *model.buffers(), model.weight, view])  # weight twice: once
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        assert torch.equal(t, before[name]), name
    assert model.weight is weight_obj and isinstance(model.weight, nn.Parameter)
    storages = {t.untyped_storage().data_ptr() for t in (model.weight, model.blocks, model.halves, view)}
    assert len(storages) == 1  # one mapping holds every moved storage
    assert model.norm.data_ptr() == norm_ptr  # under MIN_BYTES: left where it was
    view.fill_(7.0)  # the view still shares the weight's (new) storage
    assert (model.weight[10:20, 5:] == 7.0).all()
    sizes = [1024 * 1024 * 4, 3000 * 360, 512 * 256 * 2]
    assert moved.bytes == sum(-(-s // 64) * 64 for s in sizes) and model.norm.untyped_storage().nbytes() < MIN_BYTES
    assert moved.huge_bytes is not None and moved.huge_bytes >= 2 * HUGE_PAGE  # by /proc/self/smaps


def test_nothing_to_move_says_why():
    moved = move_to_huge_pages([torch.randn(10), torch.empty(0, device="meta")])
    assert moved.bytes == 0 and moved.why_not
    if THP_ON:
        assert "64 KiB" in moved.why_not
    else:
        assert transparent_huge_pages() in moved.why_not


def test_the_log_line_says_what_moved(caplog):
    with caplog.at_level(logging.INFO, logger="pagedserve.engine.core.huge_pages"):
        moved = move_model_to_huge_pages(Toy())
    line = caplog.records[-1].getMessage()
    if THP_ON:
        assert moved.bytes > 5 << 20 and line.startswith("weights on 2 MiB pages: 5 MiB moved")
    else:
        assert moved.bytes == 0 and line.startswith("weights stay on the default pages")


# In a fresh interpreter with the engine's heap settings: 512 MiB of heap-allocated tensors moved;
# resident memory before, at its peak during the move (VmHWM, reset just before) and after, in MiB.
_MOVE = """
import json, torch
from pagedserve.engine.core.heap import keep_step_memory
from pagedserve.engine.core.huge_pages import move_to_huge_pages
keep_step_memory()
def status(key):
    return int(next(l for l in open('/proc/self/status') if l.startswith(key)).split()[1]) // 1024
tensors = [torch.full((64 << 20,), i, dtype=torch.uint8) for i in range(8)]
before = status('VmRSS')
open('/proc/self/clear_refs', 'w').write('5')  # the peak counter starts again from here
moved = move_to_huge_pages(tensors)
print(json.dumps({'before': before, 'peak': status('VmHWM'), 'after': status('VmRSS'), 'moved': moved.bytes >> 20,
                  'same': all(bool((t == i).all()) for i, t in enumerate(tensors))}))
"""


@pytest.mark.skipif(not THP_ON or platform.libc_ver()[0] != "glibc", reason="huge pages off, or not glibc's heap")
def test_the_move_hands_the_old_copies_back_as_it_goes():
    """The heap keeps freed memory resident (engine/core/heap.py): without handing it back the move
    would hold the weights twice, at its peak and after."""
    out = subprocess.run([sys.executable, "-c", _MOVE], capture_output=True, text=True, timeout=120, check=True)
    m = json.loads(out.stdout.strip().splitlines()[-1])
    assert m["moved"] == 512 and m["same"], m
    assert m["after"] - m["before"] < 64, m  # the old copies went back to the kernel
    assert m["peak"] - m["before"] < 256 + 64 + 64, m  # weights plus TRIM_EVERY and one tensor, not twice
