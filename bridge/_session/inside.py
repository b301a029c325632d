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
so a probe rebuilt from its leaves (under `jax.jit`, by discovery's
`jax.eval_shape`, by a `jax.tree.map` over it) still looks inside, and whose
discovery and runs make it the `Inside` of every session made meanwhile
(`bridge._session.context.INSIDE`), by the core or by an adapter. This is
the one place `inside` is carried: an adapter's pytree knows nothing of it.
A new probe an adapter makes from parts (a porting side's `with_weights` and
`in_float64`) is given it as its other constructor arguments are, by
`new._looking_inside(probe._inside)`.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import dataclasses
import threading
import weakref
from collections.abc import Iterator, Sequence
from typing import Any, ClassVar

import jax
import numpy as np

from .._errors import (
    BridgeError,
    BridgeNotImplementedError,
    BridgeTypeError,
    BridgeValueError,
)
from .context import INSIDE, current, local_tap
from .inside_functions import BY_KEY, Rewrite, rewrites_of
from .inside_source import SiteSource
from .sites import Site, SiteOrigin, site_name

#: Guards `_SUBCLASSES`.
_lock = threading.Lock()


@dataclasses.dataclass(frozen=True)
class _Unreachable(SiteOrigin):
    """The origin of a local the adapter cannot hand out: `Site.refused`,
    refused before any computation."""

    routes: ClassVar[bool] = True

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
    before = session.naming.counts()
    try:
        with local_tap():
            tapped = session.tap(name, value)
    except BridgeError as refusal:
        if _entered(session, before):
            raise  # not a refusal of the tap: an error of its site's run
        return _unreachable(session, key, name, value, where, refusal)
    traced = _TRACED.get()
    if traced is not None and session.recorder.learns_sites():
        source = BY_KEY[key].sources[where]
        for entered in _entered(session, before):
            traced[entered] = source
    return tapped


def _entered(session: Any, before: dict[str, int]) -> list[str]:
    """The names of the calls the session named since its counts were
    `before`."""
    after = session.naming.counts()
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
        traced[call.name] = BY_KEY[key].sources[where]
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
        rewrites: list[Rewrite] = []
        for entry in entries:
            rewrites.extend(rewrites_of(entry))
        self.rewrites = tuple(dict.fromkeys(rewrites))
        self.keys = frozenset(r.key for r in self.rewrites)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Inside) and other.keys == self.keys

    def __hash__(self) -> int:
        return hash(self.keys)

    def __repr__(self) -> str:
        names = ", ".join(r.name for r in self.rewrites)
        return f"Inside({names})"

    def __copy__(self) -> Inside:
        return self  # one set of rewrites, counted once (`Rewrite.acquire`)

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
    sites = probe._discover(args, kwargs)[0]
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
    if inside is None and not isinstance(probe, _LooksInside):
        return probe  # as the adapter made it
    if not isinstance(probe, _LooksInside):
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
