"""Executes examples/quickstart.ipynb (on the tiny model, to keep CI fast) and checks its
outputs, so the notebook interface cannot silently break."""

import os

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

pytestmark = pytest.mark.subprocess  # a Jupyter kernel process

NOTEBOOK = os.path.join(os.path.dirname(__file__), "..", "examples", "quickstart.ipynb")


def test_quickstart_notebook_runs(monkeypatch):
    monkeypatch.setenv("PAGEDJAX_EXAMPLE_MODEL", "tiny")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbclient.NotebookClient(
        nb,
        timeout=600,
        kernel_name="python3",
        resources={"metadata": {"path": os.path.dirname(NOTEBOOK)}},
    ).execute()
    text = "".join(
        o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
    )
    assert "What is the capital of France? ->" in text
    assert text.count(" length ttft=") + text.count(" stop ttft=") == 3
    assert "weights_bytes" in "".join(
        str(o.get("data", "")) for c in nb.cells for o in c.get("outputs", [])
    )
