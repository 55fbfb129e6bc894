"""Sliding-window attention (Gemma 3's local layers): every backend, through ``window_view``,
against dense attention with the window mask written out (a query at p sees keys in (p - window, p])."""

from __future__ import annotations

import pytest
import torch

from pagedserve.models.attention import ATTENTION_BACKENDS, window_view
from tests.helpers.paged_inputs import head_major, paged_batch

BLOCK = 4


def _dense_windowed(q, k_cache, v_cache, meta, scale, window):
    """Each sequence's context gathered whole, masked causally and by the window, in float64."""
    out = torch.empty(q.shape, dtype=torch.float64)
    seqs = [(i, 1, int(meta.decode_context_lens[i]), meta.decode_block_tables[i]) for i in range(meta.num_decodes)]
    for start, q_len, ctx, table in seqs + meta.prefills:
        k = k_cache[table].flatten(0, 1)[:ctx].double()
        v = v_cache[table].flatten(0, 1)[:ctx].double()
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        s = torch.einsum("qhd,khd->hqk", q[start:start + q_len].double(), k) * scale
        q_pos = torch.arange(ctx - q_len, ctx)[:, None]
        k_pos = torch.arange(ctx)[None]
        s = s.masked_fill((k_pos > q_pos) | (k_pos <= q_pos - window), float("-inf"))
        out[start:start + q_len] = torch.einsum("hqk,khd->qhd", s.softmax(-1), v)
    return out


@pytest.mark.parametrize("backend", sorted(ATTENTION_BACKENDS))
@pytest.mark.parametrize("window", [5, 8, 13])
def test_every_backend_masks_by_the_window(backend, window):
    """Decodes shorter and longer than the window, window edges in and off block boundaries, and
    prompt chunks that start before, inside and past it: the same output as the dense mask."""
    q, k, v, meta = paged_batch([3, 9, 17, 40], [(6, 6), (5, 30), (20, 26), (1, 44)], block_size=BLOCK)
    want = _dense_windowed(q, k, v, meta, 0.3, window)
    view = window_view(meta, window, BLOCK)
    pools = (k, v) if backend == "reference" else (head_major(k), head_major(v))
    got = ATTENTION_BACKENDS[backend](q, *pools, view, 0.3)
    assert torch.allclose(got.double(), want, atol=1e-5)
    # the view's decodes read only the blocks that cover their window
    assert view.decode_block_tables.shape[1] <= -(-window // BLOCK) + 1


@pytest.mark.parametrize("backend", ["matmul", "fused"])
@pytest.mark.parametrize("window", [None, 13])
def test_a_chunk_too_large_for_one_score_matrix_is_taken_in_query_blocks(backend, window, monkeypatch):
    """With the score-matrix cap lowered, chunks of 20 and 40 queries (after a context of 6, and from
    the start) go through the blocked path: 16 queries a block, each against the keys its last one
    sees, windowed or not; the same output as the dense mask (formerly they went through SDPA)."""
    import pagedserve.models.attention as attention

    q, k, v, meta = paged_batch([3], [(20, 26), (40, 40)], block_size=BLOCK)
    calls = []
    gemms = attention._prefill_gemms
    monkeypatch.setattr(attention, "_MATMUL_PREFILL_MAX_SCORES", q.shape[1] * 16 * 16)
    monkeypatch.setattr(attention, "_prefill_sdpa", lambda *a, **k: pytest.fail("SDPA taken"))
    monkeypatch.setattr(attention, "_prefill_gemms", lambda qs, *a: calls.append(qs.shape[1]) or gemms(qs, *a))
    want = _dense_windowed(q, k, v, meta, 0.3, window if window is not None else 10**6)
    view = meta if window is None else window_view(meta, window, BLOCK)
    got = ATTENTION_BACKENDS[backend](q, head_major(k), head_major(v), view, 0.3)
    assert torch.allclose(got.double(), want, atol=1e-5)
    assert 16 in calls  # blocks of 16 queries ran


def test_a_window_wider_than_every_context_changes_nothing():
    q, k, v, meta = paged_batch([3, 9], [(6, 10)], block_size=BLOCK)
    plain = ATTENTION_BACKENDS["reference"](q, k, v, meta, 0.3)
    assert torch.allclose(ATTENTION_BACKENDS["reference"](q, k, v, window_view(meta, 64, BLOCK), 0.3), plain,
                          atol=1e-6)
