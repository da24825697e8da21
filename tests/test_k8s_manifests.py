"""deploy/k8s/ parses and hangs together: a Deployment per role whose server runs with that
role, readiness on gRPC health at the container's gRPC port, resources set, Services
selecting the pods they mean (headless for workers), the router pointed at the worker
Services' DNS names, every file listed by the kustomization, and every flag a manifest
passes defined by the program it runs."""

import os
import subprocess
import sys

import pytest

yaml = pytest.importorskip("yaml")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
K8S = os.path.join(ROOT, "deploy", "k8s")


def load(name: str) -> list[dict]:
    with open(os.path.join(K8S, name)) as f:
        return [d for d in yaml.safe_load_all(f) if d]


def docs() -> list[dict]:
    return [
        d for name in sorted(os.listdir(K8S)) if name != "kustomization.yaml" for d in load(name)
    ]


def of_kind(kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs() if d["kind"] == kind}


def container(deployment: dict) -> dict:
    (c,) = deployment["spec"]["template"]["spec"]["containers"]
    return c


def flag_names(args: list[str]) -> set[str]:
    return {a[2:].split("=")[0] for a in args if a.startswith("--")}


def test_kustomization_lists_every_manifest():
    (kust,) = load("kustomization.yaml")
    files = {n for n in os.listdir(K8S) if n.endswith(".yaml") and n != "kustomization.yaml"}
    assert set(kust["resources"]) == files


def test_a_deployment_per_role_with_grpc_readiness_and_resources():
    deployments = of_kind("Deployment")
    for role in ("prefill", "decode"):
        d = deployments[f"pagedjax-{role}"]
        labels = d["spec"]["template"]["metadata"]["labels"]
        assert d["spec"]["selector"]["matchLabels"].items() <= labels.items()
        c = container(d)
        assert c["command"][-1] == "serving.server" and f"--role={role}" in c["args"]
        grpc_port = next(p["containerPort"] for p in c["ports"] if p["name"] == "grpc")
        assert f"--port={grpc_port}" in c["args"]
        for probe in ("readinessProbe", "startupProbe"):
            assert c[probe]["grpc"]["port"] == grpc_port, probe
        res = c["resources"]
        assert res["requests"]["cpu"] and res["limits"]["memory"] == res["requests"]["memory"]
        assert res["limits"]["nvidia.com/gpu"] == "1"
    router = container(deployments["pagedjax-router"])
    assert router["command"][-1] == "serving.router.server"
    assert router["readinessProbe"]["grpc"]["port"] == 50051
    # the router's HTTP front tokenizes with the workers' model (serving/router/http_front.py)
    models = {
        a.split("=", 1)[1]
        for name in ("pagedjax-prefill", "pagedjax-decode")
        for a in container(deployments[name])["args"]
        if a.startswith("--model=")
    }
    assert [a.split("=", 1)[1] for a in router["args"] if a.startswith("--tokenizer=")] == [*models]


def test_services_select_their_pods_and_the_router_finds_the_workers():
    deployments, services = of_kind("Deployment"), of_kind("Service")
    for name, svc in services.items():
        target = deployments[name if name != "pagedjax" else "pagedjax-router"]
        labels = target["spec"]["template"]["metadata"]["labels"]
        assert svc["spec"]["selector"].items() <= labels.items(), name
        ports = {p["name"] for p in container(target)["ports"]}
        assert {p["targetPort"] for p in svc["spec"]["ports"]} <= ports, name
    router_args = container(deployments["pagedjax-router"])["args"]
    (workers,) = [a.split("=", 1)[1] for a in router_args if a.startswith("--workers=")]
    for entry in workers.split(","):
        kind, name, port = entry.split(":")
        assert kind == "dns" and services[name]["spec"]["clusterIP"] == "None"
        assert int(port) in {p["port"] for p in services[name]["spec"]["ports"]}


@pytest.mark.subprocess
def test_every_flag_in_the_manifests_is_defined():
    deployments = of_kind("Deployment")
    for module, names in (
        ("serving.server", ("pagedjax-prefill", "pagedjax-decode")),
        ("serving.router.server", ("pagedjax-router",)),
    ):
        code = (
            f"import {module} as m; m.define_flags(); "
            "from absl import flags; print('\\n'.join(flags.FLAGS))"
        )
        out = subprocess.run(
            [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.split()
        for name in names:
            assert flag_names(container(deployments[name])["args"]) <= set(out), name
