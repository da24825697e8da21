"""Streaming text out of a generation: token ids in, complete UTF-8 text deltas out.

`IncrementalDetokenizer` serves one request; `detokenize_step` advances every request of an
engine step at once: the windows of all of them go to the tokenizer's `decode_batch` per
(tokenizer, skip_special_tokens) group (at 256 running requests the Python layers around
each request's one or two `decode` calls were most of the detokenizer's host time).
The window of the text emitted last is usually one token: its text comes from the
tokenizer's memo (`Tokenizer.decode_token`, exact: decode is a pure function of the ids),
so a generated token costs one `decode` call, not two.
"""

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
        # decode of a one-token window, memoized by the tokenizer when it can (host time)
        self._decode_token = getattr(tokenizer, "decode_token", None)
        # detokenize_step decodes detokenizers of one key together; None: one by one
        self.batch_key = (
            (id(tokenizer), skip_special_tokens) if hasattr(tokenizer, "decode_batch") else None
        )
        self.token_ids: list[int] = list(prompt_ids or ())
        self._prefix_offset = max(len(self.token_ids) - self._PROMPT_CONTEXT_TOKENS, 0)
        self._read_offset = len(self.token_ids)
        # decode(token_ids[prefix_offset:read_offset]); None = not decoded yet (after an
        # emit it is decoded with the next token's window, in the same batch).
        self._prefix_text: str | None = None

    def add_token(self, token_id: int) -> str:
        """Append one generated token; return the text it completes ('' mid-character)."""
        self.token_ids.append(int(token_id))
        if self._prefix_text is None:
            self._prefix_text = self._decode(self._prefix_offset, self._read_offset)
        return self._accept(self._decode(self._prefix_offset, len(self.token_ids)))

    def add_tokens(self, token_ids: Sequence[int]) -> str:
        return "".join(self.add_token(t) for t in token_ids)

    def flush(self) -> str:
        """The text still held back (an incomplete character at the end), once generation ends."""
        if self._read_offset == len(self.token_ids):
            return ""
        if self._prefix_text is None:
            self._prefix_text = self._decode(self._prefix_offset, self._read_offset)
        text = self._decode(self._prefix_offset, len(self.token_ids))
        return self._emit(text) if len(text) > len(self._prefix_text) else ""

    def _accept(self, text: str) -> str:
        """The delta of the window's text `text` (the last token already appended)."""
        if len(text) <= len(self._prefix_text) or text.endswith("\ufffd"):
            return ""
        return self._emit(text)

    def _emit(self, text: str) -> str:
        delta = text[len(self._prefix_text) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(self.token_ids)
        self._prefix_text = None
        return delta

    def _decode(self, start: int, stop: int) -> str:
        if start >= stop:
            return ""
        if stop - start == 1 and self._decode_token is not None:
            return self._decode_token(self.token_ids[start], self._skip_special)
        return self._tokenizer.decode(
            self.token_ids[start:stop], skip_special_tokens=self._skip_special
        )


def detokenize_step(detokenizers: Sequence, token_ids: Sequence[int]) -> list[str]:
    """`[d.add_token(t) for d, t in zip(detokenizers, token_ids)]`, same results, with the
    IncrementalDetokenizers' windows decoded in one `decode_batch` call per (tokenizer,
    skip_special_tokens) group. Other detokenizers (any object with add_token) run one by
    one; so do all when a tokenizer has no decode_batch."""
    texts: list[str] = [""] * len(detokenizers)
    groups: dict[tuple[int, bool], list[int]] = {}
    for i, d in enumerate(detokenizers):
        key = getattr(d, "batch_key", None)
        if key is None:
            texts[i] = d.add_token(token_ids[i])
        elif key in groups:
            groups[key].append(i)
        else:
            groups[key] = [i]
    for rows in groups.values():
        _decode_group([detokenizers[i] for i in rows], [token_ids[i] for i in rows], rows, texts)
    return texts


def _decode_group(detoks: list[IncrementalDetokenizer], token_ids, rows, texts) -> None:
    """One decode_batch over each detokenizer's window. A stale prefix window (the text
    emitted last) is decoded first: one token (the common case) from the tokenizer's memo,
    longer ones with the windows."""
    first = detoks[0]
    windows, stale = [], []
    for d, t in zip(detoks, token_ids):
        ids = d.token_ids
        ids.append(int(t))
        if d._prefix_text is None:
            start, stop = d._prefix_offset, d._read_offset
            if stop - start == 1 and d._decode_token is not None:
                d._prefix_text = d._decode_token(ids[start], d._skip_special)
            elif start >= stop:
                d._prefix_text = ""
            else:
                stale.append(d)
                windows.append(ids[start:stop])
        windows.append(ids[d._prefix_offset :])
    decoded = first._tokenizer.decode_batch(windows, first._skip_special)
    if stale:  # rare: a prefix window of several tokens (after a held character)
        decoded = _take_stale_prefixes(detoks, stale, decoded)
    for d, i, text in zip(detoks, rows, decoded):
        # d._accept(text), inlined: the common path of every generated token
        prefix = d._prefix_text
        if len(text) <= len(prefix) or text.endswith("\ufffd"):
            texts[i] = ""
            continue
        texts[i] = text[len(prefix) :]
        d._prefix_offset, d._read_offset = d._read_offset, len(d.token_ids)
        d._prefix_text = None


def _take_stale_prefixes(detoks, stale, decoded: list[str]) -> list[str]:
    """`decoded` holds each stale detokenizer's prefix text right before its window's text
    (the order `_decode_group` appended them): set the prefixes, return the windows'."""
    stale_ids = {id(d) for d in stale}
    out, k = [], 0
    for d in detoks:
        if id(d) in stale_ids:
            d._prefix_text = decoded[k]
            k += 1
        out.append(decoded[k])
        k += 1
    return out
