"""`inside=`: a function's source, its assignments rewritten as taps.

`compiled` finds the `def` a function was compiled from in its source file,
as the file is now, rewrites every simple assignment `name = expr` of its own
body as `name = tap(key, "name", expr, where)` (the `tap` of
`bridge._session.inside`, found through `__import__`, so the user's module
globals are never written to), and compiles it with the original's free
variables in the original's order; `SiteSource` says where each tapped
assignment is. Nothing here swaps code or runs it: `inside_functions` does.

The file is read as it is now, and the function runs the code it was
compiled from at import: a notebook user edits the module's file after
importing it. So the `def` is compiled once more as it stands, untouched,
and must give the function's own code (bytecode, constants, names), or
`compiled` refuses, naming the function and the fix (re-import it), before
any work: the probed model would otherwise run the edited code, silently.
Only where the code lies may differ: with lines added above it, the `def`
is found by its qualified name, and the sites' lines are the file's now.
"""

from __future__ import annotations
import __future__

import ast
import copy
import functools
import inspect
import linecache
import types
from typing import Any, NamedTuple

from .._errors import BridgeError, BridgeValueError

#: The module the rewritten code imports `tap` from.
TAP_MODULE = "bridge._session.inside"

#: The `from __future__` flags a code object carries in `co_flags`: the
#: function's own are compiled in again (`annotations` changes the code of a
#: class its body defines), and not those of this module.
_FUTURE_FLAGS = functools.reduce(
    lambda flags, name: flags | getattr(__future__, name).compiler_flag,
    __future__.all_feature_names,
    0,
)
#: The flags that say what a code object does; the others say where it was
#: compiled (`CO_NESTED`: inside the wrapper `compiled` builds) or are
#: `_FUTURE_FLAGS`.
_KIND_FLAGS = (
    inspect.CO_VARARGS
    | inspect.CO_VARKEYWORDS
    | inspect.CO_GENERATOR
    | inspect.CO_COROUTINE
    | inspect.CO_ASYNC_GENERATOR
    | inspect.CO_ITERABLE_COROUTINE
)


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
    if function.__code__.co_filename.startswith("<"):  # generated, or a REPL's
        return False
    return bool(_lines(function))


def _lines(function: types.FunctionType) -> list[str]:
    """The lines of the function's source file as it is now (`linecache`
    rereads a file changed on disk, and keeps a notebook cell's)."""
    filename = function.__code__.co_filename
    linecache.checkcache(filename)
    return linecache.getlines(filename, function.__globals__)


class _File(NamedTuple):
    """A source file as `_definition` reads it: its `def`s by qualified name
    (in the file's order), and its module's imports (`_module_imports`).
    Never changed: `_definition` copies the `def` it rewrites."""

    definitions: dict[str, list[ast.FunctionDef | ast.AsyncFunctionDef]]
    imports: list[ast.stmt]


@functools.lru_cache(maxsize=16)
def _read(filename: str, source: str) -> _File:
    """A source file parsed and indexed once for all the functions of a
    class (a model's file holds many)."""
    tree = ast.parse(source, filename)
    return _File(_definitions(tree), _module_imports(tree))


class _Tapper(ast.NodeTransformer):
    """`name = expr` -> `name = tap(key, "prefix" "name", expr, where)`, in the
    function's own body (not in the functions or classes it defines)."""

    def __init__(self, key: int, prefix: str, where: _Where):
        self.key, self.prefix, self.where = key, prefix, where
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
            ast.Constant(self.where.add(node)),
        ]
        return ast.copy_location(ast.Call(function, arguments, []), value)

    def visit_FunctionDef(self, node):
        if self.depth:  # a function the body defines: its own code
            return node
        self.depth += 1
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
    rewrite meets them (its lines the source file's as it is now)."""

    def __init__(
        self, function: types.FunctionType, lines: list[str], sources: list[SiteSource]
    ):
        self.file = function.__code__.co_filename
        self.lines = lines
        self.function = function.__qualname__
        self.sources = sources

    def add(self, node: ast.stmt) -> int:
        code = " ".join(_segment(self.lines, node).split())
        self.sources.append(SiteSource(self.file, node.lineno, code, self.function))
        return len(self.sources) - 1


def _segment(lines: list[str], node: ast.stmt) -> str:
    """The node's source text (`ast.get_source_segment`, which splits the
    whole file again at every call, on the file's lines). Its columns count
    UTF-8 bytes."""
    first, last = node.lineno - 1, (node.end_lineno or node.lineno) - 1
    start, end = node.col_offset, node.end_col_offset
    if first == last:
        return lines[first].encode()[start:end].decode()
    return "".join(
        [
            lines[first].encode()[start:].decode(),
            *lines[first + 1 : last],
            lines[last].encode()[:end].decode(),
        ]
    )


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
    lines, imports, definition = _definition(function)
    _Tapper(key, prefix, _Where(function, lines, sources)).visit(definition)
    code = _compiled_alone(function, definition, imports)
    if code.co_freevars != original.co_freevars:
        raise BridgeValueError(
            f"`inside`: the rewritten {function.__qualname__} does not close over "
            f"the same variables ({code.co_freevars} vs {original.co_freevars}), so "
            "bridge cannot swap its code. Name the functions it calls instead."
        )
    return code


def _definition(
    function: types.FunctionType,
) -> tuple[list[str], list[ast.stmt], ast.FunctionDef | ast.AsyncFunctionDef]:
    """The source file's lines as they are now, its module's imports
    (`_module_imports`), and a copy of the `def` in it that compiles to the
    function's own code, without its decorators, defaults and annotations
    (they live on the function object, not in its code, and are never
    evaluated again).

    The `def` is found by the function's qualified name, first at the line
    the code says it starts on: with lines added above it, the same `def`
    is further down, and is the function's code all the same."""
    original = function.__code__
    lines = _lines(function)
    try:
        file = _read(original.co_filename, "".join(lines))
    except SyntaxError as error:
        raise _stale(function, f"the file does not compile now ({error})") from None
    qualname = getattr(original, "co_qualname", function.__qualname__)
    found = sorted(
        file.definitions.get(qualname, ()),
        key=lambda node: _first_line(node) != original.co_firstlineno,
    )
    if not found:
        raise _stale(
            function,
            f"the file has no `def` of {qualname} now (renamed or removed? If it "
            "never had, the function is made by other code: name the function "
            "it wraps instead)",
        )
    for node in found:
        definition = _bare(copy.deepcopy(node))
        made = _compiled_alone(function, definition, file.imports)
        if _code_key(made) == _code_key(original):
            return lines, file.imports, definition
    line = _first_line(found[0])
    raise _stale(
        function,
        f"its `def` at line {line} compiles to other code (other bytecode, "
        "constants or names) than the function runs",
    )


def _stale(function: types.FunctionType, why: str) -> BridgeValueError:
    """The refusal of a function whose file no longer holds its code."""
    module = function.__module__
    return BridgeValueError(
        f"`inside`: {function.__qualname__} no longer matches its source file "
        f"{function.__code__.co_filename}: {why}. `inside=` rewrites a "
        "function from its source file as it is now, so the probe would run "
        f"other code than the model does: the file was edited after {module} "
        "was imported (or a tool, such as an import hook, compiled other code "
        f"for it). Re-import it: importlib.reload({module}) (or restart the "
        "kernel), make the model again from the reloaded module and pass "
        "`inside=` the reloaded class or function; or undo the edit."
    )


def _definitions(
    tree: ast.Module,
) -> dict[str, list[ast.FunctionDef | ast.AsyncFunctionDef]]:
    """The `def`s of `tree` by their qualified names, in the file's order."""
    found: dict[str, list[ast.FunctionDef | ast.AsyncFunctionDef]] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                found.setdefault(prefix + child.name, []).append(child)
                visit(child, f"{prefix}{child.name}.<locals>.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            elif not isinstance(child, ast.Lambda):  # a lambda defines no `def`
                visit(child, prefix)

    visit(tree, "")
    return found


def _first_line(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """The line a function's code starts on: its first decorator's."""
    return min([node.lineno, *(d.lineno for d in node.decorator_list)])


def _bare(
    node: ast.FunctionDef | ast.AsyncFunctionDef,
) -> ast.FunctionDef | ast.AsyncFunctionDef:
    """The `def` without its decorators, defaults and annotations."""
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
    return node


def _compiled_alone(
    function: types.FunctionType,
    definition: ast.FunctionDef | ast.AsyncFunctionDef,
    imports: list[ast.stmt],
) -> types.CodeType:
    """The code of `definition` compiled as the function's was: inside a
    function taking its free variables, in the nearest class around it (so
    `super()`'s `__class__` cell and `__private` name mangling are the
    original's), with its `from __future__` flags, in a module importing
    what its module imports (never run: Python 3.11 calls a method of an
    imported module, `nn.Dense(...)`, with other bytecode than another
    object's); the qualified names it gives (its own, its nested functions'
    and classes') are the original's."""
    original = function.__code__
    free = [name for name in original.co_freevars if name != "__class__"]
    qualname = getattr(original, "co_qualname", function.__qualname__)
    owner = _enclosing_class(qualname)
    body: list[ast.stmt] = [definition]
    result: ast.expr = ast.Name(definition.name, ast.Load())
    if owner is not None:
        body = [ast.ClassDef(owner, [], [], [definition], [])]
        result = ast.Subscript(
            ast.Attribute(ast.Name(owner, ast.Load()), "__dict__", ast.Load()),
            ast.Constant(definition.name),
            ast.Load(),
        )
    outer = ast.FunctionDef(
        "__bridge_outer__",
        ast.arguments([], [ast.arg(name) for name in free], None, [], [], None, []),
        [*body, ast.Return(result)],
        [],
    )
    module = ast.Module([ast.If(ast.Constant(False), imports, []), outer], [])
    ast.fix_missing_locations(module)
    flags = original.co_flags & _FUTURE_FLAGS
    namespace: dict[str, Any] = {}
    # Executed with the function's globals, but the `def` binds in `namespace`:
    # the user's module is not written to. Nothing of the user's runs: the
    # `def` has no decorators or defaults left.
    exec(
        compile(module, original.co_filename, "exec", flags=flags, dont_inherit=True),
        function.__globals__,
        namespace,
    )
    made = namespace["__bridge_outer__"](*[None] * len(free))
    wrapped = ".".join(["__bridge_outer__.<locals>", *([owner] if owner else [])])
    return _requalified(
        getattr(made, "__func__", made).__code__,
        f"{wrapped}.{definition.name}",
        qualname,
    )


def _requalified(code: types.CodeType, made: str, qualname: str) -> types.CodeType:
    """`code`, compiled as `made` inside bridge's wrapper, with the qualified
    names of the original, `qualname`: its own, and those its nested
    functions and classes start with (`co_qualname`, and a class body's
    `__qualname__` constant: a class the function defines is named as
    before)."""
    inner = f"{made}."

    def renamed(constant: Any) -> Any:
        if isinstance(constant, types.CodeType):
            return _requalified(constant, made, qualname)
        if isinstance(constant, str) and constant.startswith(inner):
            return f"{qualname}.{constant[len(inner) :]}"
        return constant

    code = code.replace(co_consts=tuple(renamed(c) for c in code.co_consts))
    if not hasattr(code, "co_qualname"):  # Python 3.10
        return code
    if code.co_qualname == made:
        return code.replace(co_qualname=qualname)
    return code.replace(co_qualname=renamed(code.co_qualname))


def _module_imports(tree: ast.Module) -> list[ast.stmt]:
    """The import statements of a module's own scope (not a function's or a
    class's), but `from __future__`'s."""
    found: list[ast.stmt] = []

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import) or (
                isinstance(child, ast.ImportFrom) and child.module != "__future__"
            ):
                found.append(child)
            elif not isinstance(child, _SCOPES):
                visit(child)

    visit(tree)
    return found


_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)


def _enclosing_class(qualname: str) -> str | None:
    """The nearest class around a function, by its qualified name
    (`Outer.method.<locals>.helper` -> `Outer`), `None` outside any."""
    parts = qualname.split(".")
    for index in reversed(range(len(parts) - 1)):
        if parts[index] != "<locals>" and parts[index + 1] != "<locals>":
            return parts[index]
    return None


def _code_key(code: types.CodeType) -> tuple:
    """What a code object runs, not where it lies: its bytecode, constants
    (nested functions' code alike), names and kind, without its file, lines
    or qualified name."""
    return (
        code.co_name,
        code.co_code,
        tuple(_constant_key(constant) for constant in code.co_consts),
        code.co_names,
        code.co_varnames,
        code.co_freevars,
        code.co_cellvars,
        code.co_argcount,
        code.co_posonlyargcount,
        code.co_kwonlyargcount,
        code.co_flags & _KIND_FLAGS,
    )


def _constant_key(constant: Any) -> Any:
    if isinstance(constant, types.CodeType):
        return _code_key(constant)
    if isinstance(constant, tuple):
        return tuple, tuple(_constant_key(item) for item in constant)
    if isinstance(constant, frozenset):
        return frozenset, frozenset(_constant_key(item) for item in constant)
    # Type and repr: `1`, `1.0` and `True` are equal, as are `0.0` and `-0.0`.
    return type(constant), repr(constant)
