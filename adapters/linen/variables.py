"""bridge's variables in a Linen `apply`: the epsilons, in the probe's own
collection laid out like `params` and added by the module's own `perturb`
(`perturbation`), and the recordings that leave lifted transforms in a
mutable collection; inside `nn.scan` and `nn.vmap`, which carry only the
collections their `variable_axes` name, both ride among the parameters,
under reserved names (see `bridge.adapters.linen.transforms`). Where a site's
values live is its `Origin`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax

from bridge.adapter_api import (
    BridgeRuntimeError,
    Call,
    Session,
    SiteOrigin,
    carrier_name,
    differentiable_part,
    merge_differentiable,
)

#: The variable collection holding the probe's epsilons. A private name, so a
#: model that calls `self.perturb` itself (collection "perturbations") is not
#: disturbed.
EPSILON_COLLECTION = "bridge_epsilons"

#: The mutable collection carrying recordings out of lifted transforms.
RECORDING_COLLECTION = "bridge_recordings"


@dataclasses.dataclass(frozen=True)
class Origin(SiteOrigin):
    """Where a Linen site lives: its scope path, and whether its epsilon and
    recording ride with the parameters (inside `nn.scan` or `nn.vmap`).

    `in_session`: the epsilon is the session's own, not a variable. So is an
    `nnx.bridge.ToLinen`'s outside lifted transforms: it hands every variable
    of its scope, bridge's collection too, to the NNX module it builds.

    `tap`: the name of a `bridge.tap` inside a lifted transform, whose
    variables live in the scope of the module that calls it.

    `given`: the call is inside an `apply` the model makes itself, whose
    variables are the model's own arguments (a tied head's kernel, the
    embedding's transpose), not the probe's.

    `blocked`: why bridge cannot express the call, naming the transform that
    holds it (see `bridge.adapters.shared.unexpressible`); listed only.

    `broadcast`: `(key, name)` of the lifted transform around the call that
    broadcasts `params` (`transforms.Broadcasts`), which discovery learnt:
    a run that selects or patches the call must know it too, to route the
    call as one in a loop (an `nn.scan` counting its iterations).
    """

    scope: tuple[str, ...]
    in_params: bool = False
    in_session: bool = False
    tap: str | None = None
    given: bool = False
    blocked: str | None = None
    broadcast: tuple | None = None


def names_params(mutable: Any) -> bool:
    return (
        mutable is True
        or mutable == "params"
        or (isinstance(mutable, list | tuple) and "params" in mutable)
    )


def with_recordings(mutable: Any, in_params: bool) -> Any:
    """The user's `mutable`, plus the collections carrying recordings out."""
    if mutable is True:
        return True
    ours = [RECORDING_COLLECTION, "params"] if in_params else [RECORDING_COLLECTION]
    if mutable is False:
        return ours
    if isinstance(mutable, str):
        return [mutable, *ours]
    return [*mutable, *ours]


def place_epsilons(session: Session, params: Any) -> tuple[dict, Any]:
    """The epsilons laid out by scope path, as `Module.perturb` reads them: in
    the probe's own collection, or among the parameters inside `nn.scan`. A
    `ToLinen`'s epsilon is the session's (its origin's `in_session`)."""
    collection: dict = {}
    # A patch value for a site inside `nn.scan` rides with the parameters
    # beside its epsilon, sliced per iteration as they are.
    for carried in session.carrier.to_carry_in(
        lambda site: not site.origin.in_session, lambda site: site.origin.in_params
    ):
        scope = carried.site.origin.scope
        if carried.site.origin.in_params:
            params = _inserted(params, scope, carried.name, carried.value)
        else:
            node = collection
            for part in scope:
                node = node.setdefault(part, {})
            node[carried.name] = carried.value
    return collection, params


def _inserted(tree: Mapping, path: tuple[str, ...], key: str, value: Any) -> dict:
    """A copy of `tree` with `value` at `path + (key,)`; the original is untouched."""
    copy = dict(tree)
    if not path:
        copy[key] = value
        return copy
    copy[path[0]] = _inserted(tree.get(path[0], {}), path[1:], key, value)
    return copy


def recorded(state: Mapping, where: tuple) -> tuple[Any, Any]:
    """A value recorded inside a lifted transform, as it left it in `state`:
    in the probe's collection, or among the parameters inside `nn.scan`."""
    in_params, path, key = where
    node = state["params" if in_params else RECORDING_COLLECTION]
    for part in path:
        node = node[part]
    return node[key]


def perturbation(
    module: Any, method: str, call: Call, tap: str | None, collection: str
) -> Callable[[Any], Any]:
    """The perturbation of `call` (of `module`'s `method`, or a `bridge.tap`
    named `tap` inside it): the module's own `perturb`, reading the epsilon
    from `collection`."""

    def perturb(value):
        unperturbed = differentiable_part(value)
        floats = module.perturb(
            carrier_name("epsilon", method, call.index, tap),
            unperturbed,
            collection=collection,
        )
        _check_perturbed(floats, unperturbed, call.name)
        return merge_differentiable(value, floats)

    return perturb


def _check_perturbed(floats: Any, value: Any, name: str) -> None:
    """`Module.perturb` adds an epsilon leaf by leaf since flax 0.10.1; before,
    `value += epsilon` concatenated a tuple-valued call's output with its
    epsilon, and the epsilon's gradient would silently be zero."""
    if jax.tree.structure(floats) != jax.tree.structure(value):
        raise BridgeRuntimeError(
            f"flax.linen.Module.perturb changed the structure of site {name!r}'s "
            "value (a pytree): this flax adds perturbations to pytrees wrongly. "
            "bridge supports flax >= 0.10.1."
        )


def patch_in_params(module: Any, method: str, call: Call, tap: str | None) -> Any:
    """The patch value of `call` inside `nn.scan`, among the parameters beside
    its epsilon (this iteration's row)."""
    return module.scope.get_variable(
        "params", carrier_name("patch", method, call.index, tap)
    )


def record_in_scope(
    session: Session,
    module: Any,
    method: str,
    call: Call,
    tap: str | None,
    in_params: bool,
    path: tuple[str, ...],
    value: Any,
    call_args: tuple,
) -> None:
    """Record `call`'s value (and inputs) in the scope of its module (at
    `path` in the model), to leave the lifted transform: in the probe's
    collection, or among the parameters inside `nn.scan` (`recorded` reads
    it back)."""
    carrier = session.carrier
    key = carrier_name("recording", method, call.index, tap)
    module.scope.put_variable(
        "params" if in_params else RECORDING_COLLECTION,
        key,
        carrier.to_carry_out(value, call_args),
    )
    carrier.defer(call.name, (in_params, path, key))
