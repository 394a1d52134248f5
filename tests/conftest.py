"""Shared fixtures: the default model is loaded once per test session and shared read-only."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session", autouse=True)
def prepared_weight_cache(tmp_path_factory):
    """Prepared weights (kvserve/model/weight_cache.py) go to this session's temporary
    directory, never the user's cache; servers started by tests inherit it."""
    directory = tmp_path_factory.mktemp("prepared")
    patch = pytest.MonkeyPatch()
    patch.setenv("KVSERVE_WEIGHT_CACHE_DIR", str(directory))
    yield directory
    patch.undo()


@pytest.fixture(scope="session")
def model_path():
    from kvserve.model.paths import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def loaded_fp32():
    """The default model in float32 with float linear layers (exact comparisons): `auto` would
    pick int8 linear layers for this quantized checkpoint."""
    from kvserve.config import DeviceConfig
    from kvserve.model.loader import load_model

    return load_model(None, DeviceConfig(device="cpu", dtype="float32", quantization="none"))


@pytest.fixture(scope="session")
def loaded_default():
    """The default model as `kvserve serve` runs it with no flags (`--quantization auto`: int8
    linear layers where the CPU kernels run, bf16 where the CPU has it)."""
    from kvserve.config import DeviceConfig
    from kvserve.model.loader import load_model

    return load_model(None, DeviceConfig(device="cpu"))


@pytest.fixture(scope="session")
def loaded_bf16():
    """The default model in the machine's float dtype (bf16 where the CPU has it), float linear
    layers (`--quantization none`)."""
    from kvserve.config import DeviceConfig
    from kvserve.model.loader import load_model

    return load_model(None, DeviceConfig(device="cpu", quantization="none"))


@pytest.fixture(scope="session")
def loaded_q4():
    """The default model keeping its file's 4-bit blocks (--quantization q4), bf16 elsewhere."""
    from kvserve.config import DeviceConfig
    from kvserve.model.loader import load_model

    return load_model(None, DeviceConfig(device="cpu", quantization="q4"))


@pytest.fixture(scope="session")
def loaded_int8():
    """The default model with int8 linear layers (--quantization int8), bf16 elsewhere."""
    from kvserve.config import DeviceConfig
    from kvserve.model.loader import load_model

    return load_model(None, DeviceConfig(device="cpu", quantization="int8"))


@pytest.fixture(scope="session")
def hf_tokenizer(model_path):
    """transformers' own tokenizer for the default GGUF file (an independent reference), loaded
    once per session and shared read-only: a test that must change it works on a copy."""
    import transformers

    return transformers.AutoTokenizer.from_pretrained(
        str(model_path.parent), gguf_file=model_path.name
    )


@pytest.fixture(scope="session")
def hf_reference(model_path):
    """transformers' model for the default GGUF file in float32, in eval mode (the independent
    reference for logits and greedy tokens), loaded once per session and shared read-only."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(model_path.parent), gguf_file=model_path.name, dtype=torch.float32
    )
    model.eval()
    return model


@pytest.fixture(scope="session")
def minilm_dir():
    """The all-MiniLM-L6-v2 sentence embedder from its wheel, unzipped in kvserve's cache."""
    from kvserve.model.paths import minilm_model_dir

    return minilm_model_dir()


@pytest.fixture(scope="session")
def loaded_minilm(minilm_dir):
    """MiniLM loaded as `kvserve serve <its directory>` loads it (float32 on the CPU), once."""
    from kvserve.config import DeviceConfig
    from kvserve.engine.embedding import load_encoder_model

    return load_encoder_model(str(minilm_dir), DeviceConfig(device="cpu"))
