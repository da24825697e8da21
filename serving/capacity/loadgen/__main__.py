r"""python -m serving.capacity.loadgen: one load run, or a rate sweep, against a local server.

    python -m serving.capacity.loadgen --target=127.0.0.1:50051 --metrics_url=http://127.0.0.1:9090/metrics \
        --workload=short_qa:0.5,long_context:0.2,long_generation:0.1,shared_prefix:0.1,multi_tenant:0.1 \
        --arrival=gamma --burstiness=4 --rate=2 --duration_s=60 --cancel_fraction=0.1 \
        --slo=ttft_s=2,tpot_s=0.2,e2e_s=60 --price_per_device_hour=2.5 --out=/tmp/cap

    add --protocol=http --target=127.0.0.1:8000 to drive the OpenAI-compatible HTTP API
    (server --http_port=8000) with the same workloads and report; add
    --sweep_rates=0.5,1,2,4 (or --sweep_start=0.5 --sweep_factor=2 --sweep_steps=6) for a
    sweep: OUT/sweep.{json,md}, OUT/latency_vs_rate.png, and one report per rate.

Needs the `bench` extra (matplotlib, tqdm): pip install -e '.[bench]'.
"""

from __future__ import annotations

import json
import os
import pathlib

from absl import app, flags

from serving.extras import require

require("bench", "matplotlib", "tqdm")  # plots, progress bar: fail before any load is sent

from serving import flags as shared
from serving.capacity.loadgen import arrivals, gates, report, sweep
from serving.capacity.loadgen.metrics import parse_slo_policy
from serving.capacity.loadgen.run import RunConfig, check_loopback, run_load
from serving.capacity.loadgen.workloads import parse_mix

F = flags.FLAGS
shared.define_target()  # --target (loopback only here), --api_key, --request_timeout_s
F.set_default("request_timeout_s", 120.0)
shared.define_log_level()
shared.define_temperature()
flags.DEFINE_enum(
    "protocol", "grpc", ["grpc", "http"], "gRPC Generate, or the OpenAI-compatible HTTP API"
)
flags.DEFINE_string(
    "metrics_url", None, "Prometheus endpoint to scrape, e.g. http://127.0.0.1:9090/metrics"
)
flags.DEFINE_string("workload", RunConfig.workload, "class:weight,... (see workloads.py)")
flags.DEFINE_float("length_scale", 1.0, "multiplies every prompt/output length")
flags.DEFINE_enum("arrival", "poisson", list(arrivals.KINDS), "arrival process")
flags.DEFINE_float("rate", 1.0, "mean requests/s (open loop)")
flags.DEFINE_float("burstiness", 4.0, "gamma: squared CV of inter-arrival gaps (1 = Poisson)")
flags.DEFINE_float("on_s", 5.0, "onoff: burst length")
flags.DEFINE_float("off_s", 5.0, "onoff: silence length")
flags.DEFINE_float("period_s", 60.0, "diurnal: period of the ramp")
flags.DEFINE_float("amplitude", 0.8, "diurnal: 0 flat .. 1 trough at zero")
flags.DEFINE_integer("concurrency", 8, "closed loop: concurrent streams")
flags.DEFINE_string("trace", None, "JSONL trace to replay (implies --arrival=trace)")
flags.DEFINE_float("trace_speedup", 1.0, "divide trace arrival times by this")
flags.DEFINE_float("duration_s", 60.0, "stop sending after this many seconds")
flags.DEFINE_integer("max_requests", 1000, "stop after sending this many")
flags.DEFINE_float("cancel_fraction", 0.0, "fraction cancelled at a random point")
flags.DEFINE_float("drain_timeout_s", 60.0, "after the last send, wait this long, then cancel")
flags.DEFINE_bool("ignore_eos", True, "generate exactly the sampled output length")
flags.DEFINE_integer(
    "workload_seed", 0, "seeds arrivals, lengths, prompts and the requests' sampling seeds"
)
flags.DEFINE_string("slo", "ttft_s=2,tpot_s=0.2,e2e_s=60", "default SLO")
flags.DEFINE_multi_string("slo_class", [], "per-class SLO, e.g. long_generation:e2e_s=300")
flags.DEFINE_float("price_per_device_hour", 0.0, "price of one serving device-hour")
flags.DEFINE_integer("num_devices", 1, "devices the server uses")
flags.DEFINE_float("power_w", None, "average power per device (energy cost)")
flags.DEFINE_float("price_per_kwh", 0.0, "energy price")
flags.DEFINE_float(
    "warm_window_s", None, "cold window at the start of the run (default: 20% of --duration_s)"
)
flags.DEFINE_float("scrape_interval_s", 0.5, "metrics scrape period")
flags.DEFINE_string("save_trace", None, "write what was sent as a JSONL trace (open loop)")
flags.DEFINE_list("sweep_rates", [], "sweep mode: these rates")
flags.DEFINE_float("sweep_start", None, "sweep mode: first rate (geometric steps)")
flags.DEFINE_float("sweep_factor", 2.0, "sweep mode: rate multiplier per step")
flags.DEFINE_integer("sweep_steps", 6, "sweep mode: at most this many steps")
flags.DEFINE_float("min_good_fraction", 0.9, "sweep gate: good / non-cancelled sent")
flags.DEFINE_float("max_error_rate", 0.01, "sweep gate: (rejected+timed_out+failed) / sent")
flags.DEFINE_string("gate_percentile", "p95", "sweep gate percentile for TTFT/TPOT/E2E")
flags.DEFINE_list("api_keys", [], "tenant:key,... per-tenant x-api-key (multi_tenant workload)")
flags.DEFINE_bool(
    "calibrate_prompts",
    True,
    "size prompts with the server's tokenizer (Tokenize RPC) instead of 1.3 tokens per word",
)
flags.DEFINE_bool("progress", True, "show a progress bar")
flags.DEFINE_string("out", "/tmp/loadgen", "output directory")


def config_from_flags(rate: float | None = None, step: int = 0) -> RunConfig:
    """`step` > 0 (sweep steps) shifts the seed: each step sends new prompts, so a later step
    does not find the earlier steps' prompts in the server's prefix cache."""
    kind = "trace" if F.trace else F.arrival
    seed = F.workload_seed + 1000 * step
    arrival = arrivals.ArrivalConfig(
        kind,
        rate if rate is not None else F.rate,
        F.burstiness,
        F.on_s,
        F.off_s,
        F.period_s,
        F.amplitude,
        F.concurrency,
        seed,
    )
    return RunConfig(
        target=F.target,
        protocol=F.protocol,
        metrics_url=F.metrics_url,
        workload=F.workload,
        length_scale=F.length_scale,
        arrival=arrival,
        trace_path=F.trace,
        trace_speedup=F.trace_speedup,
        duration_s=F.duration_s,
        max_requests=F.max_requests,
        cancel_fraction=F.cancel_fraction,
        request_timeout_s=F.request_timeout_s,
        drain_timeout_s=F.drain_timeout_s,
        ignore_eos=F.ignore_eos,
        temperature=F.temperature,
        seed=seed,
        slo=parse_slo_policy(F.slo, F.slo_class),
        cost=report.CostConfig(F.price_per_device_hour, F.num_devices, F.power_w, F.price_per_kwh),
        warm_window_s=warm_window_s(F.warm_window_s, F.duration_s),
        scrape_interval_s=F.scrape_interval_s,
        save_trace=F.save_trace,
        progress=F.progress,
        calibrate_prompts=F.calibrate_prompts,
        api_keys={
            **({"*": F.api_key} if F.api_key else {}),
            **dict(kv.split(":", 1) for kv in F.api_keys),
        },
    )


def warm_window_s(flag_value: float | None, duration_s: float) -> float:
    """The cold window: as given, else a fifth of the run (so "steady" is never empty)."""
    return flag_value if flag_value is not None else 0.2 * duration_s


def sweep_rates() -> list[float]:
    if F.sweep_start is not None:
        shared.check_positive("sweep_start", F.sweep_start)
        shared.require("sweep_factor", F.sweep_factor, F.sweep_factor > 1, "> 1")
        shared.require("sweep_steps", F.sweep_steps, F.sweep_steps >= 1, ">= 1")
        return sweep.geometric_rates(F.sweep_start, F.sweep_factor, F.sweep_steps)
    rates = []
    for r in F.sweep_rates:
        try:
            rates.append(float(r))
        except ValueError:
            raise shared.UsageError("sweep_rates", ",".join(F.sweep_rates), "numbers") from None
        shared.require("sweep_rates", r, rates[-1] > 0, "every rate > 0 (req/s)")
    return rates


def check_flags() -> None:
    """Every user mistake visible before a request is sent (UsageError: one line, exit 2)."""
    shared.check_target("target", F.target)
    try:
        check_loopback(F.target)
        parse_mix(F.workload)
        parse_slo_policy(F.slo, F.slo_class)
    except ValueError as e:
        raise shared.UsageError("", "", str(e)) from None
    for name in ("rate", "duration_s", "length_scale", "burstiness", "scrape_interval_s"):
        shared.check_positive(name, getattr(F, name))
    for name in ("on_s", "off_s", "period_s", "trace_speedup", "request_timeout_s"):
        shared.check_positive(name, getattr(F, name))
    for name in ("drain_timeout_s", "price_per_device_hour", "price_per_kwh"):
        shared.check_positive(name, getattr(F, name), allow_zero=True)
    shared.check_positive("warm_window_s", F.warm_window_s, allow_zero=True, allow_none=True)
    shared.check_positive("power_w", F.power_w, allow_none=True)
    for name in ("max_requests", "concurrency", "num_devices"):
        shared.require(name, getattr(F, name), getattr(F, name) >= 1, ">= 1")
    for name in ("cancel_fraction", "amplitude", "min_good_fraction", "max_error_rate"):
        shared.check_fraction(name, getattr(F, name))
    shared.require(
        "gate_percentile",
        F.gate_percentile,
        F.gate_percentile in ("p50", "p95", "p99"),
        "one of p50, p95, p99",
    )
    shared.check_sampling(temperature=F.temperature)
    shared.require("trace", F.trace, F.trace is None or os.path.isfile(F.trace), "no such file")
    bad_keys = [kv for kv in F.api_keys if ":" not in kv]
    shared.require("api_keys", ",".join(bad_keys), not bad_keys, "entries are tenant:key")
    url = F.metrics_url
    shared.require(
        "metrics_url",
        url,
        url is None or url.startswith(("http://", "https://")),
        "an http:// URL, e.g. http://127.0.0.1:9090/metrics",
    )


def main(argv):
    if len(argv) > 1:
        raise shared.UsageError("", " ".join(argv[1:]), "loadgen takes no arguments, only flags")
    shared.setup_logging(F.log_level)
    check_flags()
    rates = sweep_rates()
    if F.protocol == "http":
        shared.wait_for_http_server(F.target)
    else:
        shared.wait_for_server(F.target)
    out = pathlib.Path(F.out)
    if not rates:
        rep = run_load(config_from_flags(), out)
        print(
            json.dumps(
                {
                    k: rep[k]
                    for k in (
                        "requests_sent",
                        "outcomes",
                        "throughput",
                        "goodput_rps",
                        "cost_per_success",
                    )
                },
                indent=1,
                default=str,
            )
        )
        print(f"report: {out / 'report.md'}")
        return
    limits = gates.Gates(F.gate_percentile, F.min_good_fraction, F.max_error_rate)
    result = sweep.run_sweep(
        rates, lambda r, d: run_load(config_from_flags(r, rates.index(r) + 1), d), out, limits
    )
    print(sweep.sweep_markdown(result))
    print(f"sweep: {out / 'sweep.md'}")


def run() -> None:
    app.run(shared.main_guard(main), flags_parser=shared.parse_flags)


if __name__ == "__main__":
    run()
