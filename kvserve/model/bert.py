"""BERT-family sentence embedders from a Hugging Face directory (sentence-transformers layout).

The directory holds `config.json` (a `bert` model), `model.safetensors`, `tokenizer.json`, and
the sentence-transformers files that say how a sentence becomes one vector: `modules.json`
(whether a `Normalize` module follows the pooling), `1_Pooling/config.json` (mean, CLS, max,
mean-sqrt-len or last-token pooling) and `sentence_bert_config.json` (`max_seq_length`, the
longest input it was trained on). Without them the defaults are sentence-transformers' own:
mean pooling, no normalization, the model's position count.

The encoder is BERT's: word + absolute position + token-type embeddings and a LayerNorm, then
per layer bidirectional self-attention and a GELU feed-forward block, each followed by its
residual add and LayerNorm (post-norm). A batch of inputs of different lengths runs in groups
of similar length, padded inside each group and masked, so little work goes to padding.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from kvserve.model.config import UnsupportedModelError, require_tensor

__all__ = [
    "POOLING_MODES",
    "BertConfig",
    "BertEncoder",
    "EncoderTokenizer",
    "LoadedEncoder",
    "is_encoder_dir",
    "load_encoder",
]

POOLING_MODES = ("mean", "cls", "max", "mean_sqrt_len", "last")
"""How token vectors become the sentence's vector (sentence-transformers' pooling modes)."""

ENCODER_TYPES = ("bert",)
"""`config.json` model types served as encoders."""

_ACTIVATIONS = {
    "gelu": lambda x: F.gelu(x),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}

# Padded positions a group of inputs may waste before it is split (a fraction of its tokens).
_MAX_PADDING = 0.25
# Tokens (padded) in one group: bounds the attention scores' memory ([group, heads, L, L]).
_GROUP_TOKENS = 8192


@dataclass(frozen=True, slots=True)
class BertConfig:
    """The shape of a BERT encoder and how its output becomes a sentence vector."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    max_position_embeddings: int
    type_vocab_size: int
    layer_norm_eps: float
    hidden_act: str
    pooling: str = "mean"
    normalize: bool = False
    max_seq_length: int | None = None
    architecture: str = "bert"
    name: str = ""

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def num_kv_heads(self) -> int:
        return self.num_heads

    @property
    def max_input_tokens(self) -> int:
        """The longest input, special tokens included."""
        limit = self.max_seq_length or self.max_position_embeddings
        return min(limit, self.max_position_embeddings)

    def num_parameters(self) -> int:
        h, i = self.hidden_size, self.intermediate_size
        embed = (self.vocab_size + self.max_position_embeddings + self.type_vocab_size) * h + 2 * h
        per_layer = 4 * (h * h + h) + 2 * h * i + i + h + 4 * h
        return embed + self.num_layers * per_layer

    @classmethod
    def from_dir(cls, path: Path) -> BertConfig:
        raw = json.loads((path / "config.json").read_text())
        if raw.get("model_type") not in ENCODER_TYPES:
            raise UnsupportedModelError(
                f"{path}: model type {raw.get('model_type')!r} is not a supported encoder "
                f"(supported: {', '.join(ENCODER_TYPES)})"
            )
        if raw.get("position_embedding_type", "absolute") != "absolute":
            raise UnsupportedModelError(
                f"{path}: position embeddings {raw['position_embedding_type']!r} are not "
                "supported (absolute only)"
            )
        act = raw.get("hidden_act", "gelu")
        if act not in _ACTIVATIONS:
            raise UnsupportedModelError(f"{path}: activation {act!r} is not supported")
        pooling, normalize = _sentence_transformers_head(path)
        max_seq = None
        bert_config = path / "sentence_bert_config.json"
        if bert_config.exists():
            max_seq = json.loads(bert_config.read_text()).get("max_seq_length")
        hidden = int(raw["hidden_size"])
        heads = int(raw["num_attention_heads"])
        if hidden % heads:
            raise UnsupportedModelError(f"{path}: hidden size {hidden} is not split by {heads}")
        return cls(
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=heads,
            max_position_embeddings=int(raw.get("max_position_embeddings", 512)),
            type_vocab_size=int(raw.get("type_vocab_size", 2)),
            layer_norm_eps=float(raw.get("layer_norm_eps", 1e-12)),
            hidden_act=act,
            pooling=pooling,
            normalize=normalize,
            max_seq_length=int(max_seq) if max_seq else None,
            name=str(raw.get("_name_or_path", "")),
        )


def _sentence_transformers_head(path: Path) -> tuple[str, bool]:
    """(pooling mode, normalize) from modules.json and the pooling module's config."""
    modules_file = path / "modules.json"
    if not modules_file.exists():
        return "mean", False
    modules = json.loads(modules_file.read_text())
    normalize = any(str(m.get("type", "")).endswith(".Normalize") for m in modules)
    pooling_dir = next(
        (m.get("path", "") for m in modules if str(m.get("type", "")).endswith(".Pooling")), None
    )
    if pooling_dir is None:
        return "mean", normalize
    config_file = path / pooling_dir / "config.json"
    if not config_file.exists():
        return "mean", normalize
    pooling = json.loads(config_file.read_text())
    if pooling.get("pooling_mode"):  # newer sentence-transformers name the mode
        mode = {"lasttoken": "last", "mean_sqrt_len_tokens": "mean_sqrt_len"}.get(
            pooling["pooling_mode"], pooling["pooling_mode"]
        )
        if mode not in POOLING_MODES:
            raise UnsupportedModelError(f"{path}: pooling {mode!r} is not supported")
        return mode, normalize
    for key, mode in (
        ("pooling_mode_cls_token", "cls"),
        ("pooling_mode_max_tokens", "max"),
        ("pooling_mode_mean_sqrt_len_tokens", "mean_sqrt_len"),
        ("pooling_mode_lasttoken", "last"),
        ("pooling_mode_mean_tokens", "mean"),
    ):
        if pooling.get(key):
            return mode, normalize
    raise UnsupportedModelError(f"{path}: the pooling config names no mode kvserve supports")


def is_encoder_dir(path: Path) -> bool:
    """Whether `path` is a model directory whose config.json is an encoder kvserve serves."""
    config = path / "config.json"
    if not path.is_dir() or not config.exists():
        return False
    try:
        return json.loads(config.read_text()).get("model_type") in ENCODER_TYPES
    except (OSError, ValueError):
        return False


def pool(hidden: torch.Tensor, mask: torch.Tensor, mode: str) -> torch.Tensor:
    """Sentence vectors from token vectors. hidden: [batch, L, dim] float32; mask: [batch, L]
    bool (True at real tokens, each row's real tokens first). Returns [batch, dim]."""
    if mode == "cls":
        return hidden[:, 0]
    lengths = mask.sum(dim=1)  # [batch]
    if mode == "last":
        return hidden[torch.arange(hidden.shape[0]), lengths - 1]
    if mode == "max":
        return hidden.masked_fill(~mask.unsqueeze(-1), float("-inf")).amax(dim=1)
    summed = (hidden * mask.unsqueeze(-1)).sum(dim=1)  # [batch, dim]
    if mode == "mean_sqrt_len":
        return summed / lengths.unsqueeze(-1).float().sqrt()
    return summed / lengths.unsqueeze(-1).float()


@dataclass(slots=True)
class _Layer:
    qkv: torch.Tensor  # [3 hidden, hidden]: query rows, then key, then value
    qkv_bias: torch.Tensor  # [3 hidden]
    out: torch.Tensor  # [hidden, hidden]
    out_bias: torch.Tensor
    attn_norm: tuple[torch.Tensor, torch.Tensor]  # LayerNorm weight, bias: [hidden] each
    up: torch.Tensor  # [intermediate, hidden]
    up_bias: torch.Tensor
    down: torch.Tensor  # [hidden, intermediate]
    down_bias: torch.Tensor
    mlp_norm: tuple[torch.Tensor, torch.Tensor]


class BertEncoder:
    """A BERT encoder and its sentence head. Stateless apart from weights; call `embed` on the
    device thread."""

    def __init__(
        self,
        config: BertConfig,
        embeddings: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        embed_norm: tuple[torch.Tensor, torch.Tensor],
        layers: list[_Layer],
    ) -> None:
        self.config = config
        self.word, self.position, self.token_type = embeddings
        self.embed_norm = embed_norm
        self.layers = layers
        self.dtype = self.word.dtype
        self.device = self.word.device
        self._act = _ACTIVATIONS[config.hidden_act]

    @property
    def dimensions(self) -> int:
        return self.config.hidden_size

    @property
    def num_bytes(self) -> int:
        tensors = [self.word, self.position, self.token_type, *self.embed_norm]
        for layer in self.layers:
            tensors += [getattr(layer, name) for name in ("qkv", "qkv_bias", "out", "out_bias")]
            tensors += [layer.up, layer.up_bias, layer.down, layer.down_bias]
            tensors += [*layer.attn_norm, *layer.mlp_norm]
        return sum(t.numel() * t.element_size() for t in tensors)

    @classmethod
    def from_dir(cls, path: Path, *, dtype: torch.dtype, device: torch.device) -> BertEncoder:
        """Load the weights of a Hugging Face BERT directory (`BertModel` names, with or
        without a `bert.` prefix)."""
        from safetensors import safe_open

        config = BertConfig.from_dir(path)
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"{path} has no *.safetensors files")
        tensors: dict[str, torch.Tensor] = {}
        for file in files:
            with safe_open(str(file), framework="pt") as handle:
                for key in handle.keys():  # noqa: SIM118 (safe_open handles are not iterable)
                    tensors[key.removeprefix("bert.")] = handle.get_tensor(key)

        def need(name: str) -> torch.Tensor:
            return require_tensor(tensors.get, name).to(device=device, dtype=dtype).contiguous()

        def norm(prefix: str) -> tuple[torch.Tensor, torch.Tensor]:
            return need(f"{prefix}.weight"), need(f"{prefix}.bias")

        layers = []
        for index in range(config.num_layers):
            p = f"encoder.layer.{index}."
            a = p + "attention."
            layers.append(
                _Layer(
                    qkv=torch.cat(
                        [need(a + f"self.{n}.weight") for n in ("query", "key", "value")]
                    ),
                    qkv_bias=torch.cat(
                        [need(a + f"self.{n}.bias") for n in ("query", "key", "value")]
                    ),
                    out=need(a + "output.dense.weight"),
                    out_bias=need(a + "output.dense.bias"),
                    attn_norm=norm(a + "output.LayerNorm"),
                    up=need(p + "intermediate.dense.weight"),
                    up_bias=need(p + "intermediate.dense.bias"),
                    down=need(p + "output.dense.weight"),
                    down_bias=need(p + "output.dense.bias"),
                    mlp_norm=norm(p + "output.LayerNorm"),
                )
            )
        embeddings = (
            need("embeddings.word_embeddings.weight"),
            need("embeddings.position_embeddings.weight"),
            need("embeddings.token_type_embeddings.weight"),
        )
        return cls(config, embeddings, norm("embeddings.LayerNorm"), layers)

    @torch.inference_mode()
    def embed(self, inputs: Sequence[Sequence[int]]) -> torch.Tensor:
        """The sentence vectors of `inputs` (token ids, special tokens included, each at most
        `config.max_input_tokens`): [len(inputs), hidden] float32, in the order given,
        pooled and (as the model says) normalized."""
        out = torch.empty(len(inputs), self.config.hidden_size, dtype=torch.float32)
        for group in _groups([len(ids) for ids in inputs]):
            vectors = self._embed_group([inputs[i] for i in group])
            out[torch.tensor(group)] = vectors.cpu()
        return out

    def _embed_group(self, inputs: list[Sequence[int]]) -> torch.Tensor:
        cfg = self.config
        batch, length = len(inputs), max(len(ids) for ids in inputs)
        ids = torch.zeros(batch, length, dtype=torch.long)
        mask = torch.zeros(batch, length, dtype=torch.bool)
        for row, token_ids in enumerate(inputs):
            ids[row, : len(token_ids)] = torch.tensor(token_ids, dtype=torch.long)
            mask[row, : len(token_ids)] = True
        ids, mask = ids.to(self.device), mask.to(self.device)
        hidden, eps = cfg.hidden_size, cfg.layer_norm_eps
        heads, head_dim = cfg.num_heads, cfg.head_dim
        # x: [batch, L, hidden]
        x = self.word[ids] + self.position[:length] + self.token_type[0]
        x = F.layer_norm(x, (hidden,), *self.embed_norm, eps)
        # Padded keys are never attended to: [batch, 1, 1, L], True where a token is real.
        attend = mask[:, None, None, :]
        for layer in self.layers:
            qkv = F.linear(x, layer.qkv, layer.qkv_bias)  # [batch, L, 3 hidden]
            # q, k, v: [batch, heads, L, head_dim]
            q, k, v = qkv.view(batch, length, 3, heads, head_dim).permute(2, 0, 3, 1, 4)
            attn = F.scaled_dot_product_attention(q, k, v, attn_mask=attend)
            attn = attn.transpose(1, 2).reshape(batch, length, hidden)
            x = F.layer_norm(
                x + F.linear(attn, layer.out, layer.out_bias), (hidden,), *layer.attn_norm, eps
            )
            up = self._act(F.linear(x, layer.up, layer.up_bias))  # [batch, L, intermediate]
            x = F.layer_norm(
                x + F.linear(up, layer.down, layer.down_bias), (hidden,), *layer.mlp_norm, eps
            )
        vectors = pool(x.float(), mask, cfg.pooling)
        if cfg.normalize:
            vectors = F.normalize(vectors, p=2, dim=-1)
        return vectors


def _groups(lengths: list[int]) -> list[list[int]]:
    """Indices of the inputs in groups of similar length: sorted by length, a group grows
    while its padding stays under `_MAX_PADDING` of its tokens and its padded size under
    `_GROUP_TOKENS`."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    groups: list[list[int]] = []
    current: list[int] = []
    real = 0
    for index in order:
        length = lengths[index]
        padded = length * (len(current) + 1)  # sorted: this one is the longest so far
        if current and (padded > _GROUP_TOKENS or padded - (real + length) > _MAX_PADDING * padded):
            groups.append(current)
            current, real = [], 0
        current.append(index)
        real += length
    if current:
        groups.append(current)
    return groups


class EncoderTokenizer:
    """The directory's `tokenizer.json` as the encoder reads text: its normalizer and
    word pieces, then its special tokens ([CLS] ... [SEP]) around at most `max_tokens` tokens.
    The file's own truncation and padding settings are not used."""

    def __init__(self, path: Path, max_tokens: int) -> None:
        from tokenizers import Tokenizer

        self._backend = Tokenizer.from_file(str(path / "tokenizer.json"))
        self._backend.no_truncation()
        self._backend.no_padding()
        self.max_tokens = max_tokens
        self.num_special = self._backend.num_special_tokens_to_add(False)
        self.vocab_size = self._backend.get_vocab_size(with_added_tokens=True)
        self.chat_template = None

    def encode(self, text: str, *, truncate: bool = False) -> list[int]:
        """The ids of `text` with the special tokens; with `truncate`, cut to `max_tokens`
        (the end of the text goes, the special tokens stay)."""
        encoding = self._backend.encode(text, add_special_tokens=False)
        if truncate and len(encoding.ids) + self.num_special > self.max_tokens:
            encoding.truncate(max(0, self.max_tokens - self.num_special))
        return self._backend.post_process(encoding).ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)


@dataclass
class LoadedEncoder:
    """An encoder loaded onto its device, with its tokenizer (as `LoadedModel` is for
    decoders)."""

    model: BertEncoder
    tokenizer: EncoderTokenizer
    config: BertConfig
    path: Path
    name: str
    device: torch.device
    dtype: torch.dtype
    load_seconds: float
    quantization: list[str]  # the checkpoint's tensor types

    def kernels_status(self) -> dict:
        """How the encoder runs, in the shape of `LoadedModel.kernels_status` (GET /ready):
        torch's own operations, no CPU kernels of kvserve's."""
        return {"kernels": None, "layers": "torch", "attention": "torch sdpa"}

    def summary(self) -> str:
        cfg = self.config
        return (
            f"loaded {self.name}: {cfg.architecture} encoder, "
            f"{cfg.num_parameters() / 1e6:.1f}M params, {cfg.num_layers} layers, "
            f"{str(self.dtype).removeprefix('torch.')} on {self.device}, "
            f"{cfg.hidden_size} dimensions, {cfg.pooling} pooling"
            f"{', normalized' if cfg.normalize else ''}, inputs up to {cfg.max_input_tokens} "
            f"tokens, in {self.load_seconds:.1f} s"
        )


def load_encoder(path: Path, device: torch.device, dtype: torch.dtype) -> LoadedEncoder:
    """Load an encoder directory (call on the device thread)."""
    from safetensors import safe_open

    started = time.perf_counter()
    model = BertEncoder.from_dir(path, dtype=dtype, device=device)
    tokenizer = EncoderTokenizer(path, model.config.max_input_tokens)
    types: set[str] = set()  # of the weights: integer buffers (position ids) are no weights
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            for key in handle.keys():  # noqa: SIM118 (safe_open handles are not iterable)
                kind = str(handle.get_slice(key).get_dtype())
                if kind.startswith(("F", "BF")):
                    types.add(kind)
    return LoadedEncoder(
        model=model,
        tokenizer=tokenizer,
        config=model.config,
        path=path,
        name=path.name,
        device=device,
        dtype=dtype,
        load_seconds=time.perf_counter() - started,
        quantization=sorted(types),
    )
