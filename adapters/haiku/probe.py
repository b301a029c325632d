"""dm-haiku: an epsilon read from Haiku state, added by `hk.intercept_methods`.

Every module method call passes through an interceptor, installed around
`apply` from outside, that reports it to the probe's session. At a selected
call of an `hk.transform_with_state` model the interceptor adds
`hk.get_state(...)` to the call's output: the epsilons travel in the state
passed to `apply`, in the module's own state bundle (keyed like its params),
so Haiku threads them wherever it threads state, and the gradient with respect
to those state entries is the activation gradient. They are stripped from the
state `apply` returns.

Haiku refuses state inside a plain `hk.transform` (`NonEmptyStateError`), so
there the epsilon comes from the probe's session instead: the same interceptor
adds it from a closure. Both give the same numbers; the state route is kept
where Haiku allows it because it is Haiku's own way to feed a value into a
module call.

Haiku's transforms run a module's call inside a JAX transform, where a value
seen by the interceptor is a tracer of the inner trace; they are recognised
on the Python call stack. Inside `hk.experimental.layer_stack`, `hk.remat`
(and `hk.jit`) and `hk.scan`, epsilons ride in with state and recordings leave
with `hk.set_state`, so a site there is a real site: a layer stack slices
state per layer going in and stacks it coming out (its sites hold every layer,
`(layers, *value shape)`); `hk.remat` threads it through; `hk.scan` carries it,
so the carry holds the whole stacked epsilon and recording and a step counter
picks the iteration's row (sites hold every iteration, in the order of `xs`).
A patch value there is given in the site's stacked shape and rides in state
beside the epsilon, so each layer or iteration takes its row; a patch
function is applied per layer or iteration; `with_inputs=True` records each
one's positional inputs, stacked like the values. A plain `hk.transform`
model with such a site runs as the `hk.transform_with_state` of the function
it wraps (Haiku keeps it on `apply`). `hk.fori_loop`, `hk.while_loop`,
`hk.vmap`, `hk.cond`, `hk.switch` and a user's `hk.lift` carry state as one
value for every iteration or example: a site inside them takes the
control-flow route where JAX's branches and loops of known bounds alone
enclose it (a layer stack's and `hk.scan`'s scans among them, which count
their iterations while a probe runs: a branch in a layer stack is a site per
layer), and selecting or patching one elsewhere raises, naming the
transform.

The interceptor is `bridge.adapters.haiku.run`; the state route is
`bridge.adapters.haiku.variables`, through Haiku's lifted transforms
`bridge.adapters.haiku.transforms`; reading the enclosing transforms off the
call stack, the one use of Haiku's internals, is
`bridge.adapters.haiku.internals`.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Mapping
from typing import Any

import haiku as hk
import jax

from bridge.adapter_api import (
    BridgeTypeError,
    BridgeValueError,
    ProbeBase,
    Session,
    Site,
    is_carrier_name,
)

from ..shared import guests, unexpressible
from .run import Interceptor
from .variables import (
    NeedsState,
    with_epsilons,
    without_epsilons,
)
from .variables import placed as placed_in_state
from .variables import with_state as with_state_transform

_PLAIN_USAGE = (
    "bridge.probe(transformed, params) with params = transformed.init(rng, x)"
)
_STATE_USAGE = (
    "bridge.probe(transformed, params, state) with params, state = "
    "transformed.init(rng, x)"
)


def probe(
    transformed: hk.Transformed | hk.TransformedWithState,
    *variables: Any,
    vmap: bool = False,
) -> HaikuProbe:
    with_state = isinstance(transformed, hk.TransformedWithState)
    if len(variables) == 1 and _is_params_and_state(variables[0]):
        raise BridgeTypeError(
            "bridge.probe got the (params, state) pair that "
            "hk.transform_with_state's init returns as one argument: unpack it, "
            f"{_STATE_USAGE}: bridge.probe(transformed, *variables)."
        )
    if with_state:
        if len(variables) != 2:
            raise BridgeTypeError(
                "An hk.transform_with_state model needs its params and its state: "
                f"{_STATE_USAGE}; got {len(variables)} variable arguments."
            )
        params, state = variables
        _check_mapping("state", state, _STATE_USAGE)
        _check_reserved(state)
    else:
        if len(variables) != 1:
            hint = (
                " An hk.transform model has no state: if it uses hk.get_state or "
                "hk.set_state, transform it with hk.transform_with_state and pass "
                "bridge.probe(transformed, params, state)."
                if len(variables) > 1
                else ""
            )
            raise BridgeTypeError(
                f"An hk.transform model needs its params: {_PLAIN_USAGE}; got "
                f"{len(variables)} variable arguments.{hint}"
            )
        (params,) = variables
        state = None
    _check_mapping("params", params, _STATE_USAGE if with_state else _PLAIN_USAGE)
    return HaikuProbe(transformed, params, state, _takes_rng(transformed), vmap)


@jax.tree_util.register_pytree_node_class
class HaikuProbe(ProbeBase):
    """A Haiku transformed function with its params (and state).

    See `bridge.ActivationProbe`. `rng=` given to `value_and_grad`, `apply` or
    `sites` goes to the transformed function's `apply`.
    """

    #: What `bridge.transfer` and `bridge.compare` know of this library.
    porting_side = "bridge.adapters.haiku.porting"

    #: The transformed functions are in the treedef, params and state are
    #: leaves, and an origin is a state bundle's name and flags: a discovery
    #: is reused by structure.
    reuses_discovery = True

    def __init__(
        self,
        transformed: hk.Transformed | hk.TransformedWithState,
        params: Mapping,
        state: Mapping | None,
        takes_rng: bool,
        vmap: bool = False,
    ):
        self.transformed = transformed
        self.params = params
        self.state = state
        self.takes_rng = takes_rng
        self.vmap = vmap

    @property
    def with_state(self) -> bool:
        return self.state is not None

    def tree_flatten(self):
        static = (self.transformed, self.takes_rng, self.vmap)
        return (self.params, self.state), static

    @classmethod
    def tree_unflatten(cls, static, children):
        transformed, takes_rng, vmap = static
        params, state = children
        return cls(transformed, params, state, takes_rng, vmap)

    def __repr__(self) -> str:
        kind = "transform_with_state" if self.with_state else "transform"
        return f"HaikuProbe({kind}, vmap={self.vmap})"

    def _trainable(self) -> Any:
        return self.params

    def _check_call(self, args: tuple, kwargs: dict) -> None:
        if "rng" in kwargs and not self.takes_rng:
            raise BridgeTypeError(
                "`rng` goes to the transformed function's apply, but this one was "
                "made with hk.without_apply_rng and takes no rng. Drop `rng=`, or "
                "transform the model without hk.without_apply_rng."
            )

    @guests.hosted("haiku")
    def _run(
        self, trainable: Any, args: tuple, kwargs: dict, session: Session
    ) -> tuple[Any, Any]:
        unexpressible.refuse_patched(session)
        placed = placed_in_state(session)
        if self.with_state:
            return self._apply(trainable, args, kwargs, session, True, placed)
        return session.run_with_fallback(
            lambda state_route: self._apply(
                trainable, args, kwargs, session, state_route, placed
            ),
            NeedsState,
            lambda origin: origin.lifted,
        )

    def _apply(
        self,
        trainable: Any,
        args: tuple,
        kwargs: dict,
        session: Session,
        state_route: bool,
        placed: Mapping[str, Site],
    ) -> tuple[Any, Any]:
        model_kwargs = {k: v for k, v in kwargs.items() if k != "rng"}
        leading = (kwargs.get("rng"),) if self.takes_rng else ()
        # Haiku's transforms around a call are read off the stack up to this
        # frame: what runs the probe (a user's jit, a scan of it) is not the
        # model's.
        here = sys._getframe()
        interceptor = Interceptor(session, state_route, placed, here)
        tapping = session.taps.tapping(interceptor.tap)
        if not state_route:  # a plain transform: epsilons from the session
            with tapping, hk.intercept_methods(interceptor):
                outputs = self.transformed.apply(
                    trainable, *leading, *args, **model_kwargs
                )
            return outputs, None
        transformed = (
            self.transformed
            if self.with_state
            else with_state_transform(self.transformed, self.takes_rng)
        )
        state = with_epsilons(self.state or {}, session, placed)
        with tapping, hk.intercept_methods(interceptor):
            outputs, new_state = transformed.apply(
                trainable, state, *leading, *args, **model_kwargs
            )
        # The values recorded inside lifted transforms, as they leave them in
        # state (stacked over a layer stack's layers).
        session.carrier.hand_over(lambda where: new_state[where[0]][where[1]])
        new_state = without_epsilons(new_state)
        if self.with_state:
            return outputs, new_state
        if new_state:
            raise BridgeValueError(  # what Haiku's own plain apply refuses too
                "The model uses hk.get_state or hk.set_state, so it needs "
                "hk.transform_with_state: pass bridge.probe(transformed, params, "
                "state) with params, state = transformed.init(rng, x)."
            )
        return outputs, None

    # -- taking the model out (`ActivationProbe.unwrap`) -------------------------

    def unwrap(self) -> tuple:
        """`(transformed, params)`, or `(transformed, params, state)` for
        `hk.transform_with_state`, what `bridge.probe` takes: the probe's
        params and state (after `bridge.transfer`, the ported ones) in
        containers of their own, so that changing them changes no probe."""
        params, state = jax.tree.map(lambda leaf: leaf, (self.params, self.state))
        if self.with_state:
            return self.transformed, params, state
        return self.transformed, params


def _takes_rng(transformed: hk.Transformed | hk.TransformedWithState) -> bool:
    """Whether `apply` takes an rng (`hk.without_apply_rng` removes it).

    Haiku gives every apply it builds a signature; its rng parameter is named
    `rng`, after `params` (and `state`).
    """
    position = 2 if isinstance(transformed, hk.TransformedWithState) else 1
    try:
        parameters = list(inspect.signature(transformed.apply).parameters.values())
    except (TypeError, ValueError):
        return True  # not inspectable: assume Haiku's default signature
    return len(parameters) > position and parameters[position].name == "rng"


def _is_params_and_state(value: Any) -> bool:
    return (
        isinstance(value, tuple)
        and len(value) == 2
        and all(isinstance(part, Mapping) for part in value)
    )


def _check_mapping(name: str, value: Any, usage: str) -> None:
    if not isinstance(value, Mapping):
        hint = (
            " If you passed the (params, state) pair that "
            "hk.transform_with_state's init returns, unpack it."
            if isinstance(value, tuple)
            else ""
        )
        raise BridgeTypeError(
            f"`{name}` must be the dict of dicts that transformed.init returns "
            f"({usage}); got {type(value).__name__}.{hint}"
        )


def _check_reserved(state: Mapping) -> None:
    for bundle, entries in state.items():
        for entry in entries:
            if is_carrier_name(entry):
                raise BridgeValueError(
                    f"`state[{bundle!r}]` has an entry {entry!r}: bridge reserves "
                    "state names of the form 'bridge_<kind>:<method>#<index>' "
                    "for its own epsilons and recordings. Rename it."
                )
