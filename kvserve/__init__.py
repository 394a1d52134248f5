"""kvserve: an LLM inference server with continuous batching over a paged KV cache.

The offline API is importable from here, as vLLM's is: `from kvserve import LLM, SamplingParams`.
It is loaded on first use, so importing the package (the server's CLI does) costs nothing.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams", "__version__"]

_LAZY = {
    "LLM": "kvserve.engine.llm",
    "CompletionOutput": "kvserve.engine.llm",
    "RequestOutput": "kvserve.engine.llm",
    "SamplingParams": "kvserve.params",
}

if TYPE_CHECKING:
    from kvserve.engine.llm import LLM, CompletionOutput, RequestOutput
    from kvserve.params import SamplingParams


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kvserve' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
