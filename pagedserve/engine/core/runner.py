"""The scheduler's plan → flat tensors → model → logits for the rows that sample.

The batch is flat (no padding): one-token sequences (decodes) first, then prompt chunks.
``positions`` and ``slot_mapping`` are computed with tensor ops over the whole batch, never a
Python loop per token: ``slot = block_table[seq, pos // block_size] * block_size + pos % block_size``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from pagedserve.engine.core.scheduler import SchedulerOutput
from pagedserve.engine.core.sequence import Sequence
from pagedserve.kv.block_manager import BlockManager
from pagedserve.models.attention import AttentionMetadata
from pagedserve.models.llama import LlamaForCausalLM

if TYPE_CHECKING:  # engine/core/cuda_graphs.py builds on this module's ModelInput
    from pagedserve.engine.core.cuda_graphs import CudaGraphDecoder


@dataclass
class ModelInput:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata | list[AttentionMetadata]  # a list: one per KV group (kv/groups.py)
    # Rows of the flat batch whose logits are sampled; None: every row, in order (a decode step's).
    sample_indices: torch.Tensor | None
    sampled_seqs: list[Sequence]  # in the order of sample_indices (1 + k rows for one verifying k drafts)
    # Prompt logprobs (only requests that ask for them): (sequence, first prompt position, count)
    # per span, and the flat-batch rows of those positions, in span order.
    prompt_spans: list[tuple[Sequence, int, int]] | None = None
    prompt_rows: torch.Tensor | None = None
    prompt_hidden: torch.Tensor | None = None  # filled by execute: the hidden states of prompt_rows


def _pad_tables(tables: list[list[int]], width: int | None = None) -> torch.Tensor:
    """``[rows, width]`` block ids, each table cut or padded with block 0 to ``width`` (default: the longest)."""
    width = max(len(t) for t in tables) if width is None else width
    return torch.tensor([t[:width] + [0] * (width - len(t)) for t in tables], dtype=torch.long)


def _decode_mask(context_lens: torch.Tensor, slots: int) -> torch.Tensor:
    """``[rows, 1, 1, slots]``: which of a decode row's table slots hold its context."""
    return (torch.arange(slots) < context_lens.unsqueeze(1))[:, None, None, :]


def _prompt_logprob_rows(rows: list[tuple[Sequence, int, int]], query_starts: torch.Tensor
                         ) -> tuple[list[tuple[Sequence, int, int]], list[int]]:
    """Which rows of the flat batch give prompt logprobs still missing (``rows``: (sequence, first
    position, query tokens) per row of the batch).

    The logits at prompt position ``q`` give the logprob of prompt token ``q + 1``; a request that
    has entries for tokens ``0..c-1`` needs positions ``c-1 .. P-2`` (``P`` prompt tokens), of
    which this step's chunk ``[s, s + n)`` covers some. A plain Python loop over the few
    sequences that ask; the rest cost one attribute test each.
    """
    spans: list[tuple[Sequence, int, int]] = []
    flat: list[int] = []
    for i, (seq, s, n) in enumerate(rows):
        have = seq.request.prompt_logprobs
        if have is None or len(have) >= seq.num_prompt_tokens:
            continue
        q_start = int(query_starts[i])
        if s > len(have) - 1:  # cannot happen (such requests skip the prefix cache); never leave a gap
            continue
        first, end = max(s, len(have) - 1), min(s + n, seq.num_prompt_tokens - 1)
        if first < end:
            spans.append((seq, first, end - first))
            flat.extend(range(q_start + first - s, q_start + end - s))
    return spans, flat


class ModelRunner:
    """Owns the model and the KV cache tensors; executes one scheduled step."""

    def __init__(self, model: LlamaForCausalLM, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 block_manager: BlockManager, device: torch.device, decode_graphs: CudaGraphDecoder | None = None):
        """``decode_graphs``: captured CUDA graphs that decode-only steps replay (CUDA, triton backend)."""
        self.model = model
        self.kv_caches = kv_caches
        self.block_manager = block_manager
        self.block_size = block_manager.block_size
        self.device = device
        self.decode_graphs = decode_graphs

    def prepare(self, out: SchedulerOutput) -> ModelInput:
        """Flatten the plan into the model's inputs.

        A decode verifying ``k`` drafts becomes ``k + 1`` one-token rows of the decode batch, at
        consecutive positions with the same block table: row ``j`` attends to the context up to
        and including its own position (all ``k + 1`` tokens' K/V are written before attention),
        which is the causal mask of a ``k + 1``-token chunk, computed by the fast decode kernel.
        """
        seqs = [seq for seq, n in out.scheduled
                if n == 1 and not seq.draft_token_ids and seq.num_computed_tokens + 1 == seq.num_tokens]
        return self._prepare_decodes(seqs) if len(seqs) == len(out.scheduled) else self._prepare_any(out)

    def _prepare_any(self, out: SchedulerOutput) -> ModelInput:
        """:meth:`prepare` of any plan: prompt chunks, decodes, drafts, prompt logprobs."""
        # One entry per row: (sequence, first position, query tokens); one-token rows first.
        rows: list[tuple[Sequence, int, int]] = []
        input_ids: list[int] = []
        chunks = []
        for seq, n in out.scheduled:
            start = seq.num_computed_tokens
            if seq.draft_token_ids or n == 1:  # a decode, verifying its drafts if it has any
                ids = [seq.token_ids[start]] + seq.draft_token_ids
                rows.extend((seq, start + j, 1) for j in range(len(ids)))
                input_ids.extend(ids)
            else:
                chunks.append((seq, start, n))
        num_decodes = len(rows)
        rows += chunks
        input_ids += [t for seq, start, n in chunks for t in seq.token_ids[start:start + n]]
        seqs = [s for s, _, _ in rows]
        starts = torch.tensor([p for _, p, _ in rows], dtype=torch.long)
        lens = torch.tensor([n for _, _, n in rows], dtype=torch.long)
        total = len(input_ids)
        # Built in Python, not by torch.repeat_interleave: that op always opens an OpenMP region, whose
        # worker then spins on the core the decode stack's pool thread needs (kernels/work_pool.h).
        seq_of_token = torch.tensor([i for i, (_, _, n) in enumerate(rows) for _ in range(n)], dtype=torch.long)
        query_starts = torch.cumsum(lens, 0) - lens
        positions = starts[seq_of_token] + torch.arange(total) - query_starts[seq_of_token]
        context_lens = starts + lens
        meta = self._per_group([self._metadata(_pad_tables(ids), seq_of_token, positions, query_starts, lens,
                                               context_lens, num_decodes) for ids in self._block_ids(seqs)])

        # Rows that sample: the one that reaches a sequence's last token; every row verifying drafts.
        sampled = [i for i, (s, p, n) in enumerate(rows) if s.draft_token_ids or p + n == s.num_tokens]
        # Every row samples in a decode step: no index then, since torch's opens an OpenMP region even
        # for 16 rows of 576 values (its worker then spins on the decode stack's pool core).
        sample_indices = None if len(sampled) == total else (query_starts + lens - 1)[sampled].to(self.device)
        sampled_seqs = [seqs[i] for i in sampled if not (i and seqs[i - 1] is seqs[i])]  # 1 + k rows: once
        spans, prompt_rows = _prompt_logprob_rows(rows, query_starts)
        dev = self.device
        return ModelInput(torch.tensor(input_ids, dtype=torch.long, device=dev), positions.to(dev), meta,
                          sample_indices, sampled_seqs, spans or None,
                          torch.tensor(prompt_rows, dtype=torch.long, device=dev) if prompt_rows else None)

    def _prepare_decodes(self, seqs: list[Sequence]) -> ModelInput:
        """:meth:`prepare` of a step of plain decodes (each sequence's one new token, no drafts, every
        row sampled): the same inputs, from Python lists in a few tensor calls. A step's Python runs
        with its caches cold (the weights just streamed through them), where each torch op cost ~10
        µs: the general path's ~30 took 0.29 ms of a 5.5 ms step on the default model (this: 0.13-0.16)."""
        bs, dev = self.block_size, self.device
        positions = [s.num_computed_tokens for s in seqs]
        width = -(-(max(positions) + 1) // bs)  # blocks of the longest context
        context_lens = torch.tensor(positions, dtype=torch.long) + 1
        metas = []
        for ids in self._block_ids(seqs):
            slots = [t[p // bs] * bs + p % bs for t, p in zip(ids, positions)]
            metas.append(AttentionMetadata(
                slot_mapping=torch.tensor(slots, dtype=torch.long).to(dev), num_decodes=len(seqs),
                decode_block_tables=_pad_tables(ids, width).to(dev), decode_context_lens=context_lens.to(dev),
                decode_mask=_decode_mask(context_lens, width * bs).to(dev), prefills=[]))
        input_ids = torch.tensor([s.token_ids[p] for s, p in zip(seqs, positions)], dtype=torch.long, device=dev)
        return ModelInput(input_ids, torch.tensor(positions, dtype=torch.long, device=dev), self._per_group(metas),
                          None, seqs)

    def _block_ids(self, seqs: list[Sequence]) -> list[list[list[int]]]:
        """Each sequence's block ids, per KV group (kv/groups.py: each group its own tables), or in the
        one table set (a list of one)."""
        bm = self.block_manager
        if not hasattr(bm, "groups"):
            return [[bm.block_ids(s.seq_id) for s in seqs]]
        return [[bm.block_ids(s.seq_id, g) for s in seqs] for g in range(len(bm.groups))]

    def _per_group(self, metas: list[AttentionMetadata]) -> AttentionMetadata | list[AttentionMetadata]:
        """One metadata per KV group, or the one of a manager without groups."""
        return metas if hasattr(self.block_manager, "groups") else metas[0]

    def _metadata(self, tables: torch.Tensor, seq_of_token: torch.Tensor, positions: torch.Tensor,
                  query_starts: torch.Tensor, lens: torch.Tensor, context_lens: torch.Tensor,
                  num_decodes: int) -> AttentionMetadata:
        """Slots and attention inputs through one set of block tables (``[rows, blocks]``)."""
        slot_mapping = (tables[seq_of_token, positions // self.block_size] * self.block_size
                        + positions % self.block_size)
        decode_tables = tables[:num_decodes]
        decode_mask = None
        if num_decodes:
            max_blocks = int((context_lens[:num_decodes].max() + self.block_size - 1) // self.block_size)
            # contiguous once here, not in every layer's attention call (the fused kernel needs it)
            decode_tables = decode_tables[:, :max_blocks].contiguous()
            decode_mask = _decode_mask(context_lens[:num_decodes], max_blocks * self.block_size)
        prefills = []
        for i in range(num_decodes, len(lens)):
            ctx = int(context_lens[i])
            prefills.append((int(query_starts[i]), int(lens[i]), ctx,
                             tables[i, :(ctx + self.block_size - 1) // self.block_size].to(self.device)))
        dev = self.device
        return AttentionMetadata(slot_mapping=slot_mapping.to(dev), num_decodes=num_decodes,
                                 decode_block_tables=decode_tables.to(dev),
                                 decode_context_lens=context_lens[:num_decodes].to(dev),
                                 decode_mask=None if decode_mask is None else decode_mask.to(dev), prefills=prefills)

    @torch.inference_mode()
    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Run the plan's copy-on-write copies (``(src, dst)`` blocks), before its model pass."""
        src = torch.tensor([c[0] for c in copies], device=self.device)
        dst = torch.tensor([c[1] for c in copies], device=self.device)
        for k_cache, v_cache in self.kv_caches:
            k_cache[dst] = k_cache[src]
            v_cache[dst] = v_cache[src]

    def screens_head(self, rows: int) -> bool:
        """Whether the model's LM head takes a greedy step of ``rows`` sampled rows through its
        screen (models/head_screen.py), given that the step needs only the argmax."""
        screen = self.model.head_screen
        return screen is not None and screen.takes(rows)

    @torch.inference_mode()
    def execute(self, model_input: ModelInput, argmax_only: bool = False) -> torch.Tensor:
        """Run the model; float32 logits for the sampled rows (``argmax_only``: every row is plain
        greedy, so the logits need only keep the argmax: ``compute_logits``)."""
        hidden = self.decode_graphs.run(model_input) if self.decode_graphs is not None else None
        if hidden is None:  # no graph for this step (a prompt chunk in it, or none captured): eager
            hidden = self.model(model_input.input_ids, model_input.positions, self.kv_caches, model_input.meta)
        if model_input.prompt_rows is not None:
            model_input.prompt_hidden = hidden[model_input.prompt_rows]
        rows = model_input.sample_indices
        return self.model.compute_logits(hidden if rows is None else hidden[rows], argmax_only)

    @torch.inference_mode()
    def prompt_logits(self, model_input: ModelInput, start: int, count: int) -> torch.Tensor:
        """Float32 logits of ``count`` of the step's prompt-logprob rows from ``start`` (after execute)."""
        assert model_input.prompt_hidden is not None
        return self.model.compute_logits(model_input.prompt_hidden[start:start + count])
