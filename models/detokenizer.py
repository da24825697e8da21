"""Streaming text out of a generation: token ids in, complete UTF-8 text deltas out.

`IncrementalDetokenizer` serves one request; `detokenize_next(d, token)` is its `add_token`
with the common token's fast path. Host time
(issue 20): at 256 running requests the step's detokenization was the largest single host
cost, so the common token costs no tokenizer call at all:

  - the window of the text emitted last is usually one token, and its text comes from the
    tokenizer's memo (`Tokenizer.decode_token`);
  - when that window is one token `a` and nothing is held back, the new token `b`'s delta
    is a pure function of (a, b, skip_special_tokens): `decode([a, b])` minus `decode([a])`,
    or "held" when the text ends mid-character. `Tokenizer.pair_deltas(skip)` memoizes it
    (exact: decode is a pure function of the ids; bounded, cleared when full), and
    `detokenize_next` (one token of one request, what the engine calls per row) reads it
    for such rows. Other rows take `add_token`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

_MISS = object()
# Entries of one pair-delta memo before it is cleared (~100 bytes each: ~13 MB at most).
PAIR_MEMO_MAX_ENTRIES = 1 << 17


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
        # (a << 32 | b) -> delta of b after a one-token window a, None = held (module doc);
        # None when the tokenizer keeps no such memo (every token takes add_token)
        pair_deltas = getattr(tokenizer, "pair_deltas", None)
        self.pair_memo: dict | None = (
            None if pair_deltas is None else pair_deltas(skip_special_tokens)
        )
        self.token_ids: list[int] = list(prompt_ids or ())
        self._prefix_offset = max(len(self.token_ids) - self._PROMPT_CONTEXT_TOKENS, 0)
        self._read_offset = len(self.token_ids)
        # decode(token_ids[prefix_offset:read_offset]); None = not decoded yet
        self._prefix_text: str | None = None

    def add_token(self, token_id: int) -> str:
        """Append one generated token; return the text it completes ('' mid-character)."""
        self.token_ids.append(int(token_id))
        if self._prefix_text is None:
            self._prefix_text = self._decode(self._prefix_offset, self._read_offset)
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
        if self._prefix_text is None:
            self._prefix_text = self._decode(self._prefix_offset, self._read_offset)
        text = self._decode(self._prefix_offset, len(self.token_ids))
        return self._emit(text) if len(text) > len(self._prefix_text) else ""

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

    def _add_pair_token(self, token_id: int) -> str:
        """`add_token` for a one-token window with nothing held (what detokenize_next checked),
        filling the pair memo on a miss."""
        ids, memo = self.token_ids, self.pair_memo
        key = (ids[-1] << 32) | token_id
        before = self._prefix_offset, self._read_offset
        text = self.add_token(token_id)
        # held, or nothing new (text no longer than the prefix's): the offsets did not move
        delta = text if (self._prefix_offset, self._read_offset) != before else None
        if len(memo) >= PAIR_MEMO_MAX_ENTRIES:
            memo.clear()
        memo[key] = delta
        return text


def detokenize_next(d, token_id: int) -> str:
    """`d.add_token(token_id)`, same result; an IncrementalDetokenizer whose window is one
    emitted token with nothing held gets its delta from the pair memo (module docstring)
    without a tokenizer call. Called once per generated token (engine/sched/outputs.py)."""
    memo = d.pair_memo if d.__class__ is IncrementalDetokenizer else None
    if memo is None:
        return d.add_token(token_id)
    ids, read = d.token_ids, d._read_offset
    if read != len(ids) or d._prefix_offset != read - 1:  # not a one-token window
        return d.add_token(token_id)
    token_id = int(token_id)
    delta = memo.get((ids[-1] << 32) | token_id, _MISS)
    if delta is _MISS:
        return d._add_pair_token(token_id)
    ids.append(token_id)
    if delta is None:  # held back (or nothing new): the offsets stay
        return ""
    d._prefix_offset, d._read_offset, d._prefix_text = read, read + 1, None  # d._emit
    return delta
