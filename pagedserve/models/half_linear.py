"""Linear layers that keep their weights 16-bit (float16 or bfloat16) for a float32 model.

A model computed in float32 (the default on a CPU without native bf16, no AVX512_BF16 and no AMX;
anywhere with ``--dtype float32``) reads 4 bytes per weight every decode step: single-stream decode
is bound by those bytes. :class:`HalfWeightLinear` holds the weight 16-bit and computes in float32:

* up to :data:`KERNEL_MAX_ROWS` rows (a decode step, the LM head's sampled rows), the native
  ``half_linear`` kernel (``kernels/half_matmul.cpp``) reads the 16-bit weight once and widens it
  in registers: half the bytes of float32 per token;
* beyond (prompt chunks), blocks of the weight are widened to float32 and go through ``F.linear``,
  torch's float32 GEMM, so prefill keeps the fastest GEMM the machine has. The widened copy is
  transient and one block at a time (:data:`_WIDEN_BLOCK_BYTES`): the resident weight stays 16-bit,
  and a 32,000-row LM head is not widened into a 98 MB buffer whose page faults cost more than its
  GEMM (measured: 80 ms against 7 ms for one row).

A bf16 or f16 checkpoint stored this way is lossless; a float32 checkpoint stored 16-bit is
rounded, so that takes ``--decode-weights`` (:func:`choose_decode_weights`).

On a CPU with native bf16 the default compute dtype is bfloat16 and none of this applies; asked
for float32 there, a bf16 checkpoint decodes through this kernel too. It is the fastest one-stream
path measured on such a CPU: ``small`` (bf16 checkpoint), one stream, 2 threads of a Sapphire
Rapids-class Xeon, 150 tok/s against 104 computed in bfloat16 through oneDNN's prepacked matmuls
(docs/BENCHMARKS.md) — the gain is the decode stack's own thread pool (a float32 model's 16-bit
linears run on it, oneDNN's on OpenMP's team), the kernel itself matches oneDNN's one-row speed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.models.quant import FlatLinear, QuantizedEmbedding
from pagedserve.models.replace import replace_linears

# Up to this many rows the kernel's single pass over the 16-bit weight beats widening it for
# torch's GEMM; beyond, the GEMM's register blocking wins. Measured on small's five shapes (AVX2
# EPYC, 1 thread, the widened path against the kernel): 1.4-1.7x at 16 rows, 1.0-1.6x at 32, 0.9-1.15x
# at 40-48; on 2 threads the kernel still led at 48 (docs/QUANTIZATION.md).
KERNEL_MAX_ROWS = 32
# float32 bytes widened per F.linear call on the prefill path: a few MiB stay in cache and in the
# allocator's reused blocks, where the whole matrix at once would be fresh pages every call.
_WIDEN_BLOCK_BYTES = 4 << 20

DECODE_WEIGHT_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}


class HalfWeightLinear(FlatLinear):
    """``y = x Wᵀ + b`` in float32 with ``W`` stored float16 or bfloat16 (``[out, in]``, row-major)
    and the bias float32; ``ops`` is the native kernels' namespace (``None``: torch only)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype, ops=None):
        super().__init__(weight.shape, None if bias is None else bias.detach().float().contiguous())
        if dtype not in DECODE_WEIGHT_DTYPES.values():
            raise ValueError(f"HalfWeightLinear stores float16 or bfloat16, not {dtype}")
        stored = weight.detach().to(dtype).contiguous()
        if not torch.isfinite(stored).all() and torch.isfinite(weight).all():
            # float16 tops out at 65504: a larger weight would become inf and every output NaN.
            raise ValueError(f"a weight of magnitude {weight.detach().abs().max().item():.4g} exceeds {dtype}'s "
                             "range; store it as bfloat16 or float32 (--decode-weights)")
        self.register_buffer("weight", stored)
        self.ops = ops
        self.max_kernel_rows = KERNEL_MAX_ROWS

    @classmethod
    def from_linear(cls, linear: nn.Linear, dtype: torch.dtype, ops=None) -> "HalfWeightLinear":
        return cls(linear.weight, linear.bias, dtype, ops)

    def rows(self, ids: torch.Tensor | slice, dtype: torch.dtype) -> torch.Tensor:
        """Rows ``ids`` of the weight (a tensor, or a slice) in ``dtype``: the lookups of a tied embedding."""
        return self.weight[ids].to(dtype)

    def matmul(self, rows: torch.Tensor) -> torch.Tensor:
        if self.ops is not None and rows.dtype == torch.float32 and rows.shape[0] <= self.max_kernel_rows:
            if rows.stride(-1) != 1:
                rows = rows.contiguous()
            y = torch.empty(rows.shape[0], self.out_features, dtype=torch.float32, device=rows.device)
            self.ops.half_linear(y, rows, self.weight, self.bias)
            return y
        # Prefill-sized batches: torch's GEMM over the weight widened a block of outputs at a time.
        step = max(1, _WIDEN_BLOCK_BYTES // (4 * self.in_features))
        bias = None if self.bias is None else self.bias.to(rows.dtype)
        parts = [F.linear(rows, self.weight[n:n + step].to(rows.dtype), None if bias is None else bias[n:n + step])
                 for n in range(0, self.out_features, step)]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"stored {_name(self.weight.dtype)}")


def store_linears_16bit(model: nn.Module, dtype: torch.dtype, ops) -> int:
    """Replace every float32 ``nn.Linear`` of ``model`` by a :class:`HalfWeightLinear` storing
    ``dtype``, in place; a tied LM head gets one too, which the token lookups then read as well
    (the float32 table is dropped: one 16-bit table). Returns how many layers were replaced."""
    tied = getattr(model, "lm_head", False) is None  # (replace_linears builds a head only over an nn.Embedding)
    count = replace_linears(model, lambda linear: HalfWeightLinear.from_linear(linear, dtype, ops),
                            lambda linear: linear.weight.dtype == torch.float32, tied_head=True)
    if tied and isinstance(model.lm_head, HalfWeightLinear):
        model.embed_tokens = QuantizedEmbedding(model.lm_head, torch.float32)
    return count


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def choose_decode_weights(requested: str, checkpoint_dtype: torch.dtype | None, compute_dtype: torch.dtype,
                          device: torch.device, quantization: str, kernel: bool) -> tuple[torch.dtype | None, str]:
    """How a model's linear weights are stored for decode: ``(dtype, why)``, dtype ``None`` when
    they stay in the compute dtype. ``requested`` is ``--decode-weights`` (``auto`` | ``float32`` |
    ``float16`` | ``bfloat16``); ``checkpoint_dtype`` the dtype the checkpoint stores its weights in
    (``None``: unknown or mixed); ``kernel`` whether the native ``half_linear`` kernel is built."""
    for refused, why in [(device.type != "cpu", "16-bit decode weights are a CPU path"),
                         (compute_dtype != torch.float32, f"the model computes in {_name(compute_dtype)}"),
                         (quantization not in (None, "none"), f"the weights are quantized ({quantization})"),
                         (not kernel, "the native half_linear kernel is unavailable"),
                         (requested == "float32", "--decode-weights float32")]:
        if refused:
            return None, why
    if requested == "auto":
        if checkpoint_dtype in DECODE_WEIGHT_DTYPES.values():
            return checkpoint_dtype, (f"the checkpoint's own {_name(checkpoint_dtype)}, lossless; decode reads 2 "
                                      "bytes per weight instead of float32's 4")
        return None, ("--decode-weights auto keeps a float32 checkpoint's weights float32; float16 would halve the "
                      "bytes decode reads, rounding them")
    dtype = DECODE_WEIGHT_DTYPES[requested]
    exact = "lossless" if checkpoint_dtype == dtype else "rounded from the checkpoint's " + (
        _name(checkpoint_dtype) if checkpoint_dtype is not None else "weights")
    return dtype, f"--decode-weights {requested} ({exact}); decode reads 2 bytes per weight instead of 4"
