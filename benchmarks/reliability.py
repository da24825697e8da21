"""`make reliability`: the full-size reliability checks of issue 17, written to
reliability/report.md (and the raw figures to reliability/report.json).

    python -m benchmarks.reliability [--sections=burst,soak_fake,soak_model,timing,fuzz,faults]
        [--burst_model=mock] [--burst_n=300] [--soak_fake_n=10000] [--soak_model_n=1000]
        [--model=smollm2-135m] [--timing_probes=200] [--fuzz_examples=500]

Sections:
  burst       N concurrent chat calls with a deadline against `python -m serving.server`
              (cold and warm), outcome table, shed latency percentiles (reliability_burst.py)
  soak_fake   N requests through the serving stack on the fake model, 20% cancelled at
              random points; zero pages in use and one outcome per request at the end
  soak_model  the same through the real model (`--model`)
  timing      cross-tenant prefix timing probe, AUC (reliability_probes.py)
  fuzz        tests/test_serving_fuzz.py with FUZZ_EXAMPLES examples per property
  faults      the fault-scenario tests (failed steps and the breaker, NaN logits, KV
              exhaustion, slow consumers, SIGTERM drain, reload)

Every figure is printed with os.getloadavg(): this machine is shared.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import time

SECTIONS = ("burst", "soak_fake", "soak_model", "timing", "fuzz", "faults")
FAULT_TESTS = {
    "engine step raises: only its requests fail; breaker opens, probe closes it": (
        "tests/test_serving_overload.py::test_circuit_breaker_opens_and_a_probe_closes_it"
    ),
    "failed step leaves queued requests unharmed": (
        "tests/test_serving_hardening.py::test_a_failed_step_fails_only_its_requests"
    ),
    "NaN/inf logits flagged on device fail only that request": (
        "tests/test_engine_faults.py::test_nonfinite_logits_fail_only_their_request"
    ),
    "KV exhaustion under long prompts preempts, all finish": (
        "tests/test_engine_faults.py::test_kv_exhaustion_preempts_and_every_request_finishes"
    ),
    "slow consumer ABORTED (tokens ahead), pages freed": (
        "tests/test_serving_hardening.py::"
        "test_slow_consumer_is_aborted_by_tokens_ahead_and_pages_freed"
    ),
    "slow consumer ABORTED (stall timeout), pages freed": (
        "tests/test_serving_hardening.py::test_slow_consumer_stall_timeout"
    ),
    "SIGTERM drains in-flight streams, exit 0 (engine in-process and in a child process)": (
        "tests/test_serving_shutdown.py::test_sigterm_drains_the_server_program_and_exits_0"
    ),
    "drain timeout cancels the rest with an outcome, pages freed": (
        "tests/test_serving_shutdown.py::"
        "test_drain_timeout_cancels_the_rest_with_an_outcome_and_frees_pages"
    ),
    "engine process killed: only its requests fail (once each), a fresh one serves": (
        "tests/test_serving_engine_process.py::"
        "test_a_killed_engine_process_fails_what_it_held_once_and_a_new_one_serves"
    ),
    "HTTP response not delivered (client left after the engine finished): cancelled": (
        "tests/test_http_delivery.py::test_streamed_response_not_delivered_is_cancelled_not_success"
    ),
    "reload under load: nothing fails, each final names its revision": (
        "tests/test_serving_shutdown.py::"
        "test_reload_under_load_fails_nothing_and_names_the_revision"
    ),
}


def _load() -> str:
    return "load {:.1f} / {:.1f} / {:.1f}".format(*os.getloadavg())


def _hypothesis_counts(stdout: str) -> dict[str, str]:
    """{test: "N passing examples, ..."} from pytest --hypothesis-show-statistics."""
    counts, test = {}, None
    for line in stdout.splitlines():
        m = re.match(r".*::(test_\w+):", line.strip())
        if m:
            test = m.group(1)
        m = re.search(r"- (\d+ passing, \d+ failing, and \d+ invalid test cases)", line)
        if m and test and test not in counts:
            counts[test] = m.group(1)
    return counts


def _pytest(args: list[str], env: dict | None = None, timeout_s: float = 3600) -> dict:
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env=dict(os.environ, **(env or {})),
    )
    tail = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else proc.stderr[-300:]
    counts = {k: int(v) for v, k in re.findall(r"(\d+) (passed|failed|error|skipped)", tail)}
    return {"returncode": proc.returncode, "summary": tail, "counts": counts,
            "hypothesis": _hypothesis_counts(proc.stdout),
            "wall_s": time.monotonic() - start}  # fmt: skip


# ---- sections -----------------------------------------------------------------------------
def section_burst(a) -> dict:
    from benchmarks import reliability_burst

    server_args = [f"--max_num_seqs={a.burst_max_num_seqs}"]
    if a.burst_max_model_len:
        server_args.append(f"--max_model_len={a.burst_max_model_len}")
    if a.burst_engine_process:
        server_args.append("--engine_process")
    if a.burst_compilation_cache_dir:
        server_args.append(f"--compilation_cache_dir={a.burst_compilation_cache_dir}")
    if a.burst_model != "mock":
        server_args.append(f"--warmup_max_shapes={a.burst_warmup_max_shapes}")
    if a.burst_model == "mock":
        server_args.append(f"--mock_step_time_s={a.mock_step_time_s}")
    server_args += [x for x in a.burst_server_args.split(",") if x]  # e.g. --layer_loop=scan
    out = reliability_burst.run(
        a.burst_model,
        a.burst_n,
        a.burst_max_tokens,
        a.burst_deadline_s,
        server_args,
        os.path.join(a.out_dir, "burst_server.log"),
        probes=a.burst_probes,
    )
    out["load"] = _load()
    out["config"] = (
        f"{a.burst_n} chat calls at once, {a.burst_max_tokens} max tokens, "
        f"{a.burst_deadline_s} s deadline, max_num_seqs {a.burst_max_num_seqs}, "
        f"max_model_len {a.burst_max_model_len or 'default'}, "
        f"warm-up {a.burst_warmup_max_shapes if a.burst_model != 'mock' else 0} shapes"
        + (f", mock step {a.mock_step_time_s} s" if a.burst_model == "mock" else "")
        + (", engine in a child process" if a.burst_engine_process else ", engine in-process")
    )
    return out


def _mock_server(max_num_seqs: int, step_time_s: float, engine_process: bool = False):
    from serving.engine_host.mock_engine import MockEngine
    from serving.frontend.admission import AdmissionConfig
    from serving.server import PagedJaxServer, ServerConfig

    if engine_process:  # the same MockEngine, built in a child process
        from serving.engine_host.process import ProcessEngine

        options = {"max_num_seqs": max_num_seqs, "num_pages": 4096, "page_size": 16}
        build = {"mock_step_time_s": step_time_s}
        engine = ProcessEngine.start("mock", options, build_kwargs=build)
    else:
        engine = MockEngine(
            max_num_seqs=max_num_seqs, num_pages=4096, page_size=16, step_time_s=step_time_s
        )
    admission = AdmissionConfig(max_queue_requests=1024, max_tokens=64, max_model_len=512)
    return PagedJaxServer(
        engine, ServerConfig(host="127.0.0.1", port=0, admission=admission)
    ).start()


def section_soak_fake(a) -> dict:
    from benchmarks.reliability_soak import soak

    server = _mock_server(32, 0.002, engine_process=bool(a.soak_engine_process))
    try:
        prompts = [f"prompt {i} " * (1 + i % 20) for i in range(50)]
        out = soak(server, a.soak_fake_n, 64, a.cancel_fraction, prompts, max_tokens=32)
    finally:
        server.stop(0)
    out["load"] = _load()
    return out


_ENGINES: dict = {}


def _model_server(a, tenants=None):
    from serving.frontend.admission import AdmissionConfig
    from serving.server import PagedJaxServer, ServerConfig, build_engine

    options = dict(
        page_size=16,
        num_pages=a.model_num_pages,
        max_num_seqs=a.model_max_num_seqs,
        max_num_batched_tokens=256,
        prefill_chunk_size=256,
        prefix_caching=True,
        mesh=None,
        warmup_max_shapes=a.warmup_max_shapes,
    )
    start = time.monotonic()
    if a.model not in _ENGINES:  # soak_model and timing share one engine (loading is slow)
        _ENGINES[a.model] = build_engine(a.model, options, max_model_len=1024)
    engine = _ENGINES[a.model]
    build_s = time.monotonic() - start
    admission = AdmissionConfig(max_queue_requests=1024, max_tokens=64, max_model_len=1024)
    cfg = ServerConfig(host="127.0.0.1", port=0, admission=admission)
    return PagedJaxServer(engine, cfg, tenants).start(), build_s


def section_soak_model(a) -> dict:
    from benchmarks.reliability_soak import soak

    server, build_s = _model_server(a)
    try:
        prompts = [
            "What is the capital of France?",
            "Write a haiku about the sea.",
            "List three prime numbers.",
            "Explain what a KV cache is in one sentence.",
        ]
        out = soak(server, a.soak_model_n, a.model_max_num_seqs * 2, a.cancel_fraction, prompts, 16)
    finally:
        server.stop(0)
    out.update(model=a.model, engine_build_s=build_s, load=_load())
    return out


def section_timing(a) -> dict:
    from benchmarks.reliability_probes import timing_report
    from serving.frontend.tenants import TenantRegistry

    tenants = TenantRegistry.from_dict(
        {
            "tenants": [
                {"name": "owner", "api_keys": ["k-owner"]},
                {"name": "other", "api_keys": ["k-other"]},
            ]
        }
    )
    server, _ = _model_server(a, tenants)
    try:
        vocab = server.loop.engine.tokenizer.vocab_size
        out = timing_report(
            f"127.0.0.1:{server.port}", "k-owner", "k-other", a.timing_prefix_tokens,
            a.timing_probes, min(vocab, 30000),
        )  # fmt: skip
    finally:
        server.stop(0)
    out.update(model=a.model, load=_load())
    return out


def section_fuzz(a) -> dict:
    out = _pytest(
        ["tests/test_serving_fuzz.py", "--hypothesis-show-statistics"],
        {"FUZZ_EXAMPLES": str(a.fuzz_examples)},
    )
    out.update(examples_per_property=a.fuzz_examples, properties=3, load=_load())
    return out


def section_faults(a) -> dict:
    results = {}
    for name, node in FAULT_TESTS.items():
        r = _pytest([node])
        results[name] = {"test": node, "passed": r["returncode"] == 0, "summary": r["summary"]}
    return {"scenarios": results, "load": _load()}


# ---- report -------------------------------------------------------------------------------
def _burst_md(b: dict) -> list[str]:
    lines = ["| burst | n | OK | RESOURCE_EXHAUSTED | UNAVAILABLE | DEADLINE_EXCEEDED | other |",
             "| --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for k in ("cold", "warm"):
        c = dict(b[k]["codes"])
        known = [c.pop(x, 0) for x in ("OK", "RESOURCE_EXHAUSTED", "UNAVAILABLE",
                                        "DEADLINE_EXCEEDED")]  # fmt: skip
        lines.append(f"| {k} | {b[k]['n']} | " + " | ".join(map(str, known)) + f" | {c or ''} |")
    retried = "; ".join(f"{k} {b[k].get('retried_after_hint')}" for k in ("cold", "warm"))
    lines += [
        "",
        f"Calls shed in each burst, retried once after their retry-after-ms: {retried}.",
        "",
        "| shed latency (ms) | p50 | p90 | p99 | max |",
        "| --- | --- | --- | --- | --- |",
    ]
    for k in ("cold", "warm"):
        for who, d in (("burst client", b[k]["shed_latency_ms"]),
                       ("light probe client", b[k]["probe"]["shed_latency_ms"])):  # fmt: skip
            vals = [f"{d[q]:.1f}" if q in d else "-" for q in ("p50", "p90", "p99", "max")]
            lines.append(f"| {k}, {who} | " + " | ".join(vals) + " |")
    return lines


def _soak_md(r: dict) -> list[str]:
    cancelled = sum(v for k, v in r["plans"].items() if k != "complete")
    rows = [
        ("model", r.get("model", "fake (MockEngine)")),
        ("requests sent", r["requests"]),
        ("cancelled at random points", f"{cancelled} {r['plans']}"),
        ("calls that reached the server", int(r["calls_seen"])),
        ("outcomes recorded (counters)", int(r["outcomes_recorded"])),
        ("request_end log lines", r["request_end_lines"]),
        ("request ids with 2+ outcome lines", r["request_ids_with_two_or_more_lines"]),
        (
            "uncancelled requests without exactly 1 line",
            r["completed_requests_without_exactly_one_line"],
        ),  # fmt: skip
        ("outcomes", r["outcomes"]),
        ("client status by plan", r["client_codes"]),
        ("KV pages in use at the end", r["kv_pages_used_at_end"]),
        ("wall time", f"{r['wall_s']:.1f} s ({r['load']})"),
    ]
    return ["| | |", "| --- | --- |", *(f"| {k} | {v} |" for k, v in rows)]


def write_report(results: dict, args, path_md: str) -> None:
    lines = [
        "# Reliability report (issue 17)",
        "",
        f"Generated {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M UTC} by "
        f"`python -m benchmarks.reliability {' '.join(sys.argv[1:])}`.",
        "Shared 2-core machine: each section carries the load average it ran at.",
        "",
    ]
    for note in results.get("notes", ()):  # what a figure cannot say by itself
        lines += [f"- {note}"]
    lines += [""] if results.get("notes") else []
    for key in sorted(k for k in results if k.startswith("burst")):
        b = results[key]
        lines += [f"## Burst, model {key[6:-1]} ({b.get('config', '')}; {b['load']})",
                  "", *_burst_md(b), "", f"Server exit code after SIGTERM: "
                  f"{b['server_exit_code']}.", ""]  # fmt: skip
    for key, title in (
        ("soak_fake", "Soak, fake model"),
        ("soak_fake[engine process]", "Soak, fake model, engine in a child process"),
        ("soak_model", "Soak, real model"),
    ):
        if key in results:
            lines += [f"## {title}", "", *_soak_md(results[key]), ""]
    if "timing" in results:
        t = results["timing"]
        lines += ["## Cross-tenant timing probe", "",
                  "| prober | probes | AUC | median TTFT hit / miss (ms) |",
                  "| --- | --- | --- | --- |",
                  f"| another tenant | {t.get('probes_other_tenant')} | "
                  f"{t['other_tenant_auc']:.3f} | {t['other_tenant_median_ttft_ms']['hit']:.1f}"
                  f" / {t['other_tenant_median_ttft_ms']['miss']:.1f} |",
                  f"| the owner itself (control) | {t.get('probes_same_tenant_control')} | "
                  f"{t['same_tenant_control_auc']:.3f} | "
                  f"{t['same_tenant_median_ttft_ms']['hit']:.1f} / "
                  f"{t['same_tenant_median_ttft_ms']['miss']:.1f} |", "",
                  f"Model {t.get('model')}, prefix {t['prefix_tokens']} tokens ({t['load']}).",
                  ""]  # fmt: skip
    if "fuzz" in results:
        f = results["fuzz"]
        lines += ["## Fuzzing", "", f"{f['examples_per_property']} hypothesis examples for each "
                  f"of {f['properties']} properties, plus the fixed hostile cases: "
                  f"`{f['summary']}` ({f['load']}).", "",
                  *(f"- {t}: {c}" for t, c in f.get("hypothesis", {}).items()), ""]  # fmt: skip
    if "faults" in results:
        lines += ["## Fault scenarios", "", "| scenario | result |", "| --- | --- |"]
        for name, r in results["faults"]["scenarios"].items():
            lines.append(f"| {name} | {'pass' if r['passed'] else 'FAIL'}: {r['summary']} |")
        lines.append("")
    with open(path_md, "w") as f:
        f.write("\n".join(lines))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sections", default=",".join(SECTIONS))
    p.add_argument("--out_dir", default="reliability")
    p.add_argument("--burst_model", default="mock")
    p.add_argument("--burst_n", type=int, default=300)
    p.add_argument("--burst_max_tokens", type=int, default=64)
    p.add_argument("--burst_deadline_s", type=float, default=15.0)
    p.add_argument("--burst_max_num_seqs", type=int, default=32)
    p.add_argument("--burst_probes", type=int, default=100)
    p.add_argument(
        "--burst_max_model_len",
        type=int,
        default=256,
        help="the burst server's --max_model_len (0: the model's): the burst's chats fit 256, "
        "and a shorter context means a smaller set of step shapes to compile (90 vs 120)",
    )
    p.add_argument(
        "--burst_compilation_cache_dir",
        default="",
        help="JAX compilation cache for the burst server (off on CPU by default): a second "
        "run then loads the step programs the first one compiled",
    )
    p.add_argument(
        "--burst_engine_process",
        type=int,
        default=1,
        help="1: the server runs its engine in a child process (--engine_process); 0: in-process",
    )
    p.add_argument("--burst_warmup_max_shapes", type=int, default=32)
    p.add_argument("--burst_server_args", default="", help="more server flags, comma-separated")
    p.add_argument("--mock_step_time_s", type=float, default=0.05)
    p.add_argument("--soak_fake_n", type=int, default=10_000)
    p.add_argument("--soak_model_n", type=int, default=1_000)
    p.add_argument(
        "--soak_engine_process",
        type=int,
        default=0,
        help="1: soak_fake's MockEngine runs in a child process (serving/engine_host/process.py)",
    )
    p.add_argument("--cancel_fraction", type=float, default=0.2)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--model_max_num_seqs", type=int, default=16)
    p.add_argument("--model_num_pages", type=int, default=512)
    p.add_argument("--warmup_max_shapes", type=int, default=16)
    p.add_argument("--timing_probes", type=int, default=200)
    p.add_argument("--timing_prefix_tokens", type=int, default=128)
    p.add_argument("--fuzz_examples", type=int, default=500)
    a = p.parse_args(argv)
    os.makedirs(a.out_dir, exist_ok=True)
    path_json = os.path.join(a.out_dir, "report.json")
    results = {}
    if os.path.exists(path_json):  # sections run separately accumulate
        with open(path_json) as f:
            results = json.load(f)
    for name in a.sections.split(","):
        print(f"[reliability] {name} ... ({_load()})", flush=True)
        start = time.monotonic()
        variant = "" if a.burst_engine_process else ", engine in-process"
        key = f"burst[{a.burst_model}{variant}]" if name == "burst" else name
        if name == "soak_fake" and a.soak_engine_process:
            key = "soak_fake[engine process]"
        results[key] = globals()[f"section_{name}"](a)
        results[key]["section_wall_s"] = time.monotonic() - start
        print(json.dumps(results[key], indent=1, default=str), flush=True)
        if os.path.exists(path_json):  # another run may have added sections meanwhile
            with open(path_json) as f:
                results = {**json.load(f), key: results[key]}
        with open(path_json, "w") as f:
            json.dump(results, f, indent=1, default=str)
        write_report(results, a, os.path.join(a.out_dir, "report.md"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
