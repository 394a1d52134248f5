"""kvserve: an LLM inference server with continuous batching over a paged KV cache."""

__version__ = "0.1.0"
