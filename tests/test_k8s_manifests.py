"""deploy/k8s/gateway/ parses and hangs together: only real, released APIs, the inference pool
valid against the upstream CRD and selecting the serving pods, probes and accelerators, the
EPP reading the metric names the server exposes, the LeaderWorkerSet's multi-host arguments,
the llm-d prefill/decode pairing, KServe, and every flag a manifest passes defined by the
program it runs. (KubeRay: deploy/ray/rayservice.yaml, tests/test_ray_serve.py.)"""

import os
import subprocess
import sys

import pytest

yaml = pytest.importorskip("yaml")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
K8S = os.path.join(ROOT, "deploy", "k8s")


def container(deployment: dict) -> dict:
    (c,) = deployment["spec"]["template"]["spec"]["containers"]
    return c


def flag_names(args: list[str]) -> set[str]:
    return {a[2:].split("=")[0] for a in args if a.startswith("--")}


# ---- the gateway manifests (deploy/k8s/gateway/): GIE / llm-d / KServe -----------------------
GATEWAY = os.path.join(K8S, "gateway")
CRD = os.path.join(
    ROOT, "..", "shared", "vendor", "gie", "inference.networking.k8s.io_inferencepools.yaml"
)
# every apiVersion/kind the gateway manifests may name: real, released APIs only
KNOWN_KINDS = {
    ("apps/v1", "Deployment"),
    ("v1", "Service"),
    ("v1", "ConfigMap"),
    ("v1", "ServiceAccount"),
    ("rbac.authorization.k8s.io/v1", "Role"),
    ("rbac.authorization.k8s.io/v1", "RoleBinding"),
    ("inference.networking.k8s.io/v1", "InferencePool"),
    ("gateway.networking.k8s.io/v1", "HTTPRoute"),
    ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet"),
    ("serving.kserve.io/v1alpha1", "LLMInferenceService"),
    ("kustomize.config.k8s.io/v1beta1", "Kustomization"),
}
LLMD_LABEL = ("llm-d.ai/inferenceServing", "true")


def gateway_docs(name: str | None = None) -> list[dict]:
    names = [name] if name else sorted(n for n in os.listdir(GATEWAY) if n.endswith(".yaml"))
    out = []
    for n in names:
        with open(os.path.join(GATEWAY, n)) as f:
            out += [d for d in yaml.safe_load_all(f) if d]
    return out


def gateway_of_kind(kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in gateway_docs() if d["kind"] == kind}


def server_containers() -> list[tuple[str, dict, dict]]:
    """(object name, pod template, container) of every pagedjax server container."""
    out = []
    for d in gateway_docs():
        templates = []
        if d["kind"] == "Deployment":
            templates = [d["spec"]["template"]]
        elif d["kind"] == "LeaderWorkerSet":
            lwt = d["spec"]["leaderWorkerTemplate"]
            templates = [lwt["leaderTemplate"], lwt["workerTemplate"]]
        elif d["kind"] == "LLMInferenceService":
            templates = [{"metadata": {}, "spec": d["spec"]["template"]}]
        for t in templates:
            for c in t["spec"]["containers"]:
                if c.get("command", [])[-1:] == ["serving.server"]:
                    out.append((d["metadata"]["name"], t, c))
    return out


def test_gateway_manifests_name_only_real_apis_and_the_kustomization_lists_files():
    for d in gateway_docs():
        assert (d["apiVersion"], d["kind"]) in KNOWN_KINDS, (d["apiVersion"], d["kind"])
    (kust,) = gateway_docs("kustomization.yaml")
    assert set(kust["resources"]) <= set(os.listdir(GATEWAY))


def test_inference_pool_validates_against_the_upstream_crd():
    jsonschema = pytest.importorskip("jsonschema")
    with open(CRD) as f:
        crd = yaml.safe_load(f)
    assert crd["spec"]["group"] == "inference.networking.k8s.io"
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    schema = version["schema"]["openAPIV3Schema"]
    pools = gateway_of_kind("InferencePool")
    assert pools
    for pool in pools.values():
        jsonschema.validate(pool, schema)  # raises with the failing path
    # a broken pool fails: the check can fail
    broken = {**pools["pagedjax"], "spec": {**pools["pagedjax"]["spec"], "targetPorts": []}}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, schema)


def test_pool_selects_the_serving_pods_on_their_http_port():
    pool = gateway_of_kind("InferencePool")["pagedjax"]
    selector = pool["spec"]["selector"]["matchLabels"]
    assert LLMD_LABEL in selector.items()
    (port,) = [p["number"] for p in pool["spec"]["targetPorts"]]
    served = [
        name
        for name, template, _ in server_containers()
        if selector.items() <= template["metadata"].get("labels", {}).items()
    ]
    assert "pagedjax" in served and "pagedjax-multihost" in served
    kserve = set(gateway_of_kind("LLMInferenceService"))  # KServe makes its own pool
    for name, template, c in server_containers():
        labels = template["metadata"].get("labels", {})
        sidecar = any(x["name"] == "routing-proxy" for x in template["spec"]["containers"])
        if name in kserve or sidecar:  # the P/D decode pod: the sidecar has the port
            continue
        if not selector.items() <= labels.items():
            assert "--http_port=8000" not in c["args"], f"{name}: serves but is not in the pool"
            continue
        assert f"--http_port={port}" in c["args"], name
        assert any(p["containerPort"] == port for p in c["ports"]), name
    epp = gateway_of_kind("Service")[pool["spec"]["endpointPickerRef"]["name"]]
    assert pool["spec"]["endpointPickerRef"]["port"]["number"] in {
        p["port"] for p in epp["spec"]["ports"]
    }


def test_servers_probe_health_and_ready_and_request_an_accelerator():
    variants = {}
    for name, _, c in server_containers():
        res = c["resources"]
        accel = {k for k in res["limits"] if k in ("nvidia.com/gpu", "google.com/tpu")}
        assert len(accel) == 1, name
        (kind,) = accel
        assert res["requests"][kind] == res["limits"][kind], name
        variants.setdefault(kind, []).append(name)
        if "--http_port=8000" not in c["args"]:
            continue  # an LWS worker: serves nothing, follows the leader
        assert c["readinessProbe"]["httpGet"]["path"] == "/ready", name
        assert c["livenessProbe"]["httpGet"]["path"] == "/health", name
        if "startupProbe" in c:
            assert c["startupProbe"]["httpGet"]["path"] == "/health", name
    assert "pagedjax" in variants["nvidia.com/gpu"]
    assert {"pagedjax-tpu", "pagedjax-multihost"} <= set(variants["google.com/tpu"])


def test_epp_reads_the_metric_names_the_server_exposes():
    from serving.gateway.metrics_compat import ALIASES

    exposed = set(ALIASES) | {"vllm:cache_config_info", "vllm:lora_requests_info"}
    (epp,) = [d for d in gateway_docs("epp.yaml") if d["kind"] == "Deployment"]
    (c,) = epp["spec"]["template"]["spec"]["containers"]
    metric_flags = {
        a.split("=", 1)[0]: a.split("=", 1)[1] for a in c["args"] if a.endswith(tuple(exposed))
    }
    assert set(metric_flags) == {
        "--total-queued-requests-metric",
        "--total-running-requests-metric",
        "--kv-cache-usage-percentage-metric",
        "--lora-info-metric",
        "--cache-info-metric",
    }
    (config,) = [d for d in gateway_docs("epp.yaml") if d["kind"] == "ConfigMap"]
    picker = yaml.safe_load(config["data"]["epp-config.yaml"])
    assert picker["kind"] == "EndpointPickerConfig"
    plugins = {p["type"]: p for p in picker["plugins"]}
    refs = {r["pluginRef"] for prof in picker["schedulingProfiles"] for r in prof["plugins"]}
    assert refs <= set(plugins)
    precise = plugins["precise-prefix-cache-scorer"]["parameters"]
    block = precise["indexerConfig"]["tokenProcessorConfig"]["blockSize"]
    (name, _, server) = next(s for s in server_containers() if s[0] == "pagedjax")
    assert f"--page_size={block}" in server["args"]
    # the pods' event PUB connects to the EPP's SUB, on the port its Service exposes
    (endpoint,) = [
        a.split("=", 1)[1] for a in server["args"] if a.startswith("--kv_events_endpoint")
    ]
    assert (
        endpoint == "tcp://pagedjax-epp:5557"
        and precise["kvEventsConfig"]["zmqEndpoint"] == "tcp://*:5557"
    )
    assert 5557 in {p["port"] for p in gateway_of_kind("Service")["pagedjax-epp"]["spec"]["ports"]}


def test_leaderworkerset_env_becomes_jax_distributed_arguments():
    from engine.parallel.distributed import config_from_env

    lws = gateway_of_kind("LeaderWorkerSet")["pagedjax-multihost"]
    size = lws["spec"]["leaderWorkerTemplate"]["size"]
    leader = lws["spec"]["leaderWorkerTemplate"]["leaderTemplate"]["spec"]["containers"][0]
    worker = lws["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0]
    (coordinator_port,) = [
        p["containerPort"] for p in leader["ports"] if p["name"] == "coordinator"
    ]
    chips = int(leader["resources"]["limits"]["google.com/tpu"])
    for index, c in [(0, leader)] + [(i, worker) for i in range(1, size)]:
        assert "--distributed_env=lws" in c["args"]
        assert f"--mesh=model:{size * chips}" in c["args"]  # every chip of the slice
        env = {e["name"]: e["value"] for e in c["env"]}
        # what LeaderWorkerSet adds to every pod of group 0
        env.update(
            LWS_LEADER_ADDRESS="pagedjax-multihost-0.pagedjax-multihost.default",
            LWS_GROUP_SIZE=str(size),
            LWS_WORKER_INDEX=str(index),
        )
        cfg = config_from_env("lws", env)
        assert cfg.coordinator_address == (
            f"pagedjax-multihost-0.pagedjax-multihost.default:{coordinator_port}"
        )
        assert (cfg.num_processes, cfg.process_id) == (size, index)


def test_prefill_decode_pairs_the_sidecar_with_the_decode_server():
    deployments = {
        name: d
        for name, d in gateway_of_kind("Deployment").items()
        if name.endswith(("fill", "code"))
    }
    pool = gateway_of_kind("InferencePool")["pagedjax"]
    (target,) = [p["number"] for p in pool["spec"]["targetPorts"]]
    for role in ("prefill", "decode"):
        pod = deployments[f"pagedjax-{role}"]["spec"]["template"]
        assert pod["metadata"]["labels"]["llm-d.ai/role"] == role
        assert pool["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
        containers = {c["name"]: c for c in pod["spec"]["containers"]}
        server = containers["server"]
        assert f"--role={role}" in server["args"]
        ports = {p["containerPort"] for c in containers.values() for p in c.get("ports", [])}
        assert target in ports, role  # the pool's port: the server (prefill), the sidecar (decode)
    prefill = deployments["pagedjax-prefill"]["spec"]["template"]["spec"]["containers"][0]
    assert 50051 in {p["containerPort"] for p in prefill["ports"]}  # decode pods pull here
    assert {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}} in prefill[
        "env"
    ]  # kv_transfer_params' remote_host
    decode = {
        c["name"]: c
        for c in deployments["pagedjax-decode"]["spec"]["template"]["spec"]["containers"]
    }
    sidecar = dict(a[2:].split("=", 1) for a in decode["routing-proxy"]["args"])
    assert int(sidecar["port"]) == target and sidecar["connector"] == "nixlv2"
    assert f"--http_port={sidecar['vllm-port']}" in decode["server"]["args"]
    (config,) = [d for d in gateway_docs("prefill-decode.yaml") if d["kind"] == "ConfigMap"]
    picker = yaml.safe_load(config["data"]["epp-config.yaml"])
    assert {p["name"] for p in picker["schedulingProfiles"]} == {"prefill", "decode"}
    assert "pd-profile-handler" in {p["type"] for p in picker["plugins"]}


def test_kserve_example_runs_our_server_on_the_model_kserve_mounts():
    (svc,) = gateway_of_kind("LLMInferenceService").values()
    (c,) = svc["spec"]["template"]["containers"]
    assert c["name"] == "main" and "--model=/mnt/models" in c["args"]
    assert svc["spec"]["model"]["uri"].startswith("hf://")
    assert set(svc["spec"]["router"]) == {"gateway", "route", "scheduler"}


@pytest.mark.subprocess
def test_every_flag_in_the_gateway_manifests_is_defined():
    code = (
        "import serving.server as m; m.define_flags(); "
        "from absl import flags; print('\\n'.join(flags.FLAGS))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    for name, _, c in server_containers():
        assert flag_names(c["args"]) <= set(out), (name, flag_names(c["args"]) - set(out))
