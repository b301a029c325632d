"""Hugging Face Flax model objects (`FlaxPreTrainedModel`): their Linen
`module`, probed with their `params`.

The object is a wrapper: its `__call__` fills in defaults (the attention
mask, position ids) and calls `module.apply(...)` with its `params`. The
probe is that of the module, so the model's inputs are the module's own
positional arguments (for GPT-2: `input_ids, attention_mask, position_ids`;
for ResNet: NHWC pixels, where the wrapper transposes NCHW ones).

Most objects keep bare parameters in `params` and are applied with
`{"params": params}`. A model with batch norm (`FlaxResNetModel`,
`FlaxRegNetModel`) keeps its collections there, `{"params": ...,
"batch_stats": ...}`, which are then the variables themselves. Which of the
two an object keeps is read from its `params_shape_tree` (the structure its
`init_weights` returns, known also with `_do_init=False`), or else from its
`params`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from bridge.adapter_api import BridgeTypeError, BridgeValueError

from .probe import LinenProbe
from .probe import probe as linen_probe


def probe(model: Any, *variables: Any, vmap: bool = False) -> LinenProbe:
    """`bridge.probe(model.module, variables)`, the variables made from
    `model.params` (`{"params": model.params}`, or `model.params` itself where
    it holds collections), or given (say, fine-tuned parameters) in the form
    the module's `apply` takes."""
    name = type(model).__name__
    collections = _collections(_shape_tree(model))
    if not variables:
        try:
            params = model.params
        except ValueError as error:  # made with `_do_init=False`: no params
            given = "params" if collections is None else "variables"
            usage = "{'params': params}" if collections is None else "variables"
            raise BridgeValueError(
                f"This {name} holds no parameters (it was made with "
                f"_do_init=False): pass them, bridge.probe(model, {usage}) with "
                f"{given} = model.init_weights(key, input_shape)."
            ) from error
        if not isinstance(params, Mapping):
            raise BridgeTypeError(
                f"This {name}'s `params` is a {type(params).__name__}, not a dict "
                "of parameters: pass the variables its module's apply takes, "
                "bridge.probe(model, {'params': params})."
            )
        if collections is None:
            collections = _collections(params)
        variables = (params if collections is not None else {"params": params},)
    if collections is not None and len(variables) == 1:
        _check_collections(name, variables[0], collections)
    return linen_probe(model.module, *variables, vmap=vmap)


def _shape_tree(model: Any) -> Any:
    try:
        return model.params_shape_tree
    except Exception:  # noqa: BLE001 - an object without one: read its params
        return None


def _collections(tree: Any) -> tuple[str, ...] | None:
    """The collections `tree` holds (`("batch_stats", "params")`), or `None`
    where it holds bare parameters: collections are what a tree with a
    `"params"` entry of parameters holds (Flax's `apply` itself refuses a
    `params` collection with a `"params"` entry)."""
    if (
        isinstance(tree, Mapping)
        and isinstance(tree.get("params"), Mapping)
        and all(isinstance(value, Mapping) for value in tree.values())
    ):
        return tuple(sorted(tree))
    return None


def _check_collections(name: str, variables: Any, collections: tuple) -> None:
    """Variables given for an object that keeps collections: all of them, at
    the top level."""
    if not isinstance(variables, Mapping):
        return  # the Linen probe names the type
    params = variables.get("params")
    if _collections(params) is not None:
        raise BridgeValueError(
            f"`variables['params']` holds the collections {sorted(params)} of this "
            f"{name}, one level too deep: pass them as the variables themselves, "
            "bridge.probe(model, model.params) (or the variables init_weights "
            "returns)."
        )
    missing = [c for c in collections if c not in variables]
    if missing:
        raise BridgeValueError(
            f"This {name} is applied with the collections {list(collections)}, and "
            f"`variables` lacks {missing} (its keys are {sorted(variables)}): pass "
            "them all, bridge.probe(model, model.params) (or the variables "
            "init_weights returns)."
        )
