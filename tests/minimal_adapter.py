"""A library bridge does not know, added with `bridge.adapter_api` alone.

What a library author writes (docs/libraries/fifth-library.md): a probe that
reaches each layer call and names it, and nothing about JAX's transforms. The
"library" is as small as one can be: a model is a dict of `Dense` layers'
parameters and a forward function `forward(layers, x)` that calls
`layers["name"](h)`, written with any of JAX's transforms (the model's own
`jax.vmap`, `lax.scan`, `lax.cond`, `jax.jit`) and `bridge.tap`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

import bridge
from bridge.adapter_api import ProbeBase, Session


@dataclasses.dataclass(frozen=True)
class Dense:
    """`x @ w + b`, its parameters held by the model."""

    features_in: int
    features_out: int

    def init(self, key: jax.Array) -> dict[str, jax.Array]:
        return {
            "w": jax.random.normal(key, (self.features_in, self.features_out)) * 0.5,
            "b": jnp.linspace(-0.3, 0.3, self.features_out),
        }


def dense(params: dict[str, jax.Array], x: jax.Array) -> jax.Array:
    y = x @ params["w"]
    return y + params["b"].reshape((1,) * (y.ndim - 1) + (-1,))


@dataclasses.dataclass(frozen=True, eq=False)
class Model:
    """`forward(layers, x)`, `layers[name](h)` calling the layer `name`."""

    layers: dict[str, Dense]
    forward: Callable[[Any, Any], Any]
    params: dict[str, dict[str, jax.Array]]

    def __call__(self, x: Any, params: dict | None = None) -> Any:
        params = self.params if params is None else params
        return self.forward(_Layers(params, None), x)


def model(layers: dict[str, Dense], forward: Callable, seed: int = 0) -> Model:
    keys = jax.random.split(jax.random.key(seed), len(layers))
    params = {
        name: layer.init(key)
        for (name, layer), key in zip(sorted(layers.items()), keys, strict=True)
    }
    return Model(dict(layers), forward, params)


class _Layers:
    """What `forward` calls: each call reported to the session, if any."""

    def __init__(self, params: dict, session: Session | None):
        self._params = params
        self._session = session

    def __getitem__(self, name: str) -> Callable[[jax.Array], jax.Array]:
        def call(x):
            if self._session is None:
                return dense(self._params[name], x)
            entered = self._session.enter(name, None, name, (x,))
            return self._session.exit(entered, dense(self._params[name], x))

        return call


@jax.tree_util.register_pytree_node_class
class MinimalProbe(ProbeBase):
    """The probe: the parameters are its pytree's children."""

    def __init__(self, model: Model, params: dict, vmap: bool = False):
        self.model = model
        self.params = params
        self.vmap = vmap

    def tree_flatten(self):
        return (self.params,), (self.model, self.vmap)

    @classmethod
    def tree_unflatten(cls, aux, children):
        model, vmap = aux
        return cls(model, children[0], vmap)

    def _trainable(self) -> dict:
        return self.params

    def _run(self, trainable, args, kwargs, session):
        return self.model.forward(_Layers(trainable, session), *args, **kwargs), None


def probe(model: Model, *variables: Any, vmap: bool = False) -> MinimalProbe:
    return MinimalProbe(model, model.params, vmap)


bridge.register_adapter(Model, probe, name="minimal")
