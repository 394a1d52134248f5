"""The KV pool is sized by memory: bytes, a fraction of what is available, or the default
share, never more than every slot could fill."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from kvserve.model import kv_cache


class Shape:
    """What pool sizing reads of a model's config: K and V bytes per position."""

    num_layers = 2
    num_kv_heads = 2

    def kv_bytes_per_token(self, element_size: int) -> int:
        return 2 * self.num_layers * self.num_kv_heads * 16 * element_size


def config() -> Shape:
    return Shape()


def size(monkeypatch, available: int, **kwargs):
    monkeypatch.setattr(kv_cache, "available_memory", lambda device: available)
    defaults = {"block_size": 16, "dtype": torch.float32, "device": torch.device("cpu")}
    defaults |= {"max_num_seqs": 8, "max_model_len": 1024}
    return kv_cache.choose_pool_size(config(), **(defaults | kwargs))


def test_bytes_a_fraction_or_the_default_share(monkeypatch) -> None:
    per_block = kv_cache.bytes_per_block(config(), 16, torch.float32)
    assert size(monkeypatch, 2**40, kv_cache_memory=100 * per_block).num_blocks == 100
    fraction = size(monkeypatch, 1000 * per_block, kv_cache_memory=0.25)
    assert fraction.num_blocks == 250 and "25%" in fraction.source
    default = size(monkeypatch, 1000 * per_block)
    assert default.num_blocks == 500 and "50%" in default.source
    assert size(monkeypatch, 2**40, num_kv_blocks=7).num_blocks == 7


def test_a_share_never_exceeds_what_every_slot_can_fill(monkeypatch) -> None:
    pool = size(monkeypatch, 2**40, max_num_seqs=2, max_model_len=160)
    assert pool.num_blocks == 2 * 10 and "capped" in pool.source
    assert pool.capacity(160, 40) == (
        "holds 2.0 full contexts of 160 positions, or 8 typical answers of 40 positions"
    )


def _resident_bytes(tensor: torch.Tensor) -> int:
    """Resident bytes of the mappings that hold `tensor`'s memory (/proc/self/smaps)."""
    first = tensor.data_ptr()
    last = first + tensor.numel() * tensor.element_size()
    total, inside, found = 0, False, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(part, 16) for part in head.split("-"))
                inside = start < last and first < end
                found |= inside
            elif inside and head == "Rss:":
                total += int(line.split()[1]) * 1024
    assert found, "no mapping holds the tensor"
    return total


def test_a_first_write_makes_only_the_block_written_resident() -> None:
    """A block is 2 x layers x kv_heads pieces far apart in the pool (qwen2.5-coder:1.5b's
    shape here: 112 pieces of 8 KiB); writing one block makes those pages resident, not a
    2 MiB huge page around each piece (224 MiB for the first token)."""
    shape = SimpleNamespace(num_layers=28, num_kv_heads=2, head_dim=128)
    cache = kv_cache.KVCache(shape, 512, 32, torch.bfloat16, torch.device("cpu"))
    before = _resident_bytes(cache.kv)
    cache.kv[:, :, :, 3] = 1.0
    grown = _resident_bytes(cache.kv) - before
    pieces, piece = 28 * 2 * 2, 32 * 128 * 2
    assert pieces * piece <= grown <= pieces * (piece + 2 * 4096)
    assert cache.kv[:, :, :, 3].eq(1).all() and cache.kv[:, :, :, 2].abs().amax() == 0
