"""Server start-up, cold and warm (issue 21.4): seconds to `serving on` and to ready.

    python -m benchmarks.startup_bench --model=smollm2-135m --starts=2 --cache_dir=/tmp/xla

Starts `python -m serving.server` `--starts` times on one compilation cache directory (the
first start is cold when the directory is new or empty), and for each start records the
seconds from launch to the model loaded, to `serving on`, and to ready (gRPC health
SERVING: warm-up and the capacity probe done), the warm-up's program count and how many
were loaded from the cache (its last progress line), the process's compiles and the compiles
after warm-up (Prometheus /metrics), and the load average. Prints one JSON line per start.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
import urllib.request

import grpc
from absl import app, flags
from grpc_health.v1 import health_pb2, health_pb2_grpc

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "smollm2-135m", "model preset")
flags.DEFINE_integer("starts", 2, "server starts on one cache directory")
flags.DEFINE_string("cache_dir", "/tmp/pagedjax_startup_xla", "compilation cache directory")
flags.DEFINE_integer("warmup_max_shapes", 32, "passed to the server")
flags.DEFINE_float("timeout_s", 1800.0, "give up on a start after this long")
flags.DEFINE_list("server_args", [], "more server flags, e.g. --engine_process")


def _metric(text: str, name: str) -> float | None:
    m = re.search(rf"^{name}{{[^}}]*}} ([0-9.e+]+)$", text, re.M)
    return None if m is None else float(m.group(1))


def _watch(proc, t0: float, marks: dict) -> None:
    """Timestamps of the server's progress lines (stderr and stdout merged)."""
    for line in proc.stdout:
        now = time.perf_counter() - t0
        sys.stderr.write(f"[{now:7.1f}s] {line}")
        if "loaded " in line and " in " in line and "loaded_s" not in marks:
            marks["loaded_s"] = now
        if line.startswith("serving on"):
            marks["serving_on_s"] = now
            marks["metrics_port"] = int(re.search(r"metrics port (\d+)", line).group(1))
            marks["port"] = int(line.split()[2])
        m = re.search(r"warm-up: (\d+) step programs .* in ([0-9.]+)s \((\d+) loaded", line)
        if m:
            marks.update(programs=int(m[1]), warmup_s=float(m[2]), cache_loaded=int(m[3]))
        if "compiled after warm-up" in line:
            marks.setdefault("compile_lines", []).append(line.strip()[-160:])


def one_start(index: int) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "serving.server",
        f"--model={FLAGS.model}",
        "--port=0",
        "--metrics_port=0",
        f"--compilation_cache_dir={FLAGS.cache_dir}",
        f"--warmup_max_shapes={FLAGS.warmup_max_shapes}",
        *FLAGS.server_args,
    ]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    marks: dict = {"start": index, "load_avg_start": os.getloadavg()}
    threading.Thread(target=_watch, args=(proc, t0, marks), daemon=True).start()
    try:
        while "port" not in marks:
            if proc.poll() is not None or time.perf_counter() - t0 > FLAGS.timeout_s:
                raise RuntimeError(f"server exited or timed out before serving on: {marks}")
            time.sleep(0.2)
        stub = health_pb2_grpc.HealthStub(grpc.insecure_channel(f"localhost:{marks['port']}"))
        while True:
            status = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status
            if status == health_pb2.HealthCheckResponse.SERVING:
                marks["ready_s"] = time.perf_counter() - t0
                break
            if proc.poll() is not None or time.perf_counter() - t0 > FLAGS.timeout_s:
                raise RuntimeError(f"server exited or timed out before ready: {marks}")
            time.sleep(0.2)
        url = f"http://localhost:{marks['metrics_port']}/metrics"
        text = urllib.request.urlopen(url, timeout=10).read().decode()
        marks["compiles_total"] = _metric(text, "pagedjax_compiles_total")
        marks["compiles_after_warmup"] = _metric(text, "pagedjax_compiles_after_warmup_total")
        marks["load_avg_end"] = os.getloadavg()
    finally:
        proc.terminate()
        proc.wait(timeout=120)
    return marks


def main(argv) -> None:
    del argv
    for i in range(FLAGS.starts):
        print(json.dumps(one_start(i)), flush=True)


if __name__ == "__main__":
    app.run(main)
