"""The decoder of every family (Llama, Mistral, Qwen2/3, Gemma 2/3, Phi-3) over a flat batch of
rows: one layer loop.

A layer is four products (q|k|v fused, o, gate|up fused, down), each a linear method chosen at
load for its weight format (kvserve/model/linear/), between the elementwise steps each method's
activation format fuses (kvserve/model/linear/__init__.py), with one attention backend chosen
at load (kvserve/model/attention/). The loop below is the only place a layer is written: a
bias, a norm or a rope change is one edit here. What differs between families is data
(kvserve/model/config.py, kvserve/model/families/) that the loop reads: q/k norms, post-norms
(Gemma's "sandwich"), the gate's activation (in each activation format), the embedding scale,
and, in the attention backend, each layer's window, RoPE, scale and soft cap. Where every layer
fits a one-call C driver (kvserve/model/drivers.py), the driver runs the same kernels in the
same order as this loop; a model using a feature the drivers lack runs the loop.

RoPE uses the half-rotation form (Hugging Face layout); GGUF checkpoints, which store q/k rows
permuted for interleaved rotation, are un-permuted by the loader. The residual stream stays in
float32 whatever the weights' dtype (as llama.cpp keeps its activations): only products'
inputs are cast down or quantized. With bf16 weights on a small model the difference decides
greedy choices between near-tied tokens.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvserve.model.attention import LayerRopes, select_attention
from kvserve.model.attention.cpu import CpuAttentionMetadata
from kvserve.model.config import ModelConfig, require_tensor
from kvserve.model.drivers import BlocksDriver, Int8Driver, Q4Driver
from kvserve.model.families import Family, family_for
from kvserve.model.head import BlockEmbedding, BlockHead, FloatHead, QuantizedHead
from kvserve.model.kernels import CpuKernels, DriverStep
from kvserve.model.kv_cache import KVCache
from kvserve.model.linear import LinearMethod, add_residual
from kvserve.model.linear import q4 as q4_blocks
from kvserve.model.linear.blocks import BlockActivations, BlockLinear, fused_from_checkpoint
from kvserve.model.linear.float import FloatFormat, FloatLinear
from kvserve.model.linear.int8 import (
    Int8Format,
    Int8Linear,
    down_block,
    residual_rotation,
    rotate_layer,
    structured_rotation,
)
from kvserve.model.linear.q4 import Q4Format, Q4Linear

log = logging.getLogger("kvserve.model")

# A loader hands tensors over by Hugging Face name, already in HF layout ([out, in], un-permuted).
TensorSource = Callable[[str], torch.Tensor | None]

INT8_REQUIREMENTS = (
    "--quantization int8 runs on the CPU kernels (needs a C compiler, a CPU device, "
    "float32 or bfloat16, and head_dim 64 or 128)"
)
Q4_REQUIREMENTS = (
    "--quantization q4 runs on the CPU kernels (needs a C compiler, a CPU with AVX512-VNNI, "
    "float32 or bfloat16, head_dim 64 or 128, and a GGUF file whose layers are Q4_0/Q4_1)"
)
PRODUCTS = ("qkv", "o", "gate_up", "down")
QUANTIZATIONS = ("none", "int8", "q4", "gguf")
GGUF_REQUIREMENTS = (
    "--quantization gguf runs on the CPU kernels (needs a C compiler, a CPU with AVX2, "
    "float32 or bfloat16, head_dim 64 or 128, and a GGUF file whose layers are in block "
    "formats the kernels take: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K)"
)
# Below this hidden size the activation blocks take 12 bits, not 8: measured through the
# kernels, 8 bits cost the 0.5B Qwen2.5 (896 wide) 0.08% of perplexity, but turn a near tie of
# the 576-wide SmolLM2-135M ("Paris") into another answer (kvserve/model/linear/blocks.py).
FINE_ACTIVATIONS_BELOW = 768


@dataclass(slots=True)
class DecoderLayer:
    qkv: LinearMethod  # [q + 2 kv, hidden]: q, k, v rows (Hugging Face order), their bias
    o: LinearMethod  # [hidden, q]
    gate_up: LinearMethod  # [2 intermediate, hidden]: gate rows, then up rows
    down: LinearMethod  # [hidden, intermediate]
    attn_norm: torch.Tensor | None  # [hidden] float32; None when folded into q|k|v
    mlp_norm: torch.Tensor | None  # [hidden] float32; None when folded into gate|up
    qk_norm: torch.Tensor | None  # [heads + kv_heads, head_dim] float32: q_norm rows, k_norm rows
    # [hidden] float32: the norms on the attention and MLP outputs (Gemma), never folded
    post_attn_norm: torch.Tensor | None = None
    post_mlp_norm: torch.Tensor | None = None

    @property
    def norms(self) -> tuple[torch.Tensor | None, ...]:
        return (
            self.attn_norm,
            self.mlp_norm,
            self.qk_norm,
            self.post_attn_norm,
            self.post_mlp_norm,
        )


NORMS = ("attn_norm", "mlp_norm", "qk_norm", "post_attn_norm", "post_mlp_norm")


class LlamaModel:
    """A Llama-family decoder. Stateless apart from weights: the KV cache is passed in.

    `quantization` names the layers' weight format ("none", "int8", "q4", "gguf": the file's
    blocks); `kernels` are the CPU kernels (None on CUDA); `rotation` ([hidden, hidden] float32)
    rotates embedded rows into the basis the int8 products read; `head` computes logits
    (kvserve/model/head.py). `embed` is the float table, or a `BlockEmbedding` left in the
    file's blocks (then `dtype` names the model dtype)."""

    def __init__(
        self,
        config: ModelConfig,
        embed: torch.Tensor | BlockEmbedding,
        layers: list[DecoderLayer],
        norm: torch.Tensor,
        lm_head: torch.Tensor | None,
        *,
        quantization: str = "none",
        kernels: CpuKernels | None = None,
        rotation: torch.Tensor | None = None,
        head: FloatHead | QuantizedHead | BlockHead | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        if quantization not in QUANTIZATIONS:
            raise ValueError(f"unknown quantization {quantization!r} (use none, int8 or q4)")
        self.config = config
        self.embed = embed  # [vocab, hidden]
        self.layers = layers
        self.norm = norm  # [hidden], float32
        self.lm_head = lm_head  # [vocab, hidden] (the same tensor as embed when tied), or None
        self.dtype = dtype or embed.dtype
        self.device = embed.device if isinstance(embed, torch.Tensor) else torch.device("cpu")
        self.kernels = kernels if self.device.type == "cpu" else None
        self.quantization = quantization
        self.rotation = rotation
        self.head = head or FloatHead(
            norm, lm_head, config.rms_norm_eps, self.kernels, config.final_logit_softcapping
        )
        # Gemma: sqrt(hidden) rounded to the model dtype, as transformers multiplies by it
        self.embed_scale = (
            torch.tensor(config.hidden_size**0.5, dtype=self.dtype)
            if config.scale_embeddings
            else None
        )
        ropes = LayerRopes.build(config, self.device)
        self.attention = select_attention(config, self.dtype, self.device, self.kernels, ropes)
        self.driver: Int8Driver | Q4Driver | BlocksDriver | None = None
        self.driver_reason = self._choose_driver()

    def _choose_driver(self) -> str:
        """Set the one-call driver where every layer fits one; returns what was chosen or why
        none (for the load log)."""
        if self.quantization == "none":
            return "float layers run the layer loop"
        if self.kernels is None or self.attention.name != "cpu-paged":
            return "the layer loop (no CPU kernels)"
        driver_class = {"int8": Int8Driver, "q4": Q4Driver, "gguf": BlocksDriver}[self.quantization]
        reason = driver_class.unsupported(self.layers, self.kernels, self.config)
        if reason is not None:
            log.info("%s layers run the layer loop: %s", self.quantization, reason)
            return f"the layer loop ({reason})"
        if driver_class is Int8Driver:
            block = self.layers[0].gate_up.input.down_block if self.layers else 1
            self.driver = Int8Driver(self.layers, self.config, self.kernels, block)
        else:
            self.driver = driver_class(self.layers, self.config, self.kernels)
        return f"the {self.driver.name} driver"

    def with_driver(self, enabled: bool) -> LlamaModel:
        """A model sharing these weights that runs its layers through the one-call driver
        (when one fits, as chosen at load) or, with `enabled=False`, through the layer loop."""
        twin = copy.copy(self)
        if not enabled:
            twin.driver = None
        elif twin.driver is None:
            twin.driver_reason = twin._choose_driver()
        return twin

    def with_attention(self, backend) -> LlamaModel:
        """A model sharing these weights that attends through `backend` (its layers then run
        the layer loop unless the driver's backend is kept)."""
        twin = copy.copy(self)
        twin.attention = backend
        if backend.name != "cpu-paged":
            twin.driver = None
        return twin

    def torch_attention(self) -> LlamaModel:
        """A model sharing these weights that attends by torch ops (the CUDA path's backend)."""
        from kvserve.model.attention.sdpa import TorchPagedAttention

        ropes = self.attention.ropes
        return self.with_attention(TorchPagedAttention(self.config, self.dtype, self.device, ropes))

    @property
    def supports_int8_kv_cache(self) -> bool:
        """Whether this model can run on an int8 KV cache (the CPU attention backend writes and
        reads it; kvserve/model/csrc/kv_int8.c)."""
        return self.attention.supports_int8_cache

    # -- construction -------------------------------------------------------------------------

    @classmethod
    def from_tensors(
        cls,
        config: ModelConfig,
        get: TensorSource,
        *,
        dtype: torch.dtype,
        device: torch.device,
        progress: Callable[[int], None] | None = None,
        quantization: str = "none",
        kernels: CpuKernels | None = None,
        family: Family | None = None,
    ) -> LlamaModel:
        """Build from tensors named as in Hugging Face checkpoints, fusing as it goes: float
        layers ("none") or int8 ones ("int8": rotated and quantized, see linear/int8.py).

        `get(name)` returns a float tensor (any dtype, on CPU) or None when absent, norm
        weights as the factors they multiply by (kvserve/model/families/). `family` names the
        checkpoint's tensors (default: the architecture's). Layers are fused, converted and
        moved one at a time so peak memory stays near one layer's.
        """
        family = family or family_for(config.architecture)
        if quantization == "int8" and (
            kernels is None
            or device.type != "cpu"
            or not kernels.supports(
                device, dtype, config.num_heads, config.num_kv_heads, config.head_dim
            )
            or not kernels.has("quant_ops")
        ):
            raise ValueError(INT8_REQUIREMENTS)
        if (
            quantization == "int8"
            and kernels.int8_gemm_isa is None
            and not hasattr(torch, "_int_mm")
        ):
            raise ValueError("--quantization int8 needs torch._int_mm (torch >= 2.2)")
        if quantization not in ("none", "int8"):
            raise ValueError(f"from_tensors builds float or int8 layers, not {quantization!r}")

        def need(name: str) -> torch.Tensor:
            return require_tensor(get, name)

        def place(tensor: torch.Tensor) -> torch.Tensor:
            return tensor.to(device=device, dtype=dtype).contiguous()

        def place_float(tensor: torch.Tensor) -> torch.Tensor:
            # Norms act on the float32 residual stream.
            return tensor.to(device=device, dtype=torch.float32).contiguous()

        embed = place(need("model.embed_tokens.weight"))
        if progress:
            progress(1)
        int8 = quantization == "int8"
        sandwich = config.sandwich_norms
        residual = None
        if int8:  # post-norms rotate at run time: a rotation cheap to apply there
            rotate = structured_rotation if sandwich else residual_rotation
            residual = rotate(config.hidden_size)
        block = down_block(config.intermediate_size)
        activation = config.hidden_activation
        int8_input = None
        if int8:
            int8_input = Int8Format(kernels, block, activation)
            if sandwich:
                int8_input.residual_signs = residual.signs.contiguous()
                int8_input.residual_block = down_block(config.hidden_size)
        float_input = FloatFormat(dtype, kernels, activation)
        layers = []
        for i in range(config.num_layers):
            p = f"model.layers.{i}."
            weight_dtype = torch.float32 if int8 else dtype
            qkv = torch.cat([need(p + f"{n}.weight").to(weight_dtype) for n in family.qkv])
            bias = None
            if config.attention_bias:
                bias = torch.cat([need(p + f"{n}.bias").float() for n in family.qkv])
            qk_norm = _qk_norm_rows(config, need, p)
            qk_norm = None if qk_norm is None else place_float(qk_norm)
            gate_up = torch.cat([need(p + f"{n}.weight").to(weight_dtype) for n in family.gate_up])
            o = need(p + "self_attn.o_proj.weight").to(weight_dtype)
            down = need(p + "mlp.down_proj.weight").to(weight_dtype)
            attn_norm = place_float(need(p + "input_layernorm.weight"))
            mlp_norm = place_float(need(p + f"{family.mlp_norm}.weight"))
            post_attn_norm = post_mlp_norm = None
            if sandwich:
                post_attn_norm = place_float(need(p + f"{family.post_attention_norm}.weight"))
                post_mlp_norm = place_float(need(p + f"{family.post_mlp_norm}.weight"))
            if int8:
                r = rotate_layer(
                    config,
                    qkv,
                    bias,
                    o,
                    gate_up,
                    down,
                    attn_norm,
                    mlp_norm,
                    residual,
                    block,
                    writes_residual=not sandwich,
                )

                def int8_linear(w, b=None):
                    return Int8Linear.quantize(w, b, kernels, input=int8_input, dtype=dtype)

                layer = DecoderLayer(
                    qkv=int8_linear(r.qkv, r.qkv_bias),
                    o=int8_linear(r.o),
                    gate_up=int8_linear(r.gate_up),
                    down=int8_linear(r.down),
                    attn_norm=None,
                    mlp_norm=None,
                    qk_norm=qk_norm,
                    post_attn_norm=post_attn_norm,
                    post_mlp_norm=post_mlp_norm,
                )
            else:

                def float_linear(w, b=None):
                    return FloatLinear(
                        place(w), None if b is None else place(b), kernels, float_input
                    )

                layer = DecoderLayer(
                    qkv=float_linear(qkv, bias),
                    o=float_linear(o),
                    gate_up=float_linear(gate_up),
                    down=float_linear(down),
                    attn_norm=attn_norm,
                    mlp_norm=mlp_norm,
                    qk_norm=qk_norm,
                    post_attn_norm=post_attn_norm,
                    post_mlp_norm=post_mlp_norm,
                )
            layers.append(layer)
            if progress:
                progress(1)
        norm = place_float(need("model.norm.weight"))
        head_weight = None if config.tie_word_embeddings else get("lm_head.weight")
        lm_head = embed if head_weight is None else place(head_weight)
        if progress:
            progress(1)
        if not int8:
            return cls(config, embed, layers, norm, lm_head, kernels=kernels)
        rotation = residual.matrix().contiguous()
        head = QuantizedHead(
            Int8Linear.quantize(residual.right(lm_head.float() * norm[None, :]), None, kernels),
            norm,
            lm_head,
            config.rms_norm_eps,
            kernels,
            to_model=rotation.t().contiguous(),
            softcap=config.final_logit_softcapping,
        )
        return cls(
            config,
            embed,
            layers,
            norm,
            lm_head,
            quantization="int8",
            kernels=kernels,
            rotation=rotation,
            head=head,
        )

    @classmethod
    def from_q4(
        cls,
        config: ModelConfig,
        checkpoint,
        *,
        dtype: torch.dtype,
        kernels: CpuKernels,
        progress: Callable[[int], None] | None = None,
    ) -> LlamaModel:
        """A model whose layers keep the 4-bit blocks of a GGUF checkpoint (linear/q4.py;
        `q4.unsupported` says whether it can). CPU only."""
        if kernels is None or not kernels.q4:
            raise ValueError(Q4_REQUIREMENTS)
        family = checkpoint.family
        q4_input = Q4Format(kernels, config.hidden_activation)

        def need(name: str) -> torch.Tensor:
            return require_tensor(checkpoint.get, name)

        embed = need("model.embed_tokens.weight").to(dtype).contiguous()
        if progress:
            progress(1)
        layers = []

        def post_norm(name: str) -> torch.Tensor | None:
            return need(name).float().contiguous() if config.sandwich_norms else None

        for i in range(config.num_layers):
            p = f"model.layers.{i}."
            qk_norm = _qk_norm_rows(config, need, p)
            products = {
                name: q4_blocks.load_projection(
                    checkpoint,
                    p,
                    names,
                    kernels,
                    bias=name == "qkv" and config.attention_bias,
                    input=q4_input,
                )
                for name, names in family.projections().items()
            }
            layers.append(
                DecoderLayer(
                    **products,
                    attn_norm=need(p + "input_layernorm.weight").float().contiguous(),
                    mlp_norm=need(p + f"{family.mlp_norm}.weight").float().contiguous(),
                    qk_norm=qk_norm,
                    post_attn_norm=post_norm(p + f"{family.post_attention_norm}.weight"),
                    post_mlp_norm=post_norm(p + f"{family.post_mlp_norm}.weight"),
                )
            )
            if progress:
                progress(1)
        norm = need("model.norm.weight").float().contiguous()
        head_weight = None if config.tie_word_embeddings else checkpoint.get("lm_head.weight")
        lm_head = embed if head_weight is None else head_weight.to(dtype).contiguous()
        if progress:
            progress(1)
        residual = residual_rotation(config.hidden_size)
        head = QuantizedHead(
            Int8Linear.quantize(residual.right(lm_head.float() * norm[None, :]), None, kernels),
            norm,
            lm_head,
            config.rms_norm_eps,
            kernels,
            to_head=residual.matrix().contiguous(),
            softcap=config.final_logit_softcapping,
        )
        return cls(
            config, embed, layers, norm, lm_head, quantization="q4", kernels=kernels, head=head
        )

    @classmethod
    def from_gguf(
        cls,
        config: ModelConfig,
        checkpoint,
        *,
        dtype: torch.dtype,
        kernels: CpuKernels,
        fine: bool | None = None,
        progress: Callable[[int], None] | None = None,
        requantize: str | None = None,
    ) -> LlamaModel:
        """A model whose products keep a GGUF file's blocks, each tensor in its own format
        (kvserve/model/linear/blocks.py): the layers, and the lm_head (or the tied embedding)
        packed for the block product; the embedding table left in the mapped file. `fine`:
        12-bit activation blocks (default: below FINE_ACTIVATIONS_BELOW hidden). `requantize`
        ("Q4_0"): the layer weights whose blocks take more bytes a value are requantized to it
        (`BlockWeight.requantized`; a draft model's layers)."""
        if not kernels.blocks_isa or not kernels.supports(
            torch.device("cpu"), dtype, config.num_heads, config.num_kv_heads, config.head_dim
        ):
            raise ValueError(GGUF_REQUIREMENTS)
        if fine is None:
            fine = config.hidden_size < FINE_ACTIVATIONS_BELOW
        family = checkpoint.family
        activations = BlockActivations(kernels, fine, config.hidden_activation)

        def need(name: str) -> torch.Tensor:
            return require_tensor(checkpoint.get, name).float().contiguous()

        def post_norm(name: str) -> torch.Tensor | None:
            return need(name) if config.sandwich_norms else None

        embed_name = "model.embed_tokens.weight"
        embed = BlockEmbedding(
            checkpoint.tensor_type(embed_name), checkpoint.raw_rows(embed_name), config.hidden_size
        )
        if progress:
            progress(1)
        layers = []
        for i in range(config.num_layers):
            p = f"model.layers.{i}."
            products = {}
            for name, parts in family.projections().items():
                biases = None
                if name == "qkv" and config.attention_bias:
                    biases = [p + n + ".bias" for n in parts]
                products[name] = fused_from_checkpoint(
                    checkpoint, [p + n + ".weight" for n in parts], kernels, biases, activations
                )
                if requantize is not None:
                    products[name] = products[name].requantized(requantize)
            layers.append(
                DecoderLayer(
                    **products,
                    attn_norm=need(p + "input_layernorm.weight"),
                    mlp_norm=need(p + f"{family.mlp_norm}.weight"),
                    qk_norm=_qk_norm_rows(config, need, p),
                    post_attn_norm=post_norm(p + f"{family.post_attention_norm}.weight"),
                    post_mlp_norm=post_norm(p + f"{family.post_mlp_norm}.weight"),
                )
            )
            if progress:
                progress(1)
        norm = need("model.norm.weight")
        head_name = embed_name if config.tie_word_embeddings else "lm_head.weight"
        head_weights = fused_from_checkpoint(checkpoint, [head_name], kernels)
        head = BlockHead(
            head_weights,
            norm,
            checkpoint.tensor_type(head_name),
            checkpoint.raw_rows(head_name),
            config.rms_norm_eps,
            kernels,
            softcap=config.final_logit_softcapping,
        )
        if progress:
            progress(1)
        return cls(
            config,
            embed,
            layers,
            norm,
            None,
            quantization="gguf",
            kernels=kernels,
            head=head,
            dtype=dtype,
        )

    def prepared_tensors(self) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
        """Everything an int8 or q4 model is made of, for the weight cache: tensors by name
        (the tied lm_head once) and the integers that complete them. See `from_prepared`."""
        if self.quantization == "none":
            raise ValueError("only int8, q4 and gguf models have prepared weights to cache")
        head = self.head
        tensors = {"norm": self.norm} | head.head.to_tensors("head")
        if isinstance(self.embed, torch.Tensor):  # the GGUF path reads its table from the file
            tensors["embed"] = self.embed
        if self.lm_head is not None and self.lm_head is not self.embed:
            tensors["lm_head"] = self.lm_head
        for name in ("to_head", "to_model"):
            if getattr(head, name, None) is not None:
                tensors[f"head.{name}"] = getattr(head, name)
        if self.rotation is not None:
            tensors["rotation"] = self.rotation
        numbers = {
            "num_layers": len(self.layers),
            "q4": int(self.quantization == "q4"),
            "gguf": int(self.quantization == "gguf"),
        }
        if self.quantization == "gguf" and self.layers:
            numbers["fine"] = int(self.layers[0].qkv.input.fine)
        for index, layer in enumerate(self.layers):
            prefix = f"layers.{index}"
            for name in PRODUCTS:
                method = getattr(layer, name)
                tensors |= method.to_tensors(f"{prefix}.{name}")
                if isinstance(method, Q4Linear):
                    numbers |= method.numbers(f"{prefix}.{name}")
            for name in NORMS:
                if getattr(layer, name) is not None:
                    tensors[f"{prefix}.{name}"] = getattr(layer, name)
        if self.quantization == "int8" and self.layers:
            int8_input = self.layers[0].gate_up.input
            numbers["down_block"] = int8_input.down_block
            if int8_input.residual_signs is not None:
                tensors["residual_signs"] = int8_input.residual_signs
                numbers["residual_block"] = int8_input.residual_block
        return tensors, numbers

    @classmethod
    def from_prepared(
        cls,
        config: ModelConfig,
        tensors: dict[str, torch.Tensor],
        numbers: dict[str, int],
        *,
        kernels: CpuKernels,
        checkpoint=None,
        dtype: torch.dtype | None = None,
    ) -> LlamaModel:
        """The int8, q4 or gguf model `prepared_tensors` described, using the tensors where they
        lie (memory-mapped from the weight cache: nothing is rotated, quantized or packed). A
        gguf model also reads its embedding table and head rows from `checkpoint` (the mapped
        GGUF file) and is in `dtype`."""
        if numbers.get("gguf"):
            return cls._from_prepared_gguf(config, tensors, numbers, kernels, checkpoint, dtype)
        embed = tensors["embed"]
        dtype = embed.dtype
        lm_head = tensors.get("lm_head", embed)
        norm = tensors["norm"]
        q4 = bool(numbers["q4"])
        if q4 and not kernels.q4:
            raise ValueError(Q4_REQUIREMENTS)
        if int(numbers["num_layers"]) != config.num_layers:
            raise KeyError("prepared weights hold another number of layers")
        activation = config.hidden_activation
        int8_input = None
        if not q4:
            int8_input = Int8Format(kernels, int(numbers["down_block"]), activation)
            if config.sandwich_norms:
                if "residual_signs" not in tensors:
                    raise KeyError("prepared weights lack the residual rotation's signs")
                int8_input.residual_signs = tensors["residual_signs"]
                int8_input.residual_block = int(numbers["residual_block"])
        layers = []
        for index in range(config.num_layers):
            prefix = f"layers.{index}"
            if q4:
                products = {
                    name: Q4Linear.from_tensors(
                        tensors,
                        numbers,
                        f"{prefix}.{name}",
                        input=Q4Format(kernels, activation),
                        kernels=kernels,
                    )
                    for name in PRODUCTS
                }
            else:
                products = {
                    name: Int8Linear.from_tensors(
                        tensors, f"{prefix}.{name}", input=int8_input, kernels=kernels, dtype=dtype
                    )
                    for name in PRODUCTS
                }
            layers.append(
                DecoderLayer(
                    **products, **{name: tensors.get(f"{prefix}.{name}") for name in NORMS}
                )
            )
            if config.qk_norm and layers[-1].qk_norm is None:
                raise KeyError("prepared weights lack the q/k norms")
            if config.sandwich_norms and layers[-1].post_mlp_norm is None:
                raise KeyError("prepared weights lack the post-norms")
        head = QuantizedHead(
            Int8Linear.from_tensors(tensors, "head", kernels=kernels),
            norm,
            lm_head,
            config.rms_norm_eps,
            kernels,
            to_head=tensors.get("head.to_head"),
            to_model=tensors.get("head.to_model"),
            softcap=config.final_logit_softcapping,
        )
        return cls(
            config,
            embed,
            layers,
            norm,
            lm_head,
            quantization="q4" if q4 else "int8",
            kernels=kernels,
            rotation=tensors.get("rotation"),
            head=head,
        )

    @classmethod
    def _from_prepared_gguf(cls, config, tensors, numbers, kernels, checkpoint, dtype):
        if checkpoint is None or dtype is None:
            raise KeyError("prepared GGUF blocks need their file and the model dtype")
        if int(numbers["num_layers"]) != config.num_layers:
            raise KeyError("prepared weights hold another number of layers")
        if not kernels.blocks_isa:
            raise ValueError(GGUF_REQUIREMENTS)
        activations = BlockActivations(kernels, bool(numbers["fine"]), config.hidden_activation)
        layers = []
        for index in range(config.num_layers):
            prefix = f"layers.{index}"
            products = {
                name: BlockLinear.from_tensors(tensors, f"{prefix}.{name}", kernels, activations)
                for name in PRODUCTS
            }
            layers.append(
                DecoderLayer(
                    **products, **{name: tensors.get(f"{prefix}.{name}") for name in NORMS}
                )
            )
            if layers[-1].attn_norm is None or layers[-1].mlp_norm is None:
                raise KeyError("prepared weights lack the norms")
            if config.qk_norm and layers[-1].qk_norm is None:
                raise KeyError("prepared weights lack the q/k norms")
            if config.sandwich_norms and layers[-1].post_mlp_norm is None:
                raise KeyError("prepared weights lack the post-norms")
        embed_name = "model.embed_tokens.weight"
        head_name = embed_name if config.tie_word_embeddings else "lm_head.weight"
        embed = BlockEmbedding(
            checkpoint.tensor_type(embed_name), checkpoint.raw_rows(embed_name), config.hidden_size
        )
        norm = tensors["norm"]
        head = BlockHead(
            BlockLinear.from_tensors(tensors, "head", kernels),
            norm,
            checkpoint.tensor_type(head_name),
            checkpoint.raw_rows(head_name),
            config.rms_norm_eps,
            kernels,
            softcap=config.final_logit_softcapping,
        )
        return cls(
            config,
            embed,
            layers,
            norm,
            None,
            quantization="gguf",
            kernels=kernels,
            head=head,
            dtype=dtype,
        )

    @property
    def num_bytes(self) -> int:
        """Bytes of the weights (a table left in the mapped file counted at its file size)."""
        tensors = [self.norm]
        if isinstance(self.embed, torch.Tensor):
            tensors.append(self.embed)
        if self.lm_head is not None and self.lm_head is not self.embed:
            tensors.append(self.lm_head)
        if self.rotation is not None:
            tensors.append(self.rotation)
        total = sum(t.numel() * t.element_size() for t in tensors) + self.head.num_bytes
        if isinstance(self.embed, BlockEmbedding):
            total += self.embed.num_bytes
        return total + self.layer_bytes

    def working_bytes(self, num_rows: int, num_logit_rows: int) -> int:
        """About the activations one step of `num_rows` rows holds at its peak (float32, one
        layer's at a time) and its `num_logit_rows` rows of logits."""
        cfg = self.config
        h, i = cfg.hidden_size, cfg.intermediate_size
        per_row = 4 * h + cfg.q_size + 2 * cfg.kv_size + cfg.q_size + 3 * i
        return 4 * (num_rows * per_row + num_logit_rows * cfg.vocab_size)

    @property
    def layer_bytes(self) -> int:
        """Bytes of the layers' weights and norms: what a decode step reads of them."""
        total = 0
        for layer in self.layers:
            total += sum(getattr(layer, name).num_bytes for name in PRODUCTS)
            total += sum(t.numel() * t.element_size() for t in layer.norms if t is not None)
        return total

    @property
    def weight_bytes_per_step(self) -> int:
        """What one decode step reads of the weights: every layer's products, the head's int8
        product and rotations, the residual rotation (not the float lm_head's refined rows)."""
        rotation = 0 if self.rotation is None else self.rotation.numel() * 4
        if isinstance(self.head, QuantizedHead | BlockHead):
            head = self.head.num_bytes
        else:
            head = self.lm_head.numel() * self.lm_head.element_size()
        return self.layer_bytes + head + rotation

    # -- forward ------------------------------------------------------------------------------

    @torch.inference_mode()
    def forward(self, token_ids: torch.Tensor, meta, kv_cache: KVCache) -> torch.Tensor:
        """Run one step. token_ids: [rows] long; `meta` from `self.attention.build_metadata`.
        Returns float32 logits `[len(meta.logits_indices), vocab]` for the rows that sample."""
        return self.head.logits(self.sampled_rows(token_ids, meta, kv_cache))

    def sampled_rows(self, token_ids: torch.Tensor, meta, kv_cache: KVCache) -> torch.Tensor:
        """The step of `forward` without the head: the residual rows that sample,
        `[len(meta.logits_indices), hidden]` float32 (what a draft's GuessHead reads)."""
        return self._residual(token_ids, meta, kv_cache)[meta.logits_indices]

    @torch.inference_mode()
    def hidden_states(self, token_ids: torch.Tensor, meta, kv_cache: KVCache) -> torch.Tensor:
        """The final norm's output of every row, in the model's basis: [rows, hidden] float32
        (what embeddings pool). The same step as `forward`, without the head."""
        x = self._residual(token_ids, meta, kv_cache)
        if self.rotation is not None:  # back from the basis the int8 products read
            x = self.kernels.rotate_rows(x, self.rotation.t().contiguous())
        return F.rms_norm(x, (self.config.hidden_size,), self.norm, self.config.rms_norm_eps)

    def _residual(self, token_ids: torch.Tensor, meta, kv_cache: KVCache) -> torch.Tensor:
        """The residual rows after the last layer: [rows, hidden] float32."""
        self.attention.check_step(meta, kv_cache, token_ids.shape[0])
        x = self.embed_rows(token_ids)  # [rows, hidden] residual, fp32
        if self.rotation is not None:  # into the basis the int8 products read
            x = self.kernels.rotate_rows(x, self.rotation)
        if self.driver is not None and isinstance(meta, CpuAttentionMetadata):
            rope = self.attention.rope
            self.driver.run(x, DriverStep(meta, rope.cos_half, rope.sin_half), kv_cache, self.dtype)
        else:
            self.run_layers(x, meta, kv_cache)
        return x

    def embed_rows(self, token_ids: torch.Tensor) -> torch.Tensor:
        """The embedded rows of token_ids ([rows] int64) as float32 [rows, hidden]."""
        if isinstance(self.embed, BlockEmbedding):
            x = self.embed(token_ids)
            if self.embed_scale is not None:  # as llama.cpp: in float32
                x = x * self.embed_scale.float()
            return x
        x = F.embedding(token_ids, self.embed)  # [rows, hidden]
        if self.embed_scale is not None:  # in the model dtype, as transformers
            x = x * self.embed_scale
        return x.float()  # the residual, fp32

    def run_layers(self, x: torch.Tensor, meta, kv_cache: KVCache) -> None:
        """Every layer on the residual rows x ([rows, hidden] float32, in place): the one
        layer loop."""
        eps, dtype = self.config.rms_norm_eps, self.dtype
        layers = self.layers
        if not layers:
            return
        h = layers[0].qkv.input.normed(x, None, layers[0].attn_norm, eps)
        for index, layer in enumerate(layers):
            qkv = layer.qkv.dense(layer.qkv.apply(h))  # [rows, q + 2 kv]
            if layer.qk_norm is not None:
                qkv = self._qk_norm(qkv, layer.qk_norm)
            attn = self.attention.forward(qkv.to(dtype), index, meta, kv_cache)  # [rows, q]
            y = layer.o.apply(layer.o.input.rows(attn))
            if layer.post_attn_norm is not None:  # x += rmsnorm(y) * w (Gemma)
                layer.gate_up.input.add_normed(x, y, layer.post_attn_norm, eps)
                y = None
            h = layer.gate_up.input.normed(x, y, layer.mlp_norm, eps)
            y = layer.down.apply(layer.down.input.gated(layer.gate_up.apply(h)))
            if layer.post_mlp_norm is not None:
                layer.down.input.add_normed(x, y, layer.post_mlp_norm, eps)
                y = None
            if index + 1 < len(layers):
                following = layers[index + 1]
                h = following.qkv.input.normed(x, y, following.attn_norm, eps)
            elif y is not None:
                add_residual(x, y)

    def _qk_norm(self, qkv: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """The per-head RMSNorm of q and k (qwen3, gemma3) on the q|k|v rows, before RoPE."""
        cfg = self.config
        heads = cfg.num_heads + cfg.num_kv_heads
        if self.kernels is not None and self.kernels.has("layer_ops") and qkv.is_contiguous():
            self.kernels.qk_norm(qkv, heads, cfg.head_dim, weight, cfg.rms_norm_eps)
            return qkv
        # qk: [rows, heads + kv_heads, head_dim]
        qk = qkv[:, : heads * cfg.head_dim].view(qkv.shape[0], heads, cfg.head_dim)
        normed = F.rms_norm(qk.float(), (cfg.head_dim,), None, cfg.rms_norm_eps) * weight
        qk.copy_(normed.to(qk.dtype))
        return qkv


def _qk_norm_rows(config: ModelConfig, need, prefix: str) -> torch.Tensor | None:
    """[heads + kv_heads, head_dim] float32: the q norm's row for every query head, then the k
    norm's for every KV head (None without q/k norms)."""
    if not config.qk_norm:
        return None
    qn = need(prefix + "self_attn.q_norm.weight").float()
    kn = need(prefix + "self_attn.k_norm.weight").float()
    return torch.cat(
        [qn.expand(config.num_heads, -1), kn.expand(config.num_kv_heads, -1)]
    ).contiguous()
