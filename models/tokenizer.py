"""Tokenizer, incremental detokenizer and chat-template entry point for a loaded model.

One `Tokenizer` wraps a Hugging Face `tokenizers.Tokenizer` (Rust, fast) plus what the model
needs around it: the BOS/EOS ids, whether BOS is prepended, the special-token strings and the
model's chat template. Two ways in:

    Tokenizer.from_gguf(path_or_reader)   # GGUF metadata: vocab + merges + token types + template
    Tokenizer.from_hf_dir(path)   # tokenizer.json + tokenizer_config.json (+ generation_config)

A GGUF stores no tokenizer.json, only llama.cpp's metadata. `from_gguf` rebuilds the byte-level
BPE the way `transformers` does for the same file (transformers/integrations/gguf/
gguf_tokenizer_mapping.py: `byte_level_tokenizer`, `add_gguf_special_tokens`, `set_split_regex`),
so our ids equal `AutoTokenizer.from_pretrained(folder, gguf_file=...)`'s (the tests check it),
except that by default the pre-tokenizer follows llama.cpp where the two disagree: a run of
spaces before a digit in SmolLM2's vocabulary (see `Compat`; `compat="transformers"` matches
transformers exactly).

Streaming text out of a generation goes through `new_detokenizer()`: see
`IncrementalDetokenizer` below for why it decodes a sliding window of tokens.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import tokenizers
from tokenizers import AddedToken, Regex, decoders, pre_tokenizers, processors

from engine.errors import InvalidRequestError
from models.chat_template import ChatTemplate, ChatTemplateError
from models.errors import ModelLoadError

# GGUF token_type values (llama.cpp's llama_token_type).
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4

# Split regexes for `tokenizer.ggml.pre` values whose pre-tokenizer is not GPT-2's, copied from
# transformers' GGUF converter (which copied them from llama.cpp's llama-vocab.cpp).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLIT_REGEX_BY_PRE = {
    **dict.fromkeys(
        ("llama-bpe", "llama3", "llama-v3", "smaug-bpe", "dbrx", "falcon3"), _LLAMA3_SPLIT
    ),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen"), _QWEN2_SPLIT),
}
# GPT-2's own regex (ByteLevel(use_regex=True)) ...
_GPT2_PRE = ("gpt2", "gpt-2", "default", "mpt", "olmo")
# ... after isolating every digit (llama.cpp's "\p{N}" pass; Digits(individual_digits) in the
# models' own tokenizer.json). See `Compat` for why this set matters.
_DIGITS_THEN_GPT2_PRE = ("smollm", "starcoder", "refact", "codeshell")
SUPPORTED_GGUF_PRE = tuple(sorted((*_GPT2_PRE, *_DIGITS_THEN_GPT2_PRE, *_SPLIT_REGEX_BY_PRE)))

# Whose reading of `tokenizer.ggml.pre` to follow where llama.cpp and transformers disagree.
# They disagree only on the digit-isolating pre-tokenizers above ("smollm"...): transformers'
# GGUF converter (5.x) does not know them and falls back to plain GPT-2 splitting. The ids then
# differ for a run of spaces before a digit: "a   3" is [a, ĠĠĠ, 3] for llama.cpp and for
# SmolLM2's own tokenizer.json (what the model was trained on), but [a, ĠĠ, Ġ, 3] for
# transformers. Everything else is identical (the tests check both settings).
Compat = Literal["llama.cpp", "transformers"]


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table: how byte-level BPE spells raw bytes."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


class Tokenizer:
    """Text <-> token ids for one model, plus its chat template."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        bos_token_id: int | None,
        eos_token_ids: Sequence[int],
        chat_template: ChatTemplate | None = None,
        special_tokens: Mapping[str, str | None] | None = None,
        source: str = "<tokenizer>",
    ):
        self.backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(int(i) for i in eos_token_ids))
        self.chat_template = chat_template
        # bos_token, eos_token, unk_token, pad_token: strings the chat template may use.
        self.special_tokens = dict(special_tokens or {})
        self.source = source
        # The post-processor decides BOS; read the answer off it rather than keeping a second flag.
        probe = backend.encode("a", add_special_tokens=True).ids
        self.add_bos = bos_token_id is not None and bool(probe) and probe[0] == bos_token_id
        self.sha256 = hashlib.sha256(backend.to_str().encode("utf-8")).hexdigest()

    # --- construction -----------------------------------------------------------------------

    @classmethod
    def from_gguf(
        cls, path_or_reader: str | os.PathLike | Any, compat: Compat = "llama.cpp"
    ) -> Tokenizer:
        """Build from a GGUF file's `tokenizer.*` metadata (path, or an open `gguf.GGUFReader`).

        `compat` picks whose pre-tokenizer to follow where llama.cpp and transformers disagree
        (only for digit-isolating vocabularies such as SmolLM2's; see `Compat`). The default
        follows llama.cpp, which matches how the model was trained.
        """
        if compat not in ("llama.cpp", "transformers"):
            raise ValueError(f"compat={compat!r}: expected 'llama.cpp' or 'transformers'")
        reader, source = _open_gguf(path_or_reader)
        meta = _GGUFMetadata(reader, source)
        model_kind = meta.get("tokenizer.ggml.model", required=True)
        if model_kind != "gpt2":
            raise ModelLoadError(
                f"{source}: tokenizer.ggml.model = {model_kind!r} is not supported (only 'gpt2', "
                "byte-level BPE); load the model's Hugging Face folder to use its tokenizer.json"
            )
        tokens = meta.get("tokenizer.ggml.tokens", required=True)
        token_types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
        backend = _byte_level_backend(
            tokens,
            meta.get("tokenizer.ggml.merges", required=True),
            token_types,
            meta.get("tokenizer.ggml.pre"),
            source,
            compat,
        )
        ids = {name: meta.token_id(key, len(tokens)) for name, key in _GGUF_ID_KEYS.items()}
        special = {name: tokens[i] if i is not None else None for name, i in ids.items()}
        _add_named_special_tokens(backend, special)
        add_bos = bool(meta.get("tokenizer.ggml.add_bos_token")) and ids["bos_token"] is not None
        add_eos = bool(meta.get("tokenizer.ggml.add_eos_token")) and ids["eos_token"] is not None
        backend.post_processor = _template_processing(
            (special["bos_token"], ids["bos_token"]) if add_bos else None,
            (special["eos_token"], ids["eos_token"]) if add_eos else None,
        )
        # End of turn / end of message also end a generation (Llama 3 writes <|eot_id|> there).
        eos_ids = [ids["eos_token"], *(meta.token_id(k, len(tokens)) for k in _GGUF_EXTRA_EOS_KEYS)]
        return cls(
            backend,
            bos_token_id=ids["bos_token"],
            eos_token_ids=[i for i in eos_ids if i is not None],
            chat_template=_chat_template(
                meta.get("tokenizer.chat_template"), f"{source}: tokenizer.chat_template"
            ),
            special_tokens=special,
            source=source,
        )

    @classmethod
    def from_hf_dir(cls, path: str | os.PathLike) -> Tokenizer:
        """Build from a HF folder: tokenizer.json, tokenizer_config.json, generation_config.json."""
        folder = Path(path)
        tokenizer_file = folder / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise ModelLoadError(
                f"{tokenizer_file}: no such file (a Hugging Face tokenizer needs it)"
            )
        try:
            backend = tokenizers.Tokenizer.from_file(str(tokenizer_file))
        except Exception as e:  # the Rust side raises plain Exception on bad JSON
            raise ModelLoadError(f"{tokenizer_file}: not a valid tokenizer.json ({e})") from e
        config = _read_json(folder / "tokenizer_config.json")
        special = {name: _token_content(config.get(name)) for name in _SPECIAL_TOKEN_NAMES}
        ids = {name: backend.token_to_id(tok) if tok else None for name, tok in special.items()}
        if "add_bos_token" in config or "add_eos_token" in config or backend.post_processor is None:
            # As transformers' TokenizersBackend: explicit flags rebuild the post-processor.
            add_bos = bool(config.get("add_bos_token")) and ids["bos_token"] is not None
            add_eos = bool(config.get("add_eos_token")) and ids["eos_token"] is not None
            backend.post_processor = _template_processing(
                (special["bos_token"], ids["bos_token"]) if add_bos else None,
                (special["eos_token"], ids["eos_token"]) if add_eos else None,
            )
        # generation_config.json may list more ids that end a generation (Llama 3: <|eot_id|>...).
        gen_eos = _read_json(folder / "generation_config.json").get("eos_token_id")
        gen_eos = gen_eos if isinstance(gen_eos, list) else [gen_eos]
        return cls(
            backend,
            bos_token_id=ids["bos_token"],
            eos_token_ids=[i for i in (ids["eos_token"], *gen_eos) if i is not None],
            chat_template=_hf_chat_template(folder, config),
            special_tokens=special,
            source=str(folder),
        )

    # --- text <-> ids -----------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`. `add_special_tokens` adds BOS/EOS as the model's config says
        (none for SmolLM2). Encode a rendered chat prompt with `add_special_tokens=False`: the
        template already wrote its own BOS (or use `encode_chat`)."""
        if not isinstance(text, str):
            raise TypeError(f"encode expects str, got {type(text).__name__}")
        try:
            # NOTE: encode_batch releases the interpreter lock while it works (encode holds
            # it: a 4 MB prompt stalled every other thread for ~2 s); same ids.
            return self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        except TypeError as e:  # the Rust side refuses lone surrogates, which are not UTF-8
            bad = next((i for i, c in enumerate(text) if 0xD800 <= ord(c) <= 0xDFFF), None)
            if bad is None:
                raise
            raise InvalidRequestError(
                f"text[{bad}]", text[bad], "must be valid Unicode (a lone surrogate is not)"
            ) from e

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Text of `ids` (invalid UTF-8 becomes U+FFFD). Same default as transformers."""
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    # --- chat -------------------------------------------------------------------------------

    @property
    def chat_template_sha256(self) -> str | None:
        return self.chat_template.sha256 if self.chat_template is not None else None

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        **kwargs: Any,
    ) -> str:
        """The prompt string for `messages`, as transformers' `apply_chat_template(...,
        tokenize=False)` renders it."""
        if self.chat_template is None:
            raise ChatTemplateError(f"{self.source}: this model has no chat template")
        return self.chat_template.render(
            messages,
            add_generation_prompt=add_generation_prompt,
            special_tokens=self.special_tokens,
            **kwargs,
        )

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        **kwargs: Any,
    ) -> list[int]:
        """Prompt token ids for `messages` (template rendered, then encoded without extra BOS).
        Message content is encoded as literal text: special-token strings in it do not become
        special ids (models/chat_encoding.py)."""
        from models.chat_encoding import encode_chat

        return encode_chat(self, messages, add_generation_prompt, **kwargs)

    def new_detokenizer(
        self, prompt_ids: Sequence[int] | None = None, skip_special_tokens: bool = True
    ) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self, prompt_ids, skip_special_tokens)

    def __repr__(self) -> str:
        return (
            f"Tokenizer(source={self.source!r}, vocab_size={self.vocab_size}, "
            f"bos={self.bos_token_id}, "
            f"eos={self.eos_token_ids}, add_bos={self.add_bos}, sha256={self.sha256[:12]}...)"
        )


class IncrementalDetokenizer:
    """Turns a stream of generated token ids into a stream of text deltas.

    Decoding token by token is wrong twice over: a multi-byte UTF-8 character (an emoji, CJK)
    can be split across tokens, and some decoders (SentencePiece's leading space) depend on the
    neighbouring tokens. So, as vLLM does, we decode a small window of recent tokens and emit
    only what is new and complete:

        tokens:  ... | prefix_offset .......... | read_offset ........ | end
                       already emitted text       not yet emitted
        new text = decode(tokens[prefix_offset:]) minus decode(tokens[prefix_offset:read_offset])

    If the window's text ends in U+FFFD, the last character is still incomplete: hold it back.
    The offsets only move past text that was emitted complete, so windows start on character
    boundaries and the deltas concatenate to `decode(all tokens)`. `flush()` emits whatever is
    left (a truly invalid byte sequence at the end stays U+FFFD, as in `decode`).
    """

    # Tokens of prompt context kept in the first window (enough for any decoder's look-behind).
    _PROMPT_CONTEXT_TOKENS = 5

    def __init__(
        self, tokenizer: Tokenizer, prompt_ids: Sequence[int] | None, skip_special_tokens: bool
    ):
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self.token_ids: list[int] = list(prompt_ids or ())
        self._prefix_offset = max(len(self.token_ids) - self._PROMPT_CONTEXT_TOKENS, 0)
        self._read_offset = len(self.token_ids)
        self._prefix_text = self._decode(self._prefix_offset, self._read_offset)

    def add_token(self, token_id: int) -> str:
        """Append one generated token; return the text it completes ('' mid-character)."""
        self.token_ids.append(int(token_id))
        text = self._decode(self._prefix_offset, len(self.token_ids))
        if len(text) <= len(self._prefix_text) or text.endswith("\ufffd"):
            return ""
        return self._emit(text)

    def add_tokens(self, token_ids: Sequence[int]) -> str:
        return "".join(self.add_token(t) for t in token_ids)

    def flush(self) -> str:
        """The text still held back (an incomplete character at the end), once generation ends."""
        if self._read_offset == len(self.token_ids):
            return ""
        text = self._decode(self._prefix_offset, len(self.token_ids))
        return self._emit(text) if len(text) > len(self._prefix_text) else ""

    def _emit(self, text: str) -> str:
        delta = text[len(self._prefix_text) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(self.token_ids)
        self._prefix_text = self._decode(self._prefix_offset, self._read_offset)
        return delta

    def _decode(self, start: int, stop: int) -> str:
        if start >= stop:
            return ""
        return self._tokenizer.decode(
            self.token_ids[start:stop], skip_special_tokens=self._skip_special
        )


# --- construction helpers --------------------------------------------------------------------

_SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")
_GGUF_ID_KEYS = {
    "bos_token": "tokenizer.ggml.bos_token_id",
    "eos_token": "tokenizer.ggml.eos_token_id",
    "unk_token": "tokenizer.ggml.unknown_token_id",
    "pad_token": "tokenizer.ggml.padding_token_id",
}
_GGUF_EXTRA_EOS_KEYS = ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")


def _open_gguf(path_or_reader: Any) -> tuple[Any, str]:
    """`(reader, name for messages)` from a path or an already open `gguf.GGUFReader`."""
    import gguf

    if isinstance(path_or_reader, gguf.GGUFReader):
        return path_or_reader, str(
            getattr(path_or_reader.data, "filename", None) or "<GGUF reader>"
        )
    source = os.fspath(path_or_reader)
    if not os.path.isfile(source):
        raise ModelLoadError(f"{source}: no such GGUF file")
    try:
        return gguf.GGUFReader(source), source
    # gguf raises ValueError, struct.error, IndexError... on a bad or truncated file.
    except Exception as e:
        raise ModelLoadError(f"{source}: not a readable GGUF file ({type(e).__name__}: {e})") from e


class _GGUFMetadata:
    """Typed access to a GGUF's metadata fields, with errors naming the file and the key."""

    def __init__(self, reader: Any, source: str):
        self._fields, self._source = reader.fields, source

    def get(self, key: str, required: bool = False) -> Any:
        field = self._fields.get(key)
        if field is None:
            if required:
                raise ModelLoadError(
                    f"{self._source}: GGUF metadata has no {key!r} (needed for the tokenizer)"
                )
            return None
        try:
            return field.contents()
        except Exception as e:
            raise ModelLoadError(
                f"{self._source}: GGUF metadata {key!r} is unreadable ({e})"
            ) from e

    def token_id(self, key: str, vocab_size: int) -> int | None:
        value = self.get(key)
        if value is None:
            return None
        if not isinstance(value, int) or not 0 <= value < vocab_size:
            raise ModelLoadError(
                f"{self._source}: GGUF metadata {key} = {value!r} is not a token id < {vocab_size}"
            )
        return value


def _add_named_special_tokens(
    backend: tokenizers.Tokenizer, special: Mapping[str, str | None]
) -> None:
    """BOS/EOS/UNK/PAD are special even where a file did not mark them (as in transformers)."""
    added = {t.content for t in backend.get_added_tokens_decoder().values()}
    missing = [
        AddedToken(t, normalized=False, special=True)
        for t in dict.fromkeys(special.values())
        if t and t not in added
    ]
    if missing:
        backend.add_special_tokens(missing)


def _template_processing(
    bos: tuple[str, int] | None, eos: tuple[str, int] | None
) -> processors.TemplateProcessing:
    """The post-processor adding BOS and/or EOS, as transformers' `update_post_processor`."""
    single = f"{bos[0] + ':0 ' if bos else ''}$A:0{' ' + eos[0] + ':0' if eos else ''}"
    pair = f"{single}{' ' + bos[0] + ':1' if bos else ''} $B:1{' ' + eos[0] + ':1' if eos else ''}"
    return processors.TemplateProcessing(
        single=single, pair=pair, special_tokens=[t for t in (bos, eos) if t]
    )


def _chat_template(text: Any, source: str) -> ChatTemplate | None:
    if isinstance(text, list):  # tokenizer_config may hold named templates: [{"name", "template"}]
        named = {t.get("name"): t.get("template") for t in text if isinstance(t, Mapping)}
        text = named.get("default")
    if not text:
        return None
    if not isinstance(text, str):
        raise ModelLoadError(f"{source}: chat template is a {type(text).__name__}, not text")
    try:
        return ChatTemplate(text, source=source)
    except ChatTemplateError as e:  # a model whose template does not compile does not load
        raise ModelLoadError(str(e)) from e


def _hf_chat_template(folder: Path, config: dict) -> ChatTemplate | None:
    """The template in tokenizer_config.json, or in chat_template.jinja (newer transformers)."""
    if config.get("chat_template") is not None:
        return _chat_template(
            config["chat_template"], f"{folder / 'tokenizer_config.json'}: chat_template"
        )
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        return _chat_template(jinja_file.read_text(encoding="utf-8"), str(jinja_file))
    return None


def _token_content(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(value, Mapping):
        return value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{path}: not valid JSON ({e})") from e


def _byte_level_pre_tokenizer(
    pre: str | None, source: str, compat: Compat
) -> pre_tokenizers.PreTokenizer:
    """The pre-tokenizer llama.cpp names `tokenizer.ggml.pre` (None: GPT-2's, the default)."""
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre is None or pre in _GPT2_PRE:
        return byte_level
    if pre in _DIGITS_THEN_GPT2_PRE:
        if compat == "transformers":
            return byte_level
        digits = pre_tokenizers.Digits(individual_digits=True)
        return pre_tokenizers.Sequence([digits, byte_level])
    if pre in _SPLIT_REGEX_BY_PRE:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_SPLIT_REGEX_BY_PRE[pre]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    raise ModelLoadError(
        f"{source}: tokenizer.ggml.pre = {pre!r} is not supported "
        f"(supported: {', '.join(SUPPORTED_GGUF_PRE)})"
    )


def _byte_level_backend(
    tokens: Sequence[str],
    merges: Sequence[str],
    token_types: Sequence[int],
    pre: str | None,
    source: str,
    compat: Compat,
) -> tokenizers.Tokenizer:
    """Byte-level BPE from llama.cpp's vocabulary, as transformers' `byte_level_tokenizer`."""
    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())
    # A token outside the byte alphabet (rare: a mislabelled added token) is respelled byte-wise.
    vocab = {
        tok if set(tok) <= alphabet else "".join(spelling[b] for b in tok.encode("utf-8")): i
        for i, tok in enumerate(tokens)
    }
    pairs = []
    for merge in merges:
        left, sep, right = merge.partition(" ")
        if not sep:
            raise ModelLoadError(
                f"{source}: tokenizer.ggml.merges entry {merge!r} is not 'left right'"
            )
        pairs.append((left, right))
    model = tokenizers.models.BPE(
        vocab=vocab,
        merges=pairs,
        dropout=None,
        continuing_subword_prefix="",
        end_of_word_suffix="",
        fuse_unk=False,
    )
    backend = tokenizers.Tokenizer(model)
    backend.pre_tokenizer = _byte_level_pre_tokenizer(pre, source, compat)
    backend.decoder = decoders.ByteLevel()
    # Control tokens (<|im_start|>...) match whole and are special; user-defined ones match whole.
    control = [
        AddedToken(tok, normalized=False, special=True)
        for tok, kind in zip(tokens, token_types)
        if kind == _TOKEN_TYPE_CONTROL and set(tok) <= alphabet
    ]
    user_defined = [
        AddedToken(tok, normalized=False, special=False)
        for tok, kind in zip(tokens, token_types)
        if kind == _TOKEN_TYPE_USER_DEFINED and tok in vocab
    ]
    backend.add_special_tokens(control)
    backend.add_tokens(user_defined)
    return backend
