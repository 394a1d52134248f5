"""The CPU kernels' C sources, compiled per family and cached: what `CpuKernels` loads.

The sources in kvserve/model/csrc/ form families (`FAMILIES`): each has its C files, the header
that declares its exported symbols, and those symbols as Python declares them for ctypes
(`Symbol`: name, result type, named argument types). The declarations are the only place the
Python side spells a signature; tests/model/test_kernel_symbols.py parses each header and fails
when a declaration and its header disagree (a name, an argument's name or type, the count).

Every C file compiles on its own to an object file, cached under `$KVSERVE_CACHE_DIR/kernels`
(default ~/.cache/kvserve/kernels) and keyed by the file, every header, the flags, the compiler
and the CPU's feature flags (the build is -march=native). A family links its own objects and
those of the families it `requires` into one shared object, so a file that fails to compile
disables only the families built from it; the others load and run. The files compile in
parallel (about 10 s for all of them on a 2-core machine, once; later starts find them cached).

Where the cache directory cannot be written (a read-only home in a container), the objects go
to a temporary directory instead, with one warning; with no C compiler, or KVSERVE_NATIVE=0,
nothing is built and the model runs on torch ops (kvserve.model.kernels says what that costs).
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
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from kvserve.model.paths import user_cache_dir

log = logging.getLogger("kvserve.model")

CSRC = Path(__file__).with_name("csrc")
# -fno-math-errno / -fno-trapping-math (not -ffast-math: no reassociation, NaN and infinity keep
# their meaning) let loops with floorf and comparisons vectorize.
FLAGS = (
    "-O3",
    "-march=native",
    "-fno-math-errno",
    "-fno-trapping-math",
    "-fopenmp",
    "-fPIC",
    "-std=c11",
    # an intrinsic this compiler lacks fails the build here, not the library's load
    "-Werror=implicit-function-declaration",
)

# ctypes types by the short names the declarations use (and the C types they stand for)
CTYPES = {
    "p": ctypes.c_void_p,  # any pointer
    "i64": ctypes.c_int64,  # int64_t
    "i32": ctypes.c_int,  # int
    "f32": ctypes.c_float,  # float
}


@dataclass(frozen=True, slots=True)
class Symbol:
    """One exported C function: `args` are (name, short type) pairs, `result` a short type or
    None for void."""

    name: str
    result: str | None
    args: tuple[tuple[str, str], ...]

    @classmethod
    def of(cls, name: str, result: str | None, args: str) -> Symbol:
        """`Symbol.of("kvserve_f", "i32", "x:p rows:i64")`."""
        pairs = tuple((n, t) for n, t in (item.split(":") for item in args.split()))
        return cls(name, result, pairs)

    def bind(self, lib: ctypes.CDLL):
        function = getattr(lib, self.name)
        function.argtypes = [CTYPES[kind] for _, kind in self.args]
        function.restype = None if self.result is None else CTYPES[self.result]
        return function


@dataclass(frozen=True, slots=True)
class Family:
    """Kernels built and loaded together. `probe`, where given, names a symbol answering what
    this CPU runs (0: built, but its instructions are missing here)."""

    name: str
    sources: tuple[str, ...]
    header: str
    symbols: tuple[Symbol, ...]
    requires: tuple[str, ...] = ()
    probe: str | None = None


_S = Symbol.of
_ADD_RMSNORM = "x:p delta:p weight:p out:p rows:i64 hidden:i64 eps:f32 num_threads:i32"
_SILU_MUL = "gate_up:p out:p rows:i64 width:i64 num_threads:i32"
_ROPE = (
    "qkv:p positions:p cos_table:p sin_table:p slots:p kv:p rows:i64 heads:i64 kv_heads:i64 "
    "head_dim:i64 num_slots:i64 num_threads:i32"
)
_ROPE_Q8 = (
    "qkv:p positions:p cos_table:p sin_table:p slots:p kv:p scales:p rows:i64 heads:i64 "
    "kv_heads:i64 head_dim:i64 num_slots:i64 num_threads:i32"
)
_QK_NORM = "qkv:p rows:i64 width:i64 num_heads:i64 head_dim:i64 weight:p eps:f32 num_threads:i32"
_DECODE_TAIL = (
    "block_tables:p table_width:i64 row_tables:p lengths:p out:p out_row_stride:i64 "
    "num_seqs:i64 num_heads:i64 num_kv_heads:i64 head_dim:i64 num_blocks:i64 block_size:i64 "
    "scale:f32 num_threads:i32"
)
_DECODE = "q:p q_row_stride:i64 kv:p " + _DECODE_TAIL
_ATTENTION = "q:p q_row_stride:i64 kv:p " + _DECODE_TAIL.replace(
    "scale:f32", "scale:f32 window:i64 softcap:f32"
)
_DECODE_Q8 = "q:p q_row_stride:i64 kv:p scales:p " + _DECODE_TAIL
_GATED_Q8 = (
    "acc:p row_scales:p col_scales:p q:p scales:p rows:i64 width:i64 block:i64 num_threads:i32"
)
_GATED_QB = "gate_up:p q:p scales:p sums:p rows:i64 width:i64 num_threads:i32"
_QUANTIZE_ROWS = "x:p rows:i64 width:i64 row_stride:i64 q:p scales:p num_threads:i32"
_DEQUANTIZE = "acc:p row_scales:p col_scales:p bias:p out:p rows:i64 cols:i64 num_threads:i32"
_QUANTIZE_BLOCKS = "x:p rows:i64 width:i64 row_stride:i64 q:p scales:p sums:p num_threads:i32"
_BLOCKS_OUT = "q:p rest:p scales:p sums:p num_threads:i32"
_BLOCKS_QUANTIZE = "x:p rows:i64 k:i64 row_stride:i64 " + _BLOCKS_OUT
_DRIVER_STEP = (
    "positions:p cos:p sin:p slots:p tables:p table_width:i64 row_tables:p lengths:p "
    "num_blocks:i64 block_size:i64"
)

FAMILIES: tuple[Family, ...] = (
    Family(
        "layer_ops",
        ("layer_ops.c",),
        "layer_ops.h",
        (
            _S("kvserve_add_rmsnorm_f32", None, _ADD_RMSNORM),
            _S("kvserve_add_rmsnorm_bf16", None, _ADD_RMSNORM),
            _S("kvserve_silu_mul_f32", None, _SILU_MUL),
            _S("kvserve_silu_mul_bf16", None, _SILU_MUL),
            _S("kvserve_gelu_tanh_mul_f32", None, _SILU_MUL),
            _S("kvserve_gelu_tanh_mul_bf16", None, _SILU_MUL),
            _S("kvserve_rope_store_f32", None, _ROPE),
            _S("kvserve_rope_store_bf16", None, _ROPE),
            _S("kvserve_qk_norm_f32", None, _QK_NORM),
            _S("kvserve_qk_norm_bf16", None, _QK_NORM),
            _S("kvserve_word_sums", "i32", "count:i64 data:p nbytes:p sums:p num_threads:i32"),
        ),
    ),
    Family(
        "attention",
        ("paged_attention.c",),
        "attention.h",
        (
            _S("kvserve_paged_decode_f32", "i32", _DECODE),
            _S("kvserve_paged_decode_bf16", "i32", _DECODE),
            _S("kvserve_paged_attention_f32", "i32", _ATTENTION),
            _S("kvserve_paged_attention_bf16", "i32", _ATTENTION),
        ),
    ),
    Family(
        "kv_int8",
        ("kv_int8.c",),
        "kv_int8.h",
        (
            _S("kvserve_kv_int8_available", "i32", ""),
            _S("kvserve_rope_store_q8_f32", None, _ROPE_Q8),
            _S("kvserve_rope_store_q8_bf16", None, _ROPE_Q8),
            _S("kvserve_paged_decode_q8_f32", "i32", _DECODE_Q8),
            _S("kvserve_paged_decode_q8_bf16", "i32", _DECODE_Q8),
        ),
        probe="kvserve_kv_int8_available",
    ),
    Family(
        "quant_ops",
        ("quant_ops.c",),
        "quant_ops.h",
        (
            _S("kvserve_quantize_rows_f32", None, _QUANTIZE_ROWS),
            _S("kvserve_quantize_rows_bf16", None, _QUANTIZE_ROWS),
            _S(
                "kvserve_add_rmsnorm_q8",
                None,
                "x:p acc:p row_scales:p col_scales:p q:p scales:p rows:i64 hidden:i64 eps:f32 "
                "num_threads:i32",
            ),
            _S("kvserve_silu_mul_q8", None, _GATED_Q8),
            _S("kvserve_gelu_tanh_mul_q8", None, _GATED_Q8),
            _S(
                "kvserve_add_post_norm_q8",
                None,
                "x:p acc:p row_scales:p col_scales:p weight:p signs:p rows:i64 hidden:i64 "
                "block:i64 eps:f32 num_threads:i32",
            ),
            _S("kvserve_dequantize_f32", None, _DEQUANTIZE),
            _S("kvserve_dequantize_bf16", None, _DEQUANTIZE),
            _S("kvserve_rotate_rows", None, "x:p m:p out:p rows:i64 n:i64 num_threads:i32"),
            _S(
                "kvserve_topk_rows",
                None,
                "x:p rows:i64 n:i64 k:i64 indices:p num_threads:i32",
            ),
        ),
    ),
    Family(
        "int8_gemm",
        ("int8_gemm.c",),
        "int8_gemm.h",
        (
            _S("kvserve_int8_gemm_available", "i32", ""),
            _S("kvserve_int8_gemm_amx", "i32", ""),
            _S(
                "kvserve_int8_gemm",
                None,
                "a:p rows:i64 k:i64 packed:p correction:p n:i64 c:p num_threads:i32",
            ),
        ),
        probe="kvserve_int8_gemm_available",
    ),
    Family(
        "f32_gemm",
        ("f32_gemm.c",),
        "f32_gemm.h",
        (
            _S("kvserve_f32_gemm_available", "i32", ""),
            _S(
                "kvserve_f32_gemm",
                None,
                "x:p rows:i64 k:i64 w:p n:i64 bias:p out:p num_threads:i32",
            ),
        ),
        probe="kvserve_f32_gemm_available",
    ),
    Family(
        "q4",
        ("q4_gemm.c",),
        "q4.h",
        (
            _S("kvserve_q4_available", "i32", ""),
            _S(
                "kvserve_q4_gemm",
                None,
                "a:p scales:p sums:p rows:i64 k:i64 packed:p n:i64 asym:i32 c:p num_threads:i32",
            ),
            _S("kvserve_quantize_blocks_f32", None, _QUANTIZE_BLOCKS),
            _S("kvserve_quantize_blocks_bf16", None, _QUANTIZE_BLOCKS),
            _S(
                "kvserve_add_rmsnorm_qb",
                None,
                "x:p delta:p weight:p q:p scales:p sums:p rows:i64 hidden:i64 eps:f32 "
                "normalize:i32 num_threads:i32",
            ),
            _S("kvserve_silu_mul_qb", None, _GATED_QB),
            _S("kvserve_gelu_tanh_mul_qb", None, _GATED_QB),
        ),
        probe="kvserve_q4_available",
    ),
    Family(
        "blocks",
        ("blocks_gemm.c",),
        "blocks.h",
        (
            _S("kvserve_blocks_isa", "i32", ""),
            _S("kvserve_blocks_amx", "i32", ""),
            _S("kvserve_blocks_many_rows", "i32", ""),
            _S("kvserve_blocks_block_values", "i64", "format:i64"),
            _S("kvserve_blocks_gguf_bytes", "i64", "format:i64"),
            _S("kvserve_blocks_record_bytes", "i64", "format:i64"),
            _S(
                "kvserve_blocks_pack",
                "i32",
                "format:i64 raw:p n:i64 k:i64 packed:p num_threads:i32",
            ),
            _S(
                "kvserve_blocks_unpack",
                "i32",
                "format:i64 packed:p n:i64 k:i64 out:p num_threads:i32",
            ),
            _S(
                "kvserve_blocks_quantize_q4_0",
                "i32",
                "x:p rows:i64 k:i64 raw:p num_threads:i32",
            ),
            _S("kvserve_blocks_quantize_f32", None, _BLOCKS_QUANTIZE),
            _S("kvserve_blocks_quantize_bf16", None, _BLOCKS_QUANTIZE),
            _S(
                "kvserve_blocks_add_rmsnorm",
                None,
                "x:p delta:p weight:p rows:i64 hidden:i64 eps:f32 " + _BLOCKS_OUT,
            ),
            _S("kvserve_blocks_silu_mul", None, "gate_up:p rows:i64 width:i64 " + _BLOCKS_OUT),
            _S(
                "kvserve_blocks_gemm",
                "i32",
                "q:p rest:p scales:p sums:p rows:i64 k:i64 parts:p num_parts:i64 out:p "
                "ldc:i64 num_threads:i32",
            ),
        ),
        probe="kvserve_blocks_isa",
    ),
    Family(
        "bitmask",
        ("bitmask.c",),
        "bitmask.h",
        (
            _S(
                "kvserve_apply_token_bitmask",
                None,
                "logits:p logit_row_stride:i64 vocab:i64 bitmask:p words:i64 rows:p "
                "num_rows:i64 num_threads:i32",
            ),
        ),
    ),
    Family(
        "int8_driver",
        ("forward_int8.c",),
        "drivers.h",
        (
            _S(
                "kvserve_forward_int8",
                "i32",
                "x:p rows:i64 layers:p num_layers:i64 kv_layers:p kv_scale_layers:p heads:i64 "
                "kv_heads:i64 hd:i64 down_block:i64 eps:f32 scale:f32 bf16:i32 "
                + _DRIVER_STEP
                + " q8:p scales_a:p scales_b:p acc:p qkv:p attn:p nt:i32",
            ),
        ),
        requires=("layer_ops", "attention", "kv_int8", "quant_ops", "int8_gemm"),
    ),
    Family(
        "q4_driver",
        ("forward_q4.c",),
        "drivers.h",
        (
            _S(
                "kvserve_forward_q4",
                "i32",
                "x:p rows:i64 layers:p num_layers:i64 kv_layers:p kv_scale_layers:p heads:i64 "
                "kv_heads:i64 hd:i64 eps:f32 scale:f32 bf16:i32 "
                + _DRIVER_STEP
                + " q8:p e:p s:p product:p qkv:p attn:p nt:i32",
            ),
        ),
        requires=("layer_ops", "attention", "kv_int8", "q4"),
    ),
    Family(
        "blocks_driver",
        ("forward_blocks.c",),
        "drivers.h",
        (
            _S(
                "kvserve_forward_blocks",
                "i32",
                "x:p rows:i64 layers:p num_layers:i64 kv_layers:p kv_scale_layers:p heads:i64 "
                "kv_heads:i64 hd:i64 hidden:i64 intermediate:i64 fine:i32 eps:f32 scale:f32 "
                "bf16:i32 "
                + _DRIVER_STEP
                + " q:p rest:p act_scales:p sums:p product:p qkv:p attn:p nt:i32",
            ),
        ),
        requires=("layer_ops", "attention", "kv_int8", "blocks"),
    ),
)


@dataclass
class BuildResult:
    """What `build` produced: each family's loaded library (its symbols bound) or the reason it
    has none, and where the objects live."""

    libraries: dict[str, ctypes.CDLL] = field(default_factory=dict)
    failures: dict[str, str] = field(default_factory=dict)
    directory: Path | None = None
    seconds: float = 0.0  # compiling and linking what the cache did not have
    compiled: int = 0  # object files compiled at this build (0: all cached)


def _cpuinfo(field: str) -> str:
    """The first CPU's `field` in /proc/cpuinfo, "" where it cannot be read."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(field):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (/proc/cpuinfo), empty where they cannot be read."""
    return frozenset(_cpuinfo("flags").split())


def cpu_vendor() -> str:
    """The CPU's vendor_id (/proc/cpuinfo: GenuineIntel, AuthenticAMD, ...), "" if unknown."""
    return _cpuinfo("vendor_id")


# The AMX-INT8 tile unit (Sapphire Rapids on): the block product's many-row path
# (csrc/blocks_gemm.c, kvserve_blocks_amx). Asked for explicitly where the CPU has it, since
# -march=native leaves it out where the compiler does not recognize the CPU model.
AMX_FLAGS = ("-mamx-tile", "-mamx-int8")


def cpu_has_amx() -> bool:
    """Whether /proc/cpuinfo lists the AMX-INT8 tile unit (amx_tile and amx_int8)."""
    return {"amx_tile", "amx_int8"} <= cpu_flags()


def compile_flags() -> tuple[str, ...]:
    """FLAGS and what this CPU asks of the sources: on AMD's cores the block product prefetches
    its weight stream as non-temporal (csrc/blocks_gemm.c says what each vendor's cores
    measured); where /proc/cpuinfo lists amx_tile and amx_int8, the AMX-INT8 instructions."""
    flags = FLAGS + (("-DKVSERVE_PREFETCH_NTA",) if cpu_vendor() == "AuthenticAMD" else ())
    if cpu_has_amx():
        flags += AMX_FLAGS
    return flags


def find_compiler() -> str | None:
    """$CC when set (None if it names no program: the compiler asked for is missing), else cc
    or gcc on the PATH."""
    asked = os.environ.get("CC")
    if asked:
        return shutil.which(asked)
    return shutil.which("cc") or shutil.which("gcc")


def writable_directory(preferred: Path) -> tuple[Path | None, str | None]:
    """`preferred` if files can be written there, else a per-user temporary directory; with a
    warning text when it had to fall back, and None when nothing is writable."""
    try:
        preferred.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=preferred, prefix=".probe-"):
            pass
        return preferred, None
    except OSError as exc:
        reason = f"{type(exc).__name__}: {exc.strerror or exc}"
    fallback = Path(tempfile.gettempdir()) / f"kvserve-kernels-{os.getuid()}"
    try:
        fallback.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=fallback, prefix=".probe-"):
            pass
    except OSError:
        try:
            fallback = Path(tempfile.mkdtemp(prefix="kvserve-kernels-"))
        except OSError:
            return None, f"no writable directory for the CPU kernels ({preferred}: {reason})"
    return fallback, (
        f"the kernel cache {preferred} cannot be written ({reason}); compiled kernels go to "
        f"{fallback} instead (rebuilt whenever that is cleared)"
    )


def default_directory() -> Path:
    return user_cache_dir() / "kernels"


def _digest(*parts: bytes) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.hexdigest()[:16]


def _first_error(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if "error" in line]
    return (lines[0] if lines else stderr.strip().splitlines()[-1:] or ["failed"])[0].strip()


def build(
    csrc: Path = CSRC,
    directory: Path | None = None,
    families: tuple[Family, ...] = FAMILIES,
    compiler: str | None = None,
) -> BuildResult:
    """Compile (or find cached) every family's objects and load each family's library.
    Never raises for a failed build: a family that cannot be built is in `failures`."""
    result = BuildResult()
    compiler = compiler or find_compiler()
    if compiler is None:
        for family in families:
            result.failures[family.name] = "no C compiler (cc or gcc on the PATH, or $CC)"
        return result
    target, warning = writable_directory(directory or default_directory())
    if warning:
        log.warning(warning)
    if target is None:
        for family in families:
            result.failures[family.name] = "no writable directory for compiled kernels"
        return result
    result.directory = target
    headers = b"".join(path.read_bytes() for path in sorted(csrc.glob("*.h")))
    flags = compile_flags()
    key = "\n".join(flags).encode() + compiler.encode() + platform.machine().encode()
    key += " ".join(sorted(cpu_flags())).encode()

    sources = sorted({source for family in families for source in family.sources})
    started = time.perf_counter()

    def compile_one(source: str) -> tuple[str, Path | None, str | None]:
        text = (csrc / source).read_bytes()
        obj = target / f"{Path(source).stem}-{_digest(text, headers, key)}.o"
        if obj.exists():
            return source, obj, None
        with tempfile.TemporaryDirectory(dir=target) as tmp:
            built = Path(tmp) / obj.name
            try:
                run = subprocess.run(
                    [compiler, *flags, "-c", str(csrc / source), "-o", str(built)],
                    capture_output=True,
                    text=True,
                )
            except OSError as exc:
                return source, None, f"running {compiler} failed: {exc}"
            if run.returncode != 0:
                return source, None, f"compiling {source} failed: {_first_error(run.stderr)}"
            os.replace(built, obj)  # atomic: concurrent builders never see a partial file
        result.compiled += 1
        return source, obj, None

    with ThreadPoolExecutor(max_workers=max(1, min(len(sources), os.cpu_count() or 1))) as pool:
        outcomes = {source: (obj, error) for source, obj, error in pool.map(compile_one, sources)}
    by_name = {family.name: family for family in families}

    def objects_of(family: Family, seen: tuple[str, ...] = ()) -> tuple[list[Path], str | None]:
        objects: list[Path] = []
        for name in family.requires:
            if name in seen or name not in by_name:
                continue
            more, error = objects_of(by_name[name], (*seen, family.name))
            if error:
                return [], f"needs {name}: {error}"
            objects += more
        for source in family.sources:
            obj, error = outcomes[source]
            if error:
                return [], error
            objects.append(obj)
        return objects, None

    for family in families:
        objects, error = objects_of(family)
        if error:
            result.failures[family.name] = error
            log.warning("CPU kernels %s not built: %s", family.name, error)
            continue
        unique = list(dict.fromkeys(objects))
        library = target / f"{family.name}-{_digest(*(o.name.encode() for o in unique))}.so"
        if not library.exists():
            with tempfile.TemporaryDirectory(dir=target) as tmp:
                built = Path(tmp) / library.name
                run = subprocess.run(
                    [compiler, "-shared", "-fopenmp", *map(str, unique), "-o", str(built), "-lm"],
                    capture_output=True,
                    text=True,
                )
                if run.returncode != 0:
                    result.failures[family.name] = f"linking failed: {_first_error(run.stderr)}"
                    continue
                os.replace(built, library)
        try:
            lib = ctypes.CDLL(str(library))
            for symbol in family.symbols:
                symbol.bind(lib)
        except (OSError, AttributeError) as exc:
            result.failures[family.name] = f"loading failed: {exc}"
            continue
        result.libraries[family.name] = lib
    result.seconds = time.perf_counter() - started
    if result.compiled:
        log.info(
            "compiled %d CPU kernel sources in %.1f s (%s)", result.compiled, result.seconds, target
        )
    return result
