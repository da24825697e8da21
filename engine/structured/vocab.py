"""Our tokenizer as a grammar engine sees it: each token id's bytes.

Grammar engines (llguidance, xgrammar) compute token masks over a byte trie of the
vocabulary, so they need every id's exact bytes, not its display string. The project's
tokenizers are byte-level BPE (GPT-2's byte -> printable-character table, models/tokenizer.py
`bytes_to_unicode`), so a token's bytes are its vocabulary string read back through that
table. Added special tokens (BOS, EOS, chat markers) are not text: llguidance's convention
marks them with a leading 0xFF byte (never valid UTF-8) so no grammar can produce them.
Ids past the tokenizer's vocabulary, up to the model's (padded) vocab size, get empty
bytes: no grammar allows them.

Built from the in-memory `tokenizers.Tokenizer` only (no hub download); cached per
(tokenizer sha256, model vocab size).
"""

from __future__ import annotations

import dataclasses
import functools

from models.tokenizer import Tokenizer, bytes_to_unicode

SPECIAL_PREFIX = b"\xff"  # llguidance: a token whose bytes start with 0xFF is special


@dataclasses.dataclass(frozen=True)
class TokenVocab:
    """The bytes of every id in [0, vocab_size) and the ids that end a generation."""

    token_bytes: tuple[bytes, ...]  # [vocab_size]; special tokens prefixed with 0xFF
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    special_token_ids: tuple[int, ...]
    tokenizer_sha256: str

    @property
    def vocab_size(self) -> int:
        return len(self.token_bytes)


def token_vocab(tokenizer: Tokenizer, vocab_size: int) -> TokenVocab:
    """The vocabulary of `tokenizer` padded to the model's `vocab_size` (cached)."""
    return _token_vocab(tokenizer, tokenizer.sha256, vocab_size)


@functools.lru_cache(maxsize=8)
def _token_vocab(tokenizer: Tokenizer, sha256: str, vocab_size: int) -> TokenVocab:
    backend = tokenizer.backend
    n = backend.get_vocab_size(with_added_tokens=True)
    if n > vocab_size:
        raise ValueError(f"tokenizer has {n} tokens > model vocab_size={vocab_size}")
    special = {i for i, t in backend.get_added_tokens_decoder().items() if t.special}
    byte_of = {ch: b for b, ch in bytes_to_unicode().items()}
    tokens = []
    for i in range(vocab_size):
        piece = backend.id_to_token(i) if i < n else None
        if piece is None:
            tokens.append(b"")
        elif i in special:
            tokens.append(SPECIAL_PREFIX + piece.encode("utf-8"))
        else:
            tokens.append(_piece_bytes(piece, byte_of))
    return TokenVocab(
        token_bytes=tuple(tokens),
        eos_token_ids=tuple(tokenizer.eos_token_ids),
        bos_token_id=tokenizer.bos_token_id,
        special_token_ids=tuple(sorted(special)),
        tokenizer_sha256=sha256,
    )


def _piece_bytes(piece: str, byte_of: dict[str, int]) -> bytes:
    """A byte-level BPE piece -> its bytes (a character outside the table: its UTF-8)."""
    if all(ch in byte_of for ch in piece):
        return bytes(byte_of[ch] for ch in piece)
    return piece.encode("utf-8")
