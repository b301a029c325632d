"""Sites inside a module's code: `bridge.probe(model, inside=...)`.

While a probe with `inside` runs, the functions it names — the methods of the
classes given, and the plain functions given — run a rewritten copy of their
code in which every simple assignment `name = expr` is
`name = tap(key, "name", expr, where)`: each assigned floating array of rank
at least 1 becomes a site `<module path>/<name>` (a plain function's
`<calling module path>/<function name>/<name>`), exactly as if the model's
author had written `bridge.tap`, and `bridge.site_sources` tells where each
comes from (file, line, the assignment).

How, and why this way:
- Only a class's methods are rewritten (functions defined in its body, and
  its properties' accessors), never its other attributes: a field default
  that is a function (`kernel_init=default_kernel_init`, `attention_fn=
  dot_product_attention`) belongs to whoever wrote it.
- The rewrite swaps the function object's `__code__` and nothing else, so
  every reference to the function sees it — a decorator's wrapper (Linen's
  `nn.compact` and method wrapping, Haiku's, `jax.named_scope`,
  `eqx.filter_jit`), a default argument holding it (`attention_fn=
  dot_product_attention`), a call through the module's globals — while its
  globals, defaults, closure cells and `super()` are the original's. The
  rewritten code is compiled once per function, from its source, without
  its decorators, defaults and annotations (they live on the function
  object, not in its code), with the same free variables in the same order
  (a method is compiled inside a class of its owner's name, so `super()`
  and name mangling are the original's).
- The swap lasts while a probe using it runs (counted across probes and
  threads, under a lock), and is undone in a `finally`: no class or function
  is left modified, also when the model raises.
- A rewritten function taps only for a session whose probe asked for it
  (`Inside.keys`): the same model called meanwhile by another thread, or by
  a probe without `inside`, gets its values untouched. The rewritten code
  finds `tap` through `__import__`, so the user's module globals are never
  written to.
- Values that are not floating arrays of rank >= 1 (a shape, a dtype, a
  boolean or integer mask, a 0-d constant, a submodule, a tuple) pass
  untouched. An assignment of a submodule's own output to a local of the
  submodule's name (`query = self.query(x)`, `out = DenseGeneral(...,
  name="out")(x)`) is that submodule's site already and is not tapped; any
  other local whose site would be a submodule's is refused at discovery,
  before any work.
- A local the adapter cannot hand out (inside a transform of the model's own
  code it cannot see through) never blocks the other sites: it is listed,
  and selecting or patching it raises naming the transform, before any work.

`inside` is the core's, whatever the adapter: `looking_inside` gives the
probe a subclass of its own class (made once per class) whose pytree
flattening carries the `Inside` beside what the adapter's flattening gives,
so a probe rebuilt from its leaves (under `jax.jit`, or by discovery's
`jax.eval_shape`) still looks inside, and whose discovery and runs make it
the `Inside` of every session made meanwhile (`bridge._session.context.INSIDE`),
by the core or by an adapter. An adapter knows nothing of it.
"""

from __future__ import annotations

import ast
import contextlib
import contextvars
import copy
import dataclasses
import functools
import inspect
import itertools
import textwrap
import threading
import types
import weakref
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

from .._errors import (
    BridgeError,
    BridgeNotImplementedError,
    BridgeTypeError,
    BridgeValueError,
)
from .context import INSIDE, current, local_tap
from .sites import Site, SiteOrigin, site_name

#: The name the rewritten code imports `tap` from.
_HERE = __name__

#: Packages whose own classes are the bases of models, not model code: a
#: class's methods are rewritten along its MRO where its bases come from the
#: class's own package, and never in these (the class given is always
#: rewritten, wherever it comes from).
_LIBRARY_PACKAGES = ("flax", "haiku", "equinox", "torch", "jax", "builtins", "abc")

_lock = threading.Lock()
_keys = itertools.count(1)
#: id(function) -> _Rewrite, for every function ever rewritten (compiled once).
_rewrites: dict[int, _Rewrite] = {}
#: key -> _Rewrite.
_by_key: dict[int, _Rewrite] = {}


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


@dataclasses.dataclass(frozen=True)
class _Unreachable(SiteOrigin):
    """The origin of a local the adapter cannot hand out: `Site.refused`."""

    blocked: str


#: `{site name: SiteSource}` of the discovery running now, in this context
#: (`Inside.looking`), as its taps tell them.
_TRACED: contextvars.ContextVar[dict[str, SiteSource] | None] = contextvars.ContextVar(
    "bridge_inside_traced", default=None
)
#: What discoveries found, by their `Site` objects (kept with the discovery
#: cache's sites, dropped with them).
_SOURCES: weakref.WeakKeyDictionary[Site, SiteSource] = weakref.WeakKeyDictionary()


def tap(key: int, name: str, value: Any, where: int = -1) -> Any:
    """What a rewritten assignment calls: `bridge.tap(name, value)` for a
    session whose probe asked for the function `key`, else `value`. `where`
    indexes the function's `SiteSource`s."""
    session = current()
    inside = None if session is None else session.inside
    if inside is None or key not in inside.keys or not _floating(session, value):
        return value
    before = session.naming.checkpoint()[0]
    try:
        with local_tap():
            tapped = session.tap(name, value)
    except BridgeError as refusal:
        if _entered(session, before):
            raise  # not a refusal of the tap: an error of its site's run
        return _unreachable(session, key, name, value, where, refusal)
    traced = _TRACED.get()
    if traced is not None and session.recorder.learns_sites():
        source = _by_key[key].sources[where]
        for entered in _entered(session, before):
            traced[entered] = source
    return tapped


def _entered(session: Any, before: dict[str, int]) -> list[str]:
    """The names of the calls the session named since its counts were
    `before`."""
    after = session.naming.checkpoint()[0]
    return [
        site_name(base, None, index)
        for base, count in after.items()
        for index in range(before.get(base, 0), count)
    ]


def _unreachable(
    session: Any, key: int, name: str, value: Any, where: int, refusal: Exception
) -> Any:
    """A local the adapter refuses to hand out (it sits inside a transform
    of the model's own code that the adapter cannot see through): listed as
    a site all the same (`Site.refused`: left out of `at=None`), its value
    left as it is; selecting or patching it is refused before any work
    (`bridge._probe.selection.select`, `bridge._probe.checks.resolve_patches`)."""
    blocked = (
        f"it is a local of `inside` that the adapter cannot hand out. {refusal} "
        "Select other sites with `at=` (the others probe as usual), or move the "
        "computation out of the transform."
    )
    call = session.enter(
        session.naming.under_enclosing(name),
        None,
        None,
        origin=_Unreachable(blocked),
        record=False,
    )
    if call.name in session.selected or call.name in session.patches:
        raise BridgeNotImplementedError(f"site {call.name!r}: {blocked}")
    traced = _TRACED.get()
    if traced is not None and session.recorder.learns_sites():
        traced[call.name] = _by_key[key].sources[where]
    return session.exit(call, value, perturb=lambda v: v, record=False)


def _floating(session: Any, value: Any) -> bool:
    arrays = session.arrays
    if not arrays.is_array(value):
        return False
    struct = arrays.abstract(value)
    dtype = getattr(struct, "dtype", None)
    if dtype is None or not getattr(struct, "shape", ()):
        return False  # a 0-d constant is no activation
    try:
        return np.issubdtype(np.dtype(dtype), np.inexact)
    except TypeError:  # a dtype NumPy does not know
        return False


class Inside:
    """The rewrites one probe asks for (`bridge.probe(..., inside=...)`).

    Equal to another `Inside` of the same functions: a probe rebuilt from its
    leaves, or the same `inside=` given twice, is the same structure to
    `jax.jit` and to bridge's discovery cache.

    Attributes:
      keys: the rewritten functions' keys, for `tap`'s check.
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

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Inside) and other.keys == self.keys

    def __hash__(self) -> int:
        return hash(self.keys)

    def __repr__(self) -> str:
        names = ", ".join(r.function.__qualname__ for r in self.rewrites)
        return f"Inside({names})"

    def __copy__(self) -> Inside:
        return self  # one set of rewrites, counted once (`_Rewrite.acquire`)

    def __deepcopy__(self, memo: dict) -> Inside:
        return self

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

    def discovered(self, sites: Sequence[Site]) -> None:
        """After a discovery, before it is kept: refuse a tapped local whose
        site is a submodule's too (two values under one name), and keep
        where each tapped local comes from, with the sites."""
        traced = _TRACED.get()
        if traced is None:
            return
        modules = {site.path for site in sites if site.module is not None}
        for site in sites:
            source = traced.get(site.name)
            if source is None or site.module is not None:
                continue
            if site.path in modules:
                raise BridgeValueError(
                    f"`inside`: the local variable {site.path.rsplit('/', 1)[-1]!r} "
                    f"({source}) and the submodule at {site.path!r} would both be "
                    f"the site {site.path!r}. Rename the local variable or the "
                    "submodule, or leave that class out of `inside` and mark the "
                    "value with bridge.tap under another name."
                )
            _SOURCES[site] = source

    @contextlib.contextmanager
    def looking(self, discovering: bool = False) -> Iterator[None]:
        """Within it, a session made in this context looks inside with this
        `Inside`; with `discovering`, its taps tell `discovered` where they
        come from."""
        token = INSIDE.set(self)
        traced = _TRACED.set({} if discovering else None)
        try:
            yield
        finally:
            _TRACED.reset(traced)
            INSIDE.reset(token)


def sources_of(sites: Sequence[Site]) -> dict[str, SiteSource]:
    """`{site name: SiteSource}` for each site of `sites` that a local of
    `inside` makes."""
    return {site.name: _SOURCES[site] for site in sites if site in _SOURCES}


def site_sources(probe: Any, *args: Any, **kwargs: Any) -> dict[str, SiteSource]:
    """Where each site that `inside=` adds comes from, on these inputs.

    Args:
      probe: a probe made with `bridge.probe(..., inside=...)`.
      *args, **kwargs: the model's call arguments, as for `probe.sites`.

    Returns:
      `{site name: SiteSource}` for each local of `inside` that is a site, in
      call order: its file, line, the assignment (`code`) and the function
      assigning it, so `attn_weights#1` (the masked scores) is told from
      `attn_weights#2` (the softmax) without reading the library's source.
      Costs no FLOPs (the discovery `probe.sites` makes, reused).

    Examples:
      >>> probe = bridge.probe(model, variables, inside=nn.MultiHeadDotProductAttention)
      >>> for name, source in bridge.site_sources(probe, x).items():
      ...     print(name, source.line, source.code)
    """
    inside = getattr(probe, "_inside", None)
    if not isinstance(inside, Inside):
        raise BridgeValueError(
            f"`probe` ({type(probe).__qualname__}) was not made with `inside=`, "
            "so no site of it comes from a local variable. Make it with "
            "bridge.probe(model, *variables, inside=ModuleClass) (or a function, "
            "or a list of them); bridge.site_sources lists where those sites come "
            "from."
        )
    args, kwargs = probe._prepare_inputs(args, kwargs)
    sites, _ = probe._discover(args, kwargs)
    return sources_of(sites)


# -- `inside`, whatever the adapter -----------------------------------------------

#: An adapter's probe class -> its subclass carrying `inside` (`looking_inside`).
_SUBCLASSES: dict[type, type] = {}


class _LooksInside:
    """The first base of an adapter's probe class's subclass that carries
    `inside`: its discovery and runs make sessions that look inside. (No
    `__slots__`: a probe with a `__dict__`, as every `ProbeBase` has, keeps
    its layout in the subclass.)"""

    _inside: Inside | None

    def _discover(self, *args: Any, **kwargs: Any) -> Any:
        if self._inside is None:
            return super()._discover(*args, **kwargs)
        with self._inside.looking(discovering=True):
            return super()._discover(*args, **kwargs)

    def _forward(self, plan: Any) -> Any:
        if self._inside is None:
            return super()._forward(plan)
        with self._inside.looking():
            return super()._forward(plan)

    def _differentiate(self, loss_fn: Any, plan: Any, *args: Any) -> Any:
        if self._inside is None:
            return super()._differentiate(loss_fn, plan, *args)
        with self._inside.looking():
            return super()._differentiate(loss_fn, plan, *args)


def looking_inside(probe: Any, inside: Inside | None) -> Any:
    """`probe`, its assignments' sites those of `inside`, through any adapter.

    The probe's class becomes a subclass of it (`_LooksInside`, made once
    per class, with the same name) registered as a pytree that flattens as
    the adapter's class does and carries `inside` beside it. Raises a
    `BridgeTypeError` where the adapter's class cannot be given one, or its
    probes rebuilt from their leaves would not look inside."""
    if inside is not None and not isinstance(probe, _LooksInside):
        base = type(probe)
        made = _subclass(base, probe)
        try:
            object.__setattr__(probe, "__class__", made)
        except TypeError as error:  # a layout the subclass cannot share
            raise BridgeTypeError(_cannot_carry(base, error)) from None
    object.__setattr__(probe, "_inside", inside)
    return probe


def check_carried(probe: Any) -> None:
    """Refuse, before any work, a probe whose `inside` a rebuild from its
    leaves would lose (as `jax.jit` and discovery rebuild it)."""
    try:
        leaves, treedef = jax.tree_util.tree_flatten(probe)
        rebuilt = jax.tree_util.tree_unflatten(treedef, leaves)
    except Exception as error:  # the adapter's pytree functions failed
        raise BridgeTypeError(_cannot_carry(type(probe), error)) from error
    if getattr(rebuilt, "_inside", None) != probe._inside:
        raise BridgeTypeError(
            _cannot_carry(type(probe), "a probe rebuilt from its leaves loses it")
        )


def _cannot_carry(base: type, why: Any) -> str:
    return (
        f"`inside` cannot be carried by a {base.__qualname__} (the probe its "
        f"adapter makes): {str(why).rstrip('.')}. Make the adapter's probe a "
        "plain class subclassing bridge.adapter_api.ProbeBase, registered as a "
        "pytree (jax.tree_util.register_pytree_node_class), or mark the values "
        "with bridge.tap in the model's code instead."
    )


def _subclass(base: type, probe: Any) -> type:
    """`base`'s subclass carrying `inside` (made once)."""
    with _lock:
        made = _SUBCLASSES.get(base)
        if made is not None:
            return made
        namespace = {
            "__slots__": (),
            "__module__": base.__module__,
            "__qualname__": base.__qualname__,
            "__doc__": base.__doc__,
        }
        try:
            made = type(base)(base.__name__, (_LooksInside, base), namespace)
        except (TypeError, ValueError) as error:
            raise BridgeTypeError(_cannot_carry(base, error)) from None
        if not jax.tree_util.treedef_is_leaf(_one_level(probe)[1]):
            try:
                _register(made, base)
            except ValueError:  # registered already, by its metaclass
                why = (
                    "its subclasses are pytrees registered by their metaclass "
                    f"({type(base).__qualname__}, as an equinox.Module's are), "
                    "whose flattening keeps only the class's own fields"
                )
                raise BridgeTypeError(_cannot_carry(base, why)) from None
        _SUBCLASSES[base] = made
        return made


def _register(made: type, base: type) -> None:
    """`made` flattens as `base` does, with its `inside` beside."""

    def as_base(probe: Any) -> Any:
        twin = copy.copy(probe)
        object.__setattr__(twin, "__class__", base)
        return twin

    def flatten(probe: Any) -> tuple[list, tuple]:
        children, inner = _one_level(as_base(probe))
        return children, (inner, probe._inside)

    def flatten_with_keys(probe: Any) -> tuple[list, tuple]:
        twin = as_base(probe)
        pairs, inner = jax.tree_util.tree_flatten_with_path(
            twin, is_leaf=lambda x: x is not twin
        )
        return [(path[0], child) for path, child in pairs], (inner, probe._inside)

    def unflatten(aux: tuple, children: Any) -> Any:
        inner, inside = aux
        return looking_inside(jax.tree_util.tree_unflatten(inner, children), inside)

    jax.tree_util.register_pytree_with_keys(made, flatten_with_keys, unflatten, flatten)


def _one_level(tree: Any) -> tuple[list, Any]:
    """`tree`'s children and its one-level treedef."""
    return jax.tree_util.tree_flatten(tree, is_leaf=lambda x: x is not tree)


# -- which functions ---------------------------------------------------------------


class _Rewrite:
    """One function's rewritten code, and how many runs have it in place."""

    def __init__(self, function: types.FunctionType, prefix: str):
        self.function = function
        self.original = function.__code__
        self.key = next(_keys)
        #: Where each tapped assignment is, indexed by its `tap` call's `where`.
        self.sources: list[SiteSource] = []
        self.code = _compiled(function, prefix, self.key, self.sources)
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
                _by_key[rewrite.key] = rewrite
            found.append(rewrite)
    return found


def _methods(cls: type) -> list[types.FunctionType]:
    """The methods with source of `cls` and of its bases from the same
    top-level package (a user's subclass of their own class, not a library's
    base classes), each unwrapped from its decorators.

    A method is a function defined in the class's body (its `__qualname__`
    says so), or a property's accessor: never a class attribute holding a
    function defined elsewhere (a field default such as `kernel_init`, an
    initializer's closure), nor a dataclass field's default."""
    found: dict[int, types.FunctionType] = {}
    package = _package(cls)
    for klass in cls.__mro__:
        if klass is not cls and (
            _package(klass) != package or package in _LIBRARY_PACKAGES
        ):
            continue
        fields = _field_names(klass)
        for name, attribute in vars(klass).items():
            if name in fields:
                continue
            for candidate in _accessors(attribute):
                function = _innermost(candidate)
                if (
                    isinstance(function, types.FunctionType)
                    and _defined_in(function, klass)
                    and _has_source(function)
                ):
                    found.setdefault(id(function), function)
    return list(found.values())


def _package(klass: type) -> str:
    return (getattr(klass, "__module__", None) or "").split(".")[0]


def _field_names(klass: type) -> set[str]:
    """The names of `klass`'s fields: dataclass fields, annotated attributes."""
    own = vars(klass)
    return {*own.get("__dataclass_fields__", {}), *own.get("__annotations__", {})}


def _accessors(attribute: Any) -> list[Any]:
    """The functions a class attribute runs as methods."""
    if isinstance(attribute, staticmethod | classmethod):
        return [attribute.__func__]
    if isinstance(attribute, property):
        return [f for f in (attribute.fget, attribute.fset, attribute.fdel) if f]
    return [attribute]


def _defined_in(function: types.FunctionType, klass: type) -> bool:
    """Whether `function`'s `def` is in `klass`'s body."""
    owner, _, name = function.__qualname__.rpartition(".")
    return owner == klass.__qualname__ and name != "<lambda>"


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
    """`name = expr` -> `name = tap(key, "prefix" "name", expr, where)`, in the
    function's own body (not in the functions or classes it defines)."""

    def __init__(self, key: int, prefix: str, source: str, where: _Where):
        self.key, self.prefix, self.source, self.where = key, prefix, source, where
        self.depth = 0

    def _tapped(self, name: str, node: ast.stmt, value: ast.expr) -> ast.expr:
        imported = ast.Call(
            ast.Name("__import__", ast.Load()),
            [ast.Constant(_HERE), ast.Constant(None), ast.Constant(None)],
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


def _compiled(
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
