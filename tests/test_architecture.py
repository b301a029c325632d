"""The architecture, checked on the source: what a new maintainer relies on.

- The built-in adapters import from bridge only `bridge.adapter_api` (and
  `bridge`): that API is what they are proven against.
- No import circle among bridge's modules, within a package or across
  packages, core and adapters alike: every `import` statement counts, module
  level or inside a function (not those under `if TYPE_CHECKING:`, which never
  run). The library packages under `bridge.adapters` also import one another
  without a circle, as packages.
- The model libraries' private names (`jax._src`, `module._forward_hooks`,
  `haiku._src.lift`) are used only in the files that say they do: each
  adapter's `internals.py`, `adapters/shared/jax_internals.py`, and two files
  of the core (`CORE_INTERNALS`). A JAX or library release that moves one
  then breaks those files alone, and they say what to check.
- Every error bridge raises is a `bridge.BridgeError` (and still the built-in
  type it always was): no bare built-in exception is raised.

Each check reads every `.py` under `bridge/` and `adapters/` with `ast`; the
readers themselves are tested on small synthetic sources and graphs, so that
a check cannot pass by reading nothing.
"""

from __future__ import annotations

import ast
import collections
import functools
import itertools
import pathlib
import re
import textwrap
from typing import NamedTuple

import pytest

import bridge

ROOT = pathlib.Path(__file__).resolve().parent.parent
ADAPTERS = ROOT / "adapters"
CORE = ROOT / "bridge"
SOURCES = sorted([*CORE.rglob("*.py"), *ADAPTERS.rglob("*.py")])


def _module_name(path: pathlib.Path) -> str:
    """The name `path` imports as (`adapters/` installs as `bridge.adapters`)."""
    if path.is_relative_to(CORE):
        parts = ["bridge", *path.relative_to(CORE).with_suffix("").parts]
    else:
        parts = [
            "bridge",
            "adapters",
            *path.relative_to(ADAPTERS).with_suffix("").parts,
        ]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


#: Every module of bridge, by the name it imports as.
MODULES = {_module_name(path): path for path in SOURCES}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _statements(
    source: str, module: str, is_package: bool
) -> list[tuple[str, tuple[str, ...], int, bool]]:
    """Every import statement of `source`, module `module`, at any depth:
    `(module imported or imported from, names imported from it, line, whether
    it runs)`, relative imports resolved. Those under `if TYPE_CHECKING:` do
    not run."""
    package = module if is_package else module.rpartition(".")[0]
    tree = ast.parse(source)
    typing_only = {
        id(node)
        for branch in ast.walk(tree)
        if isinstance(branch, ast.If) and _is_type_checking(branch.test)
        for statement in branch.body
        for node in ast.walk(statement)
    }
    found = []
    for node in ast.walk(tree):
        runs = id(node) not in typing_only
        if isinstance(node, ast.Import):
            found += [(alias.name, (), node.lineno, runs) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = parts[: len(parts) - node.level + 1]
                imported = ".".join([*base, node.module] if node.module else base)
            else:
                imported = node.module
            names = tuple(alias.name for alias in node.names)
            found.append((imported, names, node.lineno, runs))
    return found


def _statements_of(path: pathlib.Path):
    return _statements(path.read_text(), _module_name(path), path.name == "__init__.py")


def _imports(path: pathlib.Path) -> list[tuple[str, int]]:
    """Every imported module of `path` (module level and inside functions),
    absolute, with its line: `from m import n` gives `m` and `m.n`."""
    found = []
    for module, names, line, _ in _statements_of(path):
        found.append((module, line))
        found += [(f"{module}.{name}", line) for name in names]
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


# The module graph ------------------------------------------------------------


def _graph_edges(module: str, statements, modules) -> dict[str, int]:
    """The modules of `modules` that `module`'s running import statements
    execute, each with the line of the first statement that does.

    `from m import n` imports the module `m.n` where there is one, else `m`
    (whose body defines `n`); `import m.n` imports `m.n`. Importing a module
    first runs its packages' `__init__`s, except those `module` lies in,
    which are already running when it does."""
    parts = module.split(".")
    running = {".".join(parts[:i]) for i in range(1, len(parts) + 1)}
    edges: dict[str, int] = {}
    for imported, names, line, runs in statements:
        if not runs:
            continue
        targets = [
            f"{imported}.{name}" if f"{imported}.{name}" in modules else imported
            for name in names
        ] or [imported]
        for target in targets:
            if target not in modules or target == module:
                continue
            edges.setdefault(target, line)
            target_parts = target.split(".")
            for i in range(1, len(target_parts)):
                package = ".".join(target_parts[:i])
                if package in modules and package not in running:
                    edges.setdefault(package, line)
    return edges


def _unresolved(statements, modules) -> list[tuple[str, int]]:
    """Runtime imports of a `bridge.` module that is not in `modules`."""
    return [
        (imported, line)
        for imported, _, line, runs in statements
        if runs
        and (imported == "bridge" or imported.startswith("bridge."))
        and imported not in modules
    ]


def _module_graph() -> dict[str, dict[str, int]]:
    return {
        module: _graph_edges(module, _statements_of(path), MODULES)
        for module, path in MODULES.items()
    }


def _circles(graph: dict[str, dict[str, int] | set[str]]) -> list[list[str]]:
    """One shortest circle `[a, b, ..., a]` through each strongly connected
    component of `graph` that has one (Tarjan's algorithm, without recursion),
    sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, successors = work[-1]
            for successor in successors:
                if successor not in graph:
                    continue
                if successor not in index:
                    index[successor] = low[successor] = len(index)
                    stack.append(successor)
                    on_stack.add(successor)
                    work.append((successor, iter(sorted(graph[successor]))))
                    break
                if successor in on_stack:
                    low[node] = min(low[node], index[successor])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    component = set()
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.add(member)
                        if member == node:
                            break
                    components.append(component)
    circles = []
    for component in components:
        start = min(component)
        if len(component) == 1 and start not in graph[start]:
            continue
        # Breadth first from `start`, within the component, back to `start`.
        previous: dict[str, str] = {}
        queue = collections.deque([start])
        while queue:
            node = queue.popleft()
            if start in graph[node]:
                circle = [start]
                while node != start:
                    circle.append(node)
                    node = previous[node]
                circles.append([start, *reversed(circle[1:]), start])
                break
            for successor in sorted(graph[node]):
                if successor in component and successor not in previous:
                    previous[successor] = node
                    queue.append(successor)
    return sorted(circles)


def test_the_circle_finder_finds_each_circle_and_nothing_else():
    assert _circles({}) == []
    assert _circles({"a": {"b"}, "b": {"c"}, "c": set(), "d": {"b", "c"}}) == []
    assert _circles({"a": {"a"}}) == [["a", "a"]]
    graph = {
        "a": {"b"},
        "b": {"c", "x"},
        "c": {"a", "d"},
        "d": {"e"},
        "e": {"d", "f"},
        "f": set(),
        "x": {"y"},
        "y": {"b"},
        "z": {"a", "outside"},
    }
    assert _circles(graph) == [["a", "b", "c", "a"], ["d", "e", "d"]]
    # The shortest circle through the component's first module.
    assert _circles({"a": {"b", "c"}, "b": {"c"}, "c": {"a"}}) == [["a", "c", "a"]]
    # Deep chains: no recursion limit.
    chain = {str(i).zfill(5): {str(i + 1).zfill(5)} for i in range(5000)}
    chain["05000"] = {"00000"}
    assert len(_circles(chain)[0]) == 5002


def test_the_import_reader_sees_every_import_that_runs():
    source = textwrap.dedent(
        """
        from typing import TYPE_CHECKING
        import bridge.adapters.nnx.run
        from bridge.adapter_api import ProbeBase
        from . import internals
        from .variables import PATH_ATTRIBUTE
        from ..shared import guests

        if TYPE_CHECKING:
            from .porting import Layer

        def late():
            from .guest import call_to_linen

            class Inner:
                def method(self):
                    import bridge.adapters.nnx.carried
        """
    )
    modules = {
        f"bridge.{name}" if name else "bridge"
        for name in (
            "",
            "adapter_api",
            "adapters",
            "adapters.shared",
            "adapters.shared.guests",
            "adapters.nnx",
            *(
                f"adapters.nnx.{name}"
                for name in (
                    "probe run internals variables guest carried porting".split()
                )
            ),
        )
    }
    statements = _statements(source, "bridge.adapters.nnx.probe", is_package=False)
    edges = _graph_edges("bridge.adapters.nnx.probe", statements, modules)
    assert edges == {
        "bridge.adapters.nnx.run": 3,
        "bridge.adapter_api": 4,
        "bridge.adapters.nnx.internals": 5,
        "bridge.adapters.nnx.variables": 6,
        "bridge.adapters.shared": 7,  # its __init__ runs first
        "bridge.adapters.shared.guests": 7,
        "bridge.adapters.nnx.guest": 13,  # inside a function
        "bridge.adapters.nnx.carried": 17,  # inside a method of a local class
    }
    # A package's `from . import x` is relative to the package itself.
    statements = _statements("from . import run\n", "bridge.adapters.nnx", True)
    assert _graph_edges("bridge.adapters.nnx", statements, modules) == {
        "bridge.adapters.nnx.run": 1
    }
    # `from bridge import name` runs bridge's `__init__`: an edge to it.
    statements = _statements("from bridge import probe\n", "bridge.adapter_api", False)
    assert _graph_edges("bridge.adapter_api", statements, modules) == {"bridge": 1}
    assert _unresolved(
        _statements("from .missing import x\n", "bridge.adapters.nnx.run", False),
        modules,
    ) == [("bridge.adapters.nnx.missing", 1)]


def test_the_module_graph_covers_the_source():
    """The graph the next test checks is the whole of bridge: a reader that
    missed modules or imports would find no circle in nothing."""
    graph = _module_graph()
    assert len(MODULES) >= 60, sorted(MODULES)
    assert {"bridge", "bridge.adapter_api", "bridge.adapters.nnx.probe"} <= set(graph)
    assert sum(len(edges) for edges in graph.values()) >= 200
    assert "bridge._probe.registry" in graph["bridge"]
    for package in ("linen", "nnx", "equinox", "haiku", "torch"):
        assert "bridge.adapter_api" in graph[f"bridge.adapters.{package}.probe"]
    unresolved = [
        f"{path.relative_to(ROOT)}:{line}: {imported}"
        for module, path in MODULES.items()
        for imported, line in _unresolved(_statements_of(path), MODULES)
    ]
    assert not unresolved, "imports of no module of bridge:\n" + "\n".join(unresolved)


def test_no_import_circle_among_bridge_modules():
    """Within each package of `bridge/` and `adapters/` and across them,
    function-level imports included. A circle that works today works by the
    order its modules happen to be imported in."""
    graph = _module_graph()
    circles = _circles(graph)
    described = [
        " -> ".join(circle)
        + "\n"
        + "\n".join(
            f"    {MODULES[a].relative_to(ROOT)}:{graph[a][b]} imports {b}"
            for a, b in itertools.pairwise(circle)
        )
        for circle in circles
    ]
    assert not circles, "import circles:\n" + "\n".join(described)


# The model libraries' private names ------------------------------------------

#: The libraries whose private names (a `_`-prefixed module, attribute or
#: class, dunders aside) only the files below may use.
LIBRARIES = ("jax", "jaxlib", "flax", "equinox", "haiku", "torch", "transformers")

#: The core's files that use JAX's internals, each for one purpose.
CORE_INTERNALS = {
    # JAX's dead-code elimination of a jaxpr, which sees into `jit` and
    # `scan` (`jax._src.interpreters.partial_eval.dce_jaxpr`), with a
    # public-API fallback.
    CORE / "_session" / "liveness.py",
    # JAX's transpose of a while loop, zeros in the pullback that records
    # sites in branches and loops (`jax._src.interpreters.ad`,
    # `jax._src.lax.control_flow.loops.while_p`).
    CORE / "_session" / "recording_pullback.py",
    # JAX's source locations and name stacks, kept when the computation
    # binds a model's equation again (`jax._src.source_info_util`), as
    # `jax.core.eval_jaxpr` keeps them; and the equations' context, from which
    # a kept discovery's XLA metadata is taken off (`Replay`).
    CORE / "_session" / "computation.py",
}
INTERNALS = {
    *ADAPTERS.glob("*/internals.py"),
    ADAPTERS / "shared" / "jax_internals.py",
    *CORE_INTERNALS,
}

#: `_`-names that are public API (namedtuple's methods), and Python's own
#: private names bridge uses (no model library's).
_PUBLIC_UNDERSCORE = {"_replace", "_fields", "_asdict", "_make", "_field_defaults"}
_PYTHON_PRIVATE = {"sys._getframe"}

_LIBRARY_PATH = re.compile(rf"(?:{'|'.join(LIBRARIES)})(?:\.\w+)+\.?")


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


class _Own(NamedTuple):
    """The `_`-names bridge itself defines."""

    #: Of its objects: methods, class attributes, `self.`/`cls.` attributes,
    #: `__slots__`, string keys set in a mapping (a class namespace) or read
    #: from `self.__dict__`.
    members: set[str]
    #: Of its modules: functions, classes, assignments, imports `as _x`.
    globals: set[str]


def _own_private_names(sources: list[str]) -> _Own:
    """What bridge's own `_`-names are: an access to another, a library's.

    (A library's private attribute that bridge also defines as a member
    passes unseen: a limit of reading the source without types.)"""
    members, globals_ = set(), set()

    def assigned(statement):
        targets = []
        if isinstance(statement, ast.Assign):
            targets = statement.targets
        elif isinstance(statement, (ast.AnnAssign, ast.AugAssign)):
            targets = [statement.target]
        for target in targets:
            yield from (n.id for n in ast.walk(target) if isinstance(n, ast.Name))
            if isinstance(target, ast.Name) and target.id == "__slots__":
                yield from (
                    node.value
                    for node in ast.walk(statement.value)
                    if isinstance(node, ast.Constant) and isinstance(node.value, str)
                )

    for source in sources:
        tree = ast.parse(source)
        for statement in tree.body:
            # Module level, also under a version or import check.
            for node in [statement, *ast.walk(statement)]:
                if isinstance(statement, (ast.If, ast.Try)) or node is statement:
                    globals_.update(assigned(node))
                    if isinstance(node, _DEFINITIONS):
                        globals_.add(node.name)
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                for statement in node.body:
                    members.update(assigned(statement))
                    if isinstance(statement, _DEFINITIONS):
                        members.add(statement.name)
            elif isinstance(node, ast.alias) and node.asname:
                globals_.add(node.asname)
            elif (
                isinstance(node, ast.Attribute)
                and isinstance(node.ctx, ast.Store)
                and isinstance(node.value, ast.Name)
                and node.value.id in ("self", "cls")
            ):
                members.add(node.attr)
            elif (
                isinstance(node, ast.Subscript)
                and isinstance(node.ctx, ast.Store)
                and isinstance(node.slice, ast.Constant)
                and isinstance(node.slice.value, str)
            ):
                members.add(node.slice.value)
            elif (  # self.__dict__.get("_x"): set on a new instance
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and ast.unparse(node.func.value) in ("self.__dict__", "vars(self)")
                and node.args
                and isinstance(node.args[0], ast.Constant)
                and isinstance(node.args[0].value, str)
            ):
                members.add(node.args[0].value)
    return _Own(
        {n for n in members if _private(n)}, {n for n in globals_ if _private(n)}
    )


_DEFINITIONS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


def _bridge_module_names(tree: ast.Module) -> set[str]:
    """The names a module binds to bridge's modules by importing them."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (
            node.level or (node.module or "").split(".")[0] == "bridge"
        ):
            names.update(alias.asname or alias.name for alias in node.names)
        elif isinstance(node, ast.Import):
            names.update(
                alias.asname or alias.name.split(".")[0]
                for alias in node.names
                if alias.name.split(".")[0] == "bridge"
            )
    return names


def _private_uses(source: str, own: _Own) -> list[tuple[int, str]]:
    """Each use in `source` of a model library's private name, with its
    line: an import of one (`jax._src`, `from torch.nn.modules.conv import
    _ConvNd`), an attribute bridge does not define (`module._forward_hooks`,
    read, written or through `getattr(module, "_forward_hooks")`), or a
    string naming one (`importlib.import_module("haiku._src.lift")`)."""
    tree = ast.parse(source)
    docstrings = {
        id(node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
    }
    bridge_modules = _bridge_module_names(tree)

    def foreign(attribute: str, owner: ast.expr) -> bool:
        """Whether `owner.attribute` is a library's private name."""
        of_bridge_module = isinstance(owner, ast.Name) and owner.id in bridge_modules
        return (
            _private(attribute)
            and attribute not in own.members
            and not (of_bridge_module and attribute in own.globals)
            and attribute not in _PUBLIC_UNDERSCORE
            and f"{ast.unparse(owner)}.{attribute}" not in _PYTHON_PRIVATE
        )

    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [
                (node.lineno, f"import {alias.name}")
                for alias in node.names
                if alias.name.split(".")[0] in LIBRARIES
                and any(map(_private, alias.name.split(".")))
            ]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            if node.module.split(".")[0] in LIBRARIES:
                if any(map(_private, node.module.split("."))):
                    found.append((node.lineno, f"from {node.module} import ..."))
                else:
                    found += [
                        (node.lineno, f"from {node.module} import {alias.name}")
                        for alias in node.names
                        if _private(alias.name)
                    ]
        elif isinstance(node, ast.Attribute) and foreign(node.attr, node.value):
            found.append((node.lineno, f"{ast.unparse(node.value)}.{node.attr}"))
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr", "setattr", "delattr")
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
            and foreign(node.args[1].value, node.args[0])
        ):
            found.append((node.lineno, f'{node.func.id}(..., "{node.args[1].value}")'))
        elif (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and id(node) not in docstrings
            and _LIBRARY_PATH.fullmatch(_as_dotted(node.value))
            and any(map(_private, _as_dotted(node.value).split(".")))
        ):
            found.append((node.lineno, repr(node.value)))
        elif isinstance(node, ast.Call) and _joined_library_path(node.args):
            # A path spelled in pieces: `os.path.join("equinox", "_ad.py")`.
            found.append((node.lineno, ast.unparse(node)))
    return sorted(found)


def _as_dotted(text: str) -> str:
    """`equinox/internal/_loop/common.py` as `equinox.internal._loop.common`."""
    return text.removesuffix(".py").replace("/", ".").replace("\\", ".")


def _joined_library_path(arguments: list[ast.expr]) -> bool:
    """Whether string constants given as a call's arguments join into a
    library's private module path."""
    pieces = [
        argument.value
        for argument in arguments
        if isinstance(argument, ast.Constant) and isinstance(argument.value, str)
    ]
    if len(pieces) < 2 or len(pieces) != len(arguments):
        return False
    dotted = _as_dotted("/".join(pieces))
    return bool(_LIBRARY_PATH.fullmatch(dotted)) and any(
        map(_private, dotted.split("."))
    )


def test_the_private_name_reader_finds_each_kind_of_use():
    own = _own_private_names(
        [
            textwrap.dedent(
                """
                import numpy as _np
                _CACHE = {}
                if True:
                    _FALLBACK = None
                def _helper():
                    _local = 1
                class A:
                    __slots__ = ("_slot",)
                    _flag = 1
                    def __init__(self):
                        self._mine = 1
                    def _method(self):
                        pass
                    def get(self):
                        return self.__dict__.get("_cached")
                namespace = {}
                namespace["_marker"] = True
                """
            )
        ]
    )
    assert own == _Own(
        members={"_slot", "_flag", "_mine", "_method", "_cached", "_marker"},
        globals={"_np", "_CACHE", "_FALLBACK", "_helper"},
    )
    source = textwrap.dedent(
        """
        import jax._src.core
        from jax._src import pjit
        from torch.nn.modules.conv import _ConvNd, Conv1d
        from flax import nnx
        import importlib, sys
        module._qkv_same_embed_dim
        module._forward_hooks = {}
        getattr(module, "_non_persistent_buffers_set")
        importlib.import_module("haiku._src.lift")
        pjit._infer_params = wrapper
        klass.__module__.startswith("equinox._module")
        module._helper  # bridge's name, but `module` is no module of bridge
        os.path.join("equinox", "internal", "_loop", "common.py")
        frame.f_code.co_filename.endswith("equinox/_ad.py")
        # Not uses: bridge's own names, public ones, Python's frames, prose.
        from . import porting
        import bridge.adapters.shared as shared
        porting._helper()
        shared._CACHE
        self._mine
        other._method()
        result._replace(x=1)
        sys._getframe(1)
        getattr(module, "_marker", False)
        hasattr(value, "_fields")
        "jax._src.pjit"  # a bare string: prose, like a docstring
        nnx.Module.__init__
        """
    )
    assert _private_uses(source, own) == [
        (2, "import jax._src.core"),
        (3, "from jax._src import ..."),
        (4, "from torch.nn.modules.conv import _ConvNd"),
        (7, "module._qkv_same_embed_dim"),
        (8, "module._forward_hooks"),
        (9, 'getattr(..., "_non_persistent_buffers_set")'),
        (10, "'haiku._src.lift'"),
        (11, "pjit._infer_params"),
        (12, "'equinox._module'"),
        (13, "module._helper"),
        (14, "os.path.join('equinox', 'internal', '_loop', 'common.py')"),
        (15, "'equinox/_ad.py'"),
    ]


@functools.cache
def _uses_by_file() -> dict[pathlib.Path, list[tuple[int, str]]]:
    own = _own_private_names([path.read_text() for path in SOURCES])
    return {path: _private_uses(path.read_text(), own) for path in SOURCES}


def test_the_internals_files_are_where_private_names_are_used():
    """Each file designated by name exists and uses some, and the adapters'
    `internals.py` many (the reader finds them: it does not pass the other
    files by finding nothing anywhere)."""
    uses = _uses_by_file()
    assert len([path for path in INTERNALS if path.parent.parent == ADAPTERS]) >= 4
    unused = [
        str(path.relative_to(ROOT))
        for path in sorted({*CORE_INTERNALS, ADAPTERS / "shared" / "jax_internals.py"})
        if not path.exists() or not uses[path]
    ]
    assert not unused, "designated, but using no library's private name:\n" + (
        "\n".join(unused)
    )
    assert sum(len(uses[path]) for path in INTERNALS) >= 20


@pytest.mark.parametrize(
    "path",
    [path for path in SOURCES if path not in INTERNALS],
    ids=lambda p: str(p.relative_to(ROOT)),
)
def test_private_names_of_the_libraries_only_in_the_internals_files(path):
    uses = _uses_by_file()[path]
    described = [f"{path.relative_to(ROOT)}:{line}: {use}" for line, use in uses]
    assert not described, (
        "a library's private name, outside the files designated for them "
        "(adapters/*/internals.py, adapters/shared/jax_internals.py, "
        "tests/test_architecture.py's CORE_INTERNALS): move it there\n"
        + "\n".join(described)
    )


# Errors ----------------------------------------------------------------------


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
