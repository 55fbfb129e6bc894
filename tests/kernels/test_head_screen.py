"""The LM head's screen (``kernels/head_screen.cpp``, ``models/head_screen.py``) on every
instruction-set path this CPU runs, the scalar one always.

What it must keep: the full head's argmax. Checked two ways. With integer weights and hidden
states every sum is exact in float32 whatever its order, so the full head's logits are known
exactly, and rounded to bf16 / f16 many of them tie: the screen's argmax must be the full head's,
lowest index among ties, exactly. With Gaussian ones (float32, bf16 and f16 heads, K not a multiple
of the vector width, 1-4 rows): every row that comes within float32's rounding of the largest logit
is computed, each computed row holds the head's value, and the pick holds the largest one; and the
screen computes few rows (else it would read the whole head and save nothing)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pagedserve.kernels import isa_paths, kernel_error, native_ops
from pagedserve.models.head_screen import HeadScreen, build_head_screen
from pagedserve.models.half_linear import HalfWeightLinear

OPS = native_ops()
needs_kernels = pytest.mark.skipif(OPS is None, reason=f"native kernels unavailable: {kernel_error()}")
PATHS = isa_paths()
HALF = {torch.bfloat16: "bfloat16", torch.float16: "float16"}


def _screened(screen: HeadScreen, h: torch.Tensor, isa: str) -> torch.Tensor:
    return OPS.screened_logits(h, screen.q, screen.scale, screen.bound, screen.weight, screen.out_dtype, isa)


@needs_kernels
@pytest.mark.parametrize("isa", PATHS)
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_integer_heads_give_the_full_heads_argmax_exactly_ties_included(isa, out_dtype):
    """Weights and hidden states in -7..7: every logit an exact integer up to 7·7·72; rounded to
    bf16 (8 bits) the top values tie often, and the lowest index among the tied wins."""
    ties = 0
    for seed in range(12):
        g = torch.Generator().manual_seed(seed)
        w = torch.randint(-7, 8, (3000, 72), generator=g).to(out_dtype)
        h = torch.randint(-7, 8, (3, 72), generator=g).to(out_dtype)
        screen = HeadScreen(w, out_dtype, OPS)
        full = (h.double() @ w.double().T).to(out_dtype).float()  # exact sums, then the head's rounding
        got = _screened(screen, h, isa)
        assert torch.equal(got.argmax(dim=1), full.argmax(dim=1)), f"seed {seed}"
        finite = torch.isfinite(got)
        assert torch.equal(got[finite], full[finite]), "a computed row differs from the head's value"
        ties += int(((full == full.amax(dim=1, keepdim=True)).sum(dim=1) > 1).sum())
    if out_dtype == torch.bfloat16:
        assert ties > 0, "no tie at the top in any case: the test would not check the tie-break"


@needs_kernels
@pytest.mark.parametrize("isa", PATHS)
@pytest.mark.parametrize("weight_dtype,out_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                                    (torch.float16, torch.float16), (torch.bfloat16, torch.float32)])
@pytest.mark.parametrize("rows,hidden", [(1, 64), (4, 100), (2, 17)])
def test_gaussian_heads_compute_every_row_that_can_win_and_few_others(isa, weight_dtype, out_dtype, rows, hidden):
    g = torch.Generator().manual_seed(rows * 100 + hidden)
    w = (torch.randn(4000, hidden, generator=g) * 0.05).to(weight_dtype)
    h_dtype = torch.float32 if out_dtype == torch.float32 else weight_dtype  # the dtype the head reads
    h = (torch.randn(rows, hidden, generator=g) * 3).to(h_dtype)
    screen = HeadScreen(w, out_dtype, OPS)
    exact = h.double() @ w.double().T  # [rows, vocab]
    full = exact.to(out_dtype).float()
    got = _screened(screen, h, isa)
    finite = torch.isfinite(got)
    # every computed row holds the head's value (float32 summation order aside)
    tol = 1e-5 * exact.abs().amax() + (exact.abs() * {torch.bfloat16: 2**-7, torch.float16: 2**-10}.get(out_dtype, 0))
    assert ((got - full).abs()[finite] <= tol[finite] + 1e-6).all()
    # every row within float32's rounding of the largest logit is computed
    near_top = exact >= exact.amax(dim=1, keepdim=True) - 1e-4 * exact.abs().amax(dim=1, keepdim=True)
    assert finite[near_top].all(), "a row that can hold the argmax was screened out"
    pick = got.argmax(dim=1)
    assert (full.gather(1, pick[:, None]) >= full.amax(dim=1, keepdim=True) - tol.amax(dim=1, keepdim=True)).all()
    assert (finite.sum(dim=1) <= 400).all(), f"the screen computed {finite.sum(dim=1).tolist()} of 4,000 rows"


@needs_kernels
@pytest.mark.parametrize("isa", PATHS)
def test_paths_pick_the_same_rows_and_values(isa):
    """The candidates' exact values do not depend on the path (scalar sums on every one)."""
    g = torch.Generator().manual_seed(5)
    w = (torch.randn(2048, 96, generator=g) * 0.05).to(torch.bfloat16)
    h = torch.randn(2, 96, generator=g).to(torch.bfloat16)
    screen = HeadScreen(w, torch.bfloat16, OPS)
    ref, got = _screened(screen, h, "scalar"), _screened(screen, h, isa)
    assert torch.equal(ref.argmax(dim=1), got.argmax(dim=1))
    both = torch.isfinite(ref) & torch.isfinite(got)
    assert torch.equal(ref[both], got[both])


@needs_kernels
def test_a_zero_or_non_finite_hidden_state_computes_every_row():
    w = torch.randn(300, 32).to(torch.bfloat16)
    screen = HeadScreen(w, torch.bfloat16, OPS)
    zero = screen.logits(torch.zeros(1, 32, dtype=torch.bfloat16))
    assert torch.equal(zero, torch.zeros(1, 300)) and int(zero.argmax()) == 0
    h = torch.randn(1, 32).to(torch.bfloat16)
    h[0, 3] = float("inf")
    full = (h.double() @ w.double().T).to(torch.bfloat16).float()  # ±inf, as the head's own sums give
    assert torch.equal(screen.logits(h), full)  # nothing screened out


@needs_kernels
def test_bad_operands_are_refused():
    screen = HeadScreen(torch.randn(10, 8), torch.float32, OPS)
    with pytest.raises(RuntimeError, match="matching h"):
        screen.logits(torch.randn(1, 9))
    with pytest.raises(RuntimeError, match="out_dtype"):
        OPS.screened_logits(torch.randn(1, 8), screen.q, screen.scale, screen.bound, screen.weight, "int8")


@needs_kernels
def test_which_heads_get_a_screen():
    class Model(nn.Module):
        def __init__(self, head, embed):
            super().__init__()
            self.lm_head, self.embed_tokens = head, embed

    bf16_head = nn.Linear(16, 50, bias=False).to(torch.bfloat16)
    screen, _ = build_head_screen(Model(bf16_head, nn.Embedding(50, 16)), OPS)
    assert screen is not None and screen.out_dtype == "bfloat16" and screen.weight.data_ptr() == bf16_head.weight.data_ptr()
    tied = nn.Embedding(50, 16)
    screen, _ = build_head_screen(Model(None, tied), OPS)
    assert screen is not None and screen.out_dtype == "float32" and screen.weight.data_ptr() == tied.weight.data_ptr()
    half = HalfWeightLinear(torch.randn(50, 16), None, torch.bfloat16, OPS)
    screen, _ = build_head_screen(Model(half, nn.Embedding(50, 16)), OPS)
    assert screen is not None and screen.out_dtype == "float32"  # a float32 model's head: float32 out
    screen, why = build_head_screen(Model(nn.Linear(16, 50), nn.Embedding(50, 16)), OPS)
    assert screen is None and "bias" in why
    screen, why = build_head_screen(Model(bf16_head, nn.Embedding(50, 16)), None)
    assert screen is None and why == "no native kernels"
