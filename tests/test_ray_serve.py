"""pagedjax on Ray Serve (serving/ray_serve/app.py), started as the README shows it: Ray's own
CLI, `serve run deploy/ray/serve.yaml`, with the config's args swapped for the tiny model and
two replicas (one local Ray cluster, started by `serve run` and shut down by its SIGINT).
Driven by the official `openai` SDK through Serve's HTTP proxy and the app's ingress
(serving/ray_serve/ingress.py), which relays each call to the replica the router picks:

- both replicas RUNNING (read from Serve's own status by a driver attached to the cluster);
- every greedy completion (plain and streamed, 8 at once so both replicas serve) equals one
  EngineCore driven directly, and carries the model's versions."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

from serving.testing import free_port  # noqa: E402
from tests.served_reference import check_completions, greedy_reference  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
ENGINE = dict(
    page_size=4,
    num_pages=128,
    max_num_seqs=4,
    max_num_batched_tokens=64,
    prefill_chunk_size=32,
    max_model_len=128,
)
SERVER_ARGS = [
    *(f"--{k}={v}" for k, v in ENGINE.items()),
    "--warmup_max_shapes=4",  # warm-up on (a replica is routed to once it ended), kept short
    "--capacity_probe=false",
    "--log_level=warning",
]
PROMPTS = ["hello world", "the quick brown fox jumps over the lazy dog", "a b c", "tiny"]
MAX_TOKENS = [12, 5, 9, 3]


@pytest.fixture(scope="module")
def reference(tiny_model):
    return greedy_reference(tiny_model, ENGINE, PROMPTS, MAX_TOKENS)


def _cluster_driver_env(proc: subprocess.Popen, env: dict) -> tuple[str, dict]:
    """The GCS address of the Ray cluster `proc` (`serve run`) started, read from its raylet's
    command line, and `env` with the cluster's authentication mode (from the raylet's
    environment: Ray turns token auth on by default for a cluster it starts, and a driver
    given an explicit address sends no token unless told). NOTE: not
    `ray.init(address="auto")`: with no `ray start` it attaches to any cluster on the machine,
    and on the other lane tests/test_ray_routing.py may run one (a run of 2026-12-06 read that
    cluster's Serve status as it shut down: ActorDiedError)."""
    import psutil

    for child in psutil.Process(proc.pid).children(recursive=True):
        try:
            cmdline, child_env = child.cmdline(), child.environ()
        except psutil.Error:  # exited meanwhile
            continue
        for arg in cmdline:
            if arg.startswith("--gcs-address="):
                driver_env = dict(env)
                if "RAY_AUTH_MODE" in child_env:
                    driver_env["RAY_AUTH_MODE"] = child_env["RAY_AUTH_MODE"]
                return arg.split("=", 1)[1], driver_env
    raise AssertionError("no raylet under `serve run`: its cluster is not up")


# Serve's own view of the replicas, read by one driver of its own that waits until both run:
# a fresh process, since this one may have run another cluster already
# (tests/test_ray_routing.py, in the same pytest process under tests/lanes.py) and a second
# ray.init here found no Serve application.
WAIT_FOR_REPLICAS = """
import json, sys, time
import ray
from ray import serve
ray.init(address=sys.argv[1], log_to_driver=False)
end, states = time.monotonic() + float(sys.argv[2]), {}
while states.get("RUNNING") != 2 and time.monotonic() < end:
    time.sleep(0 if not states else 1)
    app = serve.status().applications.get("pagedjax")
    states = dict(app.deployments["pagedjax"].replica_states) if app else {"none": 0}
print(json.dumps(states))
"""


def _wait_for_replicas(address: str, env: dict, timeout_s: float) -> dict:
    """Serve's replica states once both replicas run (or at `timeout_s`)."""
    out = subprocess.run(
        [sys.executable, "-c", WAIT_FOR_REPLICAS, address, str(timeout_s)],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s + 120,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.subprocess
def test_documented_serve_config_runs_two_replicas_equal_to_one_engine(tmp_path, reference):
    import openai

    config = yaml.safe_load((ROOT / "deploy/ray/serve.yaml").read_text())
    port = free_port()
    config["http_options"].update(host="127.0.0.1", port=port)
    app = config["applications"][0]
    assert app["import_path"] == "serving.ray_serve:build_app"
    app["args"].update(model="tiny", num_replicas=2, server_args=SERVER_ARGS)
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(config))
    # RAY_worker_niceness: the replicas at normal priority (tests/test_ray_routing.py says why)
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu", RAY_worker_niceness="0")
    env.pop("RAY_ADDRESS", None)  # a cluster of its own, not one this shell may point at
    serve_cli = Path(sys.executable).with_name("serve")
    log = tmp_path / "serve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [str(serve_cli), "run", str(path)], cwd=ROOT, env=env, stdout=out, stderr=out
        )
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
        end = time.monotonic() + 600  # only guards against a hang
        while True:
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < end, log.read_text()[-3000:]
            try:
                reply = client.completions.create(
                    model="tiny", prompt=PROMPTS[0], max_tokens=MAX_TOKENS[0], temperature=0
                )
                break
            except (openai.APIConnectionError, openai.NotFoundError, openai.APIStatusError):
                time.sleep(1)  # the proxy is up before the application is deployed
        texts, lengths, identity = reference
        assert reply.choices[0].text == texts[0].rstrip("\ufffd")
        address, driver_env = _cluster_driver_env(proc, env)
        states = _wait_for_replicas(address, driver_env, max(1.0, end - time.monotonic()))
        assert states.get("RUNNING") == 2, states
        check_completions(client, PROMPTS, MAX_TOKENS, texts, lengths, identity)
    finally:
        proc.send_signal(signal.SIGINT)  # `serve run` tears the app and its Ray cluster down
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:  # then its Ray processes may be left: stop them
            proc.kill()
            proc.wait(10)
            subprocess.run([str(serve_cli.with_name("ray")), "stop", "--force"], env=env)


def test_kuberay_rayservice_runs_the_documented_serve_application():
    service = yaml.safe_load((ROOT / "deploy/ray/rayservice.yaml").read_text())
    assert (service["apiVersion"], service["kind"]) == ("ray.io/v1", "RayService")
    embedded = yaml.safe_load(service["spec"]["serveConfigV2"])["applications"]
    documented = yaml.safe_load((ROOT / "deploy/ray/serve.yaml").read_text())["applications"]
    assert embedded == documented
