"""PNG plots of a run and of a sweep (matplotlib, Agg backend: no display needed). matplotlib
is in the `bench` extra: only this module imports it, and only when a report is plotted."""

from __future__ import annotations

import pathlib
from collections.abc import Sequence

from serving.capacity.loadgen import metrics as m
from serving.capacity.loadgen.labels import run_label
from serving.capacity.loadgen.metrics import RequestRecord
from serving.extras import require

require("bench", "matplotlib")

import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import FuncFormatter, LogLocator, MaxNLocator, NullFormatter  # noqa: E402

# NOTE: fixed margins instead of tight_layout, which measures every tick label and doubled
# the plotting time (seconds on a loaded 2-core CI machine).


def _cdf(ax, values, label):
    vals = sorted(v for v in values if v is not None)
    if vals:
        ax.plot(vals, [(i + 1) / len(vals) for i in range(len(vals))], label=label)


def _seconds(v: float, _pos=None) -> str:
    """Tick label of a duration: '12ms', '0.5s', '30s'."""
    if v <= 0:
        return "0"
    return f"{v * 1e3:.3g}ms" if v < 1 else f"{v:.3g}s"


def _time_axis(ax, values: list[float], axis: str = "x") -> None:
    """Log scale only when the values span more than a decade and a half; either way at most
    ~6 labelled ticks, written in ms or s (minor labels overprinted each other before)."""
    which = ax.xaxis if axis == "x" else ax.yaxis
    span_ok = values and min(values) > 0 and max(values) / min(values) > 30
    if span_ok:
        (ax.set_xscale if axis == "x" else ax.set_yscale)("log")
        subs = (1.0, 2.0, 5.0) if max(values) / min(values) < 1000 else (1.0,)
        which.set_major_locator(LogLocator(base=10, subs=subs, numticks=8))
        which.set_minor_formatter(NullFormatter())
    else:
        which.set_major_locator(MaxNLocator(5))
    which.set_major_formatter(FuncFormatter(_seconds))


def _wrap(title: str, width: int = 110) -> str:
    import textwrap

    return "\n".join(textwrap.wrap(title, width))


def latency_cdf(
    path: pathlib.Path, records: Sequence[RequestRecord], slo: dict, title: str = ""
) -> None:
    ok = [r for r in records if r.outcome == "success"]
    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5))
    axes = axes.flat
    series = [
        ("TTFT", [m.ttft(r) for r in ok], slo.get("ttft_s")),
        ("TPOT", [m.tpot(r) for r in ok], slo.get("tpot_s")),
        ("ITL (token)", [g for r in ok for g in m.itl(r)], slo.get("itl_max_s")),
        ("E2E", [m.e2e(r) for r in ok], slo.get("e2e_s")),
    ]
    for ax, (name, vals, limit) in zip(axes, series):
        vals = [v for v in vals if v is not None]
        _cdf(ax, vals, name)
        # An SLO line far right of every value would squeeze the curve into one corner.
        on_scale = limit is not None and (not vals or limit <= 10 * max(vals))
        if on_scale:
            ax.axvline(limit, color="red", linestyle="--", label=f"SLO {_seconds(limit)}")
        _time_axis(ax, vals + ([limit] if on_scale else []))
        note = f", SLO {_seconds(limit)} off scale" if limit and not on_scale else ""
        ax.set_title(f"{name}: {len(vals)} values{note}", fontsize=9)
        ax.set_xlabel(name)
        ax.set_ylabel(
            "fraction of token gaps" if name.startswith("ITL") else "fraction of requests"
        )
        ax.legend(fontsize=8, loc="lower right")
        ax.grid(alpha=0.3)
    fig.suptitle(f"Latency CDFs, successful requests\n{_wrap(title)}", fontsize=10)
    fig.subplots_adjust(left=0.07, right=0.98, bottom=0.07, top=0.88, wspace=0.25, hspace=0.4)
    fig.savefig(path, dpi=90)
    plt.close(fig)


def timeline(
    path: pathlib.Path, records: Sequence[RequestRecord], server: dict, title: str = ""
) -> None:
    t0 = min(r.send_s for r in records)
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(10, 6.8), sharex=True)
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
    ax1.set_ylabel("TTFT by send time")
    ax1.yaxis.set_major_formatter(FuncFormatter(_seconds))
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
    fig.suptitle(f"TTFT and server queues over the run\n{_wrap(title, 90)}", fontsize=10)
    fig.subplots_adjust(left=0.08, right=0.9, bottom=0.08, top=0.86, hspace=0.1)
    fig.savefig(path, dpi=90)
    plt.close(fig)


def run_plots(
    out: pathlib.Path, report: dict, records: Sequence[RequestRecord]
) -> list[pathlib.Path]:
    paths = [out / "latency_cdf.png", out / "timeline.png"]
    title = run_label(report)
    latency_cdf(paths[0], records, report["slo"]["default"], title)
    timeline(paths[1], records, report.get("server_metrics", {}), title)
    return paths


def latency_vs_rate(
    path: pathlib.Path,
    steps: list[dict],
    knee: float | None,
    operating: float | None,
    slo: dict,
    title: str = "",
) -> None:
    """p50/p95 TTFT, TPOT, E2E against offered rate, throughput and goodput below."""
    rates = [s["rate"] for s in steps]
    fig, axes = plt.subplots(2, 2, figsize=(12, 7.5))
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
        ax.yaxis.set_minor_formatter(NullFormatter())
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
        a.set_xticks(rates, [f"{r:g}" for r in rates])
    knee_note = "" if knee is not None else " (knee not reached: capacity is above the rates tried)"
    fig.suptitle(
        f"Rate sweep: latency and goodput vs offered rate{knee_note}\n{_wrap(title)}", fontsize=10
    )
    fig.subplots_adjust(left=0.07, right=0.98, bottom=0.08, top=0.9, wspace=0.25, hspace=0.3)
    fig.savefig(path, dpi=90)
    plt.close(fig)
