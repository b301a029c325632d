"""dm-haiku: an epsilon read from Haiku state, added by `hk.intercept_methods`.

Every module method call passes through an interceptor, installed around
`apply` from outside, that reports it to the probe's session. At a selected
call of an `hk.transform_with_state` model the interceptor adds
`hk.get_state(...)` to the call's output: the epsilons travel in the state
passed to `apply`, in the module's own state bundle (keyed like its params),
so Haiku threads them wherever it threads state, and the gradient with respect
to those state entries is the activation gradient. They are stripped from the
state `apply` returns.

Haiku refuses state inside a plain `hk.transform` (`NonEmptyStateError`), and
a `Transformed` does not expose the function it wraps, so there the epsilon
comes from the probe's session instead: the same interceptor adds it from a
closure. Both give the same numbers; the state route is kept where Haiku
allows it because it is Haiku's own way to feed a value into a module call.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import haiku as hk
import jax
import jax.numpy as jnp

from bridge._probe import ProbeBase
from bridge._session import Session
from bridge._sites import Site, differentiable_part, merge_differentiable

#: Prefix of the state entries that hold the probe's epsilons. `#` and `.`
#: cannot occur in a name a Haiku module gives its own state by convention.
EPSILON_PREFIX = "bridge_epsilon."

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
    if with_state:
        if len(variables) != 2:
            raise TypeError(
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
            raise TypeError(
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
        return (self.params, self.state), (self.transformed, self.takes_rng, self.vmap)

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
            raise TypeError(
                "`rng` goes to the transformed function's apply, but this one was "
                "made with hk.without_apply_rng and takes no rng. Drop `rng=`, or "
                "transform the model without hk.without_apply_rng."
            )

    def _run(
        self, trainable: Any, args: tuple, kwargs: dict, session: Session
    ) -> tuple[Any, Any]:
        model_kwargs = {k: v for k, v in kwargs.items() if k != "rng"}
        leading = (kwargs.get("rng"),) if self.takes_rng else ()
        with_state = self.with_state

        def interceptor(next_fun, call_args, call_kwargs, context):
            method = context.method_name
            if not _is_site(context):
                return next_fun(*call_args, **call_kwargs)
            module = context.module
            # The module's state bundle: where its epsilons live (and, outside
            # lifted transforms, its params' key).
            bundle = hk.experimental.current_name()
            call = session.enter(
                module.module_name,
                None if method == "__call__" else method,
                module,
                call_args,
                origin=bundle,
            )
            value = next_fun(*call_args, **call_kwargs)
            if not with_state:
                return session.exit(call, value)  # the session's own epsilon
            entry = _state_entry(method, call.index)

            def perturb(value):
                epsilon = hk.get_state(entry, (), jnp.float32, init=_unreachable(call))
                floats = jax.tree.map(
                    lambda v, e: v + e, differentiable_part(value), epsilon
                )
                return merge_differentiable(value, floats)

            return session.exit(call, value, perturb)

        if not with_state:
            with hk.intercept_methods(interceptor):
                outputs = self.transformed.apply(
                    trainable, *leading, *args, **model_kwargs
                )
            return outputs, None
        state = _with_epsilons(self.state, session.selected, session.epsilons)
        with hk.intercept_methods(interceptor):
            outputs, new_state = self.transformed.apply(
                trainable, state, *leading, *args, **model_kwargs
            )
        return outputs, _without_epsilons(new_state)


def _is_site(context: hk.MethodContext) -> bool:
    """A module method call a user would name: not `__init__`, private helpers
    (`MultiHeadAttention._linear_projection`) or property reads
    (`Embed.embeddings`, `ExponentialMovingAverage.average`), which Haiku
    intercepts too."""
    method = context.method_name
    if method.startswith("_") and method != "__call__":
        return False
    attribute = inspect.getattr_static(context.orig_class, method, None)
    return not isinstance(attribute, property)


def _unreachable(call: Any) -> Any:
    """The `init` of an epsilon's `hk.get_state`: called only where the state
    given to `apply` does not reach, inside a lifted transform."""

    def fail(shape: Any, dtype: Any) -> Any:
        raise NotImplementedError(
            f"Site {call.name!r} is called inside a Haiku lifted transform "
            "(hk.experimental.layer_stack, hk.lift, ...), which has its own state "
            "that bridge's Haiku adapter does not reach yet. Select sites outside "
            "it with `at=`."
        )

    return fail


def _state_entry(method: str, index: int) -> str:
    return f"{EPSILON_PREFIX}{method}#{index}"


def _with_epsilons(
    state: Mapping, selected: Mapping[str, Site], epsilons: Mapping
) -> dict:
    """The user's state plus each epsilon in its module's bundle (new dicts)."""
    merged = {bundle: dict(entries) for bundle, entries in state.items()}
    for name, epsilon in epsilons.items():
        site = selected[name]
        if site.origin is None:  # a `bridge.tap`: its epsilon lives in the session
            continue
        entry = _state_entry(site.method or "__call__", site.index)
        merged.setdefault(site.origin, {})[entry] = epsilon
    return merged


def _without_epsilons(state: Mapping) -> dict:
    """Apply's new state less the epsilons, and less bundles that held only them."""
    stripped = {}
    for bundle, entries in state.items():
        kept = {k: v for k, v in entries.items() if not k.startswith(EPSILON_PREFIX)}
        if kept or len(kept) == len(entries):
            stripped[bundle] = kept
    return stripped


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


def _check_mapping(name: str, value: Any, usage: str) -> None:
    if not isinstance(value, Mapping):
        hint = (
            " If you passed the (params, state) pair that "
            "hk.transform_with_state's init returns, unpack it."
            if isinstance(value, tuple)
            else ""
        )
        raise TypeError(
            f"`{name}` must be the dict of dicts that transformed.init returns "
            f"({usage}); got {type(value).__name__}.{hint}"
        )


def _check_reserved(state: Mapping) -> None:
    for bundle, entries in state.items():
        for entry in entries:
            if str(entry).startswith(EPSILON_PREFIX):
                raise ValueError(
                    f"`state[{bundle!r}]` has an entry {entry!r}: bridge reserves "
                    f"state names starting with {EPSILON_PREFIX!r} for its own "
                    "epsilons. Rename it."
                )
