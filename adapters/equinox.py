"""Equinox: tree surgery on a copy of the model.

Each submodule of the model (at its pytree path, `layers/0`) is replaced with
a wrapper module that reports its calls to the probe's session, and so is each
function-valued field such as `eqx.nn.MLP.activation` (`activation`,
`activation#1`, …). The surgery happens on the copy the probe builds inside
its traced function: the user's model is never changed. The epsilon of a
selected call is the session's own, added to the call's value.

The hard part is a call inside the model's own `jax.vmap` (`eqx.nn.MultiheadAttention`
projects every token with `jax.vmap(self.query_proj)`; `eqx.nn.MLP` applies
its activation per neuron). The wrapper then sees one token, yet the site
holds every token, with per-token gradients. The wrapper binds a private
primitive whose batching rule is the only code that sees the whole mapped
value: at each enclosing `vmap` the rule moves that vmap's axis to the front
(broadcasting a value that does not vary along it) and passes the value one
trace out, until it reaches the probe's own trace. There the session records
it and adds an epsilon of the full shape, `(tokens, features)`, outermost
mapped axis first, and the rule hands the result back in, mapped along axis 0
at every level. No tracer leaves its trace and autodiff sees ordinary
operations, so gradients are per token, eager or jitted.

Inside `lax.scan` over stacked layers (`eqx.filter_vmap` builds them, the
scan slices them per step, directly or after `eqx.partition`) and inside
`jax.checkpoint` / `eqx.filter_checkpoint`, no value can be handed out: the
epsilon lives in the tree instead (the design's tree surgery). Discovery
finds these calls and their iterations (a wrapper whose parameters lost a
leading axis of size L was sliced by the scan). For the run, each such
wrapper holds, per selected call, a zero epsilon leaf and a zero "recorder"
leaf of the stacked shape `(L, *value shape)`: the scan slices them with the
parameters, so the epsilon's gradient is the stacked activation gradient. The
value leaves the scan backwards: the recorder enters through a `custom_vjp`
identity whose backward pass returns the value itself as the recorder's
cotangent, and `_run` pulls it out with one `jax.vjp` of the model. A call
inside a transform this cannot express (`lax.cond`, `while_loop`, a `jax.jit`
inside the model, a `vmap` inside the scan, a layer closed over by the scan
body rather than scanned over) raises an error naming it: a site is never
silently missing or summed over iterations.
"""

from __future__ import annotations

import contextvars
import dataclasses
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jax._src import core as _jax_core
from jax._src.interpreters.batching import BatchTrace
from jax.extend.core import Primitive
from jax.interpreters import batching

from bridge._probe import BATCH_AXIS, ProbeBase
from bridge._session import Session, current
from bridge._sites import (
    differentiable_part,
    merge_differentiable,
    strip_call_index,
    without_axis,
    zeros_like_struct,
)


def probe(model: eqx.Module, *variables: Any, vmap: bool = False) -> EquinoxProbe:
    if len(variables) > 1 or (variables and not isinstance(variables[0], eqx.nn.State)):
        given = ", ".join(type(v).__name__ for v in variables)
        raise TypeError(
            "An Equinox model is probed as bridge.probe(module), or as "
            "bridge.probe(module, state) with the eqx.nn.State from "
            f"eqx.nn.make_with_state; got {len(variables)} variable arguments "
            f"({given})."
        )
    state = variables[0] if variables else None
    if state is None:
        stateful = _state_indices(model)
        if stateful:
            raise ValueError(
                f"This model keeps state ({', '.join(stateful[:3])} hold an "
                "eqx.nn.StateIndex) but no state was given. Build it with "
                "`model, state = eqx.nn.make_with_state(Model)(...)` and pass it: "
                "bridge.probe(model, state)."
            )
    return EquinoxProbe(model, state, vmap)


@jax.tree_util.register_pytree_node_class
class EquinoxProbe(ProbeBase):
    """An Equinox module, with its `eqx.nn.State` if it has one.

    See `bridge.ActivationProbe`. With a state, the model is called as
    `model(*args, state, **kwargs)` and must return `(outputs, new_state)`;
    `loss_fn` sees `outputs` and `ProbeResult.state` is `new_state`.
    """

    #: What `bridge.transfer` and `bridge.compare` know of this library.
    _porting = "bridge.adapters._porting_equinox"

    def __init__(self, model: eqx.Module, state: eqx.nn.State | None, vmap: bool):
        self.model = model
        self.state = state
        self.vmap = vmap

    def tree_flatten(self):
        # Arrays are children (traced under `jax.jit`, never baked in); functions,
        # strings and the structure are static. A probe rebuilt by `tree_unflatten`
        # flattens back to the parts it was built from: JAX rebuilds pytrees with
        # placeholder leaves (an AOT `lower(...).compile()` checks its callers'
        # inputs against such a structure), and partitioning placeholders by
        # value would move them into the static part.
        parts = self.__dict__.get("_parts")
        if parts is None:
            parts = eqx.partition(self.model, eqx.is_array)
        arrays, static = parts
        return (arrays, self.state), (static, self.vmap)

    @classmethod
    def tree_unflatten(cls, static, children):
        arrays, state = children
        probe = cls(eqx.combine(arrays, static[0]), state, static[1])
        probe._parts = (arrays, static[0])
        return probe

    def __repr__(self) -> str:
        with_state = ", state" if self.state is not None else ""
        return (
            f"EquinoxProbe({type(self.model).__name__}{with_state}, vmap={self.vmap})"
        )

    def _trainable(self) -> Any:
        # What `eqx.filter_grad` differentiates: the floating-point arrays.
        return eqx.filter(self.model, eqx.is_inexact_array)

    def _run(
        self, trainable: Any, args: tuple, kwargs: dict, session: Session
    ) -> tuple[Any, Any]:
        in_tree = {
            name: site
            for name, site in session.selected.items()
            if isinstance(site.origin, _InTransform)
        }
        if not in_tree:
            return self._call_model(trainable, args, kwargs, session, {})
        for name in in_tree:
            if name in session.patches:
                raise ValueError(
                    f"Site {name!r} is inside {in_tree[name].origin.described}: "
                    "bridge cannot patch it there. Patch a site outside the "
                    "transform, or unroll the layers."
                )
            if session.with_inputs:
                raise ValueError(
                    f"with_inputs=True: the inputs of site {name!r}, inside "
                    f"{in_tree[name].origin.described}, cannot be recorded. "
                    "Select sites outside the transform with `at=`."
                )

        def shaped(site: Any) -> Any:
            struct = site.value_struct
            if self.vmap:  # the probe's own vmap: one example here
                struct = jax.tree.map(lambda s: without_axis(s, site.stacked), struct)
            return zeros_like_struct(struct)

        recorders = {name: shaped(site) for name, site in in_tree.items()}

        def forward(recorders: dict) -> tuple[Any, Any]:
            leaves = {
                name: _Leaves(session.epsilons.get(name, zeros), recorders[name])
                for name, zeros in ((n, shaped(s)) for n, s in in_tree.items())
            }
            outputs, state = self._call_model(trainable, args, kwargs, session, leaves)
            floats = [
                jnp.sum(leaf)
                for leaf in jax.tree.leaves(differentiable_part(outputs))
                if leaf is not None
            ]
            if not floats:
                raise ValueError(
                    "bridge records the sites inside jax.lax.scan or "
                    "jax.checkpoint through the backward pass of the model's "
                    f"outputs, but {type(self.model).__name__} returned no "
                    "floating-point array."
                )
            # What the session recorded in here must leave `jax.vjp` as outputs.
            recorded = (dict(session.activations), dict(session.inputs))
            return sum(floats, jnp.zeros(())), (outputs, state, recorded)

        # The recorders' cotangents are the values themselves (see `_record`).
        total, pullback, (outputs, state, recorded) = jax.vjp(
            forward, recorders, has_aux=True
        )
        session.activations.update(recorded[0])
        session.inputs.update(recorded[1])
        (values,) = pullback(jnp.ones_like(total))
        for name in in_tree:
            session.record(name, values[name])
        return outputs, state

    def _call_model(
        self,
        trainable: Any,
        args: tuple,
        kwargs: dict,
        session: Session,
        leaves: dict[str, _Leaves],
    ) -> tuple[Any, Any]:
        # A fresh token in every wrapper's static structure: JAX caches the traces
        # of scan and checkpoint bodies by structure, and a cached trace would
        # skip the wrappers, and so the sites.
        model = _instrument(
            eqx.combine(trainable, self.model), (), self.vmap, leaves, _Token()
        )
        context = _Context(session, _jax_core.trace_ctx.trace)
        # `bridge.tap` inside the model's own vmap must leave it the same way.
        session.tap = lambda name, value: _tap(context, name, value)
        token = _CONTEXT.set(context)
        try:
            if self.state is None:
                return model(*args, **kwargs), None
            # `State.set` invalidates the State it was called on: hand the model
            # a copy, so the user's state stays usable.
            result = model(*args, _clone(self.state), **kwargs)
        finally:
            _CONTEXT.reset(token)
            del session.tap
        if not (
            isinstance(result, tuple)
            and len(result) == 2
            and isinstance(result[1], eqx.nn.State)
        ):
            raise TypeError(
                "A model probed with a state is called as model(*args, state) and "
                "must return (outputs, new_state) with new_state an eqx.nn.State; "
                f"{type(self.model).__name__} returned {type(result).__name__}."
            )
        return result


def _clone(state: eqx.nn.State) -> eqx.nn.State:
    leaves, treedef = jax.tree.flatten(state)
    return jax.tree.unflatten(treedef, leaves)


# -- the surgery ----------------------------------------------------------------


def _instrument(
    module: eqx.Module,
    prefix: tuple[str, ...],
    vmap: bool,
    leaves: dict[str, _Leaves] | None = None,
    token: _Token | None = None,
) -> Any:
    """A copy of `module` whose submodules and function fields report their calls.

    Submodules are wrapped after their own children, so a wrapper holds an
    instrumented module. `eqx.nn.Lambda.fn` is not a site of its own: the
    Lambda's call is the same value.
    """

    def is_child(x: Any) -> bool:
        return x is not module and (isinstance(x, eqx.Module) or _is_function(x))

    children, treedef = jax.tree_util.tree_flatten_with_path(module, is_leaf=is_child)
    replaced = []
    for key_path, child in children:
        path = (*prefix, *(_key_name(key) for key in key_path))
        if isinstance(child, eqx.nn.StateIndex):
            pass  # a key into the State, looked up by identity: keep it as is
        elif isinstance(child, eqx.Module):
            if vmap and isinstance(child, eqx.nn.BatchNorm):
                # The probe's vmap is the batch: average over it.
                child = eqx.tree_at(lambda bn: bn.axis_name, child, BATCH_AXIS)
            inner = _instrument(child, path, vmap, leaves, token)
            wrapper = (
                _StatefulModuleSite
                if isinstance(child, eqx.nn.StatefulLayer)
                else _ModuleSite
            )
            name = "/".join(path)
            child = wrapper(
                inner, _leaves_of(leaves, name), name, _param_shapes(child), token
            )
        elif _is_function(child) and not _is_plumbing(module, key_path):
            name = "/".join(path)
            child = _FunctionSite(child, _leaves_of(leaves, name), name, (), token)
        replaced.append(child)
    return jax.tree_util.tree_unflatten(treedef, replaced)


def _leaves_of(leaves: dict[str, _Leaves] | None, path: str) -> dict[str, _Leaves]:
    """The leaves of the calls of the module at `path` (`path`, `path#1`, ...)."""
    return {
        name: leaf
        for name, leaf in (leaves or {}).items()
        if strip_call_index(name).partition(".")[0] == path
    }


def _param_shapes(module: Any) -> tuple[tuple[int, ...], ...]:
    """Shapes of a module's arrays, bridge's own leaves left out."""
    arrays = eqx.filter(module, eqx.is_array, is_leaf=lambda x: isinstance(x, _Leaves))
    return tuple(tuple(a.shape) for a in jax.tree.leaves(arrays))


def _is_plumbing(module: Any, key_path: tuple) -> bool:
    """A function field that is not a step of the forward pass: `eqx.nn.Lambda`'s
    `fn` (the Lambda's own call is that value) and a pool's `operation`, the
    binary reduction `lax.reduce_window` traces on scalars."""
    if isinstance(module, eqx.nn.Lambda):
        return True
    field = _key_name(key_path[0]) if key_path else None
    return isinstance(module, eqx.nn.Pool) and field == "operation"


def _is_function(x: Any) -> bool:
    return callable(x) and not isinstance(x, eqx.Module | type) and not eqx.is_array(x)


def _key_name(key: Any) -> str:
    for attribute in ("name", "key", "idx"):
        if hasattr(key, attribute):
            return str(getattr(key, attribute))
    return str(key)


def _state_indices(model: eqx.Module) -> list[str]:
    found = jax.tree_util.tree_flatten_with_path(
        model, is_leaf=lambda x: isinstance(x, eqx.nn.StateIndex)
    )[0]
    return [
        "/".join(_key_name(k) for k in path) or "the model"
        for path, leaf in found
        if isinstance(leaf, eqx.nn.StateIndex)
    ]


class _Token:
    """Equal only to itself: makes each probe call's wrappers a new structure."""

    __slots__ = ()


class _Leaves(eqx.Module):
    """A call's epsilon and recorder inside a transform (see the module docstring):
    array leaves of the tree, so a scan slices them as it slices the parameters."""

    epsilon: Any
    recorder: Any


class _ModuleSite(eqx.Module):
    """Stands in for a submodule: each call, and each public method call, is a site.

    `shapes` are the module's array shapes as given: a call that sees them
    without their leading axis was sliced by a scan over stacked layers.
    """

    module: eqx.Module
    bridge_leaves: dict
    path: str = eqx.field(static=True)
    shapes: tuple = eqx.field(static=True)
    token: _Token | None = eqx.field(static=True, default=None)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return _observed_call(self, None, self.module, self.module, args, kwargs)

    def __getattr__(self, name: str) -> Any:
        # Reached only for names the wrapper lacks: forward to the module.
        if name.startswith("_") or name in (
            "module",
            "path",
            "bridge_leaves",
            "shapes",
            "token",
        ):
            raise AttributeError(name)
        attribute = getattr(self.module, name)
        field_names = {field.name for field in dataclasses.fields(self.module)}
        if not callable(attribute) or name in field_names or name == "is_stateful":
            return attribute

        def method(*args: Any, **kwargs: Any) -> Any:
            return _observed_call(self, name, self.module, attribute, args, kwargs)

        return method

    def __getitem__(self, index: Any) -> Any:
        return self.module[index]

    def __len__(self) -> int:
        return len(self.module)

    def __iter__(self):
        return iter(self.module)


class _StatefulModuleSite(_ModuleSite, eqx.nn.StatefulLayer):
    """A wrapped `StatefulLayer`, so `eqx.nn.Sequential` still threads its state."""

    def is_stateful(self) -> bool:
        return self.module.is_stateful()


class _FunctionSite(eqx.Module):
    """Stands in for a function-valued field such as `eqx.nn.MLP.activation`."""

    function: Callable
    bridge_leaves: dict
    path: str = eqx.field(static=True)
    shapes: tuple = eqx.field(static=True, default=())
    token: _Token | None = eqx.field(static=True, default=None)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return _observed_call(self, None, self.function, self.function, args, kwargs)


# -- reaching the probe's trace -------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Context:
    session: Session
    base_trace: Any  # the trace the probe runs the model in


_CONTEXT: contextvars.ContextVar[_Context | None] = contextvars.ContextVar(
    "bridge_equinox", default=None
)


def _mapped_depth(base_trace: Any) -> int | None:
    """How many `jax.vmap`s of the model's own code enclose this point.

    `None` when another transform (`lax.scan`, `jax.checkpoint`, …) stands
    between here and the probe's trace: no value can be handed out from there.
    """
    trace = _jax_core.trace_ctx.trace
    depth = 0
    while trace is not base_trace:
        if not isinstance(trace, BatchTrace):
            return None
        trace = trace.parent_trace
        depth += 1
    return depth


def _observed_call(
    site: _ModuleSite | _FunctionSite,
    method: str | None,
    module: Any,
    function: Callable,
    args: tuple,
    kwargs: dict,
) -> Any:
    path = site.path
    context = _CONTEXT.get()
    session = current()
    if context is None or session is not context.session:
        return function(*args, **kwargs)
    depth = _mapped_depth(context.base_trace)
    if depth is None:
        return _call_in_transform(context, site, method, module, function, args, kwargs)
    if depth == 0:
        call = session.enter(path, method, module, args)
        return _report(session, call, function(*args, **kwargs))

    entered = []

    def enter(full_args: tuple) -> tuple:
        entered.append(session.enter(path, method, module, full_args))
        return full_args

    if session.with_inputs and not session.discovering:
        # Inputs are recorded at the probe's trace too, mapped axes first.
        _lift(args, depth, enter)
    else:
        enter(())
    (call,) = entered
    value = function(*args, **kwargs)
    if not (
        session.discovering
        or call.name in session.selected
        or call.name in session.patches
    ):
        # Nothing to record or change: bookkeeping only, and no cost.
        return session.exit(call, value)
    return _lift(value, depth, lambda full: _report(session, call, full))


# -- inside lax.scan and jax.checkpoint: epsilons and recorders in the tree -------

#: JAX's names (`DebugInfo.traced_for`) of the transforms a call may sit in.
_SCAN = "scan"
_CHECKPOINT = "checkpoint / remat"


@dataclasses.dataclass(frozen=True)
class _InTransform:
    """Where a site lives that takes its epsilon from the tree: `iterations` of
    the enclosing scan (`None` when only a checkpoint encloses it)."""

    iterations: int | None
    transforms: tuple[str, ...]

    @property
    def described(self) -> str:
        return _describe(self.transforms)


#: The innermost scan over stacked layers now running a sliced wrapper:
#: `(the scan body's trace, iterations)`. A call without parameters of its
#: own (a function field, a parameterless module) inside it is sliced too.
_SLICED: contextvars.ContextVar[tuple[Any, int] | None] = contextvars.ContextVar(
    "bridge_equinox_sliced", default=None
)


def _transforms(base_trace: Any) -> tuple[str, ...]:
    """The transforms between here and the probe's trace, innermost first:
    `vmap` for a `jax.vmap`, otherwise JAX's own name (`scan`, `cond`, ...)."""
    trace = _jax_core.trace_ctx.trace
    found = []
    while trace is not base_trace:
        if trace is None:
            found.append("a transform bridge does not know")
            break
        if isinstance(trace, BatchTrace):
            found.append("vmap")
        else:
            debug = getattr(getattr(trace, "frame", None), "debug_info", None)
            found.append(getattr(debug, "traced_for", None) or type(trace).__name__)
        trace = getattr(trace, "parent_trace", None)
    return tuple(found)


def _describe(transforms: tuple[str, ...]) -> str:
    names = {
        _SCAN: "jax.lax.scan",
        _CHECKPOINT: "jax.checkpoint",
        "vmap": "jax.vmap",
        "jit": "a jax.jit inside the model",
        "cond": "jax.lax.cond",
        "switch": "jax.lax.switch",
        "while_body": "jax.lax.while_loop",
        "while_cond": "jax.lax.while_loop",
        "fori_loop": "jax.lax.fori_loop",
    }
    return " inside ".join(names.get(t, t) for t in transforms)


def _iterations(site: _ModuleSite | _FunctionSite) -> int | None:
    """L when the wrapper's arrays lost a leading axis of size L (a scan sliced
    them), 0 when they are whole, `None` when it cannot tell (no arrays)."""
    if not site.shapes:
        return None
    now = _param_shapes(site.module) if isinstance(site, _ModuleSite) else ()
    if now == site.shapes:
        return 0
    leading = {shape[:1] for shape in site.shapes}
    if (
        len(now) == len(site.shapes)
        and len(leading) == 1
        and all(n == s[1:] for n, s in zip(now, site.shapes, strict=True))
    ):
        return site.shapes[0][0]
    return None


def _call_in_transform(
    context: _Context,
    site: _ModuleSite | _FunctionSite,
    method: str | None,
    module: Any,
    function: Callable,
    args: tuple,
    kwargs: dict,
) -> Any:
    """A call inside `lax.scan` or `jax.checkpoint`: see the module docstring."""
    session = context.session
    transforms = _transforms(context.base_trace)
    where = _describe(transforms)
    site_path = site.path if method is None else f"{site.path}.{method}"
    unsupported = [t for t in transforms if t not in (_SCAN, _CHECKPOINT)]
    if unsupported:
        detail = (
            "a jax.vmap of the model's own code inside a scan or checkpoint (an "
            "epsilon in the tree cannot vary along the mapped axis; eqx.nn.MLP "
            "with scan=True maps its activation so: use scan=False)"
            if "vmap" in unsupported
            else f"{_describe((unsupported[0],))}"
        )
        raise ValueError(
            f"bridge cannot see through {detail}: site {site_path!r} is called "
            f"inside {where}. bridge sees through jax.lax.scan over stacked layers "
            "and jax.checkpoint; move the call out of the transform, or unroll it."
        )
    if transforms.count(_SCAN) > 1:
        raise ValueError(
            f"bridge cannot see through nested jax.lax.scan: site {site_path!r} is "
            f"called inside {where}. Scan over one stack of layers at a time."
        )
    iterations = None
    if _SCAN in transforms:
        iterations = _iterations(site)
        sliced = _SLICED.get()
        if not iterations and sliced and sliced[0] is _jax_core.trace_ctx.trace:
            iterations = sliced[1]
        if not iterations:
            raise ValueError(
                f"bridge cannot see through this jax.lax.scan: site {site_path!r} is "
                "called in every iteration, but the scan does not slice its "
                "parameters (a layer closed over by the scan body, as in an RNN), "
                "so one epsilon would sum the gradients of all iterations. Scan "
                "over stacked layers (eqx.filter_vmap to build them, the scan's "
                "xs to slice them), or unroll the loop."
            )
    origin = _InTransform(iterations, transforms)
    call = session.enter(site.path, method, module, args, origin=origin, record=False)
    token = (
        _SLICED.set((_jax_core.trace_ctx.trace, iterations))
        if iterations and _iterations(site)
        else None
    )
    try:
        value = function(*args, **kwargs)
    finally:
        if token is not None:
            _SLICED.reset(token)
    if any(isinstance(leaf, eqx.nn.State) for leaf in _leaves_with_state(value)):
        raise ValueError(
            f"site {site_path!r} is a stateful layer inside {where}: bridge cannot "
            "thread its eqx.nn.State there. Move it out of the transform."
        )
    # The epsilon comes from the tree below, not from the session.
    value = session.exit(call, value, perturb=lambda v: v, record=False)
    if session.discovering:
        if iterations:
            session.restructure(
                call.name,
                # Broadcast, not zeros: a value varying across shard_map's
                # devices stays varying, and so do its epsilon and recorder.
                jax.tree.map(
                    lambda a: (
                        jnp.broadcast_to(a, (iterations, *jnp.shape(a)))
                        if eqx.is_array(a)
                        else a
                    ),
                    value,
                ),
            )
        return value
    if call.name not in session.selected:
        return value
    leaves = site.bridge_leaves.get(call.name)
    if leaves is None:
        raise RuntimeError(
            f"bridge found no epsilon for site {call.name!r} inside {where}: the "
            "model called it differently from the discovery pass. This is a bug "
            "in bridge: please report it."
        )
    floats = jax.tree.map(
        lambda v, epsilon, recorder: _record(v, recorder) + epsilon,
        differentiable_part(value),
        leaves.epsilon,
        leaves.recorder,
    )
    return merge_differentiable(value, floats)


def _leaves_with_state(value: Any) -> list:
    return jax.tree.leaves(value, is_leaf=lambda x: isinstance(x, eqx.nn.State))


@jax.custom_vjp
def _record(value: Any, recorder: Any) -> Any:
    """`value`; the recorder's cotangent is `value` itself, so the value leaves
    a scan as the gradient of the stacked recorder leaf."""
    del recorder
    return value


def _record_forward(value: Any, recorder: Any) -> tuple[Any, Any]:
    del recorder
    return value, value


def _record_backward(value: Any, cotangent: Any) -> tuple[Any, Any]:
    return cotangent, value


_record.defvjp(_record_forward, _record_backward)


def _report(session: Session, call: Any, value: Any) -> Any:
    """`session.exit`, leaving out any `eqx.nn.State` in the value (not an
    activation: a stateful layer returns `(x, state)`, and the site is `(x, None)`)."""

    def is_state(x: Any) -> bool:
        return isinstance(x, eqx.nn.State)

    leaves, treedef = jax.tree.flatten(value, is_leaf=is_state)
    if not any(is_state(leaf) for leaf in leaves):
        return session.exit(call, value)
    reported = [None if is_state(leaf) else leaf for leaf in leaves]
    returned = session.exit(call, jax.tree.unflatten(treedef, reported))
    returned_leaves = treedef.flatten_up_to(returned)
    merged = [
        leaf if is_state(leaf) else new
        for leaf, new in zip(leaves, returned_leaves, strict=True)
    ]
    return jax.tree.unflatten(treedef, merged)


def _tap(context: _Context, name: str, value: Any) -> Any:
    session = context.session
    depth = _mapped_depth(context.base_trace)
    if depth is None:
        where = _describe(_transforms(context.base_trace))
        raise ValueError(
            f"bridge.tap({name!r}) is inside {where}, where bridge cannot see a "
            "tap: move the tap out of the transform, or mark the value by "
            "wrapping its computation in an eqx.Module (a module call is a site)."
        )
    if depth == 0:
        return Session.tap(session, name, value)
    return _lift(value, depth, lambda full: Session.tap(session, name, full))


def _lift(tree: Any, depth: int, observe: Callable[[Any], Any]) -> Any:
    """Hand `tree`, seen inside `depth` vmaps, to `observe` at the probe's trace.

    `observe` gets the full value, mapped axes first, outermost first, and
    returns the value to go on with, of the same structure and shapes.
    """
    leaves, treedef = jax.tree.flatten(tree)
    positions = [i for i, leaf in enumerate(leaves) if eqx.is_array(leaf)]

    def observe_arrays(full_arrays: list) -> list:
        full = list(leaves)
        for i, array in zip(positions, full_arrays, strict=True):
            full[i] = array
        returned = treedef.flatten_up_to(observe(jax.tree.unflatten(treedef, full)))
        return [returned[i] for i in positions]

    arrays = _lift_p.bind(
        *[leaves[i] for i in positions], observe=observe_arrays, depth=depth
    )
    new = list(leaves)
    for i, array in zip(positions, arrays, strict=True):
        new[i] = array
    return jax.tree.unflatten(treedef, new)


_lift_p = Primitive("bridge_equinox_site")
_lift_p.multiple_results = True


def _lift_batched(axis_data, values, dims, *, observe, depth):
    """The batching rule: runs one trace out, where the mapped value is whole."""
    full = [
        jnp.broadcast_to(value, (axis_data.size, *jnp.shape(value)))
        if dim is None
        else jnp.moveaxis(value, dim, 0)
        for value, dim in zip(values, dims, strict=True)
    ]
    if depth > 1:
        out = _lift_p.bind(*full, observe=observe, depth=depth - 1)
    else:
        out = observe(full)
    return list(out), [0] * len(out)


batching.fancy_primitive_batchers[_lift_p] = _lift_batched


def _outside_a_vmap(*args, **params):
    raise RuntimeError(
        "bridge's Equinox site primitive was evaluated outside a jax.vmap. This is "
        "a bug in bridge: please report it."
    )


_lift_p.def_impl(_outside_a_vmap)
_lift_p.def_abstract_eval(_outside_a_vmap)
