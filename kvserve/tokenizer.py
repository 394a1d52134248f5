"""Text to token ids and back: the tokenizer, chat templates, and an incremental detokenizer.

Built on the Hugging Face `tokenizers` library. A tokenizer comes either from a GGUF file's
metadata (`Tokenizer.from_gguf`) or from a Hugging Face model directory (`Tokenizer.from_hf_dir`).
Byte-level BPE vocabularies (Llama 3, Qwen, SmolLM) and SentencePiece ones (BPE or unigram with
byte fallback: Llama 2, Mistral, Gemma, Phi-3, T5) are supported.

Three rules hold throughout:

- `encode` treats its input as plain text: a user typing `<|im_start|>` gets the tokens of those
  characters, never the control token. Only a raw prompt, which the caller templated itself,
  is encoded with `parse_special=True`: control-token spellings become control tokens there,
  as transformers' tokenizer (and vLLM, llama.cpp's server) parse them.
- `encode_chat` lets only the chat template produce control tokens; text that came from the
  messages is encoded as plain text, even where it spells a control token.
- `IncrementalDetokenizer` emits only whole UTF-8 characters (a character spelled by several
  byte pieces comes out once its last byte arrives), holds back text that may still become a
  stop string, and its output adds up to what `decode` gives for the same ids (standalone; a
  generated sequence keeps the space of its first word, which `decode` drops).
"""

from __future__ import annotations

import codecs
import copy
import itertools
import json
import operator
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import numpy as np
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as Backend

__all__ = [
    "ChatTemplateError",
    "IncrementalDetokenizer",
    "Tokenizer",
]


class ChatTemplateError(ValueError):
    """The conversation could not be rendered: no template, a failing template, or bad messages."""


# GGUF `tokenizer.ggml.token_type` values (llama.cpp's llama_token_type, SentencePiece's piece
# types).
_TOKEN_TYPE_NORMAL = 1
_TOKEN_TYPE_UNKNOWN = 2
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4
_TOKEN_TYPE_UNUSED = 5
_TOKEN_TYPE_BYTE = 6

# SentencePiece's word marker: a space inside a piece ("▁the" is " the").
_SPACE_MARK = "\u2581"
# A byte-fallback piece: "<0x0A>" is the byte 0x0A.
_BYTE_PIECE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")

# Token texts llama.cpp treats as end of generation when the vocabulary marks them as control
# tokens. A GGUF carries no generation_config, so without these a model that ends its text with
# one besides its named eos (SmolLM2 has <|endoftext|> as well as <|im_end|>) would run on.
_END_OF_GENERATION_TEXTS = frozenset(
    {
        "<|eot_id|>",
        "<|im_end|>",
        "<|end|>",
        "<end_of_turn>",
        "<|endoftext|>",
        "<|eom_id|>",
        "<EOT>",
        "_<EOT>",
        "<|end_of_text|>",
        "<end_of_utterance>",
    }
)

# Control tokens that mark a tool call in the model's answer. They stay in the answer's text
# when special tokens are skipped: the tool-call parsers read them (Llama 3 writes
# <|python_tag|> before a call, Mistral [TOOL_CALLS] and [ARGS]).
_ANSWER_MARKER_TEXTS = frozenset(
    {"<|python_tag|>", "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]", "<tool_call>", "</tool_call>"}
)

# Pre-tokenizer split patterns by GGUF `tokenizer.ggml.pre`: llama.cpp's (llama-vocab.cpp), in
# the spelling of the models' own tokenizer.json files where llama.cpp rewrote them for its
# regex engine. Several patterns split one after the other, each within the pieces of the last.
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# llama.cpp's `default` (also what a GGUF without `tokenizer.ggml.pre` gets there).
_DEFAULT_SPLITS = (r"[\p{P}\$\+<=>\^~\|]+", _GPT2_SPLIT, r"\p{N}+", r"[0-9][0-9][0-9]")

_LLAMA3_PRES = frozenset(
    {"llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2"}
)
_SPLITS_BY_PRE: dict[str, tuple[str, ...]] = {
    "default": _DEFAULT_SPLITS,
    **{pre: (_LLAMA3_SPLIT,) for pre in _LLAMA3_PRES | {"dbrx", "smaug-bpe", "chatglm-bpe"}},
    **{
        pre: (_QWEN2_SPLIT,)
        for pre in ("qwen2", "deepseek-r1-qwen", "stablelm2", "megrez", "kormo", "hunyuan")
    },
    "tekken": (_TEKKEN_SPLIT,),
    **{pre: (_GPT4O_SPLIT,) for pre in ("gpt-4o", "llama4", "kanana2", "minimax-m2")},
}
# Vocabularies trained with every digit split off first (StarCoder's tokenizer and its
# descendants, SmolLM among them): llama.cpp runs `\p{N}` and then the GPT-2 pattern, and the
# models' tokenizer.json has Digits(individual_digits=True) before ByteLevel. The two agree; a
# plain GPT-2 split does not ("a  1" is [a, "  ", 1] here, [a, " ", " ", 1] with GPT-2).
_DIGITS_FIRST_PRES = frozenset(
    {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva", "minerva-7b"}
)
_GPT2_PRES = frozenset({"gpt2", "gpt-2", "phi-2", "mpt", "olmo", "jais", "exaone4", "mellum"})
# llama.cpp takes a pre-token whole when the vocabulary has it, before any merge (as these
# models' tokenizer.json files say with "ignore_merges"), and adds BOS by default.
_IGNORE_MERGES_PRES = _LLAMA3_PRES | {"tekken"}
_ADD_BOS_PRES = _LLAMA3_PRES | {"tekken", "chameleon"}


def _byte_level_pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    if pre in _DIGITS_FIRST_PRES:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    if pre in _GPT2_PRES:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _SPLITS_BY_PRE:
        splits = [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated")
            for pattern in _SPLITS_BY_PRE[pre]
        ]
        return pre_tokenizers.Sequence(
            [*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
    known = sorted(_DIGITS_FIRST_PRES | _GPT2_PRES | set(_SPLITS_BY_PRE))
    raise ValueError(
        f"GGUF pre-tokenizer {pre!r} is not supported (known: {', '.join(known)}); "
        "load the model's Hugging Face directory instead"
    )


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: each byte is spelled as one printable character."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    codes = printable[:]
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            codes.append(256 + extra)
            extra += 1
    return {byte: chr(code) for byte, code in zip(printable, codes, strict=True)}


_BYTE_TO_CHAR = _bytes_to_unicode()
_CHAR_TO_BYTE = {char: byte for byte, char in _BYTE_TO_CHAR.items()}


# The byte alphabet as one character class, and each of its characters to its byte spelled as
# a latin-1 character: a vocabulary of 150k tokens is read by the regex and str.translate
# engines, not a Python loop per character.
_OUTSIDE_BYTE_ALPHABET = re.compile("[^" + "".join(re.escape(char) for char in _CHAR_TO_BYTE) + "]")
_TO_LATIN1 = str.maketrans({char: chr(byte) for char, byte in _CHAR_TO_BYTE.items()})


# Code point -> byte of the byte alphabet, -1 outside it: a whole vocabulary, joined, is read
# by numpy in one gather.
_BYTE_OF_CODE = np.full(max(map(ord, _CHAR_TO_BYTE)) + 1, -1, dtype=np.int16)
_BYTE_OF_CODE[[ord(char) for char in _CHAR_TO_BYTE]] = list(_CHAR_TO_BYTE.values())


def _byte_level_bytes(token: str) -> bytes:
    # Same rule as the ByteLevel decoder: a token spelled outside the byte alphabet (an added
    # token like "<|im_start|>" is inside it; one with other characters is not) is its own UTF-8.
    if _OUTSIDE_BYTE_ALPHABET.search(token):
        return token.encode("utf-8")
    return token.translate(_TO_LATIN1).encode("latin-1")


def _all_byte_level_bytes(tokens: Sequence[str]) -> list[bytes] | None:
    """`_byte_level_bytes` of each token, where every one is spelled in the byte alphabet
    (None where one is not): the vocabulary is joined and mapped at once, then cut, 0.06 s
    -> 0.02 s for 150k tokens."""
    joined = "".join(tokens)
    codes = np.frombuffer(joined.encode("utf-32-le"), dtype=np.uint32)
    if codes.size and int(codes.max()) >= _BYTE_OF_CODE.size:
        return None
    spelled = _BYTE_OF_CODE[codes]
    if codes.size and int(spelled.min()) < 0:
        return None
    data = spelled.astype(np.uint8).tobytes()
    ends = list(itertools.accumulate(map(len, tokens)))
    return list(map(data.__getitem__, map(slice, [0, *ends[:-1]], ends)))


def _merge_pairs(merges: Sequence[str]) -> list[tuple[str, ...]]:
    """Each "left right" merge as (left, right), cut at its first space; where each merge has
    one space and none a line break (byte-level vocabularies), cut all at once."""
    joined = "\n".join(merges)
    if merges and joined.count(" ") == len(merges) and joined.count("\n") == len(merges) - 1:
        parts = joined.replace(" ", "\n").split("\n")
        return list(zip(parts[0::2], parts[1::2], strict=True))
    return [tuple(merge.split(" ", 1)) for merge in merges]


def _indices_of_types(token_types: Sequence[int], kinds: tuple[int, ...]) -> list[int]:
    """The ids whose GGUF token type is one of `kinds`, in order."""
    types = np.asarray(token_types, dtype=np.int64)
    return np.flatnonzero(np.isin(types, kinds)).tolist()


def _merges_touch(merges: Sequence[Any], texts: set[str]) -> bool:
    """Whether a merge (a "left right" string or a pair) has one of `texts` as a part or as
    its join; True too where a merge is not a pair (the caller's exact filter decides)."""
    if not merges or not texts:
        return False
    pairs = _merge_pairs(merges) if isinstance(merges[0], str) else merges
    if set(map(len, pairs)) != {2}:  # a merge that is not two parts
        return True
    lefts = list(map(operator.itemgetter(0), pairs))
    rights = list(map(operator.itemgetter(1), pairs))
    return not (
        texts.isdisjoint(lefts)
        and texts.isdisjoint(rights)
        and texts.isdisjoint(map(operator.add, lefts, rights))
    )


def _model_vocab(data: Mapping[str, Any], backend: Backend) -> Iterable[tuple[str, int]]:
    """(token, id) of the model's own vocabulary, read from its parsed tokenizer.json when its
    shape is known (BPE, WordPiece and WordLevel: a dict; Unigram: a list of [piece, score]),
    else from the backend: `get_vocab` alone costs 0.13 s on a 150k vocabulary."""
    model = data.get("model") or {}
    vocab = model.get("vocab")
    if isinstance(vocab, dict):
        return vocab.items()
    if model.get("type") == "Unigram" and isinstance(vocab, list):
        return ((entry[0], token_id) for token_id, entry in enumerate(vocab))
    return backend.get_vocab(with_added_tokens=True).items()


def _field_value(fields: Mapping[str, Any], key: str, default: Any = None) -> Any:
    """A GGUF metadata value: a gguf ReaderField is unpacked, a plain value is taken as is."""
    field = fields.get(key)
    if field is None:
        return default
    contents = getattr(field, "contents", None)
    return contents() if callable(contents) else field


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    with path.open(encoding="utf-8") as file:
        return json.load(file)


def _token_content(value: Any) -> str | None:
    """tokenizer_config.json spells a special token as a string or as {"content": ...}."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping):
        content = value.get("content")
        return content if isinstance(content, str) else None
    return None


# --------------------------------------------------------------------------------------------
# Vocabularies from GGUF metadata


def _tokenizer_json(
    backend: Backend, twin: models.Model, vocab: dict[str, int], merges: list[tuple[str, str]]
) -> dict[str, Any]:
    """What `json.loads(backend.to_str())` gives for a BPE backend built from `vocab` and
    `merges`, without writing and parsing them again (0.18 s for a 150k vocabulary): tokenizers
    writes the other parts and `twin`, a model with the same options and no entries, and the
    entries are the objects the backend was built from (merges as pairs)."""
    shell = Backend(twin)
    for part in ("normalizer", "pre_tokenizer", "post_processor", "decoder"):
        component = getattr(backend, part)
        if component is not None:
            setattr(shell, part, component)
    data = json.loads(shell.to_str())
    data["model"] |= {"vocab": vocab, "merges": merges}
    data["added_tokens"] = [
        {
            "id": token_id,
            "content": token.content,
            "single_word": token.single_word,
            "lstrip": token.lstrip,
            "rstrip": token.rstrip,
            "normalized": token.normalized,
            "special": token.special,
        }
        for token_id, token in sorted(backend.get_added_tokens_decoder().items())
    ]
    return data


def _gguf_byte_level(
    fields: Mapping[str, Any], path: str | Path
) -> tuple[Backend, bool, dict[str, Any]]:
    """A byte-level BPE vocabulary (`tokenizer.ggml.model = gpt2`), whether llama.cpp adds
    BOS to it by default, and its tokenizer.json (parsed)."""
    tokens = list(_field_value(fields, "tokenizer.ggml.tokens", []))
    merges = list(_field_value(fields, "tokenizer.ggml.merges", []))
    token_types = list(_field_value(fields, "tokenizer.ggml.token_type", []))
    # A file without the key gets llama.cpp's `default` split, as it does there.
    pre = _field_value(fields, "tokenizer.ggml.pre", "default")
    if not tokens:
        raise ValueError(f"{path}: no tokenizer.ggml.tokens in the GGUF metadata")

    spelled = tokens
    if _OUTSIDE_BYTE_ALPHABET.search("".join(tokens)):
        spelled = [_respell_byte_level(token) for token in tokens]
    vocab = dict(zip(spelled, range(len(spelled)), strict=True))
    pairs = _merge_pairs(merges)
    options = {
        "dropout": None,
        "continuing_subword_prefix": "",
        "end_of_word_suffix": "",
        "fuse_unk": False,
        "ignore_merges": pre in _IGNORE_MERGES_PRES,
    }
    backend = Backend(models.BPE(vocab=vocab, merges=pairs, **options))
    backend.pre_tokenizer = _byte_level_pre_tokenizer(pre)
    backend.decoder = decoders.ByteLevel()

    alphabet = set(_CHAR_TO_BYTE)
    control = []
    user_defined = []
    kinds = (_TOKEN_TYPE_CONTROL, _TOKEN_TYPE_USER_DEFINED)
    for token_id in _indices_of_types(token_types[: len(tokens)], kinds):
        token, token_type = tokens[token_id], token_types[token_id]
        if token_type == _TOKEN_TYPE_CONTROL and set(token) <= alphabet:
            control.append(AddedToken(token, normalized=False, special=True))
        elif token_type == _TOKEN_TYPE_USER_DEFINED and token in vocab:
            # llama.cpp matches user-defined tokens whole, inside plain text too.
            user_defined.append(AddedToken(token, normalized=False, special=False))
    backend.add_special_tokens(control)
    backend.add_tokens(user_defined)
    data = _tokenizer_json(backend, models.BPE(vocab={}, merges=[], **options), vocab, pairs)
    return backend, pre in _ADD_BOS_PRES, data


def _merges_from_scores(
    tokens: Sequence[str], scores: Sequence[float], token_types: Sequence[int]
) -> list[tuple[str, str]]:
    """The BPE merges a SentencePiece BPE vocabulary implies: every way of cutting a normal
    piece into two normal pieces, the pieces with the best score first.

    SentencePiece (and llama.cpp's SPM tokenizer) repeatedly joins the adjacent pair whose
    concatenation is the best-scoring piece; BPE over these merges does the same. Control,
    byte and unknown pieces are never the result of a join."""
    normal = {
        token: (score, index)
        for index, (token, score, token_type) in enumerate(
            zip(tokens, scores, token_types, strict=False)
        )
        if token_type == _TOKEN_TYPE_NORMAL
    }
    ranked = []
    for token, (score, index) in normal.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in normal and right in normal:
                ranked.append((-score, index, left, right))
    ranked.sort()
    return [(left, right) for _, _, left, right in ranked]


def _sentencepiece_normalizer(
    *, add_space_prefix: bool, remove_extra_whitespaces: bool, charsmap: bytes | None
) -> normalizers.Normalizer:
    """SentencePiece's normalization: the precompiled character map, extra spaces removed, the
    dummy space in front, and every space spelled as the word marker. The dummy space is
    added to every stretch of text between added tokens, as llama.cpp does."""
    steps: list[normalizers.Normalizer] = []
    if charsmap:
        steps.append(normalizers.Precompiled(charsmap))
    if remove_extra_whitespaces:
        # Only spaces count, as in SentencePiece; newlines and tabs stay.
        steps += [
            normalizers.Replace(Regex(r"\A +| +\z"), ""),
            normalizers.Replace(Regex(" {2,}"), " "),
        ]
    if add_space_prefix:
        steps.append(normalizers.Prepend(_SPACE_MARK))
    steps.append(normalizers.Replace(" ", _SPACE_MARK))
    return normalizers.Sequence(steps)


def _gguf_sentencepiece(
    fields: Mapping[str, Any], path: str | Path, *, unigram: bool
) -> tuple[Backend, int | None]:
    """A SentencePiece vocabulary: `tokenizer.ggml.model = llama` (BPE, joined by score as
    llama.cpp's SPM tokenizer does) or `t5` (unigram, llama.cpp's UGM). Returns the backend
    and the unknown token's id."""
    tokens = list(_field_value(fields, "tokenizer.ggml.tokens", []))
    if not tokens:
        raise ValueError(f"{path}: no tokenizer.ggml.tokens in the GGUF metadata")
    num_tokens = len(tokens)
    scores = [float(s) for s in _field_value(fields, "tokenizer.ggml.scores", [])]
    token_types = [int(t) for t in _field_value(fields, "tokenizer.ggml.token_type", [])]
    if not scores:
        scores = [0.0] * num_tokens
    if not token_types:
        token_types = [_TOKEN_TYPE_NORMAL] * num_tokens
    if len(scores) < num_tokens or len(token_types) < num_tokens:
        raise ValueError(f"{path}: tokenizer.ggml.scores or token_type is shorter than tokens")
    if len(set(tokens)) != num_tokens:
        raise ValueError(f"{path}: the GGUF vocabulary spells a token twice")

    # llama.cpp's defaults where the file says nothing.
    unk_id = _field_value(fields, "tokenizer.ggml.unknown_token_id", 2 if unigram else 0)
    if unk_id is not None and not 0 <= unk_id < num_tokens:
        unk_id = None
    add_space_prefix = bool(_field_value(fields, "tokenizer.ggml.add_space_prefix", not unigram))
    remove_extra = bool(_field_value(fields, "tokenizer.ggml.remove_extra_whitespaces", False))
    charsmap = _field_value(fields, "tokenizer.ggml.precompiled_charsmap")
    has_bytes = _TOKEN_TYPE_BYTE in token_types[:num_tokens]

    if unigram:
        model = models.Unigram(
            [(token, score) for token, score in zip(tokens, scores, strict=False)],
            unk_id=unk_id,
            byte_fallback=has_bytes,
        )
    else:
        merges = list(_field_value(fields, "tokenizer.ggml.merges", []))
        model = models.BPE(
            vocab={token: token_id for token_id, token in enumerate(tokens)},
            merges=[tuple(merge.split(" ", 1)) for merge in merges]
            if merges
            else _merges_from_scores(tokens, scores, token_types),
            unk_token=tokens[unk_id] if unk_id is not None else None,
            fuse_unk=True,
            byte_fallback=has_bytes,
            dropout=None,
        )
    backend = Backend(model)
    backend.normalizer = _sentencepiece_normalizer(
        add_space_prefix=add_space_prefix,
        remove_extra_whitespaces=remove_extra,
        charsmap=bytes(int(b) & 0xFF for b in charsmap) if charsmap is not None else None,
    )
    steps = [decoders.Replace(_SPACE_MARK, " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    backend.decoder = decoders.Sequence(steps)

    special = []
    user_defined = []
    for token_id, (token, token_type) in enumerate(zip(tokens, token_types, strict=False)):
        if token_type == _TOKEN_TYPE_CONTROL or token_id == unk_id:
            special.append(AddedToken(token, normalized=False, special=True))
        elif token_type == _TOKEN_TYPE_USER_DEFINED:
            # SentencePiece and llama.cpp match user-defined pieces whole, in plain text too.
            user_defined.append(AddedToken(token, normalized=False, special=False))
    backend.add_special_tokens(special)
    backend.add_tokens(user_defined)
    return backend, unk_id


# --------------------------------------------------------------------------------------------
# Decoding: each token's bytes, as the backend's decoder spells them


@dataclass(frozen=True, slots=True)
class _DecoderShape:
    """What a tokenizer.json decoder does, in the terms the byte tables need.

    Byte-level vocabularies spell each byte as a character. SentencePiece ones write a space
    as "▁" and a byte as "<0xAB>" (ByteFallback), and drop the dummy space of a text's first
    word: `Strip` after `Fuse` takes the "▁" off the first token, `Metaspace` takes every
    "▁" out of it. As in sentencepiece, a space that a byte piece spells is never dropped."""

    byte_level: bool = False
    marker_is_space: bool = False
    byte_fallback: bool = False
    first_token_drops_marker: bool = False
    first_token_strips: int = 0

    @classmethod
    def of(cls, decoder: Mapping[str, Any] | None) -> _DecoderShape:
        if decoder is None:
            raise ValueError("the tokenizer has no decoder")
        if decoder.get("type") == "ByteLevel":
            return cls(byte_level=True)
        steps = decoder.get("decoders", []) if decoder.get("type") == "Sequence" else [decoder]
        fused = False
        found: dict[str, Any] = {}
        for step in steps:
            kind = step.get("type")
            if (
                kind == "Replace"
                and not fused
                and step.get("pattern") == {"String": _SPACE_MARK}
                and step.get("content") == " "
            ):
                found["marker_is_space"] = True
            elif kind == "ByteFallback" and not fused:
                found["byte_fallback"] = True
            elif kind == "Metaspace" and not fused and step.get("replacement") == _SPACE_MARK:
                found["marker_is_space"] = True
                scheme = step.get("prepend_scheme")
                if scheme is None:  # files written before prepend_scheme
                    scheme = "always" if step.get("add_prefix_space", True) else "never"
                found["first_token_drops_marker"] = scheme != "never"
            elif kind == "Fuse":
                fused = True
            elif kind == "Strip" and fused and step.get("content") == " " and not step.get("stop"):
                found["first_token_strips"] = int(step.get("start", 0))
            else:
                raise ValueError(
                    f"the tokenizer's decoder is not supported: step {kind!r} in "
                    f"{json.dumps(decoder)[:300]} (supported: ByteLevel, or SentencePiece's "
                    "Replace('▁', ' '), ByteFallback, Metaspace, Fuse and Strip(' ') after Fuse)"
                )
        if not found.get("marker_is_space"):
            raise ValueError(
                "the tokenizer's decoder is not supported: it neither decodes bytes (ByteLevel) "
                f"nor writes '▁' as a space: {json.dumps(decoder)[:300]}"
            )
        return cls(**found)

    @property
    def utf8_errors(self) -> str:
        """How invalid UTF-8 is shown: byte-level decoding (Rust's from_utf8_lossy) replaces
        each bad sequence once, as Python's "replace" does; SentencePiece and ByteFallback
        replace each bad byte."""
        return _REPLACE_EACH_BYTE if self.byte_fallback else "replace"

    def token_bytes(self, token: str, *, first: bool = False) -> bytes:
        """The bytes a token decodes to (as the first token of a text, with `first`)."""
        if self.byte_level:
            return _byte_level_bytes(token)
        if self.byte_fallback:
            byte = _BYTE_PIECE.match(token)
            if byte is not None:
                return bytes([int(byte.group(1), 16)])
        if first and self.first_token_drops_marker:
            return token.replace(_SPACE_MARK, "").encode("utf-8")
        if first and self.first_token_strips:
            kept = token.lstrip(_SPACE_MARK)
            token = _SPACE_MARK * max(0, len(token) - len(kept) - self.first_token_strips) + kept
        return token.replace(_SPACE_MARK, " ").encode("utf-8")

    def all_token_bytes(self, tokens: Sequence[str | None]) -> list[bytes]:
        """`token_bytes` of each token (None: b""); a byte-level vocabulary is mapped at once
        where all of it is in the byte alphabet, else goes straight to `_byte_level_bytes`."""
        if self.byte_level:
            present = tokens if None not in tokens else ["" if t is None else t for t in tokens]
            mapped = _all_byte_level_bytes(present)  # type: ignore[arg-type]
            if mapped is not None:
                return mapped
        one = _byte_level_bytes if self.byte_level else self.token_bytes
        return [b"" if token is None else one(token) for token in tokens]

    @property
    def changes_first_token(self) -> bool:
        return self.first_token_drops_marker or self.first_token_strips > 0


_REPLACE_EACH_BYTE = "kvserve.replace_each_byte"


def _replace_each_byte(error: UnicodeError) -> tuple[str, int]:
    assert isinstance(error, UnicodeDecodeError)
    return "\ufffd" * (error.end - error.start), error.end


codecs.register_error(_REPLACE_EACH_BYTE, _replace_each_byte)


# --------------------------------------------------------------------------------------------
# Plain-text encoders


def _without_first_prepend(data: dict[str, Any]) -> dict[str, Any] | None:
    """`data` (a tokenizer.json) with a Metaspace pre-tokenizer that prepends the word marker
    only at the start of the input (prepend_scheme "first") made to never prepend; None when
    it has none. Text that follows a control token in a rendered chat is encoded with it."""

    def visit(node: Any) -> bool:
        if isinstance(node, dict):
            found = node.get("type") == "Metaspace" and node.get("prepend_scheme") == "first"
            if found:
                node["prepend_scheme"] = "never"
            return any([found, *(visit(value) for value in node.values())])
        if isinstance(node, list):
            return any([visit(value) for value in node])
        return False

    pre_tokenizer = json.loads(json.dumps(data.get("pre_tokenizer")))
    if not visit(pre_tokenizer):
        return None
    return {**data, "pre_tokenizer": pre_tokenizer}


def _reserved_spelling(token_id: int) -> str:
    # With spaces, which the pipelines rewrite before the model sees the text (checked when
    # the encoder is built), so no text can spell it.
    return f" {_PLACEHOLDER_MARK}reserved {token_id}{_PLACEHOLDER_MARK} "


def _plain_text_data(data: dict[str, Any]) -> dict[str, Any] | None:
    """A copy of a tokenizer.json for plain text, from which no control token can come (None:
    `data` is such already).

    `tokenizers` keeps special added tokens out of the text it matches, but its models may
    still produce their vocabulary entries: a unigram model matches any piece inside the text
    (control pieces like "<s>", the unknown piece, byte pieces like "<0x41>"), where
    SentencePiece matches only normal and user-defined ones; a BPE model may join or (with
    ignore_merges) take whole a control token's spelling. In the copy those entries are
    respelled so that nothing matches them and the joins that make them are gone; a unigram
    model's byte fallback is left to `_PlainText`, which writes an unknown stretch as its
    bytes, as SentencePiece does."""
    model = dict(data.get("model") or {})
    added = data.get("added_tokens", [])
    specials = {token["id"]: token["content"] for token in added if token["special"]}
    respelled: set[int] = set()
    if model.get("type") == "Unigram":
        vocab = [list(entry) for entry in model["vocab"]]
        reserved = set(specials)
        if model.get("unk_id") is not None:
            reserved.add(model["unk_id"])
        if model.get("byte_fallback"):
            reserved |= {i for i, (piece, _) in enumerate(vocab) if _BYTE_PIECE.match(piece)}
        for token_id in reserved:
            if token_id < len(vocab):
                vocab[token_id][0] = _reserved_spelling(token_id)
                respelled.add(token_id)
        model["vocab"] = vocab
        model["byte_fallback"] = False
    elif model.get("type") == "BPE":
        special_texts = set(specials.values())
        merges = model.get("merges", [])
        # A merge's parts and result are entries of the model's vocabulary (tokenizers checks
        # it): with no special text there, no merge can make or use one.
        kept = merges
        if any(text in model.get("vocab", {}) for text in special_texts) and _merges_touch(
            merges, special_texts
        ):
            kept = []
            for merge in merges:
                left, right = merge if isinstance(merge, list | tuple) else merge.split(" ", 1)
                if not (
                    left in special_texts or right in special_texts or left + right in special_texts
                ):
                    kept.append(merge)
        whole_words = bool(model.get("ignore_merges"))
        if whole_words and model.get("byte_fallback"):
            # A SentencePiece vocabulary is closed under its joins: taking a whole word from
            # the vocabulary adds only byte pieces spelled out in the text ("<0x41>").
            whole_words = model["ignore_merges"] = False
        vocab = model["vocab"]
        reserved_texts = {
            text for token_id, text in specials.items() if vocab.get(text) == token_id
        }
        if not whole_words:
            # Without whole-word matching only joins make a token: none makes these now.
            reserved_texts = set()
        unchanged = model.get("ignore_merges") == data["model"].get("ignore_merges")
        if len(kept) == len(merges) and not reserved_texts and unchanged:
            return None
        model["merges"] = kept
        if reserved_texts:
            vocab = dict(vocab)
            for text in reserved_texts:
                token_id = vocab.pop(text)
                vocab[_reserved_spelling(token_id)] = token_id
                respelled.add(token_id)
                if model.get("unk_token") == text:
                    model["unk_token"] = _reserved_spelling(token_id)
            model["vocab"] = vocab
    else:
        return None
    added = [
        {**token, "content": _reserved_spelling(token["id"])} if token["id"] in respelled else token
        for token in added
    ]
    return {**data, "model": model, "added_tokens": added}


class _PlainText:
    """Encodes plain text with a backend built from `_plain_text_data`: control tokens never
    come out, and a unigram model's unknown stretches become their byte pieces."""

    def __init__(self, original: dict[str, Any], data: dict[str, Any] | Backend) -> None:
        """`data`: the tokenizer.json to build from, or a ready backend."""
        if isinstance(data, Backend):
            self.backend = data
        else:
            self.backend = Backend.from_str(json.dumps(data))
        self.backend.encode_special_tokens = True
        model = original.get("model") or {}
        self.unk_id: int | None = None
        self.byte_ids: dict[int, int] = {}
        if model.get("type") == "Unigram" and model.get("byte_fallback"):
            self.unk_id = model.get("unk_id")
            for token_id, (piece, _score) in enumerate(model["vocab"]):
                byte = _BYTE_PIECE.match(piece)
                if byte is not None:
                    self.byte_ids[int(byte.group(1), 16)] = token_id
        if model.get("type") == "Unigram" and " " in "".join(self._model_input("a b")):
            raise ValueError(
                "a unigram tokenizer that lets spaces reach its model is not supported"
            )

    def _model_input(self, text: str) -> list[str]:
        normalizer, pre_tokenizer = self.backend.normalizer, self.backend.pre_tokenizer
        normalized = normalizer.normalize_str(text) if normalizer is not None else text
        if pre_tokenizer is None:
            return [normalized]
        return [piece for piece, _ in pre_tokenizer.pre_tokenize_str(normalized)]

    def encode(self, text: str) -> list[int]:
        encoding = self.backend.encode(text, add_special_tokens=False)
        ids = encoding.ids
        if self.unk_id is None or self.unk_id not in ids:
            return ids
        out: list[int] = []
        for token_id, piece in zip(ids, encoding.tokens, strict=True):
            # An unknown token's text is the (normalized) text it stands for.
            byte_ids = [self.byte_ids.get(byte) for byte in piece.encode("utf-8")]
            if token_id == self.unk_id and piece and None not in byte_ids:
                out += byte_ids  # type: ignore[arg-type]
            else:
                out.append(token_id)
        return out


# --------------------------------------------------------------------------------------------
# Chat templates


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` as used by Hugging Face templates to mark the
    assistant's tokens; rendering only needs the body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson escapes HTML characters; chat templates expect plain JSON.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def _compile_template(source: str) -> jinja2.Template:
    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[jinja2.ext.loopcontrols, _GenerationTag],
    )
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = _strftime_now
    try:
        return environment.from_string(source)
    except jinja2.TemplateError as exc:
        raise ChatTemplateError(f"the chat template does not compile: {exc}") from exc


def _content_text(content: Any, index: int) -> Any:
    """Message content as the template sees it: a list of text parts becomes one string."""
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, Sequence):
        texts = []
        for part in content:
            if not isinstance(part, Mapping) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
                raise ChatTemplateError(
                    f"messages[{index}].content: only text parts are supported, got {kind!r}"
                )
            text = part.get("text")
            if not isinstance(text, str):
                raise ChatTemplateError(f"messages[{index}].content: a text part has no text")
            texts.append(text)
        # Parts are joined with a newline, as vLLM does for text-only models.
        return "\n".join(texts)
    raise ChatTemplateError(
        f"messages[{index}].content must be a string or a list of text parts, "
        f"got {type(content).__name__}"
    )


def _normalize_messages(messages: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    normalized = []
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ChatTemplateError(f"messages[{index}] must be an object")
        if not isinstance(message.get("role"), str):
            raise ChatTemplateError(f"messages[{index}] has no role")
        # Keys whose value is None are dropped, as transformers does, so that templates testing
        # `message.content is defined` see the same thing here as there.
        plain = {key: value for key, value in message.items() if value is not None}
        if "content" in plain:
            plain["content"] = _content_text(plain["content"], index)
        normalized.append(plain)
    return normalized


# Look-alikes of special tokens inside message text are swapped for placeholders spelled with
# this private-use character before rendering, and swapped back after the template's own special
# tokens have been found. The character itself, when it occurs in a message, is swapped too.
_PLACEHOLDER_MARK = "\U000f0000"
_PLACEHOLDER_RE = re.compile(f"{_PLACEHOLDER_MARK}(\\d+){_PLACEHOLDER_MARK}")


class _LookAlikes:
    """Replaces special-token spellings in user-supplied strings with numbered placeholders."""

    def __init__(self, special_re: re.Pattern[str]) -> None:
        self._pattern = re.compile(f"{special_re.pattern}|{_PLACEHOLDER_MARK}")
        self.originals: list[str] = []

    def _replace(self, match: re.Match[str]) -> str:
        self.originals.append(match.group(0))
        return f"{_PLACEHOLDER_MARK}{len(self.originals) - 1}{_PLACEHOLDER_MARK}"

    def hide(self, value: Any) -> Any:
        if isinstance(value, str):
            return self._pattern.sub(self._replace, value)
        if isinstance(value, Mapping):
            return {key: self.hide(item) for key, item in value.items()}
        if isinstance(value, list | tuple):
            return [self.hide(item) for item in value]
        return value

    def restore(self, text: str) -> str:
        if not self.originals:
            return text
        return _PLACEHOLDER_RE.sub(lambda match: self.originals[int(match.group(1))], text)


# --------------------------------------------------------------------------------------------
# The tokenizer


class Tokenizer:
    """A model's tokenizer: plain-text encoding, decoding, chat templates, detokenizers.

    Build one with `from_gguf` or `from_hf_dir`. Instances are read-only after construction and
    safe to share between threads.

    Byte-level BPE vocabularies (GPT-2's alphabet: Llama 3, Qwen, SmolLM) and SentencePiece
    ones (BPE or unigram, "▁" for a space, byte fallback: Llama 2, Mistral, Gemma, Phi-3) are
    supported; the backend's decoder says which a vocabulary is.
    """

    def __init__(
        self,
        backend: Backend,
        *,
        bos_token_id: int | None,
        eos_token_id: int | None,
        eos_token_ids: Iterable[int] = (),
        chat_template: str | None = None,
        add_bos: bool = False,
        add_eos: bool = False,
        data: dict[str, Any] | None = None,
    ) -> None:
        """`data`: the backend's tokenizer.json, parsed, when the caller has it."""
        if data is None:
            data = json.loads(backend.to_str())
        self._decoding = _DecoderShape.of(data.get("decoder"))
        backend.encode_special_tokens = True
        self._backend = backend
        # Plain text: special tokens in the input are never matched, nor made by the model.
        plain_data = _plain_text_data(data)
        self._plain = _PlainText(data, backend if plain_data is None else plain_data)
        # Text after a control token, where a Metaspace "first" scheme writes no dummy space.
        inner = _without_first_prepend(plain_data or data)
        self._plain_inner = self._plain if inner is None else _PlainText(data, inner)

        self._bos_token_id = bos_token_id
        self._eos_token_id = eos_token_id
        ends = set(eos_token_ids)
        if eos_token_id is not None:
            ends.add(eos_token_id)
        self._eos_token_ids = frozenset(ends)
        self._chat_template = chat_template
        self._compiled_template: jinja2.Template | None = None
        self._add_bos = add_bos
        self._add_eos = add_eos

        added = backend.get_added_tokens_decoder()
        self._special_token_ids = frozenset(i for i, token in added.items() if token.special)
        self._special_by_text = {added[i].content: i for i in sorted(self._special_token_ids)}
        longest_first = sorted(self._special_by_text, key=len, reverse=True)
        # (?!) never matches: a vocabulary without special tokens splits nothing.
        self._special_re = re.compile("|".join(map(re.escape, longest_first)) or "(?!)")
        # Added tokens that eat the whitespace beside them (AddedToken lstrip/rstrip).
        self._lstrip_ids = frozenset(i for i in self._special_token_ids if added[i].lstrip)
        self._rstrip_ids = frozenset(i for i in self._special_token_ids if added[i].rstrip)

        vocab_size = backend.get_vocab_size(with_added_tokens=True)
        tokens: list[str | None] = [None] * vocab_size
        for token, token_id in _model_vocab(data, backend):
            if token_id < vocab_size:
                tokens[token_id] = token
        for token_id, added_token in added.items():  # an added token's spelling wins, as there
            if token_id < vocab_size:
                tokens[token_id] = added_token.content
        self._token_bytes = self._decoding.all_token_bytes(tokens)
        self._first_token_bytes: list[bytes] | None = None
        if self._decoding.changes_first_token:
            self._first_token_bytes = [
                b"" if token is None else self._decoding.token_bytes(token, first=True)
                for token in tokens
            ]
        # Tokens skip_special_tokens=True leaves out: control tokens, but for the markers of a
        # tool call in the answer, which its parser reads.
        self._skipped_ids = frozenset(
            i for i in self._special_token_ids if added[i].content not in _ANSWER_MARKER_TEXTS
        )
        self._token_bytes_skipping = list(self._token_bytes)
        for token_id in self._skipped_ids:
            self._token_bytes_skipping[token_id] = b""

    def with_chat_template(self, chat_template: str | None) -> Tokenizer:
        """The same vocabulary with another chat template (None: no template); raises
        ChatTemplateError when the template does not compile."""
        other = copy.copy(self)
        other._chat_template = chat_template
        other._compiled_template = (
            None if chat_template is None else _compile_template(chat_template)
        )
        return other

    # --- construction ---------------------------------------------------------------------

    @classmethod
    def from_gguf(cls, path: str | Path, fields: Mapping[str, Any] | None = None) -> Tokenizer:
        """The tokenizer described by a GGUF file's metadata.

        `tokenizer.ggml.model` says which: `gpt2` (byte-level BPE, split by the pattern of
        `tokenizer.ggml.pre`), `llama` (SentencePiece BPE: tokens, scores and token types, byte
        fallback, the dummy space of `tokenizer.ggml.add_space_prefix`) or `t5` (SentencePiece
        unigram). `fields` is `gguf.GGUFReader(path).fields` when the caller has parsed the
        file already (parsing takes seconds); plain values in place of reader fields are
        accepted too.
        """
        if fields is None:
            import gguf

            fields = gguf.GGUFReader(str(path)).fields
        model = _field_value(fields, "tokenizer.ggml.model")
        tokens = list(_field_value(fields, "tokenizer.ggml.tokens", []))
        token_types = list(_field_value(fields, "tokenizer.ggml.token_type", []))
        data = None
        if model == "gpt2":
            backend, add_bos, data = _gguf_byte_level(fields, path)
            default_ids = {"bos": None, "eos": None}
        elif model in ("llama", "t5"):
            backend, _unk = _gguf_sentencepiece(fields, path, unigram=model == "t5")
            add_bos = model == "llama"
            default_ids = {"bos": 1, "eos": 2} if model == "llama" else {"bos": None, "eos": 1}
        else:
            raise ValueError(
                f"GGUF tokenizer model {model!r} is not supported; byte-level BPE ('gpt2') and "
                "SentencePiece ('llama', 't5') vocabularies are"
            )

        def token_id(name: str) -> int | None:
            value = _field_value(fields, f"tokenizer.ggml.{name}_token_id", default_ids.get(name))
            return value if value is not None and 0 <= value < len(tokens) else None

        eos_ids = {token_id(name) for name in ("eos", "eot", "eom")}
        eos_ids |= {
            index
            for index in _indices_of_types(token_types[: len(tokens)], (_TOKEN_TYPE_CONTROL,))
            if tokens[index] in _END_OF_GENERATION_TEXTS
        }
        eos_ids.discard(None)
        return cls(
            backend,
            bos_token_id=token_id("bos"),
            eos_token_id=token_id("eos"),
            eos_token_ids=eos_ids,
            chat_template=_field_value(fields, "tokenizer.chat_template"),
            add_bos=bool(_field_value(fields, "tokenizer.ggml.add_bos_token", add_bos)),
            add_eos=bool(_field_value(fields, "tokenizer.ggml.add_eos_token", False)),
            data=data,
        )

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> Tokenizer:
        """The tokenizer of a Hugging Face model directory.

        Reads `tokenizer.json`, `tokenizer_config.json` (chat template, bos/eos, added tokens,
        `add_bos_token`), `chat_template.jinja` when the config has no template, and the eos ids
        of `generation_config.json`.
        """
        directory = Path(path)
        tokenizer_file = directory / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(f"{directory} has no tokenizer.json")
        backend = Backend.from_file(str(tokenizer_file))
        config = _read_json(directory / "tokenizer_config.json")

        known = backend.get_added_tokens_decoder()
        for key, entry in (config.get("added_tokens_decoder") or {}).items():
            token_id = int(key)
            if token_id in known or not isinstance(entry, Mapping):
                continue
            token = AddedToken(
                entry["content"],
                single_word=entry.get("single_word", False),
                lstrip=entry.get("lstrip", False),
                rstrip=entry.get("rstrip", False),
                normalized=entry.get("normalized", not entry.get("special", False)),
                special=entry.get("special", False),
            )
            if token.special:
                backend.add_special_tokens([token])
            else:
                backend.add_tokens([token])
            if backend.token_to_id(token.content) != token_id:
                raise ValueError(
                    f"{directory}: added token {token.content!r} is declared as id {token_id} "
                    f"but the vocabulary gives {backend.token_to_id(token.content)}"
                )

        def token_id_of(name: str) -> int | None:
            content = _token_content(config.get(name))
            return None if content is None else backend.token_to_id(content)

        bos_token_id = token_id_of("bos_token")
        eos_token_id = token_id_of("eos_token")

        generation = _read_json(directory / "generation_config.json")
        eos_ids = generation.get("eos_token_id")
        if isinstance(eos_ids, int):
            eos_ids = [eos_ids]

        add_bos = config.get("add_bos_token")
        if add_bos is None:
            # No flag: the post-processor decides, as it does in transformers.
            with_special = backend.encode("a", add_special_tokens=True).ids
            add_bos = bos_token_id is not None and with_special[:1] == [bos_token_id]
        return cls(
            backend,
            bos_token_id=bos_token_id,
            eos_token_id=eos_token_id,
            eos_token_ids=eos_ids or (),
            chat_template=_hf_chat_template(directory, config),
            add_bos=bool(add_bos),
            add_eos=bool(config.get("add_eos_token", False)),
        )

    def save_pretrained(self, directory: str | Path) -> Path:
        """Write this tokenizer as a Hugging Face directory reads it (`tokenizer.json`,
        `tokenizer_config.json`, `generation_config.json`): `from_hf_dir` gives it back. A GGUF
        file's tokenizer, saved so, goes with a checkpoint written by transformers."""
        target = Path(directory)
        target.mkdir(parents=True, exist_ok=True)
        self._backend.save(str(target / "tokenizer.json"))

        def text(token_id: int | None) -> str | None:
            return None if token_id is None else self._backend.id_to_token(token_id)

        config = {
            "bos_token": text(self._bos_token_id),
            "eos_token": text(self._eos_token_id),
            "add_bos_token": self._add_bos,
            "add_eos_token": self._add_eos,
            "chat_template": self._chat_template,
        }
        (target / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
        generation = {"eos_token_id": sorted(self._eos_token_ids)}
        (target / "generation_config.json").write_text(json.dumps(generation, indent=1))
        return target

    # --- properties -----------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included."""
        return len(self._token_bytes)

    @property
    def bos_token_id(self) -> int | None:
        """The beginning-of-sequence token, if the vocabulary names one."""
        return self._bos_token_id

    @property
    def eos_token_id(self) -> int | None:
        """The end-of-sequence token the vocabulary names."""
        return self._eos_token_id

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """Every token id that ends generation."""
        return self._eos_token_ids

    @property
    def special_token_ids(self) -> frozenset[int]:
        """Control tokens: never produced by `encode`; skip_special_tokens drops them, but for
        the markers a tool call is written with (`<|python_tag|>`, `[TOOL_CALLS]`...), which
        stay in the answer's text for the tool-call parsers."""
        return self._special_token_ids

    @property
    def chat_template(self) -> str | None:
        """The Jinja chat template, if the model has one."""
        return self._chat_template

    @property
    def add_bos(self) -> bool:
        """Whether the model expects a BOS token before a plain prompt."""
        return self._add_bos

    @property
    def add_eos(self) -> bool:
        """Whether the vocabulary asks for an EOS token after a plain prompt (T5-style); read
        from the model, for callers that build prompts for such models."""
        return self._add_eos

    def backend_json(self) -> str:
        """The vocabulary as a Hugging Face `tokenizer.json` text (grammar engines read it)."""
        return self._backend.to_str()

    # --- text <-> ids ---------------------------------------------------------------------

    def encode(self, text: str, *, add_bos: bool = False, parse_special: bool = False) -> list[int]:
        """The ids of `text` as plain text; with `add_bos`, the BOS token first.

        With `parse_special`, spellings of the vocabulary's control tokens become those tokens,
        as transformers' tokenizer does by default: for raw prompts a client templated itself,
        never for text that came from chat messages.
        """
        if not parse_special:
            ids = self._encode_text(text, at_start=True)
        else:
            # Split here rather than by a second backend that matches special tokens: the
            # unigram backend would match byte pieces inside the text, and building that
            # backend from its JSON costs about 0.8 s on a 150k vocabulary (a server's first
            # raw prompt waited for it).
            ids = self._encode_parts(text)
        if add_bos:
            if self._bos_token_id is None:
                raise ValueError("this vocabulary has no BOS token")
            ids.insert(0, self._bos_token_id)
        return ids

    def _encode_text(self, text: str, *, at_start: bool) -> list[int]:
        """Plain text; `at_start`: it begins the input (a Metaspace "first" scheme gives only
        that text the dummy space)."""
        return (self._plain if at_start else self._plain_inner).encode(text)

    def _encode_parts(
        self, text: str, restore: Callable[[str], str] = lambda text: text
    ) -> list[int]:
        """`text` with its control-token spellings as control tokens and the text between as
        plain text (after `restore`), the way the backend splits a whole input at its added
        tokens: whitespace beside an lstrip/rstrip token goes, and only text at the very start
        counts as the input's start."""
        ids: list[int] = []
        start = 0
        strip_next = False
        for match in self._special_re.finditer(text):
            token_id = self._special_by_text[match.group(0)]
            part = text[start : match.start()]
            if strip_next:
                part = part.lstrip()
            if token_id in self._lstrip_ids:
                part = part.rstrip()
            if part:
                ids += self._encode_text(restore(part), at_start=start == 0)
            ids.append(token_id)
            start = match.end()
            strip_next = token_id in self._rstrip_ids
        part = text[start:]
        if strip_next:
            part = part.lstrip()
        if part:
            ids += self._encode_text(restore(part), at_start=start == 0)
        return ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """The text of `ids` as a whole text (a SentencePiece vocabulary's dummy space in
        front is dropped, as its decoder does); bytes that are not valid UTF-8 become U+FFFD
        (one per bad sequence for byte-level vocabularies, one per bad byte for SentencePiece
        ones, as each vocabulary's own decoder does)."""
        detokenizer = self.detokenizer(skip_special_tokens=skip_special_tokens, standalone=True)
        return "".join([detokenizer.add(token_id) for token_id in ids]) + detokenizer.flush()

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes of one token (a special token's text for control tokens).

        A token may hold only part of a UTF-8 character; this is what OpenAI's logprobs `bytes`
        field carries.
        """
        if not 0 <= token_id < len(self._token_bytes):
            raise ValueError(f"token id {token_id} is outside the vocabulary")
        return self._token_bytes[token_id]

    def token_texts(self, token_ids: Sequence[int]) -> list[str]:
        """Each token's own text, a partial UTF-8 character shown as U+FFFD (for logprobs)."""
        return [self.token_bytes(token_id).decode("utf-8", "replace") for token_id in token_ids]

    def detokenizer(
        self,
        *,
        stop: Sequence[str] | None = (),
        skip_special_tokens: bool = True,
        standalone: bool = False,
    ) -> IncrementalDetokenizer:
        """A fresh incremental detokenizer for one generated sequence (`stop`: None or a
        sequence of stop strings; empty strings are ignored).

        A generated sequence continues its prompt, so a SentencePiece word marker at its start
        is the space the model wrote ("▁Paris" after "The capital is" is " Paris", as vLLM and
        llama.cpp stream it). With `standalone` the ids are a whole text and the decoder's rule
        for the start of a text applies (that space is the dummy prefix and is dropped), as in
        `decode`, which the output then adds up to exactly."""
        skipping = skip_special_tokens
        return IncrementalDetokenizer(
            self._token_bytes_skipping if skipping else self._token_bytes,
            stop=stop,
            first_token_bytes=self._first_token_bytes if standalone else None,
            skipped_ids=self._skipped_ids if skipping else frozenset(),
            errors=self._decoding.utf8_errors,
        )

    # --- chat -----------------------------------------------------------------------------

    def render_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> str:
        """The conversation rendered by the model's chat template, as text.

        Follows Hugging Face conventions: the template sees `messages`, `add_generation_prompt`,
        `bos_token`, `eos_token`, `tools=None`, `documents=None` and any `template_kwargs`.
        """
        return self._render(_normalize_messages(messages), add_generation_prompt, template_kwargs)

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> list[int]:
        """The ids of the rendered conversation.

        Special tokens written by the template become control tokens; text from the messages
        (and from `template_kwargs`) is encoded as plain text even where it spells one. No BOS
        is added: templates that want one write it.
        """
        look_alikes = _LookAlikes(self._special_re)
        hidden_messages = look_alikes.hide(_normalize_messages(messages))
        hidden_kwargs = look_alikes.hide(template_kwargs)
        rendered = self._render(hidden_messages, add_generation_prompt, hidden_kwargs)
        return self._encode_parts(rendered, look_alikes.restore)

    def _render(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool,
        template_kwargs: Mapping[str, Any],
    ) -> str:
        if self._chat_template is None:
            raise ChatTemplateError(
                "this model has no chat template; use the completions endpoint with a prompt"
            )
        if self._compiled_template is None:
            self._compiled_template = _compile_template(self._chat_template)
        variables: dict[str, Any] = {"tools": None, "documents": None}
        for name, token_id in (
            ("bos_token", self._bos_token_id),
            ("eos_token", self._eos_token_id),
        ):
            if token_id is not None:
                variables[name] = self._backend.id_to_token(token_id)
        variables.update(template_kwargs)
        variables["messages"] = messages
        variables["add_generation_prompt"] = add_generation_prompt
        try:
            return self._compiled_template.render(**variables)
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"the chat template refused the conversation: {exc}") from exc
        except Exception as exc:
            # Templates index and concatenate freely; a missing field shows up as any error.
            raise ChatTemplateError(
                f"the chat template failed on this conversation: {type(exc).__name__}: {exc}"
            ) from exc


def _respell_byte_level(token: str) -> str:
    """A vocabulary token in the byte alphabet (as transformers spells GGUF tokens)."""
    if not _OUTSIDE_BYTE_ALPHABET.search(token):
        return token
    return "".join(_BYTE_TO_CHAR[byte] for byte in token.encode("utf-8"))


def _hf_chat_template(directory: Path, config: Mapping[str, Any]) -> str | None:
    template = config.get("chat_template")
    if isinstance(template, list):
        # Named templates: [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        named = {entry.get("name"): entry.get("template") for entry in template}
        template = named.get("default")
    if isinstance(template, str):
        return template
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = _read_json(directory / "chat_template.json").get("chat_template")
    return template if isinstance(template, str) else None


# --------------------------------------------------------------------------------------------
# Incremental detokenizing


class IncrementalDetokenizer:
    """Turns generated ids into text one token at a time, for streaming.

    `add` returns only whole characters: a token that ends inside a UTF-8 character keeps its
    bytes until the character completes. Text that could be the start of a stop string is held
    back until it either completes the stop string (then `stopped` is True, the text before the
    match is emitted, the match and everything after it never are) or cannot anymore (then it is
    emitted). `flush` ends the sequence and returns whatever was held.

    With no stop strings, the `add` results plus `flush()` add up to `Tokenizer.decode` of the
    same ids exactly (for a detokenizer made with `standalone=True`). Each `add` costs time in proportion to the token and the longest stop
    string, never to the text so far.
    """

    def __init__(
        self,
        token_bytes: Sequence[bytes],
        *,
        stop: Sequence[str] | None = (),
        first_token_bytes: Sequence[bytes] | None = None,
        skipped_ids: frozenset[int] = frozenset(),
        errors: str = "replace",
    ) -> None:
        """`token_bytes[i]` is token i's bytes; `first_token_bytes`, when given, the bytes of
        a token that starts the text (ids in `skipped_ids` and past the table do not start
        it); `errors` is the codec error handler for bytes that are not UTF-8."""
        self._token_bytes = token_bytes
        self._first_token_bytes = first_token_bytes
        self._skipped_ids = skipped_ids
        self._at_start = True
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors=errors)
        # An empty stop string would match before any text; it means nothing.
        self._stops = tuple(dict.fromkeys(s for s in stop or () if s))
        self._stop_prefixes = frozenset(s[:k] for s in self._stops for k in range(1, len(s)))
        self._longest_prefix = max((len(s) - 1 for s in self._stops), default=0)
        self._held = ""
        self._chunks: list[str] = []
        self._stop_reason: str | None = None
        self._flushed = False

    @property
    def stopped(self) -> bool:
        """Whether a stop string has matched; nothing more will be emitted."""
        return self._stop_reason is not None

    @property
    def stop_reason(self) -> str | None:
        """The stop string that matched, or None."""
        return self._stop_reason

    @property
    def text(self) -> str:
        """Everything emitted so far."""
        if len(self._chunks) > 1:
            self._chunks = ["".join(self._chunks)]
        return self._chunks[0] if self._chunks else ""

    def add(self, token_id: int) -> str:
        """Feed one generated token; returns the text it completes (often "")."""
        if self._flushed:
            raise RuntimeError("add() after flush(): this sequence has ended")
        if self._stop_reason is not None:
            return ""
        # Ids past the table (padding rows of a larger embedding) decode to nothing, as in
        # `decode`.
        if 0 <= token_id < len(self._token_bytes):
            data = self._token_bytes[token_id]
            if self._at_start and token_id not in self._skipped_ids:
                self._at_start = False
                if self._first_token_bytes is not None:
                    data = self._first_token_bytes[token_id]
        else:
            data = b""
        return self._emit(self._decoder.decode(data, final=False))

    def flush(self) -> str:
        """End the sequence: returns held-back text (an unfinished UTF-8 tail as U+FFFD)."""
        if self._flushed:
            return ""
        if self._stop_reason is not None:
            self._flushed = True
            return ""
        tail = self._emit(self._decoder.decode(b"", final=True))
        if self._stop_reason is None:
            tail += self._held
            self._chunks.append(self._held)
            self._held = ""
        self._flushed = True
        return tail

    def _emit(self, new_text: str) -> str:
        if not self._stops:
            if new_text:
                self._chunks.append(new_text)
            return new_text
        if not new_text:
            return ""
        # Earlier text was emitted only once it could not start a stop string, so a match can
        # begin no earlier than the held text.
        text = self._held + new_text
        # The match that completes first wins (on a tie, the one that started first): that is
        # where generation would have stopped had the text come one character at a time, so
        # the result does not depend on how the text was cut into tokens.
        best: tuple[int, int] | None = None
        for stop in self._stops:
            start = text.find(stop)
            if start >= 0 and (best is None or (start + len(stop), start) < best):
                best = (start + len(stop), start)
                self._stop_reason = stop
        if best is not None:
            out = text[: best[1]]
            self._held = ""
        else:
            hold = 0
            for length in range(min(self._longest_prefix, len(text)), 0, -1):
                if text[-length:] in self._stop_prefixes:
                    hold = length
                    break
            out = text[: len(text) - hold]
            self._held = text[len(text) - hold :]
        if out:
            self._chunks.append(out)
        return out
