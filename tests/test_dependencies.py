"""Runtime code imports only runtime dependencies: every module of the runtime packages
imports in a fresh interpreter in which the extras' packages (bench, proto, test, ...: read
from pyproject.toml) cannot be imported. Catches a plotting or test library creeping into
the server's import graph, which CI (installing `.[test]`) would not notice otherwise."""

import os
import re
import subprocess
import sys
import tomllib

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNTIME_PACKAGES = ("configs", "engine", "models", "pallas_kernels", "serving")
# Distribution name -> import name where they differ; flax: no longer a dependency at all.
IMPORT_NAMES = {"grpcio-tools": "grpc_tools"}
# Shipped tools that need an extra and say so (serving.extras.require, their docstrings): the
# load generator (`bench`: httpx, matplotlib, tqdm) and the Ray Serve application (`ray`).
# A name here skips that module and everything below it.
EXTRA_MODULES = ("serving.capacity.loadgen", "serving.ray_serve")

SCRIPT = r"""
import importlib, importlib.abc, pkgutil, sys
blocked = set(sys.argv[1].split(","))
skipped = set(sys.argv[3].split(","))

class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in blocked:
            raise ModuleNotFoundError(f"{name} is an extra, not a runtime dependency", name=name)

sys.meta_path.insert(0, Block())
for pkg in sys.argv[2].split(","):
    importlib.import_module(pkg)
    for info in pkgutil.walk_packages(sys.modules[pkg].__path__, pkg + "."):
        if any(info.name == m or info.name.startswith(m + ".") for m in skipped):
            continue
        importlib.import_module(info.name)
        print("ok", info.name)
"""


def extras_import_names() -> set[str]:
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    runtime = {re.match(r"[\w.-]+", r).group(0) for r in project["dependencies"]}
    names = {"flax"}
    for reqs in project["optional-dependencies"].values():
        for req in reqs:
            dist = re.match(r"[\w.-]+", req).group(0)
            if dist != project["name"] and dist not in runtime:
                names.add(IMPORT_NAMES.get(dist, dist.replace("-", "_")))
    return names


def test_extras_are_what_we_think():
    assert {"matplotlib", "tqdm", "grpc_tools", "chex", "torch", "transformers"} <= (
        extras_import_names()
    )


@pytest.mark.subprocess
def test_runtime_packages_import_without_any_extra():
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            SCRIPT,
            ",".join(sorted(extras_import_names())),
            ",".join(RUNTIME_PACKAGES),
            ",".join(EXTRA_MODULES),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        env=dict(os.environ, JAX_PLATFORMS="cpu"),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    imported = proc.stdout.split()
    assert "serving.server" in imported and "engine.core" in imported
    assert "pallas_kernels.tpu_kernels" in imported and "models.loaders.gguf_loader" in imported
