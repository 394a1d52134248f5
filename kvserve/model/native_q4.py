"""Checked wrappers of the 4-bit path's kernels (kvserve/model/csrc/q4_gemm.c, forward_q4.c).

As everywhere in kvserve.model.native, the C code trusts what it is handed: shapes, dtypes and
contiguity are checked here first (`KernelInputError`, and nothing runs), and a call with zero
rows returns its empty result without entering C.
"""

from __future__ import annotations

import ctypes

import torch

from kvserve.model.native import (
    FLOAT_DTYPES,
    _ptr,
    _require,
    _suffix,
    _tensor,
    check_attention_status,
    check_driver_step,
    library,
)

BLOCK = 32  # values per activation block and per weight block
PANEL = 32  # output columns per packed panel
NIBBLE_BYTES = PANEL * BLOCK // 2


def declare(lib: ctypes.CDLL) -> None:
    """Set the argument types of the 4-bit kernels on the loaded library."""
    p, i64, f32, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
    signatures = {
        "kvserve_q4_available": ([], ctypes.c_int),
        "kvserve_q4_gemm": ([p, p, p, i64, i64, p, i64, i32, p, i32], None),
        "kvserve_quantize_blocks_f32": ([p, i64, i64, i64, p, p, p, i32], None),
        "kvserve_quantize_blocks_bf16": ([p, i64, i64, i64, p, p, p, i32], None),
        "kvserve_forward_q4": (
            [
                p,
                i64,
                p,
                i64,
                p,
                p,
                i64,
                i64,
                i64,
                f32,
                f32,
                i32,
                p,
                p,
                p,
                p,
                p,
                i64,
                p,
                p,
                i64,
                i64,
                p,
                p,
                p,
                p,
                p,
                p,
                i32,
            ],
            ctypes.c_int,
        ),  # fmt: skip
    }
    for name, (argtypes, restype) in signatures.items():
        fn = getattr(lib, name)
        fn.argtypes = argtypes
        fn.restype = restype


def q4_available() -> bool:
    """Whether the 4-bit product was built (the CPU has AVX512-VNNI)."""
    lib = library()
    return lib is not None and bool(lib.kvserve_q4_available())


def _blocks_out(rows: int, width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    _require(width % BLOCK == 0, f"a row of {width} values is not whole blocks of {BLOCK}")
    return (
        torch.empty(2, rows, width, dtype=torch.int8),
        torch.empty(rows, width // BLOCK, dtype=torch.float32),
        torch.empty(rows, width // BLOCK, dtype=torch.float32),
    )


def quantize_blocks(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Blocks of 32 values of x: [rows, width] (width a multiple of 32; rows may be strided) as
    (q [2, rows, width] int8, scales [rows, width / 32], sums [rows, width / 32] float32) with
    x ~= (16 q[0] + q[1]) * scales per block and sums = scales * (the block's sum of
    16 q[0] + q[1]): about 12 bits per value (kvserve/model/csrc/q4_gemm.c)."""
    _tensor(x, "x", 2, FLOAT_DTYPES, contiguous=False)
    rows, width = x.shape
    _require(x.stride(1) == 1 or width <= 1, "x's rows must be contiguous")
    q, scales, sums = _blocks_out(rows, width)
    if rows == 0:
        return q, scales, sums
    getattr(library(), "kvserve_quantize_blocks" + _suffix(x))(
        x.data_ptr(),
        rows,
        width,
        x.stride(0),
        q.data_ptr(),
        scales.data_ptr(),
        sums.data_ptr(),
        torch.get_num_threads(),
    )
    return q, scales, sums


def record_bytes(asym: bool) -> int:
    """Bytes per (panel, block) record: the nibbles, d, and m for Q4_1."""
    return NIBBLE_BYTES + (2 if asym else 1) * PANEL * 2


def _check_packed(packed: torch.Tensor, n: int, k: int, asym: bool) -> None:
    _require(n > 0, f"a 4-bit weight needs output columns, not {n}")
    _tensor(
        packed,
        "packed weight",
        3,
        (torch.uint8,),
        shape=(-(-n // PANEL), k // BLOCK, record_bytes(asym)),
    )


def q4_gemm(
    q: torch.Tensor,
    scales: torch.Tensor,
    sums: torch.Tensor,
    packed: torch.Tensor,
    n: int,
    asym: bool,
) -> torch.Tensor:
    """Rows in blocks (`quantize_blocks`) times a packed 4-bit weight's transpose
    (kvserve.model.quant4.pack): [rows, n] float32."""
    _tensor(q, "q", 3, (torch.int8,), shape=(2, None, None))
    _, rows, k = q.shape
    _require(k > 0 and k % BLOCK == 0, f"the product's inner size {k} must be whole blocks")
    for t, name in ((scales, "scales"), (sums, "sums")):
        _tensor(t, name, 2, (torch.float32,), shape=(rows, k // BLOCK))
    _check_packed(packed, n, k, asym)
    out = torch.empty(rows, n, dtype=torch.float32)
    if rows == 0:
        return out
    library().kvserve_q4_gemm(
        q.data_ptr(),
        scales.data_ptr(),
        sums.data_ptr(),
        rows,
        k,
        packed.data_ptr(),
        n,
        int(asym),
        out.data_ptr(),
        torch.get_num_threads(),
    )
    return out


class Q4WeightStruct(ctypes.Structure):
    """kvserve_q4_weight in forward_q4.c."""

    _fields_ = [
        ("packed", ctypes.c_void_p),
        ("bias", ctypes.c_void_p),
        ("n", ctypes.c_int64),
        ("k", ctypes.c_int64),
        ("asym", ctypes.c_int64),
    ]


class Q4LayerStruct(ctypes.Structure):
    """kvserve_q4_layer in forward_q4.c."""

    _fields_ = [(name, Q4WeightStruct) for name in ("qkv", "o", "gate_up", "down")] + [
        ("attn_norm", ctypes.c_void_p),
        ("mlp_norm", ctypes.c_void_p),
        ("qk_norm", ctypes.c_void_p),
    ]


def q4_layer_table(layers, config) -> ctypes.Array:
    """The C description of 4-bit layers (kvserve.model.quant4.Q4Layer), checked against the
    model's shapes. It points into the layers' tensors, which must outlive it."""
    hidden, q_size, kv_size = config.hidden_size, config.q_size, config.kv_size
    intermediate = config.intermediate_size
    shapes = {
        "qkv": (q_size + 2 * kv_size, hidden),
        "o": (hidden, q_size),
        "gate_up": (2 * intermediate, hidden),
        "down": (hidden, intermediate),
    }
    for width, name in ((hidden, "hidden size"), (q_size, "q size"), (intermediate, "FFN")):
        _require(width % BLOCK == 0, f"the {name} ({width}) is not whole blocks of {BLOCK}")

    def weight(w, name: str) -> Q4WeightStruct:
        n, k = shapes[name]
        _require(w.out_features == n, f"{name} has {w.out_features} outputs, expected {n}")
        _check_packed(w.packed, n, k, w.asym)
        if w.bias is not None:
            _tensor(w.bias, f"{name} bias", 1, (torch.float32,), shape=(n,))
        return Q4WeightStruct(w.packed.data_ptr(), _ptr(w.bias), n, k, int(w.asym))

    heads = config.num_heads + config.num_kv_heads
    table = (Q4LayerStruct * len(layers))()
    for entry, layer in zip(table, layers, strict=True):
        for name in ("qkv", "o", "gate_up", "down"):
            setattr(entry, name, weight(getattr(layer, name), name))
        for norm in ("attn_norm", "mlp_norm"):
            _tensor(getattr(layer, norm), norm, 1, (torch.float32,), shape=(hidden,))
            setattr(entry, norm, getattr(layer, norm).data_ptr())
        if layer.qk_norm is not None:
            _tensor(layer.qk_norm, "q/k norms", 2, (torch.float32,), shape=(heads, config.head_dim))
        entry.qk_norm = _ptr(layer.qk_norm)
    return table


def forward_q4(
    x: torch.Tensor,
    table: ctypes.Array,
    kv: torch.Tensor,
    kv_scales: torch.Tensor | None,
    *,
    config,
    scale: float,
    dtype: torch.dtype,
    positions: torch.Tensor,
    cos_half: torch.Tensor,
    sin_half: torch.Tensor,
    slots: torch.Tensor,
    tables: torch.Tensor,
    row_tables: torch.Tensor,
    lengths: torch.Tensor,
) -> None:
    """Run every layer of the 4-bit path on x ([rows, hidden] float32, in place): see
    kvserve/model/csrc/forward_q4.c. kv: the whole cache ([layers, 2, kv_heads, blocks,
    block_size, head_dim]); kv_scales: its scales for an int8 cache, else None."""
    _tensor(x, "x", 2, (torch.float32,))
    rows, hidden = x.shape
    heads, kv_heads, head_dim = config.num_heads, config.num_kv_heads, config.head_dim
    q_size, kv_size, intermediate = config.q_size, config.kv_size, config.intermediate_size
    num_layers = len(table)
    _require(num_layers > 0 and table[0].o.n == hidden, "the layer table does not fit x")
    step = check_driver_step(
        rows, num_layers, kv, kv_scales, dtype, kv_heads, head_dim,
        positions, cos_half, sin_half, slots, tables, row_tables, lengths,
    )  # fmt: skip
    if step is None:
        return
    kv_pointers, scale_pointers, step_arguments = step
    widest = max(hidden, q_size, intermediate)
    q8 = torch.empty(2 * rows * widest, dtype=torch.int8)
    block_scales = torch.empty(2, rows * widest // BLOCK, dtype=torch.float32)
    product = torch.empty(
        rows * max(q_size + 2 * kv_size, 2 * intermediate, hidden), dtype=torch.float32
    )
    qkv = torch.empty(rows, q_size + 2 * kv_size, dtype=dtype)
    attn = torch.empty(rows, q_size, dtype=dtype)
    status = library().kvserve_forward_q4(
        x.data_ptr(),
        rows,
        ctypes.addressof(table),
        num_layers,
        kv_pointers,
        scale_pointers,
        heads,
        kv_heads,
        head_dim,
        config.rms_norm_eps,
        scale,
        int(dtype == torch.bfloat16),
        *step_arguments,
        q8.data_ptr(),
        block_scales[0].data_ptr(),
        block_scales[1].data_ptr(),
        product.data_ptr(),
        qkv.data_ptr(),
        attn.data_ptr(),
        torch.get_num_threads(),
    )
    check_attention_status(status, heads, kv_heads, head_dim)
