"""The capacity report: one dict (report.json), its Markdown rendering and PNG plots.

Definitions written into every report (DEFINITIONS below) so a reader never has to guess
where a clock starts. Latency percentiles are over successful requests; outcome counts are
over every request sent and always add up to `requests_sent`.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from collections.abc import Callable, Sequence

from serving.capacity.loadgen import metrics as m
from serving.capacity.loadgen import plots as plotting
from serving.capacity.loadgen import render
from serving.capacity.loadgen.metrics import RequestRecord, SloPolicy

DEFINITIONS = {
    "ttft_s": "client: request sent -> first chunk carrying a token received",
    "itl_s": "gap between adjacent tokens, from the server's per-token timestamps "
    "(chunk_itl_s: gap between adjacent network chunks at the client)",
    "tpot_s": "(T_last - T_first) / (N_out - 1) per request; undefined for one token",
    "e2e_s": "client: request sent -> end of stream",
    "queue_s": "server-reported: arrival -> first scheduled by the engine",
    "throughput": "input_tps = prompt tokens of admitted requests / wall; output_tps = tokens "
    "streamed (any outcome) / wall; rps = successful requests / wall; wall = first "
    "send -> last end",
    "goodput": "successful requests (and their output tokens) per second of wall time that met "
    "EVERY SLO gate of their class (TTFT, TPOT, E2E, max ITL when set); a one-token "
    "answer has no TPOT and passes that gate; cancelled, rejected, timed-out and "
    "failed requests never count",
    "cost_per_success": "(device-hours x price per device-hour + energy kWh x price per kWh) / "
    "successful requests; cost_per_good_request divides by SLO-meeting ones",
    "warm_vs_cold": "cold = requests sent in the first warm_window_s after the run started "
    "(default: a fifth of the wall time); steady = the rest",
}

LATENCY_KEYS = ("ttft_s", "tpot_s", "itl_s", "chunk_itl_s", "e2e_s", "queue_s")


@dataclasses.dataclass(frozen=True)
class CostConfig:
    price_per_device_hour: float = 0.0
    num_devices: int = 1
    power_w: float | None = None  # average draw of the serving devices, if known
    price_per_kwh: float = 0.0


def latency_block(records: Sequence[RequestRecord]) -> dict:
    ok = [r for r in records if r.outcome == "success"]
    flat = lambda f: [v for r in ok for v in f(r)]
    return {
        "ttft_s": m.summarize(m.ttft(r) for r in ok),
        "tpot_s": m.summarize(m.tpot(r) for r in ok),
        "itl_s": m.summarize(flat(m.itl)),
        "chunk_itl_s": m.summarize(flat(m.chunk_itl)),
        "e2e_s": m.summarize(m.e2e(r) for r in ok),
        "queue_s": m.summarize(r.queue_s for r in ok),
        "output_tokens": m.summarize(r.num_output_tokens for r in ok),
        "prompt_tokens": m.summarize(r.num_prompt_tokens for r in ok),
    }


def wall_span(records: Sequence[RequestRecord]) -> tuple[float, float]:
    start = min(r.send_s for r in records)
    end = max((r.end_s for r in records if r.end_s is not None), default=start)
    return start, max(end, start + 1e-9)


def group_block(records: Sequence[RequestRecord], policy: SloPolicy, wall_s: float) -> dict:
    return {
        **latency_block(records),
        "requests_sent": len(records),
        "outcomes": m.outcome_counts(records),
        "goodput": m.goodput(records, policy, wall_s),
    }


def grouped(
    records: Sequence[RequestRecord],
    key: Callable[[RequestRecord], object],
    policy: SloPolicy,
    wall_s: float,
) -> dict:
    groups: dict[str, list[RequestRecord]] = {}
    for r in records:
        groups.setdefault(str(key(r)), []).append(r)
    return {k: group_block(v, policy, wall_s) for k, v in sorted(groups.items())}


def observed_concurrency(records: Sequence[RequestRecord]) -> dict:
    """Requests in flight at the client (send -> end): time-weighted mean and maximum."""
    events = sorted(
        [(r.send_s, 1) for r in records if r.end_s is not None]
        + [(r.end_s, -1) for r in records if r.end_s is not None]
    )
    if not events:
        return {"mean": None, "max": 0}
    level = peak = 0
    area, last = 0.0, events[0][0]
    for t, step in events:
        area += level * (t - last)
        level, last = level + step, t
        peak = max(peak, level)
    span = events[-1][0] - events[0][0]
    return {"mean": area / span if span > 0 else float(peak), "max": peak}


def cost_block(
    cost: CostConfig, wall_s: float, n_success: int, n_good: int, output_tokens: int
) -> dict:
    device_hours = cost.num_devices * wall_s / 3600.0
    energy_kwh = (
        cost.power_w * cost.num_devices * wall_s / 3600.0 / 1000.0 if cost.power_w else None
    )
    total = device_hours * cost.price_per_device_hour + (energy_kwh or 0.0) * cost.price_per_kwh
    per = lambda n: total / n if n else None
    return {
        **dataclasses.asdict(cost),
        "device_hours": device_hours,
        "energy_kwh": energy_kwh,
        "total_cost": total,
        "cost_per_success": per(n_success),
        "cost_per_good_request": per(n_good),
        "cost_per_million_output_tokens": per(output_tokens / 1e6 if output_tokens else 0),
    }


def build_report(
    records: Sequence[RequestRecord],
    *,
    conditions: dict,
    policy: SloPolicy,
    cost: CostConfig = CostConfig(),
    scrape: dict | None = None,
    warm_window_s: float | None = None,
) -> dict:
    """Everything the report holds, as one JSON-able dict. `warm_window_s` None: a fifth of
    the wall time, so both the cold and the steady window hold requests."""
    if not records:
        raise ValueError("no requests were sent: nothing to report")
    t0, t1 = wall_span(records)
    wall_s = t1 - t0
    if warm_window_s is None:
        warm_window_s = 0.2 * wall_s
    outcomes = m.outcome_counts(records)
    good = m.goodput(records, policy, wall_s)
    admitted = [r for r in records if r.num_prompt_tokens]
    out_tokens = sum(r.num_output_tokens for r in records)
    prompt_tokens = sum(r.num_prompt_tokens for r in admitted)
    cached = sum(r.num_cached_tokens for r in admitted)
    lags = [r.send_s - r.scheduled_s for r in records if r.scheduled_s is not None]
    cold = [r for r in records if r.send_s - t0 < warm_window_s]
    steady = [r for r in records if r.send_s - t0 >= warm_window_s]
    misses: dict[str, int] = {}
    for r in records:
        for miss in policy.for_class(r.workload).misses(r):
            misses[miss] = misses.get(miss, 0) + 1
    return {
        "definitions": DEFINITIONS,
        "conditions": conditions,
        "slo": policy.to_dict(),
        "requests_sent": len(records),
        "wall_s": wall_s,
        "outcomes": outcomes,
        **{k: v for k, v in latency_block(records).items()},
        "throughput": {
            "input_tps": prompt_tokens / wall_s,
            "output_tps": out_tokens / wall_s,
            "rps": outcomes["success"] / wall_s,
            "completed_rps": len(records) / wall_s,
        },
        "goodput_rps": good["rps"],
        "goodput": good,
        "slo_misses": misses,
        "prefix_cache": {
            "prompt_tokens": prompt_tokens,
            "cached_tokens": cached,
            "hit_rate": cached / prompt_tokens if prompt_tokens else None,
        },
        "server_metrics": scrape or {},
        "cost_per_success": cost_block(
            cost, wall_s, outcomes["success"], good["good_requests"], out_tokens
        )["cost_per_success"],
        "cost": cost_block(cost, wall_s, outcomes["success"], good["good_requests"], out_tokens),
        "dispatch_lag_s": m.summarize(lags),
        "observed_concurrency": observed_concurrency(records),
        "by_class": grouped(records, lambda r: r.workload, policy, wall_s),
        "by_priority": grouped(records, lambda r: r.priority, policy, wall_s),
        "by_tenant": grouped(records, lambda r: r.tenant, policy, wall_s),
        "warm_vs_cold": {
            "warm_window_s": warm_window_s,
            "cold": latency_block(cold) | {"requests": len(cold)},
            "steady": latency_block(steady) | {"requests": len(steady)},
        },
    }


def write_report(
    out_dir: str | pathlib.Path, report: dict, records: Sequence[RequestRecord], plots: bool = True
) -> list[pathlib.Path]:
    """report.json, report.md, records.jsonl and (if `plots`) the PNGs; returns the paths."""

    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "report.json", out / "report.md", out / "records.jsonl"]
    paths[0].write_text(json.dumps(report, indent=2, default=str))
    paths[1].write_text(render.markdown(report))
    with open(paths[2], "w") as f:
        f.writelines(json.dumps(dataclasses.asdict(r)) + "\n" for r in records)
    if plots:
        paths += plotting.run_plots(out, report, records)
    return paths
