"""report.md and the PNG plots of the quant report (benchmarks/quant_report.py)."""

from __future__ import annotations

import pathlib

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def render_plots(report: dict, out: pathlib.Path) -> None:
    if "quality" in report:
        fig, ax = plt.subplots(figsize=(8, 4))
        edges = [-8 + 9 * i / 40 for i in range(41)]
        for name, q in report["quality"].items():
            if name != "float32":
                ax.stairs(q["kl_histogram"], edges, label=name)
        ax.set_xlabel("log10 KL(float32 || variant) per token, nats")
        ax.set_ylabel("tokens")
        ax.legend()
        fig.savefig(out / "kl_histogram.png", dpi=90)
        plt.close(fig)
    if "speed" not in report:
        return
    speed = report["speed"]
    names = [n for n in speed if n != "float32"]
    if not names:
        return
    keys = [k for k in speed[names[0]] if k.endswith("_vs_float32")]
    fig, ax = plt.subplots(figsize=(9, 4))
    width = 0.8 / max(len(keys), 1)
    for i, k in enumerate(keys):
        ax.bar([j + i * width for j in range(len(names))], [speed[n][k] for n in names], width)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(names))], names, fontsize=7)
    ax.axhline(1.0, color="gray", linestyle="--")
    ax.set_ylabel("x float32 (higher is faster)")
    ax.legend([k.replace("_vs_float32", "") for k in keys], fontsize=7)
    fig.savefig(out / "speed.png", dpi=90)
    plt.close(fig)


def _table(header: list[str], rows: list[list]) -> list[str]:
    fmt = lambda v: f"{v:.4g}" if isinstance(v, float) else str(v)  # noqa: E731
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(fmt(v) for v in r) + " |" for r in rows]
    return lines + [""]


def render_markdown(r: dict) -> str:
    s = r["sizes"]
    md = [
        f"# Quantization report: {r['model']} ({r['date_utc']} UTC)",
        "",
        f"JAX {r['jax']} on {r['backend']}; load average {r['loadavg_start']} at start, "
        f"{r['loadavg_end']} at end (a shared 2-core machine: speed figures are noisy; "
        f"ratios are against float32 measured in the same run); {r['wall_s']} s in all.",
        f"Sizes: {s['windows']} windows x {s['window_tokens']} tokens of quality, "
        f"{s['max_new_tokens']} new tokens per behaviour prompt, long context "
        f"{s['long_context_tokens']} tokens.",
        "",
        "## Targets",
        "",
    ]
    md += _table(
        ["target", "value", "pass"],
        [[k, v["value"], "PASS" if v["pass"] else "FAIL"] for k, v in r["targets"].items()],
    )
    md += ["## 1. Quality vs float32 (stdlib docstrings corpus)", ""]
    md += _table(
        ["variant", "tokens", "mean KL", "p99 KL", "max KL", "top-1", "ppl", "ppl change %"],
        [
            [
                n,
                q["tokens"],
                q["mean_kl_nats"],
                q["p99_kl_nats"],
                q["max_kl_nats"],
                q["top1_agreement"],
                q["perplexity"],
                q["perplexity_change_pct"],
            ]
            for n, q in r.get("quality", {}).items()
        ],
    )
    md += ["![KL histogram](kl_histogram.png)", "", "## 2. Behaviour (paged engine, greedy)", ""]
    rows = []
    for n, b in r.get("behaviour", {}).items():
        for k, p in b["prompts"].items():
            rows.append(
                [
                    n,
                    k,
                    p["prompt_tokens"],
                    p["identical_token_share"],
                    p["common_prefix_tokens"],
                    p["mean_logprob_chosen"],
                    p["logprob_of_float_tokens"],
                    p["entropy_t1"],
                ]
            )
    md += _table(
        [
            "variant",
            "prompt",
            "prompt tokens",
            "identical tokens",
            "common prefix",
            "logprob chosen",
            "logprob of float32's tokens",
            "entropy T=1",
        ],
        rows,
    )
    md += ["Continuations (first 160 characters):", ""]
    for n, b in r.get("behaviour", {}).items():
        for k, p in b["prompts"].items():
            text = p["text"][:160].replace("\n", " ").replace("|", "/")
            md.append(f"- {n} / {k}: `{text}`")
    md += [""]
    if "speed" in r:
        md += ["## 3. Speed (paged engine on this machine)", ""]
        sp = r["speed"]
        keys = list(next(iter(sp.values())))
        md += _table(
            ["variant", *keys], [[n, *[row.get(k) for k in keys]] for n, row in sp.items()]
        )
        md += ["![speed](speed.png)", "", "Matmul formulations (30 stacked layers, scan):", ""]
        md += _table(
            ["tokens", "formulation", "ms", "x float32", "load"],
            [
                [f["tokens"], f["formulation"], f["ms"], f["vs_float32"], f["loadavg_1m"]]
                for f in r["formulations"]
            ],
        )
    md += ["## 4. Memory and capacity", ""]
    mem = r["memory"]
    keys = list(next(iter(mem.values())))
    md += _table(["variant", *keys], [[n, *[row[k] for k in keys]] for n, row in mem.items()])
    md += [
        f"KV bytes per token as allocated by PagedKVCache: {r['kv_bytes_per_token_allocated']}.",
        f"Budgets: KV {s['kv_budget_bytes']} bytes; device {s['device_bytes']} bytes for "
        f"weights + KV; sequences of {s['seq_tokens']} tokens. A deployment that must fall "
        "back to float32 has the float32 row's capacity "
        "(concurrency_lost_on_float32_fallback).",
        "",
        "## 5. Artifact",
        "",
        "```",
    ]
    a = r["artifact"]
    md += [f"source: {a['source']}", f"source tensor types: {a['source_tensor_types']}"]
    md += [f"loader: {line}" for line in a["loader_paths"]] or ["loader: (no GGUF int8 paths)"]
    md += [f"{k}: {v}" for k, v in a["weights"].items()]
    md += [f"kv int8: {a['kv_int8']}"] + [f"revision {n}: {v}" for n, v in a["revisions"].items()]
    md += ["```", ""]
    return "\n".join(md)
