"""Per-request sampling parameters and stop conditions (host side, validated on creation)."""

from __future__ import annotations

import dataclasses

from engine.errors import InvalidRequestError

MAX_STOP_STRINGS = 16
MAX_LOGPROBS = 20
# EOS ids + stop_token_ids are banned on device before min_tokens in a fixed 16-entry list.
MAX_STOP_TOKEN_IDS = 12


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop.

    temperature 0 is greedy. top_k 0 disables top-k; top_p 1 and min_p 0 disable those
    filters. Penalties follow vLLM: repetition_penalty (1 = off) divides positive / multiplies
    negative logits of tokens seen in prompt or output; presence/frequency penalties (0 = off)
    subtract from logits of tokens seen in the output. `seed` makes a request's samples
    independent of what else is in the batch. `logprobs` = N returns the sampled token's
    logprob and the top-N alternatives per step.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None

    def __post_init__(self):
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> None:
        checks = [
            ("temperature", self.temperature, 0.0 <= self.temperature <= 100.0, "0 <= x <= 100"),
            ("top_k", self.top_k, self.top_k >= 0, ">= 0 (0 disables)"),
            ("top_p", self.top_p, 0.0 < self.top_p <= 1.0, "0 < x <= 1"),
            ("min_p", self.min_p, 0.0 <= self.min_p <= 1.0, "0 <= x <= 1"),
            (
                "repetition_penalty",
                self.repetition_penalty,
                0.0 < self.repetition_penalty <= 10.0,
                "0 < x <= 10",
            ),
            (
                "presence_penalty",
                self.presence_penalty,
                -2.0 <= self.presence_penalty <= 2.0,
                "-2 <= x <= 2",
            ),
            (
                "frequency_penalty",
                self.frequency_penalty,
                -2.0 <= self.frequency_penalty <= 2.0,
                "-2 <= x <= 2",
            ),
            ("max_tokens", self.max_tokens, self.max_tokens >= 1, ">= 1"),
            (
                "min_tokens",
                self.min_tokens,
                0 <= self.min_tokens <= self.max_tokens,
                f"0 <= x <= max_tokens ({self.max_tokens})",
            ),
            (
                "stop",
                len(self.stop),
                len(self.stop) <= MAX_STOP_STRINGS,
                f"at most {MAX_STOP_STRINGS} stop strings",
            ),
            (
                "stop_token_ids",
                len(self.stop_token_ids),
                len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS,
                f"at most {MAX_STOP_TOKEN_IDS} stop token ids",
            ),
            (
                "logprobs",
                self.logprobs,
                self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
                f"0 <= x <= {MAX_LOGPROBS}",
            ),
        ]
        for field, value, ok, limit in checks:
            if not ok:
                raise InvalidRequestError(field, value, limit)
        if any(not s for s in self.stop):
            raise InvalidRequestError("stop", self.stop, "stop strings must be non-empty")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise InvalidRequestError("seed", self.seed, "0 <= seed < 2**63")
