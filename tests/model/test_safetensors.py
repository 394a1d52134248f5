"""Hugging Face directories: tiny random checkpoints written by transformers, loaded by us.

Nothing is downloaded: transformers builds a random model from a config and saves it.
"""

from __future__ import annotations

import json

import pytest
import torch

from kvserve.model.config import UnsupportedModelError
from kvserve.model.kernels import load_kernels
from kvserve.model.kv_cache import KVCache
from kvserve.model.llama import LlamaModel
from kvserve.model.safetensors import SafetensorsCheckpoint, config_from_json
from tests.model.helpers import Chunk

CPU = torch.device("cpu")
VOCAB = 320


def tiny_config(arch: str, **overrides):
    import transformers

    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=112,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    )
    common.update(overrides)
    cls = {
        "llama": transformers.LlamaConfig,
        "qwen2": transformers.Qwen2Config,
        "qwen3": transformers.Qwen3Config,
        "mistral": transformers.MistralConfig,
    }[arch]
    if arch == "qwen3":
        common.setdefault("head_dim", 32)
    return cls(**common)


def save_tiny(tmp_path, config, *, max_shard_size=None):
    import transformers

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Random init leaves norms at 1 and biases at 0; perturb them so they are exercised.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    model.eval()
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(tmp_path, safe_serialization=True, **kwargs)
    return model


def our_logits(path, ids: list[int]) -> torch.Tensor:
    checkpoint = SafetensorsCheckpoint(path)
    model = LlamaModel.from_tensors(
        checkpoint.config, checkpoint.get, dtype=torch.float32, device=CPU, kernels=load_kernels()
    )
    cache = KVCache(model.config, 8, 32, torch.float32, CPU)
    meta = model.attention.build_metadata([Chunk(0, len(ids), [3, 0, 5], True)], 32)
    meta.logits_indices = torch.arange(len(ids))
    return model.forward(torch.tensor(ids), meta, cache)


CASES = {
    "llama": ("llama", {}),
    "llama-tied": ("llama", {"tie_word_embeddings": True}),
    "llama3-rope-scaling": (
        "llama",
        {
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
            "rope_theta": 500000.0,
        },
    ),
    "mistral": ("mistral", {"sliding_window": None}),
    "qwen2-bias": ("qwen2", {}),
    "qwen3-qk-norm": ("qwen3", {}),
    "qwen3-qk-norm-c-kernels": ("qwen3", {"head_dim": 64}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_tiny_checkpoint_matches_transformers(tmp_path, case):
    arch, overrides = CASES[case]
    reference = save_tiny(tmp_path, tiny_config(arch, **overrides))
    ids = torch.randint(0, VOCAB, (45,), generator=torch.Generator().manual_seed(1)).tolist()
    ours = our_logits(tmp_path, ids)
    with torch.no_grad():
        theirs = reference(torch.tensor([ids])).logits[0]
    assert (ours - theirs).abs().max().item() <= 1e-4


def test_sharded_checkpoint_loads(tmp_path):
    reference = save_tiny(tmp_path, tiny_config("llama"), max_shard_size="100KB")
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    ids = list(range(10, 40))
    with torch.no_grad():
        theirs = reference(torch.tensor([ids])).logits[0]
    assert (our_logits(tmp_path, ids) - theirs).abs().max().item() <= 1e-4


def test_unsupported_architecture_is_refused_by_name():
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel"):
        config_from_json({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})


def test_hf_directory_loads_with_its_tokenizer(tmp_path, hf_tokenizer):
    """`load_model` on a directory: weights, tokenizer.json and the chat template."""
    from kvserve.config import DeviceConfig
    from kvserve.model.loader import load_model

    tokenizer = hf_tokenizer
    config = tiny_config("llama", vocab_size=len(tokenizer), bos_token_id=1, eos_token_id=2)
    reference = save_tiny(tmp_path, config)
    tokenizer.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["architectures"]
    loaded = load_model(str(tmp_path), DeviceConfig(device="cpu", dtype="float32"))
    ids = loaded.tokenizer.encode_chat([{"role": "user", "content": "Hello there!"}])
    assert ids == tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hello there!"}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )
    cache = KVCache(loaded.config, 4, 32, torch.float32, CPU)
    meta = loaded.model.attention.build_metadata([Chunk(0, len(ids), [1, 2], True)], 32)
    ours = loaded.model.forward(torch.tensor(ids), meta, cache)[0]
    with torch.no_grad():
        theirs = reference(torch.tensor([ids])).logits[0, -1]
    assert (ours - theirs).abs().max().item() <= 1e-4
