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

SOURCE = Path(__file__).with_name("csrc") / "paged_attention.c"
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11"]


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
    source = SOURCE.read_bytes()
    digest = hashlib.sha256(
        source + " ".join(FLAGS).encode() + _cpu_key().encode() + platform.machine().encode()
    ).hexdigest()[:16]
    target = _cache_dir() / f"paged_attention-{digest}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            built = Path(tmp) / target.name
            result = subprocess.run(
                [compiler, *FLAGS, str(SOURCE), "-o", str(built), "-lm"],
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


def paged_decode(
    q: torch.Tensor,
    kv_layer: torch.Tensor,
    block_tables: torch.Tensor,
    lengths: torch.Tensor,
    out: torch.Tensor,
    scale: float,
) -> None:
    """out[i] = attention of q[i] over positions 0..lengths[i]-1 of sequence i.

    q: [seqs, heads, head_dim] (rows may be strided, heads and head_dim contiguous);
    kv_layer: [2, kv_heads, num_blocks, block_size, head_dim] contiguous;
    block_tables: [seqs, width] int64 contiguous; lengths: [seqs] int64;
    out: [seqs, heads, head_dim] with contiguous heads and head_dim.
    """
    lib = library()
    num_seqs, num_heads, head_dim = q.shape
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
        lengths.data_ptr(),
        out.data_ptr(),
        out.stride(0),
        num_seqs,
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
            f"paged decode kernel refused shapes: {num_heads} heads / {num_kv_heads} KV heads, "
            f"head_dim {head_dim}"
        )
