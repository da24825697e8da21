"""Per-request sampling parameters and stop conditions (host side, validated on creation).

vLLM's spellings are accepted where they mean the same thing: `top_k=-1` (off, stored as 0),
`stop=None` or one string, `stop_token_ids=None`, `n`, `include_stop_str_in_output`,
`skip_special_tokens`. A value of the wrong type raises SamplingTypeError (a TypeError and an
InvalidRequestError) naming the field and the expected type, before any range check.
"""

from __future__ import annotations

import dataclasses
import numbers

from engine.errors import InvalidRequestError
from engine.structured.output import StructuredOutput

MAX_STOP_STRINGS = 16
MAX_LOGPROBS = 20
# EOS ids + stop_token_ids are banned on device before min_tokens in a fixed 16-entry list.
MAX_STOP_TOKEN_IDS = 12
MAX_N = 64  # completions per prompt (LLM.generate adds one engine request per completion)


class SamplingTypeError(InvalidRequestError, TypeError):
    """A field has the wrong type: names the field, the value and the expected type."""

    def __init__(self, field: str, value, expected: str):
        InvalidRequestError.__init__(
            self, field, value, f"expected {expected}, got {type(value).__name__}"
        )


def _is_int(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _is_real(v) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


# field -> (predicate, expected type in words); None values are checked by validate().
_TYPES = {
    "temperature": (_is_real, "a number (float)"),
    "top_k": (_is_int, "an int"),
    "top_p": (_is_real, "a number (float)"),
    "min_p": (_is_real, "a number (float)"),
    "repetition_penalty": (_is_real, "a number (float)"),
    "presence_penalty": (_is_real, "a number (float)"),
    "frequency_penalty": (_is_real, "a number (float)"),
    "seed": (lambda v: v is None or _is_int(v), "an int or None"),
    "max_tokens": (_is_int, "an int"),
    "min_tokens": (_is_int, "an int"),
    "n": (_is_int, "an int"),
    "ignore_eos": (lambda v: isinstance(v, bool), "a bool"),
    "include_stop_str_in_output": (lambda v: isinstance(v, bool), "a bool"),
    "skip_special_tokens": (lambda v: isinstance(v, bool), "a bool"),
    "logprobs": (lambda v: v is None or _is_int(v), "an int or None"),
}


def _as_tuple(field: str, value, item_ok, expected: str) -> tuple:
    """None -> (); one string -> (string,); else a tuple whose items pass `item_ok`."""
    if value is None:
        return ()
    if isinstance(value, str):
        value = (value,)
    try:
        items = tuple(value)
    except TypeError:
        raise SamplingTypeError(field, value, expected) from None
    for item in items:
        if not item_ok(item):
            raise SamplingTypeError(field, item, expected)
    return items


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop.

    temperature 0 is greedy. top_k 0 (or vLLM's -1) disables top-k; top_p 1 and min_p 0
    disable those filters. Penalties follow vLLM: repetition_penalty (1 = off) divides
    positive / multiplies negative logits of tokens seen in prompt or output;
    presence/frequency penalties (0 = off) subtract from logits of tokens seen in the
    output. `seed` makes a request's samples
    independent of what else is in the batch. `logprobs` = N returns the sampled token's
    logprob and the top-N alternatives per step. `n` completions per prompt (LLM.generate; they
    share the prompt's KV pages through the prefix cache). `include_stop_str_in_output` keeps
    a matched stop string at the end of the text; `skip_special_tokens` (default) drops special
    tokens from the text (token ids are always complete). `structured` constrains the output
    to a JSON Schema, any JSON object, a regex, a choice of strings or a grammar
    (engine/structured/output.py; a dict such as {"json_schema": {...}} is accepted).
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
    n: int = 1
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    structured: StructuredOutput | None = None

    def __post_init__(self):
        for field, (ok, expected) in _TYPES.items():
            value = getattr(self, field)
            if not ok(value):
                raise SamplingTypeError(field, value, expected)
        stop = _as_tuple("stop", self.stop, lambda s: isinstance(s, str), "str or list of str")
        stop_ids = _as_tuple("stop_token_ids", self.stop_token_ids, _is_int, "list of int")
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in stop_ids))
        if self.top_k == -1:  # vLLM's spelling of "off"
            object.__setattr__(self, "top_k", 0)
        if isinstance(self.structured, dict):
            object.__setattr__(self, "structured", StructuredOutput.from_dict(self.structured))
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> None:
        checks = [
            ("temperature", self.temperature, 0.0 <= self.temperature <= 100.0, "0 <= x <= 100"),
            ("top_k", self.top_k, self.top_k >= 0, ">= 0 (0 or -1 disables)"),
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
            ("n", self.n, 1 <= self.n <= MAX_N, f"1 <= n <= {MAX_N}"),
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
        self._validate_structured()

    def _validate_structured(self) -> None:
        if self.structured is None:
            return
        if not isinstance(self.structured, StructuredOutput):
            raise SamplingTypeError("structured", self.structured, "a StructuredOutput or dict")
        # NOTE: the grammar decides where the output may end; banning EOS before min_tokens
        # could leave a row with no allowed token at all.
        if self.min_tokens:
            raise InvalidRequestError(
                "min_tokens", self.min_tokens, "must be 0 with structured output"
            )
