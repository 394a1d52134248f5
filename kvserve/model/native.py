"""CPU kernels written in C, compiled at first use and called through ctypes.

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

log = logging.getLogger("kvserve.model")

CSRC = Path(__file__).with_name("csrc")
SOURCES = [CSRC / "paged_attention.c", CSRC / "layer_ops.c"]
HEADER = CSRC / "common.h"
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
    root = os.environ.get("KVSERVE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "kvserve"
    )
    return Path(root) / "kernels"


@cache
def library() -> ctypes.CDLL | None:
    """The compiled kernels, or None when they cannot be built here (or KVSERVE_NATIVE=0)."""
    if os.environ.get("KVSERVE_NATIVE", "1") == "0":
        return None
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        log.warning("no C compiler found: CPU attention uses the slower pure-torch path")
        return None
    source = b"".join(path.read_bytes() for path in [*SOURCES, HEADER])
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
    p, i64, f32, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
    signatures = {
        "kvserve_add_rmsnorm": [p, p, p, p, i64, i64, f32, i32],
        "kvserve_silu_mul": [p, p, i64, i64, i32],
        "kvserve_rope_store": [p, p, p, p, p, p, i64, i64, i64, i64, i64, i32],
    }
    for base, argtypes in signatures.items():
        for suffix in ("_f32", "_bf16"):
            fn = getattr(lib, base + suffix)
            fn.argtypes = argtypes
            fn.restype = None
    return lib


MAX_GROUP = 16
HEAD_DIMS = (64, 128)


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
) -> None:
    """out[i] = attention of q[i] over positions 0..lengths[i]-1 of row i's sequence, whose
    block table is `block_tables[row_tables[i]]` (or `block_tables[i]` without `row_tables`).

    q: [rows, heads, head_dim] (rows may be strided, heads and head_dim contiguous);
    kv_layer: [2, kv_heads, num_blocks, block_size, head_dim] contiguous;
    block_tables: [tables, width] int64 contiguous; lengths, row_tables: [rows] int64;
    out: [rows, heads, head_dim] with contiguous heads and head_dim.
    """
    lib = library()
    num_rows, num_heads, head_dim = q.shape
    _, num_kv_heads, num_blocks, block_size, _ = kv_layer.shape
    assert q.stride(2) == 1 and q.stride(1) == head_dim
    assert out.stride(2) == 1 and out.stride(1) == head_dim
    fn = lib.kvserve_paged_decode_f32 if q.dtype == torch.float32 else lib.kvserve_paged_decode_bf16
    status = fn(
        q.data_ptr(),
        q.stride(0),
        kv_layer.data_ptr(),
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
    if status != 0:
        raise ValueError(
            f"paged attention kernel refused shapes: {num_heads} heads / {num_kv_heads} KV "
            f"heads, head_dim {head_dim}"
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
    rows, hidden = x.shape
    out = torch.empty(rows, hidden, dtype=out_dtype)
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
    rows, double = gate_up.shape
    out = torch.empty(rows, double // 2, dtype=gate_up.dtype)
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
) -> None:
    """Rotate the q and k heads of `qkv` in place and write k and v into the cache.

    qkv: [rows, (heads + 2 kv_heads) * head_dim] contiguous; positions, slots: [rows] int64;
    cos_half, sin_half: [max_positions, head_dim / 2] float32;
    kv_layer: [2, kv_heads, num_blocks, block_size, head_dim] contiguous.
    """
    rows = qkv.shape[0]
    num_slots = kv_layer.shape[2] * kv_layer.shape[3]
    fn = getattr(library(), "kvserve_rope_store" + _suffix(qkv))
    fn(
        qkv.data_ptr(),
        positions.data_ptr(),
        cos_half.data_ptr(),
        sin_half.data_ptr(),
        slots.data_ptr(),
        kv_layer.data_ptr(),
        rows,
        num_heads,
        num_kv_heads,
        head_dim,
        num_slots,
        torch.get_num_threads(),
    )
