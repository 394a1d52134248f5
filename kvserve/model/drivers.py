"""The one-call layer drivers: every layer of a model in one C call (csrc/forward_int8.c,
csrc/forward_q4.c, csrc/forward_blocks.c), a named fast path behind the model's one layer loop.

A driver runs the same kernels in the same order as the loop in kvserve/model/llama.py, so
its results are the loop's (tests/model/test_drivers.py holds each to the loop); what it
saves is a dozen ctypes calls and tensor allocations per layer, which at decode row counts cost
as much as the work: on the default model at one decode row the int8 driver measured 20-27 ms
against 33-43 ms for the loop calling the same kernels (docs/benchmarks.md). A model whose
layers a driver cannot run (another weight format, a feature the C loop lacks) keeps the loop,
and the loader says which and why.
"""

from __future__ import annotations

import ctypes

import torch

from kvserve.model.kernels import (
    BlocksLayerStruct,
    BlocksProductStruct,
    CpuKernels,
    DriverStep,
    Int8LayerStruct,
    Int8WeightStruct,
    KernelInputError,
    Q4LayerStruct,
    Q4WeightStruct,
    block_format,
    blocks_parts_table,
    check_block_packed,
    check_tensor,
)
from kvserve.model.linear.blocks import BlockLinear
from kvserve.model.linear.int8 import Int8Linear
from kvserve.model.linear.q4 import Q4Linear

_PRODUCTS = ("qkv", "o", "gate_up", "down")


def _ptr(tensor: torch.Tensor | None) -> int | None:
    return None if tensor is None else tensor.data_ptr()


def _shapes(config) -> dict[str, tuple[int, int]]:
    hidden, q_size, kv_size = config.hidden_size, config.q_size, config.kv_size
    return {
        "qkv": (q_size + 2 * kv_size, hidden),
        "o": (hidden, q_size),
        "gate_up": (2 * config.intermediate_size, hidden),
        "down": (hidden, config.intermediate_size),
    }


def family_features(config) -> str | None:
    """What of this model the C drivers do not implement (they run Llama's layer: SiLU gate,
    pre-norms only, full attention with one RoPE, no soft cap), None when they run it."""
    if config.windowed:
        return "its sliding-window layers"
    if config.attn_logit_softcapping is not None:
        return "its attention soft-capping"
    if config.local_rope_theta is not None:
        return "its per-layer RoPE"
    if config.hidden_activation != "silu":
        return f"its {config.hidden_activation} activation"
    if config.sandwich_norms:
        return "its post-attention and post-MLP norms"
    return None


def _check_qk_norm(layer, config) -> None:
    if layer.qk_norm is not None:
        heads = config.num_heads + config.num_kv_heads
        check_tensor(
            layer.qk_norm, "q/k norms", 2, (torch.float32,), shape=(heads, config.head_dim)
        )


class Int8Driver:
    """Every layer of an int8 model (rotated residual, norms folded) in one call."""

    name = "int8"

    def __init__(self, layers, config, kernels: CpuKernels, down_block: int) -> None:
        self.config = config
        self.kernels = kernels
        self.down_block = down_block
        self.table = self._table(layers, config)

    @staticmethod
    def unsupported(layers, kernels: CpuKernels, config=None) -> str | None:
        """Why these layers (of a model of `config`) cannot run on this driver, or None."""
        if not kernels.has("int8_driver"):
            return f"the int8 driver is not built ({kernels.failures.get('int8_driver')})"
        feature = None if config is None else family_features(config)
        if feature is not None:
            return f"the int8 driver does not implement {feature}"
        for layer in layers:
            for name in _PRODUCTS:
                method = getattr(layer, name)
                if not isinstance(method, Int8Linear) or method.panels is None:
                    return f"{name} is not a packed int8 product"
            if layer.attn_norm is not None or layer.mlp_norm is not None:
                return "its norms are not folded into the products"
        return None

    @staticmethod
    def _table(layers, config) -> ctypes.Array:
        shapes = _shapes(config)

        def weight(method: Int8Linear, name: str) -> Int8WeightStruct:
            n, k = shapes[name]
            if method.out_features != n or method.in_features != k:
                raise KernelInputError(f"{name} is not a [{n}, {k}] product")
            return Int8WeightStruct(
                method.panels.data_ptr(),
                method.correction.data_ptr(),
                method.scale.data_ptr(),
                _ptr(method.bias),
                n,
                k,
            )

        table = (Int8LayerStruct * len(layers))()
        for entry, layer in zip(table, layers, strict=True):
            for name in _PRODUCTS:
                setattr(entry, name, weight(getattr(layer, name), name))
            _check_qk_norm(layer, config)
            entry.qk_norm = _ptr(layer.qk_norm)
        return table

    def run(self, x: torch.Tensor, step: DriverStep, kv_cache, dtype: torch.dtype) -> None:
        """Every layer on x ([rows, hidden] float32, the rotated residual, in place)."""
        cfg = self.config
        self.kernels.forward_int8(
            x,
            self.table,
            kv_cache.kv,
            kv_cache.scales,
            step,
            heads=cfg.num_heads,
            kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            intermediate=cfg.intermediate_size,
            down_block=self.down_block,
            eps=cfg.rms_norm_eps,
            scale=cfg.attention_scale,
            dtype=dtype,
        )


class Q4Driver:
    """Every layer of a 4-bit model (the file's Q4_0/Q4_1 blocks) in one call."""

    name = "q4"

    def __init__(self, layers, config, kernels: CpuKernels) -> None:
        self.config = config
        self.kernels = kernels
        self.table = self._table(layers, config)

    @staticmethod
    def unsupported(layers, kernels: CpuKernels, config=None) -> str | None:
        """Why these layers (of a model of `config`) cannot run on this driver, or None."""
        if not kernels.has("q4_driver") or not kernels.q4:
            return "the 4-bit driver needs AVX512-VNNI"
        feature = None if config is None else family_features(config)
        if feature is not None:
            return f"the 4-bit driver does not implement {feature}"
        for layer in layers:
            for name in _PRODUCTS:
                if not isinstance(getattr(layer, name), Q4Linear):
                    return f"{name} is not a 4-bit product"
            if layer.attn_norm is None or layer.mlp_norm is None:
                return "its layers lack their norms"
        return None

    @staticmethod
    def _table(layers, config) -> ctypes.Array:
        shapes = _shapes(config)
        hidden = config.hidden_size

        def weight(method: Q4Linear, name: str) -> Q4WeightStruct:
            n, k = shapes[name]
            if method.out_features != n:
                raise KernelInputError(f"{name} has {method.out_features} outputs, expected {n}")
            method.check(n, k)
            if method.bias is not None:
                check_tensor(method.bias, f"{name} bias", 1, (torch.float32,), shape=(n,))
            return Q4WeightStruct(
                method.packed.data_ptr(), _ptr(method.bias), n, k, int(method.asym)
            )

        table = (Q4LayerStruct * len(layers))()
        for entry, layer in zip(table, layers, strict=True):
            for name in _PRODUCTS:
                setattr(entry, name, weight(getattr(layer, name), name))
            for norm in ("attn_norm", "mlp_norm"):
                check_tensor(getattr(layer, norm), norm, 1, (torch.float32,), shape=(hidden,))
                setattr(entry, norm, getattr(layer, norm).data_ptr())
            _check_qk_norm(layer, config)
            entry.qk_norm = _ptr(layer.qk_norm)
        return table

    def run(self, x: torch.Tensor, step: DriverStep, kv_cache, dtype: torch.dtype) -> None:
        """Every layer on x ([rows, hidden] float32, the residual, in place)."""
        self.kernels.forward_q4(
            x,
            self.table,
            kv_cache.kv,
            kv_cache.scales,
            step,
            config=self.config,
            scale=self.config.attention_scale,
            dtype=dtype,
        )


class BlocksDriver:
    """Every layer of a model whose products keep a GGUF file's blocks, in one call."""

    name = "blocks"

    def __init__(self, layers, config, kernels: CpuKernels) -> None:
        self.config = config
        self.kernels = kernels
        self.fine = layers[0].qkv.input.fine
        self._parts: list[ctypes.Array] = []  # the parts' tables, kept alive with the driver
        self.table = self._table(layers, config)

    @staticmethod
    def unsupported(layers, kernels: CpuKernels, config=None) -> str | None:
        """Why these layers (of a model of `config`) cannot run on this driver, or None."""
        if not kernels.has("blocks_driver") or not kernels.blocks_isa:
            return f"the block driver is not built ({kernels.failures.get('blocks_driver')})"
        feature = None if config is None else family_features(config)
        if feature is not None:
            return f"the block driver does not implement {feature}"
        fine = {layer.qkv.input.fine for layer in layers if isinstance(layer.qkv, BlockLinear)}
        for layer in layers:
            for name in _PRODUCTS:
                method = getattr(layer, name)
                if not isinstance(method, BlockLinear) or method.input.fine not in fine:
                    return f"{name} is not a block product"
            if layer.attn_norm is None or layer.mlp_norm is None:
                return "its layers lack their norms"
        if len(fine) != 1:
            return "its products' activations differ"
        return None

    def _table(self, layers, config) -> ctypes.Array:
        shapes = _shapes(config)
        hidden = config.hidden_size
        table = (BlocksLayerStruct * len(layers))()
        for entry, layer in zip(table, layers, strict=True):
            for name in _PRODUCTS:
                method: BlockLinear = getattr(layer, name)
                n, k = shapes[name]
                if method.out_features != n or method.in_features != k:
                    raise KernelInputError(f"{name} is not a [{n}, {k}] product")
                parts = [p.part for p in method.parts]
                for part in parts:
                    check_block_packed(block_format(part.qtype), part.packed, part.n, k)
                array = blocks_parts_table(parts)
                self._parts.append(array)
                setattr(entry, name, BlocksProductStruct(ctypes.addressof(array), len(parts)))
            for norm in ("attn_norm", "mlp_norm"):
                check_tensor(getattr(layer, norm), norm, 1, (torch.float32,), shape=(hidden,))
                setattr(entry, norm, getattr(layer, norm).data_ptr())
            _check_qk_norm(layer, config)
            entry.qk_norm = _ptr(layer.qk_norm)
        return table

    def run(self, x: torch.Tensor, step: DriverStep, kv_cache, dtype: torch.dtype) -> None:
        """Every layer on x ([rows, hidden] float32, the residual, in place)."""
        self.kernels.forward_blocks(
            x,
            self.table,
            kv_cache.kv,
            kv_cache.scales,
            step,
            config=self.config,
            fine=self.fine,
            scale=self.config.head_dim**-0.5,
            dtype=dtype,
        )
