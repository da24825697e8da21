"""Tokenizer and chat-template entry point for a loaded model.

One `Tokenizer` wraps a Hugging Face `tokenizers.Tokenizer` (Rust, fast) plus what the model
needs around it: the BOS/EOS ids, whether BOS is prepended, the special-token strings and the
model's chat template. Two ways in:

    tokenizer_from_gguf(path_or_reader)   # models/loaders/gguf_tokenizer.py: GGUF metadata
    Tokenizer.from_hf_dir(path)   # tokenizer.json + tokenizer_config.json (+ generation_config)

A GGUF stores no tokenizer.json, only llama.cpp's metadata: `tokenizer_from_gguf` rebuilds
the byte-level BPE from it (and says where it follows llama.cpp rather than transformers).

Streaming text out of a generation goes through `new_detokenizer()`: see
models/detokenizer.py's `IncrementalDetokenizer` for why it decodes a sliding window of tokens.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import processors

from configs.errors import InvalidRequestError
from models.chat_template import ChatTemplate, ChatTemplateError
from models.detokenizer import IncrementalDetokenizer
from models.errors import ModelLoadError


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
        self._token_texts: dict[int, str] = {}  # decode_token's memo, at most 2 x vocab
        # pair_deltas' memos, by skip_special_tokens (models/detokenizer.py fills them)
        self._pair_deltas: dict[bool, dict[int, str | None]] = {False: {}, True: {}}

    # --- construction -----------------------------------------------------------------------

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
            backend.post_processor = template_processing(
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

    def decode_token(self, token_id: int, skip_special_tokens: bool = False) -> str:
        """`decode([token_id])`, memoized (host time, issue 20): the detokenizer's window of
        the token it emitted last is one token, decoded again for every generated token."""
        key = token_id if skip_special_tokens else ~token_id  # ids are >= 0
        text = self._token_texts.get(key)
        if text is None:
            text = self._token_texts[key] = self.backend.decode([token_id], skip_special_tokens)
        return text

    def pair_deltas(self, skip_special_tokens: bool) -> dict[int, str | None]:
        """The detokenizer's memo of the delta token b adds after a one-token window a,
        keyed `a << 32 | b` (host time, issue 20; models/detokenizer.py fills and bounds it):
        shared by every request of this tokenizer, exact because decode is a pure function
        of the ids."""
        return self._pair_deltas[bool(skip_special_tokens)]

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


# --- construction helpers (also used by models/loaders/gguf_tokenizer.py) ---

_SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")


def template_processing(
    bos: tuple[str, int] | None, eos: tuple[str, int] | None
) -> processors.TemplateProcessing:
    """The post-processor adding BOS and/or EOS, as transformers' `update_post_processor`."""
    single = f"{bos[0] + ':0 ' if bos else ''}$A:0{' ' + eos[0] + ':0' if eos else ''}"
    pair = f"{single}{' ' + bos[0] + ':1' if bos else ''} $B:1{' ' + eos[0] + ':1' if eos else ''}"
    return processors.TemplateProcessing(
        single=single, pair=pair, special_tokens=[t for t in (bos, eos) if t]
    )


def load_chat_template(text: Any, source: str) -> ChatTemplate | None:
    """A compiled ChatTemplate from a config value (text or named list); None if absent.
    `source` names the file and field in errors (ModelLoadError)."""
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
        return load_chat_template(
            config["chat_template"], f"{folder / 'tokenizer_config.json'}: chat_template"
        )
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        return load_chat_template(jinja_file.read_text(encoding="utf-8"), str(jinja_file))
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
