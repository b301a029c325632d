"""Sites: one call of a submodule, its name, and the shape of its value."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from .._errors import BridgeValueError


def site_name(path: str, method: str | None, index: int) -> str:
    """The public name of a call: `path`, `path.method`, then `#k` for call k > 0."""
    base = path if method is None else f"{path}.{method}"
    return base if index == 0 else f"{base}#{index}"


def strip_call_index(name: str) -> str:
    """`Dense_0#2` -> `Dense_0`: what a selection pattern may match instead."""
    base, sep, index = name.rpartition("#")
    return base if sep and index.isdigit() else name


def key_name(key: Any) -> str:
    """One entry of a JAX key path as a path component: a field (`layers`), a
    dict key or an index (`0`), as sites and parameters are named."""
    for attribute in ("name", "key", "idx"):
        if hasattr(key, attribute):
            return str(getattr(key, attribute))
    return str(key)


class SiteOrigin:
    """The base of an adapter's private record of where a call is (a Linen
    scope path, a Haiku state bundle, the transforms around it). Subclasses
    are frozen dataclasses of plain data: a discovery is reused across traces
    only where every origin is (`bridge._probe.discovery_cache`).

    A call bridge cannot express (inside a `while_loop`, a `cond`, a scan
    that broadcasts its parameters) has as `blocked` the error to raise
    where it is selected or patched, naming the transform that holds it: it
    is listed by `sites()` and left out of `at=None`.

    `routes`: whether a route of the core's own carries the call's epsilon
    and value (`bridge._session.backward.InControlFlow`, inside Equinox's
    loops; a refusal made before any computation); false for an adapter's
    origin, which only describes the call (the layout of its inputs, for
    porting): where it runs the core reads from the computation, as for a
    call reported without one. Such an origin may still refuse the call, by
    a method `refusal_at(name)` giving the sentence for the site's public
    name: the adapter names a construct of its library
    that the computation sees only as a `while` or a `custom_vjp` (an
    Equinox loop without `max_steps`, a solve), and the core lists the call
    whole and raises that sentence."""

    __slots__ = ()

    routes: ClassVar[bool] = False
    scan: tuple[int, bool] | None = None
    value: Any = None
    inputs: Any = None
    tap: str | None = None
    blocked: str | None = None

    def backward_recorders(self, site: Site, with_inputs: bool) -> tuple | None:
        """`(inputs recorder, ran recorder)`: one example's zeros (iterations
        first) through which a differentiated step's own backward pass
        records the site's inputs and where it ran
        (`bridge._session.backward.record`), each `None` where there is none;
        `None` where the site is not recorded through the backward pass.

        An adapter whose route records a site through the backward pass
        (the values as the cotangents of recorders, as inside a loop or a
        branch) says so here, and uses the recorders the step gives it
        (`Request.control_flow_recorders`) where it has them: recording
        through a `jax.vjp` of its own inside a differentiated step would
        have JAX differentiate that backward pass again, which drops the
        `custom_jvp` rules inside a scan (their primal functions are
        differentiated instead: relu's derivative at 0 becomes 1/2)."""
        return None


def routes(origin: Any) -> bool:
    """Whether a route of the core's own carries the call of `origin`
    (`SiteOrigin.routes`): where not (any origin an adapter gives), the core
    reads where the call runs from the computation."""
    return bool(getattr(origin, "routes", False))


@dataclasses.dataclass(frozen=True, eq=False)
class Site:
    """One call of a submodule, as seen by abstract evaluation.

    Attributes:
      name: the public name, `path[.method][#k]`.
      path: the module's path, `/`-joined as its parameters are keyed.
      method: the method called, `None` for `__call__`.
      index: how many calls of the same `path[.method]` came before this one.
      module: the module object, for selection by class or predicate.
      struct: the value's full pytree of `jax.ShapeDtypeStruct` (integer leaves
        included: a native perturbation must match the value's structure).
      origin: adapter-private data locating the call (a Linen scope path, ...).
      stacked: how many leading axes of the value are iterations of the scans
        (or members of the vmaps over parameter sets) around the call; under
        `vmap=True` the probe's batch axis comes after them.
      dead: whether the call's value reaches none of the model's outputs
        (a result the model's code drops): its gradient is zero by
        construction, not by measurement (`bridge._session.liveness`).
      traced_as: the name the call is counted under while the model is
        traced, where that differs from `name`: a trace JAX discarded (a
        scan body traced twice) came first and is no site.
      computed: where the computation routes the site, an
        `bridge._session.computation.Enclosure` (the transforms around it in
        the jaxpr): a run marks it and acts on it there; `None` where the
        session acts on it where the adapter reports it.
    """

    name: str
    path: str
    method: str | None
    index: int
    module: Any
    struct: Any
    origin: SiteOrigin | None = None
    stacked: int = 0
    dead: bool = False
    traced_as: str | None = None
    computed: Any = None

    @property
    def value_struct(self) -> Any:
        """The public shape of the site: integer leaves replaced by `None`."""
        return differentiable_part(self.struct)

    @property
    def differentiable(self) -> bool:
        return any(_is_inexact(leaf) for leaf in jax.tree.leaves(self.struct))

    @property
    def refused(self) -> str | None:
        """Why bridge cannot express this site (its origin's `blocked`): the
        error raised where it is selected or patched; `None` for a site
        that probes as usual (the computation routes a site an adapter's
        own route refused, where it can)."""
        if self.computed is not None:
            return None
        return origin_refusal(self.origin, self.name)


def origin_refusal(origin: Any, name: str) -> str | None:
    """The refusal an `origin` gives the site `name`: its `refusal_at(name)`
    where it renders one for the site's public name (a call renamed after a
    trace JAX discarded), else its `blocked`."""
    at = getattr(origin, "refusal_at", None)
    if callable(at):
        return at(name)
    return getattr(origin, "blocked", None) or None


def _is_inexact(leaf: Any) -> bool:
    dtype = getattr(leaf, "dtype", None)
    return dtype is not None and jnp.issubdtype(dtype, jnp.inexact)


def is_array(leaf: Any) -> bool:
    return isinstance(leaf, jax.Array | np.ndarray | np.generic)


def abstract(tree: Any) -> Any:
    """Shapes and dtypes of a pytree's array leaves; other leaves become `None`.

    Inside `shard_map`, a value that varies across devices keeps that in its
    struct, so its epsilon can vary too: the gradient of a device-invariant
    epsilon added to a varying value is summed over the devices.
    """
    return jax.tree.map(lambda x: abstract_array(x) if is_array(x) else None, tree)


def abstract_array(x: Any, weak_type: bool = False) -> jax.ShapeDtypeStruct:
    """`x`'s `jax.ShapeDtypeStruct`, varying and sharded as `x` is; with
    `weak_type`, weakly typed as `x` is (a site's epsilon never is)."""
    weak = {"weak_type": True} if weak_type and _is_weak(x) else {}
    return jax.ShapeDtypeStruct(x.shape, x.dtype, **_varying(x), **_explicit(x), **weak)


def _is_weak(x: Any) -> bool:
    return bool(getattr(type_of(x), "weak_type", False))


def type_of(x: Any) -> Any:
    """`jax.typeof(x)`; `jax.core.get_aval` before jax 0.5 added `typeof` (an
    aval without the `sharding`/`manual_axis_type` fields read below)."""
    typeof = getattr(jax, "typeof", None)
    return typeof(x) if typeof is not None else jax.core.get_aval(x)


def _varying(x: Any) -> dict:
    manual = getattr(type_of(x), "manual_axis_type", None)
    if manual is None or not manual.varying:
        return {}
    return {"manual_axis_type": manual}


def _explicit(x: Any) -> dict:
    """The sharding of a value sharded over a mesh's `Explicit` axes: its
    epsilon must be sharded alike, or its gradient comes back replicated."""
    sharding = explicit_sharding(x)
    return {} if sharding is None else {"sharding": sharding}


def explicit_sharding(x: Any) -> Any:
    """`x`'s sharding in its type, where it names an `Explicit` mesh axis."""
    axis_type = getattr(jax.sharding, "AxisType", None)  # jax >= 0.5
    if axis_type is None:
        return None  # no `Explicit` mesh axes before it
    sharding = getattr(type_of(x), "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    if mesh is None or not any(
        kind == axis_type.Explicit for kind in getattr(mesh, "axis_types", ())
    ):
        return None
    return sharding if any(axis is not None for axis in sharding.spec) else None


def struct_update(struct: jax.ShapeDtypeStruct, **changes: Any) -> Any:
    """`struct.update(**changes)`; rebuilt by hand before jax 0.5 added
    `ShapeDtypeStruct.update` (its fields then: shape, dtype, sharding,
    weak_type)."""
    if hasattr(struct, "update"):
        return struct.update(**changes)
    fields = {
        "shape": struct.shape,
        "dtype": struct.dtype,
        "sharding": struct.sharding,
        "weak_type": struct.weak_type,
    }
    return jax.ShapeDtypeStruct(**{**fields, **changes})


def without_axis(struct: Any, axis: int) -> Any:
    """`struct` with `axis` removed from its shape (and sharding)."""
    shape = struct.shape[:axis] + struct.shape[axis + 1 :]
    sharding = getattr(struct, "sharding", None)
    if sharding is None:
        return struct_update(struct, shape=shape)
    spec = list(sharding.spec) + [None] * (len(struct.shape) - len(sharding.spec))
    del spec[axis]
    if all(entry is None for entry in spec):
        return jax.ShapeDtypeStruct(shape, struct.dtype)
    return struct_update(
        struct,
        shape=shape,
        sharding=jax.sharding.NamedSharding(
            sharding.mesh, jax.sharding.PartitionSpec(*spec)
        ),
    )


def describe(leaf: Any) -> Any:
    """`(shape, dtype)` of an array or a `ShapeDtypeStruct`; the type's name of
    any other leaf (a number, a string): what a misfit error shows."""
    if isinstance(leaf, jax.ShapeDtypeStruct) or is_array(leaf):
        return (tuple(leaf.shape), jnp.dtype(leaf.dtype))
    return type(leaf).__name__


def shapes_and_dtypes(tree: Any) -> Any:
    """`describe` of each leaf."""
    return jax.tree.map(describe, tree)


def split_arrays(tree: Any) -> tuple[list, Callable[[list], Any]]:
    """Split a pytree into its array leaves and a function that rebuilds it."""
    leaves, treedef = jax.tree.flatten(tree)
    is_dynamic = [is_array(leaf) for leaf in leaves]
    dynamic = [leaf for leaf, d in zip(leaves, is_dynamic, strict=True) if d]

    def rebuild(new_dynamic: list) -> Any:
        it = iter(new_dynamic)
        merged = [
            next(it) if d else leaf for leaf, d in zip(leaves, is_dynamic, strict=True)
        ]
        return jax.tree.unflatten(treedef, merged)

    return dynamic, rebuild


def patch_misfit(name: str, expected: Any, got: Any, function: bool) -> ValueError:
    """The one error for a patch that does not fit its site: `expected` and
    `got` are `(shape, dtype)` trees; `function` says a patch function gave
    `got`."""
    given = "the patch function returns" if function else "the patch has"
    return BridgeValueError(
        f"patch for site {name!r} does not fit: the site's value has (shape, "
        f"dtype) {expected}, {given} {got}. A patch must keep the site's "
        "structure, shape and dtype: give a value of the site's shape and dtype "
        "(see probe.sites(...)), or a function of the original value that keeps "
        "them, e.g. `lambda v: v * 0` or `lambda v: v.at[..., 0].set(0.0)`."
    )


def differentiable_part(tree: Any) -> Any:
    """The pytree with every non-floating leaf replaced by `None`."""
    return jax.tree.map(lambda x: x if _is_inexact(x) else None, tree)


def zeros_like_struct(struct: Any) -> Any:
    """Zeros of each leaf's shape and dtype, varying over the same devices."""

    def zeros(s):
        sharding = getattr(s, "sharding", None)
        if sharding is None:
            # What `jnp.zeros` binds, without its argument checks: a trace makes
            # one per selected site.
            value = jax.lax.broadcast_in_dim(np.zeros((), s.dtype), s.shape, ())
        else:
            value = jnp.zeros(s.shape, s.dtype, out_sharding=sharding)
        return varying_like(value, s)

    return jax.tree.map(zeros, struct)


def varying_like(value: Any, struct: Any) -> Any:
    """`value`, varying over the `shard_map` axes `struct` varies over."""
    manual = getattr(struct, "manual_axis_type", None)
    if manual is not None and manual.varying:
        value = jax.lax.pcast(value, tuple(sorted(manual.varying)), to="varying")
    return value


def device_invariant(struct: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
    """`struct` without the `shard_map` axes it varies over: what
    `jax.eval_shape` takes (`varying_like` restores them inside)."""
    if getattr(struct, "manual_axis_type", None) is None:
        return struct
    sharding = getattr(struct, "sharding", None)
    return jax.ShapeDtypeStruct(
        struct.shape,
        struct.dtype,
        weak_type=struct.weak_type,
        **({} if sharding is None else {"sharding": sharding}),
    )


def merge_differentiable(value: Any, floats: Any) -> Any:
    """`value` with its floating leaves replaced, in order, by those of `floats`."""
    float_leaves = iter(jax.tree.leaves(floats))
    return jax.tree.map(lambda x: next(float_leaves) if _is_inexact(x) else x, value)


def add_epsilon(value: Any, epsilon: Any) -> Any:
    """`value + epsilon` on the floating leaves; `epsilon` has `None` elsewhere."""
    perturbed = jax.tree.map(jnp.add, differentiable_part(value), epsilon)
    return merge_differentiable(value, perturbed)


class Arrays:
    """How the session handles one framework's values: JAX arrays by default.

    The session names, selects, patches and records the calls of any model
    the same way; what differs between frameworks is only what an array is,
    its abstract shape, how an epsilon is added and what a recording keeps.
    A non-JAX adapter (PyTorch) passes its own `Arrays` to the `Session`.
    Values are traversed with `jax.tree`, whose containers (tuples, lists,
    dicts, named tuples) are those models return; a framework's arrays are
    its leaves.
    """

    def is_array(self, leaf: Any) -> bool:
        return is_array(leaf)

    def abstract(self, tree: Any) -> Any:
        """`jax.ShapeDtypeStruct` of each array leaf, `None` elsewhere."""
        return abstract(tree)

    def describe(self, leaf: Any) -> Any:
        """`(shape, dtype)` of an array leaf; see `describe`."""
        return describe(leaf)

    def shapes_and_dtypes(self, tree: Any) -> Any:
        return jax.tree.map(self.describe, tree)

    def add_epsilon(self, value: Any, epsilon: Any) -> Any:
        return add_epsilon(value, epsilon)

    def recorded(self, value: Any) -> Any:
        """What a recording keeps of a site's value: its floating leaves."""
        return differentiable_part(value)

    def positional(self, args: tuple) -> tuple:
        """A call's positional arguments, array leaves kept, the rest `None`."""
        return jax.tree.map(lambda a: a if self.is_array(a) else None, tuple(args))

    def fits(self, expected: Any, got: Any) -> bool:
        """Whether the values `got` have the structure, shapes and dtypes of the
        abstract `expected` (`abstract`: `None` where the value has a leaf
        that is no array, which `got` must keep as no array): what a patch
        must keep."""
        is_none = lambda leaf: leaf is None  # noqa: E731
        wanted, wanted_structure = jax.tree.flatten(expected, is_leaf=is_none)
        given, given_structure = jax.tree.flatten(got, is_leaf=is_none)
        if wanted_structure != given_structure:
            return False
        # Leaves, not trees: `==` on a pytree node may be the library's own
        # elementwise operator (a Penzai NamedArray), not a comparison.
        return all(map(self._leaf_fits, wanted, given))

    def _leaf_fits(self, old: Any, new: Any) -> bool:
        if old is None:
            return not self.is_array(new)
        if isinstance(new, bool | int | float | complex):
            new = jnp.asarray(new)  # a number patches a scalar site
        abstract_or_array = isinstance(new, jax.ShapeDtypeStruct) or self.is_array(new)
        return abstract_or_array and describe(old) == self.describe(new)

    def eval_shape(self, function: Any, struct: Any) -> Any:
        """The abstract result of `function` on values shaped like `struct`."""
        return jax.eval_shape(function, struct)


JAX_ARRAYS = Arrays()
