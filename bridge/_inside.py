"""Sites inside a module's code: `bridge.probe(model, inside=...)`.

While a probe with `inside` runs, the functions it names — the methods of the
classes given, and the plain functions given — run a rewritten copy of their
code in which every simple assignment `name = expr` is
`name = tap(key, "name", expr)`: each assigned floating array becomes a site
`<module path>/<name>` (a plain function's `<calling module path>/<function
name>/<name>`), exactly as if the model's author had written `bridge.tap`.

How, and why this way:
- The rewrite swaps the function object's `__code__` and nothing else, so
  every reference to the function sees it — a decorator's wrapper (Linen's
  `nn.compact` and method wrapping, Haiku's, `jax.named_scope`,
  `eqx.filter_jit`), a default argument holding it (`attention_fn=
  dot_product_attention`), a call through the module's globals — while its
  globals, defaults, closure cells and `super()` are the original's. The
  rewritten code is compiled once per function, from its source, with the
  same free variables in the same order (a method is compiled inside a class
  of its owner's name, so `super()` and name mangling are the original's).
- The swap lasts while a probe using it runs (counted across probes and
  threads, under a lock), and is undone in a `finally`: no class or function
  is left modified, also when the model raises.
- A rewritten function taps only for a session whose probe asked for it
  (`Inside.keys`): the same model called meanwhile by another thread, or by
  a probe without `inside`, gets its values untouched. The rewritten code
  finds `tap` through `__import__`, so the user's module globals are never
  written to.
- Values that are not floating arrays (a shape, a dtype, a submodule, a
  tuple) pass untouched: only an array the framework differentiates is a
  site. An assignment of a submodule's own output to a local of its own name
  (`query = self.query(x)`) is that submodule's site already and is not
  tapped again; any other local whose site would be a submodule's is refused
  at discovery, before any work.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import inspect
import itertools
import textwrap
import threading
import types
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from ._errors import BridgeTypeError, BridgeValueError
from ._session import current

#: The name the rewritten code imports `tap` from.
_HERE = __name__

#: Packages whose own classes are the bases of models, not model code: a
#: class's methods are rewritten along its MRO up to the first of these
#: (the class given is always rewritten, wherever it comes from).
_LIBRARY_PACKAGES = ("flax", "haiku", "equinox", "torch", "jax", "builtins", "abc")

_lock = threading.Lock()
_keys = itertools.count(1)
#: id(function) -> _Rewrite, for every function ever rewritten (compiled once).
_rewrites: dict[int, _Rewrite] = {}


def tap(key: int, name: str, value: Any) -> Any:
    """What a rewritten assignment calls: `bridge.tap(name, value)` for a
    session whose probe asked for the function `key`, else `value`."""
    session = current()
    inside = None if session is None else session.inside
    if inside is None or key not in inside.keys or not _floating(session, value):
        return value
    return session.taps.tap(name, value)


def _floating(session: Any, value: Any) -> bool:
    arrays = session.arrays
    if not arrays.is_array(value):
        return False
    dtype = getattr(arrays.abstract(value), "dtype", None)
    try:
        return dtype is not None and np.issubdtype(np.dtype(dtype), np.inexact)
    except TypeError:  # a dtype NumPy does not know
        return False


class Inside:
    """The rewrites one probe asks for (`bridge.probe(..., inside=...)`).

    Attributes:
      keys: the rewritten functions' keys, for `tap`'s check.
      local_names: `{tap name}` each rewritten assignment may give, for the
        collision check after discovery.
    """

    def __init__(self, inside: Any):
        entries = list(inside) if isinstance(inside, list | tuple) else [inside]
        if not entries:
            raise BridgeValueError(
                "`inside` is empty: give a module class, a plain function, or a "
                "list of them, or leave `inside=None`."
            )
        rewrites: list[_Rewrite] = []
        for entry in entries:
            rewrites.extend(_rewrites_of(entry))
        self.rewrites = tuple(dict.fromkeys(rewrites))
        self.keys = frozenset(r.key for r in self.rewrites)
        self.local_names = frozenset(
            name for r in self.rewrites for name in r.local_names
        )

    @contextlib.contextmanager
    def applied(self) -> Iterator[None]:
        """The rewritten code in place while the model runs; the original
        code back afterwards, also when it raises."""
        done = []
        try:
            for rewrite in self.rewrites:
                rewrite.acquire()
                done.append(rewrite)
            yield
        finally:
            for rewrite in reversed(done):
                rewrite.release()

    def check_names(self, sites: Sequence[Any]) -> None:
        """Refuse a tapped local whose site is a submodule's too: two values
        under one name."""
        modules = {site.path for site in sites if site.module is not None}
        for site in sites:
            name = site.path.rsplit("/", 1)[-1]
            tapped = site.module is None and name in self.local_names
            if tapped and site.path in modules:
                raise BridgeValueError(
                    f"`inside`: the local variable {name!r} and the submodule at "
                    f"{site.path!r} would both be the site {site.path!r}. Rename "
                    "the local variable or the submodule, or leave that class "
                    "out of `inside` and mark the value with bridge.tap under "
                    "another name."
                )


class _Rewrite:
    """One function's rewritten code, and how many runs have it in place."""

    def __init__(self, function: types.FunctionType, prefix: str):
        self.function = function
        self.original = function.__code__
        self.key = next(_keys)
        self.local_names: set[str] = set()
        self.code = _compiled(function, prefix, self.key, self.local_names)
        self.users = 0

    def acquire(self) -> None:
        with _lock:
            if self.users == 0:
                self.function.__code__ = self.code
            self.users += 1

    def release(self) -> None:
        with _lock:
            self.users -= 1
            if self.users == 0:
                self.function.__code__ = self.original


def _rewrites_of(entry: Any) -> list[_Rewrite]:
    if isinstance(entry, type):
        functions = [(fn, "") for fn in _methods(entry)]
        if not functions:
            raise BridgeValueError(
                f"`inside`: the class {entry.__qualname__} has no method with "
                "Python source to rewrite (its methods are builtins or "
                "generated). Name the functions that compute the values instead."
            )
    else:
        function = _innermost(entry)
        if callable(function) and not isinstance(function, types.FunctionType):
            raise BridgeValueError(_no_source(entry))  # a builtin, C code
        if not isinstance(function, types.FunctionType):
            raise BridgeTypeError(
                "`inside` takes module classes and plain functions (or a list of "
                f"them); got {_describe(entry)}. Pass the class (e.g. "
                "nn.MultiHeadDotProductAttention) or the function (e.g. "
                "nn.dot_product_attention_weights)."
            )
        if function.__name__ == "<lambda>":
            raise BridgeValueError(
                f"`inside`: {_describe(entry)} is a lambda, which has no "
                "assignments to tap. Name the function that calls it, or define "
                "it with `def`."
            )
        if not _has_source(function):
            raise BridgeValueError(_no_source(entry))
        functions = [(function, f"{function.__name__}/")]
    found = []
    with _lock:
        for function, prefix in functions:
            rewrite = _rewrites.get(id(function))
            if rewrite is None or rewrite.function is not function:
                rewrite = _Rewrite(function, prefix)
                _rewrites[id(function)] = rewrite
            found.append(rewrite)
    return found


def _methods(cls: type) -> list[types.FunctionType]:
    """The functions with source of `cls` and of its bases up to the model
    libraries' own classes, each unwrapped from its decorators."""
    found: dict[int, types.FunctionType] = {}
    for klass in cls.__mro__:
        if klass is not cls and klass.__module__.split(".")[0] in _LIBRARY_PACKAGES:
            break
        for attribute in vars(klass).values():
            if isinstance(attribute, staticmethod | classmethod):
                attribute = attribute.__func__
            function = _innermost(attribute)
            if (
                isinstance(function, types.FunctionType)
                and function.__name__ != "<lambda>"  # an attribute's default
                and _has_source(function)
            ):
                found.setdefault(id(function), function)
    return list(found.values())


def _innermost(value: Any) -> Any:
    """A function without its decorators' wrappers (`__wrapped__`) and
    `functools.partial`s."""
    seen = set()
    while id(value) not in seen:
        seen.add(id(value))
        if isinstance(value, functools.partial):
            value = value.func
        elif hasattr(value, "__wrapped__"):
            value = value.__wrapped__
    return value


def _has_source(function: types.FunctionType) -> bool:
    filename = function.__code__.co_filename
    if filename.startswith("<"):  # generated (dataclasses) or typed in a REPL
        return False
    try:
        inspect.getsource(function)
    except (OSError, TypeError):
        return False
    return True


def _describe(entry: Any) -> str:
    return f"{type(entry).__qualname__} {getattr(entry, '__qualname__', entry)!r}"


def _no_source(entry: Any) -> str:
    return (
        f"`inside`: no Python source for {_describe(entry)} (a builtin, a C "
        "extension, or code typed in a REPL): bridge rewrites a function from its "
        "source. Define it in a file, or mark its values with bridge.tap."
    )


# -- the rewrite --------------------------------------------------------------------


class _Tapper(ast.NodeTransformer):
    """`name = expr` -> `name = tap(key, "prefix" "name", expr)`, in the
    function's own body (not in the functions or classes it defines)."""

    def __init__(self, key: int, prefix: str, local_names: set[str]):
        self.key, self.prefix, self.local_names = key, prefix, local_names
        self.depth = 0

    def _tapped(self, name: str, value: ast.expr) -> ast.expr:
        self.local_names.add(name)
        imported = ast.Call(
            ast.Name("__import__", ast.Load()),
            [ast.Constant(_HERE), ast.Constant(None), ast.Constant(None)],
            [ast.keyword("fromlist", ast.Constant(("tap",)))],
        )
        function = ast.Attribute(imported, "tap", ast.Load())
        arguments = [ast.Constant(self.key), ast.Constant(self.prefix + name), value]
        return ast.copy_location(ast.Call(function, arguments, []), value)

    def visit_FunctionDef(self, node):
        if self.depth:  # a function the body defines: its own code
            return node
        self.depth += 1
        node.decorator_list = []  # already applied to the function object
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
                node.value = self._tapped(target.id, node.value)
        return node

    def visit_AnnAssign(self, node):
        if node.value is not None and isinstance(node.target, ast.Name):
            if not _own_submodule_output(node.target.id, node.value):
                node.value = self._tapped(node.target.id, node.value)
        return node


def _own_submodule_output(name: str, value: ast.expr) -> bool:
    """`name = self.name(...)`: the submodule's own site already."""
    return (
        isinstance(value, ast.Call)
        and isinstance(value.func, ast.Attribute)
        and value.func.attr == name
        and isinstance(value.func.value, ast.Name)
        and value.func.value.id == "self"
    )


def _compiled(
    function: types.FunctionType, prefix: str, key: int, local_names: set[str]
) -> types.CodeType:
    """The function's code with its assignments tapped, compiled with the
    original's free variables in the original's order."""
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
    _Tapper(key, prefix, local_names).visit(definition)
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
