"""The engine flags that size the KV pool and choose the admission policy."""

from __future__ import annotations

import argparse

import pytest

from kvserve.cli import add_engine_arguments, engine_config_from_args, parse_memory
from kvserve.config import DEFAULT_RESERVE_TOKENS, CacheConfig


def parse(*argv: str):
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    return engine_config_from_args(parser.parse_args(list(argv)))


def test_kv_cache_memory_is_bytes_or_a_fraction_of_the_memory() -> None:
    assert parse_memory("4GiB") == 4 * 2**30
    assert parse_memory("512MB") == 512_000_000
    assert parse_memory("0.4") == pytest.approx(0.4)
    assert parse_memory("40%") == pytest.approx(0.4)
    assert parse_memory("1") == 1.0  # all of it
    assert parse_memory("2000000") == 2_000_000
    for bad in ("0", "150%", "-0.5"):
        with pytest.raises(ValueError):
            parse_memory(bad)
    assert parse("--kv-cache-memory", "25%").cache.kv_cache_memory == pytest.approx(0.25)
    assert parse("--kv-cache-memory", "1GiB").cache.kv_cache_memory == 2**30
    with pytest.raises(ValueError):
        CacheConfig(kv_cache_memory=1.5)


def test_admission_defaults_to_partial_and_reserve_stays_available() -> None:
    default = parse().scheduler
    assert (default.admission, default.reserve_tokens) == ("partial", DEFAULT_RESERVE_TOKENS)
    chosen = parse("--admission", "reserve", "--reserve-tokens", "64").scheduler
    assert (chosen.admission, chosen.reserve_tokens) == ("reserve", 64)
    with pytest.raises(SystemExit):
        parse("--admission", "slot-only")


def test_speculative_config_takes_vllms_json_and_refuses_a_bad_one() -> None:
    assert parse().speculative is None
    spec = parse(
        "--speculative-config",
        '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5}',
    ).speculative
    assert (spec.method, spec.num_speculative_tokens, spec.prompt_lookup_max) == ("ngram", 3, 5)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        parse("--speculative-config", '{"method": "ngram"}')


def test_the_offline_llm_takes_speculative_config() -> None:
    from kvserve.engine.llm import engine_config

    config = engine_config(speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    assert config.speculative.num_speculative_tokens == 2
    with pytest.raises(ValueError, match="unknown key"):
        engine_config(speculative_config={"method": "ngram", "num_speculative_tokens": 2, "x": 1})
