"""Streaming text out of a generation: token ids in, complete UTF-8 text deltas out."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class _Decoder(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str: ...


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
        self, tokenizer: _Decoder, prompt_ids: Sequence[int] | None, skip_special_tokens: bool
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
