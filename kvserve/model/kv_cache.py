"""The paged KV cache tensors.

One tensor holds K and V of every layer: `[num_layers, 2, kv_heads, num_blocks, block_size,
head_dim]`. A position `p` of a sequence lives in block `block_ids[p // block_size]` at offset
`p % block_size`; the flat slot `block_id * block_size + offset` addresses it in the view
`[num_layers, 2, kv_heads, num_blocks * block_size, head_dim]`. Heads are outermost so that the
positions of one head are contiguous inside a block: a gather through a block table yields the
`[kv_heads, positions, head_dim]` layout attention wants, and the CPU decode kernel streams each
head's rows in order. Which request owns which block is decided elsewhere (core.BlockPool); this
module only holds the memory.
"""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass

import torch

from kvserve.model.config import ModelConfig


@dataclass(frozen=True, slots=True)
class PoolSize:
    """How the pool size was chosen, for the one start-up log line."""

    num_blocks: int
    block_size: int
    bytes_per_block: int
    source: str  # "--num-kv-blocks", "--kv-cache-memory", or how the default was derived

    @property
    def num_positions(self) -> int:
        return self.num_blocks * self.block_size

    def copy_block(self, source: int, target: int) -> None:
        """Copy every layer's K and V (and int8 scales) of block `source` into block `target`."""
        # kv: [layers, 2, kv_heads, num_blocks, block_size, head_dim]
        self.kv[:, :, :, target] = self.kv[:, :, :, source]
        if self.scales is not None:
            self.scales[:, :, :, target] = self.scales[:, :, :, source]

    @property
    def num_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block

    def describe(self) -> str:
        return (
            f"KV pool: {self.num_blocks} blocks x {self.block_size} positions = "
            f"{self.num_positions} positions, {self.bytes_per_block / 1024:.0f} KiB/block, "
            f"{self.num_bytes / 2**20:.1f} MiB ({self.source})"
        )

    def capacity(self, max_model_len: int, answer_positions: int) -> str:
        """How many full contexts, and how many answers of `answer_positions`, the pool holds."""
        return (
            f"holds {self.num_positions / max_model_len:.1f} full contexts of {max_model_len} "
            f"positions, or {self.num_positions // answer_positions} typical answers of "
            f"{answer_positions} positions"
        )


def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    per_token = config.kv_bytes_per_token(torch.empty((), dtype=dtype).element_size())
    if dtype == torch.int8:  # plus a float32 scale per K and V row of each head
        per_token += 2 * config.num_layers * config.num_kv_heads * 4
    return block_size * per_token


def available_memory(device: torch.device) -> int:
    """Bytes that could still be allocated on `device`."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 4 * 2**30


def choose_cache_dtype(requested: str, model) -> tuple[torch.dtype, str]:
    """Resolve `--kv-cache-dtype` for `model` (a kvserve.model.llama.LlamaModel) to the cache's
    dtype, with the reason in a few words.

    `auto` stores K and V as int8 where the linear layers already run in int8 and the int8 cache
    kernels run here: measured on the default model, the pair stays within 1% of bf16's
    perplexity (docs/benchmarks.md, Quality) and the pool holds ~1.9x the positions. Otherwise
    the cache is in the model's dtype. Raises ValueError when int8 is asked for and cannot run.
    """
    model_dtype = str(model.dtype).removeprefix("torch.")
    if requested == "model":
        return model.dtype, "asked for"
    from kvserve.model.attention import int8_cache_refusal

    refusal = int8_cache_refusal(model.config)
    if requested == "int8":
        if refusal is not None:
            raise ValueError(f"--kv-cache-dtype int8 cannot run this model: {refusal}")
        if not model.supports_int8_kv_cache:
            from kvserve.model.attention import KV_INT8_REQUIREMENTS

            raise ValueError(KV_INT8_REQUIREMENTS)
        return torch.int8, "asked for"
    if requested != "auto":
        raise ValueError(f"unknown kv_cache_dtype {requested!r}")
    if model.quantization == "int8" and model.supports_int8_kv_cache:
        return torch.int8, "auto: int8 linear layers, and the int8 cache kernels run here"
    if model.quantization == "int8" and refusal is not None:
        return model.dtype, f"auto: {model_dtype}, the int8 cache: {refusal}"
    if model.quantization == "int8":
        return model.dtype, f"auto: {model_dtype}, the int8 cache kernels need AVX512-VNNI"
    if model.quantization == "gguf":
        return model.dtype, f"auto: the model's dtype ({model_dtype}) beside the file's blocks"
    if model.quantization == "q4":
        # q4 is picked for answers as close to float32 as a 4-bit file allows: keep the cache
        return model.dtype, f"auto: the model's dtype ({model_dtype}) beside 4-bit weights"
    return model.dtype, f"auto: the model's dtype ({model_dtype}) with float linear layers"


# The share of available memory the pool takes by default: on CUDA the weights are already
# resident; on a CPU host the rest of the process (and the machine) shares the memory.
DEFAULT_MEMORY_SHARE = {"cuda": 0.9, "cpu": 0.5}


def choose_pool_size(
    config: ModelConfig,
    *,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    max_num_seqs: int,
    max_model_len: int,
    num_kv_blocks: int | None = None,
    kv_cache_memory: int | float | None = None,
    draft_bytes_per_block: int = 0,
) -> PoolSize:
    """Size the pool by memory: an explicit block count wins; else `kv_cache_memory`, bytes (an
    int) or a fraction of the memory available now (a float in (0, 1]); by default 90% of the
    free memory on CUDA, 50% of the available host memory on CPU. Neither fraction takes more
    than every slot could ever fill (`max_num_seqs` full contexts). `draft_bytes_per_block`: a
    draft model's cache of the same blocks (speculative decoding), counted in every block."""
    per_block = bytes_per_block(config, block_size, dtype) + draft_bytes_per_block
    if num_kv_blocks is not None:
        return PoolSize(num_kv_blocks, block_size, per_block, "--num-kv-blocks")
    if isinstance(kv_cache_memory, int):
        blocks = max(1, kv_cache_memory // per_block)
        return PoolSize(blocks, block_size, per_block, f"--kv-cache-memory {kv_cache_memory} B")
    share = kv_cache_memory
    if share is None:
        share = DEFAULT_MEMORY_SHARE["cuda" if device.type == "cuda" else "cpu"]
    available = available_memory(device)
    blocks = max(1, int(available * share) // per_block)
    why = f"{share:.0%} of the {available / 2**30:.1f} GiB available"
    if kv_cache_memory is not None:
        why = f"--kv-cache-memory {kv_cache_memory:g}: " + why
    usable = max_num_seqs * -(-max_model_len // block_size)
    if blocks > usable:
        blocks = usable
        why += f", capped at what {max_num_seqs} slots x {max_model_len} positions can fill"
    return PoolSize(blocks, block_size, per_block, why)


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero tensor. On the host its memory is an anonymous mapping, whose pages the OS hands
    out zeroed when first written: allocating a pool of gigabytes costs nothing up front and the
    process's resident memory grows only with the blocks actually written, where `torch.zeros`
    writes every byte first (seconds per gigabyte).

    The mapping is kept out of transparent huge pages. The pool is laid out by layer and head,
    so one block is 2 x layers x kv_heads small pieces far apart: with 2 MiB pages (which numpy
    asks for its large arrays) the first write to one block zeroes 2 MiB for every piece, 222
    MiB for qwen2.5-coder:1.5b's first token, about 0.5 s on a 2-core virtual machine whose
    host backs the pages at first touch. With 4 KiB pages a block costs what it holds."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    num_bytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    mapping = mmap.mmap(-1, max(1, num_bytes))
    if hasattr(mmap, "MADV_NOHUGEPAGE"):  # Linux
        mapping.madvise(mmap.MADV_NOHUGEPAGE)
    # The tensor holds a reference to the mapping, which is unmapped with the last view.
    flat = torch.frombuffer(mapping, dtype=torch.uint8)
    return flat[:num_bytes].view(dtype).view(shape)


class KVCache:
    """K and V for all layers in one tensor; see the module docstring for the layout.

    With dtype int8, each K and V row of a head at a position is stored as 8-bit integers with
    a float32 scale in `scales` ([layers, 2, kv_heads, num_blocks, block_size]); only the CPU
    kernels read and write that form (kvserve/model/csrc/kv_int8.c)."""

    def __init__(
        self,
        config: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_layers = config.num_layers
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        # kv: [layers, 2, kv_heads, num_blocks, block_size, head_dim]
        shape = (
            config.num_layers,
            2,
            config.num_kv_heads,
            num_blocks,
            block_size,
            config.head_dim,
        )
        self.kv = zeroed(shape, dtype, device)
        self.scales: torch.Tensor | None = None
        if dtype == torch.int8:
            self.scales = zeroed(shape[:-1], torch.float32, device)

    @property
    def quantized(self) -> bool:
        return self.scales is not None

    def layer(self, index: int) -> torch.Tensor:
        """`[2, kv_heads, num_blocks, block_size, head_dim]` for one layer (a view)."""
        return self.kv[index]

    def layer_scales(self, index: int) -> torch.Tensor | None:
        """`[2, kv_heads, num_blocks, block_size]` float32 for one layer of an int8 cache."""
        return None if self.scales is None else self.scales[index]

    def copy_block(self, source: int, target: int) -> None:
        """Copy every layer's K and V (and int8 scales) of block `source` into block `target`."""
        # kv: [layers, 2, kv_heads, num_blocks, block_size, head_dim]
        self.kv[:, :, :, target] = self.kv[:, :, :, source]
        if self.scales is not None:
            self.scales[:, :, :, target] = self.scales[:, :, :, source]

    @property
    def num_bytes(self) -> int:
        total = self.kv.numel() * self.kv.element_size()
        if self.scales is not None:
            total += self.scales.numel() * self.scales.element_size()
        return total
