"""An Equinox model written as Equinox's own examples write one: `__call__`
under `eqx.filter_jit`, tokens mapped with `jax.vmap`, a `lax.scan` over
layers stacked by `eqx.filter_vmap` whose body maps a layer per token.

A method wrapped in `eqx.filter_jit` or `jax.jit` is probed through (its
calls are sites); a site bridge cannot express (a `jax.vmap` inside the scan
body, a `jax.jit` called inline) is listed, costs the other sites nothing,
and is refused only where it is selected or patched.

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
from test_equinox import NEEDS_JAXPR_PARENTS

import bridge
from bridge.adapter_api import BridgeValueError

pytestmark = NEEDS_JAXPR_PARENTS

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


class InlineJit(eqx.Module):
    """A `jax.jit` called in the model's code, not wrapping a method."""

    inner: eqx.nn.Linear
    outer: eqx.nn.Linear

    def __call__(self, x):
        return self.outer(jax.jit(lambda x: self.inner(x))(x))


class Offset(eqx.Module):
    """The test's own site offset: `layer(x) + offset`. Inside the scan the
    offset is stacked like the layer's parameters, so each step takes its row."""

    layer: eqx.Module
    offset: jax.Array

    def __call__(self, x):
        return self.layer(x) + self.offset

    def scaled(self, x):  # the mixer's other method, left as it is
        return self.layer.scaled(x)


def loss(outputs):
    return jnp.sum(jnp.sin(outputs))


MODEL = Model(jax.random.key(0))
SELECTED = ["embed", "mixer", "mixer.scaled", "blocks", "head"]


def _where(site):
    return {
        "mixer": lambda m: m.mixer,
        "blocks": lambda m: m.blocks,
    }[site]


def _directional(model, site, delta):
    """d/dt of the loss with `t * delta` added at `site`, by hand."""

    def at(t):
        patched = eqx.tree_at(
            _where(site), model, Offset(_where(site)(model), t * delta)
        )
        return loss(patched(X))

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
        # refused where selected, listed with the shape it would hold
        "blocks/norm": (LAYERS, TOKENS, WIDTH),
        "blocks/linear": (LAYERS, TOKENS, WIDTH),
        "head": (TOKENS, 3),
    }


@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_probed_through_filter_jit_and_around_the_vmap_in_the_scan(mode):
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
        h = eqx.combine(jax.tree.map(lambda a, i=i: a[i], dynamic), static)(h)
        _close(result.activations["blocks"][i], h)

    for i, site in enumerate(["mixer", "blocks"]):
        grad = result.activation_grads[site]
        delta = jax.random.normal(jax.random.key(10 + i), grad.shape)
        _close(jnp.vdot(grad, delta), _directional(MODEL, site, delta), rtol=1e-4)


def test_selecting_or_patching_the_vmap_in_the_scan_is_refused_naming_it():
    probe = bridge.probe(MODEL)
    message = (
        r"bridge cannot see through a jax.vmap of the model's own code inside a "
        r"scan or checkpoint .*: site 'blocks/linear' is called inside jax.vmap "
        r"inside jax.lax.scan\. .*select other sites with `at=`"
    )
    with pytest.raises(BridgeValueError, match=message):
        probe.value_and_grad(loss, X, at=["head", "blocks/linear"])
    with pytest.raises(BridgeValueError, match=message):
        probe.value_and_grad(loss, X, at=["head"], patch={"blocks/linear": jnp.sin})
    with pytest.raises(BridgeValueError, match="site 'blocks/norm' is called"):
        probe.value_and_grad(loss, X)  # every site, those too


def test_a_jit_called_inline_is_refused_only_where_selected():
    keys = jax.random.split(jax.random.key(3), 2)
    model = InlineJit(
        eqx.nn.Linear(3, 3, key=keys[0]), eqx.nn.Linear(3, 2, key=keys[1])
    )
    x = jax.random.normal(jax.random.key(4), (3,))
    probe = bridge.probe(model)
    assert {n: s.shape for n, s in probe.sites(x).items()} == {
        "inner": (3,),
        "outer": (2,),
    }
    result = probe.value_and_grad(loss, x, at=["outer"])
    value, grads = eqx.filter_value_and_grad(lambda m: loss(m(x)))(model)
    _close(result.loss, value)
    for got, expected in zip(
        jax.tree.leaves(result.grads), jax.tree.leaves(grads), strict=True
    ):
        _close(got, expected)
    _close(result.activation_grads["outer"], jnp.cos(model(x)))
    with pytest.raises(
        BridgeValueError,
        match=r"bridge cannot see through a jax.jit inside the model: site "
        r"'inner' is called inside a jax.jit inside the model",
    ):
        probe.value_and_grad(loss, x, at=["inner"])
