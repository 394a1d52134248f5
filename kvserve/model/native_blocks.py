"""Checked wrappers of the block-format kernels (kvserve/model/csrc/blocks_gemm.c, blocks.h).

As everywhere in kvserve.model.native, the C code trusts what it is handed: shapes, dtypes,
contiguity and every pointer's extent are checked here first (`KernelInputError`, and nothing
runs), and a call with zero rows returns its empty result without entering C.

Weights are GGUF blocks repacked into panels of 16 output columns (`pack`); activations are
blocks of 32 int8 values with a float32 scale and the sums of each 16 (`ActivationBlocks`, made
by `quantize`, `add_rmsnorm` or `silu_mul`); `gemm` multiplies them, several weights with the
same inputs in one call.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from typing import NamedTuple

import numpy as np
import torch

from kvserve.model.native import FLOAT_DTYPES, _ptr, _require, _suffix, _tensor, library

PANEL = 16  # output columns per packed panel
ACT_BLOCK = 32  # activation values per scale


@dataclass(frozen=True, slots=True)
class BlockFormat:
    """A GGUF block format as the kernels know it."""

    name: str
    ggml_type: int  # ggml.h's enum ggml_type
    values: int  # inputs per block
    gguf_bytes: int  # bytes per block in the file
    record_bytes: int  # bytes per packed record (one block of 16 columns)


FORMATS = {
    f.name: f
    for f in (
        BlockFormat("Q4_0", 2, 32, 18, 288),
        BlockFormat("Q4_1", 3, 32, 20, 320),
        BlockFormat("Q5_0", 6, 32, 22, 352),
        BlockFormat("Q5_1", 7, 32, 24, 384),
        BlockFormat("Q8_0", 8, 32, 34, 544),
        BlockFormat("Q4_K", 12, 256, 144, 2368),
        BlockFormat("Q5_K", 13, 256, 176, 2880),
        BlockFormat("Q6_K", 14, 256, 210, 3360),
    )
}
_BY_TYPE = {f.ggml_type: f for f in FORMATS.values()}

ISAS = {3: "AVX512-VNNI", 2: "AVX-VNNI", 1: "AVX2"}  # kvserve_blocks_isa's answers


class WeightStruct(ctypes.Structure):
    """kvserve_blocks_weight in blocks.h."""

    _fields_ = [
        ("packed", ctypes.c_void_p),
        ("bias", ctypes.c_void_p),
        ("n", ctypes.c_int64),
        ("format", ctypes.c_int64),
    ]


def declare(lib: ctypes.CDLL) -> None:
    """Set the argument types of the block-format kernels on the loaded library."""
    p, i64, f32, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
    signatures = {
        "kvserve_blocks_isa": ([], i32),
        "kvserve_blocks_block_values": ([i64], i64),
        "kvserve_blocks_gguf_bytes": ([i64], i64),
        "kvserve_blocks_record_bytes": ([i64], i64),
        "kvserve_blocks_pack": ([i64, p, i64, i64, p, i32], i32),
        "kvserve_blocks_unpack": ([i64, p, i64, i64, p, i32], i32),
        "kvserve_blocks_quantize_f32": ([p, i64, i64, i64, p, p, p, p, i32], None),
        "kvserve_blocks_quantize_bf16": ([p, i64, i64, i64, p, p, p, p, i32], None),
        "kvserve_blocks_add_rmsnorm": ([p, p, p, i64, i64, f32, p, p, p, p, i32], None),
        "kvserve_blocks_silu_mul": ([p, i64, i64, p, p, p, p, i32], None),
        "kvserve_blocks_gemm": ([p, p, p, p, i64, i64, p, i64, p, i64, i32], i32),
    }
    for name, (argtypes, restype) in signatures.items():
        fn = getattr(lib, name)
        fn.argtypes = argtypes
        fn.restype = restype
    # The Python table must be the C one: a mismatch would mis-size every check below.
    for f in FORMATS.values():
        got = (
            lib.kvserve_blocks_block_values(f.ggml_type),
            lib.kvserve_blocks_gguf_bytes(f.ggml_type),
            lib.kvserve_blocks_record_bytes(f.ggml_type),
        )
        if got != (f.values, f.gguf_bytes, f.record_bytes):
            raise RuntimeError(f"blocks_gemm.c's {f.name} is {got}, not as native_blocks.py says")


@cache
def isa() -> str | None:
    """The instructions the block product was built with, or None: not built here (no AVX2,
    or no C compiler), and the caller keeps a float path."""
    lib = library()
    return None if lib is None else ISAS.get(lib.kvserve_blocks_isa())


def available() -> bool:
    """Whether the block product runs here."""
    return isa() is not None


def _lib() -> ctypes.CDLL:
    lib = library()
    _require(lib is not None, "the block kernels need the C kernels, which are not built here")
    return lib


def block_format(qtype: str) -> BlockFormat:
    """The format named `qtype` ("Q4_K", ...); KernelInputError for one the kernels lack."""
    f = FORMATS.get(qtype)
    _require(f is not None, f"no block kernel for {qtype!r} (known: {', '.join(FORMATS)})")
    return f


def packed_shape(qtype: str, n: int, k: int) -> tuple[int, int, int]:
    """The packed weight's shape: (panels of 16 columns, blocks, record bytes)."""
    f = block_format(qtype)
    return -(-n // PANEL), k // f.values, f.record_bytes


def _raw_array(raw: np.ndarray | torch.Tensor) -> np.ndarray:
    if isinstance(raw, torch.Tensor):
        _require(raw.device.type == "cpu", f"raw blocks must be on the CPU, not {raw.device}")
        raw = raw.numpy()
    _require(isinstance(raw, np.ndarray), "raw blocks must be a numpy array or a tensor")
    _require(raw.dtype == np.uint8 and raw.ndim == 2, "raw blocks must be uint8 [rows, row bytes]")
    return np.ascontiguousarray(raw)


def pack(qtype: str, raw: np.ndarray | torch.Tensor) -> torch.Tensor:
    """GGUF rows of blocks (uint8 [n, row bytes], row c = output column c, as
    `GGUFCheckpoint.raw_rows` gives them) in the kernel's layout: uint8 [ceil(n / 16), blocks,
    record bytes]. A read-only memory map is read, never copied whole."""
    f = block_format(qtype)
    raw = _raw_array(raw)
    n, row_bytes = raw.shape
    _require(
        n > 0 and row_bytes > 0 and row_bytes % f.gguf_bytes == 0,
        f"a {qtype} weight of {n} rows of {row_bytes} bytes is not whole blocks of "
        f"{f.gguf_bytes} bytes",
    )
    k = row_bytes // f.gguf_bytes * f.values
    packed = torch.empty(packed_shape(qtype, n, k), dtype=torch.uint8)
    status = _lib().kvserve_blocks_pack(
        f.ggml_type, raw.ctypes.data, n, k, packed.data_ptr(), torch.get_num_threads()
    )
    _require(status == 0, f"the packing kernel refused a {qtype} weight [{n}, {k}]")
    return packed


def _check_packed(qtype: str, packed: torch.Tensor, n: int, k: int) -> BlockFormat:
    f = block_format(qtype)
    _require(n > 0, f"a packed weight needs output columns, not {n}")
    _require(
        k > 0 and k % f.values == 0,
        f"the inner size {k} is not whole {qtype} blocks of {f.values}",
    )
    _tensor(packed, f"packed {qtype} weight", 3, (torch.uint8,), shape=packed_shape(qtype, n, k))
    return f


def unpack(qtype: str, packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """A packed weight back as float32 [n, k], with ggml's arithmetic (equal to
    `gguf.quants.dequantize` of the file's blocks)."""
    f = _check_packed(qtype, packed, n, k)
    out = torch.empty(n, k, dtype=torch.float32)
    status = _lib().kvserve_blocks_unpack(
        f.ggml_type, packed.data_ptr(), n, k, out.data_ptr(), torch.get_num_threads()
    )
    _require(status == 0, f"the unpacking kernel refused a {qtype} weight [{n}, {k}]")
    return out


class ActivationBlocks(NamedTuple):
    """Rows in blocks of 32: values ~= q * scales per block, q in -127..127 (8 bits); in the
    finer form (`rest` given, 12 bits), values ~= (16 q + rest) * scales with rest in -8..8.
    `sums` holds the sums of the integer values (q, or 16 q + rest) over each 16 values (the
    kernels' offset terms)."""

    q: torch.Tensor  # [rows, k] int8
    scales: torch.Tensor  # [rows, k / 32] float32
    sums: torch.Tensor  # [rows, k / 16] int32
    rest: torch.Tensor | None = None  # [rows, k] int8, the finer form only

    @property
    def rows(self) -> int:
        return self.q.shape[0]

    @property
    def fine(self) -> bool:
        return self.rest is not None

    def integers(self) -> torch.Tensor:
        """The integer value of each activation, int32 [rows, k]."""
        q = self.q.to(torch.int32)
        return q if self.rest is None else 16 * q + self.rest.to(torch.int32)

    def dequantize(self) -> torch.Tensor:
        """The values the product sees, as float64 [rows, k] (a test reference)."""
        rows, k = self.q.shape
        blocks = self.integers().double().view(rows, k // ACT_BLOCK, ACT_BLOCK)
        return (blocks * self.scales.double()[..., None]).view(rows, k)


def _blocks_out(rows: int, k: int, fine: bool) -> ActivationBlocks:
    _require(k > 0 and k % ACT_BLOCK == 0, f"a row of {k} values is not whole blocks of 32")
    return ActivationBlocks(
        torch.empty(rows, k, dtype=torch.int8),
        torch.empty(rows, k // ACT_BLOCK, dtype=torch.float32),
        torch.empty(rows, k // 16, dtype=torch.int32),
        torch.empty(rows, k, dtype=torch.int8) if fine else None,
    )


def _out_pointers(out: ActivationBlocks | None) -> tuple:
    if out is None:
        return None, None, None, None
    return out.q.data_ptr(), _ptr(out.rest), out.scales.data_ptr(), out.sums.data_ptr()


def quantize(x: torch.Tensor, fine: bool = False) -> ActivationBlocks:
    """Activation blocks of x: [rows, k] float32 or bfloat16 (rows may be strided, each row
    contiguous), k a multiple of 32; 8 bits a value, or 12 with `fine`."""
    _tensor(x, "x", 2, FLOAT_DTYPES, contiguous=False)
    rows, k = x.shape
    _require(x.stride(1) == 1 or k <= 1, "x's rows must be contiguous")
    out = _blocks_out(rows, k, fine)
    if rows == 0:
        return out
    getattr(_lib(), "kvserve_blocks_quantize" + _suffix(x))(
        x.data_ptr(), rows, k, x.stride(0), *_out_pointers(out), torch.get_num_threads()
    )
    return out


def add_rmsnorm(
    x: torch.Tensor,
    delta: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    normalize: bool = True,
    fine: bool = False,
) -> ActivationBlocks | None:
    """In place x += delta (when given); then, with `normalize`, the activation blocks of
    rmsnorm(x) * weight (12 bits with `fine`). x, delta: [rows, hidden] float32 contiguous;
    weight: [hidden]."""
    _tensor(x, "x", 2, (torch.float32,))
    rows, hidden = x.shape
    if delta is not None:
        _tensor(delta, "delta", 2, (torch.float32,), shape=(rows, hidden))
    _tensor(weight, "norm weight", 1, (torch.float32,), shape=(hidden,))
    out = _blocks_out(rows, hidden, fine) if normalize else None
    if rows == 0:
        return out
    _lib().kvserve_blocks_add_rmsnorm(
        x.data_ptr(),
        _ptr(delta),
        weight.data_ptr(),
        rows,
        hidden,
        eps,
        *_out_pointers(out),
        torch.get_num_threads(),
    )
    return out


def silu_mul(gate_up: torch.Tensor, fine: bool = False) -> ActivationBlocks:
    """The activation blocks of silu(gate) * up from the gate|up product [rows, 2 * width]
    float32 contiguous (gate columns first); 12 bits with `fine`."""
    _tensor(gate_up, "gate|up", 2, (torch.float32,))
    rows, double = gate_up.shape
    _require(double % 2 == 0, "the gate|up product must have an even number of columns")
    out = _blocks_out(rows, double // 2, fine)
    if rows == 0:
        return out
    _lib().kvserve_blocks_silu_mul(
        gate_up.data_ptr(), rows, double // 2, *_out_pointers(out), torch.get_num_threads()
    )
    return out


class Part(NamedTuple):
    """One packed weight of a product: its format, packed tensor, output columns, bias."""

    qtype: str
    packed: torch.Tensor
    n: int
    bias: torch.Tensor | None = None


def gemm(x: ActivationBlocks, parts: Sequence[Part]) -> torch.Tensor:
    """x's rows times each part's weight transposed, the parts' columns side by side:
    float32 [rows, sum of n] (+ each part's bias). Every part has x's k inputs."""
    _require(available(), "the block product needs the C kernels and AVX2")
    _tensor(x.q, "activation values", 2, (torch.int8,))
    rows, k = x.q.shape
    _require(k > 0 and k % ACT_BLOCK == 0, f"the product's inner size {k} must be whole blocks")
    _tensor(x.scales, "activation scales", 2, (torch.float32,), shape=(rows, k // ACT_BLOCK))
    _tensor(x.sums, "activation sums", 2, (torch.int32,), shape=(rows, k // 16))
    if x.rest is not None:
        _tensor(x.rest, "activation rests", 2, (torch.int8,), shape=(rows, k))
    _require(len(parts) > 0, "a product needs at least one weight")
    table = (WeightStruct * len(parts))()
    for entry, part in zip(table, parts, strict=True):
        f = _check_packed(part.qtype, part.packed, part.n, k)
        if part.bias is not None:
            _tensor(part.bias, "bias", 1, (torch.float32,), shape=(part.n,))
        entry.packed, entry.bias = part.packed.data_ptr(), _ptr(part.bias)
        entry.n, entry.format = part.n, f.ggml_type
    columns = sum(part.n for part in parts)
    out = torch.empty(rows, columns, dtype=torch.float32)
    if rows == 0:
        return out
    # The AVX2 product moves Q8_0's signs onto the row bytes, which -128 cannot take, and
    # its saturation bounds assume |q| <= 127 (blocks_gemm.c).
    _require(int(x.q.min()) > -128, "activation values must lie in -127..127")
    if x.rest is not None:
        _require(int(x.rest.min()) > -128, "activation rests must lie in -127..127")
    status = _lib().kvserve_blocks_gemm(
        x.q.data_ptr(),
        _ptr(x.rest),
        x.scales.data_ptr(),
        x.sums.data_ptr(),
        rows,
        k,
        ctypes.addressof(table),
        len(parts),
        out.data_ptr(),
        columns,
        torch.get_num_threads(),
    )
    _require(status == 0, f"the block product refused its arguments (status {status})")
    return out


def format_of_type(ggml_type: int) -> BlockFormat | None:
    """The format with this GGML type id, or None."""
    return _BY_TYPE.get(ggml_type)
