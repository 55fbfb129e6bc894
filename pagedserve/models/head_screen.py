"""The LM head's screen: a greedy step reads an int8 copy of the head and only the rows that can win.

A greedy step needs the head's argmax, not its logits. One stream's decode reads every weight once
per token, and the head is a large share of them (``small``: 32,000 × 768 bf16, 49 of the 200 MB a
token reads). An int8 copy of the head, a scale per row, gives every logit to within a bound fixed
at load: ``|h·w_r − s_r (h·q_r)| ≤ ‖h‖ (‖w_r − s_r q_r‖ + γ_K (‖w_r‖ + ‖s_r q_r‖))``
(Cauchy–Schwarz, plus float32's worst-case rounding of both sums over K terms, γ_K = K·2⁻²⁴).
Rows whose upper bound reaches the largest lower bound are the only ones whose logit can be the
largest; ``kernels/head_screen.cpp`` computes those from the head's own weight, as its kernel sums
them, and gives every other row ``-inf``. The argmax is the full head's, up to float32 summation
order: where the head's output is 16-bit the margin also covers that rounding, so every row that
rounds to the largest value is computed and the lowest index among them wins, as over the full
logits.

It reads half the head's bytes (a quarter of a float32 head's) plus a few rows, for a few rows of
hidden states (:data:`SCREEN_MAX_ROWS`; past them the int8 pass's arithmetic costs more than the
bytes it saves). The engine asks for it only on steps whose every row is plain greedy: no
logprobs, penalties, logit bias, min_tokens ban, grammar or draft tokens
(``OutputAssembler.argmax_suffices``); the logits it returns are for that argmax only.

Heads it takes: a plain float linear or tied embedding without bias (bf16, f16 or float32), and a
float32 model's 16-bit head (:class:`~pagedserve.models.half_linear.HalfWeightLinear`).

A GGUF Q8_0 head (every tied head of the GGUF files measured) has a screen of its own,
:class:`GGUFHeadScreen`, for the other end: its bytes are already a screen's, but from a few rows on
its int16 products are what a step waits on, and the int8 activations the kernels would otherwise
use are the int16 ones' high byte. Every logit at int8 is the int16 one to within
``‖w_r‖ ‖x16 − x8‖`` plus both sums' float32 rounding, so only the groups of 16 rows that can hold
the int16 argmax are computed at int16 (``kernels/gguf_head_screen.cpp``): the full head's argmax
and, for those rows, its values to the bit, for about the int8 head's arithmetic. Other quantized
heads (``--quantization``, GGUF's other formats) have none.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedserve.models.gguf_linear import GGUFLinear
from pagedserve.models.half_linear import HalfWeightLinear
from pagedserve.models.quant import quantize_int8_rows

# Rows of hidden states a step may have for the screen: the int8 pass widens every weight for each
# row, which past a few rows costs more than the head's full matmul saves in bytes.
SCREEN_MAX_ROWS = 4
# Rows of hidden states from which a GGUF Q8_0 head is screened: below them its int16 pass waits on
# the head's bytes, which the int8 pass reads as well (SmolLM2's 49,152 x 576 head, 2 threads of a
# Zen 4: 1 / 2 / 4 / 16 rows 0.52 / 0.55 / 0.76 / 2.85 ms at int16, 0.47 / 0.54 / 0.47 / 1.91 at int8).
GGUF_SCREEN_MIN_ROWS = 4
# Rows of the head the bound is computed over at a time (float64: a chunk's copy stays small).
_BOUND_CHUNK_ROWS = 4096


class HeadScreen(nn.Module):
    """An LM head's int8 screen (``q``, ``scale``), each row's error factor ``bound``, and the head's
    own ``weight`` (shared with the head where it keeps one) with the dtype its output is rounded to
    (``out_dtype``). A module of non-persistent buffers: the weights' huge pages take them, a state
    dict does not."""

    def __init__(self, weight: torch.Tensor, out_dtype: torch.dtype, ops):
        super().__init__()
        self.out_dtype = str(out_dtype).removeprefix("torch.")
        self.ops = ops
        self.max_rows = SCREEN_MAX_ROWS
        vocab, hidden = weight.shape
        q = torch.empty(vocab, hidden, dtype=torch.int8)
        scales = torch.empty(vocab, dtype=torch.float32)
        bounds = torch.empty(vocab, dtype=torch.float32)
        gamma = 1.01 * hidden * 2.0**-24  # float32's worst-case relative error of a K-term sum
        for n in range(0, vocab, _BOUND_CHUNK_ROWS):
            chunk = weight[n:n + _BOUND_CHUNK_ROWS]
            codes, scale = quantize_int8_rows(chunk)  # --quantization int8's rows
            w, approx = chunk.double(), codes.double() * scale.double().unsqueeze(1)
            bound = (w - approx).norm(dim=1) + gamma * (w.norm(dim=1) + approx.norm(dim=1))
            q[n:n + len(w)] = codes
            scales[n:n + len(w)] = scale
            bounds[n:n + len(w)] = (bound * (1 + 1e-4)).float()  # rounded up, not to nearest
        for name, t in (("q", q), ("scale", scales), ("bound", bounds), ("weight", weight)):
            self.register_buffer(name, t, persistent=False)

    @property
    def nbytes(self) -> int:
        """The screen's own bytes (the weight is the head's)."""
        return self.q.nbytes + self.scale.nbytes + self.bound.nbytes

    def takes(self, rows: int) -> bool:
        """Whether a greedy step of ``rows`` sampled rows goes through the screen."""
        return rows <= self.max_rows

    def logits(self, hidden: torch.Tensor, stack=None) -> torch.Tensor:
        """Float32 logits of ``hidden`` for a greedy pick: the rows that can win exact, the rest -inf.
        With the model's decode ``stack``, on its threads (a float32 model's stack computes on a pool
        of its own: the op on OpenMP's team beside it measured 0.78x the rate of the full head)."""
        args = (hidden, self.q, self.scale, self.bound, self.weight, self.out_dtype)
        return stack.screened_logits(*args) if stack is not None else self.ops.screened_logits(*args)


class GGUFHeadScreen(nn.Module):
    """A GGUF Q8_0 head's screen: each row's norm (``row_norms``, the dequantized row's, rounded up)
    beside the head's own rows16 ``weight``. For greedy steps of ``min_rows`` to ``max_rows`` rows
    (past ``max_rows`` the head runs its GEMM, whose bits the kernels' do not match)."""

    def __init__(self, head: GGUFLinear, ops):
        super().__init__()
        self.ops = ops
        self.format = head.formats[0]
        self.min_rows, self.max_rows = GGUF_SCREEN_MIN_ROWS, head.kernel_rows
        norms = torch.empty(head.out_features, dtype=torch.float32)
        for n in range(0, head.out_features, _BOUND_CHUNK_ROWS):
            ids = torch.arange(n, min(n + _BOUND_CHUNK_ROWS, head.out_features))
            norm = head.rows(ids, torch.float32).double().norm(dim=1)
            norms[n:n + len(ids)] = (norm * (1 + 2.0**-20)).float()  # rounded up, not to nearest
        self.register_buffer("row_norms", norms, persistent=False)
        self.register_buffer("weight", head.weight0, persistent=False)

    @property
    def nbytes(self) -> int:
        """The screen's own bytes (the weight is the head's)."""
        return self.row_norms.nbytes

    def takes(self, rows: int) -> bool:
        """Whether a greedy step of ``rows`` sampled rows goes through the screen."""
        return self.min_rows <= rows <= self.max_rows

    def logits(self, hidden: torch.Tensor, stack=None) -> torch.Tensor:
        """Float32 logits of ``hidden`` for a greedy pick: the groups that can win at the head's
        int16 values, the rest -inf; with the model's decode ``stack``, on its threads."""
        if stack is not None:
            return stack.screened_head_logits(hidden, self.row_norms)
        return self.ops.gguf_screened_logits16(hidden, self.weight, self.format, self.row_norms)


def _gguf_head_screen(head: GGUFLinear, ops) -> tuple[GGUFHeadScreen | None, str]:
    """A GGUF head's screen, or ``None`` and why it has none."""
    if not hasattr(ops, "gguf_screened_logits16"):
        return None, "no native kernels"
    # (a planar Q8_0 head is AVX2's, where a float32 model's head runs its int16 GEMM past 4 rows:
    # no rows left for a screen to take)
    if head.formats != ["Q8_0"] or head.rows16 != [True] or head.bias is not None or not head.residual:
        return None, (f"a GGUF {'+'.join(head.formats)} head" + ("" if head.rows16 == [True] else " in planar rows")
                      + (" with a bias" if head.bias is not None else "")
                      + ("" if head.residual else " at int8 activations"))
    screen = GGUFHeadScreen(head, ops)
    if not torch.isfinite(screen.row_norms).all():
        return None, "a GGUF head with weights that are not finite"
    return screen, (f"greedy steps of {screen.min_rows} to {screen.max_rows} rows screen the Q8_0 LM head at int8 "
                    f"activations and compute at int16 only the rows that can win")


def build_head_screen(model: nn.Module, ops) -> tuple[HeadScreen | GGUFHeadScreen | None, str]:
    """The screen of ``model``'s LM head, or ``None`` and why it has none. Call it before prepacking:
    it keeps the head's plain weight, which oneDNN's packed copy cannot give rows of."""
    if ops is None or not hasattr(ops, "screened_logits"):
        return None, "no native kernels"
    head = model.lm_head
    if head is None:
        if type(model.embed_tokens) is not nn.Embedding:
            return None, f"a tied {type(model.embed_tokens).__name__} table"
        weight = model.embed_tokens.weight
        out_dtype = weight.dtype
    elif type(head) is nn.Linear and head.bias is None:
        weight, out_dtype = head.weight, head.weight.dtype
    elif isinstance(head, HalfWeightLinear) and head.bias is None:
        weight, out_dtype = head.weight, torch.float32
    elif isinstance(head, GGUFLinear):
        return _gguf_head_screen(head, ops)
    else:
        return None, f"a {type(head).__name__} head" + (" with a bias" if getattr(head, "bias", None) is not None else "")
    if weight.device.type != "cpu" or weight.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return None, f"a {weight.dtype} head on {weight.device.type}"
    screen = HeadScreen(weight.detach().contiguous(), out_dtype, ops)
    return screen, (f"greedy steps of up to {screen.max_rows} rows screen the LM head through an int8 copy "
                    f"({screen.nbytes / 2**20:.1f} MiB) and compute only the rows that can win")
