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
from bridge._session import Session, positional_arrays
from bridge._sites import Site, differentiable_part, merge_differentiable

#: The variable collection holding the probe's epsilons. A private name, so a
#: model that calls `self.perturb` itself (collection "perturbations") is not
#: disturbed.
EPSILON_COLLECTION = "bridge_epsilons"

#: The mutable collection carrying recordings out of lifted transforms.
RECORDING_COLLECTION = "bridge_recordings"

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
    for reserved in (EPSILON_COLLECTION, RECORDING_COLLECTION):
        if reserved in variables:
            raise ValueError(
                f"`variables` has a '{reserved}' collection, which bridge reserves "
                "for its own use. Remove it."
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
        user_mutable = apply_kwargs.pop("mutable", False)
        variables = {**self.variables, "params": trainable}
        if session.epsilons:
            variables[EPSILON_COLLECTION] = _epsilon_collection(
                session.selected, session.epsilons
            )
        interceptor = _Interceptor(session)
        with nn.intercept_methods(interceptor):
            outputs, state = self.module.apply(
                variables,
                *args,
                mutable=_with_recordings(user_mutable),
                **apply_kwargs,
                **model_kwargs,
            )
        interceptor.hand_over(state.get(RECORDING_COLLECTION, {}))
        if user_mutable is False:
            return outputs, None
        return outputs, {
            k: v
            for k, v in state.items()
            if k not in (EPSILON_COLLECTION, RECORDING_COLLECTION)
        }


def _with_recordings(mutable: Any) -> Any:
    """The user's `mutable`, plus the collection carrying recordings out of
    lifted transforms."""
    if mutable is True:
        return True
    if mutable is False:
        return [RECORDING_COLLECTION]
    if isinstance(mutable, str):
        return [mutable, RECORDING_COLLECTION]
    return [*mutable, RECORDING_COLLECTION]


class _Frame:
    """One active method call, as the interceptor sees it."""

    def __init__(self, root: Any):
        self.root = root  # the scope root the call runs in
        self.bodies: dict[tuple, Any] = {}  # lifted bodies traced from this call
        self.transform = "a Flax lifted transform"


class _Interceptor:
    """Reports every submodule call of one `apply` to the session.

    Calls inside a Flax lifted transform (`nn.remat`, `nn.jit`, ...) run in a
    scope of their own, with its own root, and their values are tracers of the
    transform's inner trace. Their recordings leave through a mutable variable
    collection, as the library's own `sow` does; a transform that does not
    carry bridge's collections raises instead of silently dropping a site.
    Flax traces some bodies more than once; a repeated trace of the same body
    re-uses the names of the first.
    """

    def __init__(self, session: Session):
        self.session = session
        self.stack: list[_Frame] = []
        self.deferred: dict[str, tuple[tuple[str, ...], str]] = {}

    def __call__(self, next_fun, call_args, call_kwargs, context):
        module, method = context.module, context.method_name
        parent = self.stack[-1] if self.stack else None
        frame = _Frame(module.scope.root)
        lifted = parent is not None and frame.root is not self.stack[0].root
        if parent is not None and frame.root is not parent.root:
            self._entering_lifted_scope(parent, module, method)
        self.stack.append(frame)
        try:
            if (
                module.path == ()
                or method == "setup"
                or (method.startswith("_") and method != "__call__")
            ):
                return next_fun(*call_args, **call_kwargs)
            return self._site(next_fun, call_args, call_kwargs, module, method, lifted)
        finally:
            self.stack.pop()

    def _entering_lifted_scope(self, parent: _Frame, module: Any, method: str) -> None:
        if module.path == ():
            # The transformed module itself (`ScanBlock`), before its body runs:
            # what follows is a new call of the body, not a re-trace.
            parent.bodies.clear()
            parent.transform = _transform_name(module)
            return
        key = (module.path, method, type(module))
        if key in parent.bodies:
            self.session.restore(parent.bodies[key])
        else:
            parent.bodies[key] = self.session.checkpoint()

    def _site(self, next_fun, call_args, call_kwargs, module, method, lifted):
        session = self.session
        path = tuple(module.path)
        if lifted and not module.is_mutable_collection(RECORDING_COLLECTION):
            transform = next(
                (f.transform for f in reversed(self.stack) if f.bodies), "a transform"
            )
            raise ValueError(
                f"bridge cannot see through {transform} around "
                f"'{'/'.join(path)}': its variable_axes do not carry bridge's "
                "collections, so a perturbation there would be silently dropped. "
                "Probing sites inside nn.scan and nn.vmap is not supported yet; "
                "nn.remat, nn.checkpoint and nn.jit are."
            )
        call = session.enter(
            "/".join(path),
            None if method == "__call__" else method,
            module,
            call_args,
            origin=path,
            record=not lifted,
        )
        value = next_fun(*call_args, **call_kwargs)
        key = _variable_name(method, call.index)

        def perturb(value):
            floats = module.perturb(
                key, differentiable_part(value), collection=EPSILON_COLLECTION
            )
            return merge_differentiable(value, floats)

        value = session.exit(call, value, perturb, record=not lifted)
        if lifted and call.name in session.selected:
            inputs = positional_arrays(call_args) if session.with_inputs else None
            module.scope.put_variable(
                RECORDING_COLLECTION, key, (differentiable_part(value), inputs)
            )
            self.deferred[call.name] = (path, key)
        return value

    def hand_over(self, recordings: Mapping) -> None:
        """Give the session the values recorded inside lifted transforms."""
        for name, (path, key) in self.deferred.items():
            node = recordings
            for part in path:
                node = node[part]
            value, inputs = node[key]
            self.session.record(name, value, inputs)


def _transform_name(module: Any) -> str:
    """`ScanBlock` (made by `nn.scan(Block)`) -> `nn.scan`."""
    cls = type(module)
    base = cls.__mro__[1].__name__
    prefix = cls.__name__.removesuffix(base) if cls.__name__ != base else ""
    return f"nn.{prefix.lower()}" if prefix else f"the lifted transform {cls.__name__}"


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
