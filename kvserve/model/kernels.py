"""CpuKernels: the compiled C kernels as one typed object, loaded once and passed explicitly.

`load_kernels()` builds (or finds cached) every kernel family of kvserve/model/kernel_build.py
and returns one `CpuKernels`; the model, its linear methods, its attention backend and the
sampler are handed that object. Its capability fields say, as plain values, what runs on this
CPU (`int8_gemm_isa`, `kv_int8`, `q4`, ...); `describe()` is the line the server's banner and
`GET /ready` print.

The C code trusts what it is handed, so every method checks it first: dimensions, dtypes,
contiguity and agreement between the arguments' shapes (`KernelInputError`, a ValueError, and
nothing runs), and a call with zero rows returns its empty result without entering C. The
index values a step feeds the kernels (positions, cache slots, block tables, lengths) are
checked once per step by `check_step_indices`, before the first kernel of the step runs. A
method whose family was not built raises `KernelUnavailable` naming the reason.

Without a C compiler (or with KVSERVE_NATIVE=0) `load_kernels()` returns kernels with no
family: the model then runs on torch ops alone, the float path, several times slower on a CPU
(docs/serving.md), with no int8 linear layers and no int8 KV cache.
"""

from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import Sequence
from functools import cache
from pathlib import Path

import numpy as np
import torch

from kvserve.model import kernel_build
from kvserve.model.block_formats import (
    ACT_BLOCK,
    FORMATS,
    ISAS,
    ActivationBlocks,
    BlockFormat,
    Part,
    packed_shape,
)

log = logging.getLogger("kvserve.model")

MAX_GROUP = 16
HEAD_DIMS = (64, 128)
FLOAT_DTYPES = (torch.float32, torch.bfloat16)
INT8_BLOCK_COLS = 64  # columns per packed int8 weight panel (csrc/int8_gemm.c)
INT8_GEMM_ISAS = {1: "AVX512-VNNI", 2: "AVX2"}  # kvserve_int8_gemm_available's answers
Q4_BLOCK = 32  # values per activation block and per 4-bit weight block (csrc/q4_gemm.c)
Q4_PANEL = 32  # output columns per packed 4-bit panel
Q4_NIBBLE_BYTES = Q4_PANEL * Q4_BLOCK // 2
NO_COMPILER_COST = (
    "the model runs on torch ops alone: float weights only (no int8 linear layers, no int8 KV "
    "cache), several times slower on a CPU"
)


class KernelInputError(ValueError):
    """A native kernel was handed something it cannot take; the kernel was not called."""


class KernelUnavailable(RuntimeError):
    """A kernel whose family was not built on this machine (the reason is the message)."""


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise KernelInputError(message)


def check_tensor(
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
    check_tensor(t, name, 1, (torch.int64,), shape=(rows,))


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
    """Check every index a step hands the CPU kernels (the CPU attention backend's metadata):
    positions within the RoPE tables, slots within the cache, block-table entries within the
    pool, each row's table and length within its table. Raises KernelInputError."""
    _rows_vector(meta.positions, "positions", num_rows)
    _rows_vector(meta.slot_mapping, "slot mapping", num_rows)
    _rows_vector(meta.row_tables, "row tables", num_rows)
    _rows_vector(meta.row_lengths, "row lengths", num_rows)
    check_tensor(meta.chunk_tables, "block tables", 2, (torch.int64,))
    num_tables, width = meta.chunk_tables.shape
    _span(meta.positions, "positions", 0, max_positions)
    _span(meta.slot_mapping, "cache slots", 0, num_blocks * block_size)
    _span(meta.chunk_tables, "block tables", 0, num_blocks)
    _span(meta.row_tables, "row tables", 0, num_tables)
    _span(meta.row_lengths, "row lengths", 1, width * block_size + 1)
    check_tensor(meta.logits_indices, "logits rows", 1, (torch.int64,))
    _span(meta.logits_indices, "logits rows", 0, num_rows)


_GATE_KERNELS = {"silu": "kvserve_silu_mul", "gelu_tanh": "kvserve_gelu_tanh_mul"}


def _gate_kernel(activation: str) -> str:
    _require(activation in _GATE_KERNELS, f"no gated kernel for activation {activation!r}")
    return _GATE_KERNELS[activation]


def _suffix(tensor: torch.Tensor) -> str:
    return "_f32" if tensor.dtype == torch.float32 else "_bf16"


def _ptr(tensor: torch.Tensor | None) -> int | None:
    return None if tensor is None else tensor.data_ptr()


def _threads() -> int:
    return torch.get_num_threads()


def check_attention_status(status: int, heads: int, kv_heads: int, head_dim: int) -> None:
    """Raise for a paged attention kernel's (or a layer driver's) nonzero status: -1, shapes
    the kernel refuses; -2, working memory it could not allocate."""
    if status == -2:
        raise MemoryError("the attention kernel could not allocate its working memory")
    if status != 0:
        raise ValueError(
            f"paged attention kernel refused shapes: {heads} heads / {kv_heads} KV heads, "
            f"head_dim {head_dim}"
        )


CPU_EXTENSIONS = (
    ("avx2", "AVX2"),
    ("fma", "FMA"),
    ("avx512f", "AVX512F"),
    ("avx512_vnni", "AVX512-VNNI"),
    ("avx512_bf16", "AVX512-BF16"),
    ("amx_bf16", "AMX-BF16"),
)


class CpuKernels:
    """The kernel families built here and their checked, typed entry points.

    Capabilities (plain fields, fixed at load): `families` (the names built), `failures`
    (family -> why not), `cpu_extensions` (the vector instructions this CPU has, of those the
    kernels use), `int8_gemm_isa` ("AVX512-VNNI" | "AVX2" | None), `f32_row_product`, `kv_int8`,
    `q4` (booleans: that path runs on this CPU), `blocks_amx_rows` and `int8_amx_rows` (the rows
    from which on the block and the int8 products take AMX-INT8, 0: never), `blocks_many_rows`
    (the rows from which on AVX2 or AVX512 takes the K-quants record by record, 0: never),
    `directory` (where the objects are cached).
    """

    def __init__(
        self,
        libraries: dict[str, ctypes.CDLL],
        failures: dict[str, str],
        *,
        directory: Path | None = None,
        flags: frozenset[str] = frozenset(),
    ) -> None:
        self._fn: dict[str, object] = {}
        for family in kernel_build.FAMILIES:
            lib = libraries.get(family.name)
            if lib is not None:
                for symbol in family.symbols:
                    self._fn[symbol.name] = getattr(lib, symbol.name)
        self.families = tuple(name for name in libraries)
        self.failures = dict(failures)
        self.directory = directory
        self.cpu_extensions = tuple(label for flag, label in CPU_EXTENSIONS if flag in flags)

        def probe(name: str) -> int:
            fn = self._fn.get(name)
            return int(fn()) if fn is not None else 0

        self.int8_gemm_isa: str | None = INT8_GEMM_ISAS.get(probe("kvserve_int8_gemm_available"))
        # the rows from which on the int8 products run on AMX-INT8 (0: never)
        self.int8_amx_rows = probe("kvserve_int8_gemm_amx") if self.int8_gemm_isa else 0
        self.f32_row_product = bool(probe("kvserve_f32_gemm_available"))
        self.kv_int8 = bool(probe("kvserve_kv_int8_available")) and self.has("attention")
        self.q4 = bool(probe("kvserve_q4_available")) and self.has("layer_ops", "attention")
        self.blocks_isa: str | None = ISAS.get(probe("kvserve_blocks_isa"))
        # the rows from which on the K-quants' 8-bit products run on AMX-INT8 (0: never, as
        # with KVSERVE_AMX=0)
        self.blocks_amx_rows = probe("kvserve_blocks_amx") if self.blocks_isa is not None else 0
        # the rows from which on the vector instructions take them record by record (AVX2, and
        # AVX512 where the tile unit does not take them; 0: never)
        self.blocks_many_rows = probe("kvserve_blocks_many_rows") if self.blocks_isa else 0
        if self.has("blocks"):
            self._check_block_formats()

    def _check_block_formats(self) -> None:
        """The Python table of block formats must be the C one: a mismatch would mis-size
        every check of the block kernels."""
        for f in FORMATS.values():
            got = (
                self._fn["kvserve_blocks_block_values"](f.ggml_type),
                self._fn["kvserve_blocks_gguf_bytes"](f.ggml_type),
                self._fn["kvserve_blocks_record_bytes"](f.ggml_type),
            )
            if got != (f.values, f.gguf_bytes, f.record_bytes):
                raise RuntimeError(f"blocks_gemm.c's {f.name} is {got}, not as block_formats.py")

    @classmethod
    def none(cls, reason: str) -> CpuKernels:
        """Kernels with no family built (no compiler, disabled, or not a CPU run)."""
        failures = {family.name: reason for family in kernel_build.FAMILIES}
        return cls({}, failures)

    def has(self, *families: str) -> bool:
        """Whether every named family was built."""
        return all(name in self.families for name in families)

    @property
    def available(self) -> bool:
        """Whether the float path's kernels (layer ops and paged attention) were built."""
        return self.has("layer_ops", "attention")

    @property
    def blocks_amx(self) -> bool:
        """Whether the block products take the AMX-INT8 tile unit for many rows."""
        return self.blocks_amx_rows > 0

    @property
    def blocks_path(self) -> str | None:
        """How the GGUF block products run, e.g. "AVX512-VNNI, AMX-INT8 from 16 rows"."""
        if self.blocks_isa is None:
            return None
        amx = f", AMX-INT8 from {self.blocks_amx_rows} rows" if self.blocks_amx else ""
        if self.blocks_many_rows:
            amx += f", record by record from {self.blocks_many_rows} rows"
        return f"{self.blocks_isa}{amx}"

    def describe(self) -> str:
        """One line for the banner and /ready: what was built, for which instructions."""
        if not self.families:
            why = next(iter(self.failures.values()), "not built")
            return f"CPU kernels: none ({why}): {NO_COMPILER_COST}"
        isa = "+".join(self.cpu_extensions) or "baseline x86-64"
        paths = []
        if self.int8_gemm_isa:
            amx = f", AMX-INT8 from {self.int8_amx_rows} rows" if self.int8_amx_rows else ""
            paths.append(f"int8 products by {self.int8_gemm_isa}{amx}")
        if self.f32_row_product:
            paths.append("float32 row product")
        if self.blocks_isa:
            paths.append(f"GGUF block products by {self.blocks_path}")
        paths.append("int8 KV cache" if self.kv_int8 else "no int8 KV cache (needs AVX512-VNNI)")
        paths.append("4-bit blocks" if self.q4 else "no 4-bit blocks (need AVX512-VNNI)")
        line = f"CPU kernels for {isa}: {', '.join(self.families)}; {', '.join(paths)}"
        if self.failures:
            line += "; not built: " + ", ".join(f"{k} ({v})" for k, v in self.failures.items())
        return line

    def as_dict(self) -> dict[str, object]:
        """The capabilities as plain values (GET /ready's body)."""
        return {
            "families": list(self.families),
            "failures": dict(self.failures),
            "cpu_extensions": list(self.cpu_extensions),
            "int8_gemm": self.int8_gemm_isa,
            "int8_amx_rows": self.int8_amx_rows,
            "f32_row_product": self.f32_row_product,
            "kv_int8": self.kv_int8,
            "q4": self.q4,
            "blocks": self.blocks_isa,
            "blocks_amx": self.blocks_amx,
            "blocks_many_rows": self.blocks_many_rows,
        }

    def _call(self, name: str):
        fn = self._fn.get(name)
        if fn is None:
            family = next(
                (f.name for f in kernel_build.FAMILIES if any(s.name == name for s in f.symbols)),
                "?",
            )
            raise KernelUnavailable(
                f"the {family} kernels are not built here: {self.failures.get(family, 'unknown')}"
            )
        return fn

    # -- what runs where ------------------------------------------------------------------------

    def supports(
        self, device: torch.device, dtype: torch.dtype, num_heads: int, num_kv_heads: int,
        head_dim: int,
    ) -> bool:  # fmt: skip
        """Whether the CPU attention and layer kernels run this model on this device."""
        return (
            device.type == "cpu"
            and dtype in FLOAT_DTYPES
            and head_dim in HEAD_DIMS
            and num_heads // num_kv_heads <= MAX_GROUP
            and self.available
        )

    # -- paged attention ------------------------------------------------------------------------

    def paged_attention(
        self,
        q: torch.Tensor,
        kv_layer: torch.Tensor,
        block_tables: torch.Tensor,
        lengths: torch.Tensor,
        out: torch.Tensor,
        scale: float,
        row_tables: torch.Tensor | None = None,
        kv_scales: torch.Tensor | None = None,
        *,
        window: int | None = None,
        softcap: float | None = None,
    ) -> None:
        """out[i] = attention of q[i] over positions 0..lengths[i]-1 of row i's sequence, whose
        block table is `block_tables[row_tables[i]]` (or `block_tables[i]` without `row_tables`).
        With a `window`, over positions lengths[i]-window..lengths[i]-1 only (blocks before them
        are not read); with a `softcap` C, each score s is C * tanh(s / C) before the softmax.
        The int8 cache takes neither.

        q: [rows, heads, head_dim] (rows may be strided, heads and head_dim contiguous);
        kv_layer: [2, kv_heads, num_blocks, block_size, head_dim] contiguous, in q's dtype, or
        int8 with `kv_scales` [2, kv_heads, num_blocks, block_size] float32 (csrc/kv_int8.c);
        block_tables: [tables, width] int64 contiguous; lengths, row_tables: [rows] int64;
        out: [rows, heads, head_dim] with contiguous heads and head_dim.
        """
        check_tensor(q, "q", 3, FLOAT_DTYPES, contiguous=False)
        num_rows, num_heads, head_dim = q.shape
        _require(q.stride(2) == 1 and q.stride(1) == head_dim, "q's heads must be contiguous")
        check_tensor(
            kv_layer,
            "kv cache layer",
            5,
            (q.dtype, torch.int8),
            shape=(2, None, None, None, head_dim),
        )
        _, num_kv_heads, num_blocks, block_size, _ = kv_layer.shape
        _require(
            num_kv_heads > 0 and num_heads % num_kv_heads == 0,
            f"{num_heads} heads do not group over {num_kv_heads} KV heads",
        )
        check_tensor(
            out, "out", 3, (q.dtype,), shape=(num_rows, num_heads, head_dim), contiguous=False
        )
        _require(out.stride(2) == 1 and out.stride(1) == head_dim, "out's heads must be contiguous")
        check_tensor(block_tables, "block tables", 2, (torch.int64,))
        _rows_vector(lengths, "lengths", num_rows)
        if row_tables is None:
            _require(block_tables.shape[0] >= num_rows, "one block table per row is needed")
        else:
            _rows_vector(row_tables, "row tables", num_rows)
        if num_rows == 0:
            return
        _require(window is None or window > 0, f"a sliding window must be positive, not {window}")
        _require(softcap is None or softcap > 0, f"a soft cap must be positive, not {softcap}")
        cache = [kv_layer.data_ptr()]
        extra = []
        if kv_scales is not None:
            _require(
                window is None and softcap is None,
                "the int8 KV cache kernels have no sliding window or soft cap",
            )
            _require(kv_layer.dtype == torch.int8, "an int8 cache goes with its scales")
            check_tensor(
                kv_scales, "kv scales", 4, (torch.float32,), shape=tuple(kv_layer.shape[:4])
            )
            fn = self._call("kvserve_paged_decode_q8" + _suffix(q))
            cache.append(kv_scales.data_ptr())
        else:
            _require(kv_layer.dtype == q.dtype, "the cache must be in q's dtype")
            fn = self._call("kvserve_paged_attention" + _suffix(q))
            extra = [window or 0, softcap or 0.0]
        status = fn(
            q.data_ptr(),
            q.stride(0),
            *cache,
            block_tables.data_ptr(),
            block_tables.shape[1],
            _ptr(row_tables),
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
            *extra,
            _threads(),
        )
        check_attention_status(status, num_heads, num_kv_heads, head_dim)

    # -- layer ops ------------------------------------------------------------------------------

    def add_rmsnorm(
        self,
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
        check_tensor(x, "x", 2, (torch.float32,))
        rows, hidden = x.shape
        _require(out_dtype in FLOAT_DTYPES, f"no rmsnorm kernel for {out_dtype}")
        if delta is not None:
            check_tensor(delta, "delta", 2, (out_dtype,), shape=(rows, hidden))
        check_tensor(weight, "norm weight", 1, (torch.float32,), shape=(hidden,))
        out = torch.empty(rows, hidden, dtype=out_dtype)
        if rows == 0:
            return out
        self._call("kvserve_add_rmsnorm" + _suffix(out))(
            x.data_ptr(),
            _ptr(delta),
            weight.data_ptr(),
            out.data_ptr(),
            rows,
            hidden,
            eps,
            _threads(),
        )
        return out

    def silu_mul(self, gate_up: torch.Tensor, activation: str = "silu") -> torch.Tensor:
        """act(gate) * up from `[rows, 2 * width]` (gate columns first): [rows, width]; act is
        silu, or gelu with the tanh approximation for `activation="gelu_tanh"` (GeGLU)."""
        check_tensor(gate_up, "gate_up", 2, FLOAT_DTYPES)
        rows, double = gate_up.shape
        _require(double % 2 == 0, "gate_up must have an even number of columns")
        out = torch.empty(rows, double // 2, dtype=gate_up.dtype)
        if rows == 0:
            return out
        self._call(_gate_kernel(activation) + _suffix(out))(
            gate_up.data_ptr(), out.data_ptr(), rows, double // 2, _threads()
        )
        return out

    def qk_norm(
        self, qkv: torch.Tensor, num_heads: int, head_dim: int, weight: torch.Tensor, eps: float
    ) -> None:
        """In place: each of the first `num_heads` heads of every row of qkv ([rows, width] in
        the model dtype, contiguous) RMS-normalized and scaled by weight ([num_heads, head_dim]
        float32), computed in float32."""
        check_tensor(qkv, "qkv", 2, FLOAT_DTYPES)
        rows, width = qkv.shape
        _require(num_heads * head_dim <= width, "the q/k heads do not fit the rows")
        check_tensor(weight, "q/k norms", 2, (torch.float32,), shape=(num_heads, head_dim))
        if rows == 0:
            return
        self._call("kvserve_qk_norm" + _suffix(qkv))(
            qkv.data_ptr(), rows, width, num_heads, head_dim, weight.data_ptr(), eps, _threads()
        )

    def word_sums(
        self, tensors: Sequence[torch.Tensor], num_threads: int | None = None
    ) -> list[int]:
        """Each tensor's sum, modulo 2^64, of its bytes' whole little-endian 64-bit words (its
        bytes past the last whole word left out), in one call that holds no interpreter lock:
        the checksums of a prepared-weight file, computed while the caller's thread goes on.
        Tensors on the CPU and contiguous; `num_threads` defaults to torch's."""
        for index, tensor in enumerate(tensors):
            _require(
                tensor.device.type == "cpu" and tensor.is_contiguous(),
                f"tensor {index} to sum is not a contiguous CPU tensor",
            )
        count = len(tensors)
        data = (ctypes.c_void_p * count)(*(t.data_ptr() for t in tensors))
        nbytes = (ctypes.c_int64 * count)(*(t.numel() * t.element_size() for t in tensors))
        sums = (ctypes.c_uint64 * count)()
        status = self._call("kvserve_word_sums")(
            count, data, nbytes, sums, _threads() if num_threads is None else num_threads
        )
        _require(status == 0, "the word-sum kernel refused its tensors")
        return list(sums)

    def rope_store(
        self,
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
        kv_layer: [2, kv_heads, num_blocks, block_size, head_dim] contiguous, in qkv's dtype, or
        int8 with `kv_scales` [2, kv_heads, num_blocks, block_size] float32 (each K and V row
        quantized with its own scale; see csrc/kv_int8.c).
        """
        width = (num_heads + 2 * num_kv_heads) * head_dim
        check_tensor(qkv, "qkv", 2, FLOAT_DTYPES, shape=(None, width))
        rows = qkv.shape[0]
        _rows_vector(positions, "positions", rows)
        _rows_vector(slots, "slots", rows)
        for table, name in ((cos_half, "cos table"), (sin_half, "sin table")):
            check_tensor(table, name, 2, (torch.float32,), shape=(None, head_dim // 2))
        check_tensor(
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
            check_tensor(
                kv_scales, "kv scales", 4, (torch.float32,), shape=tuple(kv_layer.shape[:4])
            )
            fn = self._call("kvserve_rope_store_q8" + _suffix(qkv))
            cache = [kv_layer.data_ptr(), kv_scales.data_ptr()]
        else:
            _require(kv_layer.dtype == qkv.dtype, "the cache must be in qkv's dtype")
            fn = self._call("kvserve_rope_store" + _suffix(qkv))
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
            _threads(),
        )

    # -- the int8 linear path -------------------------------------------------------------------

    def quantize_rows(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-row symmetric int8 of x: [rows, width] (rows may be strided, width contiguous).
        Returns (q [rows, width] int8, scales [rows] float32) with x ~= q * scales[:, None]."""
        check_tensor(x, "x", 2, FLOAT_DTYPES, contiguous=False)
        rows, width = x.shape
        _require(x.stride(1) == 1 or width <= 1, "x's rows must be contiguous")
        q = torch.empty(rows, width, dtype=torch.int8)
        scales = torch.empty(rows, dtype=torch.float32)
        if rows == 0:
            return q, scales
        self._call("kvserve_quantize_rows" + _suffix(x))(
            x.data_ptr(), rows, width, x.stride(0), q.data_ptr(), scales.data_ptr(), _threads()
        )
        return q, scales

    def add_rmsnorm_q8(
        self,
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
        check_tensor(x, "x", 2, (torch.float32,))
        rows, hidden = x.shape
        if acc is not None:
            check_tensor(acc, "acc", 2, (torch.int32,), shape=(rows, hidden))
            _require(row_scales is not None and col_scales is not None, "acc needs its scales")
            check_tensor(row_scales, "row scales", 1, (torch.float32,), shape=(rows,))
            check_tensor(col_scales, "column scales", 1, (torch.float32,), shape=(hidden,))
        q = scales = None
        if normalize:
            q = torch.empty(rows, hidden, dtype=torch.int8)
            scales = torch.empty(rows, dtype=torch.float32)
        if rows == 0:
            return (q, scales) if normalize else None
        self._call("kvserve_add_rmsnorm_q8")(
            x.data_ptr(),
            _ptr(acc),
            _ptr(row_scales),
            _ptr(col_scales),
            _ptr(q),
            _ptr(scales),
            rows,
            hidden,
            eps,
            _threads(),
        )
        return (q, scales) if normalize else None

    def silu_mul_q8(
        self,
        acc: torch.Tensor,
        row_scales: torch.Tensor,
        col_scales: torch.Tensor,
        block: int,
        activation: str = "silu",
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """From the int32 gate|up product `[rows, 2 * width]` (gate columns first) and its
        scales: m = act(gate) * up (act: silu, or gelu_tanh), rotated by normalized
        Walsh-Hadamard blocks of `block` columns (1 = no rotation), returned as per-row int8
        (q [rows, width], scales [rows])."""
        check_tensor(acc, "acc", 2, (torch.int32,))
        rows, double = acc.shape
        width = double // 2
        _require(double % 2 == 0, "the gate|up product must have an even number of columns")
        _require(
            block >= 1 and width % block == 0 and block & (block - 1) == 0,
            f"rotation block {block} must be a power of two dividing {width}",
        )
        check_tensor(row_scales, "row scales", 1, (torch.float32,), shape=(rows,))
        check_tensor(col_scales, "column scales", 1, (torch.float32,), shape=(double,))
        q = torch.empty(rows, width, dtype=torch.int8)
        scales = torch.empty(rows, dtype=torch.float32)
        if rows == 0:
            return q, scales
        self._call(_gate_kernel(activation) + "_q8")(
            acc.data_ptr(),
            row_scales.data_ptr(),
            col_scales.data_ptr(),
            q.data_ptr(),
            scales.data_ptr(),
            rows,
            width,
            block,
            _threads(),
        )
        return q, scales

    def add_post_norm_q8(
        self,
        x: torch.Tensor,
        acc: torch.Tensor,
        row_scales: torch.Tensor,
        col_scales: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        signs: torch.Tensor | None = None,
        block: int = 1,
    ) -> None:
        """x += (rmsnorm(y) * weight) R in place, y = acc * row_scales[:, None] * col_scales the
        int32 product [rows, hidden] and R = diag(signs) then normalized Walsh-Hadamard blocks
        of `block` columns (the residual rotation of kvserve/model/linear/int8.py's
        `structured_rotation`; no signs and block 1: R = I). x: [rows, hidden] float32."""
        check_tensor(x, "x", 2, (torch.float32,))
        rows, hidden = x.shape
        check_tensor(acc, "acc", 2, (torch.int32,), shape=(rows, hidden))
        check_tensor(row_scales, "row scales", 1, (torch.float32,), shape=(rows,))
        check_tensor(col_scales, "column scales", 1, (torch.float32,), shape=(hidden,))
        check_tensor(weight, "norm weight", 1, (torch.float32,), shape=(hidden,))
        if signs is not None:
            check_tensor(signs, "signs", 1, (torch.float32,), shape=(hidden,))
        _require(
            block >= 1 and hidden % block == 0 and block & (block - 1) == 0,
            f"rotation block {block} must be a power of two dividing {hidden}",
        )
        if rows == 0:
            return
        self._call("kvserve_add_post_norm_q8")(
            x.data_ptr(),
            acc.data_ptr(),
            row_scales.data_ptr(),
            col_scales.data_ptr(),
            weight.data_ptr(),
            _ptr(signs),
            rows,
            hidden,
            block,
            eps,
            _threads(),
        )

    def dequantize(
        self,
        acc: torch.Tensor,
        row_scales: torch.Tensor,
        col_scales: torch.Tensor,
        bias: torch.Tensor | None,
        dtype: torch.dtype,
    ) -> torch.Tensor:
        """acc * row_scales[:, None] * col_scales + bias, as `dtype` (float32 or bfloat16)."""
        check_tensor(acc, "acc", 2, (torch.int32,))
        rows, cols = acc.shape
        _require(dtype in FLOAT_DTYPES, f"no dequantize kernel for {dtype}")
        check_tensor(row_scales, "row scales", 1, (torch.float32,), shape=(rows,))
        check_tensor(col_scales, "column scales", 1, (torch.float32,), shape=(cols,))
        if bias is not None:
            check_tensor(bias, "bias", 1, (torch.float32,), shape=(cols,))
        out = torch.empty(rows, cols, dtype=dtype)
        if rows == 0:
            return out
        self._call("kvserve_dequantize" + _suffix(out))(
            acc.data_ptr(),
            row_scales.data_ptr(),
            col_scales.data_ptr(),
            _ptr(bias),
            out.data_ptr(),
            rows,
            cols,
            _threads(),
        )
        return out

    def rotate_rows(self, x: torch.Tensor, matrix: torch.Tensor) -> torch.Tensor:
        """x @ matrix for x: [rows, n] float32 and matrix: [n, n] float32 (both contiguous), each
        row computed alone in a fixed order: a row's result does not depend on its batch mates."""
        check_tensor(x, "x", 2, (torch.float32,))
        rows, n = x.shape
        check_tensor(matrix, "rotation", 2, (torch.float32,), shape=(n, n))
        out = torch.empty(rows, n, dtype=torch.float32)
        if rows == 0:
            return out
        self._call("kvserve_rotate_rows")(
            x.data_ptr(), matrix.data_ptr(), out.data_ptr(), rows, n, _threads()
        )
        return out

    def int8_gemm(
        self, q: torch.Tensor, panels: torch.Tensor, correction: torch.Tensor, n: int
    ) -> torch.Tensor:
        """q [rows, k] int8 (contiguous, values -127..127 as the quantizers give) times the
        packed weight's transpose (`pack_int8_weight`): [rows, n] int32."""
        check_tensor(q, "q", 2, (torch.int8,))
        rows, k = q.shape
        # The AVX2 product moves each weight's sign onto the row byte, which -128 cannot take.
        _require(rows == 0 or int(q.min()) > -128, "int8 rows must lie in -127..127")
        blocks = -(-n // INT8_BLOCK_COLS)
        check_tensor(panels, "panels", 4, (torch.int8,), shape=(blocks, k // 4, INT8_BLOCK_COLS, 4))
        _require(
            k % 4 == 0 and k > 0, f"the product's inner size {k} must be a positive multiple of 4"
        )
        check_tensor(correction, "correction", 1, (torch.int32,), shape=(blocks * INT8_BLOCK_COLS,))
        out = torch.empty(rows, n, dtype=torch.int32)
        if rows == 0:
            return out
        self._call("kvserve_int8_gemm")(
            q.data_ptr(),
            rows,
            k,
            panels.data_ptr(),
            correction.data_ptr(),
            n,
            out.data_ptr(),
            _threads(),
        )
        return out

    # -- float32 row product --------------------------------------------------------------------

    def f32_gemm(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x @ weight.T (+ bias) in float32, each output in one fixed arithmetic whatever the
        number of rows (csrc/f32_gemm.c): x [rows, k], weight [n, k], bias [n], contiguous
        float32, k a positive multiple of 8. Returns [rows, n]."""
        _require(
            self.f32_row_product, "the float32 row product needs the C kernels with AVX2 and FMA"
        )
        check_tensor(x, "x", 2, (torch.float32,))
        rows, k = x.shape
        check_tensor(weight, "weight", 2, (torch.float32,), shape=(None, k))
        _require(
            k % 8 == 0 and k > 0, f"the product's inner size {k} must be a positive multiple of 8"
        )
        n = weight.shape[0]
        if bias is not None:
            check_tensor(bias, "bias", 1, (torch.float32,), shape=(n,))
        out = torch.empty(rows, n, dtype=torch.float32)
        if rows == 0 or n == 0:
            return out
        self._call("kvserve_f32_gemm")(
            x.data_ptr(), rows, k, weight.data_ptr(), n, _ptr(bias), out.data_ptr(), _threads()
        )
        return out

    # -- logits and sampling --------------------------------------------------------------------

    def topk_rows(self, x: torch.Tensor, k: int) -> torch.Tensor:
        """Columns of the k largest values of each row of x: [rows, n] float32 contiguous, best
        first, the lower column first among equal values. Returns [rows, k] int64. k <= 64."""
        check_tensor(x, "x", 2, (torch.float32,))
        rows, n = x.shape
        _require(0 < k <= min(64, n), f"top-k needs 0 < k <= min(64, {n}), not {k}")
        indices = torch.empty(rows, k, dtype=torch.int64)
        if rows == 0:
            return indices
        self._call("kvserve_topk_rows")(x.data_ptr(), rows, n, k, indices.data_ptr(), _threads())
        return indices

    def apply_token_bitmask(
        self, logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor
    ) -> None:
        """In place: ``logits[rows[i], t] = -inf`` wherever bit t of ``bitmask[i]`` is clear.

        logits: [num_logit_rows, vocab] float32 with unit column stride; bitmask: [len(rows),
        words] int32 contiguous (llguidance's and xgrammar's layout); rows: [n] int64, each a
        row of logits. Tokens beyond ``words * 32`` are masked.
        """
        check_tensor(logits, "logits", 2, (torch.float32,), contiguous=False)
        _require(logits.stride(1) == 1, "logits must have unit column stride")
        check_tensor(rows, "rows", 1, (torch.int64,))
        check_tensor(bitmask, "bitmask", 2, (torch.int32,), shape=(rows.shape[0], None))
        _span(rows, "bitmask rows", 0, logits.shape[0])
        if rows.shape[0] == 0:
            return
        self._call("kvserve_apply_token_bitmask")(
            logits.data_ptr(),
            logits.stride(0),
            logits.shape[1],
            bitmask.data_ptr(),
            bitmask.shape[1],
            rows.data_ptr(),
            rows.shape[0],
            _threads(),
        )

    # -- 4-bit blocks ---------------------------------------------------------------------------

    def quantize_blocks(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Blocks of 32 values of x: [rows, width] (width a multiple of 32; rows may be strided)
        as (q [2, rows, width] int8, scales [rows, width / 32], sums [rows, width / 32] float32)
        with x ~= (16 q[0] + q[1]) * scales per block and sums = scales * (the block's sum of
        16 q[0] + q[1]): about 12 bits per value (csrc/q4_gemm.c)."""
        check_tensor(x, "x", 2, FLOAT_DTYPES, contiguous=False)
        rows, width = x.shape
        _require(x.stride(1) == 1 or width <= 1, "x's rows must be contiguous")
        q, scales, sums = _blocks_out(rows, width)
        if rows == 0:
            return q, scales, sums
        self._call("kvserve_quantize_blocks" + _suffix(x))(
            x.data_ptr(),
            rows,
            width,
            x.stride(0),
            q.data_ptr(),
            scales.data_ptr(),
            sums.data_ptr(),
            _threads(),
        )
        return q, scales, sums

    def add_rmsnorm_qb(
        self,
        x: torch.Tensor,
        delta: torch.Tensor | None,
        weight: torch.Tensor | None,
        eps: float,
        *,
        normalize: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """x += delta ([rows, hidden] float32, when given), in place; then, with `normalize`,
        the blocks (as `quantize_blocks`) of rmsnorm(x) * weight ([hidden] float32)."""
        check_tensor(x, "x", 2, (torch.float32,))
        rows, hidden = x.shape
        if delta is not None:
            check_tensor(delta, "delta", 2, (torch.float32,), shape=(rows, hidden))
        blocks = None
        if normalize:
            _require(weight is not None, "normalizing needs the norm weight")
            check_tensor(weight, "norm weight", 1, (torch.float32,), shape=(hidden,))
            blocks = _blocks_out(rows, hidden)
        if rows == 0:
            return blocks
        q, scales, sums = blocks if blocks is not None else (None, None, None)
        self._call("kvserve_add_rmsnorm_qb")(
            x.data_ptr(),
            _ptr(delta),
            _ptr(weight) if normalize else None,
            _ptr(q),
            _ptr(scales),
            _ptr(sums),
            rows,
            hidden,
            eps,
            int(normalize),
            _threads(),
        )
        return blocks

    def silu_mul_qb(
        self, gate_up: torch.Tensor, activation: str = "silu"
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """act(gate) * up (silu, or gelu_tanh) of the float32 gate|up product
        [rows, 2 * width], in blocks."""
        check_tensor(gate_up, "gate_up", 2, (torch.float32,))
        rows, double = gate_up.shape
        _require(double % 2 == 0, "gate_up must have an even number of columns")
        q, scales, sums = _blocks_out(rows, double // 2)
        if rows == 0:
            return q, scales, sums
        self._call(_gate_kernel(activation) + "_qb")(
            gate_up.data_ptr(),
            q.data_ptr(),
            scales.data_ptr(),
            sums.data_ptr(),
            rows,
            double // 2,
            _threads(),
        )
        return q, scales, sums

    def q4_gemm(
        self,
        q: torch.Tensor,
        scales: torch.Tensor,
        sums: torch.Tensor,
        packed: torch.Tensor,
        n: int,
        asym: bool,
    ) -> torch.Tensor:
        """Rows in blocks (`quantize_blocks`) times a packed 4-bit weight's transpose
        (kvserve.model.linear.q4.pack): [rows, n] float32."""
        _require(self.q4, "4-bit products need the C kernels with AVX512-VNNI")
        check_tensor(q, "q", 3, (torch.int8,), shape=(2, None, None))
        _, rows, k = q.shape
        _require(k > 0 and k % Q4_BLOCK == 0, f"the product's inner size {k} must be whole blocks")
        for t, name in ((scales, "scales"), (sums, "sums")):
            check_tensor(t, name, 2, (torch.float32,), shape=(rows, k // Q4_BLOCK))
        check_q4_packed(packed, n, k, asym)
        out = torch.empty(rows, n, dtype=torch.float32)
        if rows == 0:
            return out
        self._call("kvserve_q4_gemm")(
            q.data_ptr(),
            scales.data_ptr(),
            sums.data_ptr(),
            rows,
            k,
            packed.data_ptr(),
            n,
            int(asym),
            out.data_ptr(),
            _threads(),
        )
        return out

    # -- GGUF blocks (csrc/blocks_gemm.c) -------------------------------------------------------

    def blocks_pack(self, fmt: BlockFormat, raw: np.ndarray | torch.Tensor) -> torch.Tensor:
        """GGUF rows of blocks (uint8 [n, row bytes], row c = output column c) in the kernel's
        layout: uint8 [ceil(n / 16), blocks, record bytes]. A read-only memory map is read,
        never copied whole."""
        raw = _raw_array(raw)
        n, row_bytes = raw.shape
        _require(
            n > 0 and row_bytes > 0 and row_bytes % fmt.gguf_bytes == 0,
            f"a {fmt.name} weight of {n} rows of {row_bytes} bytes is not whole blocks of "
            f"{fmt.gguf_bytes} bytes",
        )
        k = row_bytes // fmt.gguf_bytes * fmt.values
        packed = torch.empty(packed_shape(fmt, n, k), dtype=torch.uint8)
        status = self._call("kvserve_blocks_pack")(
            fmt.ggml_type, raw.ctypes.data, n, k, packed.data_ptr(), _threads()
        )
        _require(status == 0, f"the packing kernel refused a {fmt.name} weight [{n}, {k}]")
        return packed

    def blocks_unpack(self, fmt: BlockFormat, packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
        """A packed weight back as float32 [n, k], with ggml's arithmetic (equal to
        `gguf.quants.dequantize` of the file's blocks)."""
        check_block_packed(fmt, packed, n, k)
        out = torch.empty(n, k, dtype=torch.float32)
        status = self._call("kvserve_blocks_unpack")(
            fmt.ggml_type, packed.data_ptr(), n, k, out.data_ptr(), _threads()
        )
        _require(status == 0, f"the unpacking kernel refused a {fmt.name} weight [{n}, {k}]")
        return out

    def blocks_quantize_q4_0(self, x: torch.Tensor) -> np.ndarray:
        """float32 rows [n, k] (k a multiple of 32) as GGUF Q4_0 rows: uint8 [n, k / 32 * 18],
        rounded as ggml's reference quantizer (and gguf-py's `quantize`) rounds them."""
        check_tensor(x, "x", 2, (torch.float32,))
        n, k = x.shape
        _require(k > 0 and k % 32 == 0, f"Q4_0 rows of {k} values are not whole blocks of 32")
        raw = np.empty((n, k // 32 * 18), dtype=np.uint8)
        status = self._call("kvserve_blocks_quantize_q4_0")(
            x.data_ptr(), n, k, raw.ctypes.data, _threads()
        )
        _require(status == 0, f"the Q4_0 quantizer refused rows [{n}, {k}]")
        return raw

    def blocks_quantize(self, x: torch.Tensor, fine: bool = False) -> ActivationBlocks:
        """Activation blocks of x: [rows, k] float32 or bfloat16 (rows may be strided, each row
        contiguous), k a multiple of 32; 8 bits a value, or 12 with `fine`."""
        check_tensor(x, "x", 2, FLOAT_DTYPES, contiguous=False)
        rows, k = x.shape
        _require(x.stride(1) == 1 or k <= 1, "x's rows must be contiguous")
        out = _activation_blocks(rows, k, fine)
        if rows == 0:
            return out
        self._call("kvserve_blocks_quantize" + _suffix(x))(
            x.data_ptr(), rows, k, x.stride(0), *_block_pointers(out), _threads()
        )
        return out

    def blocks_add_rmsnorm(
        self,
        x: torch.Tensor,
        delta: torch.Tensor | None,
        weight: torch.Tensor | None,
        eps: float,
        normalize: bool = True,
        fine: bool = False,
    ) -> ActivationBlocks | None:
        """In place x += delta (when given); then, with `normalize`, the activation blocks of
        rmsnorm(x) * weight (12 bits with `fine`). x, delta: [rows, hidden] float32 contiguous;
        weight: [hidden] float32."""
        check_tensor(x, "x", 2, (torch.float32,))
        rows, hidden = x.shape
        if delta is not None:
            check_tensor(delta, "delta", 2, (torch.float32,), shape=(rows, hidden))
        out = None
        if normalize:
            _require(weight is not None, "normalizing needs the norm weight")
            check_tensor(weight, "norm weight", 1, (torch.float32,), shape=(hidden,))
            out = _activation_blocks(rows, hidden, fine)
        if rows == 0:
            return out
        self._call("kvserve_blocks_add_rmsnorm")(
            x.data_ptr(),
            _ptr(delta),
            _ptr(weight) if normalize else None,
            rows,
            hidden,
            eps,
            *_block_pointers(out),
            _threads(),
        )
        return out

    def blocks_silu_mul(self, gate_up: torch.Tensor, fine: bool = False) -> ActivationBlocks:
        """The activation blocks of silu(gate) * up from the gate|up product [rows, 2 * width]
        float32 contiguous (gate columns first); 12 bits with `fine`."""
        check_tensor(gate_up, "gate|up", 2, (torch.float32,))
        rows, double = gate_up.shape
        _require(double % 2 == 0, "the gate|up product must have an even number of columns")
        out = _activation_blocks(rows, double // 2, fine)
        if rows == 0:
            return out
        self._call("kvserve_blocks_silu_mul")(
            gate_up.data_ptr(), rows, double // 2, *_block_pointers(out), _threads()
        )
        return out

    def blocks_gemm(self, x: ActivationBlocks, parts: Sequence[Part]) -> torch.Tensor:
        """x's rows times each part's weight transposed, the parts' columns side by side:
        float32 [rows, sum of n] (+ each part's bias). Every part has x's k inputs."""
        _require(self.blocks_isa is not None, "the block product needs the C kernels and AVX2")
        check_tensor(x.q, "activation values", 2, (torch.int8,))
        rows, k = x.q.shape
        _require(k > 0 and k % ACT_BLOCK == 0, f"the product's inner size {k} must be whole blocks")
        check_tensor(
            x.scales, "activation scales", 2, (torch.float32,), shape=(rows, k // ACT_BLOCK)
        )
        check_tensor(x.sums, "activation sums", 2, (torch.int32,), shape=(rows, k // 16))
        if x.rest is not None:
            check_tensor(x.rest, "activation rests", 2, (torch.int8,), shape=(rows, k))
        _require(len(parts) > 0, "a product needs at least one weight")
        table = (BlocksWeightStruct * len(parts))()
        for entry, part in zip(table, parts, strict=True):
            fmt = block_format(part.qtype)
            check_block_packed(fmt, part.packed, part.n, k)
            if part.bias is not None:
                check_tensor(part.bias, "bias", 1, (torch.float32,), shape=(part.n,))
            entry.packed, entry.bias = part.packed.data_ptr(), _ptr(part.bias)
            entry.n, entry.format = part.n, fmt.ggml_type
        columns = sum(part.n for part in parts)
        out = torch.empty(rows, columns, dtype=torch.float32)
        if rows == 0:
            return out
        # The AVX2 product moves Q8_0's signs onto the row bytes, which -128 cannot take, and
        # its saturation bounds assume |q| <= 127 (blocks_gemm.c).
        _require(int(x.q.min()) > -128, "activation values must lie in -127..127")
        if x.rest is not None:
            _require(int(x.rest.min()) > -128, "activation rests must lie in -127..127")
        status = self._call("kvserve_blocks_gemm")(
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
            _threads(),
        )
        _require(
            status != -3,
            "the K-quants' 8-bit activation blocks need one scale per 256 values "
            "(as blocks_quantize makes them)",
        )
        _require(status == 0, f"the block product refused its arguments (status {status})")
        return out

    # -- the one-call layer drivers -------------------------------------------------------------

    def forward_int8(
        self,
        x: torch.Tensor,
        table: ctypes.Array,
        kv: torch.Tensor,
        kv_scales: torch.Tensor | None,
        step: DriverStep,
        *,
        heads: int,
        kv_heads: int,
        head_dim: int,
        intermediate: int,
        down_block: int,
        eps: float,
        scale: float,
        dtype: torch.dtype,
    ) -> None:
        """Every layer of the int8 path on x ([rows, hidden] float32, in place): see
        csrc/forward_int8.c. `table`: `int8_layer_table`; kv: the whole cache ([layers, 2,
        kv_heads, blocks, block_size, head_dim]); kv_scales: its scales for an int8 cache."""
        check_tensor(x, "x", 2, (torch.float32,))
        rows, hidden = x.shape
        num_layers = len(table)
        q_size, kv_size = heads * head_dim, kv_heads * head_dim
        _require(num_layers > 0 and table[0].o.n == hidden, "the layer table does not fit x")
        pointers = step.check(rows, num_layers, kv, kv_scales, dtype, kv_heads, head_dim)
        if pointers is None:
            return
        kv_pointers, scale_pointers = pointers
        q8 = torch.empty(rows * max(hidden, q_size, intermediate), dtype=torch.int8)
        scales = torch.empty(2, rows, dtype=torch.float32)
        widest = max(q_size + 2 * kv_size, 2 * intermediate, hidden)
        acc = torch.empty(rows * widest, dtype=torch.int32)
        qkv = torch.empty(rows, q_size + 2 * kv_size, dtype=dtype)
        attn = torch.empty(rows, q_size, dtype=dtype)
        status = self._call("kvserve_forward_int8")(
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
            *step.arguments(kv),
            q8.data_ptr(),
            scales[0].data_ptr(),
            scales[1].data_ptr(),
            acc.data_ptr(),
            qkv.data_ptr(),
            attn.data_ptr(),
            _threads(),
        )
        check_attention_status(status, heads, kv_heads, head_dim)

    def forward_blocks(
        self,
        x: torch.Tensor,
        table: ctypes.Array,
        kv: torch.Tensor,
        kv_scales: torch.Tensor | None,
        step: DriverStep,
        *,
        config,
        fine: bool,
        scale: float,
        dtype: torch.dtype,
    ) -> None:
        """Every layer of the GGUF block path on x ([rows, hidden] float32, in place): see
        csrc/forward_blocks.c. `table`: BlocksLayerStruct per layer (kvserve.model.drivers);
        kv, kv_scales as `forward_int8`."""
        check_tensor(x, "x", 2, (torch.float32,))
        rows, hidden = x.shape
        _require(hidden == config.hidden_size, "x does not have the model's hidden size")
        heads, kv_heads, head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        q_size, kv_size, intermediate = config.q_size, config.kv_size, config.intermediate_size
        num_layers = len(table)
        _require(num_layers > 0, "no layers to run")
        pointers = step.check(rows, num_layers, kv, kv_scales, dtype, kv_heads, head_dim)
        if pointers is None:
            return
        kv_pointers, scale_pointers = pointers
        q, rest, act_scales, sums = _blocks_workspace(rows, max(hidden, q_size, intermediate), fine)
        product = torch.empty(
            rows * max(q_size + 2 * kv_size, 2 * intermediate, hidden), dtype=torch.float32
        )
        qkv = torch.empty(rows, q_size + 2 * kv_size, dtype=dtype)
        attn = torch.empty(rows, q_size, dtype=dtype)
        status = self._call("kvserve_forward_blocks")(
            x.data_ptr(),
            rows,
            ctypes.addressof(table),
            num_layers,
            kv_pointers,
            scale_pointers,
            heads,
            kv_heads,
            head_dim,
            hidden,
            intermediate,
            int(fine),
            config.rms_norm_eps,
            scale,
            int(dtype == torch.bfloat16),
            *step.arguments(kv),
            q.data_ptr(),
            _ptr(rest),
            act_scales.data_ptr(),
            sums.data_ptr(),
            product.data_ptr(),
            qkv.data_ptr(),
            attn.data_ptr(),
            _threads(),
        )
        if status <= -10:
            raise KernelInputError(f"the block product refused a layer (status {status + 10})")
        check_attention_status(status, heads, kv_heads, head_dim)

    def forward_q4(
        self,
        x: torch.Tensor,
        table: ctypes.Array,
        kv: torch.Tensor,
        kv_scales: torch.Tensor | None,
        step: DriverStep,
        *,
        config,
        scale: float,
        dtype: torch.dtype,
    ) -> None:
        """Every layer of the 4-bit path on x ([rows, hidden] float32, in place): see
        csrc/forward_q4.c. `table`: `q4_layer_table`; kv, kv_scales as `forward_int8`."""
        check_tensor(x, "x", 2, (torch.float32,))
        rows, hidden = x.shape
        heads, kv_heads, head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        q_size, kv_size, intermediate = config.q_size, config.kv_size, config.intermediate_size
        num_layers = len(table)
        _require(num_layers > 0 and table[0].o.n == hidden, "the layer table does not fit x")
        pointers = step.check(rows, num_layers, kv, kv_scales, dtype, kv_heads, head_dim)
        if pointers is None:
            return
        kv_pointers, scale_pointers = pointers
        widest = max(hidden, q_size, intermediate)
        q8 = torch.empty(2 * rows * widest, dtype=torch.int8)
        block_scales = torch.empty(2, rows * widest // Q4_BLOCK, dtype=torch.float32)
        product = torch.empty(
            rows * max(q_size + 2 * kv_size, 2 * intermediate, hidden), dtype=torch.float32
        )
        qkv = torch.empty(rows, q_size + 2 * kv_size, dtype=dtype)
        attn = torch.empty(rows, q_size, dtype=dtype)
        status = self._call("kvserve_forward_q4")(
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
            *step.arguments(kv),
            q8.data_ptr(),
            block_scales[0].data_ptr(),
            block_scales[1].data_ptr(),
            product.data_ptr(),
            qkv.data_ptr(),
            attn.data_ptr(),
            _threads(),
        )
        check_attention_status(status, heads, kv_heads, head_dim)


def block_format(qtype: str) -> BlockFormat:
    """The format named `qtype` ("Q4_K", ...); KernelInputError for one the kernels lack."""
    fmt = FORMATS.get(qtype)
    _require(fmt is not None, f"no block kernel for {qtype!r} (known: {', '.join(FORMATS)})")
    return fmt


def check_block_packed(fmt: BlockFormat, packed: torch.Tensor, n: int, k: int) -> None:
    _require(n > 0, f"a packed weight needs output columns, not {n}")
    _require(
        k > 0 and k % fmt.values == 0,
        f"the inner size {k} is not whole {fmt.name} blocks of {fmt.values}",
    )
    check_tensor(
        packed, f"packed {fmt.name} weight", 3, (torch.uint8,), shape=packed_shape(fmt, n, k)
    )


def _raw_array(raw: np.ndarray | torch.Tensor) -> np.ndarray:
    if isinstance(raw, torch.Tensor):
        _require(raw.device.type == "cpu", f"raw blocks must be on the CPU, not {raw.device}")
        raw = raw.numpy()
    _require(isinstance(raw, np.ndarray), "raw blocks must be a numpy array or a tensor")
    _require(raw.dtype == np.uint8 and raw.ndim == 2, "raw blocks must be uint8 [rows, row bytes]")
    return np.ascontiguousarray(raw)


def _activation_blocks(rows: int, k: int, fine: bool) -> ActivationBlocks:
    _require(k > 0 and k % ACT_BLOCK == 0, f"a row of {k} values is not whole blocks of 32")
    return ActivationBlocks(
        torch.empty(rows, k, dtype=torch.int8),
        torch.empty(rows, k // ACT_BLOCK, dtype=torch.float32),
        torch.empty(rows, k // 16, dtype=torch.int32),
        torch.empty(rows, k, dtype=torch.int8) if fine else None,
    )


def _block_pointers(out: ActivationBlocks | None) -> tuple:
    if out is None:
        return None, None, None, None
    return out.q.data_ptr(), _ptr(out.rest), out.scales.data_ptr(), out.sums.data_ptr()


class BlocksWeightStruct(ctypes.Structure):
    """kvserve_blocks_weight in csrc/blocks.h."""

    _fields_ = [
        ("packed", ctypes.c_void_p),
        ("bias", ctypes.c_void_p),
        ("n", ctypes.c_int64),
        ("format", ctypes.c_int64),
    ]


class BlocksProductStruct(ctypes.Structure):
    """kvserve_blocks_product in csrc/drivers.h."""

    _fields_ = [("parts", ctypes.c_void_p), ("num_parts", ctypes.c_int64)]


class BlocksLayerStruct(ctypes.Structure):
    """kvserve_blocks_layer in csrc/drivers.h."""

    _fields_ = [(name, BlocksProductStruct) for name in ("qkv", "o", "gate_up", "down")] + [
        ("attn_norm", ctypes.c_void_p),
        ("mlp_norm", ctypes.c_void_p),
        ("qk_norm", ctypes.c_void_p),
    ]


def _blocks_workspace(rows: int, widest: int, fine: bool):
    return (
        torch.empty(rows * widest, dtype=torch.int8),
        torch.empty(rows * widest, dtype=torch.int8) if fine else None,
        torch.empty(rows * widest // ACT_BLOCK, dtype=torch.float32),
        torch.empty(rows * widest // 16, dtype=torch.int32),
    )


def _blocks_out(rows: int, width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    _require(width % Q4_BLOCK == 0, f"a row of {width} values is not whole blocks of {Q4_BLOCK}")
    return (
        torch.empty(2, rows, width, dtype=torch.int8),
        torch.empty(rows, width // Q4_BLOCK, dtype=torch.float32),
        torch.empty(rows, width // Q4_BLOCK, dtype=torch.float32),
    )


def q4_record_bytes(asym: bool) -> int:
    """Bytes per (panel, block) record of a packed 4-bit weight: nibbles, d, and m for Q4_1."""
    return Q4_NIBBLE_BYTES + (2 if asym else 1) * Q4_PANEL * 2


def check_q4_packed(packed: torch.Tensor, n: int, k: int, asym: bool) -> None:
    _require(n > 0, f"a 4-bit weight needs output columns, not {n}")
    check_tensor(
        packed,
        "packed weight",
        3,
        (torch.uint8,),
        shape=(-(-n // Q4_PANEL), k // Q4_BLOCK, q4_record_bytes(asym)),
    )


class DriverStep:
    """What the one-call layer drivers read of a step (positions and RoPE tables, cache slots
    and block tables, each row's table and length), checked once for the step."""

    __slots__ = ("positions", "cos_half", "sin_half", "slots", "tables", "row_tables", "lengths")

    def __init__(self, meta, cos_half: torch.Tensor, sin_half: torch.Tensor) -> None:
        self.positions = meta.positions
        self.cos_half, self.sin_half = cos_half, sin_half
        self.slots = meta.slot_mapping
        self.tables = meta.chunk_tables
        self.row_tables = meta.row_tables
        self.lengths = meta.row_lengths

    def check(
        self,
        rows: int,
        num_layers: int,
        kv: torch.Tensor,
        kv_scales: torch.Tensor | None,
        dtype: torch.dtype,
        kv_heads: int,
        head_dim: int,
    ) -> tuple[ctypes.Array, ctypes.Array | None] | None:
        """Check the step and the cache for `rows` rows: each layer's cache pointer and their
        scale pointers (or None); None when there are no rows (nothing to run)."""
        _require(dtype in FLOAT_DTYPES, f"no layer driver for {dtype}")
        check_tensor(
            kv,
            "kv cache",
            6,
            (dtype, torch.int8),
            shape=(num_layers, 2, kv_heads, None, None, head_dim),
        )
        if kv_scales is not None:
            _require(kv.dtype == torch.int8, "an int8 cache goes with its scales")
            check_tensor(kv_scales, "kv scales", 5, (torch.float32,), shape=tuple(kv.shape[:5]))
        else:
            _require(kv.dtype == dtype, "the cache must be in the model's dtype")
        for vector, name in (
            (self.positions, "positions"),
            (self.slots, "slots"),
            (self.row_tables, "row tables"),
            (self.lengths, "lengths"),
        ):
            _rows_vector(vector, name, rows)
        check_tensor(self.tables, "block tables", 2, (torch.int64,))
        for half, name in ((self.cos_half, "cos table"), (self.sin_half, "sin table")):
            check_tensor(half, name, 2, (torch.float32,), shape=(None, head_dim // 2))
        if rows == 0:
            return None

        def per_layer(t: torch.Tensor) -> ctypes.Array:
            step = t.stride(0) * t.element_size()
            pointers = (t.data_ptr() + i * step for i in range(num_layers))
            return (ctypes.c_void_p * num_layers)(*pointers)

        return per_layer(kv), None if kv_scales is None else per_layer(kv_scales)

    def arguments(self, kv: torch.Tensor) -> tuple:
        """The step's arguments in the drivers' order (csrc/drivers.h)."""
        _, _, _, num_blocks, block_size, _ = kv.shape
        return (
            *(t.data_ptr() for t in (self.positions, self.cos_half, self.sin_half, self.slots)),
            self.tables.data_ptr(),
            self.tables.shape[1],
            self.row_tables.data_ptr(),
            self.lengths.data_ptr(),
            num_blocks,
            block_size,
        )


class Int8WeightStruct(ctypes.Structure):
    """kvserve_int8_weight in csrc/drivers.h."""

    _fields_ = [
        ("panels", ctypes.c_void_p),
        ("correction", ctypes.c_void_p),
        ("scale", ctypes.c_void_p),
        ("bias", ctypes.c_void_p),
        ("n", ctypes.c_int64),
        ("k", ctypes.c_int64),
    ]


class Int8LayerStruct(ctypes.Structure):
    """kvserve_int8_layer in csrc/drivers.h."""

    _fields_ = [(name, Int8WeightStruct) for name in ("qkv", "o", "gate_up", "down")] + [
        ("qk_norm", ctypes.c_void_p)
    ]


class Q4WeightStruct(ctypes.Structure):
    """kvserve_q4_weight in csrc/drivers.h."""

    _fields_ = [
        ("packed", ctypes.c_void_p),
        ("bias", ctypes.c_void_p),
        ("n", ctypes.c_int64),
        ("k", ctypes.c_int64),
        ("asym", ctypes.c_int64),
    ]


class Q4LayerStruct(ctypes.Structure):
    """kvserve_q4_layer in csrc/drivers.h."""

    _fields_ = [(name, Q4WeightStruct) for name in ("qkv", "o", "gate_up", "down")] + [
        ("attn_norm", ctypes.c_void_p),
        ("mlp_norm", ctypes.c_void_p),
        ("qk_norm", ctypes.c_void_p),
    ]


def blocks_parts_table(parts) -> ctypes.Array:
    """The C description of a product's packed parts (kvserve.model.block_formats.Part),
    checked; it points into their tensors, which must outlive it."""
    table = (BlocksWeightStruct * len(parts))()
    for entry, part in zip(table, parts, strict=True):
        fmt = block_format(part.qtype)
        if part.bias is not None:
            check_tensor(part.bias, "bias", 1, (torch.float32,), shape=(part.n,))
        entry.packed, entry.bias = part.packed.data_ptr(), _ptr(part.bias)
        entry.n, entry.format = part.n, fmt.ggml_type
    return table


def _env_disabled() -> bool:
    return os.environ.get("KVSERVE_NATIVE", "1") == "0"


@cache
def load_kernels() -> CpuKernels:
    """This process's kernels: built (or found cached) once, then the same object. With
    KVSERVE_NATIVE=0 or no C compiler, kernels with no family (one warning says so)."""
    if _env_disabled():
        return CpuKernels.none("disabled by KVSERVE_NATIVE=0")
    result = kernel_build.build()
    if not result.libraries:
        reason = next(iter(result.failures.values()), "not built")
        log.warning("no CPU kernels (%s): %s", reason, NO_COMPILER_COST)
    return CpuKernels(
        result.libraries,
        result.failures,
        directory=result.directory,
        flags=kernel_build.cpu_flags(),
    )


def kernels_from(
    csrc: Path, directory: Path, families: tuple[kernel_build.Family, ...] | None = None
) -> CpuKernels:
    """Kernels built from another source tree into `directory` (tests of the build)."""
    result = kernel_build.build(csrc, directory, families or kernel_build.FAMILIES)
    return CpuKernels(
        result.libraries, result.failures, directory=result.directory,
        flags=kernel_build.cpu_flags(),
    )  # fmt: skip
