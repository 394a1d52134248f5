"""The prepared-weight cache: reused, invalidated, rebuilt when corrupt, and exact.

Each test gets its own cache directory under tmp_path; the tiny synthetic model
(kvserve/bench/big_model.py) keeps loads short. Whether the preparation ran is counted at
`quantize_model`, the function that rotates, quantizes and packs.
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import replace

import pytest
import torch

from kvserve.bench.big_model import TINY, generate
from kvserve.config import DeviceConfig
from kvserve.model import llama as llama_module
from kvserve.model import weight_cache
from kvserve.model.kernels import load_kernels
from kvserve.model.kv_cache import KVCache
from kvserve.model.linear import int8 as quant
from kvserve.model.loader import cpu_has_bf16, load_model
from kvserve.model.weight_cache import WeightCache
from tests.model.helpers import Chunk, greedy_continuation

pytestmark = pytest.mark.skipif(
    not load_kernels().int8_gemm_isa,
    reason="int8 weights need the CPU kernels (AVX512-VNNI or AVX2)",
)

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory):
    """The tiny model as Q4_0 and Q8_0 (the same float weights rounded two ways)."""
    return generate(TINY, ("Q4_0", "Q8_0"), tmp_path_factory.mktemp("tiny"))


@pytest.fixture
def preparations(monkeypatch):
    """How many times the int8 preparation ran (it rotates the residual stream once)."""
    calls = []
    original = llama_module.residual_rotation

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(llama_module, "residual_rotation", counted)
    return calls


def prompt_logits(loaded) -> torch.Tensor:
    """Logits of every prompt position (one prefill)."""
    model = loaded.model
    ids = loaded.tokenizer.encode(PROMPT)
    cache = KVCache(model.config, 1, 32, model.dtype, model.device)
    meta = model.attention.build_metadata([Chunk(0, len(ids), [0], True)], 32)
    meta.logits_indices = torch.arange(len(ids))
    return model.forward(torch.tensor(ids), meta, cache)


def load(path, cache_dir, **options):
    options.setdefault("quantization", "int8")  # the path whose weights are prepared and cached
    return load_model(
        str(path), DeviceConfig(device="cpu", weight_cache_dir=str(cache_dir), **options)
    )


def test_second_load_reuses_the_prepared_weights(tiny_files, tmp_path, preparations):
    first = load(tiny_files["Q4_0"], tmp_path)
    assert (first.weight_cache, len(preparations)) == ("written", 1)
    written = first.weight_cache_written.result()  # written behind the load
    assert list(tmp_path.glob("*.safetensors")) == [written]
    second = load(tiny_files["Q4_0"], tmp_path)
    assert (second.weight_cache, len(preparations)) == ("hit", 1)
    # Memory-mapped: the cache file is mapped into this process.
    (cached,) = tmp_path.glob("*.safetensors")
    with open("/proc/self/maps") as maps:
        assert str(cached) in maps.read()
    uncached = load(tiny_files["Q4_0"], tmp_path, weight_cache=False)
    assert (uncached.weight_cache, len(preparations)) == ("off", 2)
    expected = prompt_logits(uncached)
    assert torch.equal(prompt_logits(first), expected)
    assert torch.equal(prompt_logits(second), expected)
    ids = second.tokenizer.encode(PROMPT)
    assert greedy_continuation(second.model, ids, 6) == greedy_continuation(uncached.model, ids, 6)


def test_the_cache_is_invalidated_when_the_checkpoint_changes(tiny_files, tmp_path, preparations):
    model_path = tmp_path / "model.gguf"
    shutil.copy(tiny_files["Q4_0"], model_path)
    cache_dir = tmp_path / "cache"
    before = load(model_path, cache_dir)
    logits_before = prompt_logits(before)
    # Another model of the same shape and size, written over the same path.
    other = generate(replace(TINY, seed=1), ("Q4_0",), tmp_path / "other")["Q4_0"]
    assert other.stat().st_size == model_path.stat().st_size
    shutil.copy(other, model_path)
    after = load(model_path, cache_dir)
    assert (after.weight_cache, len(preparations)) == ("written", 2)
    assert not torch.equal(prompt_logits(after), logits_before)
    # The key is the content, not the path: the same model elsewhere is a hit.
    elsewhere = load(other, cache_dir)
    assert (elsewhere.weight_cache, len(preparations)) == ("hit", 2)
    assert torch.equal(prompt_logits(after), prompt_logits(elsewhere))


def test_the_cache_is_invalidated_when_the_preparation_changes(
    tiny_files, tmp_path, preparations, monkeypatch
):
    load(tiny_files["Q8_0"], tmp_path)
    monkeypatch.setattr(quant, "PREPARATION_VERSION", quant.PREPARATION_VERSION + 1)
    assert load(tiny_files["Q8_0"], tmp_path).weight_cache == "written"
    assert len(preparations) == 2
    # Options that shape the prepared tensors are part of the key too: a dtype other than the
    # CPU's default (bf16 where it multiplies bf16 natively, else float32).
    other = "float32" if cpu_has_bf16() else "bfloat16"
    assert load(tiny_files["Q8_0"], tmp_path, dtype=other).weight_cache == "written"
    assert load(tiny_files["Q8_0"], tmp_path).weight_cache == "hit"
    assert len(preparations) == 3


@pytest.mark.parametrize("damage", ["truncated", "garbage", "zeroed", "empty"])
def test_a_corrupt_cache_file_is_rebuilt(tiny_files, tmp_path, preparations, damage):
    first = load(tiny_files["Q4_0"], tmp_path)
    expected = prompt_logits(first)
    cached = first.weight_cache_written.result()
    data = bytearray(cached.read_bytes())
    middle = len(data) // 2
    if damage == "truncated":
        data = data[: middle + 3]
    elif damage == "garbage":
        data[middle : middle + 4096] = random.Random(0).randbytes(4096)
    elif damage == "zeroed":
        data[middle : middle + 64] = bytes(64)
    else:
        data = bytearray()
    cached.write_bytes(bytes(data))
    rebuilt = load(tiny_files["Q4_0"], tmp_path)
    assert (rebuilt.weight_cache, len(preparations)) == ("rebuilt", 2)
    assert torch.equal(prompt_logits(rebuilt), expected)
    again = load(tiny_files["Q4_0"], tmp_path)
    assert (again.weight_cache, len(preparations)) == ("hit", 2)
    assert torch.equal(prompt_logits(again), expected)


def test_a_load_waits_for_the_file_another_load_is_writing(
    tiny_files, tmp_path, preparations, monkeypatch
):
    """The file is written behind the first load; a second load of the same model in the
    process, started while it is written, maps it instead of preparing again."""
    store = WeightCache.store
    started = threading.Event()

    def slow_store(self, *args, **kwargs):
        started.set()
        time.sleep(0.5)
        return store(self, *args, **kwargs)

    monkeypatch.setattr(WeightCache, "store", slow_store)
    first = load(tiny_files["Q4_0"], tmp_path)
    assert started.wait(10) and not first.weight_cache_written.done()
    second = load(tiny_files["Q4_0"], tmp_path)
    assert (first.weight_cache, second.weight_cache, len(preparations)) == ("written", "hit", 1)
    assert torch.equal(prompt_logits(first), prompt_logits(second))


def test_a_process_that_ends_at_once_still_leaves_the_whole_file(tiny_files, tmp_path):
    """The writer is not a daemon, even when a daemon thread loads (as the server's threads
    do): a process that loads a model and ends at once leaves the whole file (no temporary
    one), which the next load maps."""
    script = (
        "import sys, threading\n"
        "from kvserve.config import DeviceConfig\n"
        "from kvserve.model.loader import load_model\n"
        "config = DeviceConfig(device='cpu', weight_cache_dir=sys.argv[2], quantization='int8')\n"
        "loaded = []\n"
        "thread = threading.Thread(target=lambda: loaded.append(load_model(sys.argv[1], config)),"
        " daemon=True)\n"
        "thread.start()\n"
        "thread.join()\n"
        "print(loaded[0].weight_cache)\n"
    )
    ended = subprocess.run(
        [sys.executable, "-c", script, str(tiny_files["Q8_0"]), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert ended.returncode == 0, ended.stderr
    assert ended.stdout.split() == ["written"]
    assert [p.suffix for p in tmp_path.iterdir()] == [".safetensors"]
    assert load(tiny_files["Q8_0"], tmp_path).weight_cache == "hit"


def test_a_write_removes_what_a_killed_writer_left(tmp_path):
    """A temporary file untouched for ABANDONED_AFTER seconds (its process was killed while
    it wrote) is removed by the next write of that file; one being written is left alone."""
    cache = WeightCache(tmp_path)
    path = cache.path_for("0" * 32)
    abandoned, live = tmp_path / f".{path.name}.abandoned", tmp_path / f".{path.name}.live"
    for partial in (abandoned, live):
        partial.write_bytes(b"part of a file")
    long_ago = time.time() - weight_cache.ABANDONED_AFTER - 60
    os.utime(abandoned, (long_ago, long_ago))
    assert cache.store("0" * 32, {"w": torch.arange(8, dtype=torch.float32)}, {}) == path
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([path.name, live.name])
    tensors, _ = cache.load("0" * 32)
    assert torch.equal(tensors["w"], torch.arange(8, dtype=torch.float32))


def test_an_unwritable_cache_directory_only_costs_the_cache(tiny_files, tmp_path):
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("a file where the cache directory would be")
    loaded = load(tiny_files["Q8_0"], blocker / "prepared")
    assert loaded.weight_cache_written.result() is None
    assert loaded.weight_cache == "unwritten"
    assert greedy_continuation(loaded.model, loaded.tokenizer.encode(PROMPT), 3)


def test_q4_0_and_q8_0_files_of_the_same_tiny_model_load_and_answer(tiny_files, tmp_path):
    answers, logits = {}, {}
    for quant_type, path in tiny_files.items():
        loaded = load(path, tmp_path)
        assert loaded.config.num_layers == TINY.num_layers
        assert loaded.config.vocab_size == 49152
        assert loaded.model.quantization == "int8"
        assert loaded.quantization == ["F32", quant_type]
        ids = loaded.tokenizer.encode(PROMPT)
        answers[quant_type] = greedy_continuation(loaded.model, ids, 8)
        assert loaded.tokenizer.decode(answers[quant_type])
        logits[quant_type] = prompt_logits(loaded)
    # The same weights rounded to 4 and 8 bits: the logits agree closely, not exactly.
    cosine = torch.nn.functional.cosine_similarity(logits["Q4_0"], logits["Q8_0"], dim=-1)
    assert cosine.min() > 0.9, cosine
    assert not torch.equal(logits["Q4_0"], logits["Q8_0"])


def test_the_default_model_answers_the_same_from_the_cache(loaded_default):
    """The session's default model is in the session's cache directory (tests/conftest.py)
    once a fixture has loaded it; loading it again maps that file, and answers exactly as a
    model prepared without the cache."""
    assert loaded_default.weight_cache in ("written", "hit")
    again = load_model(None, DeviceConfig(device="cpu"))
    assert again.weight_cache == "hit"
    uncached = load_model(None, DeviceConfig(device="cpu", weight_cache=False))
    assert uncached.weight_cache == "off"
    assert torch.equal(prompt_logits(again), prompt_logits(uncached))
    ids = again.tokenizer.encode(PROMPT)
    answer = again.tokenizer.decode(greedy_continuation(again.model, ids, 4))
    assert "Paris" in answer


def test_cli_flags_reach_the_device_config(tmp_path):
    import argparse

    from kvserve.cli import add_engine_arguments, engine_config_from_args

    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    config = engine_config_from_args(
        parser.parse_args(["--weight-cache-dir", str(tmp_path), "--no-weight-cache"])
    )
    assert (config.device.weight_cache_dir, config.device.weight_cache) == (str(tmp_path), False)
    config = engine_config_from_args(parser.parse_args([]))
    assert config.device.weight_cache is True


@pytest.mark.parametrize(
    "arch, overrides",
    [
        ("qwen2", {"hidden_size": 128, "num_attention_heads": 2, "num_key_value_heads": 1}),
        ("qwen3", {"head_dim": 64}),
    ],
    ids=["qwen2-bias-untied", "qwen3-qk-norm"],
)
def test_biases_qk_norms_and_an_untied_head_round_trip(tmp_path, arch, overrides, kernels):
    """What llama-shaped tiny files lack: q|k|v biases, q/k norms, a separate lm_head."""
    from kvserve.model.llama import LlamaModel
    from kvserve.model.safetensors import SafetensorsCheckpoint
    from tests.model.test_safetensors import save_tiny, tiny_config

    save_tiny(tmp_path / "model", tiny_config(arch, **overrides))
    checkpoint = SafetensorsCheckpoint(tmp_path / "model")
    config = checkpoint.config
    model = LlamaModel.from_tensors(
        config,
        checkpoint.get,
        dtype=torch.float32,
        device=torch.device("cpu"),
        quantization="int8",
        kernels=kernels,
    )
    tensors, numbers = model.prepared_tensors()
    assert "lm_head" in tensors
    assert any(name.endswith(".bias") for name in tensors) == config.attention_bias
    assert any(name.endswith(".qk_norm") for name in tensors) == config.qk_norm
    cache = WeightCache(tmp_path / "cache")
    assert cache.store("0" * 32, tensors, numbers) is not None
    restored = LlamaModel.from_prepared(config, *cache.load("0" * 32), kernels=kernels)
    ids = list(range(5, 40))

    def logits(m):
        kv = KVCache(config, 2, 32, torch.float32, torch.device("cpu"))
        meta = m.attention.build_metadata([Chunk(0, len(ids), [0, 1], True)], 32)
        meta.logits_indices = torch.arange(len(ids))
        return m.forward(torch.tensor(ids), meta, kv)

    assert torch.equal(logits(restored), logits(model))


def test_the_writer_gives_files_safetensors_reads_back_exactly(tmp_path):
    from safetensors import safe_open

    from kvserve.model.weight_cache import write_safetensors

    generator = torch.Generator().manual_seed(0)
    tensors = {
        "panels": torch.randint(-128, 128, (7, 33), dtype=torch.int8, generator=generator),
        "scales": torch.randn(5, 3, generator=generator).to(torch.bfloat16),
        "norm": torch.randn(11, generator=generator),
        "table": torch.arange(6, dtype=torch.int64).reshape(2, 3),
        "flags": torch.tensor([True, False, True]),
        "scalar": torch.tensor(2.5, dtype=torch.float16),
        "empty": torch.zeros(0, 4),
    }
    path = tmp_path / "prepared.safetensors"
    write_safetensors(path, tensors, {"format": "test", "numbers": "{}"})
    with safe_open(str(path), framework="pt") as file:
        assert file.metadata() == {"format": "test", "numbers": "{}"}
        assert set(file.keys()) == set(tensors)
        for name, tensor in tensors.items():
            read = file.get_tensor(name)
            assert read.dtype == tensor.dtype and read.shape == tensor.shape, name
            assert torch.equal(read, tensor), name


def test_the_word_sum_kernel_gives_numpys_checksums():
    """One call sums every tensor's whole 64-bit words, wrapping at 2^64 (random bytes
    overflow it), on one thread or several; the checksum text is numpy's."""
    kernels = load_kernels()
    generator = torch.Generator().manual_seed(3)
    sizes = [0, 1, 7, 8, 9, 4096 + 5, 3 << 20, (1 << 21) + 3]
    tensors = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=generator) for n in sizes]
    tensors.append(torch.randn(333, 7, generator=generator).to(torch.bfloat16))
    tensors.append(torch.full((1 << 19,), -1, dtype=torch.int64))  # every word 2^64 - 1
    expected = [weight_cache.tensor_checksum(t) for t in tensors]
    for threads in (1, 2):
        sums = kernels.word_sums(tensors, num_threads=threads)
        assert [
            weight_cache.tensor_checksum(t, s) for t, s in zip(tensors, sums, strict=True)
        ] == expected
    assert sums[-1] == (-(1 << 19)) % 2**64
    with pytest.raises(ValueError, match="not a contiguous CPU tensor"):
        kernels.word_sums([torch.zeros(8, 8).t()])
    assert kernels.word_sums([]) == []


def test_the_vocabulary_is_built_while_a_cached_file_is_checked(tmp_path):
    """`load(beside=...)` runs `beside` once the file is found and mapped, while the sums run
    (not for a missing or unreadable file); its error is raised as it is and leaves the file,
    and a damaged file is still caught with the kernel's sums."""
    cache = WeightCache(tmp_path)
    kernels = load_kernels()
    key = "1" * 32
    tensors = {"w": torch.randn(1000, 37), "b": torch.arange(5, dtype=torch.int8)}
    cache.store(key, tensors, {"n": 1})
    calls = []
    assert cache.load("2" * 32, kernels=kernels, beside=lambda: calls.append("missing")) is None
    loaded, numbers = cache.load(key, kernels=kernels, beside=lambda: calls.append("hit"))
    assert calls == ["hit"] and numbers == {"n": 1}
    assert all(torch.equal(loaded[name], tensors[name]) for name in tensors)

    def fails() -> None:
        calls.append("fails")
        raise ValueError("this vocabulary cannot be read")

    with pytest.raises(ValueError, match="this vocabulary"):
        cache.load(key, kernels=kernels, beside=fails)
    assert cache.path_for(key).exists()
    data = bytearray(cache.path_for(key).read_bytes())
    data[-3000] ^= 0xFF  # inside "w", the last tensor written
    cache.path_for(key).write_bytes(bytes(data))
    with pytest.raises(weight_cache.CorruptCacheError, match="fails its checksum"):
        cache.load(key, kernels=kernels, beside=lambda: calls.append("damaged"))
    assert calls == ["hit", "fails", "damaged"] and not cache.path_for(key).exists()
    cache.path_for(key).write_bytes(b"not a safetensors file")
    with pytest.raises(weight_cache.CorruptCacheError):
        cache.load(key, kernels=kernels, beside=lambda: calls.append("unreadable"))
    assert calls == ["hit", "fails", "damaged"]
