"""A run's one-line label (workload | arrival | SLO): a leaf module, so the report, its
plots, its Markdown and the sweep all title runs alike without importing each other."""

from __future__ import annotations

import pathlib


def run_label(report: dict) -> str:
    """'workload | arrival at rate | SLO' in one line, for titles of the report and plots."""
    c = report.get("conditions", {})
    mix = c.get("workload_mix") or {}
    if "trace" in mix:
        workload = f"trace {pathlib.Path(str(mix['trace'])).name}"
    else:
        workload = ", ".join(
            f"{name} {v['weight']:.0%}" if isinstance(v, dict) else str(name)
            for name, v in mix.items()
        )
    a = c.get("arrival") or {}
    if a.get("kind") == "closed":
        load = f"closed loop, {a.get('concurrency')} streams"
    elif "rate" in a:
        load = f"{a['kind']} {a['rate']:g} req/s"
    else:
        load = str(a.get("kind", "?"))
    slo = report.get("slo", {}).get("default", {})
    gates = ", ".join(f"{k[:-2].upper()}<={v:g}s" for k, v in slo.items() if v is not None)
    return f"{workload or '?'} | {load} | SLO {gates or 'none'}"
