"""A `models.tokenizer.Tokenizer` from a GGUF file's `tokenizer.*` metadata (llama.cpp's
vocabulary, merges, token types, special ids and chat template): a GGUF stores no
tokenizer.json.

`tokenizer_from_gguf` rebuilds the byte-level BPE the way `transformers` does for the same
file (transformers/integrations/gguf/gguf_tokenizer_mapping.py: `byte_level_tokenizer`,
`add_gguf_special_tokens`, `set_split_regex`), so our ids equal
`AutoTokenizer.from_pretrained(folder, gguf_file=...)`'s (the tests check it), except that by
default the pre-tokenizer follows llama.cpp where the two disagree: a run of spaces before a
digit in SmolLM2's vocabulary (see `Compat`; `compat="transformers"` matches transformers
exactly).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import tokenizers
from tokenizers import AddedToken, Regex, decoders, pre_tokenizers

from models.errors import ModelLoadError
from models.loaders.gguf_loader import open_gguf
from models.tokenizer import Tokenizer, bytes_to_unicode, load_chat_template, template_processing

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

_GGUF_ID_KEYS = {
    "bos_token": "tokenizer.ggml.bos_token_id",
    "eos_token": "tokenizer.ggml.eos_token_id",
    "unk_token": "tokenizer.ggml.unknown_token_id",
    "pad_token": "tokenizer.ggml.padding_token_id",
}
_GGUF_EXTRA_EOS_KEYS = ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")


def tokenizer_from_gguf(
    path_or_reader: str | os.PathLike | Any, compat: Compat = "llama.cpp"
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
    if model_kind not in ("gpt2", "llama"):
        raise ModelLoadError(
            f"{source}: tokenizer.ggml.model = {model_kind!r} is not supported (supported: "
            "'gpt2' byte-level BPE, 'llama' SentencePiece); load the model's Hugging Face "
            "folder to use its tokenizer.json"
        )
    tokens = meta.get("tokenizer.ggml.tokens", required=True)
    token_types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    ids = {name: meta.token_id(key, len(tokens)) for name, key in _GGUF_ID_KEYS.items()}
    special = {name: tokens[i] if i is not None else None for name, i in ids.items()}
    if model_kind == "llama":
        from models.loaders.gguf_spm_tokenizer import spm_backend

        backend = spm_backend(tokens, token_types, special["unk_token"] or "<unk>")
    else:
        backend = _byte_level_backend(
            tokens,
            meta.get("tokenizer.ggml.merges", required=True),
            token_types,
            meta.get("tokenizer.ggml.pre"),
            source,
            compat,
        )
    _add_named_special_tokens(backend, special)
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token")) and ids["bos_token"] is not None
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token")) and ids["eos_token"] is not None
    backend.post_processor = template_processing(
        (special["bos_token"], ids["bos_token"]) if add_bos else None,
        (special["eos_token"], ids["eos_token"]) if add_eos else None,
    )
    # End of turn / end of message also end a generation (Llama 3 writes <|eot_id|> there).
    eos_ids = [ids["eos_token"], *(meta.token_id(k, len(tokens)) for k in _GGUF_EXTRA_EOS_KEYS)]
    from models.families import family_stop_tokens

    stops = family_stop_tokens(meta.get("general.architecture"))
    if stops:
        index = {tok: i for i, tok in enumerate(tokens)}
        eos_ids += [index[t] for t in stops if t in index]
    return Tokenizer(
        backend,
        bos_token_id=ids["bos_token"],
        eos_token_ids=[i for i in eos_ids if i is not None],
        chat_template=load_chat_template(*_chat_template(meta, source)),
        special_tokens=special,
        source=source,
    )


def _chat_template(meta: _GGUFMetadata, source: str) -> tuple[str | None, str]:
    """(template, where it came from): the file's, else its family's default (Gemma 3's GGUF
    releases ship none; models/families.py `default_chat_template`)."""
    template = meta.get("tokenizer.chat_template")
    if template is not None:
        return template, f"{source}: tokenizer.chat_template"
    from models.families import default_chat_template

    arch = meta.get("general.architecture")
    return default_chat_template(arch), f"the {arch} family's default chat template"


def _open_gguf(path_or_reader: Any) -> tuple[Any, str]:
    """`(reader, name for messages)` from a path or an already open `gguf.GGUFReader`."""
    import gguf

    if isinstance(path_or_reader, gguf.GGUFReader):
        return path_or_reader, str(
            getattr(path_or_reader.data, "filename", None) or "<GGUF reader>"
        )
    source = os.fspath(path_or_reader)
    return open_gguf(source), source


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
