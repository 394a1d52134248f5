"""Load a model (GGUF file or Hugging Face directory) onto a device, with its tokenizer."""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import sys
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from kvserve.collector import collector_paused
from kvserve.config import DeviceConfig
from kvserve.model import device_thread
from kvserve.model.config import ModelConfig
from kvserve.model.kernels import CpuKernels, load_kernels
from kvserve.model.linear.blocks import holds_k_quants
from kvserve.model.llama import LlamaModel
from kvserve.model.paths import model_name, resolve_model_path

log = logging.getLogger("kvserve.model")

_DTYPES = {
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
}


def cpu_has_bf16() -> bool:
    """True when the CPU multiplies bf16 natively (AVX512-BF16 or AMX)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = line.split()
                    return "avx512_bf16" in flags or "amx_bf16" in flags
    except OSError:
        pass
    return False


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for but no CUDA device is available")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.bfloat16 if cpu_has_bf16() else torch.float32
    if name not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r} (use auto, bfloat16, float16 or float32)")
    return _DTYPES[name]


# Tensor types of float checkpoints (GGUF names and torch's): `auto` keeps their precision.
FLOAT_TENSOR_TYPES = frozenset(
    {
        "F64",
        "F32",
        "F16",
        "BF16",
        "torch.float64",
        "torch.float32",
        "torch.float16",
        "torch.bfloat16",
    }
)


def choose_quantization(
    requested: str,
    tensor_types: list[str],
    config: ModelConfig,
    device: torch.device,
    dtype: torch.dtype,
    *,
    dtype_asked: bool = False,
    q4_unsupported: str | None = None,
    kernels: CpuKernels | None = None,
    gguf_unsupported: str | None = "not checked",
) -> tuple[str, str]:
    """Resolve `--quantization` to "none", "int8" or "q4", with the reason in a few words.

    `q4_unsupported` says why `--quantization q4` (the file's 4-bit blocks kept in memory, see
    kvserve/model/linear/q4.py) cannot run this checkpoint here; None: it can. `auto` does not pick
    it: its products take twice the integer multiplies of int8's, so prefill and many streams at
    once run at about half int8's speed, for twice the speed at one stream (docs/serving.md).

    A dtype asked for by name (`--dtype float32`, `LLM(dtype="float32")`) is a request for the
    float path in that dtype, so `auto` keeps it.

    `auto` picks int8 linear layers when the checkpoint is already quantized (its weights were
    rounded to 4-8 bits: int8 with a per-row scale loses nothing they still had, see
    docs/serving.md) and the CPU kernels run this model here. A float checkpoint keeps its
    precision. Where kvserve's int8 product kernel does not run (no C compiler, a CPU without
    the vector instructions it needs), `auto` keeps the float path: the library product left
    then (torch._int_mm) is slower than float on such CPUs (docs/serving.md).
    """
    if requested == "q4" and q4_unsupported is not None:
        raise ValueError(f"--quantization q4 cannot run this model here: {q4_unsupported}")
    if requested == "gguf" and gguf_unsupported is not None:
        raise ValueError(f"--quantization gguf cannot run this model here: {gguf_unsupported}")
    if requested != "auto":
        return requested, "asked for"
    if dtype_asked:
        return "none", f"auto: --dtype {str(dtype).removeprefix('torch.')} asked for, kept"
    quantized = sorted(set(tensor_types) - FLOAT_TENSOR_TYPES)
    if not quantized:
        return "none", f"auto: the checkpoint is float ({'/'.join(tensor_types)}), kept as it is"
    if holds_k_quants(quantized) and gguf_unsupported is None:
        return "gguf", (
            f"auto: the file's blocks kept ({'/'.join(quantized)}), products by "
            f"{kernels.blocks_isa}"
        )
    if (
        kernels is None
        or not kernels.supports(
            device, dtype, config.num_heads, config.num_kv_heads, config.head_dim
        )
        or not kernels.has("quant_ops")
        or not hasattr(torch, "_int_mm")
    ):
        return "none", (
            f"auto: the checkpoint is quantized ({'/'.join(quantized)}) but the CPU kernels do "
            f"not run it here ({device.type}, {str(dtype).removeprefix('torch.')}, "
            f"head_dim {config.head_dim})"
        )
    if not kernels.int8_gemm_isa:
        return "none", (
            f"auto: the checkpoint is quantized ({'/'.join(quantized)}) but kvserve's int8 "
            "product kernel does not run on this CPU (torch._int_mm is slower than float here)"
        )
    return "int8", (
        f"auto: the checkpoint is quantized ({'/'.join(quantized)}); int8 products by "
        f"{kernels.int8_gemm_isa}"
    )


def missing_kernels(
    quantization: str, int8_kv_cache: bool, kernels: CpuKernels | None = None
) -> str | None:
    """Why this CPU cannot run a configuration's C kernels (they were not built here), or None.
    int8 linear layers need AVX512-VNNI or AVX2; the int8 KV cache and 4-bit blocks need
    AVX512-VNNI."""
    kernels = kernels or load_kernels()
    if int8_kv_cache and not kernels.kv_int8:
        return "the int8 KV cache needs AVX512-VNNI"
    if quantization == "int8" and not kernels.int8_gemm_isa:
        return "int8 linear layers need AVX512-VNNI or AVX2"
    if quantization == "q4" and not kernels.q4:
        return "4-bit blocks need AVX512-VNNI"
    if quantization == "gguf" and not kernels.blocks_isa:
        return "GGUF block products need AVX2"
    return None


def configure_threads(num_threads: int | None) -> int:
    """Set torch's intra-op threads (default: every core) and one inter-op thread."""
    threads = num_threads or os.cpu_count() or 1
    torch.set_num_threads(threads)
    keep_freed_memory()
    return threads


# glibc's mallopt parameters
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3


def keep_freed_memory() -> bool:
    """Ask glibc to keep freed blocks instead of handing each one back to the kernel.

    A forward pass allocates and frees the same few-megabyte activations every step. By default
    glibc serves blocks that large with a fresh mmap, so every step pays page faults and the
    zeroing of new pages inside the kernels that first write them (5-10% of a prefill here).
    With a 32 MiB mmap threshold and a 256 MiB trim threshold they stay in the heap and are
    reused. Returns False where this is not glibc (nothing is changed).
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
        return all(
            libc.mallopt(parameter, value) == 1
            for parameter, value in (
                (_M_MMAP_THRESHOLD, 32 << 20),
                (_M_TRIM_THRESHOLD, 256 << 20),
                (_M_TOP_PAD, 16 << 20),
            )
        )
    except (OSError, AttributeError):
        return False


@dataclass
class LoadedModel:
    model: LlamaModel
    tokenizer: object  # kvserve.tokenizer.Tokenizer
    config: ModelConfig
    path: Path
    name: str  # the name served by default
    device: torch.device
    dtype: torch.dtype
    load_seconds: float
    quantization: list[str]  # the checkpoint's tensor types
    # What `--quantization` resolved to ("none" | "int8" | "q4") and why, in a few words.
    quantization_reason: str = "asked for"
    # The prepared-weight cache at this load: "hit", "written" (repacked, the file written
    # behind the load: `weight_cache_written`), "rebuilt" (a corrupt file is replaced),
    # "unwritten" (could not write; set when the write fails), "off" (disabled or nothing to
    # prepare).
    weight_cache: str = "off"
    # The write of the prepared-weight file behind this load (its result: the file's path, or
    # None when it could not be written); None when nothing is written.
    weight_cache_written: Future | None = None
    kernels: CpuKernels | None = None  # the CPU kernels the model runs on (None on CUDA)
    # Where the load's seconds went: building the kernels, reading the file's header, and
    # preparing the weights (repacked, or mapped from the prepared-weight cache) with the
    # tokenizer, which is built while the mapped weights are checked (else before a repack).
    kernels_seconds: float = 0.0
    read_seconds: float = 0.0
    weights_seconds: float = 0.0
    file_bytes: int = 0  # the checkpoint's size on disk
    requantized: str | None = None  # the type its larger layer blocks were requantized to

    def describe_load(self) -> str:
        """The load's time split, e.g. "kernels 0.0 s, read 0.2 s, weights and tokenizer 1.1 s
        (mapped from the prepared-weight cache)"."""
        how = {
            "hit": "mapped from the prepared-weight cache",
            "written": "repacked; the prepared-weight cache is written behind the start",
            "rebuilt": "repacked: the cached copy was unusable and is replaced behind the start",
            "unwritten": "repacked; the prepared-weight cache could not be written",
        }.get(self.weight_cache, "read from the checkpoint")
        return (
            f"kernels {self.kernels_seconds:.1f} s, read {self.read_seconds:.1f} s, "
            f"weights and tokenizer {self.weights_seconds:.1f} s ({how})"
        )

    def describe_kernels(self) -> str:
        """The CPU kernels built for this model's run, and how its layers and attention run."""
        model = self.model
        kernels = self.kernels.describe() if self.kernels is not None else "CPU kernels: not used"
        return f"{kernels}\n  layers: {model.driver_reason}; attention: {model.attention.name}"

    def kernels_status(self) -> dict:
        """The same as plain values (GET /ready's body)."""
        return {
            "kernels": None if self.kernels is None else self.kernels.as_dict(),
            "layers": self.model.driver_reason,
            "attention": self.model.attention.name,
        }

    def summary(self) -> str:
        cfg = self.config
        windows = ""
        if cfg.windowed:
            count = sum(w is not None for w in cfg.layer_windows)
            windows = f", sliding window {cfg.sliding_window} on {count}/{cfg.num_layers} layers"
        return (
            f"loaded {self.name}: {cfg.architecture}, {cfg.num_parameters() / 1e6:.1f}M params, "
            f"{cfg.num_layers} layers, {str(self.dtype).removeprefix('torch.')}"
            f"{'' if self.model.quantization == 'none' else ' + ' + self.model.quantization} "
            f"on {self.device}, "
            f"weights {self.model.num_bytes / 2**20:.0f} MiB (from {'/'.join(self.quantization)}"
            f"{'' if self.requantized is None else f'; layers requantized to {self.requantized}'}), "
            f"context {cfg.max_position_embeddings}{windows}, in {self.load_seconds:.1f} s"
            f"{'' if self.weight_cache == 'off' else f' (prepared weights: {self.weight_cache})'}"
        )


def load_model(
    model: str | None,
    device_config: DeviceConfig = DeviceConfig(),
    kernels: CpuKernels | None = None,
) -> LoadedModel:
    """Load weights and tokenizer. `model` is None (the embedded default), a .gguf file, a
    Hugging Face directory or a catalogue name already pulled (kvserve.hub); nothing is
    downloaded here. `kernels`: the CPU kernels to run on (default: this process's,
    `load_kernels()`). Runs on the device thread (see kvserve.model.device_thread), whichever
    thread calls it."""
    return device_thread.call(_load_model, model, device_config, kernels)


@collector_paused()  # the vocabulary's and the tensors' containers (kvserve.collector)
def _load_model(
    model: str | None, device_config: DeviceConfig, kernels: CpuKernels | None
) -> LoadedModel:
    from kvserve.tokenizer import Tokenizer

    started = time.perf_counter()
    path = resolve_model_path(model)
    device = resolve_device(device_config.device)
    dtype = resolve_dtype(device_config.dtype, device)
    if device.type == "cpu":
        configure_threads(device_config.num_threads)
        kernels = kernels or load_kernels()
    else:
        kernels = None
    kernels_done = time.perf_counter()
    if path.is_dir():
        from kvserve.model.safetensors import SafetensorsCheckpoint

        checkpoint = SafetensorsCheckpoint(path)
    else:
        from kvserve.model.gguf import GGUFCheckpoint

        checkpoint = GGUFCheckpoint(path)

    @functools.cache
    def read_tokenizer() -> Tokenizer:
        # Built where the prepared weights are checked (the two overlap, see WeightCache.load),
        # else before they are prepared: a vocabulary that cannot be read fails first.
        if path.is_dir():
            return Tokenizer.from_hf_dir(path)
        return Tokenizer.from_gguf(path, fields=checkpoint.fields)

    name = model_name(model, path)
    config = checkpoint.config
    q4_unsupported = None
    if device_config.quantization == "q4":
        from kvserve.model.linear import q4

        q4_unsupported = q4.unsupported(checkpoint, config, kernels, device)
    gguf_unsupported = "not a GGUF file"
    if not path.is_dir():
        from kvserve.model.linear import blocks

        gguf_unsupported = blocks.unsupported(checkpoint, config, kernels, device)
    quantization, reason = choose_quantization(
        device_config.quantization,
        checkpoint.quantization,
        config,
        device,
        dtype,
        dtype_asked=device_config.dtype != "auto",
        q4_unsupported=q4_unsupported,
        kernels=kernels,
        gguf_unsupported=gguf_unsupported,
    )

    def prepare() -> LlamaModel:
        with tqdm(
            total=config.num_layers + 2,
            desc=f"loading {path.name}",
            unit="layer",
            disable=not sys.stderr.isatty(),
            leave=False,
        ) as bar:
            if quantization == "gguf":
                return LlamaModel.from_gguf(
                    config,
                    checkpoint,
                    dtype=dtype,
                    kernels=kernels,
                    progress=bar.update,
                    requantize=device_config.requantize,
                )
            if quantization == "q4":
                return LlamaModel.from_q4(
                    config, checkpoint, dtype=dtype, kernels=kernels, progress=bar.update
                )
            return LlamaModel.from_tensors(
                config,
                checkpoint.get,
                dtype=dtype,
                device=device,
                progress=bar.update,
                quantization=quantization,
                kernels=kernels,
                family=checkpoint.family,
            )

    cache = None
    if (
        device_config.weight_cache
        and quantization in ("int8", "q4", "gguf")
        and device.type == "cpu"
    ):
        from kvserve.model.weight_cache import WeightCache

        cache = WeightCache(device_config.weight_cache_dir)
    read_done = time.perf_counter()
    # Requantized layers are another preparation of the same file: their own cache entry.
    prepared_as = quantization
    if quantization == "gguf" and device_config.requantize is not None:
        prepared_as = f"gguf>{device_config.requantize}"
    llama, cache_status, written = _prepared_model(
        cache, path, config, prepared_as, dtype, device, prepare, kernels, checkpoint,
        beside=read_tokenizer,
    )  # fmt: skip
    tokenizer = read_tokenizer()
    weights_done = time.perf_counter()
    loaded = LoadedModel(
        model=llama,
        tokenizer=tokenizer,
        config=config,
        path=path,
        name=name,
        device=device,
        dtype=dtype,
        load_seconds=time.perf_counter() - started,
        quantization=list(checkpoint.quantization),
        quantization_reason=reason,
        weight_cache=cache_status,
        kernels=kernels,
        kernels_seconds=kernels_done - started,
        read_seconds=read_done - kernels_done,
        weights_seconds=weights_done - read_done,
        file_bytes=_checkpoint_bytes(path),
        requantized=device_config.requantize if quantization == "gguf" else None,
        weight_cache_written=written,
    )
    if written is not None:

        def unwritten(future: Future) -> None:
            if future.exception() is not None or future.result() is None:
                loaded.weight_cache = "unwritten"

        written.add_done_callback(unwritten)
    log.info(loaded.summary())
    return loaded


def _checkpoint_bytes(path: Path) -> int:
    if path.is_dir():
        return sum(f.stat().st_size for f in path.glob("*.safetensors"))
    return path.stat().st_size


def _prepared_model(
    cache,
    path: Path,
    config: ModelConfig,
    quantization: str,
    dtype: torch.dtype,
    device: torch.device,
    prepare,
    kernels: CpuKernels | None,
    checkpoint=None,
    beside: Callable[[], object] = lambda: None,
) -> tuple[LlamaModel, str, Future | None]:
    """The model from the prepared-weight cache when it has it, else `prepare()` (then
    cached behind the load). Returns the model, what the cache did (see LoadedModel.weight_cache)
    and the write of its file, if one was started. `beside` runs while a cached file is checked,
    else before `prepare()`; it may be called more than once (the loader's caches its result)."""
    if cache is None:
        beside()
        return prepare(), "off", None
    from kvserve.model.weight_cache import CorruptCacheError, cache_key

    key = cache_key(
        path,
        quantization=quantization,
        dtype=dtype,
        device=device,
        packed=bool(kernels is not None and kernels.int8_gemm_isa),
        header=getattr(checkpoint, "header", None),
    )
    status = "written"
    try:
        found = cache.load(key, kernels=kernels, beside=beside)
        if found is not None:
            try:
                model = LlamaModel.from_prepared(
                    config, *found, kernels=kernels, checkpoint=checkpoint, dtype=dtype
                )
                return model, "hit", None
            except (KeyError, ValueError, RuntimeError) as exc:
                cache.discard(key, exc)
                status = "rebuilt"
    except CorruptCacheError:
        status = "rebuilt"
    beside()
    model = prepare()
    tensors, numbers = model.prepared_tensors()
    return model, status, cache.store_behind(key, tensors, numbers, source=path)
