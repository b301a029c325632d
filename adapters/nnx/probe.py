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

NNX transforms in the model's own code (`nnx.scan`, `nnx.vmap`, `nnx.remat`)
run the copy's modules as new objects: the run of the copy, and the sites
inside those transforms, are `bridge.adapters.nnx.transforms`.

Modules of other libraries called inside the model — a Linen module under
`nnx.bridge.ToNNX`, an `hk.transform`ed function's `apply` — are sites
named under the NNX site that calls them (`bridge.adapters.shared.guests`).
`ToNNX` hands every attribute of its module to Linen as a variable, so
bridge's attributes on the copy are hidden while it runs. The NNX module an
`nnx.bridge.ToLinen` builds inside a Linen model is instrumented here too
(`GuestRun`).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import sys
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import jax
from flax import nnx

from bridge.adapter_api import BridgeTypeError, ProbeBase, Session, current_session

from ..shared import guests, jax_internals
from . import internals
from . import transforms as nnx_run
from .guest import to_nnx_class

#: The probe's run of its copy, while it runs: a reporting method reports only
#: calls of the modules of the copy running now (or of the NNX module an
#: `nnx.bridge.ToLinen` builds inside a Linen model: a `GuestRun`).
_RUN: contextvars.ContextVar[nnx_run.Run | GuestRun | None] = contextvars.ContextVar(
    "bridge_nnx_run", default=None
)

#: Containers are graph nodes (nnx.List is even an nnx.Module) but are never
#: called: they hold sites and are not sites themselves.
_CONTAINERS = (nnx.List, nnx.Dict)


#: Methods that configure a module rather than compute with it.
_NOT_SITES = frozenset(dir(nnx.Module)) | {"set_view"}

#: `{class: its reporting subclass}`, made once per class.
_REPORTING_CLASSES: dict[type, type] = {}


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

    #: The graph definition (static attributes included) is in the treedef,
    #: the state is leaves, and an origin is a path, transform names and
    #: abstract shapes: a discovery is reused by structure.
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
            self._inside,
        )

    @classmethod
    def tree_unflatten(cls, static, children):
        graphdef, vmap, equinox_attributes, inside = static
        probe = cls(graphdef, *children, vmap, equinox_attributes)
        return probe._looking_inside(inside)

    def __repr__(self) -> str:
        return f"NnxProbe({self.graphdef.nodes[0].type.__name__}, vmap={self.vmap})"

    def _trainable(self) -> Any:
        return self.params

    def _check_paths(self, at: Any, patch: Any) -> None:
        guests.check_not_inside(self.equinox_attributes, "nnx", at, patch)

    def _run(
        self, trainable: Any, args: tuple, kwargs: dict, session: Session
    ) -> tuple[Any, Any]:
        # Discovery first runs without markers; where it meets a module that
        # nnx.scan carries or broadcasts, it runs again with one on each.
        candidates: dict[tuple[str, str], int] = {}
        return session.run_with_fallback(
            lambda markers: self._run_once(
                trainable, args, kwargs, session, candidates, markers
            ),
            nnx_run.NeedsCarried,
            lambda origin: getattr(origin, "scan", None) is not None,
        )

    def _run_once(
        self,
        trainable: Any,
        args: tuple,
        kwargs: dict,
        session: Session,
        candidates: dict[tuple[str, str], int],
        markers: bool,
    ) -> tuple[Any, Any]:
        model = nnx.merge(self.graphdef, trainable, self.rest, copy=True)
        # Scans around this frame (a user's jit or scan of the probe) are not
        # the model's: the walks up the stack stop here.
        run = nnx_run.Run(_instrument(model), sys._getframe(), candidates, markers)
        run.place_variables(session)
        # Graph nodes among the inputs (an `nnx.Rngs` for dropout) are the
        # user's too: the model may advance them, so it gets copies.
        args, kwargs = _copy_graph_nodes((args, kwargs))
        token = _RUN.set(run)
        try:
            with (
                session.taps.tapping(functools.partial(run.tap, session)),
                guests.hosting("nnx", run.innermost_transform),
            ):
                outputs = model(*args, **kwargs)
        except ValueError as error:
            run.explain(error)
            raise
        finally:
            _RUN.reset(token)
        if not markers and candidates:  # noted by discovery's first pass only
            session.recorder.fall_back()  # again, with a marker on each
        run.hand_over(session)
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


def _instrument(model: nnx.Module, prefix: str = "") -> dict[str, nnx.Module]:
    """Give every submodule of `model` (a private copy) a reporting class.

    Returns `{path: module}`, each path under `prefix` (the path of the
    `nnx.bridge.ToLinen` site an NNX module is called in). A module reachable
    by several paths (shared) gets the first in graph order, the path under
    which `nnx.state` keys its parameters.
    """
    modules = {}
    for path, module in internals.iter_modules(model):
        if not path or isinstance(module, _CONTAINERS):
            continue
        if any(module is seen for seen in modules.values()):
            continue
        name = guests.joined(prefix, "/".join(str(part) for part in path))
        modules[name] = module
        module.__class__ = _reporting_class(type(module))
        setattr(module, nnx_run.PATH_ATTRIBUTE, name)
    return modules


def _reporting_class(cls: type) -> type:
    """A subclass of `cls` whose public methods report their calls (cached)."""
    if getattr(cls, "_bridge_reports", False):
        return cls
    reporting = _REPORTING_CLASSES.get(cls)
    if reporting is None:
        to_nnx = to_nnx_class()
        hides = to_nnx is not None and issubclass(cls, to_nnx)
        namespace = {
            name: _reporting_method(
                name, _hiding_bridge_attributes(method) if hides else method
            )
            for name, method in _public_methods(cls)
        }
        namespace["_bridge_reports"] = True
        namespace["__module__"] = cls.__module__
        namespace["__qualname__"] = cls.__qualname__
        with warnings.catch_warnings():
            # Subclassing re-reads the class's annotations: a user's deprecated
            # `nnx.Data[...]` annotation would warn again, for no fault of theirs.
            warnings.simplefilter("ignore", DeprecationWarning)
            reporting = type(cls)(
                cls.__name__, (cls,), namespace, **internals.class_keywords(cls)
            )
        _REPORTING_CLASSES[cls] = reporting
    return reporting


def _public_methods(cls: type) -> list[tuple[str, Callable]]:
    methods = []
    for name in dir(cls):
        if name != "__call__" and (name.startswith("_") or name in _NOT_SITES):
            continue
        method = inspect.getattr_static(cls, name)
        if inspect.isfunction(method):
            methods.append((name, method))
    return methods


def _reporting_method(name: str, method: Callable) -> Callable:
    @functools.wraps(method)
    def reporting(self, *args, **kwargs):
        run, session = _RUN.get(), current_session()
        if run is None or session is None:  # not while a probe runs the copy
            return method(self, *args, **kwargs)
        return run.report(self, name, method, args, kwargs, session)

    return reporting


def _hiding_bridge_attributes(method: Callable) -> Callable:
    """A method of `nnx.bridge.ToNNX`, which hands every attribute of its module
    but its own to Linen as variables: bridge's attributes on the copy (its
    path, the variables of sites inside transforms) are hidden while it runs."""

    @functools.wraps(method)
    def hiding(self, *args, **kwargs):
        attributes = vars(self)
        hidden = {
            name: attributes.pop(name)
            for name in list(attributes)
            if nnx_run.is_bridge_attribute(name)
        }
        try:
            return method(self, *args, **kwargs)
        finally:
            attributes.update(hidden)

    return hiding


# -- NNX as a guest: the module `nnx.bridge.ToLinen` builds -------------------------


class GuestRun:
    """The NNX modules an `nnx.bridge.ToLinen` builds during one of its calls,
    inside a Linen model (see `bridge.adapters.nnx.guest.call_to_linen`).

    Their submodules get reporting classes, named under the `ToLinen`'s path;
    each call's epsilon is the session's own. That is right where the calls
    run in the host's trace: a call inside a transform of the host's code, or
    of the NNX module's own (`nnx.scan`, whose body runs on new module
    objects), is listed but refused where selected.
    """

    def __init__(self, host: guests.Host, prefix: str):
        self.host = host
        self.prefix = prefix
        self.trace = jax_internals.current_trace()
        self.outer = internals.active_transforms()
        self.ids: dict[int, str] = {}

    def instrument(self, module: nnx.Module) -> nnx.Module:
        """`module`, built by `ToLinen` for this call, with reporting classes."""
        modules = _instrument(module, self.prefix)
        self.ids.update({id(m): path for path, m in modules.items()})
        return module

    def report(self, module, method_name, method, args, kwargs, session):
        path = self.ids.get(id(module))
        blocked = self.host.transform_around(self.trace)
        if blocked is None and path is None:
            inner = [t for t in internals.active_transforms() if t not in self.outer]
            named = nnx_run.transform_name(inner[-1]) if inner else "an NNX transform"
            blocked = f"{named} in the Flax NNX module's own code"
        elif blocked is None and jax_internals.current_trace() is not self.trace:
            blocked = "a JAX transform in the Flax NNX module's own code"
        return guests.observe(
            session,
            "nnx",
            path or vars(module).get(nnx_run.PATH_ATTRIBUTE, type(module).__name__),
            None if method_name == "__call__" else method_name,
            module,
            args,
            lambda: method(module, *args, **kwargs),
            blocked,
        )


@contextlib.contextmanager
def running(run: GuestRun) -> Iterator[None]:
    """Report the calls of the modules `run` instrumented while this runs."""
    token = _RUN.set(run)
    try:
        yield
    finally:
        _RUN.reset(token)
