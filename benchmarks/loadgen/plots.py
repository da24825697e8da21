"""PNG plots of a run and of a sweep (matplotlib, Agg backend: no display needed). matplotlib
is in the `bench` extra: only this module imports it, and only when a report is plotted."""

from __future__ import annotations

import pathlib
from collections.abc import Sequence

from benchmarks.extras import require
from benchmarks.loadgen import metrics as m
from benchmarks.loadgen.metrics import RequestRecord

require("bench", "matplotlib")

import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

# NOTE: fixed margins instead of tight_layout, which measures every tick label and doubled
# the plotting time (seconds on a loaded 2-core CI machine).


def _cdf(ax, values, label):
    vals = sorted(v for v in values if v is not None)
    if vals:
        ax.plot(vals, [(i + 1) / len(vals) for i in range(len(vals))], label=label)


def latency_cdf(path: pathlib.Path, records: Sequence[RequestRecord], slo: dict) -> None:
    ok = [r for r in records if r.outcome == "success"]
    fig, axes = plt.subplots(1, 4, figsize=(16, 3.6))
    series = [
        ("TTFT", [m.ttft(r) for r in ok], slo.get("ttft_s")),
        ("TPOT", [m.tpot(r) for r in ok], slo.get("tpot_s")),
        ("ITL (token)", [g for r in ok for g in m.itl(r)], slo.get("itl_max_s")),
        ("E2E", [m.e2e(r) for r in ok], slo.get("e2e_s")),
    ]
    for ax, (name, vals, limit) in zip(axes, series):
        vals = [v for v in vals if v is not None]
        _cdf(ax, vals, name)
        if limit:
            ax.axvline(limit, color="red", linestyle="--", label=f"SLO {limit:g} s")
        if vals and min(vals) > 0:
            ax.set_xscale("log")
        ax.set_xlabel(f"{name} (s)")
        ax.set_ylabel("fraction of successful requests")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.subplots_adjust(left=0.05, right=0.98, bottom=0.15, top=0.95, wspace=0.3)
    fig.savefig(path, dpi=90)
    plt.close(fig)


def timeline(path: pathlib.Path, records: Sequence[RequestRecord], server: dict) -> None:
    t0 = min(r.send_s for r in records)
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    colors = {
        "success": "tab:blue",
        "cancelled": "tab:gray",
        "rejected": "tab:orange",
        "timed_out": "tab:red",
        "failed": "black",
    }
    for outcome, color in colors.items():
        pts = [
            (r.send_s - t0, m.ttft(r))
            for r in records
            if r.outcome == outcome and m.ttft(r) is not None
        ]
        if pts:
            ax1.scatter(*zip(*pts), s=8, color=color, label=outcome)
    ax1.set_ylabel("TTFT (s) by send time")
    if ax1.get_legend_handles_labels()[0]:
        ax1.legend(fontsize=8)
    ax1.grid(alpha=0.3)
    found = server.get("found", {})
    for name in ("running", "waiting"):
        if name in found and found[name]["points"]:
            ax2.plot(*zip(*found[name]["points"]), label=name)
    if "kv_usage" in found and found["kv_usage"]["points"]:
        ax3 = ax2.twinx()
        ax3.plot(*zip(*found["kv_usage"]["points"]), color="tab:green", label="KV usage")
        ax3.set_ylabel("KV usage", color="tab:green")
    ax2.set_xlabel("seconds since first send")
    ax2.set_ylabel("requests running / waiting")
    if ax2.get_legend_handles_labels()[0]:
        ax2.legend(fontsize=8, loc="upper left")
    ax2.grid(alpha=0.3)
    fig.subplots_adjust(left=0.08, right=0.9, bottom=0.09, top=0.97, hspace=0.1)
    fig.savefig(path, dpi=90)
    plt.close(fig)


def run_plots(
    out: pathlib.Path, report: dict, records: Sequence[RequestRecord]
) -> list[pathlib.Path]:
    paths = [out / "latency_cdf.png", out / "timeline.png"]
    latency_cdf(paths[0], records, report["slo"]["default"])
    timeline(paths[1], records, report.get("server_metrics", {}))
    return paths


def latency_vs_rate(
    path: pathlib.Path, steps: list[dict], knee: float | None, operating: float | None, slo: dict
) -> None:
    """p50/p95 TTFT, TPOT, E2E against offered rate, throughput and goodput below."""
    rates = [s["rate"] for s in steps]
    fig, axes = plt.subplots(2, 2, figsize=(12, 7))
    for ax, key in zip(axes.flat, ("ttft_s", "tpot_s", "e2e_s")):
        for p, style in (("p50", "o-"), ("p95", "s--"), ("p99", "^:")):
            ax.plot(
                rates,
                [s[key][p] if s[key][p] is not None else float("nan") for s in steps],
                style,
                label=p,
            )
        if slo.get(key):
            ax.axhline(slo[key], color="red", linestyle="--", label="SLO")
        ax.set_ylabel(f"{key[:-2].upper()} (s)")
        ax.set_xlabel("offered rate (req/s)")
        ax.set_yscale("log")
    ax = axes.flat[3]
    ax.plot(rates, rates, "k:", label="offered")
    ax.plot(rates, [s["throughput"]["rps"] for s in steps], "o-", label="successful req/s")
    ax.plot(rates, [s["goodput_rps"] for s in steps], "s-", label="goodput req/s")
    ax.set_xlabel("offered rate (req/s)")
    ax.set_ylabel("req/s")
    for a in axes.flat:
        if knee is not None:
            a.axvline(knee, color="tab:orange", alpha=0.6, label="knee")
        if operating is not None:
            a.axvline(operating, color="tab:green", alpha=0.6, label="operating point")
        a.grid(alpha=0.3)
        a.legend(fontsize=7)
    fig.subplots_adjust(left=0.07, right=0.98, bottom=0.08, top=0.97, wspace=0.25, hspace=0.3)
    fig.savefig(path, dpi=90)
    plt.close(fig)
