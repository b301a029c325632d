"""A `custom_jvp` rule inside a loop holds under a probe, in every library.

Where a site's value leaves a loop through the backward pass of the model
(`bridge._session.backward`, Equinox's scan over stacked layers), recording
it inside the differentiated step would differentiate that backward pass
again, and JAX then differentiates a `custom_jvp`'s primal function inside a
scan instead of its rule (plain JAX shows it: `jax.grad` of a loss computed
from inside `jax.vjp` of a `lax.scan`). `scaled` below is the identity with
a rule whose derivative is 3: any gradient that crosses it the wrong way is
off by 3. References: plain `jax.grad` of the same loss (parameters), and
offsets added by hand at the site (activations).
"""

from __future__ import annotations

import equinox as eqx
import flax.linen as nn
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import bridge

ITERATIONS = 2


@jax.custom_jvp
def scaled(x):
    return x


@scaled.defjvp
def _scaled_jvp(primals, tangents):
    return scaled(primals[0]), 3.0 * tangents[0]


def loss_fn(y):
    return jnp.sum(y**2)


X = jnp.array([[1.0, -2.0, 0.5], [0.3, 0.2, -1.0]])


def assert_close(actual, expected):
    actual, expected = np.asarray(actual), np.asarray(expected)
    scale = max(float(np.max(np.abs(expected))), 1e-6)
    np.testing.assert_allclose(actual, expected, rtol=0, atol=1e-5 * scale)


class EqxScanned(eqx.Module):
    """A `lax.scan` over two stacked layers, each followed by `scaled`."""

    layers: eqx.nn.Linear

    def __init__(self, key):
        keys = jax.random.split(key, ITERATIONS)
        self.layers = eqx.filter_vmap(lambda k: eqx.nn.Linear(3, 3, key=k))(keys)

    def __call__(self, x, offsets=None):
        params, static = eqx.partition(self.layers, eqx.is_array)

        def body(h, step):
            p, i = step
            h = eqx.combine(p, static)(h)
            if offsets is not None:
                h = h + offsets[i]
            return scaled(h), None

        return jax.lax.scan(body, x, (params, jnp.arange(ITERATIONS)))[0]


class EqxLoop(eqx.Module):
    """`lax.fori_loop` around one layer and `scaled`."""

    cell: eqx.nn.Linear

    def __init__(self, key):
        self.cell = eqx.nn.Linear(3, 3, key=key)

    def __call__(self, x, offsets=None):
        def body(i, h):
            h = self.cell(h)
            if offsets is not None:
                h = h + offsets[i]
            return scaled(h)

        return jax.lax.fori_loop(0, ITERATIONS, body, x)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize(
    ("make", "site"), [(EqxScanned, "layers"), (EqxLoop, "cell")], ids=["scan", "fori"]
)
def test_equinox_loop_sites_keep_a_custom_jvp_rule(make, site, jit):
    model = make(jax.random.key(0))

    def step(probe, x):
        return probe.value_and_grad(loss_fn, x)

    res = (jax.jit(step) if jit else step)(bridge.probe(model, vmap=True), X)
    params, static = eqx.partition(model, eqx.is_inexact_array)
    plain = jax.grad(lambda p: loss_fn(jax.vmap(eqx.combine(p, static))(X)))(params)
    for got, expected in zip(
        jax.tree.leaves(res.grads), jax.tree.leaves(plain), strict=True
    ):
        assert_close(got, expected)
    offsets = jnp.zeros((len(X), ITERATIONS, 3))
    by_hand = jax.grad(lambda o: loss_fn(jax.vmap(model)(X, o)))(offsets)
    assert_close(res.activation_grads[site], jnp.swapaxes(by_hand, 0, 1))


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize(
    ("make", "site"), [(EqxScanned, "layers"), (EqxLoop, "cell")], ids=["scan", "fori"]
)
def test_equinox_loop_sites_the_loss_does_not_reach_hold_their_values(make, site, jit):
    """The values leave through the step's own backward pass, which reaches
    every output: a loss that ignores the outputs still gets every
    iteration's value (each layer's output, computed by hand), with zero
    gradients."""
    model = make(jax.random.key(0))

    def step(probe, x):
        return probe.value_and_grad(lambda y: jnp.float32(1.0), x)

    res = (jax.jit(step) if jit else step)(bridge.probe(model, vmap=True), X)
    by_hand, h = [], X
    for i in range(ITERATIONS):
        layer = (
            jax.tree.map(lambda a, i=i: a[i] if eqx.is_array(a) else a, model.layers)
            if make is EqxScanned
            else model.cell
        )
        h = jax.vmap(layer)(h)
        by_hand.append(h)
    assert_close(res.activations[site], jnp.stack(by_hand))
    assert not np.any(np.asarray(res.activation_grads[site]))


class LinenLoop(nn.Module):
    @nn.compact
    def __call__(self, x):
        cell = nn.Dense(3)
        cell(x)  # its parameters, made before the loop
        return jax.lax.fori_loop(0, ITERATIONS, lambda i, h: scaled(cell(h)), x)


def _haiku_loop(x):
    cell = hk.Linear(3)
    cell(x)
    return hk.fori_loop(0, ITERATIONS, lambda i, h: scaled(cell(h)), x)


def test_linen_fori_loop_sites_keep_a_custom_jvp_rule():
    model = LinenLoop()
    variables = model.init(jax.random.key(0), X)
    res = bridge.probe(model, variables).value_and_grad(loss_fn, X, at="Dense_0")
    assert res.activations["Dense_0"].shape[0] == ITERATIONS
    plain = jax.grad(lambda v: loss_fn(model.apply(v, X)))(variables)
    for got, expected in zip(
        jax.tree.leaves(res.grads), jax.tree.leaves(plain), strict=True
    ):
        assert_close(got, expected)


def test_haiku_fori_loop_sites_keep_a_custom_jvp_rule():
    model = hk.transform(_haiku_loop)
    params = model.init(jax.random.key(0), X)
    res = bridge.probe(model, params).value_and_grad(loss_fn, X, at="linear")
    assert res.activations["linear"].shape[0] == ITERATIONS
    plain = jax.grad(lambda p: loss_fn(model.apply(p, None, X)))(params)
    for got, expected in zip(
        jax.tree.leaves(res.grads), jax.tree.leaves(plain), strict=True
    ):
        assert_close(got, expected)
