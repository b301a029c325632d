"""bridge's variables in a Linen `apply`: the epsilons, in the probe's own
collection laid out like `params`, and the recordings that leave lifted
transforms in a mutable collection; inside `nn.scan` and `nn.vmap`, which
carry only the collections their `variable_axes` name, both ride among the
parameters, under reserved names (see `bridge.adapters.linen.probe`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from bridge.adapter_api import Session

#: The variable collection holding the probe's epsilons. A private name, so a
#: model that calls `self.perturb` itself (collection "perturbations") is not
#: disturbed.
EPSILON_COLLECTION = "bridge_epsilons"

#: The mutable collection carrying recordings out of lifted transforms.
RECORDING_COLLECTION = "bridge_recordings"


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
