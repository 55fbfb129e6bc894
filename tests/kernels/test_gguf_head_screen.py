"""A GGUF Q8_0 LM head's screen (``kernels/gguf_head_screen.cpp``, ``GGUFHeadScreen`` in
``models/head_screen.py``) and the pairs entry point it computes its candidates with
(``gguf_matmul16_pairs``), on every instruction-set path this CPU runs, the scalar one always.

What it must keep: the full int16 head's argmax, ties going to the lowest index, and for every row
it computes the full head's value to the bit (``gguf_matmul16`` at int16 activations, the head's own
kernel); every other logit -inf. And it must screen: on hidden states near a few weight rows, most
groups are left out (else it would cost the int8 pass on top of the head)."""

from __future__ import annotations

import pytest
import torch

from pagedserve.bench.gguf_kernels import random_gguf_rows
from pagedserve.kernels import isa_paths, kernel_error, native_ops
from pagedserve.models.gguf_linear import ROWS16_FORMATS, GGUFLinear, rows16_layout
from pagedserve.models.head_screen import GGUF_SCREEN_MIN_ROWS, GGUFHeadScreen, build_head_screen

OPS = native_ops()
pytestmark = pytest.mark.skipif(OPS is None, reason=f"native kernels unavailable: {kernel_error()}")
PATHS = isa_paths()
NEG_INF = float("-inf")


def _head(w: torch.Tensor, K: int, **kwargs) -> GGUFLinear:
    """A Q8_0 LM head as the loader makes one: rows16, int16 activations, float32 logits."""
    head = GGUFLinear([("Q8_0", w)], K, None, OPS, rows16=True, **kwargs)
    head.residual = head.float_output = True
    return head


def _full(head: GGUFLinear, h: torch.Tensor, isa: str) -> torch.Tensor:
    out = torch.empty(h.shape[0], head.out_features)
    OPS.gguf_matmul16(out, h, head.weight0, "Q8_0", None, True, isa)
    return out


class _HeadOnly(torch.nn.Module):
    """What build_head_screen reads of a model: its LM head (no tied table)."""

    def __init__(self, head):
        super().__init__()
        self.lm_head, self.embed_tokens = head, None


def _check(got: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """The screen's promises against the full head's logits; which entries it computed."""
    kept = got != NEG_INF
    assert torch.equal(got[kept], full[kept]), "a computed row differs from the head's value"
    assert torch.equal(got.argmax(dim=1), full.argmax(dim=1))
    whole = kept[:, :kept.shape[1] // 16 * 16].view(kept.shape[0], -1, 16)
    assert torch.equal(whole.all(-1), whole.any(-1)), "a group computed in part"
    return kept


@pytest.mark.parametrize("isa", PATHS)
@pytest.mark.parametrize("rows", [GGUF_SCREEN_MIN_ROWS, 9, 16])
def test_the_int16_heads_argmax_and_values_from_few_groups(isa, rows):
    """Hidden states near a weight row each (the shape of a confident next token), N not a multiple
    of 16: the full head's argmax and values, and most groups left out."""
    N, K = 4099, 576
    w = random_gguf_rows("Q8_0", N, K, seed=rows)
    head = _head(w, K)
    screen = GGUFHeadScreen(head, OPS)
    weights = head.dequantized_weight(torch.float32)
    g = torch.Generator().manual_seed(rows)
    h = (3 * weights[torch.randint(0, N, (rows,), generator=g)] + 0.3 * torch.randn(rows, K, generator=g))
    h = h.to(torch.bfloat16)
    got = OPS.gguf_screened_logits16(h, screen.weight, "Q8_0", screen.row_norms, isa)
    kept = _check(got, _full(head, h, isa))
    assert kept.sum(dim=1).max() <= N // 4, "the screen kept most of the head"


@pytest.mark.parametrize("isa", PATHS)
def test_tied_rows_are_all_computed_and_the_lowest_index_wins(isa):
    """Copies of one weight row in its own group and in later ones give equal logits to the bit: each
    copy is a candidate, and the argmax is the first, as over the full logits."""
    N, K = 640, 256
    w = random_gguf_rows("Q8_0", N, K, seed=3)
    for dst in (37, 38, 300, 639):
        w[dst] = w[36]
    head = _head(w, K)
    screen = GGUFHeadScreen(head, OPS)
    h = (2 * head.dequantized_weight(torch.float32)[36]).repeat(5, 1).to(torch.bfloat16)
    got = OPS.gguf_screened_logits16(h, screen.weight, "Q8_0", screen.row_norms, isa)
    full = _full(head, h, isa)
    assert (full[:, [37, 38, 300, 639]] == full[:, 36:37]).all() and (full.argmax(dim=1) == 36).all()
    _check(got, full)
    assert (got[:, [36, 37, 38, 300, 639]] != NEG_INF).all()


def test_a_zero_or_non_finite_hidden_state_computes_every_row():
    """No bound holds there: every group at int16, as the full head gives it (NaN included)."""
    N, K = 100, 64
    head = _head(random_gguf_rows("Q8_0", N, K, seed=5), K)
    screen = GGUFHeadScreen(head, OPS)
    h = torch.randn(6, K).to(torch.bfloat16)
    h[0] = 0
    h[1, 3] = float("inf")
    h[2, 5] = float("nan")
    got = screen.logits(h)
    full = _full(head, h, "auto")
    torch.testing.assert_close(got[:3], full[:3], rtol=0, atol=0, equal_nan=True)
    _check(got[3:], full[3:])


@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("isa", PATHS)
@pytest.mark.parametrize("fmt", ROWS16_FORMATS)
def test_pairs_compute_gguf_matmul16s_bits_for_those_pairs_only(fmt, isa, residual):
    """Every format and path: each (row, group) pair listed holds gguf_matmul16's value to the bit
    (the last group's columns past N not written), every other entry stays as it was."""
    K = 768 if fmt in ("Q4_K", "Q5_K", "Q6_K") else 608
    N, M = 53, 6
    w16 = rows16_layout(fmt, random_gguf_rows(fmt, N, K, seed=11))
    x = torch.randn(M, K)
    full = torch.empty(M, N)
    OPS.gguf_matmul16(full, x, w16, fmt, None, residual, isa)
    pairs = torch.tensor([[0, 0], [3, 3], [5, 1], [3, 0], [2, 2]], dtype=torch.int32)
    got = torch.full((M, N), 7.0)
    OPS.gguf_matmul16_pairs(got, x, w16, fmt, pairs, residual, isa)
    want = torch.full((M, N), 7.0)
    for m, g in pairs.tolist():
        want[m, 16 * g:16 * g + 16] = full[m, 16 * g:16 * g + 16]
    assert torch.equal(got, want)


def test_bad_operands_are_refused():
    K = 64
    head = _head(random_gguf_rows("Q8_0", 40, K, seed=1), K)
    screen = GGUFHeadScreen(head, OPS)
    h = torch.randn(4, K)
    with pytest.raises(RuntimeError, match="only Q8_0 heads"):
        OPS.gguf_screened_logits16(h, screen.weight, "Q4_0", screen.row_norms)
    with pytest.raises(RuntimeError, match="row_norms must be"):
        OPS.gguf_screened_logits16(h, screen.weight, "Q8_0", screen.row_norms.double())
    with pytest.raises(RuntimeError, match="rows16 layout"):
        OPS.gguf_screened_logits16(h, screen.weight, "Q8_0", screen.row_norms[:-17])
    out = torch.empty(4, 40)
    with pytest.raises(RuntimeError, match=r"pair 1 \(4, 0\) is outside 4 rows and 3 groups"):
        OPS.gguf_matmul16_pairs(out, h, screen.weight, "Q8_0", torch.tensor([[0, 0], [4, 0]], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="int32"):
        OPS.gguf_matmul16_pairs(out, h, screen.weight, "Q8_0", torch.tensor([[0, 0]]))


def test_which_gguf_heads_get_a_screen():
    K = 64
    head = _head(random_gguf_rows("Q8_0", 48, K, seed=2), K, kernel_rows=32)
    screen, why = build_head_screen(_HeadOnly(head), OPS)
    assert isinstance(screen, GGUFHeadScreen) and "Q8_0" in why
    assert screen.weight.data_ptr() == head.weight0.data_ptr()  # the head's own bytes, no copy
    assert [screen.takes(r) for r in (1, GGUF_SCREEN_MIN_ROWS - 1, GGUF_SCREEN_MIN_ROWS, 32, 33)] == [
        False, False, True, True, False]  # past kernel_rows the head runs its GEMM, whose bits differ
    expected = head.dequantized_weight(torch.float32).double().norm(dim=1)
    assert (screen.row_norms.double() >= expected).all() and torch.allclose(screen.row_norms.double(), expected)
    q4 = GGUFLinear([("Q4_0", random_gguf_rows("Q4_0", 48, K, seed=2))], K, None, OPS, rows16=True)
    q4.residual = True
    screen, why = build_head_screen(_HeadOnly(q4), OPS)
    assert screen is None and "Q4_0" in why
    planar = _head(random_gguf_rows("Q8_0", 48, K, seed=2), K)
    planar.rows16 = [False]
    screen, why = build_head_screen(_HeadOnly(planar), OPS)
    assert screen is None and "planar" in why
    int8 = _head(random_gguf_rows("Q8_0", 48, K, seed=2), K)
    int8.residual = False
    screen, why = build_head_screen(_HeadOnly(int8), OPS)
    assert screen is None and "int8" in why


def test_a_head_with_non_finite_weights_has_no_screen():
    """Its row norms would not bound anything: the full head every step."""
    K = 64
    w = random_gguf_rows("Q8_0", 48, K, seed=2)
    w[5, 0:2] = torch.tensor([0x00, 0x7C], dtype=torch.uint8)  # the first block's float16 scale: +inf
    screen, why = build_head_screen(_HeadOnly(_head(w, K)), OPS)
    assert screen is None and "finite" in why
