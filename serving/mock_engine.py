"""A mock of the engine interface (engine/core.py EngineCore) whose arithmetic can be checked
by hand, so the serving layer is tested without a model or JAX (JetStream's mock_engine idea).

Tokenizer: one token per UTF-8 byte (token id = byte value, vocab 256, EOS = 0).
Generation: output token k (k = 1, 2, ...) of a request whose last prompt token is `t` is

    32 + (t - 32 + k) % 95          # the next printable ASCII characters, cyclically

so the prompt "abc" continues "defghij...", and "~" wraps to " !\"#...". One token per running
request per step. KV pages: a request holding `n` tokens (prompt + output) holds
ceil(n / page_size) pages; a request is scheduled only when `max_num_seqs` has a free slot and
its pages fit. When a running request cannot grow, the newest running one is preempted
(pages freed, back to the front of the waiting queue, recomputed later).

Prefix cache: page-aligned prompt prefixes seen before count as cached (at most
prompt_len - 1 tokens, rounded down to a page), so the same 9-token prompt sent twice with
page_size 4 has 8 cached tokens the second time.

Stop handling: a stop token id ends the request with "stop" (its id is in the output, its
text is not); a stop string ends it with "stop" and the text is cut before the string; text
that could still become a stop string is held back. min_tokens defers both.

Hooks for tests: `fail_next_steps(n)` makes the next n steps schedule and then raise
EngineStepError (with `.request_ids` of the scheduled requests, which are dropped and their
pages freed; pending aborts and deadlines wait for the next step, so no output is lost);
`abort_log` records (request_id, step at abort_request, step at which pages were freed).
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import math
import time

from engine.api_types import EngineRequest, RequestMetrics, RequestOutput
from engine.errors import DuplicateRequestError, EngineStepError, InvalidRequestError

VOCAB_SIZE = 256
EOS_TOKEN_ID = 0


def expected_continuation(last_prompt_token: int, num_tokens: int) -> list[int]:
    """The mock's output token ids, for tests to compare against."""
    return [32 + (last_prompt_token - 32 + k) % 95 for k in range(1, num_tokens + 1)]


@dataclasses.dataclass(frozen=True)
class MockIdentity:
    name: str = "mock"
    revision: str = "mock-rev-1"
    tokenizer_hash: str = "bytes-v1"
    chat_template_hash: str = "mock-chat-v1"
    engine_version: str = "mock-engine-0.1"


class ByteTokenizer:
    """token id = UTF-8 byte value."""

    eos_token_ids = (EOS_TOKEN_ID,)
    vocab_size = VOCAB_SIZE

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(int(i) % 256 for i in ids).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages, add_generation_prompt: bool = True) -> str:
        parts = [f"<{m['role']}>{m['content']}\n" for m in messages]
        return "".join(parts) + ("<assistant>" if add_generation_prompt else "")


@dataclasses.dataclass
class _Seq:
    req: EngineRequest
    arrival_s: float
    output_ids: list[int] = dataclasses.field(default_factory=list)
    token_times_s: list[float] = dataclasses.field(default_factory=list)
    text_sent: int = 0  # chars of output text already emitted
    num_pages: int = 0
    first_scheduled_s: float | None = None
    num_cached_tokens: int = 0
    num_preemptions: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.req.prompt_token_ids) + len(self.output_ids)


class MockEngine:
    """Implements the EngineCore interface. Driven by one thread only."""

    def __init__(
        self,
        *,
        max_num_seqs: int = 8,
        num_pages: int = 256,
        page_size: int = 4,
        max_model_len: int = 512,
        step_time_s: float = 0.0,
        identity: MockIdentity | None = None,
    ):
        self.identity = identity or MockIdentity()
        self.tokenizer = ByteTokenizer()
        self.max_num_seqs, self.num_pages, self.page_size = max_num_seqs, num_pages, page_size
        self.max_model_len, self.step_time_s = max_model_len, step_time_s
        self.waiting: collections.deque[_Seq] = collections.deque()
        self.running: list[_Seq] = []
        self.pages_used = 0
        self.num_steps = 0
        self.num_preemptions = 0
        self.prefix_queries_tokens = 0
        self.prefix_hit_tokens = 0
        self._seen_prefixes: set[tuple[int, ...]] = set()
        self._pending_aborts: list[tuple[str, int]] = []
        self._fail_steps = 0
        self.abort_log: list[tuple[str, int, int]] = []

    # ---- the engine interface -------------------------------------------------------------
    def add_request(self, request: EngineRequest) -> None:
        n = len(request.prompt_token_ids)
        if n == 0:
            raise InvalidRequestError("prompt", n, "at least one token")
        if n + request.sampling.max_tokens > self.max_model_len:
            raise InvalidRequestError(
                "max_tokens",
                request.sampling.max_tokens,
                f"prompt ({n}) + max_tokens <= {self.max_model_len}",
            )
        if n + request.sampling.max_tokens > self.num_pages * self.page_size:
            raise InvalidRequestError(
                "max_tokens",
                request.sampling.max_tokens,
                f"prompt ({n}) + max_tokens <= KV capacity "
                f"({self.num_pages * self.page_size} tokens)",
            )
        if any(s.req.request_id == request.request_id for s in self._all()):
            raise DuplicateRequestError(request.request_id)
        arrival = request.arrival_s if request.arrival_s is not None else time.monotonic()
        self.waiting.append(_Seq(request, arrival))

    def abort_request(self, request_id: str) -> None:
        self._pending_aborts.append((request_id, self.num_steps))

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self._pending_aborts)

    def fail_next_steps(self, n: int) -> None:
        self._fail_steps = n

    def step(self) -> list[RequestOutput]:
        self.num_steps += 1
        if self.step_time_s:
            time.sleep(self.step_time_s)
        if self._fail_steps > 0:  # aborts and deadlines wait, so no other output is lost
            self._fail_steps -= 1
            self._schedule(time.monotonic())
            failed = [s.req.request_id for s in self.running]
            for s in list(self.running):
                self._drop(s)
            err = EngineStepError(f"mock step {self.num_steps} failed (injected)")
            err.request_ids = failed
            raise err
        now = time.monotonic()
        outputs = self._apply_aborts(now) + self._expire(now)
        self._schedule(now)
        for seq in list(self.running):
            out = self._decode_one(seq, now)
            if out is not None:
                outputs.append(out)
        return outputs

    def stats(self) -> dict:
        return {
            "num_running": len(self.running),
            "num_waiting": len(self.waiting),
            "kv_pages_used": self.pages_used,
            "kv_pages_free": self.num_pages - self.pages_used,
            "kv_pages_total": self.num_pages,
            "kv_usage": self.pages_used / self.num_pages,
            "page_size": self.page_size,
            "num_preemptions": self.num_preemptions,
            "prefix_cache_queries_tokens": self.prefix_queries_tokens,
            "prefix_cache_hit_tokens": self.prefix_hit_tokens,
            "kv_capacity_tokens": self.num_pages * self.page_size,
            "max_model_len": self.max_model_len,
            "max_num_seqs": self.max_num_seqs,
            "num_steps": self.num_steps,
        }

    # ---- internals ------------------------------------------------------------------------
    def _all(self):
        return list(self.waiting) + self.running

    def _pages_for(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.page_size)

    def _drop(self, seq: _Seq) -> None:
        self.pages_used -= seq.num_pages
        seq.num_pages = 0
        if seq in self.running:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)

    def _finish(
        self, seq: _Seq, reason: str, now: float, new_ids=(), new_text="", new_times=()
    ) -> RequestOutput:
        self._drop(seq)
        return self._output(seq, list(new_ids), new_text, list(new_times), now, reason)

    def _apply_aborts(self, now: float) -> list[RequestOutput]:
        outputs = []
        by_id = {s.req.request_id: s for s in self._all()}
        for request_id, abort_step in self._pending_aborts:
            seq = by_id.pop(request_id, None)
            if seq is not None:
                outputs.append(self._finish(seq, "cancelled", now))
                self.abort_log.append((request_id, abort_step, self.num_steps))
        self._pending_aborts.clear()
        return outputs

    def _expire(self, now: float) -> list[RequestOutput]:
        late = [s for s in self._all() if s.req.deadline_s is not None and now >= s.req.deadline_s]
        return [self._finish(s, "timed_out", now) for s in late]

    def _schedule(self, now: float) -> None:
        while self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            need = self._pages_for(seq.num_tokens + 1)
            if self.pages_used + need > self.num_pages:
                return
            self.waiting.popleft()
            self.pages_used += need
            seq.num_pages = need
            if seq.first_scheduled_s is None:
                seq.first_scheduled_s = now
                seq.num_cached_tokens = self._prefix_lookup(seq.req.prompt_token_ids)
            self.running.append(seq)

    def _prefix_lookup(self, prompt: list[int]) -> int:
        self.prefix_queries_tokens += len(prompt)
        cached = 0
        for end in range(self.page_size, len(prompt), self.page_size):  # end <= len - 1
            key = tuple(prompt[:end])
            if key in self._seen_prefixes:
                cached = end
            self._seen_prefixes.add(key)
        self.prefix_hit_tokens += cached
        return cached

    def _grow(self, seq: _Seq) -> bool:
        """Make room for one more token of `seq`; preempt the newest other request if needed."""
        need = self._pages_for(seq.num_tokens + 1) - seq.num_pages
        while need > 0 and self.pages_used + need > self.num_pages:
            victim = self.running[-1]
            self.pages_used -= victim.num_pages
            victim.num_pages = 0
            self.running.remove(victim)
            self.waiting.appendleft(victim)
            victim.num_preemptions += 1
            self.num_preemptions += 1
            if victim is seq:
                return False
        self.pages_used += max(need, 0)
        seq.num_pages += max(need, 0)
        return True

    def _decode_one(self, seq: _Seq, now: float) -> RequestOutput | None:
        if seq not in self.running or not self._grow(seq):
            return None
        sp = seq.req.sampling
        last = seq.output_ids[-1] if seq.output_ids else seq.req.prompt_token_ids[-1]
        token = 32 + (last - 32 + 1) % 95
        seq.output_ids.append(token)
        seq.token_times_s.append(now)
        n_out = len(seq.output_ids)
        can_stop = n_out >= sp.min_tokens
        text = self.tokenizer.decode(seq.output_ids)
        reason, cut = None, len(text)
        if can_stop and token in sp.stop_token_ids:
            reason, cut = "stop", len(text) - 1
        elif can_stop and any(s in text for s in sp.stop):
            reason, cut = "stop", min(text.find(s) for s in sp.stop if s in text)
        elif n_out >= sp.max_tokens:
            reason = "length"
        else:
            cut = len(text) - _held_back(text, sp.stop)
        delta = text[seq.text_sent : max(cut, seq.text_sent)]
        seq.text_sent = max(cut, seq.text_sent)
        if reason is not None:
            return self._finish(seq, reason, now, [token], delta, [now])
        return self._output(seq, [token], delta, [now], now, None)

    def _output(self, seq: _Seq, ids, text, times, now, reason) -> RequestOutput:
        finished = reason is not None
        return RequestOutput(
            request_id=seq.req.request_id,
            new_token_ids=ids,
            new_text=text,
            token_times_s=times,
            finished=finished,
            finish_reason=reason,
            num_prompt_tokens=len(seq.req.prompt_token_ids),
            num_cached_tokens=seq.num_cached_tokens,
            num_output_tokens=len(seq.output_ids),
            metrics=_metrics(seq, now) if finished else None,
        )


def _held_back(text: str, stops) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
    best = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:n]):
                best = max(best, n)
                break
    return best


def _metrics(seq: _Seq, now: float) -> RequestMetrics:
    times = seq.token_times_s
    first = seq.first_scheduled_s
    return RequestMetrics(
        queue_s=None if first is None else first - seq.arrival_s,
        ttft_s=times[0] - seq.arrival_s if times else None,
        tpot_s=(times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else None,
        itl_s=[b - a for a, b in itertools.pairwise(times)],
        e2e_s=now - seq.arrival_s,
        cached_tokens=seq.num_cached_tokens,
        num_preemptions=seq.num_preemptions,
    )
