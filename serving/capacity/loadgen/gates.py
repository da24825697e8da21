"""The sweep's gates: what a run must meet to count as within capacity. A leaf module (it
needs only the run's label), shared by the sweep (serving/capacity/loadgen/sweep.py) and a single
run's verdict (serving/capacity/loadgen/render.py).

    gates(step)      every gate must pass at that rate:
                       p<gate_percentile> of TTFT, TPOT, E2E <= the default SLO's limits
                       good requests / requests sent (not counting client cancellations)
                         >= min_good_fraction
                       (rejected + timed_out + failed) / sent <= max_error_rate
"""

from __future__ import annotations

import dataclasses

from serving.capacity.loadgen.labels import run_label


@dataclasses.dataclass(frozen=True)
class Gates:
    gate_percentile: str = "p95"
    min_good_fraction: float = 0.9
    max_error_rate: float = 0.01
    knee_factor: float = 2.0


def step_summary(rate: float, report: dict) -> dict:
    """The part of a run's report the sweep needs."""
    keys = (
        "ttft_s",
        "tpot_s",
        "e2e_s",
        "itl_s",
        "queue_s",
        "throughput",
        "goodput_rps",
        "outcomes",
        "requests_sent",
        "slo",
        "cost_per_success",
    )
    return {
        "rate": rate,
        "good_requests": report["goodput"]["good_requests"],
        "label": run_label(report) if "conditions" in report else "",
        **{k: report[k] for k in keys},
    }


def check_gates(step: dict, gates: Gates) -> dict[str, bool]:
    slo = step["slo"]["default"]
    p = gates.gate_percentile
    checks = {}
    any_success = step["outcomes"]["success"] > 0
    for key in ("ttft_s", "tpot_s", "e2e_s"):
        limit, value = slo.get(key), step[key][p]
        if limit is not None:
            # TPOT is undefined when every answer had one token: that cannot miss the gate.
            undefined_ok = key == "tpot_s" and value is None and any_success
            checks[f"{key}_{p}"] = undefined_ok or (value is not None and value <= limit)
    o = step["outcomes"]
    sent = step["requests_sent"]
    not_cancelled = sent - o["cancelled"]
    good = step["good_requests"]
    checks["good_fraction"] = not_cancelled > 0 and good / not_cancelled >= gates.min_good_fraction
    errors = o["rejected"] + o["timed_out"] + o["failed"]
    checks["error_rate"] = sent > 0 and errors / sent <= gates.max_error_rate
    return checks
