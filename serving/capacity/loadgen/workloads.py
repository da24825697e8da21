"""Workload classes, joint input/output length distributions, and prompts built from real text.

A run mixes classes by weight (`--workload=short_qa:0.5,long_context:0.2,...`). Each class
draws (prompt tokens, output tokens) from a joint lognormal with a correlation, then builds a
prompt of about that many tokens from the public-domain corpus in `corpus/` (so the server's
tokenizer sees real prose). The server reports the exact prompt token count; the report uses
that, not the target.

    class            prompt (median)   output (median)   notes
    short_qa               64               64
    long_context         1536               32           long prefill, short answer
    long_generation        64              512           holds KV for a long time
    shared_prefix     512 + 48               64           4 fixed system prompts (prefix cache)
    multi_tenant           96               96           tenants gold/silver/bronze, prio +1/0/-1

`length_scale` multiplies every length (a small CPU run uses 0.1-0.25). Priority is -1 (low),
0 (normal) or +1 (high), sent as the API's PRIORITY_LOW / NORMAL / HIGH.
"""

from __future__ import annotations

import dataclasses
import math
import pathlib
import random
import uuid

CORPUS_DIR = pathlib.Path(__file__).parent / "corpus"
TOKENS_PER_WORD = 1.3  # English prose under a GPT-2 style BPE, roughly


@dataclasses.dataclass(frozen=True)
class LengthDist:
    """Joint lognormal of (prompt tokens, output tokens) with correlation `rho` of the logs."""

    median_in: float
    median_out: float
    sigma_in: float = 0.5
    sigma_out: float = 0.5
    rho: float = 0.0
    min_tokens: int = 1
    max_in: int = 8192
    max_out: int = 4096

    def __post_init__(self):
        if not -1.0 <= self.rho <= 1.0:
            raise ValueError(f"rho={self.rho}: must be in [-1, 1]")
        if self.median_in <= 0 or self.median_out <= 0:
            raise ValueError(f"medians ({self.median_in}, {self.median_out}) must be > 0")

    def sample(self, rng: random.Random, scale: float = 1.0) -> tuple[int, int]:
        z1 = rng.gauss(0.0, 1.0)
        z2 = self.rho * z1 + math.sqrt(1.0 - self.rho**2) * rng.gauss(0.0, 1.0)
        n_in = self.median_in * scale * math.exp(self.sigma_in * z1)
        n_out = self.median_out * scale * math.exp(self.sigma_out * z2)
        clip = lambda v, hi: int(min(max(round(v), self.min_tokens), hi))
        return clip(n_in, self.max_in), clip(n_out, self.max_out)

    def mean_in(self, scale: float = 1.0) -> float:
        """E[prompt tokens] of the unclipped lognormal."""
        return self.median_in * scale * math.exp(self.sigma_in**2 / 2)

    def mean_out(self, scale: float = 1.0) -> float:
        return self.median_out * scale * math.exp(self.sigma_out**2 / 2)


@dataclasses.dataclass(frozen=True)
class WorkloadClass:
    name: str
    lengths: LengthDist
    shared_prefix_tokens: int = 0  # > 0: the prompt starts with one of `num_prefixes` prefixes
    num_prefixes: int = 1
    tenants: tuple[tuple[str, int, float], ...] = ()  # (tenant, priority, weight)


PRESETS: dict[str, WorkloadClass] = {
    "short_qa": WorkloadClass("short_qa", LengthDist(64, 64, 0.6, 0.6, 0.2)),
    "long_context": WorkloadClass("long_context", LengthDist(1536, 32, 0.4, 0.5, 0.0)),
    "long_generation": WorkloadClass("long_generation", LengthDist(64, 512, 0.5, 0.4, 0.0)),
    "shared_prefix": WorkloadClass(
        "shared_prefix", LengthDist(48, 64, 0.5, 0.5, 0.0), shared_prefix_tokens=512, num_prefixes=4
    ),
    "multi_tenant": WorkloadClass(
        "multi_tenant",
        LengthDist(96, 96, 0.6, 0.6, 0.3),
        tenants=(("gold", 1, 0.2), ("silver", 0, 0.3), ("bronze", -1, 0.5)),
    ),
}


@dataclasses.dataclass
class RequestSpec:
    """One request the load generator will send (before it is sent)."""

    request_id: str
    workload: str
    prompt: str
    prompt_tokens_target: int
    max_tokens: int
    tenant: str = "default"
    priority: int = 0
    cancel_after_tokens: int | None = None  # cancel once this many tokens arrived (0: early)
    arrival_s: float | None = None  # offset from run start; None for closed loop


class Corpus:
    """Words of the corpus files, cycled to build prompts of a target token count.

    `tokens_per_word` converts the target to words; the load generator measures it with the
    server's own tokenizer (Tokenize RPC) before a run, so targets hold for any model.
    """

    def __init__(self, text: str | None = None, tokens_per_word: float = TOKENS_PER_WORD):
        if text is None:
            text = "\n".join(p.read_text() for p in sorted(CORPUS_DIR.glob("*.txt")))
        self.words = text.split()
        if not self.words:
            raise ValueError("corpus is empty")
        if tokens_per_word <= 0:
            raise ValueError(f"tokens_per_word={tokens_per_word}: must be > 0")
        self.tokens_per_word = tokens_per_word

    def text(self, num_tokens: int, rng: random.Random) -> str:
        """About `num_tokens` tokens of consecutive corpus words from a random start."""
        n_words = max(1, round(num_tokens / self.tokens_per_word))
        start = rng.randrange(len(self.words))
        return " ".join(self.words[(start + i) % len(self.words)] for i in range(n_words))


def parse_mix(text: str) -> list[tuple[WorkloadClass, float]]:
    """'short_qa:0.5,long_context:0.2' -> [(class, weight)]; a bare name has weight 1."""
    mix = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, weight = part.partition(":")
        if name not in PRESETS:
            raise ValueError(f"workload {name!r}: expected one of {sorted(PRESETS)}")
        w = float(weight) if weight else 1.0
        if w < 0:
            raise ValueError(f"workload {name!r} weight={w}: must be >= 0")
        mix.append((PRESETS[name], w))
    if not mix or sum(w for _, w in mix) <= 0:
        raise ValueError(f"workload mix {text!r}: needs at least one positive weight")
    return mix


@dataclasses.dataclass
class WorkloadGenerator:
    """Draws `RequestSpec`s from a weighted mix of classes (deterministic for a seed)."""

    mix: list[tuple[WorkloadClass, float]]
    corpus: Corpus = dataclasses.field(default_factory=Corpus)
    length_scale: float = 1.0
    cancel_fraction: float = 0.0
    seed: int = 0
    # Request ids must not collide with another run's on the same server; prompts stay seeded.
    run_tag: str = dataclasses.field(default_factory=lambda: uuid.uuid4().hex[:8])

    def __post_init__(self):
        if not 0.0 <= self.cancel_fraction <= 1.0:
            raise ValueError(f"cancel_fraction={self.cancel_fraction}: must be in [0, 1]")
        self.rng = random.Random(self.seed)
        prefix_rng = random.Random(self.seed + 1)
        # Fixed per run, so requests of a prefix id share token-identical prefixes.
        self.prefixes = {
            c.name: [
                self.corpus.text(
                    max(1, round(c.shared_prefix_tokens * self.length_scale)), prefix_rng
                )
                + "\n\n"
                for _ in range(c.num_prefixes)
            ]
            for c, _ in self.mix
            if c.shared_prefix_tokens
        }
        self.count = 0

    def next(self, arrival_s: float | None = None) -> RequestSpec:
        rng = self.rng
        cls = rng.choices([c for c, _ in self.mix], weights=[w for _, w in self.mix])[0]
        n_in, n_out = cls.lengths.sample(rng, self.length_scale)
        prompt = self.corpus.text(n_in, rng)
        if cls.shared_prefix_tokens:
            prefix = rng.choice(self.prefixes[cls.name])
            prompt = prefix + prompt
            n_in += round(cls.shared_prefix_tokens * self.length_scale)
        tenant, priority = "default", 0
        if cls.tenants:
            tenant, priority, _ = rng.choices(cls.tenants, weights=[t[2] for t in cls.tenants])[0]
        cancel = None
        if rng.random() < self.cancel_fraction:
            cancel = rng.randrange(n_out)  # a random point in the answer; 0 = before a token
        self.count += 1
        return RequestSpec(
            f"lg-{self.run_tag}-{self.count:06d}",
            cls.name,
            prompt,
            n_in,
            n_out,
            tenant,
            priority,
            cancel,
            arrival_s,
        )


def mix_to_dict(mix: list[tuple[WorkloadClass, float]], length_scale: float) -> dict:
    """The mix as the report states it: weights and each class's length distribution."""
    total = sum(w for _, w in mix)
    return {
        c.name: {
            "weight": w / total,
            "length_scale": length_scale,
            "lengths": dataclasses.asdict(c.lengths),
            "mean_in_tokens": c.lengths.mean_in(length_scale)
            + c.shared_prefix_tokens * length_scale,
            "mean_out_tokens": c.lengths.mean_out(length_scale),
            "shared_prefix_tokens": c.shared_prefix_tokens,
            "tenants": c.tenants,
        }
        for c, w in mix
    }
