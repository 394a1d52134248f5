"""Hugging Face model directories: config.json + *.safetensors (sharded or not).

The config is read through the checkpoint's family (kvserve/model/families/), and tensors are
handed over under their own names, except that norm weights are the factors they multiply by
(Gemma's stored w becomes 1 + w, as llama.cpp's converter writes it).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from kvserve.model.families.hf import config_from_json, family_of

__all__ = ["SafetensorsCheckpoint", "config_from_json"]


class SafetensorsCheckpoint:
    """A Hugging Face directory: its config and a name -> tensor source over all shards."""

    def __init__(self, path: Path) -> None:
        self.path = path
        raw = json.loads((path / "config.json").read_text())
        self.family = family_of(raw)
        self.config = config_from_json(raw)
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"{path} has no *.safetensors files")
        self._handles = [safe_open(str(f), framework="pt") for f in files]
        self._where: dict[str, Any] = {}
        for handle in self._handles:
            for key in handle.keys():  # noqa: SIM118 (safe_open handles are not iterable)
                self._where[key] = handle
        self.quantization = sorted({str(self._dtype_of(k)) for k in list(self._where)[:8]})

    def _dtype_of(self, name: str) -> torch.dtype:
        return self._where[name].get_slice(name).get_dtype()

    def get(self, name: str) -> torch.Tensor | None:
        handle = self._where.get(name)
        if handle is None:
            return None
        tensor = handle.get_tensor(name)
        if self.family.hf_norm_offset and name.endswith("norm.weight"):
            # Gemma stores w for a norm that multiplies by 1 + w: hand over the factor
            tensor = tensor.float() + self.family.hf_norm_offset
        return tensor
