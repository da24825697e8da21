r"""Capacity planner: memory feasibility (KV that fits) and replicas for a demand.

    python -m serving.capacity.planner plan --model=llama-3.1-8b --kv_dtype=bfloat16 \
        --device_memory_gib=80 --weights_gib=16.1 --workspace_gib=6 --page_size=16 \
        --prompt_median=512 --output_median=256 --max_tokens=1024 \
        --rate=20 --goodput_per_replica=4.5 --reserve=0.3

Memory (the seeds' arithmetic, `configs.kv_memory`):

    KV bytes / token   = 2 x layers x KV heads x head_dim x bytes   (128 KiB at 32/8/128/2)
    KV budget          = device memory x utilization - weights - workspace
    KV pages           = floor(budget / (page_size x KV bytes / token))
    sequences that fit = floor(pages / ceil(tokens per sequence / page_size))

Local-layer page release (a model with sliding-window and full-attention layers, Gemma 3;
`EngineConfig.release_local_pages`): each local layer keeps a ring of R pages per sequence
slot, R = ceil((window + prefill_chunk + page_size - 2) / page_size), so at a context of n
tokens (the plan's `local_page_release`, for each of seq_lens and 32k)

    KV bytes / token = per-layer bytes x (global layers x n + local layers x min(R x page, n)) / n

A sequence's KV grows to prompt + output tokens, and the admission controller cannot know the
output length in advance: the worst case it must budget is prompt + max_tokens, not the
expected output. The plan reports both.

Mixture of experts (a config with `num_experts`; `--expert_parallel=e` devices share the
experts, attention and the rest replicated on each):

    total params   = every weight (all experts): what memory holds
    active params  = attention + k experts + router per layer + embeddings: what one token
                     reads and computes (2 x active FLOPs per token, plus attention)
    expert weights per device = all expert stacks / e  (+ the non-expert weights whole)
    all-to-all bytes per token per sparse layer = 2 x k x D x bytes x (e - 1) / e
        (dispatch + combine: each of the k copies of a token's hidden state leaves its
        device unless its expert is local, and comes back weighted)

Host KV tier (`--host_kv_gib` with the prefix workload `--shared_prefix_tokens --sessions
--session_tokens`): the tokens each tier caches, the sessions that fit and the expected hit
rate with and without it (serving/capacity/planner_host.py).

Replicas (goodput per replica measured by a rate sweep's operating point, not saturation):

    replicas              = ceil(demand / goodput_per_replica x (1 + reserve))
    output tokens/s demand = request rate x E[output tokens]
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import random

from absl import app, flags

from configs import kv_memory
from configs.model_config import ModelConfig, from_name
from serving import flags as shared
from serving.capacity.planner_host import PrefixWorkload, host_tier_plan, render_host_tier

GIB = 1024**3


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    kv_bytes_per_token: int
    page_size: int
    kv_budget_bytes: int
    num_pages: int

    @property
    def page_bytes(self) -> int:
        return self.kv_bytes_per_token * self.page_size

    @property
    def kv_tokens(self) -> int:
        """Tokens of KV that fit (whole pages only)."""
        return self.num_pages * self.page_size

    def sequences_that_fit(self, seq_len: int) -> int:
        return self.num_pages // pages_per_sequence(seq_len, self.page_size)


def pages_per_sequence(seq_len: int, page_size: int) -> int:
    if seq_len < 1 or page_size < 1:
        raise ValueError(f"seq_len={seq_len}, page_size={page_size}: both must be >= 1")
    return math.ceil(seq_len / page_size)


def memory_plan(
    cfg: ModelConfig,
    kv_dtype: str,
    device_memory_bytes: int,
    weights_bytes: int,
    workspace_bytes: int,
    page_size: int = 16,
    utilization: float = 1.0,
    kv_head_replication: int = 1,
) -> MemoryPlan:
    """KV pages left after weights and workspace. Raises if nothing is left."""
    per_token = kv_memory.kv_bytes_per_token(cfg, kv_dtype, kv_head_replication)
    budget = int(device_memory_bytes * utilization) - weights_bytes - workspace_bytes
    if budget <= 0:
        raise ValueError(
            f"device_memory={device_memory_bytes / GIB:.2f} GiB x utilization {utilization} "
            f"leaves no KV budget after weights {weights_bytes / GIB:.2f} GiB + workspace "
            f"{workspace_bytes / GIB:.2f} GiB"
        )
    return MemoryPlan(per_token, page_size, budget, budget // (per_token * page_size))


def local_release_plan(
    cfg: ModelConfig, kv_dtype: str, page_size: int, prefill_chunk: int, seq_lens: list[int]
) -> dict | None:
    """KV bytes per token with and without local-layer page release at each context length
    (None for a model without a local/global split)."""
    try:
        window = kv_memory.local_layer_window(cfg)
    except ValueError:
        return None
    ring = kv_memory.ring_pages(window, page_size, prefill_chunk)
    num_local = sum(w is not None for w in cfg.layer_windows())

    def per_token(n: int, release: bool) -> float:
        return kv_memory.kv_bytes_per_token_in_context(
            cfg,
            n,
            kv_dtype,
            release_local_pages=release,
            page_size=page_size,
            max_query_len=prefill_chunk,
        )

    return {
        "window": window,
        "local_layers": num_local,
        "global_layers": cfg.num_layers - num_local,
        "ring_pages_per_slot": ring,
        "ring_bytes_per_slot": ring
        * page_size
        * num_local
        * kv_memory.kv_bytes_per_token_per_layer(cfg, kv_dtype),
        "kv_bytes_per_token": {
            str(n): {"without": per_token(n, False), "with": per_token(n, True)}
            for n in sorted({*seq_lens, 32768})
        },
    }


def moe_plan(cfg: ModelConfig, weight_dtype: str, expert_parallel: int) -> dict | None:
    """Active vs total parameters and the expert-parallel split (None for a dense model)."""
    if not hasattr(cfg, "num_experts"):
        return None
    if expert_parallel < 1 or cfg.num_experts % expert_parallel:
        raise ValueError(
            f"expert_parallel={expert_parallel}: must divide num_experts={cfg.num_experts}"
        )
    from models.moe import expert_bytes

    wb = kv_memory.dtype_bytes(weight_dtype)
    experts = expert_bytes(cfg, wb)
    rest = cfg.num_params * wb - experts
    e = expert_parallel
    sparse = sum(cfg.sparse_layers)
    a2a = 2 * cfg.num_experts_per_tok * cfg.hidden_size * wb * (e - 1) / e
    return {
        "num_experts": cfg.num_experts,
        "experts_per_token": cfg.num_experts_per_tok,
        "sparse_layers": sparse,
        "total_params": cfg.num_params,
        "active_params": cfg.num_active_params,
        "active_fraction": cfg.num_active_params / cfg.num_params,
        "expert_parallel": e,
        "expert_weights_gib": experts / GIB,
        "weights_per_device_gib": (rest + experts / e) / GIB,
        "all_to_all_bytes_per_token": a2a * sparse,
    }


def default_weights_bytes(cfg: ModelConfig, weight_dtype: str, expert_parallel: int) -> int:
    """Weights one device holds: every parameter, the expert stacks split over
    `expert_parallel` devices for a mixture of experts."""
    moe = moe_plan(cfg, weight_dtype, expert_parallel)
    if moe is None:
        return cfg.num_params * kv_memory.dtype_bytes(weight_dtype)
    return int(moe["weights_per_device_gib"] * GIB)


def replicas_needed(demand_rps: float, goodput_per_replica_rps: float, reserve: float) -> int:
    """ceil(demand / goodput_per_replica x (1 + reserve))."""
    if goodput_per_replica_rps <= 0:
        raise ValueError(f"goodput_per_replica_rps={goodput_per_replica_rps}: must be > 0")
    if reserve < 0:
        raise ValueError(f"reserve={reserve}: must be >= 0")
    # NOTE: round away float noise (e.g. 10 / 2 x 1.2 = 6.000000000000001) before the ceil.
    return math.ceil(round(demand_rps / goodput_per_replica_rps * (1.0 + reserve), 9))


def output_token_demand(rate_rps: float, mean_output_tokens: float) -> float:
    """Output tokens per second the fleet must generate: rate x E[output tokens]."""
    return rate_rps * mean_output_tokens


def length_samples(
    prompt_median: float,
    output_median: float,
    prompt_sigma: float,
    output_sigma: float,
    rho: float,
    n: int = 20000,
    seed: int = 0,
) -> list[tuple[int, int]]:
    """Monte Carlo draws of a joint lognormal (same model as the load generator's)."""
    from serving.capacity.loadgen.workloads import LengthDist

    dist = LengthDist(
        prompt_median, output_median, prompt_sigma, output_sigma, rho, max_in=10**9, max_out=10**9
    )
    rng = random.Random(seed)
    return [dist.sample(rng) for _ in range(n)]


def length_summary(samples: list[tuple[int, int]], page_size: int, max_tokens: int | None) -> dict:
    from serving.capacity.loadgen.metrics import percentile

    totals = [i + o for i, o in samples]
    worst = [i + max_tokens for i, _ in samples] if max_tokens else totals
    mean = lambda xs: sum(xs) / len(xs)
    return {
        "mean_prompt_tokens": mean([i for i, _ in samples]),
        "mean_output_tokens": mean([o for _, o in samples]),
        "mean_total_tokens": mean(totals),
        "p95_total_tokens": percentile(totals, 95),
        "mean_pages_expected": mean([pages_per_sequence(t, page_size) for t in totals]),
        "mean_pages_budgeted": mean([pages_per_sequence(t, page_size) for t in worst]),
        "page_rounding_waste": 1
        - mean(totals) / (page_size * mean([pages_per_sequence(t, page_size) for t in totals])),
    }


def plan(
    cfg: ModelConfig,
    *,
    kv_dtype: str,
    device_memory_bytes: int,
    weights_bytes: int,
    workspace_bytes: int,
    page_size: int,
    samples: list[tuple[int, int]],
    max_tokens: int | None,
    seq_lens: list[int],
    rate_rps: float | None = None,
    goodput_per_replica_rps: float | None = None,
    reserve: float = 0.2,
    utilization: float = 1.0,
    prefill_chunk: int = 256,
    weight_dtype: str = "bfloat16",
    expert_parallel: int = 1,
    max_num_seqs: int | None = None,
    host_kv_bytes: int = 0,
    prefix: PrefixWorkload | None = None,
    host_bytes_per_s: float | None = None,
    prefill_tokens_per_s: float | None = None,
) -> dict:
    mem = memory_plan(
        cfg, kv_dtype, device_memory_bytes, weights_bytes, workspace_bytes, page_size, utilization
    )
    lengths = length_summary(samples, page_size, max_tokens)
    out = {
        "model": cfg.name,
        "kv_dtype": kv_dtype,
        "page_size": page_size,
        "kv_bytes_per_token": mem.kv_bytes_per_token,
        "page_bytes": mem.page_bytes,
        "device_memory_gib": device_memory_bytes / GIB,
        "weights_gib": weights_bytes / GIB,
        "workspace_gib": workspace_bytes / GIB,
        "kv_budget_gib": mem.kv_budget_bytes / GIB,
        "kv_pages": mem.num_pages,
        "kv_tokens": mem.kv_tokens,
        "sequences_that_fit": {str(n): mem.sequences_that_fit(n) for n in seq_lens},
        "lengths": lengths,
        "concurrent_sequences_expected": int(mem.num_pages // lengths["mean_pages_expected"]),
        "concurrent_sequences_budgeted": int(mem.num_pages // lengths["mean_pages_budgeted"]),
        "max_tokens": max_tokens,
        "caution": "max_tokens is not the actual output, but admission must budget it: a "
        "sequence may grow to prompt + max_tokens, so plan concurrency on the "
        "budgeted figure and treat the expected one as optimistic.",
    }
    moe = moe_plan(cfg, weight_dtype, expert_parallel)
    if moe is not None:
        out["moe"] = moe
    release = local_release_plan(cfg, kv_dtype, page_size, prefill_chunk, seq_lens)
    if release is not None:
        out["local_page_release"] = release
    if host_kv_bytes or (prefix is not None and prefix.sessions):
        expected = out["concurrent_sequences_expected"]
        out["host_tier"] = host_tier_plan(
            kv_pages=mem.num_pages,
            page_size=page_size,
            kv_bytes_per_token=mem.kv_bytes_per_token,
            host_kv_bytes=host_kv_bytes,
            running_sequences=min(max_num_seqs or expected, expected),
            mean_pages_per_sequence=lengths["mean_pages_expected"],
            workload=prefix or PrefixWorkload(),
            host_bytes_per_s=host_bytes_per_s,
            prefill_tokens_per_s=prefill_tokens_per_s,
        )
    if rate_rps is not None:
        out["output_token_demand_tps"] = output_token_demand(
            rate_rps, lengths["mean_output_tokens"]
        )
        out["input_token_demand_tps"] = rate_rps * lengths["mean_prompt_tokens"]
    if rate_rps is not None and goodput_per_replica_rps:
        out["replicas"] = replicas_needed(rate_rps, goodput_per_replica_rps, reserve)
        out["replica_formula"] = (
            f"ceil({rate_rps:g} / {goodput_per_replica_rps:.4g} x (1 + {reserve:g}))"
        )
    return out


def render_plan(p: dict) -> str:
    """The plan as a few lines a person reads."""
    fits = ", ".join(f"{n} tokens: {k}" for n, k in p["sequences_that_fit"].items())
    lines = [
        (
            f"{p['model']}: {p['kv_bytes_per_token'] / 1024:.0f} KiB of KV per token "
            f"({p['kv_dtype']}), {p['page_bytes'] / 2**20:.2f} MiB per {p['page_size']}-token page"
        ),
        (
            f"KV budget {p['kv_budget_gib']:.2f} GiB = {p['device_memory_gib']:.1f} GiB x "
            f"utilization - weights {p['weights_gib']:.2f} - workspace {p['workspace_gib']:.2f} "
            f"-> {p['kv_pages']} pages, {p['kv_tokens']:,} tokens"
        ),
        f"sequences that fit: {fits}",
        (
            f"at the length distribution: {p['concurrent_sequences_expected']} concurrent "
            f"sequences at expected lengths, {p['concurrent_sequences_budgeted']} when "
            f"max_tokens={p['max_tokens']} is budgeted"
        ),
        f"caution: {p['caution']}",
    ]
    if "output_token_demand_tps" in p:
        lines.append(
            f"demand: {p['output_token_demand_tps']:.0f} output tok/s, "
            f"{p['input_token_demand_tps']:.0f} input tok/s"
        )
    if "host_tier" in p:
        lines += render_host_tier(p["host_tier"])
    if "replicas" in p:
        lines.append(f"replicas: {p['replicas']} = {p['replica_formula']}")
    if "moe" in p:
        m = p["moe"]
        lines.append(
            f"mixture of experts: {m['total_params'] / 1e9:.2f}B parameters, "
            f"{m['active_params'] / 1e9:.2f}B active per token ({m['active_fraction']:.1%}; "
            f"{m['experts_per_token']} of {m['num_experts']} experts); expert_parallel="
            f"{m['expert_parallel']}: {m['weights_per_device_gib']:.2f} GiB of weights per "
            f"device, {m['all_to_all_bytes_per_token'] / 1024:.1f} KiB all-to-all per token"
        )
    if "local_page_release" in p:
        r = p["local_page_release"]
        per = ", ".join(
            f"{n} tokens {b['without'] / 1024:.1f} -> {b['with'] / 1024:.1f} KiB"
            for n, b in r["kv_bytes_per_token"].items()
        )
        lines.append(
            f"local page release ({r['local_layers']} local layers, window {r['window']}; "
            f"{r['global_layers']} global; a ring of {r['ring_pages_per_slot']} pages, "
            f"{r['ring_bytes_per_slot'] / 2**20:.1f} MiB per slot): KV per token {per}"
        )
    return "\n".join(lines)


# ---- command line ------------------------------------------------------------------------

F = flags.FLAGS
flags.DEFINE_string(
    "model", "llama-3.1-8b", "configs preset name, or a GGUF preset (gemma3-270m: its metadata)"
)
flags.DEFINE_integer("prefill_chunk", 256, "prefill chunk (sizes local page release's rings)")
flags.DEFINE_string("kv_dtype", "bfloat16", "KV cache dtype")
flags.DEFINE_string("weight_dtype", "bfloat16", "for the default weights size")
flags.DEFINE_float("device_memory_gib", 80.0, "memory of one device (GiB)")
flags.DEFINE_float("weights_gib", None, "measured weights (default: params x weight_dtype)")
flags.DEFINE_float("workspace_gib", 2.0, "measured activations/workspace/graphs (GiB)")
flags.DEFINE_float("utilization", 0.95, "fraction of device memory the server may use")
flags.DEFINE_integer("page_size", 16, "tokens per KV page")
flags.DEFINE_integer("expert_parallel", 1, "MoE: devices the experts are split over")
flags.DEFINE_float("prompt_median", 512, "lognormal prompt length median")
flags.DEFINE_float("prompt_sigma", 0.6, "lognormal sigma of prompt length")
flags.DEFINE_float("output_median", 256, "lognormal output length median")
flags.DEFINE_float("output_sigma", 0.6, "lognormal sigma of output length")
flags.DEFINE_float("rho", 0.0, "correlation of log lengths")
flags.DEFINE_string("trace", None, "JSONL trace: lengths from it instead of the lognormal")
flags.DEFINE_integer("max_tokens", 1024, "max_tokens the server budgets per request")
flags.DEFINE_list("seq_lens", ["1024", "4096", "8192"], "sequence lengths to fit")
flags.DEFINE_float("rate", None, "demand (requests/s)")
flags.DEFINE_float("goodput_per_replica", None, "measured goodput of one replica (req/s)")
flags.DEFINE_string("sweep_json", None, "take goodput_per_replica from a sweep.json")
flags.DEFINE_float("reserve", 0.2, "headroom fraction (failures, rollouts, bursts)")
flags.DEFINE_integer("max_num_seqs", 64, "host tier: sequences the server runs at once")
flags.DEFINE_float("host_kv_gib", 0.0, "host memory for evicted prefix-cache pages (GiB)")
flags.DEFINE_integer("shared_prefix_tokens", 0, "host tier: prefix every request shares")
flags.DEFINE_integer("sessions", 0, "host tier: sessions that come back (chats, agents)")
flags.DEFINE_float("session_tokens", 0.0, "host tier: mean reusable context per session")
flags.DEFINE_float("host_gib_per_s", None, "host tier: measured reload bandwidth (GiB/s)")
flags.DEFINE_float("prefill_tokens_per_s", None, "host tier: measured prefill rate")
flags.DEFINE_enum("format", "text", ["text", "json"], "output format")


def _samples_from_flags() -> list[tuple[int, int]]:
    if F.trace:
        from serving.capacity.loadgen.trace import load_trace

        return [(e.prompt_tokens, e.output_tokens) for e in load_trace(F.trace)]
    return length_samples(F.prompt_median, F.output_median, F.prompt_sigma, F.output_sigma, F.rho)


def check_flags(argv) -> None:
    """Every input mistake, as a UsageError (one line, exit 2)."""
    from configs.model_config import PRESETS

    shared.require(
        "",
        "",
        argv[1:] == ["plan"],
        f"expected the command 'plan' (got {' '.join(argv[1:]) or 'none'}): "
        "python -m serving.capacity.planner plan [--flags]",
    )
    from models.families import family_presets
    from models.registry import GGUF_PRESETS

    known = sorted({*PRESETS, *family_presets(), *GGUF_PRESETS})
    shared.require("model", F.model, F.model in known, f"unknown model; one of {known}")
    shared.require("prefill_chunk", F.prefill_chunk, F.prefill_chunk >= 1, ">= 1")
    for flag in ("kv_dtype", "weight_dtype"):
        shared.require(
            flag,
            getattr(F, flag),
            getattr(F, flag) in kv_memory.DTYPE_BYTES,
            f"one of {sorted(kv_memory.DTYPE_BYTES)}",
        )
    for flag in ("device_memory_gib", "prompt_median", "output_median"):
        shared.check_positive(flag, getattr(F, flag))
    for flag in ("workspace_gib", "prompt_sigma", "output_sigma", "reserve", "host_kv_gib",
                 "shared_prefix_tokens", "sessions", "session_tokens"):  # fmt: skip
        shared.check_positive(flag, getattr(F, flag), allow_zero=True)
    shared.check_positive("weights_gib", F.weights_gib, allow_zero=True, allow_none=True)
    shared.check_positive("rate", F.rate, allow_none=True)
    shared.check_positive("goodput_per_replica", F.goodput_per_replica, allow_none=True)
    for flag in ("host_gib_per_s", "prefill_tokens_per_s"):
        shared.check_positive(flag, getattr(F, flag), allow_none=True)
    shared.require("max_num_seqs", F.max_num_seqs, F.max_num_seqs >= 1, ">= 1")
    shared.require(
        "session_tokens",
        F.session_tokens,
        not F.sessions or F.session_tokens > 0,
        "> 0 when --sessions is given",
    )
    shared.check_fraction("utilization", F.utilization, low_open=True)
    shared.require("rho", F.rho, -1 <= F.rho <= 1, "-1 <= rho <= 1")
    shared.require("page_size", F.page_size, F.page_size >= 1, ">= 1")
    shared.require("expert_parallel", F.expert_parallel, F.expert_parallel >= 1, ">= 1")
    shared.require("max_tokens", F.max_tokens, F.max_tokens >= 1, ">= 1")
    bad = [s for s in F.seq_lens if not s.isdigit() or int(s) < 1]
    shared.require("seq_lens", ",".join(F.seq_lens), not bad, "positive integers, e.g. 1024,4096")
    for flag in ("trace", "sweep_json"):
        path = getattr(F, flag)
        shared.require(flag, path, path is None or os.path.isfile(path), "no such file")


def model_config(name: str) -> ModelConfig:
    """A configs preset, or a GGUF preset's config read from its metadata (no weights)."""
    from configs.model_config import PRESETS

    if name in PRESETS:
        return from_name(name)
    from models.families import family_presets

    if name in family_presets():
        return family_presets()[name]
    from models.loaders.gguf_loader import config_from_gguf, open_gguf
    from models.registry import GGUF_PRESETS

    path = GGUF_PRESETS[name]()
    return config_from_gguf(open_gguf(path), path, name)


def _goodput_from_sweep(path: str) -> float:
    try:
        with open(path) as f:
            goodput = json.load(f).get("operating_goodput_rps")
    except (ValueError, AttributeError) as e:
        raise shared.UsageError("sweep_json", path, f"not a sweep.json: {e}") from None
    shared.require(
        "sweep_json",
        path,
        bool(goodput),
        "the sweep found no operating point (operating_goodput_rps is empty); rerun the sweep "
        "at lower rates",
    )
    return goodput


def main(argv):
    check_flags(argv)
    cfg = model_config(F.model)
    goodput = _goodput_from_sweep(F.sweep_json) if F.sweep_json else F.goodput_per_replica
    try:
        weights = (
            F.weights_gib * GIB
            if F.weights_gib is not None
            else default_weights_bytes(cfg, F.weight_dtype, F.expert_parallel)
        )
        result = plan(
            cfg,
            kv_dtype=F.kv_dtype,
            device_memory_bytes=int(F.device_memory_gib * GIB),
            weights_bytes=int(weights),
            workspace_bytes=int(F.workspace_gib * GIB),
            page_size=F.page_size,
            samples=_samples_from_flags(),
            max_tokens=F.max_tokens,
            seq_lens=[int(s) for s in F.seq_lens],
            rate_rps=F.rate,
            goodput_per_replica_rps=goodput,
            reserve=F.reserve,
            utilization=F.utilization,
            prefill_chunk=F.prefill_chunk,
            weight_dtype=F.weight_dtype,
            expert_parallel=F.expert_parallel,
            max_num_seqs=F.max_num_seqs,
            host_kv_bytes=int(F.host_kv_gib * GIB),
            prefix=PrefixWorkload(F.shared_prefix_tokens, F.sessions, F.session_tokens),
            host_bytes_per_s=F.host_gib_per_s and F.host_gib_per_s * GIB,
            prefill_tokens_per_s=F.prefill_tokens_per_s,
        )
    except ValueError as e:  # e.g. weights + workspace leave no KV memory, experts / devices
        raise shared.UsageError("", "", str(e)) from None
    print(json.dumps(result, indent=1) if F.format == "json" else render_plan(result))


def run() -> None:
    app.run(shared.main_guard(main), flags_parser=shared.parse_flags)


if __name__ == "__main__":
    run()
