"""Equinox: tree surgery on a copy of the model.

Each submodule of the model (at its pytree path, `layers/0`) is replaced with
a wrapper that reports its calls to the probe's session, and so is each
function-valued field such as `eqx.nn.MLP.activation` (`activation`,
`activation#1`, …), invisibly to the model's code
(`bridge.adapters.equinox.surgery`). The surgery happens on the copy the
probe builds inside its traced function: the user's model is never changed.
The epsilon of a selected call is the session's own, added to the call's
value.

A wrapper reports its call from where it runs (`bridge.adapters.equinox.run`),
plainly: where that is inside the model's own transforms the core reads from
the computation JAX builds.
"""

from __future__ import annotations

from typing import Any

import equinox as eqx
import jax

from bridge.adapter_api import (
    BridgeError,
    BridgeTypeError,
    BridgeValueError,
    ProbeBase,
    Session,
    key_name,
)

from ..shared import guests, jax_internals
from . import run, surgery


def probe(model: eqx.Module, *variables: Any, vmap: bool = False) -> EquinoxProbe:
    if len(variables) > 1 or (variables and not isinstance(variables[0], eqx.nn.State)):
        given = ", ".join(type(v).__name__ for v in variables)
        raise BridgeTypeError(
            "An Equinox model is probed as bridge.probe(module), or as "
            "bridge.probe(module, state) with the eqx.nn.State from "
            f"eqx.nn.make_with_state; got {len(variables)} variable arguments "
            f"({given})."
        )
    state = variables[0] if variables else None
    if state is None:
        stateful = _state_indices(model)
        if stateful:
            raise BridgeValueError(
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
    porting_side = "bridge.adapters.equinox.porting"

    #: Static fields and functions are in the treedef, arrays are leaves, and
    #: an origin is transform names and counts: a discovery is reused by
    #: structure.
    reuses_discovery = True

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
        #
        # The partition is made once per probe: a jitted step flattens its probe
        # argument on every call, and partitioning a GPT-2-sized model costs
        # ~1 ms of host time, which on an accelerator is most of a small step.
        # Keeping the same static object also keeps the cached program's check
        # of the treedef to an identity test (Equinox compares modules leaf by
        # leaf, `eqx.tree_equal`). The model is an immutable pytree, so the
        # partition cannot go stale.
        parts = self.__dict__.get("_parts")
        if parts is None:
            parts = self._parts = eqx.partition(self.model, eqx.is_array)
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

    @guests.hosted("equinox")
    def _run(
        self, trainable: Any, args: tuple, kwargs: dict, session: Session
    ) -> tuple[Any, Any]:
        # A fresh token in every wrapper's static structure: JAX caches the traces
        # of scan and checkpoint bodies by structure, and a cached trace would
        # skip the wrappers, and so the sites.
        model = surgery.instrument(
            eqx.combine(trainable, self.model), (), self.vmap, surgery.Token()
        )
        context = run.Context(session, jax_internals.current_trace())
        token = run.CONTEXT.set(context)
        tapping = session.taps.tapping(
            lambda name, value: run.tap(context, name, value)
        )
        try:
            with tapping:
                # A root `__call__` under `eqx.filter_jit` is traced inline.
                call = run.unjitted(model, "__call__")
                if self.state is None:
                    return call(*args, **kwargs), None
                # `State.set` invalidates the State it was called on: hand the
                # model a copy, so the user's state stays usable.
                result = call(*args, clone_state(self.state), **kwargs)
        except (TypeError, ValueError) as error:
            # Only the model's first trace on these inputs, discovery's, meets
            # a shape error of the user's own.
            learnt = session.recorder.learns_sites()
            if self.vmap or not learnt or isinstance(error, BridgeError):
                raise
            said = (
                "".join(error.args)
                if all(isinstance(part, str) for part in error.args)
                else str(error)
            )
            raise type(error)(f"{said}\n\n{_FORGOT_VMAP}") from error
        finally:
            run.CONTEXT.reset(token)
        if not (
            isinstance(result, tuple)
            and len(result) == 2
            and isinstance(result[1], eqx.nn.State)
        ):
            raise BridgeTypeError(
                "A model probed with a state is called as model(*args, state) and "
                "must return (outputs, new_state) with new_state an eqx.nn.State; "
                f"{type(self.model).__name__} returned {type(result).__name__}."
            )
        return result

    # -- taking the model out (`ActivationProbe.unwrap`) -------------------------

    def unwrap(self) -> tuple:
        """`(model,)`, or `(model, state)` for a model with an `eqx.nn.State`,
        what `bridge.probe` takes: the probe's model (after `bridge.transfer`,
        the ported one) and a copy of its state (`State.set` invalidates the
        state it is called on: the probe's own stays valid)."""
        if self.state is None:
            return (self.model,)
        return self.model, clone_state(self.state)


def clone_state(state: eqx.nn.State) -> eqx.nn.State:
    leaves, treedef = jax.tree.flatten(state)
    return jax.tree.unflatten(treedef, leaves)


# -- the surgery ----------------------------------------------------------------


#: Appended to a shape error of the model's own code under `vmap=False`.
_FORGOT_VMAP = (
    "bridge: an Equinox model usually handles one example, and this probe calls "
    "it on the inputs as given (vmap=False). If the inputs carry a batch axis, "
    "probe it with bridge.probe(model, vmap=True): the probe maps the model over "
    "axis 0 of the positional inputs, as jax.vmap(model) would."
)


def _state_indices(model: eqx.Module) -> list[str]:
    found = jax.tree_util.tree_flatten_with_path(
        model, is_leaf=lambda x: isinstance(x, eqx.nn.StateIndex)
    )[0]
    return [
        "/".join(key_name(k) for k in path) or "the model"
        for path, leaf in found
        if isinstance(leaf, eqx.nn.StateIndex)
    ]
