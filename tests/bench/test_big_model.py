"""The synthetic checkpoints (kvserve/bench/big_model.py) and the 1B-shaped bench's machinery,
run on the tiny spec."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvserve.bench import big_model
from kvserve.bench.big_model import LLAMA_1B_SHAPED, TINY, generate, model_file
from kvserve.model.gguf import GGUFCheckpoint, read_header
from kvserve.model.kernels import load_kernels


def test_generated_files_have_the_spec_shape_and_the_default_tokenizer(tmp_path, model_path):
    paths = generate(TINY, ("Q8_0", "Q4_0"), tmp_path)
    assert set(paths) == {"Q8_0", "Q4_0"}
    default = read_header(model_path).fields
    for quant_type, path in paths.items():
        checkpoint = GGUFCheckpoint(path)
        config = checkpoint.config
        assert (config.hidden_size, config.num_layers) == (TINY.hidden_size, TINY.num_layers)
        assert (config.num_heads, config.num_kv_heads) == (TINY.num_heads, TINY.num_kv_heads)
        assert config.intermediate_size == TINY.intermediate_size
        assert config.tie_word_embeddings and config.vocab_size == 49152
        assert config.rope_theta == TINY.rope_theta
        assert checkpoint.quantization == ["F32", quant_type]
        for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.chat_template"):
            assert checkpoint.fields[key] == default[key]
    assert not list(tmp_path.glob("*.tmp")), "temporary files left behind"


def test_files_are_reused_and_named_by_their_spec(tmp_path):
    first = generate(TINY, ("Q4_0",), tmp_path)["Q4_0"]
    stamp = first.stat().st_mtime_ns
    again = generate(TINY, ("Q4_0",), tmp_path)["Q4_0"]
    assert again == first and again.stat().st_mtime_ns == stamp
    other = model_file(replace(TINY, seed=5), "Q4_0", tmp_path)
    assert other != first


def test_the_default_directory_is_the_user_cache(monkeypatch, tmp_path):
    monkeypatch.delenv("KVSERVE_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert big_model.bench_model_dir() == tmp_path / "kvserve" / "bench"
    path = model_file(LLAMA_1B_SHAPED, "Q4_0")
    assert path.parent == tmp_path / "kvserve" / "bench" and path.suffix == ".gguf"


def test_the_1b_spec_is_llama_3_2_1b_shaped():
    spec = LLAMA_1B_SHAPED
    assert (spec.hidden_size, spec.num_layers, spec.num_heads) == (2048, 16, 32)
    assert (spec.num_kv_heads, spec.intermediate_size, spec.head_dim) == (8, 8192, 64)


@pytest.fixture(scope="module")
def tiny_q4_0(tmp_path_factory):
    """A tiny Q4_0 file, generated once for the bench tests below."""
    return generate(TINY, ("Q4_0",), tmp_path_factory.mktemp("tiny"))["Q4_0"]


@pytest.mark.skipif(not load_kernels().int8_gemm_isa, reason="int8 needs AVX512-VNNI or AVX2")
def test_the_bench_measures_starts_and_decode_on_a_file(tiny_q4_0):
    from kvserve.bench.bigmodel_bench import (
        block_bytes,
        format_report,
        measure_decode,
        measure_starts,
    )

    path = tiny_q4_0
    start = measure_starts("tiny Q4_0", str(path), path.stat().st_size)
    assert start.statuses == ("written", "hit")
    assert start.cached_process_s >= start.cached_load_s > 0
    decode = measure_decode("tiny Q4_0", path, (1, 2), output_len=4)
    assert set(decode.tok_s) == {1, 2} and all(v > 0 for v in decode.tok_s.values())
    # 4-bit blocks (18 bytes per 32 weights) against int8 panels (32+ bytes per 32 weights)
    assert 0 < block_bytes(path) < decode.weight_bytes_per_step
    report = format_report(20e9, [start], [decode], 4)
    assert "tiny Q4_0" in report and "batch-1 bound" in report and "Targets" in report


@pytest.mark.skipif(not load_kernels().q4, reason="4-bit blocks need AVX512-VNNI")
def test_the_bench_measures_a_file_with_its_4_bit_blocks_kept(tiny_q4_0):
    from kvserve.bench.bigmodel_bench import format_report, measure_decode

    path = tiny_q4_0
    decode = measure_decode("tiny Q4_0", path, (1,), output_len=4)
    # the same file with its blocks kept (q4): fewer bytes read per step than int8's
    kept = measure_decode("tiny Q4_0, q4", path, (1,), output_len=4, quantization="q4")
    assert kept.tok_s[1] > 0 and kept.weight_bytes_per_step < decode.weight_bytes_per_step
    assert "tiny Q4_0, q4" in format_report(20e9, [], [decode, kept], 4)


def test_make_bench_says_when_the_1b_section_is_skipped(tmp_path, capsys):
    from kvserve.bench.run import main

    output = tmp_path / "benchmarks.md"
    assert main(["--only", "bigmodel", "--skip-bigmodel", "--output", str(output)]) == 0
    assert "1B-shaped benchmark: skipped (--skip-bigmodel)" in capsys.readouterr().out
    assert "Skipped in this run (`--skip-bigmodel`)." in output.read_text()
