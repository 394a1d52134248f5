"""Synthetic Llama-family checkpoints for benchmarks and tests: random weights, a real tokenizer.

`LLAMA_1B_SHAPED` has Llama-3.2-1B's shape (hidden 2048, 16 layers, 32 heads, 8 KV heads, FFN
8192, tied embeddings, RoPE theta 500000) with the default model's tokenizer (SmolLM2's 49,152
tokens, copied from its GGUF), so the cost of a 1B model can be measured without downloading
one. `TINY` is the same family in a few layers, small enough for tests.

The float weights are drawn once per tensor from a seeded normal (std 0.02: activations stay
near unit scale through the layers) and written by the `gguf` package quantized to each asked
type, so the Q4_0 and Q8_0 files of one spec are the same model rounded two ways. Files are
generated on demand into the user's cache directory (`<cache>/bench/`, see
kvserve.model.paths.user_cache_dir), written under a temporary name and renamed when complete,
and reused while the spec and this generator are unchanged (both are in the file name).

    python -m kvserve.bench.big_model            # the 1B-shaped Q8_0 and Q4_0 files
    python -m kvserve.bench.big_model --tiny --dir /tmp/models
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import quantize

from kvserve.model.paths import default_model_path, user_cache_dir

# Bumped when the files this module writes change for the same spec.
GENERATOR_VERSION = 1
QUANT_TYPES = ("Q8_0", "Q4_0")


@dataclass(frozen=True, slots=True)
class SyntheticSpec:
    """The shape of a synthetic Llama checkpoint (tied embeddings, the default tokenizer)."""

    name: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    context_length: int = 8192
    rope_theta: float = 500000.0
    std: float = 0.02
    seed: int = 0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def digest(self) -> str:
        text = json.dumps(asdict(self) | {"generator": GENERATOR_VERSION}, sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:10]


LLAMA_1B_SHAPED = SyntheticSpec(
    name="llama-1b-shaped",
    hidden_size=2048,
    num_layers=16,
    num_heads=32,
    num_kv_heads=8,
    intermediate_size=8192,
)
TINY = SyntheticSpec(
    name="llama-tiny",
    hidden_size=128,
    num_layers=2,
    num_heads=2,
    num_kv_heads=1,
    intermediate_size=256,
    context_length=2048,
)


def bench_model_dir() -> Path:
    """Where generated checkpoints live: `<user cache dir>/bench`."""
    return user_cache_dir() / "bench"


def model_file(spec: SyntheticSpec, quant_type: str, directory: Path | None = None) -> Path:
    """The path of `spec` quantized to `quant_type` (generated or not)."""
    return (directory or bench_model_dir()) / f"{spec.name}-{spec.digest()}-{quant_type}.gguf"


def _tensor_shapes(spec: SyntheticSpec) -> list[tuple[str, tuple[int, ...]]]:
    """GGUF tensor names and numpy shapes ([out, in] for matrices), in file order."""
    hidden, kv = spec.hidden_size, spec.num_kv_heads * spec.head_dim
    shapes: list[tuple[str, tuple[int, ...]]] = [("token_embd.weight", (-1, hidden))]
    for i in range(spec.num_layers):
        p = f"blk.{i}."
        shapes += [
            (p + "attn_norm.weight", (hidden,)),
            (p + "attn_q.weight", (hidden, hidden)),
            (p + "attn_k.weight", (kv, hidden)),
            (p + "attn_v.weight", (kv, hidden)),
            (p + "attn_output.weight", (hidden, hidden)),
            (p + "ffn_norm.weight", (hidden,)),
            (p + "ffn_gate.weight", (spec.intermediate_size, hidden)),
            (p + "ffn_up.weight", (spec.intermediate_size, hidden)),
            (p + "ffn_down.weight", (hidden, spec.intermediate_size)),
        ]
    shapes.append(("output_norm.weight", (hidden,)))
    return shapes


def _copy_tokenizer(writer: GGUFWriter, reader: GGUFReader) -> int:
    """Copy every `tokenizer.*` field of the default model; returns its vocabulary size."""
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        vtype = field.types[0]
        sub_type = field.types[-1] if vtype == GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), vtype, sub_type)
    return len(reader.fields["tokenizer.ggml.tokens"].data)


def _write_metadata(writer: GGUFWriter, spec: SyntheticSpec, vocab: int, quant_type: str) -> None:
    writer.add_name(f"{spec.name} (synthetic, random weights)")
    writer.add_block_count(spec.num_layers)
    writer.add_context_length(spec.context_length)
    writer.add_embedding_length(spec.hidden_size)
    writer.add_feed_forward_length(spec.intermediate_size)
    writer.add_head_count(spec.num_heads)
    writer.add_head_count_kv(spec.num_kv_heads)
    writer.add_rope_freq_base(spec.rope_theta)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(spec.head_dim)
    writer.add_vocab_size(vocab)
    writer.add_file_type({"Q8_0": 7, "Q4_0": 2}[quant_type])  # llama.cpp's LLAMA_FTYPE values
    writer.add_quantization_version(2)


def _random_tensor(spec: SyntheticSpec, index: int, shape: tuple[int, ...]) -> np.ndarray:
    rng = np.random.default_rng([spec.seed, index])
    if len(shape) == 1:  # norm weights: near 1, as trained models have them
        return (1.0 + 0.1 * rng.standard_normal(shape, dtype=np.float32)).astype(np.float32)
    return rng.standard_normal(shape, dtype=np.float32) * np.float32(spec.std)


def generate(
    spec: SyntheticSpec,
    quant_types: Sequence[str] = QUANT_TYPES,
    directory: Path | None = None,
    *,
    progress: bool = False,
) -> dict[str, Path]:
    """Write `spec` in each of `quant_types` (Q8_0, Q4_0) unless already there; returns the
    paths by type. Each tensor is drawn once and quantized to every type being written, so peak
    memory is about one tensor plus the writers' buffers, not the model."""
    paths = {q: model_file(spec, q, directory) for q in quant_types}
    missing = [q for q, path in paths.items() if not path.exists()]
    if not missing:
        return paths
    target_dir = next(iter(paths.values())).parent
    target_dir.mkdir(parents=True, exist_ok=True)
    reader = GGUFReader(default_model_path())
    shapes = _tensor_shapes(spec)
    vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    shapes[0] = ("token_embd.weight", (vocab, spec.hidden_size))
    writers: dict[str, tuple[GGUFWriter, Path]] = {}
    try:
        for quant_type in missing:
            handle, tmp = tempfile.mkstemp(dir=target_dir, suffix=".gguf.tmp")
            os.close(handle)
            writer = GGUFWriter(tmp, "llama")
            _copy_tokenizer(writer, reader)
            _write_metadata(writer, spec, vocab, quant_type)
            qtype = GGMLQuantizationType[quant_type]
            for name, shape in shapes:
                if len(shape) == 1:
                    writer.add_tensor_info(name, shape, np.dtype(np.float32), shape[0] * 4)
                else:
                    nbytes = _quantized_nbytes(shape, qtype)
                    byte_shape = (shape[0], nbytes // shape[0])
                    writer.add_tensor_info(name, byte_shape, np.dtype(np.uint8), nbytes, qtype)
            writer.write_header_to_file()
            writer.write_kv_data_to_file()
            writer.write_ti_data_to_file()
            writers[quant_type] = (writer, Path(tmp))
        for index, (name, shape) in enumerate(shapes):
            if progress:
                print(f"\r  {name:<28}", end="", flush=True)
            weights = _random_tensor(spec, index, shape)
            for quant_type, (writer, _) in writers.items():
                if len(shape) == 1:
                    writer.write_tensor_data(weights)
                else:
                    writer.write_tensor_data(quantize(weights, GGMLQuantizationType[quant_type]))
        if progress:
            print()
        for quant_type, (writer, tmp) in writers.items():
            writer.close()
            os.replace(tmp, paths[quant_type])  # atomic: a reader never sees a partial file
    finally:
        for _, tmp in writers.values():
            tmp.unlink(missing_ok=True)
    return paths


def _quantized_nbytes(shape: tuple[int, ...], qtype: GGMLQuantizationType) -> int:
    from gguf.constants import GGML_QUANT_SIZES

    block, type_size = GGML_QUANT_SIZES[qtype]
    rows, cols = shape
    if cols % block:
        raise ValueError(f"{qtype.name} needs rows a multiple of {block} wide, not {cols}")
    return rows * cols // block * type_size


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="the tiny spec (tests)")
    parser.add_argument("--dir", default=None, help="output directory (default: the cache)")
    parser.add_argument("--types", default=",".join(QUANT_TYPES))
    args = parser.parse_args(argv)
    spec = TINY if args.tiny else LLAMA_1B_SHAPED
    directory = Path(args.dir) if args.dir else None
    for quant_type, path in generate(spec, args.types.split(","), directory, progress=True).items():
        print(f"{quant_type}: {path} ({path.stat().st_size / 2**20:.0f} MiB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
