"""Arrival processes: when each request is sent, as offsets (seconds) from the run's start.

Open-loop processes produce a schedule up front (the load does not slow down when the server
does, which is what exposes the queueing knee). Closed loop (`closed`) has no schedule: a
fixed number of workers each send the next request when their last one ends.

    constant   every 1/rate seconds
    poisson    exponential gaps, mean 1/rate
    gamma      gamma gaps with mean 1/rate and squared coefficient of variation `burstiness`
               (1 = Poisson; 4 = clumps of requests with long silences)
    onoff      Poisson at rate x (on+off)/on during `on_s`, silence for `off_s` (mean = rate)
    diurnal    Poisson with rate(t) = rate x (1 - amplitude x cos(2 pi t / period_s)):
               a ramp from a trough up to a peak and back, mean = rate over whole periods
    trace      the arrival times of a JSONL trace (see trace.py), divided by `speedup`
"""

from __future__ import annotations

import dataclasses
import math
import random

KINDS = ("constant", "poisson", "gamma", "onoff", "diurnal", "closed", "trace")


@dataclasses.dataclass(frozen=True)
class ArrivalConfig:
    kind: str = "poisson"
    rate: float = 1.0  # mean requests per second
    burstiness: float = 4.0  # gamma: squared coefficient of variation of the gaps
    on_s: float = 5.0
    off_s: float = 5.0
    period_s: float = 60.0
    amplitude: float = 0.8  # diurnal: 0 = flat, 1 = trough at zero
    concurrency: int = 8  # closed loop
    seed: int = 0

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"arrival kind={self.kind!r}: expected one of {KINDS}")
        if self.kind not in ("closed", "trace") and self.rate <= 0:
            raise ValueError(f"rate={self.rate}: must be > 0 for {self.kind} arrivals")
        if self.burstiness <= 0:
            raise ValueError(f"burstiness={self.burstiness}: must be > 0")
        if not 0.0 <= self.amplitude <= 1.0:
            raise ValueError(f"amplitude={self.amplitude}: must be in [0, 1]")
        if self.kind == "closed" and self.concurrency < 1:
            raise ValueError(f"concurrency={self.concurrency}: must be >= 1")


def _from_gaps(next_gap, duration_s: float, max_requests: int) -> list[float]:
    times, t = [], 0.0
    while len(times) < max_requests:
        if times:
            t += next_gap()
        if t >= duration_s:
            break
        times.append(t)
    return times


def schedule(cfg: ArrivalConfig, duration_s: float, max_requests: int) -> list[float] | None:
    """Arrival offsets in [0, duration_s), at most `max_requests`; None for closed loop."""
    rng = random.Random(cfg.seed)
    rate = cfg.rate
    if cfg.kind == "closed":
        return None
    if cfg.kind == "trace":
        raise ValueError("trace arrivals come from trace.load_trace, not schedule()")
    if cfg.kind == "constant":
        return _from_gaps(lambda: 1.0 / rate, duration_s, max_requests)
    if cfg.kind == "poisson":
        return _from_gaps(lambda: rng.expovariate(rate), duration_s, max_requests)
    if cfg.kind == "gamma":
        shape = 1.0 / cfg.burstiness  # CV^2 of a gamma = 1 / shape
        return _from_gaps(
            lambda: rng.gammavariate(shape, 1.0 / (rate * shape)), duration_s, max_requests
        )
    if cfg.kind == "onoff":
        return _on_off(cfg, rng, duration_s, max_requests)
    return _diurnal(cfg, rng, duration_s, max_requests)


def _on_off(
    cfg: ArrivalConfig, rng: random.Random, duration_s: float, max_requests: int
) -> list[float]:
    period = cfg.on_s + cfg.off_s
    peak = cfg.rate * period / cfg.on_s
    times, t = [], 0.0
    while len(times) < max_requests:
        t += rng.expovariate(peak)  # time spent inside "on" windows only
        cycles, within = divmod(t, cfg.on_s)
        wall = cycles * period + within
        if wall >= duration_s:
            break
        times.append(wall)
    return times


def _diurnal(
    cfg: ArrivalConfig, rng: random.Random, duration_s: float, max_requests: int
) -> list[float]:
    # Thinning (Lewis-Shedler): propose at the peak rate, keep with probability rate(t)/peak.
    peak = cfg.rate * (1.0 + cfg.amplitude)
    times, t = [], 0.0
    while len(times) < max_requests:
        t += rng.expovariate(peak)
        if t >= duration_s:
            break
        rate_t = cfg.rate * (1.0 - cfg.amplitude * math.cos(2 * math.pi * t / cfg.period_s))
        if rng.random() * peak < rate_t:
            times.append(t)
    return times


def to_dict(cfg: ArrivalConfig) -> dict:
    """The arrival pattern as the report states it (only the fields that apply)."""
    keep = {
        "constant": ("rate",),
        "poisson": ("rate",),
        "gamma": ("rate", "burstiness"),
        "onoff": ("rate", "on_s", "off_s"),
        "diurnal": ("rate", "period_s", "amplitude"),
        "closed": ("concurrency",),
        "trace": (),
    }[cfg.kind]
    return {"kind": cfg.kind, "seed": cfg.seed, **{k: getattr(cfg, k) for k in keep}}
