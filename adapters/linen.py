"""Flax Linen: `Module.perturb`, inserted from outside with `nn.intercept_methods`.

Every submodule method call passes through an interceptor that reports it to
the probe's session. At a selected call the interceptor calls the module's own
`perturb` on its output, reading the epsilon from a private variable
collection laid out like `params` (`{scope path...: {"__call__#k": eps}}`).
Each call has its own variable name, so the gradients of a shared module's
calls are never summed, and the collection is passed to `apply` only when
there are epsilons, so unselected sites cost nothing.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax

from bridge._probe import ProbeBase
from bridge._session import Session
from bridge._sites import Site, differentiable_part, merge_differentiable

#: The variable collection holding the probe's epsilons. A private name, so a
#: model that calls `self.perturb` itself (collection "perturbations") is not
#: disturbed.
EPSILON_COLLECTION = "bridge_epsilons"

#: Keywords of `Module.apply` rather than of the model.
_APPLY_KEYWORDS = ("rngs", "mutable", "capture_intermediates")


def probe(module: nn.Module, *variables: Any, vmap: bool = False) -> LinenProbe:
    if len(variables) != 1:
        raise TypeError(
            "A Flax Linen module needs its variables: bridge.probe(module, "
            "variables) with variables = module.init(key, x) (a dict with a "
            f"'params' collection); got {len(variables)} variable arguments."
        )
    (variables,) = variables
    if not isinstance(variables, Mapping):
        raise TypeError(
            "`variables` must be the dict returned by module.init(key, x), e.g. "
            f"{{'params': ...}}; got {type(variables).__name__}."
        )
    if variables and "params" not in variables:
        raise ValueError(
            "`variables` has no 'params' collection (its keys are "
            f"{sorted(variables)}). Pass what module.init returns, or wrap bare "
            "parameters: bridge.probe(module, {'params': params})."
        )
    if EPSILON_COLLECTION in variables:
        raise ValueError(
            f"`variables` has a '{EPSILON_COLLECTION}' collection, which bridge "
            "reserves for its own epsilons. Remove it."
        )
    return LinenProbe(module, variables, vmap)


@jax.tree_util.register_pytree_node_class
class LinenProbe(ProbeBase):
    """A Flax Linen module with its variables. See `bridge.ActivationProbe`."""

    def __init__(self, module: nn.Module, variables: Mapping, vmap: bool = False):
        self.module = module
        self.variables = variables
        self.vmap = vmap

    def tree_flatten(self):
        return (self.variables,), (self.module, self.vmap)

    @classmethod
    def tree_unflatten(cls, static, children):
        return cls(static[0], children[0], static[1])

    def __repr__(self) -> str:
        return f"LinenProbe({type(self.module).__name__}, vmap={self.vmap})"

    def _trainable(self) -> Any:
        return self.variables.get("params", {})

    def _check_call(self, args: tuple, kwargs: dict) -> None:
        mutable = kwargs.get("mutable", False)
        if not (
            isinstance(mutable, bool | str)
            or (
                isinstance(mutable, list | tuple)
                and all(isinstance(m, str) for m in mutable)
            )
            or callable(mutable)
        ):
            raise TypeError(
                "`mutable` goes to Module.apply: a collection name, a list of names "
                f"(e.g. mutable=['batch_stats']), True or False; got {mutable!r}."
            )

    def _run(
        self, trainable: Any, args: tuple, kwargs: dict, session: Session
    ) -> tuple[Any, Any]:
        apply_kwargs = {k: kwargs[k] for k in _APPLY_KEYWORDS if k in kwargs}
        model_kwargs = {k: v for k, v in kwargs.items() if k not in _APPLY_KEYWORDS}
        variables = {**self.variables, "params": trainable}
        if session.epsilons:
            variables[EPSILON_COLLECTION] = _epsilon_collection(
                session.selected, session.epsilons
            )

        def interceptor(next_fun, call_args, call_kwargs, context):
            module = context.module
            method = context.method_name
            if (
                module.path == ()
                or method == "setup"
                or (method.startswith("_") and method != "__call__")
            ):
                return next_fun(*call_args, **call_kwargs)
            path = tuple(module.path)
            call = session.enter(
                "/".join(path),
                None if method == "__call__" else method,
                module,
                call_args,
                origin=path,
            )
            value = next_fun(*call_args, **call_kwargs)
            key = _variable_name(method, call.index)

            def perturb(value):
                floats = module.perturb(
                    key, differentiable_part(value), collection=EPSILON_COLLECTION
                )
                return merge_differentiable(value, floats)

            return session.exit(call, value, perturb)

        with nn.intercept_methods(interceptor):
            result = self.module.apply(variables, *args, **apply_kwargs, **model_kwargs)
        if apply_kwargs.get("mutable", False) is False:
            return result, None
        outputs, state = result
        state = {k: v for k, v in state.items() if k != EPSILON_COLLECTION}
        return outputs, state


def _variable_name(method: str, index: int) -> str:
    # `#` cannot occur in an attribute name, so this never shadows a submodule.
    return f"{method}#{index}"


def _epsilon_collection(selected: Mapping[str, Site], epsilons: Mapping) -> dict:
    """The epsilons laid out by scope path, as `Module.perturb` reads them."""
    collection: dict = {}
    for name, epsilon in epsilons.items():
        site = selected[name]
        if site.origin is None:  # a `bridge.tap`: its epsilon lives in the session
            continue
        scope = collection
        for part in site.origin:
            scope = scope.setdefault(part, {})
        scope[_variable_name(site.method or "__call__", site.index)] = epsilon
    return collection
