r"""Sizing prefill and decode pools from measured per-phase rates (extends
serving.capacity.planner).

    python -m serving.capacity.planner_disagg --model=llama-3.1-8b --kv_dtype=bfloat16 \
        --rate=40 --prompt_tokens=2000 --output_tokens=250 --prefix_hit_rate=0 \
        --prefill_tokens_per_s=31000 --decode_tokens_per_s=5200 --tpot_s=0.0123 \
        --transfer_gb_per_s=450 --kv_budget_gib=58 --reserve=0.3 --devices=8

Inputs are MEASURED per worker (benchmarks/disagg_bench.py measures them on this machine;
a rate sweep on the target hardware gives the real ones): prefill prompt tokens/s at the
operating point, decode output tokens/s at the operating batch (meeting the TPOT SLO) and
that TPOT, and the KV transfer bandwidth between a prefill and a decode worker.

    prefill demand (tokens/s)  = rate x prompt_tokens x (1 - prefix_hit_rate)
    prefill workers            = ceil(prefill demand / (prefill_tokens_per_s x (1 - reserve)))
    decode demand (tokens/s)   = rate x output_tokens
    decode workers (rate)      = ceil(decode demand / (decode_tokens_per_s x (1 - reserve)))
    decode sequences in flight = rate x output_tokens x tpot_s              (Little's law)
    decode workers (memory)    = ceil(in flight x (prompt + output) x KV bytes/token
                                      / kv_budget per worker)
    decode workers             = max(rate, memory)
    KV bytes per request       = prompt_tokens x KV bytes/token   (the whole prompt moves,
                                 cached or not: the decode worker holds all of it)
    transfer time              = KV bytes per request / bandwidth
    added TTFT                 = transfer time (vs prefill time = prompt x (1 - hit) /
                                 prefill_tokens_per_s at batch 1, a lower bound)
    link load                  = rate x KV bytes per request / bandwidth (per link, all
                                 transfers on one link: the worst case)
    colocated replicas         = ceil(rate x (prefill s + decode s per request) / (1 - reserve))
                                 with prefill s = prompt x (1 - hit) / prefill_tokens_per_s and
                                 decode s = output / decode_tokens_per_s (time-sharing, no
                                 interference: a lower bound for colocated serving)

What it does not model: interference inside a colocated replica (what disaggregation buys:
TTFT and TPOT tuned apart), a prefill worker's queueing delay, or tensor parallelism inside
a worker (give per-worker rates of the TP group, and devices per worker).
"""

from __future__ import annotations

import dataclasses
import json
import math

from absl import app, flags

from configs import kv_memory
from configs.model_config import from_name
from serving import flags as shared

GIB = 1024**3


@dataclasses.dataclass(frozen=True)
class PhaseRates:
    prefill_tokens_per_s: float  # per prefill worker, prompt tokens
    decode_tokens_per_s: float  # per decode worker, output tokens, at the operating batch
    tpot_s: float  # time per output token at that batch
    transfer_bytes_per_s: float  # prefill -> decode KV bandwidth of one link


def disagg_plan(
    kv_bytes_per_token: int,
    rates: PhaseRates,
    *,
    rate_rps: float,
    prompt_tokens: float,
    output_tokens: float,
    kv_budget_bytes: float,
    prefix_hit_rate: float = 0.0,
    reserve: float = 0.3,
    devices_per_worker: int = 1,
) -> dict:
    """Pool sizes and the transfer cost (formulas in the module docstring)."""
    for name, value in (
        ("rate_rps", rate_rps),
        ("prompt_tokens", prompt_tokens),
        ("output_tokens", output_tokens),
        ("kv_budget_bytes", kv_budget_bytes),
        *dataclasses.asdict(rates).items(),
    ):
        if not value > 0:
            raise ValueError(f"{name}={value}: must be > 0")
    if not 0 <= prefix_hit_rate < 1 or not 0 <= reserve < 1:
        raise ValueError(f"prefix_hit_rate={prefix_hit_rate}, reserve={reserve}: in [0, 1)")
    usable = 1 - reserve
    computed_prompt = prompt_tokens * (1 - prefix_hit_rate)
    prefill_demand = rate_rps * computed_prompt
    decode_demand = rate_rps * output_tokens
    in_flight = rate_rps * output_tokens * rates.tpot_s
    seq_bytes = (prompt_tokens + output_tokens) * kv_bytes_per_token
    prefill_workers = math.ceil(prefill_demand / (rates.prefill_tokens_per_s * usable))
    decode_by_rate = math.ceil(decode_demand / (rates.decode_tokens_per_s * usable))
    decode_by_memory = math.ceil(in_flight * seq_bytes / (kv_budget_bytes * usable))
    decode_workers = max(decode_by_rate, decode_by_memory)
    kv_request_bytes = prompt_tokens * kv_bytes_per_token
    transfer_s = kv_request_bytes / rates.transfer_bytes_per_s
    prefill_s = computed_prompt / rates.prefill_tokens_per_s
    decode_s = output_tokens / rates.decode_tokens_per_s
    colocated = math.ceil(rate_rps * (prefill_s + decode_s) / usable)
    return {
        "kv_bytes_per_token": kv_bytes_per_token,
        "prefill_demand_tokens_per_s": prefill_demand,
        "decode_demand_tokens_per_s": decode_demand,
        "prefill_workers": prefill_workers,
        "decode_workers": decode_workers,
        "decode_workers_by_rate": decode_by_rate,
        "decode_workers_by_memory": decode_by_memory,
        "decode_sequences_in_flight": in_flight,
        "devices": (prefill_workers + decode_workers) * devices_per_worker,
        "colocated_replicas_lower_bound": colocated,
        "colocated_devices_lower_bound": colocated * devices_per_worker,
        "kv_bytes_per_request": kv_request_bytes,
        "transfer_s": transfer_s,
        "prefill_s_batch1_lower_bound": prefill_s,
        "transfer_over_prefill": transfer_s / prefill_s,
        "link_utilization": rate_rps * kv_request_bytes / rates.transfer_bytes_per_s,
    }


def render(p: dict) -> str:
    mib = 1024**2
    return "\n".join(
        [
            f"KV per token {p['kv_bytes_per_token'] / 1024:.0f} KiB; per request "
            f"{p['kv_bytes_per_request'] / mib:.1f} MiB",
            f"prefill: {p['prefill_demand_tokens_per_s']:,.0f} tokens/s -> "
            f"{p['prefill_workers']} workers",
            f"decode: {p['decode_demand_tokens_per_s']:,.0f} tokens/s, "
            f"{p['decode_sequences_in_flight']:.0f} sequences in flight -> "
            f"{p['decode_workers']} workers (rate {p['decode_workers_by_rate']}, memory "
            f"{p['decode_workers_by_memory']})",
            f"devices: {p['devices']} disaggregated vs >= "
            f"{p['colocated_devices_lower_bound']} colocated (no interference modelled)",
            f"transfer {1e3 * p['transfer_s']:.2f} ms per request = "
            f"{p['transfer_over_prefill']:.3f} x its prefill "
            f"({1e3 * p['prefill_s_batch1_lower_bound']:.1f} ms); link load "
            f"{p['link_utilization']:.1%}",
        ]
    )


F = flags.FLAGS


def define_flags() -> None:
    """Defined only when run as a program (serving.capacity.planner defines some of the same
    names)."""
    flags.DEFINE_string("model", "llama-3.1-8b", "a configs.model_config preset")
    flags.DEFINE_string("kv_dtype", "bfloat16", "KV element type")
    flags.DEFINE_float("rate", 40.0, "requests per second")
    flags.DEFINE_float("prompt_tokens", 2000, "mean prompt tokens")
    flags.DEFINE_float("output_tokens", 250, "mean output tokens")
    flags.DEFINE_float("prefix_hit_rate", 0.0, "fraction of prompt tokens served by prefix caches")
    flags.DEFINE_float("prefill_tokens_per_s", 31000, "measured, per prefill worker")
    flags.DEFINE_float("decode_tokens_per_s", 5200, "measured, per decode worker")
    flags.DEFINE_float("tpot_s", 0.0123, "measured time per output token at that batch")
    flags.DEFINE_float("transfer_gb_per_s", 450, "measured KV bandwidth prefill -> decode (GB/s)")
    flags.DEFINE_float("kv_budget_gib", 58, "KV memory per decode worker (GiB)")
    flags.DEFINE_float("reserve", 0.3, "headroom kept free on every pool")
    flags.DEFINE_integer("devices_per_worker", 1, "devices of one worker (TP group size)")
    flags.DEFINE_enum("format", "text", ["text", "json"], "output")


def main(argv):
    if len(argv) > 1:
        raise shared.UsageError("", " ".join(argv[1:]), "only flags")
    positive = ("rate", "prompt_tokens", "output_tokens", "prefill_tokens_per_s")
    positive += ("decode_tokens_per_s", "tpot_s", "transfer_gb_per_s", "kv_budget_gib")
    for flag in positive:
        shared.check_positive(flag, getattr(F, flag))
    shared.require("reserve", F.reserve, 0 <= F.reserve < 1, "0 <= reserve < 1")
    shared.require(
        "prefix_hit_rate", F.prefix_hit_rate, 0 <= F.prefix_hit_rate < 1, "0 <= rate < 1"
    )
    try:
        cfg = from_name(F.model)
        per_token = kv_memory.kv_bytes_per_token(cfg, F.kv_dtype)
        rates = PhaseRates(
            F.prefill_tokens_per_s, F.decode_tokens_per_s, F.tpot_s, F.transfer_gb_per_s * 1e9
        )
        p = disagg_plan(
            per_token,
            rates,
            rate_rps=F.rate,
            prompt_tokens=F.prompt_tokens,
            output_tokens=F.output_tokens,
            kv_budget_bytes=F.kv_budget_gib * GIB,
            prefix_hit_rate=F.prefix_hit_rate,
            reserve=F.reserve,
            devices_per_worker=F.devices_per_worker,
        )
    except (ValueError, KeyError) as e:
        raise shared.UsageError("", "", str(e)) from None
    print(json.dumps(p, indent=1) if F.format == "json" else render(p))


if __name__ == "__main__":
    define_flags()
    app.run(shared.main_guard(main), flags_parser=shared.parse_flags)
