"""Speculative decoding options: `LLM(model, speculative={...})`, `--speculative=...`.

    SpeculativeConfig(method="ngram", num_speculative_tokens=4,
                      prompt_lookup_min=1, prompt_lookup_max=4, disable_by_batch_size=8)
    SpeculativeConfig(method="layers", num_speculative_tokens=4, num_draft_layers=8)

`method`: "ngram" (prompt lookup, model-free, engine/spec/ngram.py) or "layers"
(self-speculation from the target's first `num_draft_layers` layers plus its own head,
engine/spec/layers.py; checked against the model's layer count by the engine) or "draft"
(a separate `draft_model`, a preset name or path for models.registry.load_model, with the
target's tokenizer: engine/spec/draft.py). `disable_by_batch_size`: the engine stops speculating
while more than this many requests run (None: always speculate); the default comes from
benchmarks/spec_bench.py's measurement on this CPU (see benchmarks/RESULTS.md).
"""

from __future__ import annotations

import dataclasses
import json

METHODS = ("ngram", "layers", "draft")
PLANNED_METHODS = ()
MAX_SPECULATIVE_TOKENS = 16
DEFAULT_DISABLE_BY_BATCH_SIZE = 8  # measured: benchmarks/RESULTS.md, speculative decoding


def _check(field: str, value, ok: bool, limit: str) -> None:
    if not ok:
        raise ValueError(f"speculative.{field}={value!r} is invalid: {limit}")


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int = 4  # k: drafted tokens verified per step and sequence
    prompt_lookup_min: int = 2  # ngram: shortest suffix matched earlier in the sequence
    prompt_lookup_max: int = 4  # ngram: longest (tried first)
    disable_by_batch_size: int | None = DEFAULT_DISABLE_BY_BATCH_SIZE
    num_draft_layers: int | None = None  # layers: the target's first N layers draft (required)
    draft_model: str | None = None  # draft: the draft model's preset name or path (required)

    def __post_init__(self):
        if self.method in PLANNED_METHODS:
            raise NotImplementedError(
                f"speculative.method={self.method!r} is not implemented yet; "
                f"available: {list(METHODS)}"
            )
        _check("method", self.method, self.method in METHODS, f"one of {list(METHODS)}")
        k = self.num_speculative_tokens
        _check(
            "num_speculative_tokens",
            k,
            isinstance(k, int) and 1 <= k <= MAX_SPECULATIVE_TOKENS,
            f"an int in [1, {MAX_SPECULATIVE_TOKENS}]",
        )
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        _check("prompt_lookup_min", lo, isinstance(lo, int) and lo >= 1, "an int >= 1")
        _check(
            "prompt_lookup_max",
            hi,
            isinstance(hi, int) and hi >= lo,
            f"an int >= prompt_lookup_min ({lo})",
        )
        d = self.disable_by_batch_size
        _check(
            "disable_by_batch_size",
            d,
            d is None or (isinstance(d, int) and d >= 1),
            "None (never disable) or an int >= 1",
        )

        n = self.num_draft_layers
        if self.method == "layers":
            _check("num_draft_layers", n, isinstance(n, int) and n >= 1, "an int >= 1 (layers)")
        else:
            only = f"only with method='layers' (not {self.method!r})"
            _check("num_draft_layers", n, n is None, only)
        m = self.draft_model
        if self.method == "draft":
            _check("draft_model", m, isinstance(m, str) and m != "", "a model name or path")
        else:
            _check("draft_model", m, m is None, f"only with method='draft' (not {self.method!r})")

    @classmethod
    def of(cls, value) -> SpeculativeConfig | None:
        """None, a SpeculativeConfig, a dict of its fields, or a string: "" / "off" (None),
        "ngram", "ngram:k=4,disable_by_batch_size=8" or a JSON object."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            value = _parse(value)
            if value is None:
                return None
        if not isinstance(value, dict):
            raise ValueError(
                f"speculative={value!r} is invalid: None, a dict, a SpeculativeConfig or a string"
            )
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - names)
        _check("<keys>", unknown, not unknown, f"known keys are {sorted(names)}")
        return cls(**value)

    def describe(self) -> str:
        """One line for ServerInfo and the resolved versions, e.g. "ngram:k=4"."""
        layers = "" if self.num_draft_layers is None else f",layers={self.num_draft_layers}"
        model = "" if self.draft_model is None else f",model={self.draft_model}"
        return f"{self.method}:k={self.num_speculative_tokens}{layers}{model}"


_ALIASES = {"k": "num_speculative_tokens", "layers": "num_draft_layers", "model": "draft_model"}


def _parse(text: str) -> dict | None:
    text = text.strip()
    if text in ("", "off", "none"):
        return None
    if text.startswith("{"):
        return json.loads(text)
    method, _, rest = text.partition(":")
    out: dict = {"method": method}
    for item in filter(None, rest.split(",")):
        key, eq, val = item.partition("=")
        _check(item, item, bool(eq), "expected key=value")
        key = _ALIASES.get(key.strip(), key.strip())
        val = val.strip()
        out[key] = None if val.lower() == "none" else val if key == "draft_model" else int(val)
    return out
