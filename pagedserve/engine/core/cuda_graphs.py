"""Decode steps under CUDA graphs: the model's forward for a batch of one-token sequences, captured
once per padded batch size and replayed.

A decode step of a small model is hundreds of short kernels; launched one by one from Python,
their launch cost (a few microseconds each, plus the Python between them) exceeds the GPU's work
at small batches. A captured graph replays the whole forward with one launch. A graph fixes its
tensors' addresses and shapes, so:

* the inputs live in persistent buffers (:class:`DecodeBuffers`) sized for the largest captured
  batch; each step copies its rows in and pads the rest: padding rows write no KV (slot -1) and
  attend to nothing (context length 0), which the triton backend's kernels honour;
* the block tables are as wide as ``max_model_len`` needs, and the decode kernel's split-K grid
  follows the width (never the contexts on the device), so one graph serves every context length;
* a batch is padded up to the next captured size (:func:`graph_batch_sizes`): 1, 2, 4, 8, then
  every 8, vLLM's ladder, so padding wastes at most 7 rows where it matters little.

Only plain decode batches replay (speculative verification rows are one-token rows too, so they
do); a step with a prompt chunk, or more rows than the largest graph, runs eagerly. Graphs are
captured for the triton backend only: the others gather a step's blocks into tensors whose shapes
follow the batch's longest context.
"""

from __future__ import annotations

import bisect
import logging
import time

import torch

from pagedserve.config import EngineConfig
from pagedserve.engine.core.runner import ModelInput
from pagedserve.models.attention import AttentionMetadata
from pagedserve.models.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)

PAD_SLOT = -1  # a padding row's slot: the KV write skips it


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """The decode batch sizes captured: 1, 2, 4, 8, then multiples of 8, up to ``max_num_seqs``
    (which is always included, so every batch the scheduler can form has a graph)."""
    return [s for s in (1, 2, 4) if s < max_num_seqs] + list(range(8, max_num_seqs, 8)) + [max_num_seqs]


def padded_batch_size(rows: int, sizes: list[int]) -> int | None:
    """The smallest captured size that holds ``rows`` rows, or ``None`` if none does."""
    i = bisect.bisect_left(sizes, rows)
    return sizes[i] if i < len(sizes) else None


class DecodeBuffers:
    """The persistent inputs of the captured decode graphs, filled in place every step: every batch
    size reads a prefix of the same buffers, through the same views each time (:meth:`inputs`)."""

    def __init__(self, max_batch: int, max_blocks: int, device: torch.device):
        self.max_batch, self.max_blocks = max_batch, max_blocks
        self.input_ids = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((max_batch,), PAD_SLOT, dtype=torch.long, device=device)
        self.block_tables = torch.zeros(max_batch, max_blocks, dtype=torch.long, device=device)
        self.context_lens = torch.zeros(max_batch, dtype=torch.long, device=device)
        self._views: dict[int, tuple[torch.Tensor, torch.Tensor, AttentionMetadata]] = {}

    def inputs(self, size: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """The model's inputs for a batch of ``size`` rows: views of the buffers, the same each call."""
        if size not in self._views:
            meta = AttentionMetadata(slot_mapping=self.slot_mapping[:size], num_decodes=size,
                                     decode_block_tables=self.block_tables[:size],
                                     decode_context_lens=self.context_lens[:size], decode_mask=None, prefills=[])
            self._views[size] = (self.input_ids[:size], self.positions[:size], meta)
        return self._views[size]

    def load(self, model_input: ModelInput, size: int) -> None:
        """Copy a decode batch's rows into the buffers and pad them to ``size`` rows.

        Table columns past the batch's width keep stale block ids: no kernel reads them, since
        every read stops at the row's context length."""
        meta = model_input.meta
        rows, width = meta.decode_block_tables.shape
        if rows > size or size > self.max_batch or width > self.max_blocks:
            raise ValueError(f"a decode batch of {rows} rows × {width} blocks does not fit buffers of "
                             f"{self.max_batch} rows × {self.max_blocks} blocks padded to {size}")
        self.input_ids[:rows].copy_(model_input.input_ids)
        self.positions[:rows].copy_(model_input.positions)
        self.slot_mapping[:rows].copy_(meta.slot_mapping)
        self.block_tables[:rows, :width].copy_(meta.decode_block_tables)
        self.context_lens[:rows].copy_(meta.decode_context_lens)
        self.pad(rows, size)

    def pad(self, start: int, end: int) -> None:
        """Rows ``start..end`` become padding: token 0 at position 0, no KV written, nothing attended."""
        self.input_ids[start:end] = 0
        self.positions[start:end] = 0
        self.slot_mapping[start:end] = PAD_SLOT
        self.context_lens[start:end] = 0


class CudaGraphDecoder:
    """Captures the model's decode forward for each size of :func:`graph_batch_sizes` (on construction)
    and replays the one that fits a step."""

    def __init__(self, model: LlamaForCausalLM, kv_caches, c: EngineConfig, device: torch.device):
        self.model, self.kv_caches = model, kv_caches
        self.sizes = graph_batch_sizes(c.max_num_seqs)
        self.buffers = DecodeBuffers(self.sizes[-1], -(-c.max_model_len // c.block_size), device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.capture()

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size, largest first, all in one memory pool (the smaller graphs' buffers fit in
        what the largest one reserved). Each size runs once eagerly first: the kernels compile and
        autotune outside the capture."""
        t0 = time.monotonic()
        before = torch.cuda.memory_reserved()
        pool = None
        for size in reversed(self.sizes):
            ids, positions, meta = self.buffers.inputs(size)
            self.buffers.pad(0, size)
            self.model(ids, positions, self.kv_caches, meta)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                hidden = self.model(ids, positions, self.kv_caches, meta)
            pool = graph.pool()
            self.graphs[size] = (graph, hidden)
        torch.cuda.synchronize()
        logger.info("captured %d decode CUDA graphs (batch sizes %s) in %.1fs, %.0f MiB", len(self.graphs),
                    ",".join(map(str, self.sizes)), time.monotonic() - t0,
                    (torch.cuda.memory_reserved() - before) / 2**20)

    def run(self, model_input: ModelInput) -> torch.Tensor | None:
        """The hidden states of a decode-only step, by replaying its padded size's graph; ``None`` for a
        step no graph covers (a prompt chunk in it, or more rows than the largest graph)."""
        meta = model_input.meta
        if meta.prefills or not meta.num_decodes:
            return None
        size = padded_batch_size(meta.num_decodes, self.sizes)
        if size is None or size not in self.graphs:
            return None
        self.buffers.load(model_input, size)
        graph, hidden = self.graphs[size]
        graph.replay()
        return hidden[:meta.num_decodes]
