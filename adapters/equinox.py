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

A call inside a transform that is not a `vmap` (`lax.scan`, `jax.checkpoint`,
`lax.cond`, a `jax.jit` inside the model) cannot hand its value out: it is not
a site, and the model runs there unchanged.
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

    def __init__(self, model: eqx.Module, state: eqx.nn.State | None, vmap: bool):
        self.model = model
        self.state = state
        self.vmap = vmap

    def tree_flatten(self):
        # Arrays are children (traced under `jax.jit`, never baked in); functions,
        # strings and the structure are static.
        arrays, static = eqx.partition(self.model, eqx.is_array)
        return (arrays, self.state), (static, self.vmap)

    @classmethod
    def tree_unflatten(cls, static, children):
        arrays, state = children
        return cls(eqx.combine(arrays, static[0]), state, static[1])

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
        model = _instrument(eqx.combine(trainable, self.model), (), self.vmap)
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


def _instrument(module: eqx.Module, prefix: tuple[str, ...], vmap: bool) -> Any:
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
            inner = _instrument(child, path, vmap)
            wrapper = (
                _StatefulModuleSite
                if isinstance(child, eqx.nn.StatefulLayer)
                else _ModuleSite
            )
            child = wrapper(inner, "/".join(path))
        elif _is_function(child) and not isinstance(module, eqx.nn.Lambda):
            child = _FunctionSite(child, "/".join(path))
        replaced.append(child)
    return jax.tree_util.tree_unflatten(treedef, replaced)


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


class _ModuleSite(eqx.Module):
    """Stands in for a submodule: each call, and each public method call, is a site."""

    module: eqx.Module
    path: str = eqx.field(static=True)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return _observed_call(self.path, None, self.module, self.module, args, kwargs)

    def __getattr__(self, name: str) -> Any:
        # Reached only for names the wrapper lacks: forward to the module.
        if name.startswith("_") or name in ("module", "path"):
            raise AttributeError(name)
        attribute = getattr(self.module, name)
        field_names = {field.name for field in dataclasses.fields(self.module)}
        if not callable(attribute) or name in field_names or name == "is_stateful":
            return attribute

        def method(*args: Any, **kwargs: Any) -> Any:
            return _observed_call(self.path, name, self.module, attribute, args, kwargs)

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
    path: str = eqx.field(static=True)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return _observed_call(
            self.path, None, self.function, self.function, args, kwargs
        )


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
    path: str,
    method: str | None,
    module: Any,
    function: Callable,
    args: tuple,
    kwargs: dict,
) -> Any:
    context = _CONTEXT.get()
    session = current()
    if context is None or session is not context.session:
        return function(*args, **kwargs)
    depth = _mapped_depth(context.base_trace)
    if depth is None:
        return function(*args, **kwargs)
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
        return value
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
