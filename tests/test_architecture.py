"""The architecture, checked on the source: what a new maintainer relies on.

- The built-in adapters import from bridge only `bridge.adapter_api` (and
  `bridge`): that API is what they are proven against.
- The library packages under `bridge.adapters` import one another without a
  circle, at module level or inside functions.
- Every error bridge raises is a `bridge.BridgeError` (and still the built-in
  type it always was): no bare built-in exception is raised.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

import bridge

ROOT = pathlib.Path(__file__).resolve().parent.parent
ADAPTERS = ROOT / "adapters"
CORE = ROOT / "bridge"
SOURCES = sorted([*CORE.glob("*.py"), *ADAPTERS.rglob("*.py")])


def _imports(path: pathlib.Path) -> list[tuple[str, int]]:
    """Every imported module of `path` (module level and inside functions),
    absolute, with its line: relative imports resolved against the package
    `bridge.adapters` installs as."""
    if path.is_relative_to(CORE):
        package = ["bridge"]
    else:
        package = ["bridge", "adapters", *path.relative_to(ADAPTERS).parts[:-1]]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join([*base, node.module] if node.module else base)
            if node.module is None or not node.level:
                found += [
                    (f"{module}.{alias.name}", node.lineno) for alias in node.names
                ]
            found.append((module, node.lineno))
    return found


@pytest.mark.parametrize(
    "path", sorted(ADAPTERS.rglob("*.py")), ids=lambda p: str(p.relative_to(ROOT))
)
def test_adapters_import_only_the_adapter_api_from_bridge(path):
    private = [
        f"{path.relative_to(ROOT)}:{line}: {module}"
        for module, line in _imports(path)
        if module.startswith("bridge.")
        and not module.startswith(("bridge.adapter_api", "bridge.adapters"))
    ]
    assert not private, "import bridge.adapter_api instead:\n" + "\n".join(private)


def test_library_packages_import_each_other_without_a_circle():
    packages = sorted(
        p.name for p in ADAPTERS.iterdir() if (p / "__init__.py").exists()
    )
    edges = {package: set() for package in packages}
    for package in packages:
        for path in (ADAPTERS / package).rglob("*.py"):
            for module, _ in _imports(path):
                parts = module.split(".")
                if parts[:2] == ["bridge", "adapters"] and len(parts) > 2:
                    if parts[2] in edges and parts[2] != package:
                        edges[package].add(parts[2])

    def circle_from(start, path):
        for successor in sorted(edges[path[-1]]):
            if successor == start:
                return [*path, start]
            if successor not in path:
                found = circle_from(start, [*path, successor])
                if found:
                    return found
        return None

    for package in packages:
        circle = circle_from(package, [package])
        assert circle is None, " -> ".join(circle)


_BUILT_IN_ERRORS = {
    name
    for name, value in vars(__import__("builtins")).items()
    if isinstance(value, type) and issubclass(value, Exception)
}

#: Raised for Python's own protocols, not as bridge's refusals: a module's
#: `__getattr__` and a pytree node's missing attribute must raise exactly
#: `AttributeError`.
_PROTOCOL_ERRORS = {"AttributeError"}


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_bridge_raises_only_its_own_error_types(path):
    bare = []
    for node in ast.walk(ast.parse(path.read_text())):
        raised = node.exc if isinstance(node, ast.Raise) else None
        if isinstance(node, ast.Return) and isinstance(node.value, ast.Call):
            raised = node.value  # a function building the error to raise
        if isinstance(raised, ast.Call) and isinstance(raised.func, ast.Name):
            name = raised.func.id
            if name in _BUILT_IN_ERRORS and name not in _PROTOCOL_ERRORS:
                bare.append(f"{path.relative_to(ROOT)}:{node.lineno}: {name}")
    assert not bare, "raise a bridge.adapter_api.Bridge*Error:\n" + "\n".join(bare)


def test_bridge_errors_are_also_the_built_in_types():
    from bridge import adapter_api

    for kind in (ValueError, TypeError, RuntimeError, NotImplementedError):
        error_type = getattr(adapter_api, f"Bridge{kind.__name__}")
        assert issubclass(error_type, bridge.BridgeError)
        assert issubclass(error_type, kind)
    with pytest.raises(bridge.BridgeError, match="cannot probe a model of type int"):
        bridge.probe(3)
    with pytest.raises(TypeError, match="cannot probe a model of type int"):
        bridge.probe(3)
