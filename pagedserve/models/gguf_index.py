"""A GGUF file's tensors and scalar metadata, without parsing its arrays: what loading weights needs.

``gguf.GGUFReader`` builds a numpy view for every element of every metadata array. A chat
model's vocabulary is two such arrays (SmolLM2: 49,152 tokens and 48,900 merges), which costs
the reader over 4 s of CPU on every load, although a load needs only the tensors: the tokenizer
was converted once, when the file's prepared directory was made (:mod:`pagedserve.models.gguf`).
This index walks the header with ``struct``, steps over each array by its items' sizes, keeps the
scalar and string values, and describes the tensors exactly as ``GGUFReader`` does
(``gguf.gguf_reader.ReaderTensor``, data memory-mapped), so the loader takes either.
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
from gguf import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGUF_MAGIC, GGMLQuantizationType, quant_shape_to_byte_shape
from gguf.gguf_reader import READER_SUPPORTED_VERSIONS, ReaderTensor

# GGUF metadata value types (the spec's numbering): struct format of each fixed-size one.
_STRING, _ARRAY = 8, 9
_SCALAR_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
# Tensor types whose data GGUFReader views as their own numpy dtype; every other type as bytes.
_ELEMENT_DTYPES = {GGMLQuantizationType.F16: np.float16, GGMLQuantizationType.F32: np.float32,
                   GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
                   GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
                   GGMLQuantizationType.I64: np.int64}


class ScalarField(NamedTuple):
    """One scalar or string metadata value; ``contents()`` as ``gguf.ReaderField`` gives it."""

    value: Any

    def contents(self) -> Any:
        return self.value


class GGUFTensorIndex:
    """``fields`` (scalar and string metadata only: array-valued keys are left out) and ``tensors``
    (``ReaderTensor``, as ``GGUFReader.tensors``) of a little-endian GGUF file (versions 2 and 3)."""

    def __init__(self, path: str | Path):
        self.fields: dict[str, ScalarField] = {}
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            infos, self.data_offset = self._parse_header(buf)
        self.data = np.memmap(path, mode="r")
        self.tensors = [self._tensor(name, *info) for name, info in infos.items()]

    def _parse_header(self, buf: mmap.mmap) -> tuple[dict[str, tuple[list[int], int, int]], int]:
        magic, version, tensor_count, kv_count = struct.unpack_from("<IIQQ", buf, 0)
        if magic != GGUF_MAGIC:
            raise ValueError("GGUF magic invalid")
        if version not in READER_SUPPORTED_VERSIONS:  # a big-endian file reads as a huge version here
            raise ValueError(f"GGUF version {version} is not supported here (little-endian versions "
                             f"{', '.join(map(str, READER_SUPPORTED_VERSIONS))} are)")
        offs = 24

        def string(at: int) -> tuple[str, int]:
            (n,) = struct.unpack_from("<Q", buf, at)
            return bytes(buf[at + 8:at + 8 + n]).decode("utf-8"), at + 8 + n

        for _ in range(kv_count):
            key, offs = string(offs)
            (kind,) = struct.unpack_from("<I", buf, offs)
            offs += 4
            if kind == _STRING:
                value, offs = string(offs)
                self.fields[key] = ScalarField(value)
            elif kind == _ARRAY:
                offs = self._skip_array(buf, offs)
            elif kind in _SCALAR_FORMATS:
                fmt = "<" + _SCALAR_FORMATS[kind]
                (value,) = struct.unpack_from(fmt, buf, offs)
                self.fields[key] = ScalarField(value)
                offs += struct.calcsize(fmt)
            else:
                raise ValueError(f"GGUF metadata {key!r} has an unknown value type {kind}")
        infos = {}  # name -> (dims, type, offset), in the file's order
        for _ in range(tensor_count):
            name, offs = string(offs)
            if name in infos:
                raise ValueError(f"Found duplicated tensor with name {name}")
            (n_dims,) = struct.unpack_from("<I", buf, offs)
            dims = list(struct.unpack_from(f"<{n_dims}Q", buf, offs + 4))
            infos[name] = (dims, *struct.unpack_from("<IQ", buf, offs + 4 + 8 * n_dims))
            offs += 4 + 8 * n_dims + 12
        alignment = int(self.fields.get("general.alignment", ScalarField(GGUF_DEFAULT_ALIGNMENT)).value)
        if alignment <= 0 or alignment & (alignment - 1):
            raise ValueError("Invalid alignment: must be a non-zero power of two")
        return infos, offs + (-offs % alignment)

    @staticmethod
    def _skip_array(buf: mmap.mmap, offs: int) -> int:
        """The offset just past the array at ``offs`` (its item type, count, items)."""
        kind, count = struct.unpack_from("<IQ", buf, offs)
        offs += 12
        if kind in _SCALAR_FORMATS:
            return offs + count * struct.calcsize("<" + _SCALAR_FORMATS[kind])
        if kind == _STRING:
            for _ in range(count):
                offs += 8 + struct.unpack_from("<Q", buf, offs)[0]
            return offs
        if kind == _ARRAY:
            for _ in range(count):
                offs = GGUFTensorIndex._skip_array(buf, offs)
            return offs
        raise ValueError(f"GGUF metadata array of unknown value type {kind}")

    def _tensor(self, name: str, dims: list[int], kind: int, offset: int) -> ReaderTensor:
        ggml_type = GGMLQuantizationType(kind)
        n_elems = int(np.prod(dims))
        block_size, type_size = GGML_QUANT_SIZES[ggml_type]
        n_bytes = n_elems * type_size // block_size
        start = self.data_offset + offset
        np_dims = tuple(reversed(dims))
        item_type = _ELEMENT_DTYPES.get(ggml_type)
        if item_type is None:  # a quantized type (or BF16): rows of bytes, as GGUFReader has them
            item_type, np_dims = np.uint8, quant_shape_to_byte_shape(np_dims, ggml_type)
        data = self.data[start:start + n_bytes].view(dtype=item_type).reshape(np_dims)  # n_bytes: whole items
        return ReaderTensor(name=name, tensor_type=ggml_type, shape=np.array(dims, dtype=np.uint64),
                            n_elements=n_elems, n_bytes=n_bytes, data_offset=start, data=data, field=None)
