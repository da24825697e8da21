"""Speculative decoding benchmark (issue 11): spec off vs each proposer (ngram, layers),
by batch size, on a workload where drafts should be right (quote back a passage given in
the prompt) and one where they should not (a free-form story), plus "policy": ngram with
the default auto-disable (`disable_by_batch_size`), to show where it switches off.

    python -m benchmarks.spec_bench --modes=off,ngram,layers,policy --draft_layers=8

    python -m benchmarks.spec_bench                      # SmolLM2-135M, float32
    python -m benchmarks.spec_bench --batches=1,8 --max_tokens=48 --out=spec.json
    python -m benchmarks.spec_bench --smoke              # tiny model, seconds (CI)

How each figure is measured:
- One loaded model; per batch size two LLMs over it (off, ngram). Greedy requests (so a
  rerun takes the same path and reaches the same step shapes), `max_tokens` new tokens,
  ignore_eos so every request decodes the same length. Each workload runs once untimed per
  engine (compiles; `compiles` counts any in timed runs), then `--repeats` timed runs
  alternating off / ngram, so a change of machine load hits both; the median run by tok/s
  is reported, with every run's tok/s. Prefix caching off (a rerun would hit).
- mode "off": no speculation (overlapped steps); "ngram": k drafts from prompt lookup,
  `disable_by_batch_size=None` so speculation runs at every batch size measured;
  "layers": k drafts from the target's first `--draft_layers` layers + its head (same
  forced-on policy); "policy": ngram with the default disable_by_batch_size (off above it).
- TPOT: mean over requests of (last token time - first token time) / (tokens - 1);
  tok/s: output tokens / wall time of the run (prefill included); acceptance: accepted /
  drafted tokens; tokens/verify: tokens a verified sequence emits per step; draft overhead:
  host ms proposing per verify step, as a share of the verify step's ms.
- Policy: the largest measured batch at which ngram beats off on tok/s on some workload
  and keeps >= 0.9x of it on every workload (the free story, whose drafts fail): what
  `SpeculativeConfig.disable_by_batch_size` should be on this machine. Printed at the end.
Load average is printed with every figure: other processes share this CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from engine import LLM, SamplingParams
from models.registry import load_model

PASSAGE = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk. He wiped the "
    "salt from the great lens, trimmed the wick, and lit the lamp that had guided ships "
    "past the northern rocks for a hundred years. In the logbook he wrote the weather, the "
    "ships he saw, and the number of gulls resting on the rail."
)
WORKLOADS = {
    "quote": f"Repeat the following passage exactly, word for word:\n\n{PASSAGE}",
    "story": "Write a short, original story about a dragon who is afraid of the dark.",
}


def load_avg() -> str:
    return "load {:.1f}/{:.1f}/{:.1f}".format(*os.getloadavg())


def run_once(llm: LLM, prompts: list, params: SamplingParams) -> dict:
    before = llm.stats()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall_s = time.perf_counter() - t0
    after = llm.stats()
    tokens = sum(len(o.token_ids) for o in outs)
    tpots = [o.metrics.tpot_s for o in outs if o.metrics.tpot_s is not None]
    row = {
        "compiles": after["compiles_total"] - before["compiles_total"],
        "wall_s": wall_s,
        "tok_s": tokens / wall_s,
        "tpot_ms": 1e3 * statistics.mean(tpots) if tpots else None,
        "outputs": [o.token_ids for o in outs],
    }
    if "spec_drafted_tokens" in after:
        diff = lambda k: after[k] - before.get(k, 0)
        drafted, accepted = diff("spec_drafted_tokens"), diff("spec_accepted_tokens")
        steps = max(diff("spec_verify_steps"), 1)
        row.update(
            acceptance=accepted / max(drafted, 1),
            tokens_per_verify=(diff("spec_verified_seqs") + accepted)
            / max(diff("spec_verified_seqs"), 1),
            verify_steps=diff("spec_verify_steps"),
            draft_overhead=(
                (after["spec_draft_ms_per_step"] * after["spec_verify_steps"])
                - (before.get("spec_draft_ms_per_step", 0) * before.get("spec_verify_steps", 0))
            )
            / steps
            / max(after["spec_verify_ms_per_step"], 1e-9),
        )
    return row


def prompts_for(workload: str, batch: int, smoke: bool) -> list:
    if smoke:  # tiny model, no chat template: a repeated phrase vs random tokens
        quote = [1] + list(range(10, 40)) * 2
        return [quote if workload == "quote" else [1, 5 + i, 7, 9] for i in range(batch)]
    conversation = [{"role": "user", "content": WORKLOADS[workload]}]
    return [conversation] * batch  # LLM.generate renders the chat template


def engines(model, args) -> dict[str, LLM]:
    """The engines compared (args.modes), over one set of weights."""
    opts = dict(max_num_seqs=max(args.batches), max_model_len=args.max_model_len)
    opts["prefix_caching"] = False  # a repeated run would hit
    spec = {"num_speculative_tokens": args.k, "disable_by_batch_size": None}
    specs = {
        "off": None,
        "ngram": spec,
        "layers": dict(spec, method="layers", num_draft_layers=args.draft_layers),
        "policy": {"num_speculative_tokens": args.k},  # the default disable_by_batch_size
    }
    return {mode: LLM(model, speculative=specs[mode], **opts) for mode in args.modes}


def measure(llms: dict, workload: str, batch: int, args) -> dict[str, dict]:
    """Both modes on one workload: each run once untimed (compiles), then `repeats` timed
    runs alternating off / ngram (so load changes hit both); the median-tok/s run is kept."""
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    prompts = prompts_for(workload, batch, args.smoke)
    for llm in llms.values():
        run_once(llm, prompts, params)
    runs = {mode: [] for mode in llms}
    for _ in range(args.repeats):
        for mode, llm in llms.items():
            runs[mode].append(run_once(llm, prompts, params))
    rows = {}
    for mode, rs in runs.items():
        row = sorted(rs, key=lambda r: r["tok_s"])[len(rs) // 2]
        row.update(workload=workload, batch=batch, mode=mode, load=os.getloadavg())
        row["tok_s_runs"] = [round(r["tok_s"], 2) for r in rs]
        rows[mode] = row
    return rows


def fmt(row: dict) -> str:
    spec = ""
    if "acceptance" in row:
        spec = (
            f" acc={row['acceptance']:.2f} tok/verify={row['tokens_per_verify']:.2f}"
            f" draft_overhead={row['draft_overhead']:.3f}"
        )
    tpot = "n/a" if row["tpot_ms"] is None else f"{row['tpot_ms']:.1f}"
    return (
        f"{row['workload']:>5} b={row['batch']:<3} {row['mode']:>5}: TPOT {tpot} ms, "
        f"{row['tok_s']:.1f} tok/s{spec} compiles={row['compiles']}  [load {row['load'][0]:.1f}]"
    )


def policy(rows: list[dict], floor: float = 0.9, mode: str = "ngram") -> int | None:
    """Largest batch where speculation pays somewhere (mode/off tok/s > 1 on some
    workload) and costs at most 1 - floor everywhere (>= floor on every workload, e.g. a
    free story whose drafts all fail); None: no such batch."""
    best = None
    for b in sorted({r["batch"] for r in rows}):
        tok_s = {(r["workload"], r["mode"]): r["tok_s"] for r in rows if r["batch"] == b}
        if not any(m == mode for _, m in tok_s):
            continue
        ratios = [tok_s[(w, mode)] / tok_s[(w, "off")] for w in {w for w, _ in tok_s}]
        if max(ratios) > 1 and min(ratios) >= floor:
            best = b
    return best


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny model, small sizes")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--workloads", default="quote,story")
    ap.add_argument("--max_tokens", type=int, default=64)
    ap.add_argument("--max_model_len", type=int, default=512)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--modes", default="off,ngram,layers,policy")
    ap.add_argument("--draft_layers", type=int, default=8, help="layers: the first N draft")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per mode (median)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    args.batches = [int(b) for b in args.batches.split(",")]
    args.modes = args.modes.split(",")
    if args.modes[0] != "off":
        raise ValueError(f"--modes={','.join(args.modes)}: the first mode must be off")
    if args.smoke:
        args.max_tokens, args.repeats = min(args.max_tokens, 12), 1
        args.draft_layers = min(args.draft_layers, 1)  # the tiny model has 2 layers
    model = load_model("tiny" if args.smoke else "smollm2-135m")
    rows = []
    for batch in args.batches:
        llms = engines(model, args)
        for workload in args.workloads.split(","):
            pair = measure(llms, workload, batch, args)
            rows += pair.values()
            for row in pair.values():
                print(fmt(row), flush=True)
            for mode in args.modes[1:]:
                same = pair["off"]["outputs"] == pair[mode]["outputs"]
                pair[mode]["identical_outputs"] = same
                speedup = pair[mode]["tok_s"] / pair["off"]["tok_s"]
                tpot = pair["off"]["tpot_ms"] / pair[mode]["tpot_ms"]
                print(
                    f"  -> {mode}/off: tok/s x{speedup:.2f}, TPOT lower x{tpot:.2f}, "
                    f"greedy outputs identical: {same}  [{load_avg()}]",
                    flush=True,
                )
    best = {m: policy(rows, mode=m) for m in args.modes[1:] if m != "policy"}
    print(f"policy: disable_by_batch_size={best} (a gain somewhere, >= 0.9x everywhere)")
    for r in rows:
        r.pop("outputs")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"rows": rows, "disable_by_batch_size": best}, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
