"""Keras 3 on the JAX backend: a built model and its variables' values.

The model runs through Keras's own pure call, `stateless_call`, with the
probe's values for its trainable and non-trainable variables, each layer's
call reported to the session (`bridge.adapters.keras.run`). Gradients are
`jax.grad` of that call with respect to the trainable values; the
non-trainable ones (BatchNorm's statistics, the seed generators' state) come
back in `res.state` as `stateless_call` returns them. Everything about JAX's
transforms in the model (a layer's remat, a custom layer's `lax.scan`) is
the core's, read from the computation.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import keras

from bridge.adapter_api import BridgeTypeError, BridgeValueError, ProbeBase, Session

from . import run


def probe(model: keras.Layer, *variables: Any, vmap: bool = False) -> KerasProbe:
    if variables:
        raise BridgeTypeError(
            "A Keras model holds its own variables: bridge.probe(model), with no "
            f"variable arguments; got {len(variables)}."
        )
    if keras.backend.backend() != "jax":
        raise BridgeValueError(
            f"This Keras runs on the {keras.backend.backend()!r} backend "
            f"(KERAS_BACKEND={os.environ.get('KERAS_BACKEND', 'unset')}); bridge "
            "probes Keras on JAX. Set KERAS_BACKEND=jax before `import keras` (in "
            "the shell, or os.environ at the top of the script)."
        )
    if not model.built:
        raise BridgeValueError(
            f"The Keras model {model.name!r} is not built: it has no variables yet. "
            "Build it first, with model.build(input_shape) or by calling it once "
            "on an example batch (or give a Sequential model a keras.Input)."
        )
    trainable = _by_path(model.trainable_variables, model)
    non_trainable = _by_path(model.non_trainable_variables, model)
    order = (tuple(trainable), tuple(non_trainable))
    return KerasProbe(model, trainable, non_trainable, vmap, order)


def _paths(model: keras.Layer) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The keys of the trainable and the non-trainable values, in Keras's
    order (`stateless_call`'s), which a pytree's sorted keys do not keep."""
    return (
        tuple(_by_path(model.trainable_variables, model)),
        tuple(_by_path(model.non_trainable_variables, model)),
    )


def _by_path(variables: list, model: keras.Layer) -> dict[str, jax.Array]:
    """`{path: value}` in Keras's order, each path relative to the model as
    its sites' names are (`hidden/kernel` beside the site `hidden`); a path
    seen again gets `#k`."""
    values: dict[str, jax.Array] = {}
    for variable in variables:
        base = run.relative(variable.path, model)
        path, index = base, 1
        while path in values:
            path, index = f"{base}#{index}", index + 1
        values[path] = variable.value
    return values


@jax.tree_util.register_pytree_node_class
class KerasProbe(ProbeBase):
    """A built Keras 3 model with its variables' values. See
    `bridge.ActivationProbe`."""

    #: The model is in the treedef, the values are leaves, and no site has
    #: an origin: a discovery is reused by structure.
    reuses_discovery = True
    porting_side = "bridge.adapters.keras.porting"

    def __init__(
        self,
        model: keras.Layer,
        trainable: dict[str, Any],
        non_trainable: dict[str, Any],
        vmap: bool = False,
        order: tuple[tuple[str, ...], tuple[str, ...]] | None = None,
    ):
        self.model = model
        self.trainable = trainable
        self.non_trainable = non_trainable
        self.vmap = vmap
        self._order = _paths(model) if order is None else order

    def tree_flatten(self):
        static = (self.model, self.vmap, self._order)
        return (self.trainable, self.non_trainable), static

    @classmethod
    def tree_unflatten(cls, static, children):
        model, vmap, order = static
        return cls(model, *children, vmap, order)

    def __repr__(self) -> str:
        return f"KerasProbe({type(self.model).__name__}, vmap={self.vmap})"

    def _trainable(self) -> dict[str, Any]:
        return self.trainable

    def _run(
        self, trainable: Any, args: tuple, kwargs: dict, session: Session
    ) -> tuple[Any, Any]:
        trainable_paths, non_trainable_paths = self._order
        with run.reporting(self.model, session):
            outputs, updated = self.model.stateless_call(
                [trainable[path] for path in trainable_paths],
                [self.non_trainable[path] for path in non_trainable_paths],
                *args,
                **kwargs,
            )
        state = dict(zip(non_trainable_paths, updated, strict=True))
        return outputs, state or None

    # -- taking the model out (`ActivationProbe.unwrap`) -------------------------

    def unwrap(self) -> tuple:
        """`(model,)`, what `bridge.probe` takes: Keras's own copy of the model
        (`keras.models.clone_model`: new layers of the same configuration and
        names) holding the probe's values (after `bridge.transfer`, the
        ported weights). The user's model is untouched."""
        try:
            model = keras.models.clone_model(self.model)
        except (TypeError, ValueError, NotImplementedError) as error:
            raise BridgeTypeError(
                f"Keras cannot copy the model {self.model.name!r} "
                f"({type(error).__name__}: {error}). Give its custom classes a "
                "`get_config` (and `@keras.saving.register_keras_serializable()`), "
                "or read the values from the probe: probe.trainable and "
                "probe.non_trainable."
            ) from error
        if _paths(model) != self._order:
            raise BridgeTypeError(
                f"Keras's copy of the model {self.model.name!r} names its "
                "variables differently from the model (a subclassed model whose "
                "layers are named as they are built): read the values from the "
                "probe instead, probe.trainable and probe.non_trainable."
            )
        trainable_paths, non_trainable_paths = self._order
        for variables, paths, values in (
            (model.trainable_variables, trainable_paths, self.trainable),
            (model.non_trainable_variables, non_trainable_paths, self.non_trainable),
        ):
            for variable, path in zip(variables, paths, strict=True):
                variable.assign(values[path])
        return (model,)
