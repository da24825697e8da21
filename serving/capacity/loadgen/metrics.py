"""Metric definitions on per-request timelines (the seeds' definitions, one function each).

Clocks. The load generator records every client-side time with `time.perf_counter()` (one
clock for the whole run). The server reports a timestamp per generated *token*; only the
differences between those are used, so the two clocks never have to agree.

    send_s ------ first chunk arrives ------ ... chunk k arrives ... ------ end_s
                  (first_token_s)              (chunk_times_s[k], n_k tokens)
    server:   token_times_s[0] .. token_times_s[N_out - 1]   (one stamp per token)

    TTFT  = first_token_s - send_s          (client: submission -> first token observed)
    ITL   = token_times_s[i] - token_times_s[i-1]   token level (server stamps)
    chunk ITL = chunk_times_s[k] - chunk_times_s[k-1]   what the user's stream shows
    TPOT  = (T_last - T_first) / (N_out - 1)   None when N_out < 2 (no interval exists)
    E2E   = end_s - send_s                   ( ~ TTFT + sum(ITL) + T_tail )
    queue = the server's reported queue time (arrival -> first scheduled)

A network message can carry several tokens, so token timing (ITL) and chunk timing are kept
apart: when the server sent no per-token stamps, token times fall back to chunk arrival
times and `itl_source` says "chunk".

Goodput counts a request only if it succeeded AND met every SLO that applies to its class
(TTFT, TPOT, E2E, and max ITL if set); a one-token answer has no TPOT and passes that gate.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import re
from collections.abc import Iterable, Sequence

OUTCOMES = ("success", "cancelled", "rejected", "timed_out", "failed")


@dataclasses.dataclass
class RequestRecord:
    """Everything the load generator observed about one request (times in seconds)."""

    request_id: str
    workload: str = "default"
    tenant: str = "default"
    priority: int = 0
    send_s: float = 0.0  # client clock, when the request was sent
    scheduled_s: float | None = None  # client clock, when the arrival process said to send
    first_token_s: float | None = None  # client clock, first chunk with a token arrived
    chunk_times_s: list[float] = dataclasses.field(default_factory=list)  # client clock
    chunk_tokens: list[int] = dataclasses.field(default_factory=list)  # tokens per chunk
    token_times_s: list[float] = dataclasses.field(default_factory=list)  # server clock
    end_s: float | None = None  # client clock, stream finished (any outcome)
    outcome: str = "failed"  # one of OUTCOMES
    reason: str = ""  # finish reason, rejection reason or error text
    queue_s: float | None = None  # server-reported
    num_prompt_tokens: int = 0  # server-reported (0 if never admitted)
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    max_tokens: int = 0
    cancel_after_tokens: int | None = None  # planned client cancellation point

    @property
    def itl_source(self) -> str:
        return "token" if self.token_times_s else "chunk"

    def token_times(self) -> list[float]:
        """Per-token times: the server's stamps, or each chunk's arrival repeated per token."""
        if self.token_times_s:
            return list(self.token_times_s)
        out: list[float] = []
        for t, n in zip(self.chunk_times_s, self.chunk_tokens):
            out.extend([t] * max(n, 0))
        return out


# ---- the definitions --------------------------------------------------------------------


def ttft(rec: RequestRecord) -> float | None:
    """Submission to first token observed by the client; None if no token came."""
    if rec.first_token_s is None:
        return None
    return rec.first_token_s - rec.send_s


def itl(rec: RequestRecord) -> list[float]:
    """Gaps between adjacent tokens (token level when the server stamped tokens)."""
    times = rec.token_times()
    return [b - a for a, b in itertools.pairwise(times)]


def chunk_itl(rec: RequestRecord) -> list[float]:
    """Gaps between adjacent network chunks as the client saw them."""
    times = rec.chunk_times_s
    return [b - a for a, b in itertools.pairwise(times)]


def tpot(rec: RequestRecord) -> float | None:
    """(T_last - T_first) / (N_out - 1); undefined (None) for fewer than two tokens."""
    times = rec.token_times()
    if len(times) < 2:
        return None
    return (times[-1] - times[0]) / (len(times) - 1)


def e2e(rec: RequestRecord) -> float | None:
    """Submission to end of stream; None if the end was never observed."""
    if rec.end_s is None:
        return None
    return rec.end_s - rec.send_s


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated percentile (numpy's default), q in [0, 100]; None when empty."""
    vals = sorted(v for v in values if v is not None and not math.isnan(v))
    if not vals:
        return None
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"q={q}: must be in [0, 100]")
    pos = (len(vals) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return vals[lo] + (vals[hi] - vals[lo]) * (pos - lo)


def summarize(values: Iterable[float | None]) -> dict:
    """count, mean, p50, p95, p99, max of the defined values."""
    vals = [v for v in values if v is not None]
    if not vals:
        return {"count": 0, "mean": None, "p50": None, "p95": None, "p99": None, "max": None}
    return {
        "count": len(vals),
        "mean": sum(vals) / len(vals),
        "p50": percentile(vals, 50),
        "p95": percentile(vals, 95),
        "p99": percentile(vals, 99),
        "max": max(vals),
    }


# ---- SLOs and goodput ------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Slo:
    """Latency targets for one class; None disables a gate."""

    ttft_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float | None = None
    itl_max_s: float | None = None  # largest single token gap allowed

    def misses(self, rec: RequestRecord) -> list[str]:
        """Names of the gates this request missed (empty list: it met every SLO)."""
        missed = []
        if rec.outcome != "success":
            return [f"outcome:{rec.outcome}"]
        checks = [
            ("ttft_s", self.ttft_s, ttft(rec)),
            ("tpot_s", self.tpot_s, tpot(rec)),
            ("e2e_s", self.e2e_s, e2e(rec)),
        ]
        gaps = itl(rec)
        checks.append(("itl_max_s", self.itl_max_s, max(gaps) if gaps else None))
        for name, limit, value in checks:
            # A metric that is undefined for this request (one-token TPOT) cannot miss.
            if limit is not None and value is not None and value > limit:
                missed.append(name)
        return missed

    def met(self, rec: RequestRecord) -> bool:
        return not self.misses(rec)


@dataclasses.dataclass(frozen=True)
class SloPolicy:
    """A default SLO and per-class overrides (class = workload name)."""

    default: Slo = Slo()
    per_class: tuple[tuple[str, Slo], ...] = ()

    def for_class(self, workload: str) -> Slo:
        return dict(self.per_class).get(workload, self.default)

    def to_dict(self) -> dict:
        return {
            "default": dataclasses.asdict(self.default),
            "per_class": {k: dataclasses.asdict(v) for k, v in self.per_class},
        }


def parse_slo(text: str, base: Slo | None = None) -> Slo:
    """'ttft_s=2,tpot_s=0.1,e2e_s=30' -> Slo (fields not named keep `base`'s values)."""
    fields = {f.name for f in dataclasses.fields(Slo)}
    values = dataclasses.asdict(base or Slo())
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, _, val = part.partition("=")
        if key not in fields:
            raise ValueError(f"slo field {key!r}: expected one of {sorted(fields)}")
        values[key] = None if val in ("", "none", "None") else float(val)
    return Slo(**values)


def parse_slo_policy(default: str, per_class: Sequence[str] = ()) -> SloPolicy:
    """default 'ttft_s=2,...'; per_class entries 'long_generation:e2e_s=120,tpot_s=0.2'."""
    base = parse_slo(default)
    overrides = []
    for entry in per_class:
        name, _, spec = entry.partition(":")
        overrides.append((name.strip(), parse_slo(spec, base)))
    return SloPolicy(base, tuple(overrides))


def goodput(records: Sequence[RequestRecord], policy: SloPolicy, duration_s: float) -> dict:
    """Requests and output tokens per second that succeeded within every SLO of their class."""
    if duration_s <= 0:
        raise ValueError(f"duration_s={duration_s}: must be > 0")
    good = [r for r in records if policy.for_class(r.workload).met(r)]
    return {
        "good_requests": len(good),
        "rps": len(good) / duration_s,
        "output_tps": sum(r.num_output_tokens for r in good) / duration_s,
        "fraction_of_sent": len(good) / len(records) if records else None,
    }


def reason_key(reason: str) -> str:
    """Groups reasons that differ only in numbers ("wait 5.0s exceeds 2.9s" -> "wait #s ...")."""
    return re.sub(r"\d+(\.\d+)?", "#", reason) if reason else "unspecified"


def outcome_counts(records: Sequence[RequestRecord]) -> dict:
    """Counts by outcome, plus rejections (and failures) broken down by reason."""
    counts = {k: 0 for k in OUTCOMES}
    by_reason: dict[str, dict[str, int]] = {}
    for r in records:
        if r.outcome not in counts:
            raise ValueError(f"outcome={r.outcome!r}: expected one of {OUTCOMES}")
        counts[r.outcome] += 1
        if r.outcome in ("rejected", "failed", "timed_out"):
            reasons = by_reason.setdefault(r.outcome, {})
            key = reason_key(r.reason)
            reasons[key] = reasons.get(key, 0) + 1
    return {**counts, "by_reason": by_reason}
