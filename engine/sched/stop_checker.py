"""Host-side stop conditions for one request: turns each sampled token into the text to emit
now and, when the request is done, its finish reason.

Rules, checked in this order for every new token (output index i = tokens before it):
  1. EOS (unless ignore_eos) and stop_token_ids end the request with "stop" when i >= min_tokens;
     the stopping token's text is not emitted. (The sampler already bans them before
     min_tokens; if one still arrives it is treated as an ordinary token.)
  2. The token's text is appended; a stop string ends the request with "stop" when an
     occurrence of it ends in text of a token with i >= min_tokens. Everything after the stop
     string is never emitted, nor the stop string itself unless `include_stop_str_in_output`,
     also when it spans several tokens.
  3. `grammar_done(token)` (structured output, engine/structured/matcher.py: the matcher
     consumes the token) returning True ends the request with "stop", the token's text
     emitted (it completes the document).
  4. max_tokens reached ends the request with "length".

Streaming without leaking a stop string: text whose tail could still grow into a stop string
(the longest suffix that is a proper prefix of one) is held back until the next token decides
it; when the request finishes for another reason the held text is flushed.

    emitted | held ("</s" could become "</stop>") | new text ...
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import NamedTuple, Protocol

from engine.api_types import FinishReason
from engine.sampling.params import SamplingParams


class Detokenizer(Protocol):
    def add_token(self, token_id: int) -> str:
        """New, complete UTF-8 text produced by this token (may be empty)."""


class StopResult(NamedTuple):
    text: str  # to emit now
    finish_reason: FinishReason | None  # None while the request continues


class RequestFinishedError(RuntimeError):
    def __init__(self, num_tokens: int):
        super().__init__(f"the request already finished after {num_tokens} tokens")


class StopChecker:
    def __init__(
        self,
        sampling_params: SamplingParams,
        eos_token_ids: Iterable[int],
        detokenizer: Detokenizer,
        grammar_done: Callable[[int], bool] | None = None,
    ):
        self.params = sampling_params
        self._grammar_done = grammar_done
        self.detokenizer = detokenizer
        self.stop_ids = set(sampling_params.stop_token_ids)
        if not sampling_params.ignore_eos:
            self.stop_ids |= set(eos_token_ids)
        # host time (#20): what engine/sched/outputs.py's per-step fast path reads. A plain
        # request (no stop string, no grammar) whose next token is not a stop id and whose
        # output count stays below `continues_below` (max_tokens; 0 when not plain or
        # finished) only counts it: add_token's first and last rules decide everything.
        plain = not sampling_params.stop and grammar_done is None
        self.continues_below = sampling_params.max_tokens if plain else 0
        self.min_tokens = sampling_params.min_tokens
        self._held = ""  # text that may be the start of a stop string
        self.num_output_tokens = 0
        self.finish_reason: FinishReason | None = None

    def ends_on(self, token_id: int) -> bool:
        """Whether `token_id`, as the next output, ends the request as a stop id (rule 1):
        such a token is never detokenized (engine/sched/outputs.py batches the others)."""
        return token_id in self.stop_ids and self.num_output_tokens >= self.min_tokens

    def add_token(self, token_id: int, text: str | None = None) -> StopResult:
        """Account for one sampled token; returns the text to emit and the finish reason.
        `text`: what `self.detokenizer.add_token(token_id)` returned, when the caller ran
        the detokenizer already (a batched step; never for a token that `ends_on`)."""
        if self.finish_reason is not None:
            raise RequestFinishedError(self.num_output_tokens)
        index = self.num_output_tokens
        self.num_output_tokens += 1
        if token_id in self.stop_ids and index >= self.min_tokens:
            return self._finish("stop", self.flush())
        if text is None:
            text = self.detokenizer.add_token(token_id)
        if not self.params.stop:  # fast path: nothing is ever held back
            if self._grammar_done is not None and self._grammar_done(token_id):
                return self._finish("stop", text)
            if self.num_output_tokens >= self.params.max_tokens:
                return self._finish("length", text)
            return StopResult(text, None)
        text, stopped = self._scan(text, check=index >= self.params.min_tokens)
        if stopped:
            return self._finish("stop", text)
        if self._grammar_done is not None and self._grammar_done(token_id):
            return self._finish("stop", text + self.flush())
        if self.num_output_tokens >= self.params.max_tokens:
            return self._finish("length", text + self.flush())
        return StopResult(text, None)

    def continues(self, token_id: int) -> bool:
        """add_token's common case in one test, for a token whose text the caller emits
        as is: a plain request, a token that is not a stop id, below max_tokens. Then the
        token is counted and True returned; False changes nothing (call add_token)."""
        n = self.num_output_tokens + 1
        if n < self.continues_below and token_id not in self.stop_ids:
            self.num_output_tokens = n
            return True
        return False

    def flush(self) -> str:
        """The held-back text (for a request ending for any other reason)."""
        text, self._held = self._held, ""
        return text

    def _finish(self, reason: FinishReason, text: str) -> StopResult:
        self.finish_reason = reason
        self.continues_below = 0  # continues() no longer applies: add_token raises
        self._held = ""
        return StopResult(text, reason)

    def _scan(self, new_text: str, check: bool) -> tuple[str, bool]:
        """(text to emit, whether a stop string was found) after appending new_text."""
        buf = self._held + new_text
        if check:
            found = self._earliest_stop(buf, len(self._held))
            if found is not None:
                start, stop = found
                self._held = ""
                keep_stop = self.params.include_stop_str_in_output
                return buf[: start + len(stop) if keep_stop else start], True
        keep = self._longest_partial_stop(buf)
        self._held = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep], False

    def _earliest_stop(self, buf: str, held_len: int) -> tuple[int, str] | None:
        """(start, stop string) of the earliest occurrence that ends in the new text."""
        found = []
        for stop in self.params.stop:
            # Occurrences lying wholly inside the held text ended before min_tokens.
            start = buf.find(stop, max(0, held_len - len(stop) + 1))
            if start >= 0:
                found.append((start, stop))
        return min(found, default=None)

    def _longest_partial_stop(self, buf: str) -> int:
        """Length of the longest suffix of buf that is a proper prefix of a stop string."""
        best = 0
        for stop in self.params.stop:
            for n in range(min(len(stop) - 1, len(buf)), best, -1):
                if buf.endswith(stop[:n]):
                    best = n
                    break
        return best
