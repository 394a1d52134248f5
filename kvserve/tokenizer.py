"""Text to token ids and back: the tokenizer, chat templates, and an incremental detokenizer.

Built on the Hugging Face `tokenizers` library. A tokenizer comes either from a GGUF file's
metadata (`Tokenizer.from_gguf`) or from a Hugging Face model directory (`Tokenizer.from_hf_dir`).

Three rules hold throughout:

- `encode` treats its input as plain text: a user typing `<|im_start|>` gets the tokens of those
  characters, never the control token. Only a raw prompt, which the caller templated itself,
  is encoded with `parse_special=True`: control-token spellings become control tokens there,
  as transformers' tokenizer (and vLLM, llama.cpp's server) parse them.
- `encode_chat` lets only the chat template produce control tokens; text that came from the
  messages is encoded as plain text, even where it spells a control token.
- `IncrementalDetokenizer` emits only whole UTF-8 characters, holds back text that may still
  become a stop string, and its output always adds up to what `decode` gives for the same ids.
"""

from __future__ import annotations

import codecs
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as Backend

__all__ = [
    "ChatTemplateError",
    "IncrementalDetokenizer",
    "Tokenizer",
]


class ChatTemplateError(ValueError):
    """The conversation could not be rendered: no template, a failing template, or bad messages."""


# GGUF `tokenizer.ggml.token_type` values (llama.cpp's llama_token_type).
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4

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

# Pre-tokenizer split patterns by GGUF `tokenizer.ggml.pre`, the same ones llama.cpp and the
# models' own tokenizer.json files use.
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Vocabularies trained with every digit split off first (StarCoder's tokenizer and its
# descendants, SmolLM among them): llama.cpp runs `\p{N}` and then the GPT-2 pattern, and the
# models' tokenizer.json has Digits(individual_digits=True) before ByteLevel. The two agree; a
# plain GPT-2 split does not ("a  1" is [a, "  ", 1] here, [a, " ", " ", 1] with GPT-2).
_DIGITS_FIRST_PRES = frozenset(
    {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"}
)
_GPT2_PRES = frozenset({"gpt2", "gpt-2", "mpt", "olmo", "jais"})
_SPLIT_PRES = {
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "falcon3": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "dbrx": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
}


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
    if pre in _SPLIT_PRES:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_SPLIT_PRES[pre]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    known = sorted(_DIGITS_FIRST_PRES | _GPT2_PRES | set(_SPLIT_PRES))
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


def _byte_level_bytes(token: str) -> bytes:
    # Same rule as the ByteLevel decoder: a token spelled outside the byte alphabet (an added
    # token like "<|im_start|>" is inside it; one with other characters is not) is its own UTF-8.
    try:
        return bytes(_CHAR_TO_BYTE[char] for char in token)
    except KeyError:
        return token.encode("utf-8")


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
    ) -> None:
        if not isinstance(backend.decoder, decoders.ByteLevel):
            raise ValueError(
                "only byte-level BPE tokenizers are supported; this one decodes with "
                f"{type(backend.decoder).__name__} (SentencePiece-style vocabularies are not)"
            )
        # A second backend, identical but for matching special tokens in its input, encodes raw
        # prompts (`parse_special=True`); the flag is per backend, and instances are shared
        # between threads, so it is never toggled.
        self._parsing_backend = Backend.from_str(backend.to_str())
        self._parsing_backend.encode_special_tokens = False
        # Plain-text encoding: special tokens in the input are never matched.
        backend.encode_special_tokens = True
        self._backend = backend
        self._bos_token_id = bos_token_id
        self._eos_token_id = eos_token_id
        ends = set(eos_token_ids)
        if eos_token_id is not None:
            ends.add(eos_token_id)
        self._eos_token_ids = frozenset(ends)
        self._chat_template = chat_template
        self._compiled_template: jinja2.Template | None = None
        self._add_bos = add_bos

        added = backend.get_added_tokens_decoder()
        self._special_token_ids = frozenset(i for i, token in added.items() if token.special)
        self._special_by_text = {added[i].content: i for i in sorted(self._special_token_ids)}
        longest_first = sorted(self._special_by_text, key=len, reverse=True)
        # (?!) never matches: a vocabulary without special tokens splits nothing.
        self._special_re = re.compile("|".join(map(re.escape, longest_first)) or "(?!)")

        vocab_size = backend.get_vocab_size(with_added_tokens=True)
        self._token_bytes: list[bytes] = []
        for token_id in range(vocab_size):
            token = backend.id_to_token(token_id)
            self._token_bytes.append(b"" if token is None else _byte_level_bytes(token))
        # The same table with special tokens left out, for skip_special_tokens=True.
        self._token_bytes_skipping = list(self._token_bytes)
        for token_id in self._special_token_ids:
            self._token_bytes_skipping[token_id] = b""

    # --- construction ---------------------------------------------------------------------

    @classmethod
    def from_gguf(cls, path: str | Path, fields: Mapping[str, Any] | None = None) -> Tokenizer:
        """The tokenizer described by a GGUF file's metadata.

        `fields` is `gguf.GGUFReader(path).fields` when the caller has parsed the file already
        (parsing takes seconds); plain values in place of reader fields are accepted too.
        """
        if fields is None:
            import gguf

            fields = gguf.GGUFReader(str(path)).fields
        model = _field_value(fields, "tokenizer.ggml.model")
        if model != "gpt2":
            raise ValueError(
                f"GGUF tokenizer model {model!r} is not supported; only byte-level BPE ('gpt2') "
                "vocabularies are (SentencePiece 'llama' vocabularies are not)"
            )
        tokens = list(_field_value(fields, "tokenizer.ggml.tokens", []))
        merges = list(_field_value(fields, "tokenizer.ggml.merges", []))
        token_types = list(_field_value(fields, "tokenizer.ggml.token_type", []))
        pre = _field_value(fields, "tokenizer.ggml.pre", "gpt2")
        if not tokens:
            raise ValueError(f"{path}: no tokenizer.ggml.tokens in the GGUF metadata")

        spelled = [_respell_byte_level(token) for token in tokens]
        vocab = {token: token_id for token_id, token in enumerate(spelled)}
        backend = Backend(
            models.BPE(
                vocab=vocab,
                merges=[tuple(merge.split(" ", 1)) for merge in merges],
                dropout=None,
                continuing_subword_prefix="",
                end_of_word_suffix="",
                fuse_unk=False,
            )
        )
        backend.pre_tokenizer = _byte_level_pre_tokenizer(pre)
        backend.decoder = decoders.ByteLevel()

        alphabet = set(_CHAR_TO_BYTE)
        control = []
        user_defined = []
        for token, token_type in zip(tokens, token_types, strict=False):
            if token_type == _TOKEN_TYPE_CONTROL and set(token) <= alphabet:
                control.append(AddedToken(token, normalized=False, special=True))
            elif token_type == _TOKEN_TYPE_USER_DEFINED and token in vocab:
                # llama.cpp matches user-defined tokens whole, inside plain text too.
                user_defined.append(AddedToken(token, normalized=False, special=False))
        backend.add_special_tokens(control)
        backend.add_tokens(user_defined)

        eos_ids = {
            _field_value(fields, f"tokenizer.ggml.{name}_token_id")
            for name in ("eos", "eot", "eom")
        }
        eos_ids |= {
            token_id
            for token_id, (token, token_type) in enumerate(zip(tokens, token_types, strict=False))
            if token_type == _TOKEN_TYPE_CONTROL and token in _END_OF_GENERATION_TEXTS
        }
        eos_ids.discard(None)
        return cls(
            backend,
            bos_token_id=_field_value(fields, "tokenizer.ggml.bos_token_id"),
            eos_token_id=_field_value(fields, "tokenizer.ggml.eos_token_id"),
            eos_token_ids=eos_ids,
            chat_template=_field_value(fields, "tokenizer.chat_template"),
            add_bos=bool(_field_value(fields, "tokenizer.ggml.add_bos_token", False)),
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
        )

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
        """Control tokens: never produced by `encode`, dropped by skip_special_tokens."""
        return self._special_token_ids

    @property
    def chat_template(self) -> str | None:
        """The Jinja chat template, if the model has one."""
        return self._chat_template

    @property
    def add_bos(self) -> bool:
        """Whether the model expects a BOS token before a plain prompt."""
        return self._add_bos

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
        backend = self._parsing_backend if parse_special else self._backend
        ids = backend.encode(text, add_special_tokens=False).ids
        if add_bos:
            if self._bos_token_id is None:
                raise ValueError("this vocabulary has no BOS token")
            ids.insert(0, self._bos_token_id)
        return ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """The text of `ids`; byte sequences that are not valid UTF-8 become U+FFFD."""
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

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
        self, *, stop: Sequence[str] | None = (), skip_special_tokens: bool = True
    ) -> IncrementalDetokenizer:
        """A fresh incremental detokenizer for one generated sequence (`stop`: None or a
        sequence of stop strings; empty strings are ignored)."""
        table = self._token_bytes_skipping if skip_special_tokens else self._token_bytes
        return IncrementalDetokenizer(table, stop=stop)

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
        ids: list[int] = []
        start = 0
        for match in self._special_re.finditer(rendered):
            if match.start() > start:
                ids += self.encode(look_alikes.restore(rendered[start : match.start()]))
            ids.append(self._special_by_text[match.group(0)])
            start = match.end()
        if start < len(rendered):
            ids += self.encode(look_alikes.restore(rendered[start:]))
        return ids

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
    if all(char in _CHAR_TO_BYTE for char in token):
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
    same ids exactly. Each `add` costs time in proportion to the token and the longest stop
    string, never to the text so far.
    """

    def __init__(self, token_bytes: Sequence[bytes], *, stop: Sequence[str] | None = ()) -> None:
        self._token_bytes = token_bytes
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
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
        data = self._token_bytes[token_id] if 0 <= token_id < len(self._token_bytes) else b""
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
