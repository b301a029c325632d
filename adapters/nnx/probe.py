"""Flax NNX: graph surgery on a copy of the module, made inside the traced call.

`bridge.probe(module)` splits the module once into its graph definition and
its state (`nnx.Param` and everything else); the probe's pytree leaves are
that state, so `jax.jit(step)(probe, x)` traces the parameters instead of
baking them in. Each run merges a fresh copy (`nnx.merge(..., copy=True)`:
a plain merge would share the user's `Variable` objects) and gives every
submodule of the copy a reporting subclass of its own class, whose public
methods and `__call__` report each call to the probe's session. The user's
module, its classes and its `Variable` objects are never touched.

Rngs: the copy starts from the user's RNG counts, so a probe draws the same
dropout masks as the model's next plain call would, and drawing them advances
the copy only. The advanced `RngCount` comes back in `state` with the rest of
the non-`Param` state, so `nnx.update(model, res.state)` leaves the model as
a plain call would have. An `nnx.Rngs` passed as a call argument is copied
too: it is the user's, and is never advanced.

Not `Module.perturb` + `nnx.capture`: capture with `method_outputs` patches
the user's classes for everyone while it runs, and attaches `__captures__` to
the module it is given.

Each run's copy is given reporting classes by `bridge.adapters.nnx.surgery`,
and its calls go to the run of the copy, `bridge.adapters.nnx.run`, which
reports each plainly; where it runs (NNX's transforms, which run the copy's
modules as new objects, and JAX's) the core reads from the computation.

Modules of other libraries called inside the model — a Linen module under
`nnx.bridge.ToNNX`, an `hk.transform`ed function's `apply` — are sites
named under the NNX site that calls them (`bridge.adapters.shared.guests`).
`ToNNX` hands every attribute of its module to Linen as a variable, so
bridge's attributes on the copy are hidden while it runs. The NNX module an
`nnx.bridge.ToLinen` builds inside a Linen model is instrumented too
(`bridge.adapters.nnx.guest`).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
from flax import nnx

from bridge.adapter_api import BridgeTypeError, ProbeBase, Session

from ..shared import guests
from . import internals, surgery
from .run import Run


def probe(module: nnx.Module, *variables: Any, vmap: bool = False) -> NnxProbe:
    if variables:
        raise BridgeTypeError(
            "An NNX module carries its own variables: call bridge.probe(module), "
            f"without further arguments; got {len(variables)} extra argument(s). "
            "To probe other weights, load them first: nnx.update(module, state)."
        )
    if not callable(module):
        raise BridgeTypeError(
            f"bridge.probe(module) calls module(*args), but {type(module).__name__} "
            "defines no __call__. Probe the module that runs the forward pass."
        )
    graphdef, params, rest = nnx.split(module, nnx.Param, ...)
    # Fresh Variable objects holding the same (immutable) arrays: the probe is a
    # snapshot, unaffected by later in-place updates of the module.
    params, rest = jax.tree.map(lambda leaf: leaf, (params, rest))
    return NnxProbe(graphdef, params, rest, vmap, _equinox_attributes(module))


def _equinox_attributes(model: nnx.Module) -> tuple[str, ...]:
    """The paths of the Equinox modules the model's modules hold (`head`):
    bridge cannot see the calls inside them (see `bridge.adapters.shared.guests`)."""
    found = []
    for path, module in internals.iter_modules(model):
        for name, value in vars(module).items():
            if guests.is_equinox_module(value):
                found.append("/".join([*(str(part) for part in path), name]))
    return tuple(found)


@jax.tree_util.register_pytree_node_class
class NnxProbe(ProbeBase):
    """An `nnx.Module`, split into graph and state. See `bridge.ActivationProbe`.

    The probe is a snapshot of the module when it was made: after updating the
    module in place (an optimizer step, `nnx.update`, `model.eval()`), probe it
    again — `bridge.probe(model)` only splits the graph.
    """

    #: What `bridge.transfer` and `bridge.compare` know of this library.
    porting_side = "bridge.adapters.nnx.porting"

    #: The graph definition (static attributes included) is in the treedef
    #: and the state is leaves: a discovery is reused by structure.
    reuses_discovery = True

    def __init__(
        self,
        graphdef: Any,
        params: nnx.State,
        rest: nnx.State,
        vmap: bool = False,
        equinox_attributes: tuple[str, ...] = (),
    ):
        self.graphdef = graphdef
        self.params = params
        self.rest = rest
        self.vmap = vmap
        self.equinox_attributes = equinox_attributes

    def tree_flatten(self):
        return (self.params, self.rest), (
            self.graphdef,
            self.vmap,
            self.equinox_attributes,
        )

    @classmethod
    def tree_unflatten(cls, static, children):
        graphdef, vmap, equinox_attributes = static
        return cls(graphdef, *children, vmap, equinox_attributes)

    def __repr__(self) -> str:
        return f"NnxProbe({self.graphdef.nodes[0].type.__name__}, vmap={self.vmap})"

    def _trainable(self) -> Any:
        return self.params

    def _check_paths(self, at: Any, patch: Any) -> None:
        guests.check_not_inside(self.equinox_attributes, "nnx", at, patch)

    def _run(
        self, trainable: Any, args: tuple, kwargs: dict, session: Session
    ) -> tuple[Any, Any]:
        model = nnx.merge(self.graphdef, trainable, self.rest, copy=True)
        run = Run(surgery.instrument(model))
        # Graph nodes among the inputs (an `nnx.Rngs` for dropout) are the
        # user's too: the model may advance them, so it gets copies.
        args, kwargs = _copy_graph_nodes((args, kwargs))
        with (
            surgery.running(run),
            session.taps.tapping(functools.partial(run.tap, session)),
            guests.hosting("nnx"),
        ):
            outputs = model(*args, **kwargs)
        state = nnx.state(model, nnx.Not(nnx.Param))
        return outputs, state if jax.tree.leaves(state) else None

    # -- taking the model out (`ActivationProbe.unwrap`) -------------------------

    def unwrap(self) -> tuple:
        """`(module,)`, what `bridge.probe` takes: a new module of the probe's
        graph and state (after `bridge.transfer`, the ported weights) with
        `Variable` objects of its own. The user's module is untouched, and
        updating the new one changes no probe."""
        return (nnx.merge(self.graphdef, self.params, self.rest, copy=True),)


def _copy_graph_nodes(tree: Any) -> Any:
    return jax.tree.map(
        lambda leaf: (
            nnx.clone(leaf) if internals.graphlib.is_graph_node(leaf) else leaf
        ),
        tree,
        is_leaf=internals.graphlib.is_graph_node,
    )
