"""GGUF checkpoints: metadata to ModelConfig, tensors dequantized by ggml-org's `gguf` package.

The header (metadata and tensor directory) is parsed here rather than by `gguf.GGUFReader`,
which builds a memory-mapped view for every part of every field: on a file with a 49,152-token
vocabulary and its merges that takes 3-8 s on a 2-core machine, every start. Reading the same
header with `struct` takes tens of milliseconds. Tensor data stay in a read-only memory map and
are dequantized by `gguf.quants`.

GGUF names tensors llama.cpp's way (`blk.3.attn_q.weight`); they are handed to the model under
Hugging Face names, through the file's family (kvserve/model/families/: Gemma's norms and
Phi-3's fused projections have their own names). For the `llama` architecture llama.cpp's
converter permutes the rows of q and k so that RoPE rotates interleaved pairs; we undo that
permutation at load and use the half-rotation RoPE everywhere (the other families' files are
stored unpermuted). Norm weights are stored as the factors they multiply by (Gemma's 1 + w
included), which is the form the model takes them in.
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize

from kvserve.model.config import ModelConfig
from kvserve.model.families import GGUF_ROPE_TENSORS, Family
from kvserve.model.families.gguf import config_from_gguf, family_of

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK = re.compile(r"blk\.(\d+)\.(.+)")


def field_value(fields: Any, key: str, default: Any = None) -> Any:
    """A scalar, string or array metadata value, or `default` when absent. `fields` maps keys to
    plain values (`read_header`) or to `gguf.GGUFReader` fields."""
    field = fields.get(key)
    if field is None:
        return default
    contents = getattr(field, "contents", None)
    return contents() if callable(contents) else field


GGUF_MAGIC = b"GGUF"
# GGUF value types -> struct formats (little-endian); 8 is a string, 9 an array.
_SCALARS = {
    0: "B",
    1: "b",
    2: "H",
    3: "h",
    4: "I",
    5: "i",
    6: "f",
    7: "?",
    10: "Q",
    11: "q",
    12: "d",
}
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?"}
_NUMPY |= {10: "<u8", 11: "<i8", 12: "<f8"}
_STRING, _ARRAY = 8, 9
_U64 = struct.Struct("<Q")


class GGUFFormatError(ValueError):
    """The file is not a GGUF file this reader understands (or is truncated)."""


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """One tensor of the directory: its GGML type, shape (GGML order: fastest axis first) and
    its bytes (a read-only view of the mapped file)."""

    name: str
    tensor_type: GGMLQuantizationType
    shape: np.ndarray  # GGML order, as gguf.ReaderTensor.shape
    data_offset: int  # from the start of the file
    data: np.ndarray  # uint8 [rows, row bytes] for block types, else the element type, flat

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)


@dataclass(frozen=True, slots=True)
class GGUFHeader:
    fields: dict[str, Any]  # key -> plain value (str, int, float, bool, list)
    tensors: list[TensorEntry]
    data_offset: int  # where tensor data start (aligned)


class _Cursor:
    def __init__(self, buffer: memoryview | bytes) -> None:
        self.buffer, self.pos = buffer, 0

    def take(self, fmt: str) -> Any:
        value = struct.unpack_from("<" + fmt, self.buffer, self.pos)[0]
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        return self.strings(1)[0]

    def strings(self, count: int) -> list[str]:
        """`count` strings in a row (a vocabulary: 150k tokens and as many merges), read in
        one loop of local names from bytes copies of the file's next stretch (decoding slices
        of bytes is quicker than of the mapped file's view): 0.34 s for a 150k vocabulary's
        header one string at a time, 0.11 s this way."""
        buffer, size = self.buffer, len(self.buffer)
        length_at = _U64.unpack_from
        decode = bytes.decode
        out = [""] * count
        index, base, need = 0, self.pos, 0
        while True:
            # a stretch from `base` that holds the strings left in the common case (16-byte
            # tokens and merges with their lengths) and at least the next one whole
            data = bytes(buffer[base : base + max(64 * (count - index), 256, need)])
            at, stop = 0, len(data)
            while index < count and at + 8 <= stop:
                (length,) = length_at(data, at)
                end = at + 8 + length
                if end > stop:
                    break
                out[index] = decode(data[at + 8 : end], "utf-8")
                index += 1
                at = end
            if index == count:
                self.pos = base + at
                return out
            if at + 8 > stop:  # the next length is not in the stretch
                if base + at + 8 > size:
                    raise GGUFFormatError("string runs past the end of the file")
                need = 8
            else:
                (length,) = length_at(data, at)
                if base + at + 8 + length > size:
                    raise GGUFFormatError("string runs past the end of the file")
                need = 8 + length
            base += at

    def value(self, vtype: int) -> Any:
        if vtype in _SCALARS:
            return self.take(_SCALARS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            item_type, count = self.take("I"), self.take("Q")
            if item_type in _NUMPY:
                dtype = np.dtype(_NUMPY[item_type])
                array = np.frombuffer(self.buffer, dtype, count, self.pos)
                self.pos += count * dtype.itemsize
                return array.tolist()
            if item_type == _STRING:
                return self.strings(count)
            return [self.value(item_type) for _ in range(count)]
        raise GGUFFormatError(f"unknown GGUF value type {vtype}")


def read_header(path: Path) -> GGUFHeader:
    """The metadata and tensor directory of a GGUF file (version 2 or 3, little-endian), with
    each tensor's data as a view of one read-only memory map of the file."""
    if path.stat().st_size < 24:  # magic, version and two counts
        raise GGUFFormatError(f"{path} is too short to be a GGUF file")
    mapped = np.memmap(path, dtype=np.uint8, mode="r")
    cursor = _Cursor(memoryview(mapped))
    try:
        if bytes(mapped[:4]) != GGUF_MAGIC:
            raise GGUFFormatError(f"{path} is not a GGUF file")
        cursor.pos = 4
        version = cursor.take("I")
        if version not in (2, 3):
            raise GGUFFormatError(f"GGUF version {version} is not supported (2 or 3)")
        num_tensors, num_fields = cursor.take("Q"), cursor.take("Q")
        fields: dict[str, Any] = {}
        for _ in range(num_fields):
            key = cursor.string()
            fields[key] = cursor.value(cursor.take("I"))
        infos = []
        for _ in range(num_tensors):
            name = cursor.string()
            dims = [cursor.take("Q") for _ in range(cursor.take("I"))]
            infos.append((name, dims, GGMLQuantizationType(cursor.take("I")), cursor.take("Q")))
    except GGUFFormatError:
        raise
    except (struct.error, ValueError) as exc:  # short reads, unknown types, bad UTF-8
        raise GGUFFormatError(f"{path}: unreadable GGUF header ({exc})") from exc
    alignment = int(fields.get("general.alignment", 32))
    data_offset = -(-cursor.pos // alignment) * alignment
    tensors = []
    for name, dims, qtype, offset in infos:
        block, type_size = GGML_QUANT_SIZES[qtype]
        count = int(np.prod(dims, dtype=np.int64))
        nbytes = count // block * type_size
        start = data_offset + offset
        if start + nbytes > len(mapped):
            raise GGUFFormatError(f"{path}: tensor {name} runs past the end of the file")
        raw = mapped[start : start + nbytes]
        if block > 1:
            data = raw.reshape(count // dims[0], dims[0] // block * type_size)
        else:
            data = raw.view(np.dtype(_NUMPY_OF_TYPE.get(qtype, np.uint8)))
        tensors.append(TensorEntry(name, qtype, np.array(dims, np.uint64), start, data))
    return GGUFHeader(fields, tensors, data_offset)


_NUMPY_OF_TYPE = {
    GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F64: np.float64,
    GGMLQuantizationType.BF16: np.int16,
}


def hf_name(gguf_name: str, family: Family) -> str | None:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`; None for unknown."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _BLOCK.fullmatch(gguf_name)
    if match:
        name = family.gguf_name(match.group(2))
        if name is not None:
            return f"model.layers.{match.group(1)}.{name}"
    return None


def config_from_fields(fields: Any, tensors: list[TensorEntry]) -> ModelConfig:
    """The ModelConfig of a GGUF header (its fields and tensor directory)."""
    rope = {}
    for tensor in tensors:
        if tensor.name in GGUF_ROPE_TENSORS:
            values = dequantize_tensor(tensor).float().reshape(-1)
            rope[tensor.name.removesuffix(".weight")] = tuple(values.tolist())
    return config_from_gguf(
        lambda key, default=None: field_value(fields, key, default),
        {t.name for t in tensors},
        rope,
    )


def unpermute_rope_rows(weight, num_heads: int):
    """Undo llama.cpp's q/k permutation: per head, rows [r0, r_half, r1, r_half+1, ...]
    (interleaved pairs) back to [first half | second half] (Hugging Face layout). `weight`: a
    tensor or a numpy array (a block-quantized weight's rows of bytes), whose type is kept."""
    rest = weight.shape[1:]
    head_dim = weight.shape[0] // num_heads
    rows = weight.reshape(num_heads, head_dim // 2, 2, *rest).swapaxes(1, 2).reshape(weight.shape)
    return rows.contiguous() if isinstance(rows, torch.Tensor) else np.ascontiguousarray(rows)


def dequantize_tensor(tensor: TensorEntry) -> torch.Tensor:
    """A GGUF tensor as float32 (or its native float type for F16/BF16), shape [rows, cols]."""
    qtype = tensor.tensor_type
    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    # F32/F16 data are read-only views of the mapped file: copy them (they are small: norms).
    if qtype == GGMLQuantizationType.F32:
        array = np.array(tensor.data, dtype=np.float32)
    elif qtype == GGMLQuantizationType.F16:
        array = np.array(tensor.data).view(np.float16)
    elif qtype == GGMLQuantizationType.BF16:
        raw = np.asarray(tensor.data).view(np.int16)
        return torch.from_numpy(raw.copy()).view(torch.bfloat16).reshape(shape)
    else:
        array = dequantize(tensor.data, qtype)
    return torch.from_numpy(np.ascontiguousarray(array)).reshape(shape)


class GGUFCheckpoint:
    """An opened GGUF file: its metadata, config and a name -> tensor source for the model."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.header = read_header(path)
        self.fields = self.header.fields
        self.family = family_of(field_value(self.fields, "general.architecture"))
        self.tensors: dict[str, TensorEntry] = {}
        for tensor in self.header.tensors:
            name = hf_name(tensor.name, self.family)
            if name is not None:
                self.tensors[name] = tensor
        self.config = config_from_fields(self.fields, self.header.tensors)
        self.quantization = sorted({t.tensor_type.name for t in self.header.tensors})

    def get(self, name: str) -> torch.Tensor | None:
        tensor = self.tensors.get(name)
        if tensor is None:
            return None
        return self._unpermuted(name, dequantize_tensor(tensor))

    def _unpermuted(self, name: str, rows):
        """The q/k rows of a llama file back in Hugging Face order (any other tensor as is).
        `rows`: a tensor or array whose first axis is the output rows."""
        if self.family.gguf_permuted_rope:
            if name.endswith(("self_attn.q_proj.weight", "self_attn.q_proj.bias")):
                return unpermute_rope_rows(rows, self.config.num_heads)
            if name.endswith(("self_attn.k_proj.weight", "self_attn.k_proj.bias")):
                return unpermute_rope_rows(rows, self.config.num_kv_heads)
        return rows

    def tensor_type(self, name: str) -> str | None:
        """The GGML type of a tensor by Hugging Face name ("Q4_1", "F32", ...), None if absent."""
        tensor = self.tensors.get(name)
        return None if tensor is None else tensor.tensor_type.name

    def raw_rows(self, name: str) -> np.ndarray:
        """A block-quantized weight's bytes as uint8 [rows, row bytes], rows in Hugging Face
        order (a view of the mapped file where no reordering is needed)."""
        tensor = self.tensors[name]
        return self._unpermuted(name, np.asarray(tensor.data))
