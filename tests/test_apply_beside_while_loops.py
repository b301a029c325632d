"""`probe.apply` gives the values of sites inside branches and loops of static
bounds in a model that also runs a `lax.while_loop` (a tree search on the
network's outputs), in every library (DESIGN.md, "Sites inside control
flow").

`apply` differentiates nothing: the values leave their loops and branches
as what bridge's recorders are given on the way back, and a while loop,
which JAX cannot reverse-differentiate, passes nothing back that is read
(`bridge._session.recording_pullback`). `value_and_grad`, which does
differentiate the model, still refuses that while loop.

Each model is `encoder`, then `STEPS` iterations of `tanh(cell(h))` in a
`lax.fori_loop`, then a `lax.cond` between `left` and `tanh(right(h))`
taken per example (`h[0] > 0`), then a `lax.while_loop` that halves its
carry a number of times its data decides, then `head`. The references never
use bridge: the same computation written out from the parameters, the loop
unrolled and the branch picked in Python, one example at a time.
"""

from __future__ import annotations

import equinox as eqx
import flax.linen as nn
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import nnx_supported

import bridge

IN, WIDTH, OUT, BATCH, STEPS = 3, 4, 2, 6, 3
X = jax.random.normal(jax.random.key(1), (BATCH, IN))


def search(h):
    """A while loop of the model's: halve `h` until its norm is below 0.5 (a
    number of steps the data decides)."""

    def go_on(carry):
        return jnp.sum(jnp.square(carry)) > 0.25

    return jax.lax.while_loop(go_on, lambda c: 0.5 * c, h)


def middle(cell, left, right, h):
    """The fori_loop and the cond, around the layers `cell`, `left`, `right`."""
    h = jax.lax.fori_loop(0, STEPS, lambda i, h: jnp.tanh(cell(h)), h)
    return jax.lax.cond(h[0] > 0, lambda v: left(v), lambda v: jnp.tanh(right(v)), h)


# -- the models ---------------------------------------------------------------------


class LinenModel(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.Dense(WIDTH, name="encoder")(x)
        layers = [nn.Dense(WIDTH, name=n) for n in ("cell", "left", "right")]
        if self.is_initializing():
            for layer in layers:
                layer(h)
        return nn.Dense(OUT, name="head")(search(middle(*layers, h)))


def _linen():
    variables = LinenModel().init(jax.random.key(0), jnp.ones((IN,)))
    p = variables["params"]
    weights = {n: (p[n]["kernel"], p[n]["bias"]) for n in p}
    return bridge.probe(LinenModel(), variables, vmap=True), weights


def _nnx():
    from flax import nnx

    class NnxModel(nnx.Module):
        def __init__(self, rngs):
            self.encoder = nnx.Linear(IN, WIDTH, rngs=rngs)
            self.cell = nnx.Linear(WIDTH, WIDTH, rngs=rngs)
            self.left = nnx.Linear(WIDTH, WIDTH, rngs=rngs)
            self.right = nnx.Linear(WIDTH, WIDTH, rngs=rngs)
            self.head = nnx.Linear(WIDTH, OUT, rngs=rngs)

        def __call__(self, x):
            h = middle(self.cell, self.left, self.right, self.encoder(x))
            return self.head(search(h))

    model = NnxModel(nnx.Rngs(0))
    weights = {
        n: (getattr(model, n).kernel[...], getattr(model, n).bias[...])
        for n in ("encoder", "cell", "left", "right", "head")
    }
    return bridge.probe(model, vmap=True), weights


class EqxModel(eqx.Module):
    encoder: eqx.nn.Linear
    cell: eqx.nn.Linear
    left: eqx.nn.Linear
    right: eqx.nn.Linear
    head: eqx.nn.Linear

    def __init__(self, key):
        keys = jax.random.split(key, 5)
        self.encoder = eqx.nn.Linear(IN, WIDTH, key=keys[0])
        self.cell = eqx.nn.Linear(WIDTH, WIDTH, key=keys[1])
        self.left = eqx.nn.Linear(WIDTH, WIDTH, key=keys[2])
        self.right = eqx.nn.Linear(WIDTH, WIDTH, key=keys[3])
        self.head = eqx.nn.Linear(WIDTH, OUT, key=keys[4])

    def __call__(self, x):
        h = middle(self.cell, self.left, self.right, self.encoder(x))
        return self.head(search(h))


def _equinox():
    model = EqxModel(jax.random.key(0))
    weights = {
        n: (getattr(model, n).weight.T, getattr(model, n).bias)
        for n in ("encoder", "cell", "left", "right", "head")
    }
    return bridge.probe(model, vmap=True), weights


def _haiku_function(x):
    h = hk.Linear(WIDTH, name="encoder")(x)
    layers = [hk.Linear(WIDTH, name=n) for n in ("cell", "left", "right")]
    if hk.running_init():
        for layer in layers:
            layer(h)
    return hk.Linear(OUT, name="head")(search(middle(*layers, h)))


def _haiku():
    transformed = hk.transform(_haiku_function)
    params = transformed.init(jax.random.key(0), jnp.ones((IN,)))
    weights = {n: (p["w"], p["b"]) for n, p in params.items()}
    return bridge.probe(transformed, params, vmap=True), weights


BUILDERS = {"linen": _linen, "equinox": _equinox, "haiku": _haiku}
if nnx_supported():
    BUILDERS["nnx"] = _nnx


# -- the reference, by hand -------------------------------------------------------


def by_hand(weights, x):
    """One example: `(outputs, {cell: (STEPS, WIDTH), left, right}, took_left)`,
    the loop unrolled and the branch picked in Python; the branch not taken
    holds zeros."""
    dense = lambda name, v: v @ weights[name][0] + weights[name][1]  # noqa: E731
    h = dense("encoder", x)
    cells = []
    for _ in range(STEPS):
        cells.append(dense("cell", h))
        h = jnp.tanh(cells[-1])
    took_left = bool(h[0] > 0)
    branch = dense("left" if took_left else "right", h)
    zeros = jnp.zeros_like(branch)
    h = branch if took_left else jnp.tanh(branch)
    while float(jnp.sum(jnp.square(h))) > 0.25:
        h = 0.5 * h
    values = {
        "cell": jnp.stack(cells),
        "left": branch if took_left else zeros,
        "right": zeros if took_left else branch,
    }
    return dense("head", h), values, took_left


def reference(weights):
    per_example = [by_hand(weights, x) for x in X]
    outputs = jnp.stack([o for o, _, _ in per_example])
    values = {
        site: jnp.stack([v[site] for _, v, _ in per_example])
        for site in ("cell", "left", "right")
    }
    values["cell"] = jnp.moveaxis(values["cell"], 0, 1)  # iterations first
    took_left = np.array([t for _, _, t in per_example])
    return outputs, values, took_left


def assert_close(actual, expected):
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    scale = max(float(np.max(np.abs(expected))), 1e-6)
    np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-5 * scale)


# -- the tests -------------------------------------------------------------------


@pytest.mark.parametrize("library", list(BUILDERS))
@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_apply_gives_loop_and_branch_values_beside_a_while_loop(library, mode):
    """Each iteration's value of the loop's site, `(iterations, batch,
    width)`, and each branch's value where it ran (zeros elsewhere, `ran`
    saying where), equal the model unrolled by hand; the outputs are the
    model's."""
    probe, weights = BUILDERS[library]()
    outputs, values, took_left = reference(weights)
    assert took_left.any() and not took_left.all()  # both branches run

    def run(x):
        return probe.apply(x, at=["cell", "left", "right"])

    fwd = run(X) if mode == "eager" else jax.jit(run)(X)
    assert list(fwd.activations) == ["cell", "left", "right"]
    assert fwd.activations["cell"].shape == (STEPS, BATCH, WIDTH)
    for site in ("cell", "left", "right"):
        assert_close(fwd.activations[site], values[site])
    assert set(fwd.ran) == {"left", "right"}
    np.testing.assert_array_equal(np.asarray(fwd.ran["left"]), took_left)
    np.testing.assert_array_equal(np.asarray(fwd.ran["right"]), ~took_left)
    assert_close(fwd.outputs, outputs)


@pytest.mark.parametrize("library", list(BUILDERS))
@pytest.mark.parametrize("at", ["cell", "left"])
def test_apply_of_one_site_in_control_flow_beside_a_while_loop(library, at):
    probe, weights = BUILDERS[library]()
    _, values, _ = reference(weights)
    fwd = jax.jit(lambda x: probe.apply(x, at=at))(X)
    assert_close(fwd.activations[at], values[at])


@pytest.mark.parametrize("library", list(BUILDERS))
def test_value_and_grad_still_refuses_the_while_loop(library):
    """The step differentiates the model, through its while loop: JAX's
    error (or bridge's naming it), never a silent zero."""
    probe, _ = BUILDERS[library]()
    with pytest.raises((ValueError, bridge.BridgeError), match="while_loop"):
        probe.value_and_grad(lambda o: jnp.sum(o**2), X, at="cell")


def test_a_while_loop_outside_a_recording_pullback_still_raises():
    """bridge's zeros for a while loop's transpose stand only in the pullback
    that records: after an `apply`, differentiating a while loop in plain JAX
    raises JAX's error, as without bridge."""
    probe, _ = _equinox()
    probe.apply(X, at="cell")
    with pytest.raises(ValueError, match="Reverse-mode differentiation"):
        jax.grad(lambda h: jnp.sum(search(h)))(jnp.ones((WIDTH,)))


class EqxStack(eqx.Module):
    """A scan over stacked layers (Equinox's own route records its sites
    through the backward pass too), then the while loop."""

    layers: eqx.nn.Linear

    def __call__(self, x):
        arrays, static = eqx.partition(self.layers, eqx.is_array)

        def step(h, layer):
            return jnp.tanh(eqx.combine(layer, static)(h)), None

        return search(jax.lax.scan(step, x, arrays)[0])


@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_apply_gives_a_scanned_stacks_values_beside_a_while_loop(mode):
    keys = jax.random.split(jax.random.key(0), STEPS)
    layers = eqx.filter_vmap(lambda key: eqx.nn.Linear(IN, IN, key=key))(keys)
    probe = bridge.probe(EqxStack(layers), vmap=True)

    def by_hand(x):
        values = []
        for i in range(STEPS):
            values.append(x @ layers.weight[i].T + layers.bias[i])
            x = jnp.tanh(values[-1])
        return jnp.stack(values)

    expected = jnp.moveaxis(jnp.stack([by_hand(x) for x in X]), 0, 1)

    def run(x):
        return probe.apply(x, at="layers")

    fwd = run(X) if mode == "eager" else jax.jit(run)(X)
    assert_close(fwd.activations["layers"], expected)
