"""Every configuration the server runs in, for the tests that must hold in each of them.

A configuration is a loaded model (a session fixture, by name) and a KV cache dtype. Tests take
the `configuration` fixture below through `pytest.mark.parametrize(..., indirect=True)` or use
`CONFIGURATIONS` directly.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from kvserve.model.loader import cpu_has_bf16, missing_kernels


@dataclass(frozen=True)
class Configuration:
    name: str
    model_fixture: str  # a session fixture in tests/conftest.py
    kv_cache_dtype: str  # CacheConfig.kv_cache_dtype
    exact: bool  # a row's result does not depend on its batch mates (greedy answers comparable)

    @property
    def quantization(self) -> str:
        """The --quantization its model fixture was loaded with."""
        return {
            "loaded_int8": "int8",
            "loaded_q4": "q4",
            "qwen05_gguf": "gguf",
            "qwen05_int8": "int8",
        }.get(self.model_fixture, "none")


# `--quantization q4` with the int8 KV cache is covered by the model tests
# (tests/model/test_quant4.py) and the quality benchmark, to keep the suite's time.
CONFIGURATIONS = [
    Configuration("fp32", "loaded_fp32", "model", exact=True),
    Configuration("bf16", "loaded_bf16", "model", exact=False),
    Configuration("int8-weights", "loaded_int8", "model", exact=True),
    Configuration("int8-kv", "loaded_bf16", "int8", exact=False),
    Configuration("int8-both", "loaded_int8", "int8", exact=True),
    # 12-bit activations keep the last bits of bf16 attention, whose prefill tiles sum in
    # another order than single rows: a row's result depends on how its prompt was chunked.
    Configuration("q4-weights", "loaded_q4", "model", exact=False),
]

# The real qwen2.5-coder:0.5b (Q4_K_M) in each way a user runs it: auto (its blocks kept),
# int8 linear layers, float32 throughout (none), and its blocks beside the int8 KV cache. The
# tests that must hold for a real file (prompts of every length, a fault mid-step, the leak
# property) take these too.
REAL_CONFIGURATIONS = [
    Configuration("qwen05-auto", "qwen05_gguf", "model", exact=True),
    Configuration("qwen05-int8", "qwen05_int8", "model", exact=True),
    Configuration("qwen05-none", "qwen05_fp32", "model", exact=True),
    Configuration("qwen05-int8-kv", "qwen05_gguf", "int8", exact=False),
]


# `loaded_bf16` is the model in the machine's float dtype: on a CPU without bf16 that is float32,
# and the bf16 configuration is then the fp32 one (same weights, products and cache), with the
# weaker checks of an inexact configuration.
SAME_AS_FP32 = "this CPU has no bf16, so its float dtype is float32: this is the fp32 configuration"


def params(configurations: list[Configuration] = CONFIGURATIONS) -> list:
    """`pytest.param` per configuration, ids by name; marked to skip: those whose kernels this
    CPU lacks, and bf16 where it would run the fp32 configuration a second time."""
    result = []
    for c in configurations:
        missing = missing_kernels(c.quantization, c.kv_cache_dtype == "int8")
        if c.name == "bf16" and not cpu_has_bf16():
            missing = SAME_AS_FP32
        marks = [pytest.mark.skip(reason=missing)] if missing else []
        result.append(pytest.param(c, id=c.name, marks=marks))
    return result
