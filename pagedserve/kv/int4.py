"""int4 KV: keys per channel within each block with a zero point, each channel at its calibrated
bits, values rotated per token, and each sequence's open block kept in a float16 *tail* until it
fills — the layout ``examples/int4_kv_study.py`` chose (docs/QUANTIZATION.md: on SmolLM2 +0.24 %
perplexity at 0.289× bf16's bytes, needle recall level with float32's at 1k–7k).

One layer's K (or V) pool::

    data        [num_blocks, kv_heads, head_dim * block_size // 2] uint8 (K: bit planes, below)
                [num_blocks, block_size, kv_heads, head_dim // 2]  uint8 (V: two int4 codes a byte)
    key_bits    [kv_heads, head_dim]                uint8 (K only: each channel's bits, 1..8, 4 on average)
    scales      [num_blocks, kv_heads, head_dim]   float8 e4m3 (K: one step per block, head and channel)
                [num_blocks, block_size, kv_heads] float16      (V: one scale per token and head)
    zero_points [num_blocks, kv_heads, head_dim]   int8         (K only)
    tail        [tail_slots, block_size, kv_heads, head_dim] float16

Post-RoPE keys of Llama-family models keep a few channels far larger than the rest: a scale per
channel over the block's 16 keys gives each channel its own range, which a per-vector scale cannot.
Many of those channels also sit off zero (a slow RoPE pair barely turns in 16 positions), so each
channel is quantized *asymmetrically*, key = step · (code + zero_point) with codes 0..2^b - 1: a
symmetric scale spent half its levels on a side the channel never visits, and that cost SmolLM2 a
third of its needle recall (docs/QUANTIZATION.md). The step is stored as float8 e4m3 (rounded up:
2^-9 .. 448, three mantissa bits from 2^-6) and the zero point as int8 in steps, so a channel
costs two bytes, as the symmetric float16 scale did, and a token's bytes stay whole.

Channels are not equally worth their bits: a query leans on a few of them, and a wide one's range
costs more score error per level. Each channel c of a layer's KV head gets its own b_c bits (1..8,
4 on average: :mod:`pagedserve.engine.core.key_bits` calibrates them once per model; 4 each without it).
A block's keys of one head are stored as *bit planes*: for each channel, least significant bit
first, ``block_size`` bits saying which tokens' codes have that bit set, channel after channel —
``4 · head_dim · block_size`` bits whatever the mix, the bytes of 4-bit codes. A decode then scores
a block plane by plane: q_c · step_c · 2^p added to the tokens whose bit is set.
Values have no such channels; they are stored as before, per vector, rotated by the normalised
Hadamard matrix (:func:`~pagedserve.kv.quant.hadamard_matrix`), and attention rotates its output
back (``models.attention._attention``: in the stored basis).

A per-channel scale needs the block's 16 keys, so a block is quantized when it fills; until then
its K and V rows sit in a tail slot at float16. The query's nearest keys carry most of its
attention, which is why the tail is also the layout's largest gain. :class:`TailMap`, one per
engine and shared by every layer's pools, maps block id → tail slot (``-1``: quantized): a
sequence holds at most one open block (per KV group), so ``max_num_seqs`` slots suffice; the
block manager gives a slot back when a block's last holder frees it (:meth:`TailMap.release`).
Only full blocks enter the prefix cache, and those are quantized, so a prefix hit reads what the
first request wrote.

Prompt chunks read their own block exact (:meth:`Int4KVCache.own_block_rows`: the step's rows and
the block's earlier ones, at float16): each query then sees what it would see decoded, the earlier
blocks quantized and its own block exact, however the prompt was chunked. A decode whose token
fills its block reads that block from its tail slot too (:attr:`WritePlan.decode_slots`): the slot
is given back after the step (sooner only when no other is free).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from pagedserve.kv.quant import SCALE_DTYPE, dequantize_kv, hadamard_matrix, quantize_kv
from pagedserve.kv.zeros import zeros

# The layout's name in examples/int4_kv_study.py's terms, by how the key bits are chosen
# (config.INT4_KEY_BITS): a benchmark's journal of int4 answers (bench/retrieval.py) holds for one only.
LAYOUTS = {"calibrated": "kmix-vrot+tail", "uniform": "kzero-vrot+tail"}
TAIL_DTYPE = torch.float16
KEY_STEP_DTYPE = torch.float8_e4m3fn
KEY_BITS, MAX_KEY_BITS = 4, 8  # a key channel's bits: 4 on average over a head, 1..8 each
_E4M3_MIN, _E4M3_MAX = 2.0 ** -9, 448.0  # e4m3's smallest subnormal and largest finite value


@dataclass(frozen=True)
class WritePlan:
    """How one step's tokens (one ``slot_mapping``) land, worked out once on the host for every
    layer: blocks the step fills are quantized (their earlier rows from a tail slot, or
    dequantized where a rolled-back block is reopened), the others' rows go to tail slots."""

    full_blocks: torch.Tensor  # [F] blocks quantized this step
    full_slots: torch.Tensor  # [F] the tail slot holding each one's earlier rows (-1: none, or reopened)
    full_from_tail: torch.Tensor  # [Ft] indices into full_blocks whose earlier rows are in a tail slot ...
    full_tail_slots: torch.Tensor  # [Ft] ... this one
    full_from_pool: torch.Tensor  # [Fp] indices into full_blocks whose earlier rows are quantized (reopened)
    full_rows: torch.Tensor  # [R] row (index * block_size + offset) of each of the step's tokens in full blocks
    full_tokens: torch.Tensor  # [R] and which token it is
    reopen_blocks: torch.Tensor  # [O] quantized blocks written again mid-block (after a rollback) ...
    reopen_slots: torch.Tensor  # [O] ... dequantized into these tail slots first
    tail_rows: torch.Tensor  # [T] flat tail row (slot * block_size + offset) of each token in an open block
    tail_tokens: torch.Tensor  # [T]
    # Filled blocks' former tail slots, which keep their rows through the step (taken again only
    # when no other slot is free): a prompt chunk that finishes a block reads the block's earlier
    # rows exact from there (Int4KVCache.own_block_rows), and a decode that fills its block reads it
    # from there too (decode_slots: block -> slot as this step's decodes read them).
    filled_slots: dict[int, int]
    decode_slots: torch.Tensor
    reads_pool: bool  # a rolled-back block is reopened or refilled: its rows come from the quantized pool


class TailMap:
    """Which blocks are open (in a tail slot) and which slots are free, for every layer's pools."""

    def __init__(self, num_blocks: int, block_size: int, num_slots: int, device: torch.device, kv_groups: int = 1):
        if num_slots < 1:
            raise ValueError("an int4 KV cache needs at least one tail slot")
        self.block_size, self.num_slots, self.kv_groups = block_size, num_slots, kv_groups
        self.slot_of = torch.full((num_blocks,), -1, dtype=torch.long, device=device)
        self._slot_of = [-1] * num_blocks  # host copy: planning never waits on the device
        self._free = list(range(num_slots - 1, -1, -1))
        # Slots of blocks filled this step: read through the step (WritePlan.filled_slots), free for
        # the next. A step writes one slot mapping per KV group, so a step is kv_groups plans.
        self._resting: list[int] = []
        self._num_plans = 0
        self._plans: list[tuple[torch.Tensor, WritePlan]] = []  # this step's and the last, by slot mapping

    @property
    def num_open(self) -> int:
        return self.num_slots - len(self._free) - len(self._resting)

    def _set(self, changes: dict[int, int], slot_of: torch.Tensor | None = None) -> None:
        """Each changed block's slot into ``slot_of`` (the device map by default)."""
        slot_of = self.slot_of if slot_of is None else slot_of
        if changes:
            dev = slot_of.device
            slot_of[torch.tensor(list(changes)).to(dev)] = torch.tensor(list(changes.values())).to(dev)

    def _take(self, block: int, changes: dict[int, int], spare: list[int] | None = None) -> int:
        """A free slot for ``block``; with none, a slot of a block filled this step (``spare``: by
        this plan; else by another KV group's, whose plan then reads that block quantized)."""
        pool = self._free or spare or self._resting
        if not pool:
            raise RuntimeError(f"int4 KV: more open blocks than the {self.num_slots} tail slots "
                               "(sized by max_num_seqs)")
        slot = self._slot_of[block] = changes[block] = pool.pop()
        if pool is self._resting:
            for _, plan in self._plans:
                for b in [b for b, s in plan.filled_slots.items() if s == slot]:
                    del plan.filled_slots[b]
                    plan.decode_slots[b] = -1
        return slot

    def release(self, block_ids: Iterable[int]) -> None:
        """Blocks no sequence holds any more: their tail slots (if open) are free again. The block
        manager calls this as it frees, truncates or releases blocks."""
        changes: dict[int, int] = {}
        for b in block_ids:
            if self._slot_of[b] >= 0:
                self._free.append(self._slot_of[b])
                self._slot_of[b] = changes[b] = -1
        self._set(changes)

    def ensure_open(self, block_ids: list[int]) -> list[int]:
        """Tail slots for ``block_ids`` (copy-on-write targets), taking free ones where needed."""
        changes: dict[int, int] = {}
        slots = [self._slot_of[b] if self._slot_of[b] >= 0 else self._take(b, changes) for b in block_ids]
        self._set(changes)
        return slots

    def plan(self, slot_mapping: torch.Tensor) -> WritePlan:
        """The :class:`WritePlan` for a step's ``slot_mapping`` (negative slots: padding, skipped),
        made on the first layer's write and reused by the others."""
        for mapping, plan in self._plans:
            if mapping is slot_mapping:
                return plan
        if self._num_plans % self.kv_groups == 0:  # a new step: last step's filled blocks' slots are free
            self._free += self._resting
            self._resting = []
        self._num_plans += 1
        plan = self._make_plan(slot_mapping.tolist())
        self._plans = [*self._plans[1 - 2 * self.kv_groups:], (slot_mapping, plan)]
        return plan

    def _make_plan(self, slots: list[int]) -> WritePlan:
        bs = self.block_size
        rows: dict[int, list[tuple[int, int]]] = {}
        for i, s in enumerate(slots):
            if s >= 0:
                rows.setdefault(s // bs, []).append((i, s % bs))
        full = {b: r for b, r in rows.items() if any(o == bs - 1 for _, o in r)}
        lists: dict[str, list[int]] = {name: [] for name in WritePlan.__dataclass_fields__
                                       if name not in ("filled_slots", "decode_slots", "reads_pool")}
        changes: dict[int, int] = {}
        filled_slots = {b: self._slot_of[b] for b in full if self._slot_of[b] >= 0}
        released = list(filled_slots.values())  # free after this step, or in it if no other slot is
        for j, (b, r) in enumerate(full.items()):
            slot = self._slot_of[b]
            lists["full_slots"].append(slot)
            if slot >= 0:
                lists["full_from_tail"].append(j)
                lists["full_tail_slots"].append(slot)
                self._slot_of[b] = changes[b] = -1
            elif min(o for _, o in r) > 0:
                lists["full_from_pool"].append(j)
            lists["full_rows"] += [j * bs + o for _, o in r]
            lists["full_tokens"] += [i for i, _ in r]
        lists["full_blocks"] = list(full)
        for b, r in rows.items():
            if b in full:
                continue
            slot = self._slot_of[b]
            if slot < 0:  # (a slot taken from `released` is read, then written, in that order per layer)
                slot = self._take(b, changes, released)
                if min(o for _, o in r) > 0:  # written before, quantized since (a rollback): reopened
                    lists["reopen_blocks"].append(b)
                    lists["reopen_slots"].append(slot)
            lists["tail_rows"] += [slot * bs + o for _, o in r]
            lists["tail_tokens"] += [i for i, _ in r]
        self._set(changes)
        self._resting += released
        filled_slots = {b: s for b, s in filled_slots.items() if s in released}
        decode_slots = self.slot_of.clone() if filled_slots else self.slot_of
        self._set(filled_slots, decode_slots)
        dev = self.slot_of.device
        return WritePlan(**{k: torch.tensor(v, dtype=torch.long).to(dev) for k, v in lists.items()},
                         filled_slots=filled_slots, decode_slots=decode_slots,
                         reads_pool=bool(lists["full_from_pool"] or lists["reopen_blocks"]))


def uniform_key_bits(kv_heads: int, head_dim: int, device: torch.device | None = None) -> torch.Tensor:
    """4 bits for every key channel: the layout before calibration (engine/core/key_bits.py), and its bytes."""
    return torch.full((kv_heads, head_dim), KEY_BITS, dtype=torch.uint8, device=device)


def check_key_bits(bits: torch.Tensor, kv_heads: int, head_dim: int) -> None:
    """``bits`` must be uint8 ``[kv_heads, head_dim]``, each 1..8, ``4 · head_dim`` a head: any mix
    then fills exactly the bytes of 4 bits a channel."""
    if bits.dtype != torch.uint8 or tuple(bits.shape) != (kv_heads, head_dim):
        raise ValueError(f"key bits must be uint8 [{kv_heads}, {head_dim}], got {bits.dtype} {tuple(bits.shape)}")
    if int(bits.min()) < 1 or int(bits.max()) > MAX_KEY_BITS:
        raise ValueError(f"key bits must be 1..{MAX_KEY_BITS} a channel, got {int(bits.min())}..{int(bits.max())}")
    per_head = bits.sum(1, dtype=torch.long)
    if not (per_head == KEY_BITS * head_dim).all():
        raise ValueError(f"key bits must total {KEY_BITS * head_dim} a KV head, got {per_head.tolist()}")


def _planes_of_channels(bits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(plane ``[kv_heads, head_dim, 8]`` each channel's bit p lives in, and whether it has bit p):
    a head's planes run channel by channel, least significant bit first."""
    p = torch.arange(MAX_KEY_BITS, device=bits.device)
    b = bits.long()
    first = b.cumsum(1) - b
    return first.unsqueeze(-1) + p, p < b.unsqueeze(-1)


def _to_planes(codes: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """Key codes ``[n, block_size, kv_heads, head_dim]`` (integers in 0..2^bits - 1) → the block's bit
    planes, ``[n, kv_heads, head_dim * block_size // 2]`` bytes: bit ``plane · block_size + token`` of a
    head's bytes (least significant first) is that bit of the token's code in that plane's channel."""
    n, bs, kvh, hd = codes.shape
    per_bit = (codes.long().permute(0, 2, 3, 1).unsqueeze(3) >> torch.arange(MAX_KEY_BITS, device=codes.device)
               .view(-1, 1)) & 1  # [n, kvh, hd, 8, bs]
    _, has = _planes_of_channels(bits)
    planes = per_bit[:, has].view(n, kvh, KEY_BITS * hd * bs // 8, 8)  # channels and bits in plane order
    return (planes << torch.arange(8, device=codes.device)).sum(-1).to(torch.uint8)


def _from_planes(data: torch.Tensor, bits: torch.Tensor, block_size: int) -> torch.Tensor:
    """:func:`_to_planes`' bytes ``[..., kv_heads, bytes]`` (a pool's blocks, or a selection's
    ``[seqs, blocks, ...]``) back as codes ``[..., block_size, kv_heads, head_dim]``, float32: each
    plane's bits weighted by 2^p, summed over each channel's run of planes (a running sum read at
    the runs' ends: exact, codes stay far below 2^24)."""
    *lead, kvh, nbytes = data.shape
    n, hd, dev = data.numel() // (kvh * nbytes), bits.shape[1], data.device
    byte_bits = ((torch.arange(256, device=dev).unsqueeze(1) >> torch.arange(8, device=dev)) & 1).float()
    plane, has = _planes_of_channels(bits)
    weight = torch.zeros(kvh, KEY_BITS * hd, device=dev)  # 2^p for channel c's plane p
    powers = (2.0 ** torch.arange(MAX_KEY_BITS, device=dev)).expand_as(has)
    weight.scatter_(1, plane[has].view(kvh, -1), powers[has].view(kvh, -1))
    # (the plane count named: n may be 0)
    planes = byte_bits[data.reshape(n, kvh, nbytes).long()].view(n, kvh, KEY_BITS * hd, block_size)
    sums = F.pad((planes * weight.unsqueeze(-1)).cumsum(2), (0, 0, 1, 0))  # sums[:, :, j]: planes 0 .. j - 1

    def sum_before(j: torch.Tensor) -> torch.Tensor:
        return sums.gather(2, j.view(1, kvh, hd, 1).expand(n, -1, -1, block_size))

    first = plane[..., 0]
    codes = sum_before(first + bits.long()) - sum_before(first)  # [n, kvh, hd, block_size]
    return codes.permute(0, 3, 1, 2).reshape(*lead, block_size, kvh, hd)


def _e4m3_at_least(x: torch.Tensor) -> torch.Tensor:
    """``x >= 0`` as float8 e4m3, rounded up (a step rounded down would clip its channel's range; a
    zero one is the smallest, 2^-9)."""
    x = x.clamp(_E4M3_MIN, _E4M3_MAX)
    y = x.to(KEY_STEP_DTYPE)
    return torch.where(y.float() < x, (y.view(torch.uint8) + 1).view(KEY_STEP_DTYPE), y)


def quantize_key_blocks(x: torch.Tensor, bits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Whole key blocks ``[n, block_size, kv_heads, head_dim]`` (float32) → (bit planes, steps, zero
    points): per block, head and channel, ``key ≈ step · (code + zero_point)`` with the channel's
    ``bits [kv_heads, head_dim]`` a code (codes 0 .. 2^bits - 1)."""
    lo, hi = x.amin(dim=1), x.amax(dim=1)  # [n, kv_heads, head_dim]
    levels = (2.0 ** bits.float() - 1).to(x.device)
    # The step spans the channel's range in its levels, and is large enough that |lo| / step fits
    # int8; a zero point rounded to the nearest step then clips at most half a step at either end.
    step = torch.maximum((hi - lo) / levels, torch.maximum(lo.abs(), hi.abs()) / 127)
    steps = _e4m3_at_least(step)
    real = steps.float()  # what dequantizing multiplies by
    zero_points = (lo / real).round().clamp(-128, 127).to(torch.int8)
    codes = torch.minimum((x / real.unsqueeze(1) - zero_points.float().unsqueeze(1)).round().clamp(min=0), levels)
    return _to_planes(codes, bits), steps, zero_points


def key_block_values(data: torch.Tensor, steps: torch.Tensor, zero_points: torch.Tensor,
                     bits: torch.Tensor) -> torch.Tensor:
    """:func:`quantize_key_blocks`' output back as float32 keys ``[n, block_size, kv_heads, head_dim]``."""
    block_size = 8 * data.shape[-1] // (KEY_BITS * bits.shape[1])
    return (_from_planes(data, bits, block_size) + zero_points.float().unsqueeze(-3)) * steps.float().unsqueeze(-3)


@dataclass
class Int4KVCache:
    """One layer's K (``per_channel``) or V (rotated, per token) pool in the int4 layout; the
    selected blocks of one (``cache[block_ids]``, with their ``slots``) read the same way."""

    data: torch.Tensor
    scales: torch.Tensor
    tail: torch.Tensor
    tails: TailMap
    per_channel: bool
    out_dtype: torch.dtype
    rotation: torch.Tensor | None = None  # V: [head_dim, head_dim] float32
    zero_points: torch.Tensor | None = None  # K: [blocks, kv_heads, head_dim] int8
    key_bits: torch.Tensor | None = None  # K: [kv_heads, head_dim] uint8, each channel's bits (check_key_bits)
    slots: torch.Tensor | None = None  # a selection's tail slots (-1: quantized); None for the pool
    read_slots: torch.Tensor | None = None  # block -> slot as read (decode_view), else tails.slot_of
    fresh: torch.Tensor | None = None  # the last write's rows, float16, as stored
    plan: WritePlan | None = None  # and its plan
    # The loaded native kernels (kernels/kv_write.cpp): int4_kv_write does write()'s work in one
    # call, int4_key_values reads key blocks back, the same bits; None: the torch ops below (no
    # native kernels, or another device).
    native: object | None = None

    @classmethod
    def allocate_pair(cls, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, out_dtype: torch.dtype,
                      device: torch.device, tails: TailMap,
                      native: object | None = None) -> tuple[Int4KVCache, Int4KVCache]:
        """A layer's K and V pools (all zero, no block open) over the engine's shared ``tails``, the
        keys at 4 bits a channel (:meth:`with_key_bits`: a layer's own)."""
        if head_dim % 2:
            raise ValueError(f"int4 KV packs two values per byte and needs an even head_dim, got {head_dim}")
        data = (num_blocks, block_size, num_kv_heads, head_dim // 2)
        tail = (tails.num_slots, block_size, num_kv_heads, head_dim)
        per_channel = (num_blocks, num_kv_heads, head_dim)
        planes = (num_blocks, num_kv_heads, head_dim * block_size // 2)  # the same bytes as `data`
        k = cls(zeros(planes, torch.uint8, device), zeros(per_channel, KEY_STEP_DTYPE, device),
                zeros(tail, TAIL_DTYPE, device), tails, True, out_dtype,
                zero_points=zeros(per_channel, torch.int8, device),
                key_bits=uniform_key_bits(num_kv_heads, head_dim, device),
                native=native)
        v = cls(zeros(data, torch.uint8, device), zeros(data[:3], SCALE_DTYPE, device), zeros(tail, TAIL_DTYPE, device),
                tails, False, out_dtype, hadamard_matrix(head_dim, device=device), native=native)
        return k, v

    def with_key_bits(self, key_bits: torch.Tensor) -> Int4KVCache:
        """This K pool's storage read and written with ``key_bits`` a channel (a layer's calibrated
        bits, kv/int4.py's ``check_key_bits``): blocks written before hold other bits, so only an
        empty pool (or a KV group's layer, whose blocks are its own) takes them."""
        check_key_bits(key_bits, *self.shape[2:])
        return replace(self, key_bits=key_bits.to(self.data.device))

    @property
    def shape(self) -> torch.Size:
        """The logical shape: ``[blocks, block_size, kv_heads, head_dim]``."""
        return torch.Size((self.data.shape[0], *self.tail.shape[1:]))

    @property
    def nbytes(self) -> int:
        """Bytes held: blocks, scales (K: steps and zero points) and tail slots."""
        return sum(t.nbytes for t in (self.data, self.scales, self.tail, self.zero_points) if t is not None)

    def _store(self, ids: torch.Tensor, x: torch.Tensor) -> None:
        """Quantize whole blocks ``x [n, block_size, kv_heads, head_dim]`` (float32, as stored) into ``ids``."""
        if self.per_channel:
            self.data[ids], self.scales[ids], self.zero_points[ids] = quantize_key_blocks(x, self.key_bits)
        else:
            self.data[ids], self.scales[ids] = quantize_kv(x, "int4")

    def _values(self, ids: torch.Tensor | slice = slice(None)) -> torch.Tensor:
        """Quantized blocks ``ids`` of this pool or selection as float32 values, as stored (V still rotated)."""
        if not self.per_channel:
            return dequantize_kv(self.data[ids], self.scales[ids], "int4", torch.float32)
        data, steps, zero_points = self.data[ids], self.scales[ids], self.zero_points[ids]
        if self.native is None:
            return key_block_values(data, steps, zero_points, self.key_bits)
        values = self.native.int4_key_values(data.flatten(0, -3), steps.flatten(0, -3), zero_points.flatten(0, -3),
                                             self.key_bits)
        return values.view(*data.shape[:-2], *values.shape[1:])

    def write(self, slot_mapping: torch.Tensor, x: torch.Tensor) -> None:
        """Store ``x [T, kv_heads, head_dim]``: token i at flat slot ``slot_mapping[i]`` (:class:`WritePlan`)."""
        p = self.plan = self.tails.plan(slot_mapping)
        # At the tail's precision from the start: a block's bits, and what a query reads of its own
        # block, are then the same however its rows arrived (one chunk, several, or decodes).
        x16 = self.fresh = (x if self.rotation is None else self.rotate(x)).to(TAIL_DTYPE)
        if self.native is not None and not p.reads_pool:
            zero_points = self.zero_points if self.per_channel else self.data.new_empty(0, dtype=torch.int8)
            key_bits = self.key_bits if self.per_channel else self.data.new_empty(0)
            self.native.int4_kv_write(x16.contiguous(), self.tail, self.data, self.scales, zero_points, key_bits,
                                      p.full_blocks, p.full_slots, p.full_rows, p.full_tokens, p.tail_rows,
                                      p.tail_tokens)
            return
        x = x16.float()
        bs, kvh, hd = self.shape[1:]
        if p.full_blocks.numel():
            rows = torch.zeros(p.full_blocks.numel(), bs, kvh, hd, device=x.device)
            rows[p.full_from_tail] = self.tail[p.full_tail_slots].float()
            rows[p.full_from_pool] = self._values(p.full_blocks[p.full_from_pool])
            rows.view(-1, kvh, hd)[p.full_rows] = x[p.full_tokens]
            self._store(p.full_blocks, rows)
            # whole in its slot too, for this step's decodes (WritePlan.decode_slots)
            self.tail[p.full_tail_slots] = rows[p.full_from_tail].to(TAIL_DTYPE)
        if p.reopen_blocks.numel():
            self.tail[p.reopen_slots] = self._values(p.reopen_blocks).to(TAIL_DTYPE)
        self.tail.view(-1, kvh, hd)[p.tail_rows] = x[p.tail_tokens].to(TAIL_DTYPE)

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        """Rows ``[..., head_dim]`` times :attr:`rotation`, float32: the native kernel where this pool
        writes through one (each row summed in one order, so the decode stack's rotations and the
        Python path's are the same bits), else torch's matmul."""
        if self.native is not None:
            return self.native.int4_rotate(x, self.rotation)
        return x.float() @ self.rotation

    def own_block_rows(self, start: int, count: int, lead: int, block: int) -> torch.Tensor:
        """A prompt chunk's rows at the tail's precision, float32: the ``lead`` rows its first
        ``block`` held before the chunk (from its tail slot, which keeps them through the step
        even if the chunk filled the block), then rows ``start .. start + count`` of the last
        write. In the model's basis for a pool read rotated back (:meth:`dequantize`), as stored
        for a :meth:`stored_basis` view."""
        rows = self.fresh[start:start + count].float()
        if lead:
            slot = self.plan.filled_slots.get(block, self.tails._slot_of[block])
            before = (self.tail[slot, :lead].float() if slot >= 0  # else reopened and filled at once: as quantized
                      else self._values(slice(block, block + 1))[0, :lead])
            rows = torch.cat([before, rows])
        return rows if self.rotation is None else rows @ self.rotation

    def __getitem__(self, block_ids) -> Int4KVCache:
        """The selected blocks (``cache[block_table]``), still quantized, with their tail slots."""
        pick = {} if self.zero_points is None else {"zero_points": self.zero_points[block_ids]}
        return replace(self, data=self.data[block_ids], scales=self.scales[block_ids],
                       slots=self.tail_slots()[block_ids], **pick)

    def tail_slots(self) -> torch.Tensor:
        """``[num_blocks]``: each block's tail slot as this view reads it (-1: quantized)."""
        return self.tails.slot_of if self.read_slots is None else self.read_slots

    def decode_kernel_pools(self, v: Int4KVCache) -> tuple[torch.Tensor, ...]:
        """This key pool's and value pool ``v``'s tensors in the order ``paged_decode_attention_int4``
        takes them (kernels/kernel_ops.h), its tail slots as this view reads them."""
        return (self.data, v.data, self.scales, self.zero_points, self.key_bits, v.scales, self.tail, v.tail,
                self.tail_slots())

    def decode_view(self) -> Int4KVCache:
        """The pool as this step's decodes read it: a block their write filled is still read from
        its tail slot (the decode's own block, exact, as in the simulation); prompt chunks read it
        quantized and their own block from :meth:`own_block_rows`."""
        return self if self.plan is None else replace(self, read_slots=self.plan.decode_slots)

    def __setitem__(self, block_ids, blocks: Int4KVCache) -> None:
        """Copy-on-write: ``block_ids`` become copies of ``blocks``, open ones in tail slots of their own."""
        self.data[block_ids], self.scales[block_ids] = blocks.data, blocks.scales
        if self.zero_points is not None:
            self.zero_points[block_ids] = blocks.zero_points
        dst = torch.as_tensor(block_ids).reshape(-1)
        open_src = blocks.slots.reshape(-1) >= 0
        if open_src.any():
            slots = self.tails.ensure_open(dst[open_src.to(dst.device)].tolist())
            self.tail[torch.tensor(slots, device=self.tail.device)] = self.tail[blocks.slots.reshape(-1)[open_src]]

    def dequantize(self) -> torch.Tensor:
        """A selection's values in ``out_dtype``, open blocks from their tail, V rotated back."""
        values = self._values()
        if self.slots is not None:
            open_ = self.slots >= 0
            values[open_] = self.tail[self.slots[open_]].float()
        if self.rotation is not None:
            values = values @ self.rotation
        return values.to(self.out_dtype)

    def stored_basis(self) -> Int4KVCache:
        """The same storage read as stored (V rotated), in float32: attention rotates its output
        back instead of every value row (``models.attention._attention``)."""
        return replace(self, rotation=None, out_dtype=torch.float32)
