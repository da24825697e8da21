"""Prefix cache benchmark: what reusing a shared system prompt's KV pages buys, and what the
cache costs when nothing is shared. One run, one model, two engines over the same weights
(cache on / cache off, same pool size so they share compiled step programs).

    python -m benchmarks.prefix_cache_bench                  # SmolLM2-135M on CPU, full sizes
    python -m benchmarks.prefix_cache_bench --smoke          # tiny model, seconds
    python -m benchmarks.prefix_cache_bench --json=out.json

Phases (every request is greedy with `ignore_eos`, so on and off do the same work):
  1. TTFT, one request at a time: cold = the cache cleared before each request (the whole
     system prompt + question is prefilled); warm = the system prompt already cached (only
     the question and the system prompt's partial last page are prefilled). Median and p95.
  2. Shared-prefix throughput: a burst of requests (system prompt + distinct questions)
     submitted together to a cold engine, cache on vs off: wall time, requests/s, output
     tokens/s, prefill tokens computed and saved; the outputs must be identical.
  3. Nothing shared: a burst of distinct random prompts, cache on vs off, alternated
     `repeats` times with fresh prompts each time (so the cache never hits); the cost is the
     median wall-time ratio.

Each phase runs once untimed first, so step compilation stays out of every figure. TTFT is
the engine's arrival -> first token (time.monotonic()). The CPU may be shared: the load
average is printed with the results.

Host tier (`--host_tier`, a run of its own, `HOST_SIZES`): a device pool too small to keep
a long system prompt. Each round sends system prompt + question, then a distinct prompt as
long as the system prompt that evicts it from the device pool; the TTFT of the next
system-prompt request is measured with the host KV tier (`host_kv_gib`) and without (the
evicted pages recomputed), alternating the two engines, with the outputs compared.

    python -m benchmarks.prefix_cache_bench --host_tier [--smoke] [--system_tokens=N]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time

import numpy as np

from configs.engine_config import EngineConfig
from engine.api_types import EngineRequest
from engine.core import EngineCore
from engine.runner import compiles
from engine.sampling.params import SamplingParams
from serving.capacity.loadgen import workloads

CORPUS_DIR = str(
    workloads.CORPUS_DIR
)  # the load generator's prose (serving/capacity/loadgen/corpus)
QUESTIONS = [
    "What is the main idea of the text above?",
    "Who is speaking in the second passage?",
    "Summarize the first fable in one sentence.",
    "Which animal appears most often?",
    "What does the declaration complain about?",
    "Name one moral from the fables.",
    "How many paragraphs are there?",
    "What is the tone of the speech?",
    "Give a title for the whole text.",
    "Which word is used most?",
    "What happens to the fox?",
    "Why was the speech given?",
    "List three characters.",
    "Is the text old or new?",
    "What is liberty?",
    "Translate the first line into French.",
    "Who wrote the last passage?",
    "What is a fable?",
    "Name a virtue praised above.",
    "What would you ask the author?",
    "Explain the ending.",
    "Quote the shortest sentence.",
    "What year is mentioned?",
    "Which passage is the longest?",
]


@dataclasses.dataclass(frozen=True)
class BenchSizes:
    model: str = "smollm2-135m"
    system_tokens: int = 2000
    num_cold: int = 5  # TTFT samples with the cache cleared
    num_warm: int = 10  # TTFT samples with the system prompt cached
    burst_requests: int = 8  # shared-prefix throughput burst
    max_tokens: int = 16  # outputs per request in the bursts
    unshared_requests: int = 8
    unshared_prompt_tokens: int = 256
    repeats: int = 5  # on/off alternations of the unshared burst
    engine: tuple = (
        ("page_size", 16),
        ("max_num_seqs", 8),
        ("max_num_batched_tokens", 512),
        ("prefill_chunk_size", 512),
        ("max_model_len", 2176),
        ("num_pages", 1200),
    )


SIZES = {
    "full": BenchSizes(),
    # The engine options of tests/test_prefix_cache_engine.py, so the smoke test compiles
    # nothing new after that module.
    "smoke": BenchSizes(
        model="tiny",
        system_tokens=14,
        num_cold=2,
        num_warm=3,
        burst_requests=3,
        max_tokens=4,
        unshared_requests=2,
        unshared_prompt_tokens=12,
        repeats=2,
        engine=(
            ("page_size", 8),
            ("num_pages", 7),
            ("max_num_seqs", 2),
            ("max_num_batched_tokens", 16),
            ("prefill_chunk_size", 16),
            ("max_model_len", 32),
        ),
    ),
}


@dataclasses.dataclass(frozen=True)
class HostTierSizes:
    model: str = "smollm2-135m"
    system_tokens: int = 1024  # the repeated prefix
    # the evicting prompt: system_tokens + this many tokens, all of the pool's pages
    evict_extra_tokens: int = 79
    rounds: int = 5  # timed rounds per engine (after one untimed compile round)
    max_tokens: int = 4
    host_kv_gib: float = 0.25
    engine: tuple = (
        ("page_size", 16),
        ("num_pages", 70),  # 69 pages: the evicting prompt (1,103 tokens) takes them all
        ("max_num_seqs", 2),
        ("max_num_batched_tokens", 512),
        ("prefill_chunk_size", 512),
        ("max_model_len", 1120),
        ("layer_loop", "scan"),  # compiles ~5x faster than unrolled on XLA:CPU
    )


HOST_SIZES = {
    "full": HostTierSizes(),
    # 4 device pages of 8 tokens: the 25-token evicting prompt takes them all
    "smoke": HostTierSizes(
        model="tiny",
        system_tokens=16,
        evict_extra_tokens=9,
        rounds=2,
        max_tokens=4,
        host_kv_gib=1e-3,
        engine=tuple({**dict(SIZES["smoke"].engine), "num_pages": 5}.items()),
    ),
}


# ---- workload --------------------------------------------------------------------------
def system_prompt(tokenizer, num_tokens: int) -> list[int]:
    """The first `num_tokens` tokens of the corpus prose (repeated if it is too short)."""
    text = ""
    for name in sorted(os.listdir(CORPUS_DIR)):
        if name.endswith(".txt"):
            with open(os.path.join(CORPUS_DIR, name)) as f:
                text += f.read()
    ids = tokenizer.encode("You answer questions about this text.\n\n" + text)
    while len(ids) < num_tokens:
        ids = ids + ids
    return ids[:num_tokens]


def question_ids(tokenizer, i: int, max_len: int | None = None) -> list[int]:
    ids = tokenizer.encode(
        f"\n\nQuestion {i}: {QUESTIONS[i % len(QUESTIONS)]}\nAnswer:", add_special_tokens=False
    )
    return ids[:max_len] if max_len else ids


def random_prompts(n: int, num_tokens: int, vocab: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, num_tokens).tolist() for _ in range(n)]


# ---- running -----------------------------------------------------------------------------
class Runner:
    def __init__(self, core: EngineCore):
        self.core = core
        self.num = 0

    num_compiles = 0  # step programs compiled inside timed runs (should stay 0)

    def run(
        self, prompts: list[list[int]], max_tokens: int, timed: bool = True
    ) -> tuple[float, list]:
        """Submits all prompts at once, steps until done: (wall seconds, final outputs)."""
        compiled = compiles.count()
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        ids = []
        t0 = time.perf_counter()
        for p in prompts:
            self.num += 1
            ids.append(f"b{self.num}")
            self.core.add_request(EngineRequest(ids[-1], p, params))
        tokens = {rid: [] for rid in ids}
        final = {}
        while self.core.has_unfinished():
            for out in self.core.step():
                tokens[out.request_id] += out.new_token_ids
                if out.finished:
                    final[out.request_id] = out
        wall = time.perf_counter() - t0
        if timed:
            Runner.num_compiles += compiles.count() - compiled
        return wall, [(tokens[r], final[r]) for r in ids]

    def prefill_tokens(self) -> tuple[int, int]:
        s = self.core.stats()
        return s["tokens_processed"], s["prefix_cache_prefill_tokens_saved"]


def progress(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs), q))


def measure_ttft(on: Runner, sizes: BenchSizes, system: list[int]) -> dict:
    tok = on.core.tokenizer
    qmax = None if sizes.model != "tiny" else 2
    prompt = lambda i: system + question_ids(tok, i, qmax)
    progress("TTFT: compile pass")
    on.core.clear_prefix_cache()
    on.run([prompt(0)], 1, timed=False)
    on.run([prompt(1)], 1, timed=False)
    cold, warm, warm_cached = [], [], []
    progress("TTFT: cold and warm samples")
    for i in range(sizes.num_cold):
        on.core.clear_prefix_cache()
        _, [(_, out)] = on.run([prompt(100 + i)], 1)
        assert out.metrics.cached_tokens == 0
        cold.append(out.metrics.ttft_s)
    on.run([prompt(200)], 1)  # the system prompt is now cached
    for i in range(sizes.num_warm):
        _, [(_, out)] = on.run([prompt(300 + i)], 1)
        warm.append(out.metrics.ttft_s)
        warm_cached.append(out.metrics.cached_tokens)
    return {
        "prompt_tokens": len(prompt(100)),
        "cold_ttft_median_s": statistics.median(cold),
        "cold_ttft_p95_s": pct(cold, 95),
        "warm_ttft_median_s": statistics.median(warm),
        "warm_ttft_p95_s": pct(warm, 95),
        "warm_cached_tokens_median": statistics.median(warm_cached),
        "ttft_speedup_median": statistics.median(cold) / statistics.median(warm),
        "cold_samples": len(cold),
        "warm_samples": len(warm),
    }


def measure_shared(on: Runner, off: Runner, sizes: BenchSizes, system: list[int]) -> dict:
    tok = on.core.tokenizer
    qmax = None if sizes.model != "tiny" else 2
    results = {}
    for rnd in ("compile", "timed"):
        prompts = [
            system + question_ids(tok, 1000 * (rnd == "timed") + i, qmax)
            for i in range(sizes.burst_requests)
        ]
        outs = {}
        for name, runner in (("on", on), ("off", off)):
            progress(f"shared burst: {rnd} round, cache {name}")
            runner.core.clear_prefix_cache()
            before = runner.prefill_tokens()
            wall, got = runner.run(prompts, sizes.max_tokens, timed=rnd == "timed")
            after = runner.prefill_tokens()
            outs[name] = [t for t, _ in got]
            n_out = sum(len(t) for t in outs[name])
            results[name] = {
                "wall_s": wall,
                "requests_per_s": len(prompts) / wall,
                "output_tokens_per_s": n_out / wall,
                "tokens_computed": after[0] - before[0],
                "prefill_tokens_saved": after[1] - before[1],
                "cached_tokens_per_request": [o.metrics.cached_tokens for _, o in got],
            }
        results["outputs_identical"] = outs["on"] == outs["off"]
    results["burst_requests"] = sizes.burst_requests
    results["prompt_tokens"] = len(prompts[0])
    results["throughput_ratio"] = results["off"]["wall_s"] / results["on"]["wall_s"]
    return results


def measure_unshared(on: Runner, off: Runner, sizes: BenchSizes) -> dict:
    vocab = on.core.cfg.vocab_size
    walls = {"on": [], "off": []}
    hits = 0
    for rep in range(sizes.repeats + 1):  # repeat 0 compiles
        prompts = random_prompts(
            sizes.unshared_requests, sizes.unshared_prompt_tokens, vocab, seed=10_000 + rep
        )
        order = (("on", on), ("off", off)) if rep % 2 else (("off", off), ("on", on))
        for name, runner in order:
            progress(f"unshared burst: repeat {rep}, cache {name}")
            before = runner.prefill_tokens()[1]
            wall, _ = runner.run(prompts, sizes.max_tokens, timed=rep > 0)
            if rep:
                walls[name].append(wall)
            if name == "on":
                hits += runner.prefill_tokens()[1] - before
    on_s, off_s = statistics.median(walls["on"]), statistics.median(walls["off"])
    return {
        "requests": sizes.unshared_requests,
        "prompt_tokens": sizes.unshared_prompt_tokens,
        "wall_on_s": walls["on"],
        "wall_off_s": walls["off"],
        "median_on_s": on_s,
        "median_off_s": off_s,
        "overhead_pct": 100.0 * (on_s - off_s) / off_s,
        "hit_tokens": hits,
    }


def run(sizes: BenchSizes, model=None) -> dict:
    """All three phases. `model`: an already loaded models.registry.LoadedModel (tests)."""
    from models.registry import load_model

    load_before = os.getloadavg()
    model = model or load_model(sizes.model)
    opts = dict(sizes.engine)
    on = Runner(EngineCore(model, EngineConfig(model=sizes.model, **opts)))
    off = Runner(EngineCore(model, EngineConfig(model=sizes.model, prefix_caching=False, **opts)))
    system = system_prompt(model.tokenizer, sizes.system_tokens)
    t0 = time.perf_counter()
    Runner.num_compiles = 0
    out = {"sizes": dataclasses.asdict(sizes)}
    # Each phase's figures go to stderr as soon as they exist (a long run may be cut short).
    out["ttft"] = measure_ttft(on, sizes, system)
    progress(f"ttft {json.dumps(out['ttft'])}")
    out["shared"] = measure_shared(on, off, sizes, system)
    progress(f"shared {json.dumps(out['shared'])}")
    out["unshared"] = measure_unshared(on, off, sizes)
    progress(f"unshared {json.dumps(out['unshared'])}")
    s = on.core.stats()
    out["cache_stats_on"] = {k: v for k, v in s.items() if k.startswith("prefix_cache")}
    out["bench_s"] = time.perf_counter() - t0
    out["compiles_in_timed_runs"] = Runner.num_compiles
    out["loadavg_before"], out["loadavg_after"] = load_before, os.getloadavg()
    out["cpus"] = os.cpu_count()
    return out


def measure_host_tier(sizes: HostTierSizes, model=None) -> dict:
    """TTFT of a repeated long prefix that the device pool cannot keep, host tier on / off."""
    from models.registry import load_model

    load_before = os.getloadavg()
    model = model or load_model(sizes.model)
    opts = dict(sizes.engine)
    engines = {
        "host": Runner(
            EngineCore(
                model, EngineConfig(model=sizes.model, host_kv_gib=sizes.host_kv_gib, **opts)
            )
        ),
        "device": Runner(EngineCore(model, EngineConfig(model=sizes.model, **opts))),
    }
    host_core = engines["host"].core
    host_core.offload.warm(
        host_core.runner.state.kv
    )  # its gather / scatter programs, as warm-up does
    tok, vocab = model.tokenizer, model.config.vocab_size
    system = system_prompt(tok, sizes.system_tokens)
    qmax = 2 if sizes.model == "tiny" else 8  # one length: round 0 compiles every shape
    ttft = {name: [] for name in engines}
    cached = {name: [] for name in engines}
    identical = True
    t0 = time.perf_counter()
    Runner.num_compiles = 0
    for rnd in range(sizes.rounds + 1):  # round 0 compiles
        order = list(engines.items()) if rnd % 2 else list(engines.items())[::-1]
        outs = {}
        for name, runner in order:
            progress(f"host tier: round {rnd}, {name}")
            runner.run([system + question_ids(tok, 2 * rnd, qmax)], 1, timed=rnd > 0)
            n = len(system) + sizes.evict_extra_tokens
            [evict] = random_prompts(1, n, vocab, seed=20_000 + rnd)
            runner.run([evict], 1, timed=rnd > 0)  # pushes the system prompt out
            prompt = system + question_ids(tok, 2 * rnd + 1, qmax)
            _, [(tokens, out)] = runner.run([prompt], sizes.max_tokens, timed=rnd > 0)
            outs[name] = tokens
            if rnd:
                ttft[name].append(out.metrics.ttft_s)
                cached[name].append(out.metrics.cached_tokens)
        identical &= outs["host"] == outs["device"]
    stats = engines["host"].core.stats()
    med = {name: statistics.median(v) for name, v in ttft.items()}
    return {
        "sizes": dataclasses.asdict(sizes),
        "prompt_tokens": len(system) + len(question_ids(tok, 1, qmax)),
        "device_pages": dict(sizes.engine)["num_pages"] - 1,
        "ttft_s": ttft,
        "ttft_median_s": med,
        "ttft_speedup_median": med["device"] / med["host"],
        "cached_tokens": cached,
        "outputs_identical": identical,
        "host_stats": {k: v for k, v in stats.items() if k.startswith("host_kv")},
        "bench_s": time.perf_counter() - t0,
        "compiles_in_timed_runs": Runner.num_compiles,
        "loadavg_before": load_before,
        "loadavg_after": os.getloadavg(),
        "cpus": os.cpu_count(),
    }


def render_host_tier(r: dict) -> str:
    ms = lambda s: f"{1000 * s:9.1f} ms"
    hs = r["host_stats"]
    rows = [
        (
            f"Host KV tier: {r['sizes']['model']}, {r['prompt_tokens']}-token prompts on a "
            f"{r['device_pages']}-page device pool (page {dict(r['sizes']['engine'])['page_size']}"
            f"), host tier {r['sizes']['host_kv_gib']} GiB, {r['cpus']} CPUs, load average "
            f"{r['loadavg_before'][0]:.1f} -> {r['loadavg_after'][0]:.1f}"
        ),
        f"  {'':28} {'TTFT median':>12}  {'samples (ms)':<40} cached tokens",
    ]
    for name, label in (("device", "device only (recompute)"), ("host", "with host tier")):
        samples = " ".join(f"{1000 * t:.1f}" for t in r["ttft_s"][name])
        rows.append(
            f"  {label:28} {ms(r['ttft_median_s'][name])}  {samples:<40} {r['cached_tokens'][name]}"
        )
    rows += [
        (
            f"  recompute / host tier (median): {r['ttft_speedup_median']:.2f}x; outputs "
            f"identical: {r['outputs_identical']}"
        ),
        (
            f"  host tier: {hs['host_kv_hit_tokens']} tokens hit, {hs['host_kv_saved_pages']} "
            f"pages saved ({hs['host_kv_saved_bytes'] / 2**20:.1f} MiB), "
            f"{hs['host_kv_loaded_pages']} loaded ({hs['host_kv_loaded_bytes'] / 2**20:.1f} MiB), "
            f"host copy time save {hs['host_kv_save_s']:.3f}s / load {hs['host_kv_load_s']:.3f}s"
        ),
        (
            f"Benchmark time {r['bench_s']:.0f}s; programs compiled inside timed runs: "
            f"{r['compiles_in_timed_runs']}"
        ),
    ]
    return "\n".join(rows)


def render(r: dict) -> str:
    t, sh, un = r["ttft"], r["shared"], r["unshared"]
    ms = lambda s: f"{1000 * s:9.1f} ms"
    rows = [
        (
            f"Prefix cache benchmark: {r['sizes']['model']}, system prompt "
            f"{r['sizes']['system_tokens']} tokens, {r['cpus']} CPUs, load average "
            f"{r['loadavg_before'][0]:.1f} -> {r['loadavg_after'][0]:.1f}"
        ),
        "",
        f"TTFT, one request at a time ({t['prompt_tokens']}-token prompts)",
        f"  {'':24} {'median':>12} {'p95':>12}",
        f"  {'cold (cache cleared)':24} {ms(t['cold_ttft_median_s'])} {ms(t['cold_ttft_p95_s'])}",
        f"  {'warm (system cached)':24} {ms(t['warm_ttft_median_s'])} {ms(t['warm_ttft_p95_s'])}",
        (
            f"  cold / warm (median): {t['ttft_speedup_median']:.1f}x   (target >= 5x); warm "
            f"requests hit {t['warm_cached_tokens_median']:.0f} tokens"
        ),
        "",
        (
            f"Shared-prefix burst: {sh['burst_requests']} requests x {sh['prompt_tokens']} prompt "
            f"tokens, {r['sizes']['max_tokens']} outputs each, submitted together to a cold cache"
        ),
        f"  {'':10} {'wall':>9} {'req/s':>8} {'out tok/s':>10} {'computed':>9} {'saved':>8}",
    ]
    for name in ("on", "off"):
        x = sh[name]
        rows.append(
            f"  {'cache ' + name:10} {x['wall_s']:8.2f}s {x['requests_per_s']:8.2f} "
            f"{x['output_tokens_per_s']:10.1f} {x['tokens_computed']:9d} "
            f"{x['prefill_tokens_saved']:8d}"
        )
    rows += [
        (
            f"  on / off throughput: {sh['throughput_ratio']:.2f}x; outputs identical: "
            f"{sh['outputs_identical']}; cached tokens per request (on): "
            f"{sh['on']['cached_tokens_per_request']}"
        ),
        "",
        (
            f"Nothing shared: {un['requests']} distinct {un['prompt_tokens']}-token prompts, "
            f"median of {len(un['wall_on_s'])} alternated runs"
        ),
        (
            f"  cache on {un['median_on_s']:.3f}s  off {un['median_off_s']:.3f}s  cost "
            f"{un['overhead_pct']:+.1f}% wall time (target < 3%); hits: {un['hit_tokens']}"
        ),
        f"  runs on:  {' '.join(f'{w:.3f}' for w in un['wall_on_s'])}",
        f"  runs off: {' '.join(f'{w:.3f}' for w in un['wall_off_s'])}",
        "",
        f"Cache counters (on engine): {r['cache_stats_on']}",
        (
            f"Benchmark time {r['bench_s']:.0f}s; step programs compiled inside timed runs: "
            f"{r['compiles_in_timed_runs']}"
        ),
    ]
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny model and sizes (seconds)")
    int_fields = [f.name for f in dataclasses.fields(BenchSizes) if f.type in (int, "int")]
    for name in int_fields:
        ap.add_argument(f"--{name}", type=int, default=None)
    ap.add_argument("--json", default=None, help="also write the results here")
    ap.add_argument(
        "--host_tier",
        action="store_true",
        help="only the host KV tier phase: TTFT of an evicted prefix, host tier on / off",
    )
    ap.add_argument("--host_kv_gib", type=float, default=None, help="with --host_tier")
    ap.add_argument("--num_pages", type=int, default=None, help="with --host_tier: device pool")
    args = ap.parse_args(argv)
    if args.host_tier:
        return host_tier_main(args)
    sizes = SIZES["smoke" if args.smoke else "full"]
    for field in int_fields:
        if getattr(args, field) is not None:
            sizes = dataclasses.replace(sizes, **{field: getattr(args, field)})
    result = run(sizes)
    print(render(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


def host_tier_main(args) -> int:
    sizes = HOST_SIZES["smoke" if args.smoke else "full"]
    for field in ("system_tokens", "max_tokens", "host_kv_gib"):
        if getattr(args, field, None) is not None:
            sizes = dataclasses.replace(sizes, **{field: getattr(args, field)})
    if args.repeats is not None:
        sizes = dataclasses.replace(sizes, rounds=args.repeats)
    if args.num_pages is not None:
        engine = {**dict(sizes.engine), "num_pages": args.num_pages}
        sizes = dataclasses.replace(sizes, engine=tuple(engine.items()))
    result = measure_host_tier(sizes)
    print(render_host_tier(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.exit(main())
