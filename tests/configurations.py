"""Every configuration the server runs in, for the tests that must hold in each of them.

A configuration is a loaded model (a session fixture, by name) and a KV cache dtype. Tests take
the `configuration` fixture below through `pytest.mark.parametrize(..., indirect=True)` or use
`CONFIGURATIONS` directly.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from kvserve.model import native


@dataclass(frozen=True)
class Configuration:
    name: str
    model_fixture: str  # a session fixture in tests/conftest.py
    kv_cache_dtype: str  # CacheConfig.kv_cache_dtype
    exact: bool  # a row's result does not depend on its batch mates (greedy answers comparable)


CONFIGURATIONS = [
    Configuration("fp32", "loaded_fp32", "model", exact=True),
    Configuration("bf16", "loaded_bf16", "model", exact=False),
    Configuration("int8-weights", "loaded_int8", "model", exact=True),
    Configuration("int8-kv", "loaded_bf16", "int8", exact=False),
    Configuration("int8-both", "loaded_int8", "int8", exact=True),
]

needs_int8 = pytest.mark.skipif(
    not native.kv_int8_available(), reason="the int8 configurations need AVX512-VNNI"
)


def params() -> list:
    """`pytest.param` per configuration, int8 ones marked to need the kernels, ids by name."""
    return [
        pytest.param(c, id=c.name, marks=[needs_int8] if "int8" in c.name else [])
        for c in CONFIGURATIONS
    ]
