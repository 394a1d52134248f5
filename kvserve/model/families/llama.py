"""The Llama layout: Llama 2/3 (and SmolLM), Mistral, Qwen2, Qwen3.

Mistral is Llama with a sliding window on every layer where its config has one (llama.cpp's
converter writes Mistral as `llama` and drops the window; a `llama.attention.sliding_window`
key, where a file has one, is honoured). Qwen2 adds q/k/v biases, Qwen3 per-head q/k norms;
both window the layers from `max_window_layers` on when `use_sliding_window` is set.
"""

from __future__ import annotations

from kvserve.model.families import Family, windows_from_layer_types


def _mistral(raw, num_layers: int) -> dict:
    return {"sliding_window": raw.get("sliding_window")}


def _qwen_windows(raw, num_layers: int) -> dict:
    window = raw.get("sliding_window") if raw.get("use_sliding_window") else None
    if window is None:
        return {}
    layers = windows_from_layer_types(raw.get("layer_types"))
    if layers is None:
        first = int(raw.get("max_window_layers", num_layers))
        layers = tuple(i >= first for i in range(num_layers))
    return {"sliding_window": window, "sliding_layers": layers}


def _qwen2(raw, num_layers: int) -> dict:
    return {"attention_bias": True} | _qwen_windows(raw, num_layers)


def _qwen3(raw, num_layers: int) -> dict:
    return {"qk_norm": True} | _qwen_windows(raw, num_layers)


def _llama(raw, num_layers: int) -> dict:
    return {"attention_bias": bool(raw.get("attention_bias", False))}


def _gguf_window(key, num_layers: int) -> dict:
    window = int(key("attention.sliding_window", 0) or 0)
    return {"sliding_window": window} if window > 0 else {}


FAMILIES = (
    Family(
        "llama",
        ("LlamaForCausalLM",),
        "llama",
        gguf_permuted_rope=True,
        hf_fields=_llama,
        gguf_fields=_gguf_window,
    ),
    Family("llama", ("MistralForCausalLM",), hf_fields=_mistral),
    Family(
        "qwen2",
        ("Qwen2ForCausalLM",),
        "qwen2",
        hf_fields=_qwen2,
        gguf_fields=lambda key, n: {"attention_bias": True} | _gguf_window(key, n),
    ),
    Family(
        "qwen3",
        ("Qwen3ForCausalLM",),
        "qwen3",
        hf_fields=_qwen3,
        gguf_fields=lambda key, n: {"qk_norm": True} | _gguf_window(key, n),
    ),
)
