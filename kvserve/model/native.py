"""CPU kernels written in C, compiled at first use and called through ctypes.

The C code trusts what it is handed, so every wrapper here checks it first: dimensions, dtypes,
contiguity and agreement between the arguments' shapes (`KernelInputError`, a ValueError, and
nothing runs), and a call with zero rows returns its empty result without entering C. The index
values a step feeds the kernels (positions, cache slots, block tables, lengths) are checked once
per step by `check_step_indices`, before the first kernel of the step runs.

The C file is small and has no torch headers, so compiling it takes well under a second. The
shared object is cached under `$KVSERVE_CACHE_DIR` (default `~/.cache/kvserve`) keyed by the
source, the compiler flags and the CPU's feature flags (it is built with -march=native). When no
compiler is available the model falls back to the pure-torch path and says so once.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

import torch

from kvserve.model.paths import user_cache_dir

log = logging.getLogger("kvserve.model")

CSRC = Path(__file__).with_name("csrc")
SOURCES = [
    CSRC / "paged_attention.c",
    CSRC / "layer_ops.c",
    CSRC / "quant_ops.c",
    CSRC / "int8_gemm.c",
    CSRC / "f32_gemm.c",
    CSRC / "kv_int8.c",
    CSRC / "forward_int8.c",
    CSRC / "q4_gemm.c",
    CSRC / "forward_q4.c",
    CSRC / "bitmask.c",
    CSRC / "blocks_gemm.c",
]
HEADERS = [CSRC / "common.h", CSRC / "kernels.h", CSRC / "blocks.h"]
# -fno-math-errno / -fno-trapping-math (not -ffast-math: no reassociation, NaN and infinity keep
# their meaning) let loops with floorf and comparisons vectorize.
FLAGS = [
    "-O3",
    "-march=native",
    "-fno-math-errno",
    "-fno-trapping-math",
    "-fopenmp",
    "-shared",
    "-fPIC",
    "-std=c11",
    # an intrinsic this compiler lacks fails the build here, not the library's load
    "-Werror=implicit-function-declaration",
]


def _cpu_key() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return line
    except OSError:
        pass
    return platform.processor()


def _cache_dir() -> Path:
    return user_cache_dir() / "kernels"


@cache
def library() -> ctypes.CDLL | None:
    """The compiled kernels, or None when they cannot be built here (or KVSERVE_NATIVE=0)."""
    if os.environ.get("KVSERVE_NATIVE", "1") == "0":
        return None
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        log.warning("no C compiler found: CPU attention uses the slower pure-torch path")
        return None
    source = b"".join(path.read_bytes() for path in [*SOURCES, *HEADERS])
    digest = hashlib.sha256(
        source + " ".join(FLAGS).encode() + _cpu_key().encode() + platform.machine().encode()
    ).hexdigest()[:16]
    target = _cache_dir() / f"kernels-{digest}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            built = Path(tmp) / target.name
            result = subprocess.run(
                [compiler, *FLAGS, *map(str, SOURCES), "-o", str(built), "-lm"],
                capture_output=True,
                text=True,
            )
            if result.returncode != 0:
                log.warning(
                    "compiling the CPU attention kernel failed; using the pure-torch path:\n%s",
                    result.stderr.strip(),
                )
                return None
            os.replace(built, target)  # atomic: concurrent builders never see a partial file
    lib = ctypes.CDLL(str(target))
    args = [
        ctypes.c_void_p,  # q
        ctypes.c_int64,  # q_row_stride
        ctypes.c_void_p,  # kv
        ctypes.c_void_p,  # block_tables
        ctypes.c_int64,  # table_width
        ctypes.c_void_p,  # row_tables (nullable)
        ctypes.c_void_p,  # lengths
        ctypes.c_void_p,  # out
        ctypes.c_int64,  # out_row_stride
        ctypes.c_int64,  # num_seqs
        ctypes.c_int64,  # num_heads
        ctypes.c_int64,  # num_kv_heads
        ctypes.c_int64,  # head_dim
        ctypes.c_int64,  # num_blocks
        ctypes.c_int64,  # block_size
        ctypes.c_float,  # scale
        ctypes.c_int,  # num_threads
    ]
    for name in ("kvserve_paged_decode_f32", "kvserve_paged_decode_bf16"):
        fn = getattr(lib, name)
        fn.argtypes = args
        fn.restype = ctypes.c_int
    # the int8 cache: its scales follow the cache pointer
    for name in ("kvserve_paged_decode_q8_f32", "kvserve_paged_decode_q8_bf16"):
        fn = getattr(lib, name)
        fn.argtypes = [*args[:3], ctypes.c_void_p, *args[3:]]
        fn.restype = ctypes.c_int
    p, i64, f32, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
    signatures = {
        "kvserve_add_rmsnorm": [p, p, p, p, i64, i64, f32, i32],
        "kvserve_silu_mul": [p, p, i64, i64, i32],
        "kvserve_rope_store": [p, p, p, p, p, p, i64, i64, i64, i64, i64, i32],
    }
    signatures["kvserve_quantize_rows"] = [p, i64, i64, i64, p, p, i32]
    signatures["kvserve_dequantize"] = [p, p, p, p, p, i64, i64, i32]
    for base, argtypes in signatures.items():
        for suffix in ("_f32", "_bf16"):
            fn = getattr(lib, base + suffix)
            fn.argtypes = argtypes
            fn.restype = None
    lib.kvserve_add_rmsnorm_q8.argtypes = [p, p, p, p, p, p, i64, i64, f32, i32]
    lib.kvserve_silu_mul_q8.argtypes = [p, p, p, p, p, i64, i64, i64, i32]
    lib.kvserve_rotate_rows.argtypes = [p, p, p, i64, i64, i32]
    for suffix in ("_f32", "_bf16"):
        fn = getattr(lib, "kvserve_rope_store_q8" + suffix)
        fn.argtypes = [p, p, p, p, p, p, p, i64, i64, i64, i64, i64, i32]
        fn.restype = None
    lib.kvserve_forward_int8.argtypes = [
        p, i64, p, i64, p, p, i64, i64, i64, i64, f32, f32, i32,
        p, p, p, p, p, i64, p, p, i64, i64,
        p, p, p, p, p, p, i32,
    ]  # fmt: skip
    lib.kvserve_forward_int8.restype = ctypes.c_int
    lib.kvserve_kv_int8_available.argtypes = []
    lib.kvserve_kv_int8_available.restype = ctypes.c_int
    lib.kvserve_topk_rows.argtypes = [p, i64, i64, i64, p, i32]
    lib.kvserve_topk_rows.restype = None
    lib.kvserve_apply_token_bitmask.argtypes = [p, i64, i64, p, i64, p, i64, i32]
    lib.kvserve_apply_token_bitmask.restype = None
    lib.kvserve_int8_gemm.argtypes = [p, i64, i64, p, p, i64, p, i32]
    lib.kvserve_int8_gemm.restype = None
    lib.kvserve_int8_gemm_available.argtypes = []
    lib.kvserve_int8_gemm_available.restype = ctypes.c_int
    lib.kvserve_f32_gemm.argtypes = [p, i64, i64, p, i64, p, p, i32]
    lib.kvserve_f32_gemm.restype = None
    lib.kvserve_f32_gemm_available.argtypes = []
    lib.kvserve_f32_gemm_available.restype = ctypes.c_int
    for name in ("kvserve_add_rmsnorm_q8", "kvserve_silu_mul_q8", "kvserve_rotate_rows"):
        getattr(lib, name).restype = None
    from kvserve.model import native_blocks, native_q4

    native_q4.declare(lib)
    native_blocks.declare(lib)
    return lib


MAX_GROUP = 16
HEAD_DIMS = (64, 128)
FLOAT_DTYPES = (torch.float32, torch.bfloat16)


class KernelInputError(ValueError):
    """A native kernel was handed something it cannot take; the kernel was not called."""


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise KernelInputError(message)


def _tensor(
    t: torch.Tensor,
    name: str,
    ndim: int,
    dtypes: tuple[torch.dtype, ...],
    *,
    shape: tuple[int | None, ...] | None = None,
    contiguous: bool = True,
) -> None:
    """Check a CPU tensor's rank, dtype, contiguity and (where given, None = any) sizes."""
    # The checks run for every kernel call, so the usual case is one expression and the
    # messages are only built for a tensor that fails.
    if (
        isinstance(t, torch.Tensor)
        and t.device.type == "cpu"
        and t.dim() == ndim
        and t.dtype in dtypes
        and (not contiguous or t.is_contiguous())
        and (
            shape is None
            or (
                len(shape) == ndim
                and all(w is None or s == w for s, w in zip(t.shape, shape, strict=True))
            )
        )
    ):
        return
    _require(isinstance(t, torch.Tensor), f"{name} must be a tensor")
    _require(t.device.type == "cpu", f"{name} must be on the CPU, not {t.device}")
    _require(t.dim() == ndim, f"{name} must have {ndim} dimensions, not shape {tuple(t.shape)}")
    _require(t.dtype in dtypes, f"{name} must be {' or '.join(map(str, dtypes))}, not {t.dtype}")
    if contiguous:
        _require(t.is_contiguous(), f"{name} must be contiguous")
    if shape is not None:
        for axis, (size, want) in enumerate(zip(t.shape, shape, strict=True)):
            _require(
                want is None or size == want,
                f"{name} has size {size} in dimension {axis}, expected {want}",
            )


def _rows_vector(t: torch.Tensor, name: str, rows: int) -> None:
    _tensor(t, name, 1, (torch.int64,), shape=(rows,))


def _span(t: torch.Tensor, name: str, low: int, high: int) -> None:
    """Every value of the int64 tensor t lies in [low, high)."""
    if t.numel() == 0:
        return
    lo, hi = torch.aminmax(t)
    _require(
        int(lo) >= low and int(hi) < high,
        f"{name} holds values in [{int(lo)}, {int(hi)}], outside [{low}, {high})",
    )


def check_step_indices(
    meta, num_blocks: int, block_size: int, max_positions: int, num_rows: int
) -> None:
    """Check every index a step hands the kernels (kvserve.model.attention.AttentionMetadata):
    positions within the RoPE tables, slots within the cache, block-table entries within the
    pool, each row's table and length within its table. Raises KernelInputError."""
    _rows_vector(meta.positions, "positions", num_rows)
    _rows_vector(meta.slot_mapping, "slot mapping", num_rows)
    _rows_vector(meta.row_tables, "row tables", num_rows)
    _rows_vector(meta.row_lengths, "row lengths", num_rows)
    _tensor(meta.chunk_tables, "block tables", 2, (torch.int64,))
    num_tables, width = meta.chunk_tables.shape
    _span(meta.positions, "positions", 0, max_positions)
    _span(meta.slot_mapping, "cache slots", 0, num_blocks * block_size)
    _span(meta.chunk_tables, "block tables", 0, num_blocks)
    _span(meta.row_tables, "row tables", 0, num_tables)
    _span(meta.row_lengths, "row lengths", 1, width * block_size + 1)
    _tensor(meta.logits_indices, "logits rows", 1, (torch.int64,))
    _span(meta.logits_indices, "logits rows", 0, num_rows)


def supports(
    device: torch.device, dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int
) -> bool:
    """Whether the C decode kernel handles this model on this device (else: torch path)."""
    return (
        device.type == "cpu"
        and dtype in (torch.float32, torch.bfloat16)
        and head_dim in HEAD_DIMS
        and num_heads // num_kv_heads <= MAX_GROUP
        and library() is not None
    )


def paged_attention(
    q: torch.Tensor,
    kv_layer: torch.Tensor,
    block_tables: torch.Tensor,
    lengths: torch.Tensor,
    out: torch.Tensor,
    scale: float,
    row_tables: torch.Tensor | None = None,
    kv_scales: torch.Tensor | None = None,
) -> None:
    """out[i] = attention of q[i] over positions 0..lengths[i]-1 of row i's sequence, whose
    block table is `block_tables[row_tables[i]]` (or `block_tables[i]` without `row_tables`).

    q: [rows, heads, head_dim] (rows may be strided, heads and head_dim contiguous);
    kv_layer: [2, kv_heads, num_blocks, block_size, head_dim] contiguous, in q's dtype, or int8
    with `kv_scales` [2, kv_heads, num_blocks, block_size] float32 (kvserve/model/csrc/kv_int8.c);
    block_tables: [tables, width] int64 contiguous; lengths, row_tables: [rows] int64;
    out: [rows, heads, head_dim] with contiguous heads and head_dim.
    """
    lib = library()
    _tensor(q, "q", 3, FLOAT_DTYPES, contiguous=False)
    num_rows, num_heads, head_dim = q.shape
    _require(q.stride(2) == 1 and q.stride(1) == head_dim, "q's heads must be contiguous")
    _tensor(
        kv_layer, "kv cache layer", 5, (q.dtype, torch.int8), shape=(2, None, None, None, head_dim)
    )
    _, num_kv_heads, num_blocks, block_size, _ = kv_layer.shape
    _require(
        num_kv_heads > 0 and num_heads % num_kv_heads == 0,
        f"{num_heads} heads do not group over {num_kv_heads} KV heads",
    )
    _tensor(out, "out", 3, (q.dtype,), shape=(num_rows, num_heads, head_dim), contiguous=False)
    _require(out.stride(2) == 1 and out.stride(1) == head_dim, "out's heads must be contiguous")
    _tensor(block_tables, "block tables", 2, (torch.int64,))
    _rows_vector(lengths, "lengths", num_rows)
    if row_tables is None:
        _require(block_tables.shape[0] >= num_rows, "one block table per row is needed")
    else:
        _rows_vector(row_tables, "row tables", num_rows)
    if num_rows == 0:
        return
    cache = [kv_layer.data_ptr()]
    if kv_scales is not None:
        _require(kv_layer.dtype == torch.int8, "an int8 cache goes with its scales")
        _tensor(kv_scales, "kv scales", 4, (torch.float32,), shape=tuple(kv_layer.shape[:4]))
        name = "kvserve_paged_decode_q8" + _suffix(q)
        cache.append(kv_scales.data_ptr())
    else:
        _require(kv_layer.dtype == q.dtype, "the cache must be in q's dtype")
        name = "kvserve_paged_decode" + _suffix(q)
    status = getattr(lib, name)(
        q.data_ptr(),
        q.stride(0),
        *cache,
        block_tables.data_ptr(),
        block_tables.shape[1],
        None if row_tables is None else row_tables.data_ptr(),
        lengths.data_ptr(),
        out.data_ptr(),
        out.stride(0),
        num_rows,
        num_heads,
        num_kv_heads,
        head_dim,
        num_blocks,
        block_size,
        scale,
        torch.get_num_threads(),
    )
    check_attention_status(status, num_heads, num_kv_heads, head_dim)


def check_attention_status(status: int, heads: int, kv_heads: int, head_dim: int) -> None:
    """Raise for a paged attention kernel's (or a layer driver's) nonzero status: -1, shapes
    the kernel refuses; -2, working memory it could not allocate (csrc/kv_int8.c)."""
    if status == -2:
        raise MemoryError("the attention kernel could not allocate its working memory")
    if status != 0:
        raise ValueError(
            f"paged attention kernel refused shapes: {heads} heads / {kv_heads} KV heads, "
            f"head_dim {head_dim}"
        )


def _suffix(tensor: torch.Tensor) -> str:
    return "_f32" if tensor.dtype == torch.float32 else "_bf16"


def _ptr(tensor: torch.Tensor | None) -> int | None:
    return None if tensor is None else tensor.data_ptr()


def add_rmsnorm(
    x: torch.Tensor,
    delta: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """x += delta (in place, when given); returns rmsnorm(x) * weight in `out_dtype`.

    x: [rows, hidden] float32 contiguous (the residual stream); delta: [rows, hidden] in
    `out_dtype`, contiguous; weight: [hidden] float32.
    """
    _tensor(x, "x", 2, (torch.float32,))
    rows, hidden = x.shape
    _require(out_dtype in FLOAT_DTYPES, f"no rmsnorm kernel for {out_dtype}")
    if delta is not None:
        _tensor(delta, "delta", 2, (out_dtype,), shape=(rows, hidden))
    _tensor(weight, "norm weight", 1, (torch.float32,), shape=(hidden,))
    out = torch.empty(rows, hidden, dtype=out_dtype)
    if rows == 0:
        return out
    fn = getattr(library(), "kvserve_add_rmsnorm" + _suffix(out))
    fn(
        x.data_ptr(),
        _ptr(delta),
        weight.data_ptr(),
        out.data_ptr(),
        rows,
        hidden,
        eps,
        torch.get_num_threads(),
    )
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up from `[rows, 2 * width]` (gate columns first); returns [rows, width]."""
    _tensor(gate_up, "gate_up", 2, FLOAT_DTYPES)
    rows, double = gate_up.shape
    _require(double % 2 == 0, "gate_up must have an even number of columns")
    out = torch.empty(rows, double // 2, dtype=gate_up.dtype)
    if rows == 0:
        return out
    fn = getattr(library(), "kvserve_silu_mul" + _suffix(out))
    fn(gate_up.data_ptr(), out.data_ptr(), rows, double // 2, torch.get_num_threads())
    return out


def rope_store(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos_half: torch.Tensor,
    sin_half: torch.Tensor,
    slots: torch.Tensor,
    kv_layer: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    kv_scales: torch.Tensor | None = None,
) -> None:
    """Rotate the q and k heads of `qkv` in place and write k and v into the cache.

    qkv: [rows, (heads + 2 kv_heads) * head_dim] contiguous; positions, slots: [rows] int64;
    cos_half, sin_half: [max_positions, head_dim / 2] float32;
    kv_layer: [2, kv_heads, num_blocks, block_size, head_dim] contiguous, in qkv's dtype, or int8
    with `kv_scales` [2, kv_heads, num_blocks, block_size] float32 (each K and V row quantized
    with its own scale; see kvserve/model/csrc/kv_int8.c).
    """
    width = (num_heads + 2 * num_kv_heads) * head_dim
    _tensor(qkv, "qkv", 2, FLOAT_DTYPES, shape=(None, width))
    rows = qkv.shape[0]
    _rows_vector(positions, "positions", rows)
    _rows_vector(slots, "slots", rows)
    for table, name in ((cos_half, "cos table"), (sin_half, "sin table")):
        _tensor(table, name, 2, (torch.float32,), shape=(None, head_dim // 2))
    _tensor(
        kv_layer,
        "kv cache layer",
        5,
        (qkv.dtype, torch.int8),
        shape=(2, num_kv_heads, None, None, head_dim),
    )
    num_slots = kv_layer.shape[2] * kv_layer.shape[3]
    if rows == 0:
        return
    if kv_scales is not None:
        _require(kv_layer.dtype == torch.int8, "an int8 cache goes with its scales")
        _tensor(kv_scales, "kv scales", 4, (torch.float32,), shape=tuple(kv_layer.shape[:4]))
        fn = getattr(library(), "kvserve_rope_store_q8" + _suffix(qkv))
        cache = [kv_layer.data_ptr(), kv_scales.data_ptr()]
    else:
        _require(kv_layer.dtype == qkv.dtype, "the cache must be in qkv's dtype")
        fn = getattr(library(), "kvserve_rope_store" + _suffix(qkv))
        cache = [kv_layer.data_ptr()]
    fn(
        qkv.data_ptr(),
        positions.data_ptr(),
        cos_half.data_ptr(),
        sin_half.data_ptr(),
        slots.data_ptr(),
        *cache,
        rows,
        num_heads,
        num_kv_heads,
        head_dim,
        num_slots,
        torch.get_num_threads(),
    )


def kv_int8_available() -> bool:
    """Whether the int8 KV cache kernels were built (the CPU has AVX512-VNNI)."""
    lib = library()
    return lib is not None and bool(lib.kvserve_kv_int8_available())


# -- the int8 linear path (kvserve/model/quant.py) ----------------------------------------------


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row symmetric int8 of x: [rows, width] (rows may be strided, width contiguous).
    Returns (q [rows, width] int8, scales [rows] float32) with x ~= q * scales[:, None]."""
    _tensor(x, "x", 2, FLOAT_DTYPES, contiguous=False)
    rows, width = x.shape
    _require(x.stride(1) == 1 or width <= 1, "x's rows must be contiguous")
    q = torch.empty(rows, width, dtype=torch.int8)
    scales = torch.empty(rows, dtype=torch.float32)
    if rows == 0:
        return q, scales
    fn = getattr(library(), "kvserve_quantize_rows" + _suffix(x))
    fn(
        x.data_ptr(),
        rows,
        width,
        x.stride(0),
        q.data_ptr(),
        scales.data_ptr(),
        torch.get_num_threads(),
    )
    return q, scales


def add_rmsnorm_q8(
    x: torch.Tensor,
    acc: torch.Tensor | None,
    row_scales: torch.Tensor | None,
    col_scales: torch.Tensor | None,
    eps: float,
    *,
    normalize: bool = True,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """x += acc * row_scales[:, None] * col_scales (when acc is given), in place; then, with
    `normalize`, returns the per-row int8 of rmsnorm(x) (no weight) as (q, scales).

    x: [rows, hidden] float32 contiguous; acc: [rows, hidden] int32 contiguous."""
    _tensor(x, "x", 2, (torch.float32,))
    rows, hidden = x.shape
    if acc is not None:
        _tensor(acc, "acc", 2, (torch.int32,), shape=(rows, hidden))
        _require(row_scales is not None and col_scales is not None, "acc needs its scales")
        _tensor(row_scales, "row scales", 1, (torch.float32,), shape=(rows,))
        _tensor(col_scales, "column scales", 1, (torch.float32,), shape=(hidden,))
    q = scales = None
    if normalize:
        q = torch.empty(rows, hidden, dtype=torch.int8)
        scales = torch.empty(rows, dtype=torch.float32)
    if rows == 0:
        return (q, scales) if normalize else None
    library().kvserve_add_rmsnorm_q8(
        x.data_ptr(),
        _ptr(acc),
        _ptr(row_scales),
        _ptr(col_scales),
        _ptr(q),
        _ptr(scales),
        rows,
        hidden,
        eps,
        torch.get_num_threads(),
    )
    return (q, scales) if normalize else None


def silu_mul_q8(
    acc: torch.Tensor, row_scales: torch.Tensor, col_scales: torch.Tensor, block: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """From the int32 gate|up product `[rows, 2 * width]` (gate columns first) and its scales:
    m = silu(gate) * up, rotated by normalized Walsh-Hadamard blocks of `block` columns (1 = no
    rotation), returned as per-row int8 (q [rows, width], scales [rows])."""
    _tensor(acc, "acc", 2, (torch.int32,))
    rows, double = acc.shape
    width = double // 2
    _require(double % 2 == 0, "the gate|up product must have an even number of columns")
    _require(
        block >= 1 and width % block == 0 and block & (block - 1) == 0,
        f"rotation block {block} must be a power of two dividing {width}",
    )
    _tensor(row_scales, "row scales", 1, (torch.float32,), shape=(rows,))
    _tensor(col_scales, "column scales", 1, (torch.float32,), shape=(double,))
    q = torch.empty(rows, width, dtype=torch.int8)
    scales = torch.empty(rows, dtype=torch.float32)
    if rows == 0:
        return q, scales
    library().kvserve_silu_mul_q8(
        acc.data_ptr(),
        row_scales.data_ptr(),
        col_scales.data_ptr(),
        q.data_ptr(),
        scales.data_ptr(),
        rows,
        width,
        block,
        torch.get_num_threads(),
    )
    return q, scales


def dequantize(
    acc: torch.Tensor,
    row_scales: torch.Tensor,
    col_scales: torch.Tensor,
    bias: torch.Tensor | None,
    dtype: torch.dtype,
) -> torch.Tensor:
    """acc * row_scales[:, None] * col_scales + bias, as `dtype` (float32 or bfloat16)."""
    _tensor(acc, "acc", 2, (torch.int32,))
    rows, cols = acc.shape
    _require(dtype in FLOAT_DTYPES, f"no dequantize kernel for {dtype}")
    _tensor(row_scales, "row scales", 1, (torch.float32,), shape=(rows,))
    _tensor(col_scales, "column scales", 1, (torch.float32,), shape=(cols,))
    if bias is not None:
        _tensor(bias, "bias", 1, (torch.float32,), shape=(cols,))
    out = torch.empty(rows, cols, dtype=dtype)
    if rows == 0:
        return out
    fn = getattr(library(), "kvserve_dequantize" + _suffix(out))
    fn(
        acc.data_ptr(),
        row_scales.data_ptr(),
        col_scales.data_ptr(),
        _ptr(bias),
        out.data_ptr(),
        rows,
        cols,
        torch.get_num_threads(),
    )
    return out


def rotate_rows(x: torch.Tensor, matrix: torch.Tensor) -> torch.Tensor:
    """x @ matrix for x: [rows, n] float32 and matrix: [n, n] float32 (both contiguous), each
    row computed alone in a fixed order: a row's result does not depend on its batch mates."""
    _tensor(x, "x", 2, (torch.float32,))
    rows, n = x.shape
    _tensor(matrix, "rotation", 2, (torch.float32,), shape=(n, n))
    out = torch.empty(rows, n, dtype=torch.float32)
    if rows == 0:
        return out
    library().kvserve_rotate_rows(
        x.data_ptr(), matrix.data_ptr(), out.data_ptr(), rows, n, torch.get_num_threads()
    )
    return out


INT8_BLOCK_COLS = 64  # columns per packed weight panel (kvserve/model/csrc/int8_gemm.c)


INT8_GEMM_ISAS = {1: "AVX512-VNNI", 2: "AVX2"}  # kvserve_int8_gemm_available's answers


def int8_gemm_isa() -> str | None:
    """The instructions the packed int8 product was built with, or None: not built here."""
    lib = library()
    return None if lib is None else INT8_GEMM_ISAS.get(lib.kvserve_int8_gemm_available())


def int8_gemm_available() -> bool:
    """Whether the packed int8 product was built (the CPU has AVX512-VNNI or AVX2)."""
    return int8_gemm_isa() is not None


def pack_int8_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Pack an int8 weight [n, k] (k a multiple of 4) for `int8_gemm`: returns the panels
    [ceil(n / 64), k / 4, 64, 4] int8 (zero columns past n) and the correction
    128 * sum_k weight[n, k] as int32, padded alike."""
    _tensor(weight, "weight", 2, (torch.int8,), contiguous=False)
    n, k = weight.shape
    _require(k % 4 == 0 and k > 0 and n > 0, f"cannot pack a [{n}, {k}] weight (k % 4 != 0)")
    blocks = -(-n // INT8_BLOCK_COLS)
    padded = torch.zeros(blocks * INT8_BLOCK_COLS, k, dtype=torch.int8)
    padded[:n] = weight
    panels = padded.view(blocks, INT8_BLOCK_COLS, k // 4, 4).permute(0, 2, 1, 3).contiguous()
    # Row sums in float32 are exact here (|sum| <= 127 k < 2^24 for k <= 2^17) and several
    # times faster than torch's integer reduction, which dominated packing a 1B model.
    _require(k <= 1 << 17, f"cannot pack a [{n}, {k}] weight (k > 131072)")
    correction = (padded.float().sum(dim=1) * 128).to(torch.int32).contiguous()
    return panels, correction


def int8_gemm(
    q: torch.Tensor, panels: torch.Tensor, correction: torch.Tensor, n: int
) -> torch.Tensor:
    """q [rows, k] int8 (contiguous, values -127..127 as the quantizers give) times the packed
    weight's transpose: [rows, n] int32."""
    _tensor(q, "q", 2, (torch.int8,))
    rows, k = q.shape
    # The AVX2 product moves each weight's sign onto the row byte, which -128 cannot take.
    _require(rows == 0 or int(q.min()) > -128, "int8 rows must lie in -127..127")
    blocks = -(-n // INT8_BLOCK_COLS)
    _tensor(panels, "panels", 4, (torch.int8,), shape=(blocks, k // 4, INT8_BLOCK_COLS, 4))
    _require(k % 4 == 0 and k > 0, f"the product's inner size {k} must be a positive multiple of 4")
    _tensor(correction, "correction", 1, (torch.int32,), shape=(blocks * INT8_BLOCK_COLS,))
    out = torch.empty(rows, n, dtype=torch.int32)
    if rows == 0:
        return out
    library().kvserve_int8_gemm(
        q.data_ptr(),
        rows,
        k,
        panels.data_ptr(),
        correction.data_ptr(),
        n,
        out.data_ptr(),
        torch.get_num_threads(),
    )
    return out


@cache
def f32_gemm_available() -> bool:
    """Whether csrc/f32_gemm.c's float32 row product runs here (AVX2 and FMA)."""
    lib = library()
    return lib is not None and bool(lib.kvserve_f32_gemm_available())


def f32_gemm(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x @ weight.T (+ bias) in float32, each output in one fixed arithmetic whatever the
    number of rows (csrc/f32_gemm.c): x [rows, k], weight [n, k], bias [n], contiguous float32,
    k a positive multiple of 8. Returns [rows, n]."""
    _require(f32_gemm_available(), "the float32 row product needs the C kernels with AVX2 and FMA")
    _tensor(x, "x", 2, (torch.float32,))
    rows, k = x.shape
    _tensor(weight, "weight", 2, (torch.float32,), shape=(None, k))
    _require(k % 8 == 0 and k > 0, f"the product's inner size {k} must be a positive multiple of 8")
    n = weight.shape[0]
    if bias is not None:
        _tensor(bias, "bias", 1, (torch.float32,), shape=(n,))
    out = torch.empty(rows, n, dtype=torch.float32)
    if rows == 0 or n == 0:
        return out
    library().kvserve_f32_gemm(
        x.data_ptr(),
        rows,
        k,
        weight.data_ptr(),
        n,
        _ptr(bias),
        out.data_ptr(),
        torch.get_num_threads(),
    )
    return out


def topk_rows(x: torch.Tensor, k: int) -> torch.Tensor:
    """Columns of the k largest values of each row of x: [rows, n] float32 contiguous, best
    first, the lower column first among equal values. Returns [rows, k] int64. k <= 64."""
    _tensor(x, "x", 2, (torch.float32,))
    rows, n = x.shape
    _require(0 < k <= min(64, n), f"top-k needs 0 < k <= min(64, {n}), not {k}")
    indices = torch.empty(rows, k, dtype=torch.int64)
    if rows == 0:
        return indices
    library().kvserve_topk_rows(
        x.data_ptr(), rows, n, k, indices.data_ptr(), torch.get_num_threads()
    )
    return indices


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """In place: ``logits[rows[i], t] = -inf`` wherever bit t of ``bitmask[i]`` is clear.

    logits: [num_logit_rows, vocab] float32 with unit column stride; bitmask: [len(rows), words]
    int32 contiguous (llguidance's and xgrammar's layout); rows: [n] int64. Tokens beyond
    ``words * 32`` are masked.
    """
    assert logits.dtype == torch.float32 and logits.stride(1) == 1
    assert bitmask.dtype == torch.int32 and bitmask.is_contiguous()
    assert rows.dtype == torch.int64 and rows.is_contiguous() and bitmask.shape[0] == rows.shape[0]
    library().kvserve_apply_token_bitmask(
        logits.data_ptr(),
        logits.stride(0),
        logits.shape[1],
        bitmask.data_ptr(),
        bitmask.shape[1],
        rows.data_ptr(),
        rows.shape[0],
        torch.get_num_threads(),
    )


class Int8WeightStruct(ctypes.Structure):
    """kvserve_int8_weight in forward_int8.c."""

    _fields_ = [
        ("panels", ctypes.c_void_p),
        ("correction", ctypes.c_void_p),
        ("scale", ctypes.c_void_p),
        ("bias", ctypes.c_void_p),
        ("n", ctypes.c_int64),
        ("k", ctypes.c_int64),
    ]


class Int8LayerStruct(ctypes.Structure):
    """kvserve_int8_layer in forward_int8.c."""

    _fields_ = [(name, Int8WeightStruct) for name in ("qkv", "o", "gate_up", "down")]


def int8_layer_table(layers) -> ctypes.Array:
    """The C description of quantized layers (kvserve.model.quant.Int8Layer, every weight
    packed). It points into the layers' tensors, which must outlive it."""

    def weight(w) -> Int8WeightStruct:
        return Int8WeightStruct(
            w.panels.data_ptr(),
            w.correction.data_ptr(),
            w.scale.data_ptr(),
            _ptr(w.bias),
            w.out_features,
            w.panels.shape[1] * 4,
        )

    table = (Int8LayerStruct * len(layers))()
    for entry, layer in zip(table, layers, strict=True):
        entry.qkv, entry.o = weight(layer.qkv), weight(layer.o)
        entry.gate_up, entry.down = weight(layer.gate_up), weight(layer.down)
    return table


def check_driver_step(
    rows: int,
    num_layers: int,
    kv: torch.Tensor,
    kv_scales: torch.Tensor | None,
    dtype: torch.dtype,
    kv_heads: int,
    head_dim: int,
    positions: torch.Tensor,
    cos_half: torch.Tensor,
    sin_half: torch.Tensor,
    slots: torch.Tensor,
    tables: torch.Tensor,
    row_tables: torch.Tensor,
    lengths: torch.Tensor,
) -> tuple[ctypes.Array, ctypes.Array | None, tuple] | None:
    """Check what a one-call layer driver (forward_int8.c, forward_q4.c) is handed for a step
    of `rows` rows: (each layer's cache pointer, their scale pointers or None, the step's
    arguments in the drivers' order: positions, cos, sin, slots, tables and their width, row
    tables, lengths, num_blocks, block_size). None when there are no rows (nothing to run)."""
    _require(dtype in FLOAT_DTYPES, f"no layer driver for {dtype}")
    _tensor(
        kv,
        "kv cache",
        6,
        (dtype, torch.int8),
        shape=(num_layers, 2, kv_heads, None, None, head_dim),
    )
    _, _, _, num_blocks, block_size, _ = kv.shape
    if kv_scales is not None:
        _require(kv.dtype == torch.int8, "an int8 cache goes with its scales")
        _tensor(kv_scales, "kv scales", 5, (torch.float32,), shape=tuple(kv.shape[:5]))
    else:
        _require(kv.dtype == dtype, "the cache must be in the model's dtype")
    for vector, name in (
        (positions, "positions"),
        (slots, "slots"),
        (row_tables, "row tables"),
        (lengths, "lengths"),
    ):
        _rows_vector(vector, name, rows)
    _tensor(tables, "block tables", 2, (torch.int64,))
    for half, name in ((cos_half, "cos table"), (sin_half, "sin table")):
        _tensor(half, name, 2, (torch.float32,), shape=(None, head_dim // 2))
    if rows == 0:
        return None

    def per_layer(t: torch.Tensor) -> ctypes.Array:
        step = t.stride(0) * t.element_size()
        return (ctypes.c_void_p * num_layers)(*(t.data_ptr() + i * step for i in range(num_layers)))

    step_arguments = (
        *(t.data_ptr() for t in (positions, cos_half, sin_half, slots, tables)),
        tables.shape[1],
        row_tables.data_ptr(),
        lengths.data_ptr(),
        num_blocks,
        block_size,
    )
    return per_layer(kv), None if kv_scales is None else per_layer(kv_scales), step_arguments


def forward_int8(
    x: torch.Tensor,
    table: ctypes.Array,
    kv: torch.Tensor,
    kv_scales: torch.Tensor | None,
    *,
    heads: int,
    kv_heads: int,
    head_dim: int,
    intermediate: int,
    down_block: int,
    eps: float,
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
    """Run every layer of the int8 path on x ([rows, hidden] float32, in place): see
    kvserve/model/csrc/forward_int8.c. kv: the whole cache ([layers, 2, kv_heads, blocks,
    block_size, head_dim]); kv_scales: its scales for an int8 cache, else None."""
    _tensor(x, "x", 2, (torch.float32,))
    rows, hidden = x.shape
    num_layers = len(table)
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    _require(num_layers > 0 and table[0].o.n == hidden, "the layer table does not fit x")
    step = check_driver_step(
        rows, num_layers, kv, kv_scales, dtype, kv_heads, head_dim,
        positions, cos_half, sin_half, slots, tables, row_tables, lengths,
    )  # fmt: skip
    if step is None:
        return
    kv_pointers, scale_pointers, step_arguments = step
    q8 = torch.empty(rows * max(hidden, q_size, intermediate), dtype=torch.int8)
    scales = torch.empty(2, rows, dtype=torch.float32)
    acc = torch.empty(rows * max(q_size + 2 * kv_size, 2 * intermediate, hidden), dtype=torch.int32)
    qkv = torch.empty(rows, q_size + 2 * kv_size, dtype=dtype)
    attn = torch.empty(rows, q_size, dtype=dtype)
    status = library().kvserve_forward_int8(
        x.data_ptr(),
        rows,
        ctypes.addressof(table),
        num_layers,
        kv_pointers,
        scale_pointers,
        heads,
        kv_heads,
        head_dim,
        down_block,
        eps,
        scale,
        int(dtype == torch.bfloat16),
        *step_arguments,
        q8.data_ptr(),
        scales[0].data_ptr(),
        scales[1].data_ptr(),
        acc.data_ptr(),
        qkv.data_ptr(),
        attn.data_ptr(),
        torch.get_num_threads(),
    )
    check_attention_status(status, heads, kv_heads, head_dim)
