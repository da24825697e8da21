"""report.json -> report.md (tables a person reads; the JSON stays the source of truth)."""

from __future__ import annotations

import json

from serving.capacity.loadgen import gates
from serving.capacity.loadgen.labels import run_label


def _f(v, digits: int = 3) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{digits}g}" if abs(v) < 1e4 else f"{v:,.0f}"
    return str(v)


def _ms(v) -> str:
    return "-" if v is None else f"{v * 1e3:.1f}"


def latency_table(
    blocks: dict[str, dict], keys=("ttft_s", "tpot_s", "itl_s", "e2e_s", "queue_s")
) -> list[str]:
    head = "| group | n ok | " + " | ".join(f"{k[:-2]} p50/p95/p99 (ms)" for k in keys) + " |"
    lines = [head, "|" + "---|" * (len(keys) + 2)]
    for name, b in blocks.items():
        n = b.get("ttft_s", {}).get("count", 0)
        cells = ["/".join(_ms(b[k][p]) for p in ("p50", "p95", "p99")) for k in keys]
        lines.append(f"| {name} | {n} | " + " | ".join(cells) + " |")
    return lines


def outcome_table(blocks: dict[str, dict]) -> list[str]:
    kinds = ("success", "cancelled", "rejected", "timed_out", "failed")
    lines = [
        "| group | sent | " + " | ".join(kinds) + " | goodput req/s | good / sent |",
        "|" + "---|" * (len(kinds) + 4),
    ]
    for name, b in blocks.items():
        o, g = b["outcomes"], b["goodput"]
        lines.append(
            f"| {name} | {b['requests_sent']} | "
            + " | ".join(str(o[k]) for k in kinds)
            + f" | {_f(g['rps'])} | {_f(g['fraction_of_sent'])} |"
        )
    return lines


def slo_miss_table(r: dict) -> list[str]:
    """Gate | limit | requests that missed it | share of sent (outcomes count as gates)."""
    limits = r["slo"]["default"]
    if not r["slo_misses"]:
        return ["Every request sent met every SLO gate."]
    lines = ["| gate | limit | requests missing it | share of sent |", "|---|---|---|---|"]
    for gate, n in sorted(r["slo_misses"].items(), key=lambda kv: -kv[1]):
        limit = limits.get(gate)
        shown = f"{limit:g} s" if limit is not None else "must succeed"
        lines.append(f"| {gate} | {shown} | {n} | {n / r['requests_sent']:.1%} |")
    return lines


def verdict(r: dict) -> str:
    """Whether this rate passes the sweep's gates (the operating point's test)."""
    passed = gates.check_gates(gates.step_summary(0.0, r), gates.Gates())
    failed = [k for k, ok in passed.items() if not ok]
    if not failed:
        return (
            "**Within capacity**: every gate passed at this load (p95 latencies within the SLO, "
            ">= 90% of requests good, <= 1% errors). A sweep (`--sweep_start`) finds how far above "
            "it the operating point lies."
        )
    return (
        f"**Beyond capacity at this load**: gates failing: {', '.join(failed)}. Run a sweep "
        "(`--sweep_start=<lower rate>`) to find the highest rate that passes."
    )


def markdown(r: dict) -> str:
    """The answer first (goodput, verdict, cost, outcomes, latency), conditions last."""
    c, t, g = r["conditions"], r["throughput"], r["goodput"]
    sent = r["requests_sent"]
    lines = [
        f"# Capacity report: {run_label(r)}",
        "",
        (
            f"Model **{c.get('model', '?')}** revision `{str(c.get('revision', '?'))[:16]}`; "
            f"{sent} requests over {r['wall_s']:.1f} s."
        ),
        "",
        "## Answer",
        "",
        (
            f"- **goodput {r['goodput_rps']:.3f} req/s** ({g['good_requests']} of {sent} "
            f"requests met every SLO, {g['good_requests'] / sent:.0%}); "
            f"{g['output_tps']:.1f} good output tok/s"
        ),
        f"- {verdict(r)}",
        (
            f"- cost per successful request: **{_f(r['cost_per_success'], 4)}** (per "
            f"SLO-meeting request {_f(r['cost']['cost_per_good_request'], 4)}; price per "
            f"device-hour {r['cost']['price_per_device_hour']})"
        ),
        (
            f"- throughput: {t['rps']:.2f} successful req/s, {t['output_tps']:.1f} output tok/s, "
            f"{t['input_tps']:.1f} input tok/s"
        ),
        "",
        "### Outcomes",
        "",
    ]
    lines += outcome_table({"all": r})
    lines += ["", "### Latency of successful requests", ""]
    lines += latency_table({"all": r})
    lines += ["", "### SLO misses", ""]
    lines += slo_miss_table(r)
    lines += _breakdown(r)
    lines += _appendix(r)
    return "\n".join(lines)


def _breakdown(r: dict) -> list[str]:
    groups = {
        **{f"class {k}": v for k, v in r["by_class"].items()},
        **{f"priority {k}": v for k, v in r["by_priority"].items()},
    }
    lines = ["", "## By class and priority", ""]
    lines += latency_table(groups)
    lines += [""]
    lines += outcome_table({**groups, **{f"tenant {k}": v for k, v in r["by_tenant"].items()}})
    reasons = r["outcomes"]["by_reason"]
    if reasons:
        lines += ["", "| outcome: reason | requests |", "|---|---|"]
        for outcome, by in reasons.items():
            lines += [f"| {outcome}: {k.replace('|', '/')} | {n} |" for k, n in by.items()]
    lines += [
        "",
        "Chunk-level ITL (network messages) p50/p95/p99 ms: "
        + "/".join(_ms(r["chunk_itl_s"][p]) for p in ("p50", "p95", "p99")),
        (
            f"Prefix cache: {_f(r['prefix_cache']['hit_rate'])} of prompt tokens cached "
            f"(scraped counters: {_f(r['server_metrics'].get('prefix_cache_hit_rate'))}); "
            f"preemptions: {_f(r['server_metrics'].get('preemptions'))}; requests in flight "
            f"at the client: mean {_f(r['observed_concurrency']['mean'])}, max "
            f"{r['observed_concurrency']['max']}; dispatch lag p99 "
            f"{_ms(r['dispatch_lag_s']['p99'])} ms."
        ),
    ]
    wc = r["warm_vs_cold"]
    lines += [
        "",
        f"## Warm vs cold (cold = requests sent in the first {wc['warm_window_s']:.1f} s)",
        "",
    ]
    lines += latency_table(
        {
            f"cold ({wc['cold']['requests']} sent)": wc["cold"],
            f"steady ({wc['steady']['requests']} sent)": wc["steady"],
        }
    )
    lines += ["", "## Server metrics (scraped)", ""]
    sm = r["server_metrics"]
    for name, s in sm.get("found", {}).items():
        lines.append(
            f"- {name} (`{s['series_key']}`): max {_f(s['max'])}, mean {_f(s['mean'])}"
            f", change over run {_f(s['delta'])}"
        )
    if sm.get("missing"):
        lines.append(f"- not found on the metrics endpoint: {', '.join(sm['missing'])}")
    if not sm:
        lines.append("- not scraped (no --metrics_url)")
    return lines


def _appendix(r: dict) -> list[str]:
    lines = ["", "## Appendix A: conditions", "", "```json"]
    lines += [json.dumps(r["conditions"], indent=1, default=str), "```", ""]
    lines += ["## Appendix B: SLOs", "", "```json", json.dumps(r["slo"], indent=1), "```", ""]
    lines += ["## Appendix C: definitions", ""]
    lines += [f"- **{k}**: {v}" for k, v in r["definitions"].items()]
    lines += ["", "Plots: `latency_cdf.png`, `timeline.png`.", ""]
    return lines
