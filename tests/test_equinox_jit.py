"""Equinox models as shipped under `eqx.filter_jit` / `jax.jit`: on the
root's `__call__`, on a submodule's, around a scanned stack of layers, on a
function called in the model's code, and with the jit's cache warmed by a
call before probing.

The contract: a jitted function inside the model is traced through, its
sites appear as if it were not jitted, and a cached trace hides none of them.

References do not use bridge: parameter gradients from plain
`eqx.filter_grad`; activations and their gradients from the model written
out by hand with an offset added at each site (`jax.grad` with respect to
the offsets, and `jax.jvp` along one direction).
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_tree_allclose

import bridge

TOKENS, WIDTH, LAYERS, BATCH = 5, 4, 3, 2

#: Tracing through a `jax.jit` called in the model's code is the core's.


class Layer(eqx.Module):
    linear: eqx.nn.Linear

    @eqx.filter_jit
    def __call__(self, x):
        return x + jnp.tanh(jax.vmap(self.linear)(x))


def _scan(layers, h):
    dynamic, static = eqx.partition(layers, eqx.is_array)

    def step(h, arrays):
        return eqx.combine(arrays, static)(h), None

    return jax.lax.scan(step, h, dynamic)[0]


#: A scanned stack of layers under `eqx.filter_jit`, as shipped code runs it.
jitted_scan = eqx.filter_jit(_scan)


class Model(eqx.Module):
    """`eqx.filter_jit` on `__call__` here and on each layer's; `how` says
    how the stack runs: `plain`, `filter_jit` (a jitted function) or
    `inline` (`jax.jit` of a closure, called in place)."""

    embed: eqx.nn.Linear
    layers: Layer
    head: eqx.nn.Linear
    how: str = eqx.field(static=True)

    def __init__(self, key, how):
        keys = jax.random.split(key, 3)
        self.embed = eqx.nn.Linear(WIDTH, WIDTH, key=keys[0])
        self.layers = eqx.filter_vmap(
            lambda k: Layer(eqx.nn.Linear(WIDTH, WIDTH, key=k))
        )(jax.random.split(keys[1], LAYERS))
        self.head = eqx.nn.Linear(WIDTH, 2, key=keys[2])
        self.how = how

    @eqx.filter_jit
    def __call__(self, x):
        h = jax.vmap(self.embed)(x)
        if self.how == "plain":
            h = _scan(self.layers, h)
        elif self.how == "filter_jit":
            h = jitted_scan(self.layers, h)
        else:
            h = jax.jit(lambda h: _scan(self.layers, h))(h)
        return jax.vmap(self.head)(h)


SITES = ("embed", "layers", "layers/linear", "head")


def _by_hand(model, x, offsets):
    """One example through the model written out, `offsets[site]` added at
    each site; returns the outputs and each site's values."""
    embedded = jax.vmap(model.embed)(x) + offsets["embed"]
    dynamic, static = eqx.partition(model.layers, eqx.is_array)

    def step(h, xs):
        arrays, off_linear, off_layer = xs
        layer = eqx.combine(arrays, static)
        y = jax.vmap(layer.linear)(h) + off_linear
        out = h + jnp.tanh(y) + off_layer
        return out, (y, out)

    h, (linear, layers) = jax.lax.scan(
        step, embedded, (dynamic, offsets["layers/linear"], offsets["layers"])
    )
    outputs = jax.vmap(model.head)(h) + offsets["head"]
    values = {
        "embed": embedded,
        "layers": layers,
        "layers/linear": linear,
        "head": outputs,
    }
    return outputs, values


def _batched_by_hand(model, x, offsets):
    """Over the batch: site values as the contract lays them out, the batch
    after a scanned site's iterations."""
    axes = {"embed": 0, "layers": 1, "layers/linear": 1, "head": 0}
    return jax.vmap(
        lambda x, o: _by_hand(model, x, o), in_axes=(0, axes), out_axes=(0, axes)
    )(x, offsets)


def _zeros(batch):
    stacked = (LAYERS, *batch, TOKENS, WIDTH)
    return {
        "embed": jnp.zeros((*batch, TOKENS, WIDTH)),
        "layers": jnp.zeros(stacked),
        "layers/linear": jnp.zeros(stacked),
        "head": jnp.zeros((*batch, TOKENS, 2)),
    }


def loss(outputs):
    return jnp.sum(jnp.sin(outputs))


def _near(actual, expected, rtol=1e-5):
    """Equal at the scale of the whole tensor."""
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    scale = float(np.max(np.abs(expected), initial=0.0))
    assert float(np.max(np.abs(actual - expected), initial=0.0)) <= (
        rtol * scale + 1e-6
    )


def _check(model, vmap, mode, warmed):
    batch = (BATCH,) if vmap else ()
    x = jax.random.normal(jax.random.key(1), (*batch, TOKENS, WIDTH))
    mapped = jax.vmap(model) if vmap else model
    if warmed:  # the jits' caches hold a trace for these shapes
        mapped(x)
        jitted_scan(model.layers, jnp.zeros((TOKENS, WIDTH)))
    by_hand = _batched_by_hand if vmap else _by_hand
    offsets = _zeros(batch)

    probe = bridge.probe(model, vmap=vmap)
    shapes = {name: s.shape for name, s in probe.sites(x).items()}
    assert shapes == {name: o.shape for name, o in offsets.items()}

    def run(p, x):
        return p.value_and_grad(loss, x, at=list(SITES))

    res = jax.jit(run)(probe, x) if mode == "jit" else run(probe, x)
    outputs, values = by_hand(model, x, offsets)
    _near(res.loss, loss(outputs))
    expected = eqx.filter_grad(lambda m: loss((jax.vmap(m) if vmap else m)(x)))
    assert_tree_allclose(res.grads, expected(model))
    grads = jax.grad(lambda o: loss(by_hand(model, x, o)[0]))(offsets)
    for site in SITES:
        _near(res.activations[site], values[site])
        _near(res.activation_grads[site], grads[site])
    delta = jax.random.normal(jax.random.key(2), offsets["layers/linear"].shape)
    tangent = {**jax.tree.map(jnp.zeros_like, offsets), "layers/linear": delta}
    directional = jax.jvp(
        lambda o: loss(by_hand(model, x, o)[0]), (offsets,), (tangent,)
    )[1]
    _near(jnp.vdot(res.activation_grads["layers/linear"], delta), directional, 1e-4)


@pytest.mark.parametrize(
    "vmap, mode, warmed",
    [(True, "eager", False), (False, "jit", True), (True, "jit", True)],
)
def test_filter_jit_on_the_root_call_and_on_a_layer_call(vmap, mode, warmed):
    _check(Model(jax.random.key(0), "plain"), vmap, mode, warmed)


@pytest.mark.parametrize(
    "vmap, mode, warmed", [(True, "eager", False), (False, "jit", False)]
)
def test_filter_jit_around_a_scanned_stack(vmap, mode, warmed):
    _check(Model(jax.random.key(0), "filter_jit"), vmap, mode, warmed)


@pytest.mark.parametrize("vmap, mode", [(True, "eager"), (False, "jit")])
def test_a_warmed_filter_jit_around_a_scanned_stack_hides_no_site(vmap, mode):
    _check(Model(jax.random.key(0), "filter_jit"), vmap, mode, warmed=True)


@pytest.mark.parametrize("vmap, mode", [(True, "eager"), (False, "jit")])
def test_a_jax_jit_called_in_place_in_the_model_code(vmap, mode):
    _check(Model(jax.random.key(0), "inline"), vmap, mode, warmed=False)


class Encoder(eqx.Module):
    """A submodule whose jitted method other than `__call__` the model calls."""

    linear: eqx.nn.Linear

    @eqx.filter_jit
    def encode(self, x):
        return jnp.tanh(self.linear(x))


class Encodes(eqx.Module):
    encoder: Encoder
    head: eqx.nn.Linear

    @eqx.filter_jit
    def __call__(self, x):
        return self.head(self.encoder.encode(x))


@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_a_jitted_method_of_a_submodule_is_a_site(mode):
    keys = jax.random.split(jax.random.key(0), 2)
    model = Encodes(
        Encoder(eqx.nn.Linear(3, 4, key=keys[0])), eqx.nn.Linear(4, 2, key=keys[1])
    )
    x = jax.random.normal(jax.random.key(1), (3,))
    model(x)  # a warm cache
    probe = bridge.probe(model)
    assert list(probe.sites(x)) == ["encoder.encode", "encoder/linear", "head"]

    def run(p, x):
        return p.value_and_grad(loss, x)

    res = jax.jit(run)(probe, x) if mode == "jit" else run(probe, x)
    encoded = model.encoder.encode(x)
    _near(res.activations["encoder.encode"], encoded)

    def offset(t):
        return loss(model.head(model.encoder.encode(x) + t))

    _near(
        res.activation_grads["encoder.encode"],
        jax.grad(offset)(jnp.zeros_like(encoded)),
    )
    assert_tree_allclose(res.grads, eqx.filter_grad(lambda m: loss(m(x)))(model))
