"""The per-group KV arithmetic of sliding-window layers (kv/sizing.py), the planner's figures for
Gemma 3: a window layer keeps at most ceil((window - 1) / block) + 1 blocks, a global layer all."""

from __future__ import annotations

import pytest

from pagedserve.kv.sizing import SizingError, hybrid_kv_bytes_per_sequence, kv_pool_bytes_per_token, window_blocks


def _blocks_a_window_straddles(context_len: int, window: int, block: int) -> int:
    """Blocks holding positions the next query (at ``context_len``) sees or writes, counted one by one."""
    first = max(0, context_len - window + 1)
    return len({p // block for p in range(first, context_len + 1)})


@pytest.mark.parametrize("window,block", [(512, 16), (5, 4), (8, 4), (1, 16)])
def test_window_blocks_is_the_most_any_position_needs(window, block):
    worst = max(_blocks_a_window_straddles(n, window, block) for n in range(0, 4 * window + 3 * block))
    assert window_blocks(window, block) == worst


def test_gemma3_270m_seats_at_4000_tokens():
    """18 layers, 1 KV head of 256 dims in bf16: 1,024 B per layer-token. At 4,000 tokens, freeing
    the 15 window layers' old blocks takes the sequence from 4,500 layer-blocks to 1,245: 3.6x."""
    layer_bpt = kv_pool_bytes_per_token(1, 1, 256, "bf16")
    assert layer_bpt == 1024
    full = hybrid_kv_bytes_per_sequence(4000, 16, layer_bpt, 3, {512: 15}, free_window_blocks=False)
    freed = hybrid_kv_bytes_per_sequence(4000, 16, layer_bpt, 3, {512: 15})
    assert full == 18 * 250 * 16 * 1024 == kv_pool_bytes_per_token(18, 1, 256, "bf16") * 4000
    assert freed == (3 * 250 + 15 * 33) * 16 * 1024
    assert full / freed == pytest.approx(3.61, abs=0.01)
    budget = 1 << 30
    assert (budget // full, budget // freed) == (14, 52)
    # below the window, freeing changes nothing
    assert hybrid_kv_bytes_per_sequence(300, 16, layer_bpt, 3, {512: 15}) == kv_pool_bytes_per_token(18, 1, 256,
                                                                                                        "bf16") * 304


def test_bad_input_is_a_sizing_error():
    with pytest.raises(SizingError):
        window_blocks(0, 16)
    with pytest.raises(SizingError):
        hybrid_kv_bytes_per_sequence(-1, 16, 1024, 3, {512: 15})
