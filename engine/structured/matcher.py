"""Host side of structured output: one grammar matcher per constrained request, the packed
token bitmask of a step, and the matcher's advance on each emitted token.

    add_request:  matcher = GrammarCache.matcher(constraint)   compile once per (constraint,
                                                               tokenizer sha256, vocab size),
                                                               then a cheap deep copy each
    each step:    mask = StructuredRequests.bitmask(rows)      [R, ceil(V/32)] int32; bit t of
                                                               row r set = token t allowed;
                                                               unconstrained rows all ones
    device:       sample(..., token_bitmask=mask)              engine/structured/mask.py
    each token:   StopChecker -> StructuredRequests.accept     matcher consumes the token;
                                                               grammar complete -> "stop"

EOS is allowed by the mask only where the grammar accepts (llguidance puts the EOS ids in
the mask exactly then). A matcher whose grammar can take no more tokens after a token
(`is_stopped`) ends the request with finish_reason "stop" at once, without spending a step
on EOS. When max_tokens comes first the request ends "length" and its output is an
incomplete document.

A matcher that errs (a token it refuses, or a mask step out of fuel) is logged; its row
then allows only EOS, so the request ends at its next step instead of producing text the
grammar forbids.
"""

from __future__ import annotations

import collections
import logging
import threading

import llguidance
import llguidance.numpy as llnp
import numpy as np

from configs.errors import InvalidRequestError
from engine.structured.output import StructuredOutput, parser_limits
from engine.structured.vocab import TokenVocab, token_vocab

log = logging.getLogger(__name__)


def bitmask_width(vocab_size: int) -> int:
    """int32 words per mask row: ceil(V / 32)."""
    return (vocab_size + 31) // 32


class _VocabTokenizer:
    """What llguidance's TokenizerWrapper reads: token bytes, EOS/BOS, and an encoder."""

    def __init__(self, vocab: TokenVocab, tokenizer):
        self.tokens = list(vocab.token_bytes)
        self.eos_token_id = vocab.eos_token_ids[0]
        self.bos_token_id = vocab.bos_token_id
        self.special_token_ids = list(vocab.special_token_ids)
        self._tokenizer = tokenizer

    def __call__(self, text: bytes) -> list[int]:
        return self._tokenizer.encode(text.decode("utf-8", "replace"), add_special_tokens=False)


def ll_tokenizer(tokenizer, vocab_size: int) -> llguidance.LLTokenizer:
    """llguidance's view of our tokenizer (built from its bytes; no hub download)."""
    vocab = token_vocab(tokenizer, vocab_size)
    wrapper = llguidance.TokenizerWrapper(_VocabTokenizer(vocab, tokenizer))
    return llguidance.LLTokenizer(wrapper, n_vocab=vocab_size, eos_token=list(vocab.eos_token_ids))


class GrammarCache:
    """Compiled matchers keyed by (grammar, tokenizer sha256, vocab size), LRU-bounded; each
    request gets a deep copy of the cached, untouched matcher. Thread-safe (serving may
    compile off the engine thread)."""

    def __init__(self, tokenizer, vocab_size: int, max_entries: int = 256):
        self.tokenizer_key = (tokenizer.sha256, vocab_size)
        self.ll_tokenizer = ll_tokenizer(tokenizer, vocab_size)
        self.max_entries = max_entries
        self._entries: collections.OrderedDict = collections.OrderedDict()
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def matcher(self, constraint: StructuredOutput) -> llguidance.LLMatcher:
        key = (constraint.grammar_text, *self.tokenizer_key)
        with self._lock:
            template = self._entries.get(key)
            if template is not None:
                self._entries.move_to_end(key)
                self.hits += 1
                return template.deep_copy()
        template = self._compile(constraint)
        with self._lock:
            self.misses += 1
            self._entries[key] = template
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)
        return template.deep_copy()

    def _compile(self, constraint: StructuredOutput) -> llguidance.LLMatcher:
        m = llguidance.LLMatcher(
            self.ll_tokenizer, constraint.grammar_text, limits=parser_limits(), log_level=0
        )
        if m.is_error():
            raise InvalidRequestError(f"structured.{constraint.kind}", "...", m.get_error())
        return m


class StructuredRequests:
    """The matchers of the engine's constrained requests, by request id."""

    def __init__(self, tokenizer, vocab_size: int):
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(tokenizer.eos_token_ids)
        self._tokenizer = tokenizer
        self._cache: GrammarCache | None = None  # built on the first constrained request
        self._matchers: dict[str, llguidance.LLMatcher] = {}

    def set_tokenizer(self, tokenizer) -> None:
        """A reloaded model's tokenizer: new requests compile against it (the cache key
        holds the tokenizer's sha256); running requests keep their matchers."""
        if tokenizer.sha256 != self._tokenizer.sha256:
            self._tokenizer, self._cache = tokenizer, None
            self.eos_token_ids = tuple(tokenizer.eos_token_ids)

    @property
    def cache(self) -> GrammarCache:
        if self._cache is None:
            self._cache = GrammarCache(self._tokenizer, self.vocab_size)
        return self._cache

    @property
    def active(self) -> bool:
        """Whether any constrained request is in the engine."""
        return bool(self._matchers)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._matchers

    def compile(self, constraint: StructuredOutput) -> llguidance.LLMatcher:
        """A fresh matcher for a constraint (compiled once, cached); InvalidRequestError if
        it does not compile against this tokenizer."""
        return self.cache.matcher(constraint)

    def track(self, request_id: str, matcher: llguidance.LLMatcher) -> None:
        self._matchers[request_id] = matcher

    def remove(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)

    def accept(self, request_id: str, token_id: int) -> bool:
        """The matcher consumes an emitted token; True when the grammar is complete (no
        further token possible), i.e. the request stops here."""
        m = self._matchers.get(request_id)
        if m is None:
            return False
        if not m.consume_token(token_id):
            log.error(
                "request %s: token %d refused by its grammar: %s",
                request_id,
                token_id,
                m.get_error(),
            )
            return True
        return m.is_stopped()

    def bitmask(self, request_ids: list[str | None], num_rows: int) -> np.ndarray:
        """[num_rows, ceil(V/32)] int32: row i holds the allowed tokens of request_ids[i]
        (None or unconstrained: all ones; rows past the list: all ones)."""
        mask = np.full((num_rows, bitmask_width(self.vocab_size)), -1, np.int32)
        for row, rid in enumerate(request_ids):
            m = self._matchers.get(rid) if rid is not None else None
            if m is None:
                continue
            llnp.fill_next_token_bitmask(m, mask, row)
            if m.is_error():
                log.error("request %s: grammar mask failed: %s", rid, m.get_error())
                self._eos_only(mask[row])
        return mask

    def _eos_only(self, row: np.ndarray) -> None:
        bits = row.view(np.uint32)
        bits[:] = 0
        for t in self.eos_token_ids:
            bits[t // 32] |= np.uint32(1 << (t % 32))
