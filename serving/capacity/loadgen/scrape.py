"""Scrapes the server's Prometheus endpoint during a run (KV usage, running/waiting, ...).

A background thread GETs `http://HOST:PORT/metrics` every `interval_s` and keeps every
gauge/counter sample as a time series keyed `name{label=value,...}`. The report then picks
the series it knows by name pattern (the server's metric names are the serving package's
choice; `pick` matches loosely so a rename does not silently empty the report: unmatched
patterns are listed as missing).
"""

from __future__ import annotations

import re
import threading
import time
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

# Report field -> regexes over metric names, tried in order (the serving package's names
# first, looser fallbacks after). First match wins.
KNOWN = {
    "kv_usage": (r"kv_usage_ratio$", r"kv.*(usage|utili[sz]ation)"),
    "running": (r"num_requests_running$", r"running"),
    "waiting": (r"num_requests_waiting$", r"waiting|queue_(depth|size|len)"),
    "preemptions": (r"preemptions_total$", r"preempt"),
    "prefix_hit_tokens": (r"prefix_cache_hits_tokens_total$", r"prefix.*hit.*tokens"),
    "prefix_query_tokens": (
        r"prefix_cache_queries_tokens_total$",
        r"prefix.*(query|queries|lookup).*tokens",
    ),
}


def parse_samples(text: str) -> dict[str, float]:
    """Prometheus text exposition -> {series key: value}."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = float(s.value)
    return out


class Scraper:
    """Polls a metrics URL on a thread; `series` is [(t_s, {key: value})]."""

    def __init__(self, url: str, interval_s: float = 0.5, clock=time.perf_counter):
        self.url, self.interval_s, self.clock = url, interval_s, clock
        self.series: list[tuple[float, dict[str, float]]] = []
        self.errors = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="metrics-scraper", daemon=True)

    def start(self) -> Scraper:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.scrape_once()  # a last sample after the run

    def scrape_once(self) -> None:
        try:
            with urllib.request.urlopen(self.url, timeout=2) as resp:
                text = resp.read().decode()
            self.series.append((self.clock(), parse_samples(text)))
        except (OSError, ValueError):
            self.errors += 1

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.scrape_once()
            self._stop.wait(self.interval_s)


def pick(series: list[tuple[float, dict[str, float]]], patterns: tuple[str, ...]) -> str | None:
    """The first series key matching the first pattern that matches any (histogram parts and
    _created samples skipped)."""
    keys = sorted({k for _, sample in series for k in sample})
    names = [(k, k.split("{")[0]) for k in keys]
    names = [(k, n) for k, n in names if not re.search(r"_(bucket|sum|count|created)$", n)]
    for pattern in patterns:
        rx = re.compile(pattern)
        for key, name in names:
            if rx.search(name):
                return key
    return None


def timeseries(
    series: list[tuple[float, dict[str, float]]], key: str, t0: float
) -> list[tuple[float, float]]:
    return [(t - t0, s[key]) for t, s in series if key in s]


def summarize_scrape(series: list[tuple[float, dict[str, float]]], t0: float) -> dict:
    """Known series over time plus derived figures (peak KV usage, prefix hit rate, ...)."""
    found, missing = {}, []
    for name, patterns in KNOWN.items():
        key = pick(series, patterns)
        if key is None:
            missing.append(name)
            continue
        points = timeseries(series, key, t0)
        values = [v for _, v in points]
        found[name] = {
            "series_key": key,
            "points": points,
            "max": max(values),
            "mean": sum(values) / len(values),
            "delta": values[-1] - values[0],
        }
    hit_rate = None
    if "prefix_hit_tokens" in found and "prefix_query_tokens" in found:
        q = found["prefix_query_tokens"]["delta"]
        hit_rate = found["prefix_hit_tokens"]["delta"] / q if q > 0 else None
    return {
        "found": found,
        "missing": missing,
        "samples": len(series),
        "prefix_cache_hit_rate": hit_rate,
        "preemptions": found.get("preemptions", {}).get("delta"),
    }
