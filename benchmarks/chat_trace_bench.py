"""Multi-turn chat trace with the host KV tier off vs on (issue 34, "Measure": host tier).

    python -m benchmarks.chat_trace_bench                   # SmolLM2-135M, the sizes below
    python -m benchmarks.chat_trace_bench --smoke           # tiny model, seconds
    python -m benchmarks.chat_trace_bench --conversations=200 --turns=6 --json=out.json

The trace: `conversations` chats of `turns` turns each behind one shared system prompt
(`system_tokens` of the load generator's prose). Turn t's prompt is the conversation so
far (system prompt, every earlier user message and reply) plus a new user message of
`user_tokens` (a slice of the same prose at a random offset); the reply is `reply_tokens`
greedy tokens (`ignore_eos`), appended to the conversation. Turns go in rounds: round t
holds turn t of every conversation in a shuffled order (a conversation's turn waits for its
previous reply), fed to the engine closed-loop, `concurrency` requests in flight.

The device pool holds `pool_fraction` of the trace's working set (the system prompt plus
every conversation's final context, in pages; the issue: "working set ~4x the device
pool"), so between two turns of one conversation the other conversations push its pages
out. Device only, the evicted context is recomputed; with the host tier (`host_kv_gib`,
default: the whole working set) its pages come back from host memory.

Two engines over the same weights and the same step programs (both warmed first, outside
the timing), the trace run on each (`repeats` times, alternating which goes first).
Reported per engine: prefix hit rate (cached / prompt tokens, and cached / the tokens a
perfect cache would hold: what earlier turns computed, in whole pages), host tier hits,
prefill tokens computed, mean / p50 / p90 TTFT (the engine's arrival -> first token),
requests/s and output tokens/s, wall time; whether every reply was identical. The CPU may
be shared: the load average is printed with the results; compare the engines' ratios.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import sys
import time

import numpy as np

from benchmarks.prefix_cache_bench import progress, system_prompt
from configs.engine_config import EngineConfig
from engine.api_types import EngineRequest
from engine.runner import compiles
from engine.runner.kv_offload import page_bytes_of
from engine.sampling.params import SamplingParams


@dataclasses.dataclass(frozen=True)
class TraceSizes:
    model: str = "smollm2-135m"
    # The trace is 200 conversations x 6 turns; on the shared 2-core CPU one pass
    # of that takes hours, so the default keeps the 6 turns and the 4x working set with 32.
    conversations: int = 32
    turns: int = 6
    system_tokens: int = 256
    user_tokens: int = 32
    reply_tokens: int = 16
    concurrency: int = 4
    pool_fraction: float = 0.25  # device pool / working set
    num_pages: int | None = None  # the device pool (with the null page); None: by fraction
    host_kv_gib: float | None = None  # None: the whole working set
    repeats: int = 1
    seed: int = 0
    engine: tuple = (
        ("page_size", 16),
        ("max_num_batched_tokens", 256),
        ("prefill_chunk_size", 256),
        ("layer_loop", "scan"),  # compiles ~5x faster than unrolled on XLA:CPU
    )

    @property
    def page_size(self) -> int:
        return dict(self.engine)["page_size"]

    @property
    def max_context_tokens(self) -> int:
        """The last turn's prompt plus its reply."""
        return self.system_tokens + self.turns * (self.user_tokens + self.reply_tokens)

    @property
    def working_set_pages(self) -> int:
        """Pages of KV the trace reuses: the system prompt's, and each conversation's own
        (its final context past the system prompt)."""
        own = self.max_context_tokens - self.system_tokens
        return math.ceil(self.system_tokens / self.page_size) + self.conversations * math.ceil(
            own / self.page_size
        )

    def device_pages(self) -> int:
        """Usable device pages: `num_pages - 1`, or the fraction of the working set, but at
        least what `concurrency` requests at the longest context need."""
        if self.num_pages is not None:
            return self.num_pages - 1
        floor = self.concurrency * math.ceil(self.max_context_tokens / self.page_size)
        return max(floor, math.ceil(self.pool_fraction * self.working_set_pages))


SIZES = {
    "full": TraceSizes(),
    # The engine shapes of tests/test_host_kv_tier.py (page 8, 7 pages, 2 sequences, a
    # 16-token step, max_model_len 32), so the smoke test compiles little after it: 4
    # conversations of 3 turns, a 13-page working set on 6 device pages.
    "smoke": TraceSizes(
        model="tiny",
        conversations=4,
        turns=3,
        system_tokens=8,
        user_tokens=4,
        reply_tokens=4,
        concurrency=1,  # the last turn takes 4 of the 6 pages
        num_pages=7,
        host_kv_gib=1e-3,
        engine=(
            ("page_size", 8),
            ("max_num_seqs", 2),
            ("max_num_batched_tokens", 16),
            ("prefill_chunk_size", 16),
            ("max_model_len", 32),
        ),
    ),
}


# ---- the trace -----------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ChatTrace:
    system: list[int]
    user: list[list[list[int]]]  # [conversation][turn] -> the user message's token ids
    order: list[tuple[int, int]]  # (conversation, turn), round by round, shuffled per round


def build_trace(sizes: TraceSizes, tokenizer) -> ChatTrace:
    """The system prompt, every user message and the submission order (seeded)."""
    rng = np.random.default_rng(sizes.seed)
    prose = system_prompt(tokenizer, sizes.system_tokens + 4096)[sizes.system_tokens :]
    span = len(prose) - sizes.user_tokens
    user = [
        [prose[o : o + sizes.user_tokens] for o in rng.integers(0, span, sizes.turns).tolist()]
        for _ in range(sizes.conversations)
    ]
    order = [(int(c), t) for t in range(sizes.turns) for c in rng.permutation(sizes.conversations)]
    return ChatTrace(system_prompt(tokenizer, sizes.system_tokens), user, order)


def reusable_tokens(prompt_len: int, known_len: int, page_size: int) -> int:
    """Prompt tokens a perfect prefix cache serves: the whole pages of what earlier requests
    computed (`known_len` tokens of this prompt's prefix), never the prompt's last token."""
    return min(prompt_len - 1, known_len // page_size * page_size)


# ---- running it ----------------------------------------------------------------------------
def run_trace(core, trace: ChatTrace, sizes: TraceSizes, tag: str) -> dict:
    """The trace through `core`, closed-loop: {"requests": [...], "wall_s", figures}."""
    params = SamplingParams(temperature=0, max_tokens=sizes.reply_tokens, ignore_eos=True)
    context = [list(trace.system) for _ in trace.user]  # each conversation so far
    known = [0] * len(trace.user)  # tokens of it whose KV an earlier request computed
    done_turns = [0] * len(trace.user)
    pending = list(trace.order)
    in_flight: dict[str, dict] = {}
    records = []
    stats0 = core.stats()
    system_seen = False
    t0 = time.perf_counter()
    while pending or in_flight:
        while pending and len(in_flight) < sizes.concurrency:
            ready = [i for i, (c, t) in enumerate(pending) if done_turns[c] == t]
            if not ready:
                break
            c, t = pending.pop(ready[0])
            prompt = context[c] + trace.user[c][t]
            known_len = known[c] if t else (len(trace.system) if system_seen else 0)
            system_seen = True
            rid = f"{tag}-c{c}-t{t}"
            in_flight[rid] = {"conversation": c, "turn": t, "prompt": prompt, "reply": [],
                              "reusable": reusable_tokens(len(prompt), known_len,
                                                          sizes.page_size)}  # fmt: skip
            core.add_request(EngineRequest(rid, prompt, params))
        for out in core.step():
            rec = in_flight[out.request_id]
            rec["reply"] += out.new_token_ids
            if not out.finished:
                continue
            del in_flight[out.request_id]
            c = rec["conversation"]
            context[c] = rec["prompt"] + rec["reply"]
            known[c] = len(context[c]) - 1  # the last reply token's KV is never written
            done_turns[c] += 1
            m = out.metrics
            records.append({
                "conversation": c, "turn": rec["turn"], "prompt_tokens": len(rec["prompt"]),
                "reusable_tokens": rec["reusable"], "cached_tokens": m.cached_tokens,
                "ttft_s": m.ttft_s, "e2e_s": m.e2e_s, "reply": rec["reply"],
            })  # fmt: skip
    wall = time.perf_counter() - t0
    return summarize(records, wall, stats0, core.stats())


def summarize(records: list[dict], wall_s: float, before: dict, after: dict) -> dict:
    prompt = sum(r["prompt_tokens"] for r in records)
    cached = sum(r["cached_tokens"] for r in records)
    reusable = sum(r["reusable_tokens"] for r in records)
    ttft = [r["ttft_s"] for r in records]
    delta = lambda k: after.get(k, 0) - before.get(k, 0)
    return {
        "requests": len(records),
        "wall_s": wall_s,
        "requests_per_s": len(records) / wall_s,
        "output_tokens_per_s": sum(len(r["reply"]) for r in records) / wall_s,
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "reusable_tokens": reusable,
        "hit_rate": cached / prompt,
        "hit_rate_of_reusable": cached / max(1, reusable),
        "host_hit_tokens": delta("host_kv_hit_tokens"),
        "tokens_computed": delta("tokens_processed"),
        "ttft_mean_s": statistics.fmean(ttft),
        "ttft_p50_s": float(np.percentile(ttft, 50)),
        "ttft_p90_s": float(np.percentile(ttft, 90)),
        "replies": {f"{r['conversation']}:{r['turn']}": r["reply"] for r in records},
    }


def engine_config(sizes: TraceSizes, host_kv_gib: float) -> EngineConfig:
    opts = {
        "max_num_seqs": sizes.concurrency,
        "max_model_len": sizes.max_context_tokens,
        **dict(sizes.engine),
        "num_pages": sizes.device_pages() + 1,
    }
    return EngineConfig(model=sizes.model, host_kv_gib=host_kv_gib, **opts)


def measure(sizes: TraceSizes, model=None, warm: bool = True) -> dict:
    """The trace on a device-only engine and on one with the host tier. `model`: an already
    loaded models.registry.LoadedModel; `warm`: build every step program first (tests skip
    it: they compile only the shapes the trace meets)."""
    from engine.core import EngineCore
    from engine.runner.warmup import warmup
    from models.registry import load_model

    load_before = os.getloadavg()
    model = model or load_model(sizes.model)
    device = EngineCore(model, engine_config(sizes, 0.0))
    page_bytes = page_bytes_of(device.runner.state.kv)
    host_gib = sizes.host_kv_gib or 1.05 * sizes.working_set_pages * page_bytes / 2**30
    engines = {"device": device, "host": EngineCore(model, engine_config(sizes, host_gib))}
    t0 = time.perf_counter()
    for name, core in engines.items() if warm else ():
        progress(f"chat trace: warm-up, {name}")
        warmup(core)
    warmup_s = time.perf_counter() - t0
    trace = build_trace(sizes, model.tokenizer)
    runs: dict[str, list[dict]] = {name: [] for name in engines}
    compiled = compiles.count("engine_step")
    for rep in range(sizes.repeats):
        order = ["device", "host"] if rep % 2 == 0 else ["host", "device"]
        for name in order:
            progress(f"chat trace: repeat {rep}, {name}")
            core = engines[name]
            core.clear_prefix_cache()
            runs[name].append(run_trace(core, trace, sizes, f"{name}{rep}"))
            progress(f"chat trace: {name} {json.dumps(figures(runs[name][-1]))}")
    replies = [r["replies"] for rs in runs.values() for r in rs]
    host = engines["host"].stats()
    return {
        "sizes": dataclasses.asdict(sizes),
        "working_set_pages": sizes.working_set_pages,
        "device_pages": sizes.device_pages(),
        "page_bytes": page_bytes,
        "host_kv_gib": host_gib,
        "host_pages": host["host_kv_pages_total"],
        "runs": {name: [figures(r) for r in rs] for name, rs in runs.items()},
        "replies_identical": all(r == replies[0] for r in replies),
        "host_stats": {k: v for k, v in host.items() if k.startswith("host_kv")},
        "warmup_s": warmup_s,
        "compiles_in_timed_runs": compiles.count("engine_step") - compiled,
        "loadavg_before": load_before,
        "loadavg_after": os.getloadavg(),
        "cpus": os.cpu_count(),
    }


def figures(run: dict) -> dict:
    return {k: v for k, v in run.items() if k != "replies"}


def median_of(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def render(r: dict) -> str:
    s = r["sizes"]
    rows = [
        (
            f"Chat trace: {s['model']}, {s['conversations']} conversations x {s['turns']} "
            f"turns ({s['system_tokens']}-token system prompt, {s['user_tokens']}-token user "
            f"messages, {s['reply_tokens']}-token replies), {s['concurrency']} in flight"
        ),
        (
            f"  working set {r['working_set_pages']} pages, device pool {r['device_pages']} "
            f"pages ({r['working_set_pages'] / r['device_pages']:.1f}x), host tier "
            f"{r['host_kv_gib']:.3g} GiB = {r['host_pages']} pages of {r['page_bytes']} bytes; "
            f"{r['cpus']} CPUs, load average {r['loadavg_before'][0]:.1f} -> "
            f"{r['loadavg_after'][0]:.1f}; medians of {s['repeats']} run(s)"
        ),
        f"  {'':12} {'hit rate':>9} {'of ideal':>9} {'host hits':>10} {'computed':>9} "
        f"{'TTFT mean':>10} {'p50':>8} {'p90':>8} {'req/s':>7} {'out tok/s':>9} {'wall':>7}",
    ]
    for name in ("device", "host"):
        runs = r["runs"][name]
        m = lambda k, runs=runs: median_of(runs, k)
        rows.append(
            f"  {name + ' tier' if name == 'host' else 'device only':12} {m('hit_rate'):9.1%} "
            f"{m('hit_rate_of_reusable'):9.1%} {m('host_hit_tokens'):10.0f} "
            f"{m('tokens_computed'):9.0f} {1e3 * m('ttft_mean_s'):8.0f}ms "
            f"{1e3 * m('ttft_p50_s'):6.0f}ms {1e3 * m('ttft_p90_s'):6.0f}ms "
            f"{m('requests_per_s'):7.2f} {m('output_tokens_per_s'):9.1f} {m('wall_s'):6.1f}s"
        )
    d, h = r["runs"]["device"], r["runs"]["host"]
    hs = r["host_stats"]
    ttft_ratio = median_of(d, "ttft_mean_s") / median_of(h, "ttft_mean_s")
    rps_ratio = median_of(h, "requests_per_s") / median_of(d, "requests_per_s")
    rows += [
        (
            f"  host tier / device only: TTFT mean {ttft_ratio:.2f}x lower, throughput "
            f"{rps_ratio:.2f}x; replies identical: {r['replies_identical']}"
        ),
        (
            f"  host tier over all runs: {hs['host_kv_saved_pages']} pages saved, "
            f"{hs['host_kv_loaded_pages']} loaded ({hs['host_kv_loaded_bytes'] / 2**20:.0f} MiB),"
            f" {hs['host_kv_evictions']} evicted; host seconds save {hs['host_kv_save_s']:.2f}"
            f" / load {hs['host_kv_load_s']:.2f}; the host reads of {hs['host_kv_loads_hidden']}"
            f" of {hs['host_kv_load_launches']} loading launches ended while the step before"
            " still computed"
        ),
        (
            f"  warm-up {r['warmup_s']:.0f}s; step programs compiled inside timed runs: "
            f"{r['compiles_in_timed_runs']}"
        ),
    ]
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny model and sizes (seconds)")
    tunable = {"conversations": int, "turns": int, "system_tokens": int, "user_tokens": int,
               "reply_tokens": int, "concurrency": int, "num_pages": int, "repeats": int,
               "seed": int, "pool_fraction": float, "host_kv_gib": float}  # fmt: skip
    for name, kind in tunable.items():
        ap.add_argument(f"--{name}", type=kind, default=None)
    engine_opts = ("max_num_batched_tokens", "prefill_chunk_size", "max_step_shapes")
    for name in engine_opts:  # fewer step shapes compile faster (padding costs more)
        ap.add_argument(f"--{name}", type=int, default=None)
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args(argv)
    sizes = SIZES["smoke" if args.smoke else "full"]
    for name in tunable:
        if getattr(args, name) is not None:
            sizes = dataclasses.replace(sizes, **{name: getattr(args, name)})
    engine = {**dict(sizes.engine)}
    engine.update({k: getattr(args, k) for k in engine_opts if getattr(args, k) is not None})
    sizes = dataclasses.replace(sizes, engine=tuple(engine.items()))
    from engine.runner import compilation_cache

    compilation_cache.enable()  # a rerun loads the warm-up's programs
    result = measure(sizes)
    print(render(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.exit(main())
