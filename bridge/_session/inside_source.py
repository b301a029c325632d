"""`inside=`: a function's source, its assignments rewritten as taps.

`compiled` parses a function's source, rewrites every simple assignment
`name = expr` of its own body as `name = tap(key, "name", expr, where)` (the
`tap` of `bridge._session.inside`, found through `__import__`, so the user's
module globals are never written to), and compiles it with the original's
free variables in the original's order; `SiteSource` says where each tapped
assignment is. Nothing here swaps code or runs it: `inside_functions` does.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
import types
from typing import Any, NamedTuple

from .._errors import BridgeError, BridgeValueError

#: The module the rewritten code imports `tap` from.
TAP_MODULE = "bridge._session.inside"


class SiteSource(NamedTuple):
    """Where a site of `bridge.probe(..., inside=...)` comes from: the
    assignment whose value it is (`bridge.site_sources`).

    Attributes:
      file: the source file of the function assigning it.
      line: the assignment's first line in that file.
      code: the assignment, on one line (`attn_weights = jax.nn.softmax(...)`).
      function: the qualified name of the function assigning it.
    """

    file: str
    line: int
    code: str
    function: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line} in {self.function}: {self.code}"


def has_source(function: types.FunctionType) -> bool:
    filename = function.__code__.co_filename
    if filename.startswith("<"):  # generated (dataclasses) or typed in a REPL
        return False
    try:
        inspect.getsource(function)
    except (OSError, TypeError):
        return False
    return True


class _Tapper(ast.NodeTransformer):
    """`name = expr` -> `name = tap(key, "prefix" "name", expr, where)`, in the
    function's own body (not in the functions or classes it defines)."""

    def __init__(self, key: int, prefix: str, source: str, where: _Where):
        self.key, self.prefix, self.source, self.where = key, prefix, source, where
        self.depth = 0

    def _tapped(self, name: str, node: ast.stmt, value: ast.expr) -> ast.expr:
        imported = ast.Call(
            ast.Name("__import__", ast.Load()),
            [ast.Constant(TAP_MODULE), ast.Constant(None), ast.Constant(None)],
            [ast.keyword("fromlist", ast.Constant(("tap",)))],
        )
        function = ast.Attribute(imported, "tap", ast.Load())
        arguments = [
            ast.Constant(self.key),
            ast.Constant(self.prefix + name),
            value,
            ast.Constant(self.where.add(node, self.source)),
        ]
        return ast.copy_location(ast.Call(function, arguments, []), value)

    def visit_FunctionDef(self, node):
        if self.depth:  # a function the body defines: its own code
            return node
        self.depth += 1
        # Decorators, defaults and annotations live on the function object,
        # not in its code: left out, they are never evaluated again.
        node.decorator_list = []
        node.returns = None
        arguments = node.args
        arguments.defaults = []
        arguments.kw_defaults = [None] * len(arguments.kwonlyargs)
        for argument in (
            *arguments.posonlyargs,
            *arguments.args,
            *arguments.kwonlyargs,
            arguments.vararg,
            arguments.kwarg,
        ):
            if argument is not None:
                argument.annotation = None
        self.generic_visit(node)
        return node

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Lambda(self, node):
        return node

    def visit_ClassDef(self, node):
        return node

    def visit_Assign(self, node):
        target = node.targets[0]
        if len(node.targets) == 1 and isinstance(target, ast.Name):
            if not _own_submodule_output(target.id, node.value):
                node.value = self._tapped(target.id, node, node.value)
        return node

    def visit_AnnAssign(self, node):
        if node.value is not None and isinstance(node.target, ast.Name):
            if not _own_submodule_output(node.target.id, node.value):
                node.value = self._tapped(node.target.id, node, node.value)
        return node


class _Where:
    """The `SiteSource` of each tapped assignment of one function, as the
    rewrite meets them (its lines still those of the dedented source)."""

    def __init__(self, function: types.FunctionType, sources: list[SiteSource]):
        self.file = function.__code__.co_filename
        self.first = function.__code__.co_firstlineno
        self.function = function.__qualname__
        self.sources = sources

    def add(self, node: ast.stmt, source: str) -> int:
        code = " ".join((ast.get_source_segment(source, node) or "").split())
        line = self.first + node.lineno - 1
        self.sources.append(SiteSource(self.file, line, code, self.function))
        return len(self.sources) - 1


def _own_submodule_output(name: str, value: ast.expr) -> bool:
    """Whether `name = value` gives a submodule's output the submodule's own
    name, its site already: `name = self.name(...)`, or a module made with
    `name="name"` and called, `name = Dense(..., name="name")(x)`."""
    if not isinstance(value, ast.Call):
        return False
    called = value.func
    if isinstance(called, ast.Attribute):
        return (
            called.attr == name
            and isinstance(called.value, ast.Name)
            and called.value.id == "self"
        )
    return isinstance(called, ast.Call) and any(
        keyword.arg == "name"
        and isinstance(keyword.value, ast.Constant)
        and keyword.value.value == name
        for keyword in called.keywords
    )


def compiled(
    function: types.FunctionType, prefix: str, key: int, sources: list[SiteSource]
) -> types.CodeType:
    """The function's code with its assignments tapped, compiled with the
    original's free variables in the original's order."""
    try:
        return _compile(function, prefix, key, sources)
    except BridgeError:
        raise
    except Exception as error:  # a source that does not compile on its own
        raise BridgeValueError(
            f"`inside`: bridge cannot rewrite {function.__qualname__} "
            f"({function.__code__.co_filename}:{function.__code__.co_firstlineno}): "
            f"{type(error).__name__}: {error}. Leave it out of `inside` (name the "
            "functions it calls instead), or mark its values with bridge.tap."
        ) from error


def _compile(
    function: types.FunctionType, prefix: str, key: int, sources: list[SiteSource]
) -> types.CodeType:
    original = function.__code__
    source = textwrap.dedent(inspect.getsource(function))
    tree = ast.parse(source)
    definition = tree.body[0] if tree.body else None
    if not isinstance(definition, ast.FunctionDef | ast.AsyncFunctionDef) or (
        definition.name != original.co_name
    ):
        raise BridgeValueError(
            f"`inside`: the source of {function.__qualname__} does not define it "
            "with `def` (it is made by another function or a decorator), so "
            "bridge cannot rewrite it. Name the function it wraps instead."
        )
    _Tapper(key, prefix, source, _Where(function, sources)).visit(definition)
    free = [name for name in original.co_freevars if name != "__class__"]
    # A method is compiled inside a class of its owner's name: `super()`'s
    # `__class__` cell and `__private` name mangling are the original's.
    owner = function.__qualname__.rsplit(".", 2)
    in_class = "." in function.__qualname__ and owner[-2] != "<locals>"
    body: list[ast.stmt] = [definition]
    result: ast.expr = ast.Name(definition.name, ast.Load())
    if in_class:
        body = [ast.ClassDef(owner[-2], [], [], [definition], [])]
        result = ast.Subscript(
            ast.Attribute(ast.Name(owner[-2], ast.Load()), "__dict__", ast.Load()),
            ast.Constant(definition.name),
            ast.Load(),
        )
    outer = ast.FunctionDef(
        "__bridge_outer__",
        ast.arguments([], [ast.arg(name) for name in free], None, [], [], None, []),
        [*body, ast.Return(result)],
        [],
    )
    module = ast.Module([outer], [])
    ast.fix_missing_locations(module)
    ast.increment_lineno(module, original.co_firstlineno - 1)
    namespace: dict[str, Any] = {}
    # Executed with the function's globals, but the `def` binds in `namespace`:
    # the user's module is not written to.
    exec(compile(module, original.co_filename, "exec"), function.__globals__, namespace)
    made = namespace["__bridge_outer__"](*[None] * len(free))
    code = getattr(made, "__func__", made).__code__
    if code.co_freevars != original.co_freevars:
        raise BridgeValueError(
            f"`inside`: the rewritten {function.__qualname__} does not close over "
            f"the same variables ({code.co_freevars} vs {original.co_freevars}), so "
            "bridge cannot swap its code. Name the functions it calls instead."
        )
    if hasattr(code, "co_qualname"):
        code = code.replace(co_qualname=original.co_qualname, co_name=original.co_name)
    return code
