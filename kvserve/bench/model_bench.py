"""Model benchmark: the forward pass alone (no scheduler, no HTTP).

Prefill tok/s for one 512-token prompt, and decode tok/s at 1, 8, 32 and 64 rows, each row a
separate sequence with its own block table and ~128 positions of context. Beside ours, the same
measurements on transformers (a LlamaForCausalLM holding the same dequantized weights in the same
dtype), taken in the same run so the ratio is what the run shows.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch

from kvserve.model import device_thread
from kvserve.model.kv_cache import KVCache
from kvserve.model.loader import LoadedModel


@dataclass(frozen=True, slots=True)
class _Chunk:
    start: int
    num_tokens: int
    block_ids: tuple[int, ...]
    samples: bool


@dataclass
class ModelBenchResult:
    dtype: str
    threads: int
    prefill_tokens: int
    prefill_tok_s: float
    decode_tok_s: dict[int, float]  # rows -> tok/s
    reference_prefill_tok_s: float | None = None
    reference_decode_tok_s: dict[int, float] | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def best_seconds(fn, repeats: int) -> float:
    """Best-of-`repeats` seconds for one call, after one warm-up call (which builds kernels and
    grows working memory); the benchmarks of kvserve/bench share it."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - started)
    return best


def measure_ours(
    loaded: LoadedModel,
    *,
    prefill_tokens: int = 512,
    rows: tuple[int, ...] = (1, 8, 32, 64),
    context: int = 128,
    repeats: int = 5,
    cache_dtype: torch.dtype | None = None,
) -> tuple[float, dict[int, float]]:
    model = loaded.model
    device = model.device
    block_size = 32
    blocks_per_seq = -(-(context + 1) // block_size)
    num_blocks = max(max(rows) * blocks_per_seq, -(-prefill_tokens // block_size)) + 1
    cache = KVCache(model.config, num_blocks, block_size, cache_dtype or model.dtype, device)
    generator = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size

    ids = torch.randint(0, vocab, (prefill_tokens,), generator=generator).to(device)
    table = tuple(range(-(-prefill_tokens // block_size)))
    meta = model.attention.build_metadata([_Chunk(0, prefill_tokens, table, True)], block_size)
    prefill = prefill_tokens / best_seconds(lambda: _sync(model.forward(ids, meta, cache)), repeats)

    decode: dict[int, float] = {}
    for num_rows in rows:
        chunks = [
            _Chunk(context, 1, tuple(range(r * blocks_per_seq, (r + 1) * blocks_per_seq)), True)
            for r in range(num_rows)
        ]
        meta = model.attention.build_metadata(chunks, block_size)
        ids = torch.randint(0, vocab, (num_rows,), generator=generator).to(device)
        seconds = best_seconds(lambda m=meta, i=ids: _sync(model.forward(i, m, cache)), repeats)
        decode[num_rows] = num_rows / seconds
    return prefill, decode


def _sync(result):
    if isinstance(result, torch.Tensor) and result.is_cuda:
        torch.cuda.synchronize()
    return result


def reference_model(loaded: LoadedModel):
    """transformers' LlamaForCausalLM with our dequantized weights, in our dtype."""
    import transformers

    from kvserve.model.gguf import GGUFCheckpoint
    from kvserve.model.safetensors import SafetensorsCheckpoint

    cfg = loaded.config
    hf_config = transformers.LlamaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        rms_norm_eps=cfg.rms_norm_eps,
        rope_theta=cfg.rope_theta,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=cfg.tie_word_embeddings,
    )
    model = transformers.LlamaForCausalLM(hf_config)
    source = (
        SafetensorsCheckpoint(loaded.path) if loaded.path.is_dir() else GGUFCheckpoint(loaded.path)
    )
    state = {}
    for name in model.state_dict():
        tensor = source.get(name)
        if tensor is not None:
            state[name] = tensor
    model.load_state_dict(state, strict=False)
    if cfg.tie_word_embeddings:
        model.tie_weights()
    return model.to(dtype=loaded.dtype, device=loaded.device).eval()


@torch.inference_mode()
def measure_reference(
    model,
    vocab: int,
    *,
    prefill_tokens: int = 512,
    rows: tuple[int, ...] = (1, 8, 32, 64),
    context: int = 128,
    new_tokens: int = 16,
) -> tuple[float, dict[int, float]]:
    """Prefill tok/s of one forward, and decode tok/s of `generate` with a static batch: the
    time of `new_tokens` steps minus the time of one (prefill + first token)."""
    generator = torch.Generator().manual_seed(0)
    device = next(model.parameters()).device
    ids = torch.randint(0, vocab, (1, prefill_tokens), generator=generator).to(device)
    prefill = prefill_tokens / best_seconds(lambda: model(ids), 2)
    decode: dict[int, float] = {}
    for num_rows in rows:
        batch = torch.randint(0, vocab, (num_rows, context), generator=generator).to(device)
        mask = torch.ones_like(batch)

        def run(n: int, b=batch, m=mask):
            return model.generate(
                b,
                attention_mask=m,
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                pad_token_id=0,
            )

        first = best_seconds(lambda: run(1), 1)
        full = best_seconds(lambda: run(new_tokens), 1)
        decode[num_rows] = num_rows * (new_tokens - 1) / max(full - first, 1e-9)
    return prefill, decode


def run_model_bench(
    loaded: LoadedModel, *, with_reference: bool = True, cache_dtype: torch.dtype | None = None
) -> ModelBenchResult:
    prefill, decode = device_thread.call(measure_ours, loaded, cache_dtype=cache_dtype)
    result = ModelBenchResult(
        dtype=str(loaded.dtype).removeprefix("torch."),
        threads=torch.get_num_threads(),
        prefill_tokens=512,
        prefill_tok_s=prefill,
        decode_tok_s=decode,
    )
    if with_reference:
        reference = device_thread.call(reference_model, loaded)
        ref_prefill, ref_decode = device_thread.call(
            measure_reference, reference, loaded.config.vocab_size
        )
        result.reference_prefill_tok_s = ref_prefill
        result.reference_decode_tok_s = ref_decode
        del reference
    return result


def format_model_table(result: ModelBenchResult) -> str:
    lines = [
        "| measurement | kvserve tok/s | transformers tok/s | ratio |",
        "| --- | ---: | ---: | ---: |",
    ]

    def row(label: str, ours: float, theirs: float | None) -> None:
        if theirs:
            lines.append(f"| {label} | {ours:.0f} | {theirs:.0f} | {ours / theirs:.2f}x |")
        else:
            lines.append(f"| {label} | {ours:.0f} | — | — |")

    row(
        f"prefill, one {result.prefill_tokens}-token prompt",
        result.prefill_tok_s,
        result.reference_prefill_tok_s,
    )
    for rows, tok_s in result.decode_tok_s.items():
        theirs = (result.reference_decode_tok_s or {}).get(rows)
        row(f"decode, {rows} rows x ~128 context", tok_s, theirs)
    return "\n".join(lines)
