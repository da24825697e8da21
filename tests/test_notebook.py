"""Executes examples/quickstart.ipynb (on the tiny model, to keep CI fast) and checks what each
section of the tour printed, so the notebook interface cannot silently break."""

import os
import re

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

pytestmark = pytest.mark.subprocess  # a Jupyter kernel process

NOTEBOOK = os.path.join(os.path.dirname(__file__), "..", "examples", "quickstart.ipynb")


def test_quickstart_notebook_runs(monkeypatch):
    monkeypatch.setenv("PAGEDJAX_EXAMPLE_MODEL", "tiny")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    assert "JAX_PLATFORMS" not in "".join(c.source for c in nb.cells)  # no forced CPU
    prose = [c for c in nb.cells if c.cell_type == "markdown"]
    assert len(prose) >= 8  # a tour: prose between the code cells
    nbclient.NotebookClient(
        nb,
        timeout=600,
        kernel_name="python3",
        resources={"metadata": {"path": os.path.dirname(NOTEBOOK)}},
    ).execute()
    text = "".join(
        o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
    )
    assert "JAX backend:" in text
    assert "What is the capital of France? ->" in text
    assert text.count(" length ttft=") + text.count(" stop ttft=") == 3
    assert "same samples with the same seed: True" in text
    assert text.count("logprob ") == 4 and "cumulative logprob:" in text
    assert "stopped at" in text and "keeping the stop string:" in text
    assert "requests still running after the break: 0" in text
    cached = int(re.search(r"cached prompt tokens on the second request: (\d+)", text).group(1))
    assert cached > 0
    assert "turns: 5" in text
    assert "weights_bytes" in "".join(
        str(o.get("data", "")) for c in nb.cells for o in c.get("outputs", [])
    )
