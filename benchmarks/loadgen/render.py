"""report.json -> report.md (tables a person reads; the JSON stays the source of truth)."""

from __future__ import annotations

import json


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


def markdown(r: dict) -> str:
    c = r["conditions"]
    t = r["throughput"]
    lines = [
        "# Capacity report",
        "",
        (
            f"Model **{c.get('model', '?')}** revision `{c.get('revision', '?')}`, "
            f"engine {c.get('engine_version', '?')}; target `{c.get('target', '?')}`."
        ),
        "",
        "## Conditions",
        "",
        "```json",
        json.dumps(c, indent=1, default=str),
        "```",
        "",
        "## SLOs",
        "",
        "```json",
        json.dumps(r["slo"], indent=1),
        "```",
        "",
        "## Summary",
        "",
        f"- requests sent: **{r['requests_sent']}** over {r['wall_s']:.1f} s",
        (
            f"- throughput: input {t['input_tps']:.1f} tok/s, output {t['output_tps']:.1f} "
            f"tok/s, {t['rps']:.2f} successful req/s ({t['completed_rps']:.2f} ended req/s)"
        ),
        (
            f"- **goodput: {r['goodput_rps']:.3f} req/s**, {r['goodput']['output_tps']:.1f} "
            f"output tok/s ({r['goodput']['good_requests']} requests met every SLO)"
        ),
        f"- SLO misses by gate: {r['slo_misses'] or 'none'}",
        (
            f"- cost per successful request: {_f(r['cost_per_success'], 4)} "
            f"(per SLO-meeting request: {_f(r['cost']['cost_per_good_request'], 4)}; "
            f"price/device-hour {r['cost']['price_per_device_hour']})"
        ),
        (
            f"- prefix cache: {_f(r['prefix_cache']['hit_rate'])} of prompt tokens cached "
            f"(server-reported per request; scraped counters: "
            f"{_f(r['server_metrics'].get('prefix_cache_hit_rate'))}); preemptions during "
            f"the run: {_f(r['server_metrics'].get('preemptions'))}"
        ),
        (
            f"- requests in flight at the client: mean "
            f"{_f(r['observed_concurrency']['mean'])}, max {r['observed_concurrency']['max']}"
        ),
        f"- load generator dispatch lag p99: {_ms(r['dispatch_lag_s']['p99'])} ms",
        "",
        "## Latency (successful requests)",
        "",
    ]
    lines += latency_table(
        {
            "all": r,
            **{f"class {k}": v for k, v in r["by_class"].items()},
            **{f"priority {k}": v for k, v in r["by_priority"].items()},
        }
    )
    lines += [
        "",
        "Chunk-level ITL (network messages) p50/p95/p99 ms: "
        + "/".join(_ms(r["chunk_itl_s"][p]) for p in ("p50", "p95", "p99")),
        "",
        "## Outcomes and goodput",
        "",
    ]
    lines += outcome_table(
        {
            "all": r,
            **{f"class {k}": v for k, v in r["by_class"].items()},
            **{f"priority {k}": v for k, v in r["by_priority"].items()},
            **{f"tenant {k}": v for k, v in r["by_tenant"].items()},
        }
    )
    lines += [
        "",
        f"Reasons: `{json.dumps(r['outcomes']['by_reason'])}`",
        "",
        "## Server metrics (scraped)",
        "",
    ]
    sm = r["server_metrics"]
    for name, s in sm.get("found", {}).items():
        lines.append(
            f"- {name} (`{s['series_key']}`): max {_f(s['max'])}, mean {_f(s['mean'])}"
            f", change over run {_f(s['delta'])}"
        )
    if sm.get("missing"):
        lines.append(f"- not found on the metrics endpoint: {', '.join(sm['missing'])}")
    wc = r["warm_vs_cold"]
    lines += ["", f"## Warm vs cold (cold = first {wc['warm_window_s']} s)", ""]
    lines += latency_table(
        {
            f"cold ({wc['cold']['requests']} sent)": wc["cold"],
            f"steady ({wc['steady']['requests']} sent)": wc["steady"],
        }
    )
    lines += ["", "## Definitions", ""]
    lines += [f"- **{k}**: {v}" for k, v in r["definitions"].items()]
    lines += ["", "Plots: `latency_cdf.png`, `timeline.png`.", ""]
    return "\n".join(lines)
