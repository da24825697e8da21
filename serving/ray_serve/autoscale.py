"""Serve autoscaling from the replicas' own signals, and the bounds that keep Serve from
queueing in front of a replica that would shed.

Signals. Each engine replica reports, through Serve's custom-metrics hook
(`record_autoscaling_stats`, pushed every RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S):

    pagedjax_load      requests the replica holds: in the engine (running + waiting for a
                       slot) + in its admission queue (serving/frontend/admission.py)
    pagedjax_kv_usage  fraction of the KV pages in use (0-1)

Policy (`PagedJaxAutoscalingPolicy`, run by the Serve controller every tick over the metrics
averaged on `look_back_period_s`): desired replicas = total load / target_ongoing_requests; and
one more than now while any replica's KV usage is at `kv_usage_target` or above (a replica
whose pages are full preempts, however few requests it holds). Until replicas have reported,
Serve's own count of ongoing requests stands in for the load. Serve applies min/max_replicas,
upscale/downscale delays and factors to the result (its `_apply_autoscaling_config` wraps
every custom policy). Scale-to-zero is off unless min_replicas: 0 is asked for.

Overload. A replica sheds with 429 + Retry-After once its admission queue is full
(--max_queue_requests). For that answer to reach the client, Serve must hand the request to
the replica instead of holding it: the engine deployment's `max_ongoing_requests` is the
replica's whole capacity (in flight + queue bound) plus `SHED_HEADROOM` (requests being shed
hold a slot for a moment), so a replica is never "full" for Serve while it would still
answer; and Serve's own queue (requests no replica accepted yet: all are at that cap, or none
is up) is bounded by `max_queued_requests`, past which the ingress answers 429 + Retry-After
itself (Serve's BackPressureError).

May import: ray.serve's public autoscaling API, serving.flags.
"""

from __future__ import annotations

from typing import Any

from ray.serve.config import AutoscalingContext

from serving import flags as shared

LOAD = "pagedjax_load"
KV_USAGE = "pagedjax_kv_usage"
POLICY_PATH = "serving.ray_serve.autoscale:PagedJaxAutoscalingPolicy"
SHED_HEADROOM = 16  # Serve-side slots above the replica's capacity, for requests being shed
DEFAULT_MAX_QUEUED = 64  # Serve's queue bound in front of the replicas (per ingress replica)
DEFAULT_RETRY_AFTER_S = 1.0
# The defaults of serving.server's flags that size a replica (kept equal by a test).
SERVER_DEFAULTS = {"max_num_seqs": 64, "max_queue_requests": 256, "max_inflight": None}
AUTOSCALING_DEFAULTS = {
    "min_replicas": 1,  # scale-to-zero off unless asked for
    "max_replicas": 4,
    "target_ongoing_requests": 32,
    "upscale_delay_s": 10.0,
    "downscale_delay_s": 300.0,
    "look_back_period_s": 10.0,
}


def replica_signals(server) -> dict[str, float]:
    """A PagedJaxServer's autoscaling metrics (read on the replica, cheap: no engine call)."""
    stats = server.loop.last_stats or {}
    in_engine = int(stats.get("num_running", 0)) + int(stats.get("num_waiting", 0))
    return {LOAD: float(in_engine + len(server.waiting)), KV_USAGE: float(stats.get("kv_usage", 0))}


class PagedJaxAutoscalingPolicy:
    """Serve custom autoscaling policy (a class: Serve builds it once with policy_kwargs)."""

    def __init__(self, kv_usage_target: float = 0.9):
        if not 0 < kv_usage_target <= 1:
            raise ValueError(f"kv_usage_target={kv_usage_target}: must be in (0, 1]")
        self.kv_usage_target = kv_usage_target

    def __call__(self, ctx: AutoscalingContext) -> tuple[float, dict[str, Any]]:
        metrics = ctx.aggregated_metrics or {}
        loads = metrics.get(LOAD) or {}
        total = sum(loads.values()) if loads else ctx.total_num_requests
        target = ctx.config.get_target_ongoing_requests()
        desired = total / target
        kv = metrics.get(KV_USAGE) or {}
        if kv and max(kv.values()) >= self.kv_usage_target:
            desired = max(desired, ctx.current_num_replicas + 1)
        state = dict(ctx.policy_state)
        state.update(pagedjax_load=total, pagedjax_desired=desired)
        return desired, state


def replica_capacity(argv: list[str]) -> int:
    """Requests one replica holds before it sheds: in flight + its admission queue bound, read
    from its serving.server flags (`--name=value` form) or their defaults."""
    values = dict(SERVER_DEFAULTS)
    for arg in argv:
        name, sep, value = arg.lstrip("-").partition("=")
        if sep and name in values:
            values[name] = int(value)
    inflight = values["max_inflight"] or values["max_num_seqs"]
    return int(inflight) + int(values["max_queue_requests"])


HEALTH_CHECK_OPTIONS = ("health_check_period_s", "health_check_timeout_s")


def deployment_options(args: dict[str, Any], argv: list[str]) -> dict[str, Any]:
    """The engine deployment's scaling and queueing options from build_app's args (popped):
    `num_replicas` (int, or "auto"), `autoscaling_config` (Serve's keys; ours by default),
    `max_ongoing_requests`, `max_queued_requests`, `retry_after_s`, `health_check_period_s`,
    `health_check_timeout_s`."""
    options: dict[str, Any] = {}
    num_replicas = args.pop("num_replicas", 1)
    if num_replicas == "auto" or "autoscaling_config" in args:
        config = {**AUTOSCALING_DEFAULTS, **dict(args.pop("autoscaling_config", None) or {})}
        config.setdefault("policy", {"policy_function": POLICY_PATH})
        options["autoscaling_config"] = config
    else:
        if not isinstance(num_replicas, int) or num_replicas < 1:
            raise shared.UsageError("num_replicas", num_replicas, 'an int >= 1, or "auto"')
        options["num_replicas"] = num_replicas
    capacity = replica_capacity(argv)
    options["max_ongoing_requests"] = int(
        args.pop("max_ongoing_requests", capacity + SHED_HEADROOM)
    )
    if options["max_ongoing_requests"] <= capacity:
        shared.progress(
            f"max_ongoing_requests={options['max_ongoing_requests']} <= the replica's "
            f"capacity {capacity}: Serve queues requests the replica would have shed"
        )
    options["max_queued_requests"] = int(args.pop("max_queued_requests", DEFAULT_MAX_QUEUED))
    retry_after_s = float(args.pop("retry_after_s", DEFAULT_RETRY_AFTER_S))
    options["backpressure_config"] = {"status_code": 429, "retry_after_s": retry_after_s}
    for name in HEALTH_CHECK_OPTIONS:  # Serve's own (defaults: every 10 s, 30 s to answer)
        if name in args:
            options[name] = float(args.pop(name))
    return options
