"""The package layers, checked on the source: configs <- models <- engine <- serving <-
benchmarks, no import cycle between modules (imports inside functions included: a
function-level import that closes a cycle is a layering fault hidden from the interpreter),
the rules between sub-packages (SUB_FORBIDDEN: the scheduler never imports JAX, the
transport-neutral frontend imports neither the gRPC nor the HTTP modules, ...), no module
importing another module's private name, and the mock engine importable without JAX."""

import ast
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("configs", "models", "engine", "serving", "pallas_kernels", "benchmarks")
# package -> packages it must never import (at module level or inside functions)
FORBIDDEN = {
    "configs": {"models", "engine", "serving", "benchmarks"},
    "models": {"engine", "serving", "benchmarks"},
    "pallas_kernels": {"engine", "serving", "benchmarks"},
    "engine": {"serving", "benchmarks"},
    "serving": {"benchmarks"},
}
# sub-package -> modules or packages (prefixes, third-party ones included) it must never import
# (relayout: package names: the dotted names below are packages, never old module paths)
SUB_FORBIDDEN = {
    # host side, plain Python: the mock engine runs it without JAX
    "engine.sched": {
        "jax",
        "jaxlib",
        "engine.core",
        "engine.runner",
        "engine.batch",
        "engine.spec",
        "engine.lora",
        "engine.parallel",
        "engine.kv_transfer",
    },
    # transport-neutral: gRPC and HTTP both call it
    "serving.frontend": {
        "serving.grpc_api",
        "serving.http",
        "serving.proto",
        "serving.engine_host",
        "serving.ray_serve",
        "serving.disagg",
        "serving.capacity",
        "serving.server",
        "fastapi",
        "starlette",
        "uvicorn",
    },
    "serving.engine_host": {
        "serving.frontend",
        "serving.grpc_api",
        "serving.http",
        "serving.ray_serve",
        "serving.disagg",
        "serving.server",
    },
    # a client of the server (it drives one over gRPC/HTTP), never the server itself
    "serving.capacity": {
        "engine",
        "jax",
        "serving.frontend",
        "serving.grpc_api",
        "serving.http",
        "serving.engine_host",
        "serving.ray_serve",
        "serving.disagg",
        "serving.server",
    },
    "serving.grpc_api": {"serving.http", "serving.ray_serve", "serving.disagg", "serving.server"},
    "serving.http": {
        "serving.grpc_api.service",
        "serving.ray_serve",
        "serving.disagg",
        "serving.server",
    },
}
# sub-package -> what its modules must not pull in through their module-level imports, however
# indirectly (function-level imports are lazy and left out)
NEVER_LOADS = {"engine.sched": {"jax", "jaxlib"}}


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, pathlib.Path]:
    return {
        _module_name(p): p
        for pkg in PACKAGES
        for p in (ROOT / pkg).rglob("*.py")
        if "proto" not in p.parts
    }


def _imports(path: pathlib.Path, modules=()) -> set[str]:
    """Absolute module names `path` imports anywhere in it. `from a import b` gives a.b when
    that is one of `modules` (a submodule), else a."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            subs = {f"{node.module}.{a.name}" for a in node.names}
            out |= subs & set(modules) or {node.module}
    return out


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_lower_layers_never_import_higher_ones(package):
    bad = []
    for name, path in _modules().items():
        if name.split(".")[0] != package:
            continue
        for imported in _imports(path):
            if imported.split(".")[0] in FORBIDDEN[package]:
                bad.append(f"{name} imports {imported}")
    assert not bad, bad


def _within(name: str, prefixes) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


@pytest.mark.parametrize("sub", sorted(SUB_FORBIDDEN))
def test_sub_package_rules(sub):
    modules = _modules()
    mine = {n: p for n, p in modules.items() if _within(n, [sub])}
    assert len(mine) > 2, sorted(mine)  # the rule sees the package
    bad = [
        f"{name} imports {imported}"
        for name, path in mine.items()
        for imported in _imports(path, modules)
        if _within(imported, SUB_FORBIDDEN[sub])
    ]
    assert not bad, bad


def _module_level_imports(path: pathlib.Path, modules) -> set[str]:
    """What importing `path` imports at once: statements outside functions (class bodies, try
    and if blocks included, `if TYPE_CHECKING:` left out), plus each name's parent packages."""
    out = set()

    def visit(stmts):
        for node in stmts:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                visit(node.orelse)
                continue
            if isinstance(node, ast.Import):
                out.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                subs = {f"{node.module}.{a.name}" for a in node.names}
                out.update(subs & set(modules) or {node.module})
            for field in ("body", "orelse", "finalbody", "handlers"):
                visit(getattr(node, field, []))

    visit(ast.parse(path.read_text(encoding="utf-8")).body)
    return out | {".".join(m.split(".")[:i]) for m in out for i in range(1, m.count(".") + 1)}


@pytest.mark.parametrize("sub", sorted(NEVER_LOADS))
def test_never_loads_through_module_level_imports(sub):
    modules = _modules()
    seen, todo, via = set(), [n for n in modules if _within(n, [sub])], {}
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        for imported in _module_level_imports(modules[name], modules):
            via.setdefault(imported, name)
            if imported in modules:
                todo.append(imported)
    loaded = {m for m in via if _within(m, NEVER_LOADS[sub])}
    assert not loaded, {m: via[m] for m in loaded}
    assert len(seen) > 5  # the walk follows real imports


def _private_uses(name: str, source: str, modules) -> list[str]:
    """`from x import _y` and `x._y` (x one of `modules`, bound by an import) in module `name`,
    for x other than `name` itself."""
    tree = ast.parse(source)
    bad, aliases = [], {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases.update({a.asname or a.name: a.name for a in node.names if a.name in modules})
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for a in node.names:
                if a.name.startswith("_") and not a.name.startswith("__"):
                    if node.module != name:
                        bad.append(f"{name}:{node.lineno} from {node.module} import {a.name}")
                elif f"{node.module}.{a.name}" in modules:
                    aliases[a.asname or a.name] = f"{node.module}.{a.name}"
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_"):
            if node.attr.startswith("__"):
                continue
            parts, value = [], node.value
            while isinstance(value, ast.Attribute):
                parts.append(value.attr)
                value = value.value
            if isinstance(value, ast.Name) and value.id in aliases:
                target = ".".join([aliases[value.id], *reversed(parts)])
                if target in modules and target != name:
                    bad.append(f"{name}:{node.lineno} {target}.{node.attr}")
    return bad


def test_private_use_check_finds_both_forms():
    modules = {"engine.core", "engine.runner.penalties", "engine.runner"}
    src = (
        "from engine.core import _x, public\n"
        "from engine.runner import penalties\n"
        "import engine.core as c\n"
        "penalties._reset(c._slot, public._ok)\n"
    )
    assert _private_uses("engine.llm", src, modules) == [
        "engine.llm:1 from engine.core import _x",
        "engine.llm:4 engine.runner.penalties._reset",
        "engine.llm:4 engine.core._slot",
    ]
    assert _private_uses("engine.core", "from engine.core import _x\n", modules) == []


def test_no_module_imports_another_modules_private_name():
    modules = _modules()
    modules.update({_module_name(p): p for p in (ROOT / "tests").glob("*.py")})
    bad = [
        use
        for name, path in sorted(modules.items())
        for use in _private_uses(name, path.read_text(encoding="utf-8"), modules)
    ]
    assert not bad, bad


@pytest.mark.parametrize("package", ["configs", "models", "engine", "serving", "benchmarks"])
def test_no_import_cycles(package):
    # Package __init__ files are left out: engine/__init__.py re-exports lazily (__getattr__).
    modules = {n: p for n, p in _modules().items() if p.name != "__init__.py"}
    graph = {
        name: {m for m in _imports(path, modules) if m in modules and m != name}
        for name, path in modules.items()
        if name.split(".")[0] == package
    }
    graph = {n: deps & set(graph) for n, deps in graph.items()}  # cycles lie inside a package
    state: dict[str, int] = {}  # 1 visiting, 2 done

    def visit(name, stack):
        state[name] = 1
        for dep in sorted(graph[name]):
            if state.get(dep) == 1:
                cycle = stack[stack.index(dep) :] + [dep]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if dep not in state:
                visit(dep, [*stack, dep])
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    # the check sees real edges (benchmarks are mostly independent scripts: fewer)
    assert sum(map(len, graph.values())) > len(graph) // (4 if package == "benchmarks" else 2)


@pytest.mark.subprocess
def test_mock_engine_and_host_step_import_without_jax():
    code = (
        "import sys, serving.engine_host.mock_engine, engine.sched.outputs, engine.interface,"
        " engine.sched.scheduler;"
        "bad = [m for m in sys.modules if m == 'jax' or m.startswith('jax.')];"
        "assert not bad, bad[:5]"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=120)
