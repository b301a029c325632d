"""An Equinox model written as Equinox's own examples write one: `__call__`
under `eqx.filter_jit`, tokens mapped with `jax.vmap`, a `lax.scan` over
layers stacked by `eqx.filter_vmap` whose body maps a layer per token.

A method wrapped in `eqx.filter_jit` or `jax.jit` is probed through (its
calls are sites), and so is a layer the scan body maps per token: its site
holds every iteration, then every token. (A `jax.jit` called elsewhere in
the model's code: tests/test_equinox_jit.py.)

References do not use bridge: parameter gradients from plain
`eqx.filter_value_and_grad`, activation gradients from `jax.jvp` of the loss
with an offset `t * delta` the test inserts at the site itself (swapping the
layer for one that adds it), whose derivative is `vdot(grad, delta)`.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import bridge

TOKENS, WIDTH, LAYERS = 5, 4, 3
X = jax.random.normal(jax.random.key(1), (TOKENS, 2))


class Block(eqx.Module):
    norm: eqx.nn.LayerNorm
    linear: eqx.nn.Linear

    @eqx.filter_jit
    def __call__(self, x):
        return x + jax.nn.gelu(jax.vmap(self.linear)(jax.vmap(self.norm)(x)))


class Mixer(eqx.Module):
    linear: eqx.nn.Linear

    @jax.jit
    def __call__(self, x):
        return jnp.tanh(jax.vmap(self.linear)(x.T).T)

    @eqx.filter_jit
    def scaled(self, x):
        return 0.5 * jax.vmap(self.linear)(x.T).T


class Model(eqx.Module):
    embed: eqx.nn.Linear
    mixer: Mixer
    blocks: Block
    head: eqx.nn.Linear

    def __init__(self, key):
        keys = jax.random.split(key, 4)
        self.embed = eqx.nn.Linear(2, WIDTH, key=keys[0])
        self.mixer = Mixer(eqx.nn.Linear(TOKENS, TOKENS, key=keys[1]))

        def make(k):
            return Block(eqx.nn.LayerNorm(WIDTH), eqx.nn.Linear(WIDTH, WIDTH, key=k))

        self.blocks = eqx.filter_vmap(make)(jax.random.split(keys[2], LAYERS))
        self.head = eqx.nn.Linear(WIDTH, 3, key=keys[3])

    @eqx.filter_jit
    def __call__(self, x):
        h = jax.vmap(self.embed)(x)
        h = self.mixer(h) + self.mixer.scaled(h)
        dynamic, static = eqx.partition(self.blocks, eqx.is_array)

        def step(h, arrays):
            return eqx.combine(arrays, static)(h), None

        h, _ = jax.lax.scan(step, h, dynamic)
        return jax.vmap(self.head)(h)


class Offset(eqx.Module):
    """The test's own site offset: `layer(x) + offset`. Inside the scan the
    offset is stacked like the layer's parameters, so each step takes its row."""

    layer: eqx.Module
    offset: jax.Array

    def __call__(self, x):
        return self.layer(x) + self.offset

    def scaled(self, x):  # the mixer's other method, left as it is
        return self.layer.scaled(x)


class BlockByHand(eqx.Module):
    """`Block` written out by the test, with offsets added to its sublayers'
    values, or `linear`'s value replaced; stacked like the parameters, so each
    scan step takes its row."""

    norm: eqx.nn.LayerNorm
    linear: eqx.nn.Linear
    norm_offset: jax.Array
    linear_offset: jax.Array
    linear_value: jax.Array | None = None

    def __call__(self, x):
        normed = jax.vmap(self.norm)(x) + self.norm_offset
        y = jax.vmap(self.linear)(normed)
        if self.linear_value is not None:
            y = self.linear_value
        return x + jax.nn.gelu(y + self.linear_offset)


def _by_hand(model, norm_offset=0.0, linear_offset=0.0, linear_value=None):
    zeros = jnp.zeros((LAYERS, TOKENS, WIDTH))
    block = BlockByHand(
        model.blocks.norm,
        model.blocks.linear,
        zeros + norm_offset,
        zeros + linear_offset,
        linear_value,
    )
    return eqx.tree_at(lambda m: m.blocks, model, block)


def loss(outputs):
    return jnp.sum(jnp.sin(outputs))


MODEL = Model(jax.random.key(0))
SELECTED = [
    "embed",
    "mixer",
    "mixer.scaled",
    "blocks",
    "blocks/norm",
    "blocks/linear",
    "head",
]


def _with_offset(model, site, offset):
    """`model` with `offset` added at `site`, by hand."""
    if site == "blocks/norm":
        return _by_hand(model, norm_offset=offset)
    if site == "blocks/linear":
        return _by_hand(model, linear_offset=offset)
    where = {"mixer": lambda m: m.mixer, "blocks": lambda m: m.blocks}[site]
    return eqx.tree_at(where, model, Offset(where(model), offset))


def _directional(model, site, delta):
    """d/dt of the loss with `t * delta` added at `site`, by hand."""

    def at(t):
        return loss(_with_offset(model, site, t * delta)(X))

    return jax.jvp(at, (0.0,), (1.0,))[1]


def _close(actual, expected, rtol=1e-5):
    expected = np.asarray(expected)
    atol = 1e-6 * max(1.0, float(np.max(np.abs(expected))))
    np.testing.assert_allclose(np.asarray(actual), expected, rtol=rtol, atol=atol)


def test_sites_lists_every_call_the_vmapped_one_in_the_scan_whole():
    sites = bridge.probe(MODEL).sites(X)
    shapes = {name: s.shape for name, s in sites.items()}
    assert shapes == {
        "embed": (TOKENS, WIDTH),
        "mixer": (TOKENS, WIDTH),
        "mixer/linear": (WIDTH, TOKENS),
        "mixer.scaled": (TOKENS, WIDTH),
        "mixer/linear#1": (WIDTH, TOKENS),
        "blocks": (LAYERS, TOKENS, WIDTH),
        # applied per token inside the scan: every iteration, every token
        "blocks/norm": (LAYERS, TOKENS, WIDTH),
        "blocks/linear": (LAYERS, TOKENS, WIDTH),
        "head": (TOKENS, 3),
    }


@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_probed_through_filter_jit_and_inside_the_vmap_in_the_scan(mode):
    def run(model, x):
        return bridge.probe(model).value_and_grad(loss, x, at=SELECTED)

    result = jax.jit(run)(MODEL, X) if mode == "jit" else run(MODEL, X)
    value, grads = eqx.filter_value_and_grad(lambda m: loss(m(X)))(MODEL)
    _close(result.loss, value)
    for got, expected in zip(
        jax.tree.leaves(result.grads), jax.tree.leaves(grads), strict=True
    ):
        _close(got, expected)
    assert set(result.activations) == set(SELECTED)

    # Values by hand: the layers called as the model calls them.
    h = jax.vmap(MODEL.embed)(X)
    _close(result.activations["embed"], h)
    _close(result.activations["mixer"], MODEL.mixer(h))
    _close(result.activations["mixer.scaled"], MODEL.mixer.scaled(h))
    _close(result.activations["head"], MODEL(X))
    _close(result.activation_grads["head"], jnp.cos(MODEL(X)))
    h = MODEL.mixer(h) + MODEL.mixer.scaled(h)
    dynamic, static = eqx.partition(MODEL.blocks, eqx.is_array)
    for i in range(LAYERS):
        block = eqx.combine(jax.tree.map(lambda a, i=i: a[i], dynamic), static)
        normed = jax.vmap(block.norm)(h)
        _close(result.activations["blocks/norm"][i], normed)
        _close(result.activations["blocks/linear"][i], jax.vmap(block.linear)(normed))
        h = block(h)
        _close(result.activations["blocks"][i], h)

    for i, site in enumerate(["mixer", "blocks", "blocks/norm", "blocks/linear"]):
        grad = result.activation_grads[site]
        delta = jax.random.normal(jax.random.key(10 + i), grad.shape)
        _close(jnp.vdot(grad, delta), _directional(MODEL, site, delta), rtol=1e-4)


def test_a_patch_value_of_the_vmap_in_the_scan_gives_each_layer_its_row():
    probe = bridge.probe(MODEL)
    value = jax.random.normal(jax.random.key(5), (LAYERS, TOKENS, WIDTH))
    result = probe.value_and_grad(
        loss, X, at=["blocks/norm", "head"], patch={"blocks/linear": value}
    )
    reference = _by_hand(MODEL, linear_value=value)
    _close(result.loss, loss(reference(X)))
    _close(result.activations["head"], reference(X))
    delta = jax.random.normal(jax.random.key(6), (LAYERS, TOKENS, WIDTH))

    def at(t):
        return loss(_by_hand(MODEL, norm_offset=t * delta, linear_value=value)(X))

    _close(
        jnp.vdot(result.activation_grads["blocks/norm"], delta),
        jax.jvp(at, (0.0,), (1.0,))[1],
        rtol=1e-4,
    )
    # A patch function sees one iteration, every token.
    doubled = probe.apply(
        X, at="blocks/linear", patch={"blocks/linear": lambda v: 2 * v}
    )
    plain = probe.apply(X, at="blocks/linear")
    _close(
        doubled.activations["blocks/linear"][0],
        2 * plain.activations["blocks/linear"][0],
    )
