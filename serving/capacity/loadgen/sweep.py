"""Rate sweep: step the offered rate up, find the knee and the SLO operating point.

Each step is a full run (its own report in `OUT/rate_<r>/`). From the steps:

    gates(step)      every gate must pass at that rate:
                       p<gate_percentile> of TTFT, TPOT, E2E <= the default SLO's limits
                       good requests / requests sent (not counting client cancellations)
                         >= min_good_fraction
                       (rejected + timed_out + failed) / sent <= max_error_rate
    operating point  the highest rate at which every gate passed, provided every lower rate
                     passed too (a pass above a failure is noise, not capacity)
    knee             the first rate whose p95 TTFT exceeds knee_factor x the p95 TTFT of the
                     lowest rate, or whose error fraction passes max_error_rate: where
                     queueing starts to dominate. (Achieved vs offered req/s is not used: over
                     a short step, Poisson noise and the drain tail move it by 10-20%.)

The sweep stops after `stop_after_failures` consecutive failing steps. It says when its rates
did not bracket the answer (`advice`): no knee and every gate passing means capacity lies above
the highest rate tried; the lowest rate already failing means it lies below the lowest.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from collections.abc import Callable

from serving.capacity.loadgen import plots
from serving.capacity.loadgen.gates import Gates, check_gates, step_summary


def find_knee(steps: list[dict], gates: Gates) -> float | None:
    """First rate where p95 TTFT passes knee_factor x the lowest rate's, or errors appear."""
    if not steps:
        return None
    base = steps[0]["ttft_s"]["p95"]
    for s in steps:
        p95 = s["ttft_s"]["p95"]
        latency_up = base is not None and (p95 is None or p95 > gates.knee_factor * base)
        o = s["outcomes"]
        errors = (o["rejected"] + o["timed_out"] + o["failed"]) / max(s["requests_sent"], 1)
        if latency_up or errors > gates.max_error_rate:
            return s["rate"]
    return None


def operating_point(steps: list[dict]) -> float | None:
    best = None
    for s in sorted(steps, key=lambda s: s["rate"]):
        if not all(s["gates"].values()):
            break
        best = s["rate"]
    return best


def geometric_rates(start: float, factor: float, max_steps: int) -> list[float]:
    if start <= 0 or factor <= 1 or max_steps < 1:
        raise ValueError(
            f"sweep start={start} factor={factor} steps={max_steps}: need "
            "start > 0, factor > 1, steps >= 1"
        )
    return [round(start * factor**i, 4) for i in range(max_steps)]


def run_sweep(
    rates: list[float],
    run_at: Callable[[float, pathlib.Path], dict],
    out_dir: pathlib.Path,
    gates: Gates | None = None,
    stop_after_failures: int = 2,
) -> dict:
    """Runs `run_at(rate, step_dir) -> report` per rate; writes sweep.json/.md/.png.
    `gates`: None for the defaults (Gates())."""
    gates = gates or Gates()

    steps = []
    failures = 0
    for rate in rates:
        report = run_at(rate, out_dir / f"rate_{rate:g}")
        step = step_summary(rate, report)
        step["gates"] = check_gates(step, gates)
        steps.append(step)
        failures = 0 if all(step["gates"].values()) else failures + 1
        if failures >= stop_after_failures:
            break
    result = {
        "gates": dataclasses.asdict(gates),
        "steps": steps,
        "knee_rate": find_knee(steps, gates),
        "operating_rate": operating_point(steps),
    }
    op = [s for s in steps if s["rate"] == result["operating_rate"]]
    result["operating_goodput_rps"] = op[0]["goodput_rps"] if op else None
    result["knee_reached"] = result["knee_rate"] is not None
    result["advice"] = advice(steps, result["knee_rate"], result["operating_rate"])
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "sweep.json").write_text(json.dumps(result, indent=2, default=str))
    (out_dir / "sweep.md").write_text(sweep_markdown(result))
    plots.latency_vs_rate(
        out_dir / "latency_vs_rate.png",
        steps,
        result["knee_rate"],
        result["operating_rate"],
        steps[0]["slo"]["default"] if steps else {},
        _sweep_title(steps),
    )
    return result


def _sweep_title(steps: list[dict]) -> str:
    """The steps' shared label without the per-step rate: 'workload | SLO ...'."""
    if not steps or not steps[0].get("label"):
        return ""
    parts = steps[0]["label"].split(" | ")
    rates = ", ".join(f"{s['rate']:g}" for s in steps)
    return f"{parts[0]} | rates {rates} req/s | {parts[-1]}"


def advice(steps: list[dict], knee: float | None, operating: float | None) -> str:
    """What the sweep shows, and what to run next when its rates did not bracket the answer."""
    if not steps:
        return "no step ran"
    low, high = steps[0]["rate"], steps[-1]["rate"]
    if operating is None:
        failed = [k for k, ok in steps[0]["gates"].items() if not ok]
        return (
            f"no operating point: the lowest rate, {low:g} req/s, already failed "
            f"({', '.join(failed)}). Capacity is below it: rerun with "
            f"--sweep_start={low / 4:g}, or check the SLO is attainable on this hardware."
        )
    if knee is None:
        return (
            f"the knee was not reached: latency stayed flat and errors low up to {high:g} "
            f"req/s, so {operating:g} req/s is a lower bound, not the capacity. Rerun with "
            f"--sweep_start={high:g} --sweep_factor=2 (or more --sweep_steps)."
        )
    return (
        f"knee at {knee:g} req/s (p95 TTFT doubled or errors appeared); operating point "
        f"{operating:g} req/s is the highest rate where every gate passed."
    )


def sweep_markdown(result: dict) -> str:
    ms = lambda v: "-" if v is None else f"{v * 1e3:.0f}"
    lines = [
        "# Rate sweep" + (f": {_sweep_title(result['steps'])}" if result["steps"] else ""),
        "",
        (
            f"- knee: **{result['knee_rate'] or 'not reached'}** req/s; operating point "
            f"(highest rate where "
            f"every gate passed): **{result['operating_rate']}** req/s, goodput "
            f"{result['operating_goodput_rps']} req/s"
        ),
        f"- **{result['advice']}**",
        f"- gates: `{json.dumps(result['gates'])}`",
        "",
        (
            "| rate | sent | ok | goodput req/s | out tok/s | TTFT p50/p95 ms | "
            "TPOT p50/p95 ms | E2E p95 ms | gates |"
        ),
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for s in result["steps"]:
        failed = [k for k, v in s["gates"].items() if not v]
        lines.append(
            f"| {s['rate']:g} | {s['requests_sent']} | {s['outcomes']['success']} | "
            f"{s['goodput_rps']:.3f} | {s['throughput']['output_tps']:.1f} | "
            f"{ms(s['ttft_s']['p50'])}/{ms(s['ttft_s']['p95'])} | "
            f"{ms(s['tpot_s']['p50'])}/{ms(s['tpot_s']['p95'])} | {ms(s['e2e_s']['p95'])} | "
            f"{'pass' if not failed else 'FAIL ' + ','.join(failed)} |"
        )
    lines += ["", "Plot: `latency_vs_rate.png`.", ""]
    return "\n".join(lines)
