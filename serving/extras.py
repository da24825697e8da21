"""The benchmarks' optional dependencies (pyproject extras), checked up front so a missing one
is a clear error naming the extra to install, not an ImportError halfway through a run."""

from __future__ import annotations

import importlib.util


def require(extra: str, *modules: str) -> None:
    """Raises ModuleNotFoundError naming `extra` if any of `modules` is not installed."""
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        raise ModuleNotFoundError(
            f"{', '.join(missing)} not installed: this needs the `{extra}` extra "
            f"(pip install -e '.[{extra}]')",
            name=missing[0],
        )
