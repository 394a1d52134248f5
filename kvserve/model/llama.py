"""The Llama-family forward pass over a flat batch of rows (llama, qwen2, qwen3 as flags).

Weights are kept fused where it pays: q|k|v in one matrix, gate|up in one matrix, so a layer is
four matmuls. RoPE uses the half-rotation form (Hugging Face layout); GGUF checkpoints, which store
q/k rows permuted for interleaved rotation, are un-permuted by the loader.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvserve.model import native, native_q4
from kvserve.model.attention import AttentionMetadata, paged_attention
from kvserve.model.config import ModelConfig, require_tensor
from kvserve.model.kv_cache import KVCache
from kvserve.model.linear import Linear
from kvserve.model.quant import Int8Weight, Int8Weights, quantize_model
from kvserve.model.quant4 import Q4Weights

# A loader hands tensors over by Hugging Face name, already in HF layout ([out, in], un-permuted).
TensorSource = Callable[[str], torch.Tensor | None]

KV_INT8_REQUIREMENTS = (
    "--kv-cache-dtype int8 runs on the CPU kernels (needs a C compiler, a CPU with AVX512-VNNI, "
    "float32 or bfloat16, and head_dim 64 or 128)"
)
INT8_REQUIREMENTS = (
    "--quantization int8 runs on the CPU kernels (needs a C compiler, a CPU device, "
    "float32 or bfloat16, and head_dim 64 or 128)"
)
Q4_REQUIREMENTS = (
    "--quantization q4 runs on the CPU kernels (needs a C compiler, a CPU with AVX512-VNNI, "
    "float32 or bfloat16, head_dim 64 or 128, and a GGUF file whose layers are Q4_0/Q4_1)"
)

# Candidates per row whose logits are recomputed in float32 when the weights are bf16/fp16.
REFINE_TOP_K = 16


@dataclass(slots=True)
class LayerWeights:
    attn_norm: torch.Tensor  # [hidden], float32
    qkv: torch.Tensor  # [q + 2 kv, hidden]
    qkv_bias: torch.Tensor | None  # [q + 2 kv]
    qk_norm: torch.Tensor | None  # [heads + kv_heads, head_dim]: q_norm rows then k_norm rows
    o: torch.Tensor  # [hidden, q]
    mlp_norm: torch.Tensor  # [hidden], float32
    gate_up: torch.Tensor  # [2 intermediate, hidden]
    down: torch.Tensor  # [hidden, intermediate]


class LlamaModel:
    """A Llama-family decoder. Stateless apart from weights: the KV cache is passed in."""

    def __init__(
        self,
        config: ModelConfig,
        embed: torch.Tensor,
        layers: list[LayerWeights],
        norm: torch.Tensor,
        lm_head: torch.Tensor,
        quantization: str = "none",
        *,
        prepared: Int8Weights | Q4Weights | None = None,
        qk_norms: list[torch.Tensor | None] | None = None,
    ) -> None:
        """`prepared`: int8 weights prepared earlier (the weight cache) for quantization "int8",
        with `layers` empty and the layers' q/k norms in `qk_norms`; for "q4", the 4-bit
        weights (kvserve/model/quant4.py), which every "q4" model is built from."""
        self.config = config
        self.embed = embed  # [vocab, hidden]
        self.layers = layers
        self.norm = norm  # [hidden], float32
        self.lm_head = lm_head  # [vocab, hidden] (the same tensor as embed when tied)
        # Per layer: (q|k|v, o, gate|up, down) as prepared products. The int8 path replaces
        # them, so it skips their float packing (seconds for a 1B model).
        float_products = quantization == "none"
        self.projections = [
            (Linear(w.qkv, w.qkv_bias), Linear(w.o), Linear(w.gate_up), Linear(w.down))
            for w in (layers if float_products else [])
        ]
        self.head = Linear(lm_head) if float_products else None
        self.dtype = embed.dtype
        self.device = embed.device
        self.scale = config.head_dim**-0.5
        self.native = native.supports(
            self.device, self.dtype, config.num_heads, config.num_kv_heads, config.head_dim
        )
        # The fused C layer ops (norms, RoPE + cache write, SiLU); q/k norms, where the model
        # has them, run in torch between the qkv product and the RoPE + cache write kernel.
        self.fused = self.native
        self.qk_norms = [w.qk_norm for w in layers] if qk_norms is None else qk_norms
        self._build_rope_tables(config.max_position_embeddings)
        self.quantization = quantization
        self.int8: Int8Weights | None = None
        self.q4: Q4Weights | None = None
        if quantization == "int8":
            self._quantize_int8(prepared)
        elif quantization == "q4":
            if not isinstance(prepared, Q4Weights):
                raise ValueError("a q4 model is built from its 4-bit weights (quant4.prepare)")
            if not self.fused or not native_q4.q4_available():
                raise ValueError(Q4_REQUIREMENTS)
            self.q4 = prepared
        elif quantization != "none":
            raise ValueError(f"unknown quantization {quantization!r} (use none, int8 or q4)")

    @property
    def supports_int8_kv_cache(self) -> bool:
        """Whether this model can run on an int8 KV cache (the fused CPU path writes and reads
        it; kvserve/model/csrc/kv_int8.c)."""
        return self.fused and native.kv_int8_available()

    def _quantize_int8(self, prepared: Int8Weights | None = None) -> None:
        """Replace the linear layers by rotated int8 ones (kvserve/model/quant.py), or take
        `prepared` ones. The float layer weights are dropped."""
        if not self.fused:
            raise ValueError(INT8_REQUIREMENTS)
        if not hasattr(torch, "_int_mm"):
            raise ValueError("--quantization int8 needs torch._int_mm (torch >= 2.2)")
        self.int8 = prepared or quantize_model(self.config, self.layers, self.norm, self.lm_head)
        if self.config.qk_norm:
            self.int8.native_layers = None  # the one-call C driver has no q/k norm step
        self.layers = []
        self.projections = []
        self.head = None  # the int8 head picks candidates; self.lm_head recomputes them

    # -- construction -------------------------------------------------------------------------

    def prepared_tensors(self) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
        """Everything an int8 or q4 model is made of, for the weight cache: tensors by name
        (the tied lm_head once) and the integers that complete them. See `from_prepared`."""
        quantized = self.int8 or self.q4
        if quantized is None:
            raise ValueError("only int8 and q4 models have prepared weights to cache")
        tensors, numbers = quantized.to_tensors()
        tensors = {f"{self.quantization}.{name}": t for name, t in tensors.items()}
        tensors |= {"embed": self.embed, "norm": self.norm}
        if self.lm_head is not self.embed:
            tensors["lm_head"] = self.lm_head
        if self.int8 is not None:
            for index, qk_norm in enumerate(self.qk_norms):
                if qk_norm is not None:
                    tensors[f"qk_norm.{index}"] = qk_norm
        return tensors, numbers

    @classmethod
    def from_prepared(
        cls, config: ModelConfig, tensors: dict[str, torch.Tensor], numbers: dict[str, int]
    ) -> LlamaModel:
        """The int8 or q4 model `prepared_tensors` described, using the tensors where they lie
        (memory-mapped from the weight cache: nothing is rotated, quantized or packed)."""
        embed = tensors["embed"]
        lm_head = tensors.get("lm_head", embed)
        if any(name.startswith("q4.") for name in tensors):
            q4 = Q4Weights.from_tensors(
                {name[3:]: t for name, t in tensors.items() if name.startswith("q4.")},
                numbers,
                config,
            )
            qk_norms = [layer.qk_norm for layer in q4.layers]
            return cls(
                config, embed, [], tensors["norm"], lm_head, "q4", prepared=q4, qk_norms=qk_norms
            )
        prepared = Int8Weights.from_tensors(
            {name[5:]: t for name, t in tensors.items() if name.startswith("int8.")}, numbers
        )
        qk_norms = [tensors.get(f"qk_norm.{i}") for i in range(config.num_layers)]
        if config.qk_norm and any(n is None for n in qk_norms):
            raise KeyError("prepared weights lack the q/k norms")
        return cls(
            config,
            embed,
            [],
            tensors["norm"],
            lm_head,
            "int8",
            prepared=prepared,
            qk_norms=qk_norms,
        )

    @classmethod
    def from_q4(
        cls,
        config: ModelConfig,
        checkpoint,
        *,
        dtype: torch.dtype,
        progress: Callable[[int], None] | None = None,
    ) -> LlamaModel:
        """A model whose layers keep the 4-bit blocks of a GGUF checkpoint (kvserve/model/
        quant4.py; `quant4.unsupported` says whether it can). CPU only."""
        from kvserve.model import quant4

        def need(name: str) -> torch.Tensor:
            return require_tensor(checkpoint.get, name)

        embed = need("model.embed_tokens.weight").to(dtype).contiguous()
        if progress:
            progress(1)
        layers = quant4.load_layers(checkpoint, config, progress)
        norm = need("model.norm.weight").float().contiguous()
        head = None if config.tie_word_embeddings else checkpoint.get("lm_head.weight")
        lm_head = embed if head is None else head.to(dtype).contiguous()
        weights = quant4.prepare(config, layers, norm, lm_head)
        if progress:
            progress(1)
        return cls(
            config,
            embed,
            [],
            norm,
            lm_head,
            "q4",
            prepared=weights,
            qk_norms=[layer.qk_norm for layer in layers],
        )

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
    ) -> LlamaModel:
        """Build from tensors named as in Hugging Face checkpoints, fusing as it goes.

        `get(name)` returns a float tensor (any dtype, on CPU) or None when absent. Layers are
        fused and moved one at a time so peak memory stays near the size of one layer.
        """

        def need(name: str) -> torch.Tensor:
            return require_tensor(get, name)

        def place(tensor: torch.Tensor) -> torch.Tensor:
            return tensor.to(device=device, dtype=dtype).contiguous()

        def place_norm(tensor: torch.Tensor) -> torch.Tensor:
            # Norms act on the float32 residual stream.
            return tensor.to(device=device, dtype=torch.float32).contiguous()

        embed = place(need("model.embed_tokens.weight"))
        if progress:
            progress(1)
        layers = []
        for i in range(config.num_layers):
            p = f"model.layers.{i}."
            qkv = torch.cat(
                [need(p + f"self_attn.{n}_proj.weight").to(dtype) for n in ("q", "k", "v")]
            )
            bias = None
            if config.attention_bias:
                bias = place(
                    torch.cat([need(p + f"self_attn.{n}_proj.bias").float() for n in "qkv"])
                )
            qk_norm = None
            if config.qk_norm:
                qn = need(p + "self_attn.q_norm.weight").float()
                kn = need(p + "self_attn.k_norm.weight").float()
                qk_norm = place(
                    torch.cat([qn.expand(config.num_heads, -1), kn.expand(config.num_kv_heads, -1)])
                )
            gate_up = torch.cat(
                [need(p + f"mlp.{n}_proj.weight").to(dtype) for n in ("gate", "up")]
            )
            layers.append(
                LayerWeights(
                    attn_norm=place_norm(need(p + "input_layernorm.weight")),
                    qkv=place(qkv),
                    qkv_bias=bias,
                    qk_norm=qk_norm,
                    o=place(need(p + "self_attn.o_proj.weight")),
                    mlp_norm=place_norm(need(p + "post_attention_layernorm.weight")),
                    gate_up=place(gate_up),
                    down=place(need(p + "mlp.down_proj.weight")),
                )
            )
            if progress:
                progress(1)
        norm = place_norm(need("model.norm.weight"))
        head = None if config.tie_word_embeddings else get("lm_head.weight")
        lm_head = embed if head is None else place(head)
        if progress:
            progress(1)
        return cls(config, embed, layers, norm, lm_head, quantization)

    def _build_rope_tables(self, max_positions: int) -> None:
        inv = torch.tensor(self.config.inverse_frequencies(), dtype=torch.float32)
        angles = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv)
        cos, sin = angles.cos(), angles.sin()
        # Half rotation: x*cos + rotate_half(x)*sin, with rotate_half(x) = [-x2, x1]. Written as
        # x*cos + roll(x, half)*sin_signed where sin_signed = [-sin, sin]: one op fewer per layer.
        self.rope_cos = torch.cat([cos, cos], dim=-1).to(self.device, self.dtype)
        self.rope_sin = torch.cat([-sin, sin], dim=-1).to(self.device, self.dtype)
        # The fused kernel reads the half tables in float32: [max_positions, head_dim / 2].
        self.rope_cos_half = cos.contiguous()
        self.rope_sin_half = sin.contiguous()

    @property
    def num_bytes(self) -> int:
        quantized = self.int8 or self.q4
        if quantized is not None:
            tensors = [self.embed, self.norm] + (
                [] if self.lm_head is self.embed else [self.lm_head]
            )
            return quantized.num_bytes + sum(t.numel() * t.element_size() for t in tensors)
        tensors = [self.embed, self.norm]
        if self.lm_head is not self.embed:
            tensors.append(self.lm_head)
        for layer in self.layers:
            tensors += [t for t in vars_of(layer) if t is not None]
        return sum(t.numel() * t.element_size() for t in tensors)

    # -- forward ------------------------------------------------------------------------------

    @torch.inference_mode()
    def forward(
        self, token_ids: torch.Tensor, meta: AttentionMetadata, kv_cache: KVCache
    ) -> torch.Tensor:
        """Run one step. token_ids: [rows] long. Returns float32 logits
        `[len(meta.logits_indices), vocab]` for the rows that sample.

        The residual stream stays in float32 whatever the weights' dtype (as llama.cpp keeps
        its activations): only matmul inputs are cast down. With bf16 weights on a small model
        the difference decides greedy choices between near-tied tokens.
        """
        if kv_cache.quantized and not self.supports_int8_kv_cache:
            raise ValueError(KV_INT8_REQUIREMENTS)
        if self.native:
            # The C kernels trust the indices they are handed: check them once for the step.
            native.check_step_indices(
                meta,
                kv_cache.num_blocks,
                kv_cache.block_size,
                self.rope_cos_half.shape[0],
                token_ids.shape[0],
            )
        if self.int8 is not None:
            return self._forward_int8(token_ids, meta, kv_cache)
        if self.q4 is not None:
            return self._forward_q4(token_ids, meta, kv_cache)
        if self.fused and self.native:
            return self._forward_fused(token_ids, meta, kv_cache)
        cfg = self.config
        dtype = self.dtype
        hidden, eps = cfg.hidden_size, cfg.rms_norm_eps
        num_heads, num_kv_heads, head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        rows = token_ids.shape[0]
        qk_size = cfg.q_size + cfg.kv_size
        half = head_dim // 2
        # cos, sin: [rows, 1, head_dim]
        cos = self.rope_cos[meta.positions].unsqueeze(1)
        sin = self.rope_sin[meta.positions].unsqueeze(1)

        x = F.embedding(token_ids, self.embed).float()  # [rows, hidden] residual, fp32
        for index, layer in enumerate(self.layers):
            qkv_proj, o_proj, gate_up_proj, down_proj = self.projections[index]
            h = F.rms_norm(x, (hidden,), layer.attn_norm, eps).to(dtype)
            qkv = qkv_proj(h)  # [rows, q + 2 kv]
            qk = qkv[:, :qk_size].view(rows, num_heads + num_kv_heads, head_dim)
            if layer.qk_norm is not None:
                qk = F.rms_norm(qk, (head_dim,), None, eps) * layer.qk_norm
            qk = torch.addcmul(qk * cos, qk.roll(half, dims=-1), sin)
            v = qkv[:, qk_size:].view(rows, num_kv_heads, head_dim)
            attn = paged_attention(
                qk[:, :num_heads],
                qk[:, num_heads:],
                v,
                kv_cache.layer(index),
                meta,
                self.scale,
                self.native,
            )
            x.add_(o_proj(attn))
            h = F.rms_norm(x, (hidden,), layer.mlp_norm, eps).to(dtype)
            gate, up = gate_up_proj(h).chunk(2, dim=-1)
            x.add_(down_proj(F.silu(gate) * up))

        x = F.rms_norm(x[meta.logits_indices], (hidden,), self.norm, eps)
        return self.logits(x)

    def hidden_states(
        self, token_ids: torch.Tensor, meta: AttentionMetadata, kv_cache: KVCache
    ) -> torch.Tensor:
        """The final norm's output of every row: [rows, hidden] float32 (what embeddings
        pool). `forward` on every path, with its last step swapped: where the logits would be
        computed, the normalized rows are returned. `meta.logits_indices` is set to all rows."""
        eps, hidden = self.config.rms_norm_eps, (self.config.hidden_size,)
        headless = copy.copy(self)  # shares every weight; only the two head steps differ
        headless.logits = lambda x: x  # x: [rows, hidden], already normalized
        headless._quantized_logits = lambda x, head, unrotated: F.rms_norm(
            unrotated, hidden, self.norm, eps
        )
        meta.logits_indices = torch.arange(token_ids.shape[0], device=self.device)
        return headless.forward(token_ids, meta, kv_cache)

    def _forward_fused(
        self, token_ids: torch.Tensor, meta: AttentionMetadata, kv_cache: KVCache
    ) -> torch.Tensor:
        """The same computation as `forward` with the elementwise work in C kernels: a layer is
        four matmuls, attention, and four kernel calls (norm, RoPE + cache write, norm, SiLU)."""
        cfg = self.config
        dtype, eps = self.dtype, cfg.rms_norm_eps
        layers = self.layers

        x = F.embedding(token_ids, self.embed).float()  # [rows, hidden] residual, fp32
        h = native.add_rmsnorm(x, None, layers[0].attn_norm, eps, dtype)
        for index, layer in enumerate(layers):
            qkv_proj, o_proj, gate_up_proj, down_proj = self.projections[index]
            qkv = qkv_proj(h)  # [rows, q + 2 kv]
            attn = self._attend_native(qkv, index, meta, kv_cache)
            h = native.add_rmsnorm(x, o_proj(attn), layer.mlp_norm, eps, dtype)
            down = down_proj(native.silu_mul(gate_up_proj(h)))
            if index + 1 < len(layers):
                h = native.add_rmsnorm(x, down, layers[index + 1].attn_norm, eps, dtype)
            else:
                x.add_(down)

        x = F.rms_norm(x[meta.logits_indices], (cfg.hidden_size,), self.norm, eps)
        return self.logits(x)

    def _attend_native(
        self, qkv: torch.Tensor, index: int, meta: AttentionMetadata, kv_cache: KVCache
    ) -> torch.Tensor:
        """Layer `index` of the fused paths: rotate q and k of `qkv` ([rows, q + 2 kv] in the
        model dtype) in place, write k and v into the cache, attend. Returns [rows, q]."""
        cfg = self.config
        rows, heads, kv_heads, head_dim = (
            qkv.shape[0],
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
        )
        q_size, qk_size = cfg.q_size, cfg.q_size + cfg.kv_size
        kv_layer, kv_scales = kv_cache.layer(index), kv_cache.layer_scales(index)
        qk_norm = self.qk_norms[index]
        if qk_norm is not None:
            # qk: [rows, heads + kv_heads, head_dim], normalized per head before RoPE
            qk = qkv[:, :qk_size].view(rows, heads + kv_heads, head_dim)
            qk.copy_(F.rms_norm(qk.float(), (head_dim,), None, cfg.rms_norm_eps) * qk_norm)
        native.rope_store(
            qkv,
            meta.positions,
            self.rope_cos_half,
            self.rope_sin_half,
            meta.slot_mapping,
            kv_layer,
            heads,
            kv_heads,
            head_dim,
            kv_scales,
        )
        return paged_attention(
            qkv[:, :q_size].view(rows, heads, head_dim),
            qkv[:, q_size:qk_size].view(rows, kv_heads, head_dim),
            qkv[:, qk_size:].view(rows, kv_heads, head_dim),
            kv_layer,
            meta,
            self.scale,
            native=True,
            store=False,
            kv_scales=kv_scales,
        )

    def _forward_int8(
        self, token_ids: torch.Tensor, meta: AttentionMetadata, kv_cache: KVCache
    ) -> torch.Tensor:
        """The fused path with int8 linear layers (kvserve/model/quant.py): each product takes
        int8 rows with their scales and gives int32, which the next kernel dequantizes."""
        cfg = self.config
        dtype, eps = self.dtype, cfg.rms_norm_eps
        num_heads, num_kv_heads, head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        rows, q_size = token_ids.shape[0], cfg.q_size
        weights = self.int8
        last = len(weights.layers) - 1

        # [rows, hidden] residual, fp32, in the rotated basis
        x = native.rotate_rows(F.embedding(token_ids, self.embed).float(), weights.rotation)
        if weights.native_layers is not None:
            native.forward_int8(
                x,
                weights.native_layers,
                kv_cache.kv,
                kv_cache.scales,
                heads=num_heads,
                kv_heads=num_kv_heads,
                head_dim=head_dim,
                intermediate=cfg.intermediate_size,
                down_block=weights.down_block,
                eps=eps,
                scale=self.scale,
                dtype=dtype,
                **self._driver_step(meta),
            )
            return self._int8_logits(x[meta.logits_indices])
        q, s = native.add_rmsnorm_q8(x, None, None, None, eps)
        for index, layer in enumerate(weights.layers):
            qkv = native.dequantize(layer.qkv.matmul(q), s, layer.qkv.scale, layer.qkv.bias, dtype)
            attn = self._attend_native(qkv, index, meta, kv_cache)
            q, s = native.quantize_rows(attn.view(rows, q_size))
            q, s = native.add_rmsnorm_q8(x, layer.o.matmul(q), s, layer.o.scale, eps)
            q, s = native.silu_mul_q8(
                layer.gate_up.matmul(q), s, layer.gate_up.scale, weights.down_block
            )
            acc = layer.down.matmul(q)
            if index < last:
                q, s = native.add_rmsnorm_q8(x, acc, s, layer.down.scale, eps)
            else:
                native.add_rmsnorm_q8(x, acc, s, layer.down.scale, eps, normalize=False)

        return self._int8_logits(x[meta.logits_indices])

    def _driver_step(self, meta: AttentionMetadata) -> dict[str, torch.Tensor]:
        """What the one-call layer drivers read of a step: positions and RoPE tables, cache
        slots and block tables, each row's table and length."""
        return {
            "positions": meta.positions,
            "cos_half": self.rope_cos_half,
            "sin_half": self.rope_sin_half,
            "slots": meta.slot_mapping,
            "tables": meta.chunk_tables,
            "row_tables": meta.row_tables,
            "lengths": meta.row_lengths,
        }

    def _forward_q4(
        self, token_ids: torch.Tensor, meta: AttentionMetadata, kv_cache: KVCache
    ) -> torch.Tensor:
        """The fused path with the weights in their 4-bit blocks (kvserve/model/quant4.py):
        every layer in one call to the C driver (kvserve/model/csrc/forward_q4.c)."""
        x = F.embedding(token_ids, self.embed).float()  # [rows, hidden] residual, fp32
        native_q4.forward_q4(
            x,
            self.q4.native_layers,
            kv_cache.kv,
            kv_cache.scales,
            config=self.config,
            scale=self.scale,
            dtype=self.dtype,
            **self._driver_step(meta),
        )
        x = x[meta.logits_indices]
        return self._quantized_logits(
            native.rotate_rows(x, self.q4.rotation), self.q4.head, unrotated=x
        )

    def _int8_logits(self, x: torch.Tensor) -> torch.Tensor:
        """float32 logits of the rows x ([rows, hidden] float32, the rotated residual after the
        last layer)."""
        return self._quantized_logits(x, self.int8.head, native.rotate_rows(x, self.int8.inverse))

    def _quantized_logits(
        self, x: torch.Tensor, head: Int8Weight, unrotated: torch.Tensor
    ) -> torch.Tensor:
        """float32 logits of the rows x ([rows, hidden] float32, the residual after the last
        layer in the head's rotated basis; `unrotated`: the same rows in the model's basis): the
        int8 lm_head (final norm folded in) picks each row's candidates, recomputed exactly."""
        eps = self.config.rms_norm_eps
        if x.shape[0] == 0:  # a step whose chunks all continue a prompt samples nothing
            return x.new_empty(0, self.config.vocab_size)
        q, s = native.add_rmsnorm_q8(x, None, None, None, eps)
        logits = native.dequantize(head.matmul(q), s, head.scale, None, torch.float32)
        # The best candidates of each row, exactly, from the rows in the model's basis
        x = F.rms_norm(unrotated, (self.config.hidden_size,), self.norm, eps)
        return self._refine(logits, x)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """float32 logits of normalized hidden states x: [rows, hidden] (float32).

        With low-precision weights the full-vocabulary product is rounded to that precision
        (bf16 keeps 8 bits: steps of 0.125 around logit 20), so the few best candidates of each
        row are recomputed exactly in float32. Greedy choices and the head of the distribution
        are then as exact as the weights allow, for the cost of a [rows, k] product.
        """
        if x.shape[0] == 0:  # a step whose chunks all continue a prompt samples nothing
            return x.new_empty(0, self.config.vocab_size, dtype=torch.float32)
        if self.dtype == torch.float32:
            return F.linear(x, self.lm_head) if self.head is None else self.head(x)
        return self._refine(self.head(x.to(self.dtype)).float(), x)

    def _refine(self, logits: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Recompute each row's REFINE_TOP_K best logits exactly: x [rows, hidden] float32 are
        the normalized hidden states the final norm gives (its weight applied)."""
        if self.native and logits.is_contiguous():
            top = native.topk_rows(logits, REFINE_TOP_K)  # [rows, k]
        else:
            top = logits.topk(REFINE_TOP_K, dim=-1).indices
        exact = torch.bmm(self.lm_head[top].float(), x.unsqueeze(-1)).squeeze(-1)
        return logits.scatter_(1, top, exact)


def vars_of(layer: LayerWeights) -> list[torch.Tensor | None]:
    return [getattr(layer, name) for name in LayerWeights.__slots__]
