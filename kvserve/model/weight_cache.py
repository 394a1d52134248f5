"""Prepared weights cached on disk, so a restart skips the preparation of int8 or q4 weights.

Preparing int8 weights (dequantize, rotate, quantize, pack: kvserve/model/linear/int8.py) costs
seconds per hundred million parameters, at every start. The prepared tensors are written once,
behind the load (`store_behind`: the model serves meanwhile), to a safetensors file in the user's
cache directory (`$KVSERVE_WEIGHT_CACHE_DIR`, else
`<user cache dir>/prepared`, never beside the model) and memory-mapped at the next start:
safetensors hands out tensors that point into the mapped file, so nothing is copied and the
pages are read as the first steps touch them.

The key of a file is a hash of

- the checkpoint's content fingerprint (`checkpoint_fingerprint`);
- the preparation: `linear.int8.PREPARATION_VERSION`, a hash of the source files that prepare and
  lay out the weights (so an edit that forgets to bump the version still misses), the torch and
  gguf versions (the rotation's QR and the dequantization come from them);
- the options that shape the result: quantization, dtype, device, and whether the weights are
  packed for the VNNI kernel.

Any change to one of them is a different file: a stale one is never read. Files are written
under a temporary name and renamed when complete, so a crash or a concurrent start never
leaves a partial file under the real name. Every tensor's byte count and 64-bit word sum are
stored in the file's metadata and checked at load: a truncated or overwritten file is deleted
and rebuilt, never served (the sum costs one pass at memory speed, about 0.1 s per GiB, against
about 1.2 s per GiB for SHA-256 on this class of machine).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path

import numpy as np
import torch

from kvserve.model.paths import user_cache_dir

log = logging.getLogger("kvserve.model")

FORMAT = "kvserve-prepared-weights/1"
ENV_DIR = "KVSERVE_WEIGHT_CACHE_DIR"
SAMPLE_BYTES = 4096
ABANDONED_AFTER = 600.0  # seconds without a write: a temporary file whose writer is gone
NUM_SAMPLES = 1024
_PREPARING_SOURCES = (
    "linear/int8.py",
    "linear/q4.py",
    "llama.py",
    "head.py",
    "gguf.py",
    "safetensors.py",
    "kernels.py",
    "linear/blocks.py",
    # tensor names, fused projections and norm offsets of each family
    "families/__init__.py",
    "families/llama.py",
    "families/gemma.py",
    "families/phi3.py",
)


class CorruptCacheError(ValueError):
    """A cached file that cannot be used as it is (it is then rebuilt)."""


def default_directory() -> Path:
    """`$KVSERVE_WEIGHT_CACHE_DIR`, else `<user cache dir>/prepared`."""
    configured = os.environ.get(ENV_DIR)
    return Path(configured).expanduser() if configured else user_cache_dir() / "prepared"


def _sample_file(
    digest, path: Path, head: int, spans: list[tuple[int, int]], label: str = ""
) -> None:
    """Feed `digest` with `label`, the file's size, its first `head` bytes, NUM_SAMPLES evenly
    spaced samples, and the first, middle and last SAMPLE_BYTES of each (start, length) span."""
    size = path.stat().st_size
    digest.update(f"{label}:{size}:".encode())
    offsets = [size * i // NUM_SAMPLES for i in range(NUM_SAMPLES)]
    for start, length in spans:
        offsets += [start, start + length // 2, start + max(0, length - SAMPLE_BYTES)]
    with path.open("rb") as file:
        digest.update(file.read(head))
        for offset in sorted(set(offsets)):
            file.seek(offset)
            digest.update(file.read(SAMPLE_BYTES))


def checkpoint_fingerprint(path: Path, header=None) -> str:
    """A content fingerprint of a checkpoint (a .gguf file or a model directory), in
    milliseconds.

    Hashing all of a 1B model (0.7-1.3 GB) would cost about a second here, half of a cached
    start; size and mtime would miss a file rewritten in place or a different model copied with
    its times kept. So the fingerprint hashes what decides the weights' identity: the whole
    GGUF header (every metadata value, every tensor's name, shape, type and offset), the
    first, middle and last 4 KiB of every tensor (a re-quantized, fine-tuned or replaced tensor
    differs in all of them), and 1,024 samples of 4 KiB spread over the whole file. An edit
    confined to bytes outside all samples, keeping the size, would go unseen: no tool that
    writes checkpoints edits them that way.

    `header`: the GGUF file's header when the caller has read it already (a 150k vocabulary
    makes reading it cost a few tenths of a second).
    """
    digest = hashlib.sha256()
    if path.is_dir():
        for file in sorted(path.iterdir()):
            if file.suffix in (".safetensors", ".json") and file.is_file():
                _sample_file(digest, file, 1 << 20, [], label=file.name)
        return digest.hexdigest()
    if header is None:
        from kvserve.model.gguf import read_header

        header = read_header(path)
    spans = [(t.data_offset, t.nbytes) for t in header.tensors]
    _sample_file(digest, path, header.data_offset, spans)
    return digest.hexdigest()


def _preparation_digest() -> str:
    from importlib.metadata import version

    from kvserve.model.linear.int8 import PREPARATION_VERSION

    digest = hashlib.sha256(f"{PREPARATION_VERSION}:{torch.__version__}:".encode())
    digest.update(version("gguf").encode())
    here = Path(__file__).parent
    for name in _PREPARING_SOURCES:
        digest.update((here / name).read_bytes())
    for kernel in ("int8_gemm.c", "q4_gemm.c", "blocks_gemm.c"):  # the packed layouts
        digest.update((here / "csrc" / kernel).read_bytes())
    return digest.hexdigest()


def cache_key(
    path: Path,
    *,
    quantization: str,
    dtype: torch.dtype,
    device: torch.device,
    packed: bool,
    header=None,
) -> str:
    """The cache key of `path` prepared with these options (see the module docstring);
    `header` as for `checkpoint_fingerprint`."""
    material = {
        "format": FORMAT,
        "checkpoint": checkpoint_fingerprint(path, header),
        "preparation": _preparation_digest(),
        "quantization": quantization,
        "dtype": str(dtype),
        "device": device.type,
        "packed": packed,
    }
    return hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()[:32]


def tensor_checksum(tensor: torch.Tensor, word_sum: int | None = None) -> str:
    """`bytes:sum:tail`: the byte count, the sum of the tensor's bytes read as little-endian
    64-bit words (mod 2^64), and the bytes past the last whole word. It catches truncation,
    zeroed or overwritten ranges, not deliberate tampering (the directory is the user's own).
    `word_sum`: that sum, where the caller has it (`CpuKernels.word_sums`)."""
    raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
    whole = raw.size // 8 * 8
    if word_sum is None:
        word_sum = int(np.add.reduce(raw[:whole].view("<u8"), dtype=np.uint64)) if whole else 0
    return f"{raw.size}:{word_sum:016x}:{bytes(raw[whole:]).hex()}"


def _checksums_beside(
    tensors: dict[str, torch.Tensor], kernels, beside: Callable[[], object] | None
) -> dict[str, str]:
    """Every tensor's `tensor_checksum`, with `beside()` run meanwhile on this thread: the word
    sums are one kernel call on a thread of their own, which holds no interpreter lock, so a
    vocabulary built in `beside` (0.4 s of Python for 150k tokens) and the pass over a
    gigabyte of mapped weights (0.15 s, its first reads included) overlap. Without the kernel
    the sums are numpy's, before `beside`. `beside`'s exception is raised once the sums are
    done."""
    names = list(tensors)
    if kernels is None or not kernels.has("layer_ops"):
        sums = [tensor_checksum(tensors[name]) for name in names]
        if beside is not None:
            beside()
        return dict(zip(names, sums, strict=True))
    values = [tensors[name] for name in names]
    if beside is None:
        words = kernels.word_sums(values)
    else:
        summed: Future = Future()

        def run() -> None:
            try:  # one thread: the other core is beside()'s
                summed.set_result(kernels.word_sums(values, num_threads=1))
            except BaseException as exc:
                summed.set_exception(exc)

        threading.Thread(target=run, name="kvserve-weight-sums", daemon=True).start()
        try:
            beside()
        finally:
            words = summed.result()
    return {
        name: tensor_checksum(tensor, word)
        for name, tensor, word in zip(names, values, words, strict=True)
    }


_SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


def write_safetensors(
    path: Path | str, tensors: dict[str, torch.Tensor], metadata: dict[str, str]
) -> None:
    """`tensors` (contiguous, on the CPU) as a safetensors file: the 8-byte length of a JSON
    header padded to 8 bytes, then each tensor's bytes in the header's order. Each tensor's
    memory is written as it is; `safetensors.torch.save_file` first copies every tensor into
    one buffer, which cost 2.5 s of a 4.6 s first start of a 1.5B model here (1 GB of
    prepared blocks), against about 0.5 s this way."""
    header: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    for name, tensor in tensors.items():
        size = tensor.numel() * tensor.element_size()
        header[name] = {
            "dtype": _SAFETENSORS_DTYPES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as file:
        file.write(len(text).to_bytes(8, "little"))
        file.write(text)
        for tensor in tensors.values():
            if tensor.numel():
                file.write(memoryview(tensor.reshape(-1).view(torch.uint8).numpy()))


# Files being written behind a load (`WeightCache.store_behind`), by path.
_writing: dict[Path, Future] = {}
_writing_lock = threading.Lock()


class WeightCache:
    """One directory of prepared-weight files, named by their key."""

    def __init__(self, directory: Path | str | None = None) -> None:
        self.directory = Path(directory).expanduser() if directory else default_directory()

    def path_for(self, key: str) -> Path:
        return self.directory / f"{key}.safetensors"

    def load(
        self, key: str, *, kernels=None, beside: Callable[[], object] | None = None
    ) -> tuple[dict[str, torch.Tensor], dict[str, int]] | None:
        """The cached tensors (memory-mapped) and numbers, or None when there is no file.
        Raises CorruptCacheError (after deleting the file) when one exists but is unusable.

        `beside`, where given, runs while the tensors' checksums are computed, once the file
        is found and mapped (so not at all when this returns None or the file is unreadable);
        its exception is raised as it is. `kernels`: the CPU kernels that sum the words."""
        path = self.path_for(key)
        with _writing_lock:
            being_written = _writing.get(path)
        if being_written is not None:  # by a load of this process: finished first
            being_written.result()
        if not path.exists():
            return None
        from safetensors import safe_open

        try:
            with safe_open(str(path), framework="pt") as file:
                metadata = file.metadata() or {}
                if metadata.get("format") != FORMAT or metadata.get("key") != key:
                    raise CorruptCacheError("not a prepared-weights file for this key")
                checksums = json.loads(metadata["checksums"])
                numbers = json.loads(metadata["numbers"])
                tensors = {name: file.get_tensor(name) for name in file.keys()}  # noqa: SIM118
            if set(tensors) != set(checksums):
                raise CorruptCacheError("the tensors do not match the stored list")
        except Exception as exc:  # any unreadable file is rebuilt, whatever the reader raised
            self.discard(key, exc)
            raise CorruptCacheError(str(exc)) from exc
        found = _checksums_beside(tensors, kernels, beside)
        failed = next((name for name in tensors if found[name] != checksums[name]), None)
        if failed is not None:
            reason = f"tensor {failed} fails its checksum"
            self.discard(key, reason)
            raise CorruptCacheError(reason)
        return tensors, numbers

    def _remove_abandoned(self, path: Path) -> None:
        """Temporary files of `path` that no writer has touched for ABANDONED_AFTER seconds: a
        process killed while it wrote (a writer adds to its file without pause; a gigabyte
        takes seconds)."""
        now = time.time()
        for partial in self.directory.glob(f".{path.name}.*"):
            try:
                if now - partial.stat().st_mtime > ABANDONED_AFTER:
                    partial.unlink()
                    log.info("removed %s, left by a write that did not finish", partial)
            except OSError:
                pass

    def discard(self, key: str, reason: object) -> None:
        """Delete an unusable file (it is rebuilt by the caller)."""
        path = self.path_for(key)
        log.warning("prepared weights %s are unusable (%s): preparing again", path, reason)
        path.unlink(missing_ok=True)

    def store_behind(
        self,
        key: str,
        tensors: dict[str, torch.Tensor],
        numbers: dict[str, int],
        source: Path | None = None,
    ) -> Future:
        """`store` on a thread of its own, so that a model serves while its prepared tensors
        are written (1.5 s of the 5.4 s first start of qwen2.5-coder:1.5b on 2 cores, most of it
        the page cache taking a fresh gigabyte). The future's result is `store`'s. A `load` of
        the same file in this process waits for it, and the thread is not a daemon (said
        outright: a thread started by a daemon, as the device thread is, would be one too), so
        the interpreter finishes the file before it exits."""
        path = self.path_for(key)
        future: Future = Future()

        def write() -> None:
            try:
                future.set_result(self.store(key, tensors, numbers, source))
            except BaseException as exc:  # store logs and returns None; anything else is kept
                future.set_exception(exc)
            finally:
                with _writing_lock:
                    if _writing.get(path) is future:
                        del _writing[path]

        with _writing_lock:
            _writing[path] = future
        threading.Thread(target=write, name="kvserve-weight-cache-writer", daemon=False).start()
        return future

    def store(
        self,
        key: str,
        tensors: dict[str, torch.Tensor],
        numbers: dict[str, int],
        source: Path | None = None,
    ) -> Path | None:
        """Write the file atomically (temporary name, then rename). Returns its path, or None
        when it could not be written (full disk, read-only directory): that only costs the
        next start its preparation, so it is logged, never raised."""
        path = self.path_for(key)
        tmp = None
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            self._remove_abandoned(path)
            tensors = {name: t.detach().contiguous() for name, t in tensors.items()}
            metadata = {
                "format": FORMAT,
                "key": key,
                "numbers": json.dumps(numbers),
                "checksums": json.dumps({n: tensor_checksum(t) for n, t in tensors.items()}),
                "source": str(source or ""),  # for a person looking at the directory
            }
            handle, tmp = tempfile.mkstemp(dir=self.directory, prefix=f".{path.name}.")
            os.close(handle)
            write_safetensors(tmp, tensors, metadata)
            os.replace(tmp, path)  # atomic: readers see the old name absent or the whole file
            tmp = None
            return path
        except Exception as exc:  # noqa: BLE001 - safetensors' errors are plain Exceptions
            log.warning("could not write prepared weights to %s (%s)", path, exc)
            return None
        finally:
            if tmp is not None:
                Path(tmp).unlink(missing_ok=True)
