"""Weight-only quantization at load: int8 per output channel, int4 in groups along the input.

Every ``nn.Linear`` of the model (fused QKV, output, fused gate/up, down, the LM head) is
replaced by a quantized twin; embeddings and norms stay in the model dtype. A tied LM head gets
a quantized copy of the embedding matrix for the logits matmul (the lookups keep the table). Activations stay
in the model dtype too — only the bytes each decode step reads from memory shrink, which is
what bounds single-stream decode speed.

* ``int8`` — ``w ≈ q × s[n]``, q in [-127, 127], one scale per output channel. On CPU with
  bfloat16 activations the matmul is ``aten._weight_int8pack_mm`` (measured here 2.7× faster than
  the bf16 matmul for a 4096×16384 matrix-vector product); elsewhere int8 → dtype, matmul, scale.
* ``int4`` — asymmetric per group of ``group_size`` input columns: ``w ≈ (q − 8) × s + z`` with q
  in [0, 15] and ``z = min + 8 s`` (layouts: :class:`Int4Linear`). On CPU with the native group
  kernels (``--group-kernels``; ``quant_matmul.cpp``) a batch of up to :data:`_NATIVE_MAX_ROWS` rows
  is one pass over the packed bytes; a larger one dequantizes the weight natively and runs the
  float GEMM. On CPU without the kernels the weights are packed once for
  ``aten._weight_int4pack_mm_for_cpu`` instead (opaque); other devices dequantize per call.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.models.replace import replace_linears

INT4_GROUP_SIZE = 32
_INT4_INNER_K_TILES = 2  # the CPU packing's tile parameter (K must be a multiple of 16 × this)
# The native group kernels' batch limit: up to this many rows, one pass over the packed weight
# (unpacked in registers, reused for 4 rows at a time) beats dequantizing it for the float GEMM;
# beyond, dequantizing once for the GEMM's register blocking wins. The kernel's time grows with the
# rows, the dequantization's barely: they cross between 45 and 64 rows on SmolLM2's three weight
# shapes (AVX2, 2 threads; docs/QUANTIZATION.md), so a batched decode of up to 48 stays in the kernel.
_NATIVE_MAX_ROWS = 48


def group_kernel_ops(ops, device: torch.device, group_size: int) -> object | None:
    """``ops`` (the native kernels, or None) when the group-of-32 kernels can serve a layer on ``device``.

    Opt-in (``EngineConfig.group_kernels``, ``--group-kernels``: the loader passes the kernels down
    only then). Both batch-size paths compute with the stored weights exactly and sum in float32
    (the kernel up to :data:`_NATIVE_MAX_ROWS` rows, batch-invariant within that; a float32 GEMM
    over the float32 dequantization beyond), so a prompt's last logits cold and after a
    prefix-cache hit differ by summation order only. Not the default because on this project's
    AVX2 machine torch's int4pack path decodes SmolLM2 faster on two threads (docs/QUANTIZATION.md)."""
    return ops if ops is not None and device.type == "cpu" and group_size == 32 else None


def _pack_nibbles(q: torch.Tensor, group_size: int) -> torch.Tensor:
    """q [N, K] in [0, 15] → uint8 [N, K/2]: per group, byte i holds column i (low nibble) and
    column i + g/2 (high), so unpacking needs a mask and a shift and no shuffle."""
    n, k = q.shape
    g = q.to(torch.uint8).reshape(n, k // group_size, 2, group_size // 2)
    return (g[:, :, 0] | (g[:, :, 1] << 4)).reshape(n, k // 2).contiguous()


def _native_linear(ops, kind: str, x2: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor,
                   offsets: torch.Tensor | None, bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """``x2 [M, K] → [M, N]`` through the native group kernels (decode-sized M) or one native
    dequantization and ``F.linear`` (prefill-sized M)."""
    x2 = x2.contiguous()
    if bias is not None and bias.dtype != x2.dtype:
        bias = bias.to(x2.dtype)
    if x2.shape[0] <= _NATIVE_MAX_ROWS:
        y = torch.empty(x2.shape[0], weight.shape[0], dtype=out_dtype)
        if kind == "int4":
            ops.int4_group_matmul(y, x2, weight, scales, offsets, bias)
        else:
            ops.int8_group_matmul(y, x2, weight, scales, bias)
        return y
    # float32 weights, exactly as stored, and float32 sums: what the kernel computes, so a row's
    # result does not depend on how many rows came with it beyond summation order (a prompt's last
    # logits cold and after a prefix-cache hit agree). float32 GEMMs are also the fast ones on a
    # CPU without bf16 hardware.
    w = torch.empty(weight.shape[0], x2.shape[1], dtype=torch.float32)
    ops.group_dequantize(w, weight, scales, offsets)
    return F.linear(x2.float(), w, None if bias is None else bias.float()).to(out_dtype)


class FlatLinear(nn.Module):
    """What the weight-only twins of ``nn.Linear`` share: their shape and ``bias`` buffer (None or
    added to the output, each layout's way); the input flattened to rows ``[-1, in]``
    for :meth:`matmul` (``rows Wᵀ + b``, each layout's own), the output shaped back; and the whole
    dequantized weight as the rows of it (:meth:`rows` of ``slice(None)``)."""

    def __init__(self, weight_shape: torch.Size, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = weight_shape
        self.register_buffer("bias", bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x.reshape(-1, self.in_features)).reshape(*x.shape[:-1], self.out_features)

    def dequantized_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The float weight this layer computes with, ``[out, in]``."""
        return self.rows(slice(None), dtype)


def quantize_int8_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [rows, cols]`` as int8 codes in [-127, 127] and one float32 scale per row (its largest
    magnitude / 127), computed in float32: ``w ≈ q × s[row]``."""
    w = w.float()
    scales = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
    return (w / scales.unsqueeze(1)).round().clamp(-127, 127).to(torch.int8), scales


class Int8Linear(FlatLinear):
    """``y = x Wᵀ + b`` with ``W`` stored as int8 and one scale per output channel."""

    def __init__(self, weight_int8: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None):
        super().__init__(weight_int8.shape, bias)
        self.register_buffer("weight", weight_int8)
        self.register_buffer("scales", scales)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "Int8Linear":
        """Quantize a float linear layer (scales and bias keep its dtype)."""
        q, scales = quantize_int8_rows(linear.weight.detach())
        return cls(q, scales.to(linear.weight.dtype), None if linear.bias is None else linear.bias.detach().clone())

    def dequantized_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The float weight this layer computes with, ``[out, in]``."""
        return self.weight.to(dtype) * self.scales.to(dtype).unsqueeze(1)

    def matmul(self, x2: torch.Tensor) -> torch.Tensor:
        # The fused CPU kernel is fast for bfloat16 only (float32 measured ~4× slower than a bf16 matmul).
        if x2.device.type == "cpu" and x2.dtype == torch.bfloat16 and self.scales.dtype == torch.bfloat16:
            y = torch.ops.aten._weight_int8pack_mm(x2.contiguous(), self.weight, self.scales)
        else:
            y = F.linear(x2, self.weight.to(x2.dtype)) * self.scales.to(x2.dtype)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per-channel"


def quantize_int4_groups(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``w [N, K]`` → (q int32 in [0, 15] ``[N, K]``, scales ``[N, K/g]``, zeros ``[N, K/g]``), float32."""
    n, k = w.shape
    if k % group_size:
        raise ValueError(f"int4 groups of {group_size} need in_features divisible by it, got {k}")
    wg = w.float().reshape(n, k // group_size, group_size)
    lo, hi = wg.amin(dim=-1), wg.amax(dim=-1)
    scales = ((hi - lo) / 15.0).clamp(min=1e-8)
    zeros = lo + 8.0 * scales
    q = ((wg - lo.unsqueeze(-1)) / scales.unsqueeze(-1)).round().clamp(0, 15).to(torch.int32)
    return q.reshape(n, k), scales, zeros


def int4_cpu_layout_is_opaque(device: torch.device, group_size: int = INT4_GROUP_SIZE, group_ops=None) -> bool:
    """Whether ``packed_for_cpu`` lays int4 weights out for torch's ``_weight_int4pack_mm_for_cpu``
    (opaque: no row lookups): on a CPU without the native group kernels (``group_ops``). With them,
    the readable layout is also the fast one."""
    return device.type == "cpu" and group_kernel_ops(group_ops, device, group_size) is None


class Int4Linear(FlatLinear):
    """``y = x Wᵀ + b`` with ``W`` in 4 bits, an asymmetric scale and zero per group of input columns.

    Readable layout (every case but one): ``weight`` uint8 ``[N, K/2]`` (:func:`_pack_nibbles`),
    ``scales`` and ``offsets`` float16 ``[N, K/g]`` with ``w = q × scale + offset``; float16 holds a
    GGUF's Q4_0 / Q4_1 ``d`` and ``m`` exactly. Opaque layout (``packed_for_cpu`` on a CPU without
    the native kernels): torch's int4pack weight and ``scales_and_zeros [K/g, N, 2]`` in the model dtype.
    """

    def __init__(self, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bias: torch.Tensor | None,
                 group_size: int, dtype: torch.dtype, packed_for_cpu: bool, group_ops=None):
        super().__init__(q.shape, bias)
        self.group_size = group_size
        if self.in_features % group_size or group_size % 2:
            raise ValueError(f"int4 groups of {group_size} need in_features divisible by it, got {self.in_features}")
        self.group_ops = group_kernel_ops(group_ops, q.device, group_size)
        self.packed_for_cpu = packed_for_cpu and self.group_ops is None and q.device.type == "cpu"
        if self.packed_for_cpu:
            if self.in_features % (16 * _INT4_INNER_K_TILES):
                raise ValueError(f"the CPU int4 kernel needs in_features divisible by {16 * _INT4_INNER_K_TILES}, "
                                 f"got {self.in_features}")
            self.register_buffer("weight", torch.ops.aten._convert_weight_to_int4pack_for_cpu(
                q.contiguous(), _INT4_INNER_K_TILES))
            # [K/g, N, 2] (scale, zero): the layout torch's kernel takes.
            self.register_buffer("scales_and_zeros", torch.stack([scales, zeros], dim=-1).transpose(0, 1)
                                 .contiguous().to(dtype))
        else:
            self.register_buffer("weight", _pack_nibbles(q, group_size))
            s = scales.float()
            # z − 8 s is exact in float32 whenever z = m + 8 s was (a GGUF Q4_1 m; −8 d for Q4_0).
            self.register_buffer("scales", s.to(torch.float16).contiguous())
            self.register_buffer("offsets", (zeros.float() - 8.0 * s).to(torch.float16).contiguous())

    @classmethod
    def from_linear(cls, linear: nn.Linear, group_size: int = INT4_GROUP_SIZE,
                    packed_for_cpu: bool | None = None, group_ops=None) -> "Int4Linear":
        """Quantize a float linear layer; ``packed_for_cpu`` defaults to whether it lives on the CPU."""
        w = linear.weight.detach()
        q, scales, zeros = quantize_int4_groups(w, group_size)
        return cls(q, scales, zeros, None if linear.bias is None else linear.bias.detach().clone(), group_size, w.dtype,
                   w.device.type == "cpu" if packed_for_cpu is None else packed_for_cpu, group_ops)

    def rows(self, ids: torch.Tensor | slice, dtype: torch.dtype) -> torch.Tensor:
        """Rows ``ids`` of the dequantized weight (a tensor, or a slice): the lookups of a quantized
        embedding table (:class:`QuantizedEmbedding`). Readable layout only."""
        if self.packed_for_cpu:
            raise RuntimeError("the CPU-packed int4 layout is opaque; build with packed_for_cpu=False to read it")
        packed, s, b = self.weight[ids], self.scales[ids], self.offsets[ids]
        p = packed.reshape(packed.shape[0], -1, self.group_size // 2)
        q = torch.cat([p & 0x0F, p >> 4], dim=-1).float()  # [rows, K/g, g]
        w = q * s.float().unsqueeze(-1) + b.float().unsqueeze(-1)  # float32, one rounding to dtype
        return w.reshape(packed.shape[0], self.in_features).to(dtype)

    def matmul(self, x2: torch.Tensor) -> torch.Tensor:
        if self.group_ops is not None and x2.device.type == "cpu":  # (never with the CPU-packed layout)
            return _native_linear(self.group_ops, "int4", x2, self.weight, self.scales, self.offsets, self.bias,
                                  x2.dtype)
        if self.packed_for_cpu:
            # A no-op .to() when the activations have the model dtype (no copy per call).
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2.contiguous(), self.weight, self.group_size,
                                                          self.scales_and_zeros.to(x2.dtype))
        else:
            y = F.linear(x2, self.dequantized_weight(x2.dtype))
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, int4 group {self.group_size}"
                f"{', CPU-packed' if self.packed_for_cpu else ''}")


# Without the native kernels: up to this many rows the grouped int8 layer runs torch's int8 CPU
# kernel once per group (as fast as one per-channel call for one row); beyond, one dequantized
# copy per call amortizes better.
_INT8_GROUPED_KERNEL_MAX_ROWS = 32


class Int8GroupedLinear(FlatLinear):
    """``y = x Wᵀ + b`` with ``W`` int8 and one scale per output channel per group of ``group_size``
    input columns: ``w[n, k] = q[n, k] × s[n, k // g]`` (GGUF's Q8_0, carried over as stored).

    On CPU with the native kernels (``group_size`` 32) the weight is kept ``[N, K]`` with float16
    scales ``[N, K/g]`` (a Q8_0 block's own scale, exactly) and the product is one native pass
    (:func:`_native_linear`), for any model dtype. Without them, torch's int8 CPU kernel takes one
    scale per output channel, and within one group that is what the scales are: so with bfloat16
    activations a product is one ``aten._weight_int8pack_mm`` per group, summed in float32, over a
    weight stored ``[K/g, N, g]`` (each group's matrix contiguous) with scales ``[K/g, N]`` in the
    model dtype; larger batches, other devices and float32 dequantize it per call (correct, not fast).
    """

    def __init__(self, q: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None, group_size: int,
                 dtype: torch.dtype, group_ops=None):
        super().__init__(q.shape, bias)
        if self.in_features % group_size or scales.shape != (self.out_features, self.in_features // group_size):
            raise ValueError(f"int8 groups of {group_size}: weight {tuple(q.shape)} and scales {tuple(scales.shape)} "
                             "do not match")
        self.group_size = group_size
        self.group_ops = group_kernel_ops(group_ops, q.device, group_size)
        self.native = self.group_ops is not None
        if self.native:
            self.register_buffer("weight", q.to(torch.int8).contiguous())  # [N, K]
            self.register_buffer("scales", scales.to(torch.float16).contiguous())  # [N, K/g]
        else:
            self.register_buffer("weight", q.to(torch.int8).reshape(self.out_features, -1, group_size)
                                 .transpose(0, 1).contiguous())  # [K/g, N, g]
            self.register_buffer("scales", scales.t().contiguous().to(dtype))  # [K/g, N]
        self.float_output = False  # True: return float32 sums (an LM head's logits)

    def rows(self, ids: torch.Tensor | slice, dtype: torch.dtype) -> torch.Tensor:
        """Rows ``ids`` of the dequantized weight (a tensor, or a slice), ``[rows, in]``."""
        if self.native:
            q, s = self.weight[ids], self.scales[ids]
            w = q.reshape(q.shape[0], -1, self.group_size).float() * s.float().unsqueeze(-1)  # exact in float32
            return w.reshape(q.shape[0], self.in_features).to(dtype)
        q, s = self.weight[:, ids], self.scales[:, ids]
        w = q.to(dtype) * s.to(dtype).unsqueeze(-1)  # [K/g, rows, g]; q * s is exact before the one rounding
        return w.transpose(0, 1).reshape(w.shape[1], self.in_features)

    def matmul(self, x2: torch.Tensor) -> torch.Tensor:
        if self.native and x2.device.type == "cpu":
            # As the LM head (float_output), the float32 sums are the logits: rounding them to
            # bfloat16 first would tie near-equal candidates (SmolLM2's "The" / "L" for "Paris").
            out_dtype = torch.float32 if self.float_output else x2.dtype
            return _native_linear(self.group_ops, "int8", x2, self.weight, self.scales, None, self.bias, out_dtype)
        if (x2.device.type == "cpu" and x2.dtype == torch.bfloat16 and self.scales.dtype == torch.bfloat16
                and x2.shape[0] <= _INT8_GROUPED_KERNEL_MAX_ROWS):
            xg = x2.reshape(x2.shape[0], -1, self.group_size).transpose(0, 1).contiguous()  # [K/g, T, g]
            acc = torch.ops.aten._weight_int8pack_mm(xg[0], self.weight[0], self.scales[0]).float()
            for g in range(1, xg.shape[0]):
                acc += torch.ops.aten._weight_int8pack_mm(xg[g], self.weight[g], self.scales[g])
            y = acc if self.float_output and self.bias is None else acc.to(x2.dtype)
        else:
            y = F.linear(x2, self.dequantized_weight(x2.dtype))
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, int8 group {self.group_size}"
                f"{', native' if self.native else ''}")


class QuantizedEmbedding(nn.Module):
    """Token lookups from a quantized table (an :class:`Int8GroupedLinear` or a readable-layout
    :class:`Int4Linear`, ``[vocab, hidden]``): only the looked-up rows are dequantized. With tied
    embeddings the same module is the LM head, so the table is held once."""

    def __init__(self, table: nn.Module, dtype: torch.dtype):
        super().__init__()
        self.table = table
        self.dtype = dtype
        self.num_embeddings, self.embedding_dim = table.out_features, table.in_features

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.table.rows(ids.reshape(-1), self.dtype).reshape(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, quantized"


def quantize_model(model: nn.Module, quantization: str, group_size: int = INT4_GROUP_SIZE,
                   group_ops=None) -> nn.Module:
    """Replace every ``nn.Linear`` in ``model`` by its ``int8`` or ``int4`` twin, in place; ``none`` is a no-op.
    ``group_ops``: the native group kernels for the int4 layers (``--group-kernels``), or None."""
    if quantization in ("none", None):
        return model
    if quantization not in ("int8", "int4"):
        raise ValueError(f"quantization must be none, int8 or int4, got {quantization!r}")
    # A tied LM head gets its own quantized copy (57 MiB of bf16 read every step for qwen05-shape).
    replace_linears(model, Int8Linear.from_linear if quantization == "int8" else
                    functools.partial(Int4Linear.from_linear, group_size=group_size, group_ops=group_ops))
    return model


def weight_bytes(model: nn.Module) -> int:
    """Bytes of every stored weight (parameters and persistent buffers, scales included, and the
    opaque prepacked matrices of :class:`~pagedserve.models.packed.PackedLinear` layers). A tensor
    held by two modules (a quantized table that is both the embedding and the LM head) counts once.
    An LM head's screen (models/head_screen.py) counts too: its int8 copy, and the head's plain rows
    where only the screen keeps them (beside a prepacked head)."""
    packed = sum(getattr(m, "packed_nbytes", 0) for m in model.modules())
    tensors = list(model.state_dict().values())
    screen = getattr(model, "head_screen", None)
    if screen is not None:
        tensors += list(screen.buffers())
    return packed + sum(nbytes for _, nbytes in {(t.data_ptr(), t.nbytes) for t in tensors})
