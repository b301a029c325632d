"""The same two small models in Flax Linen, Flax NNX, Haiku and Equinox.

`cnn`: Conv 3x3 (SAME) -> BatchNorm (running statistics) -> relu -> flatten
-> Dense 16 -> LayerNorm -> tanh -> Dense 5, on channel-last images.
`attention`: Embed -> self-attention (2 heads of 4) -> LayerNorm -> mean over
tokens -> Dense 3, on token ids.

Hyperparameters match across libraries (LayerNorm epsilon 1e-5, SAME
padding); the Equinox models handle one example (probed with vmap=True), are
channel-first inside and take the same channel-last input, transposing it at
their entry. Each builder returns a probe with random weights (`filled`): no scale
is 1, no bias 0 and the running statistics are not the initial ones.
"""

from __future__ import annotations

import functools
from typing import Any

import equinox as eqx
import flax.linen as nn
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import bridge

LIBRARIES = ("linen", "nnx", "haiku", "equinox")
IMAGES = jax.random.normal(jax.random.key(1), (2, 6, 6, 3))
TOKENS = jax.random.randint(jax.random.key(2), (2, 5), 0, 11)
EPSILON = 1e-5


# -- cnn ------------------------------------------------------------------------


class LinenCNN(nn.Module):
    """Its LayerNorm epsilon and nonlinearities can be changed: planted bugs."""

    layer_norm_epsilon: float = EPSILON
    activation: Any = nn.relu
    squash: Any = jnp.tanh

    @nn.compact
    def __call__(self, x):
        x = nn.Conv(4, (3, 3), padding="SAME")(x)
        x = nn.BatchNorm(use_running_average=True, epsilon=EPSILON)(x)
        x = self.activation(x)
        x = x.reshape(x.shape[0], -1)
        x = nn.Dense(16)(x)
        x = self.squash(nn.LayerNorm(epsilon=self.layer_norm_epsilon)(x))
        return nn.Dense(5)(x)


class NnxCNN(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.conv = nnx.Conv(3, 4, (3, 3), padding="SAME", rngs=rngs)
        self.norm = nnx.BatchNorm(4, use_running_average=True, rngs=rngs)
        self.hidden = nnx.Linear(144, 16, rngs=rngs)
        self.layer_norm = nnx.LayerNorm(16, epsilon=EPSILON, rngs=rngs)
        self.out = nnx.Linear(16, 5, rngs=rngs)

    def __call__(self, x):
        x = jax.nn.relu(self.norm(self.conv(x)))
        x = self.hidden(x.reshape(x.shape[0], -1))
        return self.out(jnp.tanh(self.layer_norm(x)))


def _haiku_cnn(x, is_training=False):
    x = hk.Conv2D(4, 3, padding="SAME")(x)
    x = hk.BatchNorm(True, True, 0.9, eps=EPSILON)(x, is_training=is_training)
    x = jax.nn.relu(x)
    x = hk.Linear(16)(x.reshape(x.shape[0], -1))
    x = hk.LayerNorm(axis=-1, create_scale=True, create_offset=True, eps=EPSILON)(x)
    return hk.Linear(5)(jnp.tanh(x))


class EqxCNN(eqx.Module):
    conv: eqx.nn.Conv2d
    norm: eqx.nn.BatchNorm
    hidden: eqx.nn.Linear
    layer_norm: eqx.nn.LayerNorm
    out: eqx.nn.Linear

    def __init__(self, key):
        keys = jax.random.split(key, 3)
        self.conv = eqx.nn.Conv2d(3, 4, 3, padding="SAME", key=keys[0])
        self.norm = eqx.nn.BatchNorm(4, "batch", inference=True, mode="ema")
        self.hidden = eqx.nn.Linear(144, 16, key=keys[1])
        self.layer_norm = eqx.nn.LayerNorm(16, eps=EPSILON)
        self.out = eqx.nn.Linear(16, 5, key=keys[2])

    def __call__(self, x, state):
        x = jnp.transpose(x, (2, 0, 1))  # channel-last in, channel-first inside
        x, state = self.norm(self.conv(x), state)
        x = jnp.transpose(jax.nn.relu(x), (1, 2, 0)).reshape(-1)
        x = jnp.tanh(self.layer_norm(self.hidden(x)))
        return self.out(x), state


# -- attention ------------------------------------------------------------------


class LinenAttention(nn.Module):
    @nn.compact
    def __call__(self, tokens):
        h = nn.Embed(11, 8)(tokens)
        h = nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=8)(h)
        h = nn.LayerNorm(epsilon=EPSILON)(h)
        return nn.Dense(3)(h.mean(axis=1))


class NnxAttention(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.embed = nnx.Embed(11, 8, rngs=rngs)
        self.attention = nnx.MultiHeadAttention(
            num_heads=2, in_features=8, qkv_features=8, decode=False, rngs=rngs
        )
        self.norm = nnx.LayerNorm(8, epsilon=EPSILON, rngs=rngs)
        self.out = nnx.Linear(8, 3, rngs=rngs)

    def __call__(self, tokens):
        h = self.norm(self.attention(self.embed(tokens)))
        return self.out(h.mean(axis=1))


def _haiku_attention(tokens):
    h = hk.Embed(11, 8)(tokens)
    h = hk.MultiHeadAttention(
        num_heads=2, key_size=4, w_init=hk.initializers.VarianceScaling(1.0)
    )(h, h, h)
    h = hk.LayerNorm(axis=-1, create_scale=True, create_offset=True, eps=EPSILON)(h)
    return hk.Linear(3)(h.mean(axis=1))


class EqxAttention(eqx.Module):
    embed: eqx.nn.Embedding
    attention: eqx.nn.MultiheadAttention
    norm: eqx.nn.LayerNorm
    out: eqx.nn.Linear

    def __init__(self, key):
        keys = jax.random.split(key, 3)
        self.embed = eqx.nn.Embedding(11, 8, key=keys[0])
        self.attention = eqx.nn.MultiheadAttention(
            2,
            8,
            use_query_bias=True,
            use_key_bias=True,
            use_value_bias=True,
            use_output_bias=True,
            key=keys[1],
        )
        self.norm = eqx.nn.LayerNorm(8, eps=EPSILON)
        self.out = eqx.nn.Linear(8, 3, key=keys[2])

    def __call__(self, tokens):
        h = jax.vmap(self.embed)(tokens)
        h = jax.vmap(self.norm)(self.attention(h, h, h))
        return self.out(h.mean(axis=0))


# -- builders -------------------------------------------------------------------


def filled(struct, seed: int):
    """Concrete values for a pytree of `jax.ShapeDtypeStruct`s, drawn with NumPy
    (nothing to compile): floats normal with deviation 0.5, variances (a `var`
    in the path) in [0.5, 1.5], integers (step counters) zero."""
    rng = np.random.default_rng(seed)

    def fill(key_path, leaf):
        if not isinstance(leaf, jax.ShapeDtypeStruct):
            return leaf
        if not jnp.issubdtype(leaf.dtype, jnp.floating):
            return jnp.zeros(leaf.shape, leaf.dtype)
        if "var" in jax.tree_util.keystr(key_path):
            value = rng.uniform(0.5, 1.5, leaf.shape)
        else:
            value = 0.5 * rng.standard_normal(leaf.shape)
        return jnp.asarray(value, leaf.dtype)

    return jax.tree_util.tree_map_with_path(fill, struct)


@functools.cache
def build(library: str, model: str = "cnn", seed: int = 0):
    """A probe of `model` in `library` with random weights (cached: probes are
    immutable). Shapes come from the library's own initialisation, evaluated
    abstractly; the values from `filled`."""
    key = jax.random.key(seed)
    x = IMAGES if model == "cnn" else TOKENS
    if library == "linen":
        module = LinenCNN() if model == "cnn" else LinenAttention()
        return bridge.probe(module, filled(jax.eval_shape(module.init, key, x), seed))
    if library == "nnx":
        cls = NnxCNN if model == "cnn" else NnxAttention
        graphdef, state = nnx.split(nnx.eval_shape(lambda: cls(nnx.Rngs(seed))))
        return bridge.probe(nnx.merge(graphdef, filled(state, seed)))
    if library == "haiku":
        if model == "cnn":
            transformed = hk.without_apply_rng(hk.transform_with_state(_haiku_cnn))
            init = functools.partial(transformed.init, is_training=True)
            params, state = filled(jax.eval_shape(init, key, x), seed)
            return bridge.probe(transformed, params, state)
        transformed = hk.without_apply_rng(hk.transform(_haiku_attention))
        return bridge.probe(
            transformed, filled(jax.eval_shape(transformed.init, key, x), seed)
        )
    if library == "equinox":
        if model == "cnn":
            shapes = eqx.filter_eval_shape(eqx.nn.make_with_state(EqxCNN), key)
            module, state = filled(shapes, seed)
            # The running statistics: the State's keys are opaque, so set by hand.
            index = module.norm.ema_state_index
            rng = np.random.default_rng(seed)
            statistics = (
                jnp.asarray(0.5 * rng.standard_normal(4), jnp.float32),
                jnp.asarray(rng.uniform(0.5, 1.5, 4), jnp.float32),
            )
            return bridge.probe(module, state.set(index, statistics), vmap=True)
        return bridge.probe(
            filled(eqx.filter_eval_shape(EqxAttention, key), seed), vmap=True
        )
    raise ValueError(library)


def outputs(probe, x):
    """The model's plain forward pass, through the library's own apply (the
    probe's fields; no bridge code runs)."""
    library = type(probe).__module__.split(".")[2]  # bridge.adapters.<library>
    if library == "linen":
        return probe.module.apply(probe.variables, x)
    if library == "nnx":
        return nnx.merge(probe.graphdef, probe.params, probe.rest, copy=True)(x)
    if library == "haiku":
        if probe.state is not None:
            return probe.transformed.apply(probe.params, probe.state, x)[0]
        return probe.transformed.apply(probe.params, x)
    if probe.state is not None:
        return jax.vmap(
            probe.model, in_axes=(0, None), out_axes=(0, None), axis_name="batch"
        )(x, probe.state)[0]
    return jax.vmap(probe.model)(x)


def as_numpy(tree):
    return jax.tree.map(np.asarray, tree)
