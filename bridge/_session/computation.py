"""Sites read from the computation JAX builds: one rule per higher-order
primitive, for every adapter.

An adapter reaches a call and reports it (`Session.enter`/`exit`); where the
call runs inside transforms of the model's own code that no route of the
adapter carries, the session binds `site_marker` (an identity primitive
holding the site's name, `bridge._session.liveness`) on its value and its
inputs instead of acting in Python. The model is traced once to a jaxpr, and
`evaluate` runs that jaxpr again with the epsilons and patches planted at the
markers and the values brought out, crossing each higher-order primitive by
one rule (`RULES`), as JAX's own interpreters and Oryx's `harvest` do:

- `jit` (`pjit`), `closed_call`: the body evaluated in place;
- `scan` (which `lax.map`, a static `fori_loop` and every library's scan
  lower to, however the model spells it): the body scanned again, the
  site's epsilon and patch value entering as rows of `xs` and its value
  leaving as rows of `ys` (`(iterations, *value shape)`);
- `cond` (`switch`): every branch returns every site of every branch, zeros
  where its own branch does not hold it, and where it ran (`ran`);
- `remat2` / `checkpoint`: the body checkpointed again with the same policy;
- `while`, `custom_jvp_call`, `custom_vjp_call`, `shard_map` and any other
  primitive holding a jaxpr: refused, one sentence each (`refusal_of`).

The model's own `jax.vmap` needs no rule: it is no primitive in the jaxpr.
The marker's batching rule keeps the mapped value whole, mapped axes first,
so a site inside it holds every mapped example and its epsilon varies per
example.

Discovery reads the same jaxpr (`enclosures`): where each marker sits, so a
site's true shape (stacked over scans, mapped axes first) and its refusal
are known before any work.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import itertools
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from jax.extend.core import Literal

from .._errors import BridgeAssertionError, BridgeRuntimeError
from . import liveness, sites
from .liveness import site_marker
from .routing import CONVERTED, CONVERTED_FIX, UNBOUNDED_LOOP, refusal
from .sites import Site, SiteOrigin, differentiable_part, origin_refusal, routes

#: The part of a call a marker holds: its value, or its positional inputs
#: (recorded only: nothing flows on from them).
VALUE = "value"
INPUTS = "inputs"


@dataclasses.dataclass(frozen=True)
class Enclosure:
    """Where a site's marker sits in the computation.

    Attributes:
      transforms: the higher-order primitives around it, outermost first,
        each `(primitive name, scan length or branch count)`; `jit` and the
        other calls evaluated in place are left out.
      leaves: the marker's operands, abstract, as seen where it is bound
        (one iteration of the scans around it, mapped axes first).
      mapped: how many of the model's own vmaps map it (the probe's is not
        counted).
      in_call: whether a call evaluated in place (a `jax.jit`) holds it.
    """

    transforms: tuple[tuple[str, int], ...]
    leaves: tuple[jax.ShapeDtypeStruct, ...]
    mapped: int = 0
    in_call: bool = False

    @property
    def iterations(self) -> tuple[int, ...]:
        """The lengths of the scans around the site, outermost first."""
        return tuple(n for name, n in self.transforms if name == "scan")

    def blocked(self, site: str) -> str | None:
        """The refusal of the site, where a primitive around it has no rule."""
        for name, _ in reversed(self.transforms):
            if name not in _EXPRESSED:
                return refusal_of(name, site)
        return None


#: The primitives a site can sit in (their rules below), and those evaluated
#: in place, which an `Enclosure` leaves out.
_IN_PLACE = frozenset({"jit", "pjit", "closed_call", "core_call"})
_EXPRESSED = frozenset({"scan", "cond", "remat2", "checkpoint"})

#: Why a primitive without a rule holds no site, and the way out.
_REFUSALS: Mapping[str, tuple[str, str, str]] = {
    "while": (
        # JAX runs a `fori_loop` with traced bounds as a `while_loop` too.
        "jax.lax.while_loop or a jax.lax.fori_loop with traced bounds",
        UNBOUNDED_LOOP,
        "write the loop as a jax.lax.scan, or give a jax.lax.fori_loop Python "
        "int bounds",
    ),
    "custom_jvp_call": (
        "a jax.custom_jvp function",
        "its derivative is the model's own rule, which never sees bridge's epsilon",
        "call the layer outside the custom_jvp function",
    ),
    "custom_vjp_call": (
        "a jax.custom_vjp function",
        "its backward pass is the model's own function, which never sees "
        "bridge's epsilon",
        "call the layer outside the custom_vjp function",
    ),
    "shard_map": (
        "jax.shard_map",
        "bridge does not carry an epsilon into a shard_map's body yet",
        "call the layer outside the shard_map",
    ),
}
_REFUSALS = {
    **_REFUSALS,
    "custom_vjp_call_jaxpr": _REFUSALS["custom_vjp_call"],  # jax < 0.7
}


def refusal_of(primitive: str, site: str) -> str:
    """The one sentence refusing a site inside `primitive`."""
    transform, why, fix = _REFUSALS.get(
        primitive,
        (
            f"JAX's {primitive}",
            "bridge has no rule to carry an epsilon through it",
            "call the layer outside it",
        ),
    )
    return refusal(site, transform, why, fix)


def _traced_apart(site: str, traced_for: str) -> str:
    """The refusal of a call in a function the model's code traced apart."""
    transform = (
        "jax.closure_convert"
        if traced_for == "closure_convert"
        else "a function the model's code traced apart and runs as a jaxpr "
        "(a closure conversion such as equinox.filter_closure_convert, "
        "jax.make_jaxpr)"
    )
    return refusal(site, transform, CONVERTED, CONVERTED_FIX)


def trace_apart(value: Any, base: Any) -> str | None:
    """JAX's name of the trace a tracer among `value`'s leaves belongs to
    (`traced_for`, e.g. `closure_convert`), where it is not `base`, the
    trace the model's call started in; else `None`. Read from JAX's trace
    objects (`Tracer._trace`, the jaxpr trace's debug info), where they are
    not found: `None`."""
    if base is None:
        return None
    for leaf in jax.tree.leaves(value):
        trace = (
            getattr(leaf, "_trace", None) if isinstance(leaf, jax.core.Tracer) else None
        )
        if trace is None:
            continue
        if trace is base:
            return None
        debug = getattr(getattr(trace, "frame", None), "debug_info", None)
        return str(getattr(debug, "traced_for", None) or type(trace).__name__)
    return None


def current_trace() -> Any:
    """The trace JAX traces in now, `None` where this JAX keeps it elsewhere."""
    try:
        from jax._src import core
    except ImportError:  # pragma: no cover
        return None
    return getattr(getattr(core, "trace_ctx", None), "trace", None)


# -- reading the computation -----------------------------------------------------


def _sub_jaxprs(params: Mapping[str, Any]) -> Iterable[tuple[Any, tuple]]:
    """`(jaxpr, consts)` of each jaxpr among an equation's parameters."""
    for value in params.values():
        for item in value if isinstance(value, tuple | list) else (value,):
            # A ClosedJaxpr first: it also answers `eqns` (its jaxpr's).
            if hasattr(item, "jaxpr") and hasattr(item.jaxpr, "eqns"):
                yield item.jaxpr, tuple(item.consts)
            elif hasattr(item, "eqns"):
                yield item, ()


def _extent(eqn: Any) -> int:
    if eqn.primitive.name == "scan":
        return int(eqn.params["length"])
    if eqn.primitive.name == "cond":
        return len(eqn.params["branches"])
    return 0


def enclosures(closed_jaxpr: Any, part: str = VALUE) -> dict[str, Enclosure]:
    """`{site name: Enclosure}` of every marker of `part` (a site's value, or
    a call's inputs) in the jaxpr."""
    found: dict[str, Enclosure] = {}

    def walk(jaxpr: Any, around: tuple[tuple[str, int], ...], in_call: bool) -> None:
        for eqn in jaxpr.eqns:
            if eqn.primitive is site_marker:
                if eqn.params.get("part", VALUE) == part:
                    found[eqn.params["name"]] = Enclosure(
                        around,
                        tuple(
                            jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype)
                            for v in eqn.invars
                        ),
                        eqn.params.get("mapped", 0),
                        in_call,
                    )
                continue
            name = eqn.primitive.name
            inner = around if name in _IN_PLACE else (*around, (name, _extent(eqn)))
            for sub, _ in _sub_jaxprs(eqn.params):
                walk(sub, inner, in_call or name in _IN_PLACE)

    walk(closed_jaxpr.jaxpr, (), False)
    return found


@dataclasses.dataclass(frozen=True)
class NoRule(SiteOrigin):
    """The origin of a site the adapter reported without a route of its own,
    inside a primitive no rule crosses: `blocked` is its refusal, which
    the computation gave already."""

    routes: ClassVar[bool] = True

    blocked: str | None = None


def located(
    sites: list[Site], closed_jaxpr: Any, traced_apart: Mapping[str, str] = {}
) -> list[Site]:
    """The sites of a discovery, each one the adapter gave no origin of its
    own and that sits inside a transform of the model's code (or its own
    `jax.vmap`) given its true shape there, read from the jaxpr: the
    iterations of the scans around it first, then the model's mapped axes,
    then the value; and its refusal where a primitive around it has no
    rule. Other sites (a call on Equinox's loops' control-flow route among
    them) are returned as they are.

    `traced_apart`: `{marker name: JAX's name of the trace}` of the calls
    reported without an origin whose value was a tracer of another trace
    than the model's (`trace_apart`). Where the computation holds such a
    marker inside no primitive at all, the model's code traced the function
    apart and inlined its jaxpr (`jax.closure_convert`,
    `eqx.filter_closure_convert`, `jax.make_jaxpr` evaluated again): one
    trace standing for every call of the function, refused."""
    found = enclosures(closed_jaxpr)
    placed = []
    for site in sites:
        marker = site.traced_as or site.name
        enclosure = found.get(marker)
        routed = routes(site.origin)
        # An adapter's refusal of a call it reports plainly: it names the
        # library's construct (a loop, a solve) the computation sees only as
        # a `while` or a `custom_vjp`.
        named = None if routed else origin_refusal(site.origin, site.name)
        if (
            not routed
            and not named
            and marker in traced_apart
            and enclosure is not None
            and not (enclosure.transforms or enclosure.mapped or enclosure.in_call)
        ):
            sentence = _traced_apart(site.name, traced_apart[marker])
            placed.append(dataclasses.replace(site, origin=NoRule(sentence)))
            continue
        if (
            routed
            or enclosure is None
            or not (enclosure.transforms or enclosure.mapped)
        ):
            # Inside no transform; or a call on the control-flow route
            # (inside Equinox's loops: the one fallback), listed by it.
            placed.append(site)
            continue
        leaves, treedef = jax.tree.flatten(site.struct)
        floats = iter(enclosure.leaves)
        iterations = enclosure.iterations
        whole = []
        for leaf in leaves:
            if leaf is not None and jnp.issubdtype(leaf.dtype, jnp.inexact):
                marked = next(floats)
                # Past the probe's own batch axis, where it maps the value.
                kept = enclosure.mapped + len(leaf.shape)
                shape = marked.shape[len(marked.shape) - kept :]
                leaf = jax.ShapeDtypeStruct((*iterations, *shape), leaf.dtype)
            whole.append(leaf)
        site = dataclasses.replace(
            site, struct=jax.tree.unflatten(treedef, whole), stacked=len(iterations)
        )
        # Listed whole where it is refused too: a site is the same shape
        # whether it can be probed or not.
        blocked = enclosure.blocked(site.name)
        if named:
            placed.append(site)
        elif blocked is not None:
            placed.append(dataclasses.replace(site, origin=NoRule(blocked)))
        else:
            placed.append(dataclasses.replace(site, computed=enclosure))
    return placed


def _names_in(jaxpr: Any, cache: dict[int, frozenset[str]]) -> frozenset[str]:
    """The names of the markers in `jaxpr` and the jaxprs inside it."""
    key = id(jaxpr)
    if key not in cache:
        names: set[str] = set()
        for eqn in jaxpr.eqns:
            if eqn.primitive is site_marker:
                names.add(eqn.params["name"])
            for sub, _ in _sub_jaxprs(eqn.params):
                names |= _names_in(sub, cache)
        cache[key] = frozenset(names)
    return cache[key]


# -- planting ---------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Structure:
    """A marked value's pytree: its array leaves are the marker's operands,
    the other leaves (kept here) are the model's Python objects."""

    treedef: Any
    leaves: tuple
    arrays: tuple[int, ...]

    @classmethod
    def of(cls, value: Any) -> Structure:
        leaves, treedef = jax.tree.flatten(value)
        arrays = tuple(i for i, leaf in enumerate(leaves) if is_array(leaf))
        kept = tuple(None if i in arrays else leaf for i, leaf in enumerate(leaves))
        return cls(treedef, kept, arrays)

    @classmethod
    def of_struct(cls, struct: Any) -> Structure:
        """From a discovered site's `struct` (`sites.abstract`: the arrays'
        `jax.ShapeDtypeStruct`, `None` for the other leaves): where JAX
        served a trace from its cache, this run's Python did not mark the
        value, and the marker found is from the trace that did."""
        leaves, treedef = jax.tree.flatten(struct)
        arrays = tuple(
            i for i, leaf in enumerate(leaves) if isinstance(leaf, jax.ShapeDtypeStruct)
        )
        return cls(treedef, (None,) * len(leaves), arrays)

    def array_leaves(self, value: Any) -> list[Any]:
        leaves = jax.tree.leaves(value)
        return [leaves[i] for i in self.arrays]

    def rebuild(self, arrays: Iterable[Any]) -> Any:
        leaves = list(self.leaves)
        for i, array in zip(self.arrays, arrays, strict=True):
            leaves[i] = array
        return jax.tree.unflatten(self.treedef, leaves)


def mark(name: str, value: Any, part: str = VALUE) -> tuple[Any, Structure]:
    """`value` with its array leaves passed through the marker of site
    `name`'s `part`, and its `Structure`."""
    structure = Structure.of(value)
    arrays = structure.array_leaves(value)
    if not arrays:
        return value, structure
    marked = site_marker.bind(*arrays, name=name, part=part, mapped=0)
    return structure.rebuild(marked), structure


@dataclasses.dataclass(frozen=True)
class Planted:
    """What a run asks of the markers, and how each site's value is rebuilt.

    Attributes:
      structures: `{name: Structure}` of each marked value, and of each
        marked call's inputs under `name + "/inputs"`.
      epsilons: `{name: epsilon}`, the floating leaves' epsilon of the part
        of the computation evaluated now (one iteration's row in a scan).
      patch_values: `{name: value}`, likewise.
      patch_functions: `{name: function of the original value}`.
      recorded: the names whose value (and inputs) are recorded.
      act: `(name, value, patch, epsilon) -> value`: the patch applied and
        checked as the session applies it, and the epsilon added.
      stacked: `{name: how many leading axes are iterations}`.
      dead: the sites discovery found dead (their value reaches no output).
      patched: whether the run patches any site (a patch downstream may cut
        a site off the outputs, as it should).
    """

    structures: Mapping[str, Structure]
    epsilons: Mapping[str, Any]
    patch_values: Mapping[str, Any]
    patch_functions: Mapping[str, Callable]
    recorded: frozenset[str]
    act: Callable[[str, Any, Any, Any], Any]
    stacked: Mapping[str, int] = dataclasses.field(default_factory=dict)
    dead: frozenset[str] = frozenset()
    patched: bool = False
    names_cache: dict = dataclasses.field(default_factory=dict, compare=False)

    @property
    def asked(self) -> frozenset[str]:
        return (
            frozenset(self.recorded)
            | set(self.patch_values)
            | set(self.patch_functions)
        )

    def inner(self, epsilons: Mapping[str, Any], patch_values: Mapping[str, Any]):
        return dataclasses.replace(self, epsilons=epsilons, patch_values=patch_values)

    def here(self, jaxpr: Any) -> frozenset[str]:
        """The asked names inside `jaxpr`."""
        return _names_in(jaxpr, self.names_cache) & self.asked

    def within(self, names: Iterable[str]) -> tuple[dict, dict]:
        """The epsilons and patch values of the sites `names`: what enters a
        higher-order primitive that holds them."""
        names = frozenset(names)
        return (
            {n: e for n, e in self.epsilons.items() if n in names},
            {n: v for n, v in self.patch_values.items() if n in names},
        )


@dataclasses.dataclass
class Records:
    """What a part of the computation brings out: `{name: value}`,
    `{name: inputs}` and `{name: where it ran}`."""

    values: dict[str, Any] = dataclasses.field(default_factory=dict)
    inputs: dict[str, Any] = dataclasses.field(default_factory=dict)
    ran: dict[str, Any] = dataclasses.field(default_factory=dict)

    def as_tree(self) -> tuple[dict, dict, dict]:
        return self.values, self.inputs, self.ran

    @classmethod
    def of_tree(cls, tree: tuple[dict, dict, dict]) -> Records:
        return cls(*map(dict, tree))

    def update(self, other: Records) -> None:
        for mine, theirs in zip(self.as_tree(), other.as_tree(), strict=True):
            clash = set(mine) & set(theirs)
            if clash:
                raise BridgeAssertionError(f"site {sorted(clash)[0]!r} recorded twice")
            mine.update(theirs)


def evaluate(
    jaxpr: Any,
    consts: Iterable[Any],
    args: Iterable[Any],
    planted: Planted,
    layers: Mapping[int, Layer] = {},
) -> tuple[list[Any], Records]:
    """Run `jaxpr` on `args` with `planted` acted out at its markers:
    `(outputs, Records)`. Each of `layers` (`stacked_layers`, by its first
    equation) runs as one function that every layer computing the same
    shares (`_run_layer`)."""
    env: dict[Any, Any] = {}

    def read(atom: Any) -> Any:
        return atom.val if isinstance(atom, Literal) else env[atom]

    for var, value in zip(jaxpr.constvars, consts, strict=True):
        env[var] = value
    for var, value in zip(jaxpr.invars, args, strict=True):
        env[var] = value
    records = Records()
    shared: dict[tuple, Callable] = {}
    eqns = jaxpr.eqns
    index = 0
    while index < len(eqns):
        layer = layers.get(index)
        if layer is not None and layer.shareable(planted):
            invals = [read(v) for v in layer.inputs]
            outvals, inner = _run_layer(layer, invals, planted, shared)
            records.update(inner)
            for var, value in zip(layer.outputs, outvals, strict=True):
                env[var] = value
            index = layer.stop
            continue
        eqn = eqns[index]
        index += 1
        invals = [read(v) for v in eqn.invars]
        if eqn.primitive is site_marker:
            outvals = _at_marker(eqn.params, invals, planted, records)
        else:
            rule = RULES.get(eqn.primitive.name)
            inside = any(planted.here(sub) for sub, _ in _sub_jaxprs(eqn.params))
            if inside:
                if rule is None:
                    raise BridgeAssertionError(
                        f"no rule carries a site through {eqn.primitive.name}: "
                        "discovery should have refused it"
                    )
                outvals, inner = rule(eqn, invals, planted)
                records.update(inner)
            else:
                outvals = _bind(eqn, invals)
        if not eqn.primitive.multiple_results:
            outvals = [outvals]
        for var, value in zip(eqn.outvars, outvals, strict=True):
            env[var] = value
    return [read(v) for v in jaxpr.outvars], records


# -- a stack of layers: one shared function ----------------------------------------

#: What stands for a layer's own name in the jaxpr its stack shares.
_LAYER = "@"


@dataclasses.dataclass(frozen=True)
class Layer:
    """Equations `start:stop` of a jaxpr: one call of a stack of layers that
    compute the same (its value's marker last), as a jaxpr of its own whose
    markers are named relative to the call (`name` becomes `_LAYER`).

    JAX linearizes an inner `jax.jit` once per jaxpr and serves every later
    call of it from its cache, but `jax.numpy`'s functions are inlined into
    the jaxpr discovery traces: evaluated equation by equation, a stack of
    twelve layers is linearized twelve times (`benchmarks/RESULTS_tpu.md`,
    "Where a cold lowering goes"). Run as one shared function, once."""

    start: int
    stop: int
    name: str
    inputs: tuple
    outputs: tuple
    shared: Any
    key: str
    names: frozenset[str]

    def relative(self, name: str) -> str:
        return _relative(self.name, name)

    def absolute(self, relative: str) -> str:
        return self.name + relative[len(_LAYER) :]

    def holds(self, name: str) -> bool:
        return _holds(self.name, name)

    def shareable(self, planted: Planted) -> bool:
        """Whether this run acts on the layer's sites by epsilons and
        recordings alone: a patch is applied, and checked, under the site's
        own name."""
        patched = set(planted.patch_values) | set(planted.patch_functions)
        return not (patched & self.names)


def _relative(call: str, name: str) -> str:
    return _LAYER + name[len(call) :]


def _holds(call: str, name: str) -> bool:
    return name == call or name.startswith(call + "/")


def stacked_layers(jaxpr: Any) -> dict[int, Layer]:
    """`{first equation: Layer}` of the calls of `jaxpr` that compute the same
    as another: the calls at the shallowest depth of names (`a/b` is
    deeper than `a`) where two do; `{}` where none does, or where this JAX's
    jaxprs cannot be cut (the run then evaluates equation by equation)."""
    eqns = jaxpr.eqns
    markers = [
        (i, eqn.params["name"])
        for i, eqn in enumerate(eqns)
        if eqn.primitive is site_marker and eqn.params.get("part", VALUE) == VALUE
    ]
    last_use: dict[Any, int] = {}
    for i, eqn in enumerate(eqns):
        for var in eqn.invars:
            if not isinstance(var, Literal):
                last_use[var] = i
    for var in jaxpr.outvars:
        if not isinstance(var, Literal):
            last_use[var] = len(eqns)
    for depth in sorted({name.count("/") for _, name in markers})[:3]:
        ends = [(i, name) for i, name in markers if name.count("/") == depth]
        starts = [0, *(i + 1 for i, _ in ends[:-1])]
        # Only calls whose primitives match another's are compared in full.
        outline = {
            start: (
                stop - start,
                tuple(e.primitive.name for e in eqns[start : stop + 1]),
            )
            for start, (stop, _) in zip(starts, ends, strict=True)
        }
        counts = collections.Counter(outline.values())
        repeated = {o for o, count in counts.items() if count > 1}
        try:
            layers = [
                _layer(jaxpr, start, stop + 1, name, last_use)
                for start, (stop, name) in zip(starts, ends, strict=True)
                if outline[start] in repeated
            ]
        except (AttributeError, TypeError):  # pragma: no cover - another JAX
            return {}
        keys = collections.Counter(layer.key for layer in layers)
        found = {layer.start: layer for layer in layers if keys[layer.key] > 1}
        if found:
            return found
    return {}


def _layer(
    jaxpr: Any, start: int, stop: int, name: str, last_use: Mapping[Any, int]
) -> Layer:
    eqns = jaxpr.eqns[start:stop]
    defined: set[Any] = set()
    inputs: dict[Any, None] = {}  # in order of first use
    for eqn in eqns:
        for var in eqn.invars:
            if not isinstance(var, Literal) and var not in defined:
                inputs.setdefault(var)
        defined.update(eqn.outvars)
    outputs = [
        var for eqn in eqns for var in eqn.outvars if last_use.get(var, -1) >= stop
    ]
    # JAX's debug info, its argument and result names unknown ("", as JAX
    # writes them): jax 0.5 to 0.9 warn of a jaxpr built without one.
    debug = getattr(jaxpr, "debug_info", None)
    if debug is not None:
        debug = debug._replace(
            arg_names=("",) * len(inputs), result_paths=("",) * len(outputs)
        )
    own = jaxpr.replace(
        constvars=[], invars=list(inputs), outvars=outputs, eqns=eqns, debug_info=debug
    )
    names = _names_in(own, {})
    renames = {n: _relative(name, n) for n in names if _holds(name, n)}
    shared = _stripped(own, {}, renames)
    # A marker of another call inside it (named absolutely): no other layer
    # computes the same.
    key = str(shared) if len(renames) == len(names) else f"{start}"
    return Layer(start, stop, name, tuple(inputs), tuple(outputs), shared, key, names)


def _run_layer(
    layer: Layer, invals: list[Any], planted: Planted, shared: dict[tuple, Callable]
) -> tuple[list[Any], Records]:
    """`layer` run by the function its stack shares in this evaluation (one
    per request of the layer's sites), and what it brings out, named again
    under the layer's own name."""
    names = layer.names
    recorded = frozenset(layer.relative(n) for n in planted.recorded & names)
    epsilons = {layer.relative(n): e for n, e in planted.epsilons.items() if n in names}
    key = (layer.key, recorded, frozenset(epsilons))
    run = shared.get(key)
    if run is None:
        inner = Planted(
            structures={
                layer.relative(n): s
                for n, s in planted.structures.items()
                if layer.holds(n)
            },
            epsilons={},
            patch_values={},
            patch_functions={},
            recorded=recorded,
            act=planted.act,
            stacked={
                layer.relative(n): k for n, k in planted.stacked.items() if n in names
            },
            dead=frozenset(layer.relative(n) for n in planted.dead & names),
            patched=planted.patched,
        )

        def shared_layer(invals, epsilons):
            outvals, records = evaluate(
                layer.shared, [], invals, inner.inner(epsilons, {})
            )
            return outvals, records.as_tree()

        run = shared[key] = jax.jit(shared_layer)
    outvals, tree = run(invals, epsilons)
    return list(outvals), Records.of_tree(
        tuple({layer.absolute(n): v for n, v in part.items()} for part in tree)
    )


def _bind(eqn: Any, invals: list[Any]) -> Any:
    """The equation bound again as the model's code bound it, with its
    source location and name stack (an error JAX raises there names the
    model's line; the lowered program keeps its op names)."""
    params = eqn.primitive.get_bind_params(eqn.params)
    subfuns: tuple = ()
    if isinstance(params, tuple):  # jax < 0.5: (subfuns, params)
        subfuns, params = params
    with _at_source(eqn):
        return eqn.primitive.bind(*subfuns, *invals, **params)


def _at_source(eqn: Any) -> Any:
    """JAX's own context for re-binding an equation (`jax.core.eval_jaxpr`
    does the same), or none where this JAX's is not found."""
    try:
        from jax._src import source_info_util
    except ImportError:  # pragma: no cover
        return contextlib.nullcontext()
    name_stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
    return source_info_util.user_context(
        eqn.source_info.traceback, name_stack=name_stack
    )


def _at_marker(
    params: Mapping[str, Any], invals: list[Any], planted: Planted, records: Records
) -> list[Any]:
    name = params["name"]
    if params.get("part", VALUE) == INPUTS:
        # Read where the run records inputs (its discovery marked every call's).
        structure = planted.structures.get(f"{name}/inputs")
        if name in planted.recorded and structure is not None:
            records.inputs[name] = structure.rebuild(invals)
        return invals
    if name not in planted.asked:
        return invals
    structure = planted.structures[name]
    value = structure.rebuild(invals)
    patch = planted.patch_values.get(name, planted.patch_functions.get(name))
    value = planted.act(name, value, patch, planted.epsilons.get(name))
    if name in planted.recorded:
        records.values[name] = value
    return structure.array_leaves(value)


def is_array(leaf: Any) -> bool:
    """What a marker holds of a value, at discovery and in a run alike (a
    trace JAX caches is read by a later pass): every array leaf, NumPy's
    included (`sites.is_array`), floating or not."""
    return sites.is_array(leaf) or hasattr(leaf, "aval")


# -- one rule per higher-order primitive ---------------------------------------------


def _in_place(eqn, invals, planted):
    (sub, consts), *_ = _sub_jaxprs(eqn.params)
    return evaluate(sub, consts, invals, planted)


def _scan(eqn, invals, planted):
    params = eqn.params
    body = params["jaxpr"]
    num_consts, num_carry = params["num_consts"], params["num_carry"]
    consts = invals[:num_consts]
    init = invals[num_consts : num_consts + num_carry]
    xs = invals[num_consts + num_carry :]
    names = planted.here(body.jaxpr)
    epsilons, patch_values = planted.within(names)

    def step(carry, sliced):
        x, epsilon_rows, patch_rows = sliced
        outputs, records = evaluate(
            body.jaxpr,
            body.consts,
            [*consts, *carry, *x],
            planted.inner(epsilon_rows, patch_rows),
        )
        return outputs[:num_carry], (outputs[num_carry:], records.as_tree())

    carry, (ys, records) = jax.lax.scan(
        step,
        list(init),
        (list(xs), epsilons, patch_values),
        length=params["length"],
        reverse=params["reverse"],
        unroll=params.get("unroll", 1),
    )
    return [*carry, *ys], Records.of_tree(records)


def _cond(eqn, invals, planted):
    branches = eqn.params["branches"]
    index, *operands = invals
    names = frozenset().union(*(planted.here(b.jaxpr) for b in branches))
    epsilons, patch_values = planted.within(names)

    def run_branch(branch, operands, epsilons, patch_values):
        outputs, records = evaluate(
            branch.jaxpr, branch.consts, operands, planted.inner(epsilons, patch_values)
        )
        return outputs, records.as_tree()

    # What each branch records, abstractly: every branch must return every
    # branch's records, zeros where its own does not hold the site.
    shapes = [
        jax.eval_shape(
            lambda *a, b=branch: run_branch(b, *a)[1], operands, epsilons, patch_values
        )
        for branch in branches
    ]
    every: tuple[dict, dict, dict] = ({}, {}, {})
    for recorded in shapes:
        for mine, theirs in zip(every, recorded, strict=True):
            mine.update(theirs)
    values_of, inputs_of, ran_of = every
    held = sorted({*values_of, *inputs_of})

    def full(branch, own):
        def run(operands, epsilons, patch_values):
            outputs, (values, inputs, ran) = run_branch(
                branch, operands, epsilons, patch_values
            )
            mine = {*own[0], *own[1]}
            return outputs, (
                {n: values.get(n, _zeros(values_of[n])) for n in values_of},
                {n: inputs.get(n, _zeros(inputs_of[n])) for n in inputs_of},
                {
                    # Where a site in a branch inside this one ran: where both did.
                    n: ran[n]
                    if n in ran
                    else jnp.full(
                        ran_of[n].shape if n in ran_of else (), n in mine, jnp.bool_
                    )
                    for n in held
                },
            )

        return run

    outputs, records = jax.lax.switch(
        index,
        [full(b, own) for b, own in zip(branches, shapes, strict=True)],
        operands,
        epsilons,
        patch_values,
    )
    return outputs, Records.of_tree(records)


def _zeros(tree: Any) -> Any:
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), tree)


def _checkpoint(eqn, invals, planted):
    params = eqn.params
    body = params["jaxpr"]
    names = planted.here(body)
    epsilons, patch_values = planted.within(names)

    def run(invals, epsilons, patch_values):
        outputs, records = evaluate(
            body, (), invals, planted.inner(epsilons, patch_values)
        )
        return outputs, records.as_tree()

    outputs, records = jax.checkpoint(
        run, prevent_cse=params.get("prevent_cse", True), policy=params.get("policy")
    )(list(invals), epsilons, patch_values)
    return outputs, Records.of_tree(records)


#: `primitive name -> rule(eqn, invals, planted) -> (outputs, Records)`.
RULES: Mapping[str, Callable] = {
    "jit": _in_place,
    "pjit": _in_place,
    "closed_call": _in_place,
    "core_call": _in_place,
    "scan": _scan,
    "cond": _cond,
    "remat2": _checkpoint,
    "checkpoint": _checkpoint,
}


def run_planted(closed_jaxpr: Any, shapes: Any, planted: Planted) -> Any:
    """`closed_jaxpr` (a trace returning `(outputs, state, activations,
    inputs, ran)`, abstractly `shapes`) evaluated with `planted` acted on:
    the planted sites' records joined to the session's."""
    _check_reached(closed_jaxpr, planted)
    _check_carried_on(closed_jaxpr, planted)
    flat, records = evaluate(closed_jaxpr.jaxpr, closed_jaxpr.consts, (), planted)
    outputs, state, activations, inputs, ran = jax.tree.unflatten(
        jax.tree.structure(shapes), flat
    )
    _join(records, planted, activations, inputs, ran)
    return outputs, state, activations, inputs, ran


def _join(
    records: Records, planted: Planted, activations: dict, inputs: dict, ran: dict
) -> None:
    """The records of the planted sites, as the session keeps them."""
    for name, value in records.values.items():
        activations[name] = differentiable_part(value)
    inputs.update(records.inputs)
    for name, where in records.ran.items():
        # A site in a scan inside a branch ran at every iteration where the
        # branch did.
        leaf = jax.tree.leaves(records.values.get(name, records.inputs.get(name)))[0]
        ran[name] = jnp.broadcast_to(where, leaf.shape[: planted.stacked[name]])


# -- discovery's computation, evaluated again by later runs ---------------------------


@dataclasses.dataclass(frozen=True)
class ProbeVmap:
    """The probe's `vmap=True` around an evaluation of one example's trace.

    Attributes:
      axis_name: the probe's batch axis, named as in the model's collectives.
      inputs: per input of the jaxpr, its mapped axis (`0`) or `None`.
      outputs: per output of the jaxpr, `0` (the model's outputs) or `None`
        (its state, the same for every example).
    """

    axis_name: str
    inputs: tuple[int | None, ...]
    outputs: tuple[int | None, ...]

    def mapped(self, evaluated: Callable, stacked: Mapping[str, int]) -> Callable:
        """`evaluated` mapped over the batch: each epsilon, patch value and
        record holds the batch axis after the iterations of the scans around
        its site (`stacked`), as the result does."""

        def run(inputs, epsilons, patch_values):
            flat, *records = jax.vmap(
                evaluated,
                in_axes=(
                    list(self.inputs),
                    {name: stacked[name] for name in epsilons},
                    {name: stacked[name] for name in patch_values},
                ),
                out_axes=(list(self.outputs), 0, 0, 0),
                axis_name=self.axis_name,
            )(inputs, epsilons, patch_values)
            return flat, *(
                {
                    name: jax.tree.map(
                        lambda v, k=stacked[name]: jnp.moveaxis(v, 0, k), value
                    )
                    for name, value in found.items()
                }
                for found in records
            )

        return run


@dataclasses.dataclass(frozen=True, eq=False)
class Replay:
    """Discovery's trace of the model, kept so that a run evaluates it rather
    than tracing the model's Python again: one Python trace per call
    structure, whatever the number of runs and of `jax.jit` traces.

    Discovery traces the model once to a jaxpr whose inputs are the probe's
    leaves, the trainable leaves and the call's arrays, and marks every
    site. A run whose selected and patched sites are all markable (`serves`)
    evaluates that jaxpr (`replay`, through `evaluation`) with its epsilons
    and patches planted at the markers, as `run_planted` does for a run's
    own trace: the model's
    Python, the adapter's routes and the session's bookkeeping do not run
    again. Under the probe's `vmap=True` the jaxpr is one example's, and the
    evaluation is mapped over the batch (`ProbeVmap`): a branch on a
    per-example predicate is a `cond` there, whose rule brings out where
    each example's branch ran.

    Attributes:
      closed_jaxpr: discovery's jaxpr; its outputs are the array leaves of
        the model's `(outputs, state)`.
      outputs: `(treedef, leaves)` of `(outputs, state)`, `None` where an
        array leaf goes.
      markable: the sites acted on correctly at their marker: one marker
        each, every primitive around it crossed by a rule, and its value at
        the marker laid out as its epsilon is (the iterations of the scans
        around it, the batch axis, the model's mapped axes, the value).
      inputs: `{name: Structure}` of the inputs of each markable site whose
        call's inputs discovery marked once, where its value is marked (the
        same transforms around, the same axes first): a run that records
        inputs (`with_inputs=True`) reads them there.
      vmapped: how the probe's `vmap=True` maps the evaluation, else `None`.
    """

    closed_jaxpr: Any
    outputs: tuple[Any, list]
    markable: frozenset[str]
    inputs: Mapping[str, Structure] = dataclasses.field(default_factory=dict)
    vmapped: ProbeVmap | None = None
    _evaluations: dict = dataclasses.field(default_factory=dict, repr=False)

    @functools.cached_property
    def _layers(self) -> dict[int, Layer]:
        """The jaxpr's stacks of layers (`stacked_layers`), found at its
        first evaluation."""
        return stacked_layers(self.closed_jaxpr.jaxpr)

    def evaluation(self, planted: Planted) -> Callable:
        """The jaxpr evaluated with what `planted` asks, as one `jax.jit` of
        `(inputs, epsilons, patch values) -> (outputs, activations, inputs,
        ran)`, one per
        request (the sites, the patch functions): a later trace of the step
        binds that one call, and JAX's caches serve its differentiation, where
        binding each equation again would differentiate each one anew (JAX's
        own `jax.numpy` functions, inlined into discovery's jaxpr)."""
        key = (
            planted.recorded,
            frozenset(planted.epsilons),
            frozenset(planted.patch_values),
            tuple(sorted((n, id(f)) for n, f in planted.patch_functions.items())),
            planted.patched,
        )
        found = self._evaluations.get(key)
        if found is None:
            closed = self.closed_jaxpr
            layers = self._layers

            def evaluated(inputs, epsilons, patch_values):
                flat, records = evaluate(
                    closed.jaxpr,
                    closed.consts,
                    inputs,
                    planted.inner(epsilons, patch_values),
                    layers,
                )
                activations: dict[str, Any] = {}
                recorded_inputs: dict[str, Any] = {}
                ran: dict[str, Any] = {}
                _join(records, planted, activations, recorded_inputs, ran)
                return flat, activations, recorded_inputs, ran

            if self.vmapped is not None:
                evaluated = self.vmapped.mapped(evaluated, planted.stacked)
            if len(self._evaluations) >= _EVALUATIONS_KEPT:
                self._evaluations.clear()  # a new patch function every call
            found = self._evaluations.setdefault(key, jax.jit(evaluated))
        return found

    @classmethod
    def of_discovery(
        cls,
        closed_jaxpr: Any,
        outputs: tuple[Any, list],
        sites_found: Iterable[Site],
        vmapped: ProbeVmap | None = None,
        input_structures: Mapping[str, Structure] | None = None,
    ) -> Replay | None:
        """The replay of a discovery, or `None` where no run could use it: a
        constant of the trace belongs to an enclosing trace (a model closing
        over a traced value: a later trace cannot use it). Where discovery
        renamed a call (it met a trace JAX discards first: a scan body traced
        twice, Flax's pass over an `nn.scan` body before the scan), the
        markers kept, which hold the names the calls were traced under, are
        given the public names."""
        sites_found = list(sites_found)
        if any(isinstance(c, jax.core.Tracer) for c in closed_jaxpr.consts):
            return None
        renames = {
            site.traced_as: site.name
            for site in sites_found
            if site.traced_as not in (None, site.name)
        }
        closed_jaxpr = _without_discovery_metadata(closed_jaxpr, renames)
        if closed_jaxpr is None:
            return None
        counts: dict[tuple[str, str], int] = {}
        passed_by: set[str] = set()
        _census(closed_jaxpr.jaxpr, counts, passed_by)
        found = enclosures(closed_jaxpr)
        markable = frozenset(
            site.name
            for site in sites_found
            if counts.get((site.name, VALUE)) == 1
            and site.name not in passed_by
            and _acted_on_at_marker(site, found[site.name])
        )
        # Walked only where the discovery marked inputs (a plain one did not).
        found_inputs = enclosures(closed_jaxpr, INPUTS) if input_structures else {}
        # Marked under the names the calls were traced under.
        input_structures = {
            site.name: input_structures[site.traced_as or site.name]
            for site in sites_found
            if (site.traced_as or site.name) in (input_structures or {})
        }
        inputs = {
            name: structure
            for name, structure in input_structures.items()
            if name in markable
            and counts.get((name, INPUTS)) == 1
            and _inputs_beside_value(found_inputs[name], found[name])
        }
        return cls(closed_jaxpr, outputs, markable, inputs, vmapped)

    def serves(self, names: Iterable[str], inputs_of: Iterable[str] = ()) -> bool:
        """Whether a run acting on the sites `names`, and recording the
        inputs of `inputs_of`, can evaluate this trace."""
        return frozenset(names) <= self.markable and self.inputs.keys() >= set(
            inputs_of
        )


def _without_discovery_metadata(
    closed_jaxpr: Any, renames: Mapping[str, str] = {}
) -> Any:
    """`closed_jaxpr` with `fresh_traces`' XLA metadata taken off every
    equation, and each marker named in `renames` (`{traced as: public
    name}`) given its public name; `None` where this JAX's equation context
    is not one known here. An evaluation binds the top-level equations again
    in the run's own context, but keeps the jaxprs inside those it binds
    whole (a scan body without a site, a `custom_jvp` function's): their
    equations would carry the key into the compiled program as frontend
    attributes."""
    try:
        return _stripped(closed_jaxpr, {}, renames)
    except (AttributeError, TypeError):  # pragma: no cover - another JAX
        return None


def _stripped(value: Any, done: dict[Any, Any], renames: Mapping[str, str]) -> Any:
    key = id(value)
    if key in done:
        return done[key]
    if type(value) in (tuple, list):  # not a NamedTuple of parameters
        result = type(value)(_stripped(item, done, renames) for item in value)
    elif hasattr(value, "consts") and hasattr(value, "jaxpr"):  # a ClosedJaxpr
        result = value.replace(jaxpr=_stripped(value.jaxpr, done, renames))
    elif hasattr(value, "eqns"):  # a Jaxpr
        result = value.replace(
            eqns=[
                eqn.replace(
                    params=_renamed(
                        eqn,
                        {k: _stripped(v, done, renames) for k, v in eqn.params.items()},
                        renames,
                    ),
                    ctx=_context_without_discovery(eqn.ctx, done),
                )
                for eqn in value.eqns
            ]
        )
    else:
        return value
    done[key] = result
    return result


def _renamed(eqn: Any, params: dict[str, Any], renames: Mapping[str, str]) -> dict:
    """A marker's `params` with its public name, where `renames` has one."""
    if eqn.primitive is site_marker and params.get("name") in renames:
        return {**params, "name": renames[params["name"]]}
    return params


def _context_without_discovery(ctx: Any, done: dict[Any, Any]) -> Any:
    """JAX's equation context `ctx` without `fresh_traces`' key, one per
    context (its layouts: an interned class with slots from jax 0.8, a
    constructor before; `TypeError` where neither fits)."""
    metadata = getattr(ctx, "xla_metadata", None)
    if not metadata or _DISCOVERY_KEY not in dict(metadata):
        return ctx
    key = ("context", id(ctx))
    if key in done:
        return done[key]
    kept = {k: v for k, v in dict(metadata).items() if k != _DISCOVERY_KEY} or None
    if hasattr(type(ctx), "_create"):
        new = object.__new__(type(ctx))
        for name in type(ctx).__slots__:
            if name != "__weakref__" and hasattr(ctx, name):
                object.__setattr__(new, name, getattr(ctx, name))
        object.__setattr__(new, "xla_metadata", kept)
    else:
        new = type(ctx)(ctx.compute_type, ctx.threefry_partitionable, kept)
        for name in getattr(type(ctx), "__slots__", ()):
            if name != "xla_metadata" and hasattr(ctx, name):
                setattr(new, name, getattr(ctx, name))
    done[key] = new
    return new


#: How many requests' evaluations a `Replay` keeps.
_EVALUATIONS_KEPT = 32


def _census(
    jaxpr: Any, counts: dict[tuple[str, str], int], passed_by: set[str]
) -> None:
    """How many markers of each name and part the jaxpr binds (a jaxpr called
    twice counted twice), and the sites whose marked value the model does
    not go on with while it uses the value the marker was given (an
    adapter's route that passed the unmarked value on at discovery): acting
    at such a marker would change nothing the model computes, a silent
    zero."""
    uses: dict[Any, int] = {}
    for var in [*(v for eqn in jaxpr.eqns for v in eqn.invars), *jaxpr.outvars]:
        if not isinstance(var, Literal):
            uses[var] = uses.get(var, 0) + 1
    for eqn in jaxpr.eqns:
        if eqn.primitive is not site_marker:
            for sub, _ in _sub_jaxprs(eqn.params):
                _census(sub, counts, passed_by)
            continue
        name, part = eqn.params["name"], eqn.params.get("part", VALUE)
        counts[name, part] = counts.get((name, part), 0) + 1
        if part != VALUE:
            continue  # a call's inputs are read at their marker, not changed
        for given, marked in zip(eqn.invars, eqn.outvars, strict=True):
            own = sum(1 for v in eqn.invars if v is given)
            if (
                not isinstance(given, Literal)
                and not uses.get(marked)
                and uses.get(given, 0) > own
            ):
                passed_by.add(name)


def _acted_on_at_marker(site: Site, enclosure: Enclosure) -> bool:
    """Whether acting on `site` (one example's, under the probe's vmap) at
    its marker is what its run does: no refusal, every primitive around it
    crossed by a rule, and the site's value laid out as the marker's
    operands with the iterations of the scans around it first (a site whose
    adapter's route brings out where it ran, in a branch the model's own
    vmap turned into a select, is left to that route: the computation holds
    no branch there)."""
    if site.refused or enclosure.blocked(site.name) is not None:
        return False
    if _ran_known_to_its_route(site) and all(
        name != "cond" for name, _ in enclosure.transforms
    ):
        return False
    leaves = [leaf for leaf in jax.tree.leaves(site.struct) if hasattr(leaf, "shape")]
    if len(leaves) != len(enclosure.leaves):
        return False
    iterations = enclosure.iterations
    return all(
        tuple(leaf.shape) == (*iterations, *marked.shape) and leaf.dtype == marked.dtype
        for leaf, marked in zip(leaves, enclosure.leaves, strict=True)
    )


def _inputs_beside_value(inputs: Enclosure, value: Enclosure) -> bool:
    """Whether a call's inputs, read at their marker, are laid out as its
    value is at its own: the same transforms around both, the same mapped
    axes first."""
    return inputs.transforms == value.transforms and inputs.mapped == value.mapped


def _ran_known_to_its_route(site: Site) -> bool:
    """Whether the adapter's route brings out where `site` ran (a call in a
    branch: `SiteOrigin.backward_recorders` gives a recorder of it)."""
    recorders = getattr(site.origin, "backward_recorders", None)
    if site.computed is not None or not callable(recorders):
        return False
    found = recorders(site, False)
    return found is not None and found[1] is not None


def replay(kept: Replay, inputs: Iterable[Any], planted: Planted) -> Any:
    """Discovery's jaxpr evaluated on `inputs` (its flat inputs: the probe's
    leaves, the trainable leaves, the call's arrays) with `planted` acted
    on: `(outputs, state, activations, inputs, ran)`."""
    # Every site asked for is `markable`: its marker is in the jaxpr, and
    # discovery judged the jaxpr's liveness itself (`Site.dead`).
    flat, activations, recorded_inputs, ran = kept.evaluation(planted)(
        list(inputs), dict(planted.epsilons), dict(planted.patch_values)
    )
    treedef, leaves = kept.outputs
    computed = iter(flat)
    outputs, state = jax.tree.unflatten(
        treedef, [next(computed) if leaf is None else leaf for leaf in leaves]
    )
    return outputs, state, activations, recorded_inputs, ran


_discoveries = itertools.count()
#: The XLA metadata key of a discovery's trace context.
_DISCOVERY_KEY = "bridge_discovery"


def fresh_traces() -> contextlib.AbstractContextManager[Any]:
    """A trace context no earlier trace had, so that none of JAX's caches of
    traced functions (a `lax.cond` branch, a scan body, an inner `jax.jit`,
    kept by function and trace context) serves a discovery: it runs the
    model's Python, and so sees every call. XLA metadata is part of JAX's
    trace context; discovery's jaxpr is never compiled, so the metadata on
    its equations costs nothing. A later run may be served a trace a
    discovery made: its markers are there (`Structure.of_struct`). Without
    the API (JAX before `jax.experimental.xla_metadata`), nothing.

    Within the discovery the context is renewed after a call inside a
    traced function (`renew_traces`): a function JAX traces again is then
    not served the trace it made of an earlier call either."""
    try:
        from jax.experimental.xla_metadata import set_xla_metadata
    except ImportError:  # pragma: no cover
        return contextlib.nullcontext()
    return _FreshTraces(set_xla_metadata)


class _FreshTraces:
    """`fresh_traces`' context: one key per discovery, renewed where a call
    was reported inside a function JAX traces, and all of them undone at
    its end (each nested in the one before)."""

    def __init__(self, set_xla_metadata: Callable[..., Any]):
        self._set = set_xla_metadata
        self._contexts = contextlib.ExitStack()
        self._outer: _FreshTraces | None = None
        # The trace of the last call after which the context was renewed.
        self.renewed_in: Any = None

    def __enter__(self) -> _FreshTraces:
        self.renew()
        self._outer = getattr(_renewing, "traces", None)
        _renewing.traces = self
        return self

    def renew(self) -> None:
        self._contexts.enter_context(self._set(**{_DISCOVERY_KEY: next(_discoveries)}))

    def __exit__(self, *exc_info: Any) -> None:
        _renewing.traces = self._outer
        self._contexts.close()


#: The discovery's `_FreshTraces` on this thread, while it traces.
_renewing = threading.local()


def renew_traces(base: Any) -> None:
    """After a call reported inside a function JAX traces to a jaxpr (a
    `jax.checkpoint`ed function, a scan body, a branch: not `base`, the
    trace the model's call started in, nor a `jax.vmap`'s), a new trace
    context for the rest of the discovery: JAX caches such a function's
    trace by the function, its inputs' types and the trace context, so the
    same function called again (a block `nnx.remat`ed and called twice)
    would otherwise be served the first call's trace and run no Python, and
    its calls be no sites. Only there, and once per trace of such a
    function (its first call's exit): elsewhere JAX's caches of
    `jax.numpy`'s functions keep serving every layer."""
    traces = getattr(_renewing, "traces", None)
    trace = current_trace()
    if traces is None or trace is None or trace is base:
        return
    if type(trace).__name__ == "BatchTrace":  # JAX's name of a vmap's trace
        return
    if trace is traces.renewed_in:
        return  # once per trace of a function: the next trace is another's
    traces.renewed_in = trace
    traces.renew()


def not_reached(missing: list[str]) -> BridgeRuntimeError:
    """The error for selected or patched sites a run did not reach."""
    return BridgeRuntimeError(
        f"Site {missing[0]!r} was selected or patched, but the model's "
        "code did not reach it in this run"
        + (f" (nor {missing[1:]!r})" if missing[1:] else "")
        + ": its gradient would be a silent zero. JAX reuses a trace it "
        "cached (a jitted or `jax.checkpoint`ed function traced before), "
        "or the model takes "
        "another path than when its sites were found. Select sites the "
        "model reaches on every call, or clear JAX's caches "
        "(`jax.clear_caches()`) before probing."
    )


def _check_reached(closed_jaxpr: Any, planted: Planted) -> None:
    """Raise where a planted site asked for has no marker in the computation
    (whether this run's Python bound it or JAX served a trace that did)."""
    missing = sorted(planted.asked - _names_in(closed_jaxpr.jaxpr, {}))
    if missing:
        raise not_reached(missing)


def _check_carried_on(closed_jaxpr: Any, planted: Planted) -> None:
    """Raise where a planted site's marked value is not what the model goes
    on with (an adapter that passed the unmarked value on): its epsilon
    would reach nothing, a silent zero. Discovery found it live."""
    if planted.patched:
        return  # a patch downstream may cut a site off: its zero is right
    present, live = liveness.present_and_live(closed_jaxpr)
    if live is None:
        return
    for name in sorted(planted.asked - planted.dead):
        if name in present and name not in live:
            raise BridgeRuntimeError(
                f"Site {name!r} is routed through the computation, but the value "
                "its adapter passed on is not the one bridge marked: its gradient "
                "would be a silent zero. The adapter must go on with the value "
                "`session.exit` returns."
            )
