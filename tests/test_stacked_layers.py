"""A stack of layers that compute the same runs, in a probed step, as one
function the layers share (`bridge._session.computation.stacked_layers`):
JAX then linearizes one layer where it would linearize every equation of
every layer, so a new program's first lowering costs what plain's does. The
numbers are those of the model: checked here against references bridge
does not compute (plain `jax.grad`, `jax.jvp` of a perturbation inserted by
hand), for a site in one layer, every site, and a patch that stops the
sharing of its layer.
"""

from __future__ import annotations

import warnings

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_tree_allclose

import bridge

WIDTH, DEPTH, BATCH = 8, 4, 3


class EquinoxBlock(eqx.Module):
    up: eqx.nn.Linear
    down: eqx.nn.Linear

    def __init__(self, key):
        a, b = jax.random.split(key)
        self.up = eqx.nn.Linear(WIDTH, 2 * WIDTH, key=a)
        self.down = eqx.nn.Linear(2 * WIDTH, WIDTH, key=b)

    def __call__(self, x):
        return x + self.down(jnp.tanh(self.up(x)))


class EquinoxStack(eqx.Module):
    blocks: tuple
    head: eqx.nn.Linear

    def __init__(self, key):
        keys = jax.random.split(key, DEPTH + 1)
        self.blocks = tuple(EquinoxBlock(k) for k in keys[:DEPTH])
        self.head = eqx.nn.Linear(WIDTH, 1, key=keys[-1])

    def __call__(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class LinenBlock(nn.Module):
    @nn.compact
    def __call__(self, x):
        return x + nn.Dense(WIDTH, name="down")(jnp.tanh(nn.Dense(2 * WIDTH)(x)))


class LinenStack(nn.Module):
    @nn.compact
    def __call__(self, x):
        for _ in range(DEPTH):
            x = LinenBlock()(x)
        return nn.Dense(1)(x)


def _equinox():
    model = EquinoxStack(jax.random.key(0))
    probe = bridge.probe(model, vmap=True)

    def forward(params, x, at=None, delta=None):
        # The model by hand, `delta` added to block `at`'s output.
        def one(x, delta):
            for i, block in enumerate(params.blocks):
                x = block(x)
                if i == at:
                    x = x + delta
            return params.head(x)

        return jax.vmap(one)(x, jnp.zeros_like(x) if delta is None else delta)

    return probe, model, forward, "blocks/{}"


def _linen():
    module = LinenStack()
    x = jnp.ones((BATCH, WIDTH))
    variables = module.init(jax.random.key(0), x)
    probe = bridge.probe(module, variables)

    def forward(params, x, at=None, delta=None):
        def perturbed(next_fun, args, kwargs, context):
            value = next_fun(*args, **kwargs)
            if at is not None and context.module.path == (f"LinenBlock_{at}",):
                if context.method_name == "__call__":
                    value = value + delta
            return value

        with nn.intercept_methods(perturbed):
            return module.apply({"params": params}, x)

    return probe, variables["params"], forward, "LinenBlock_{}"


MODELS = {"equinox": _equinox, "linen": _linen}


def _loss(outputs):
    return jnp.sum(outputs**2)


def _inputs():
    return jax.random.normal(jax.random.key(1), (BATCH, WIDTH))


def _shared_calls(step, *args):
    """The `shared_layer` calls of `step`'s jaxpr (at any depth), and how
    many jaxprs they bind."""
    calls = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.params.get("name") == "shared_layer":
                calls.append(eqn.params["jaxpr"])
            for value in eqn.params.values():
                for sub in value if isinstance(value, tuple | list) else (value,):
                    inner = getattr(sub, "jaxpr", sub)
                    if hasattr(inner, "eqns"):
                        walk(inner)

    walk(jax.make_jaxpr(step)(*args).jaxpr)
    return len(calls), len({id(c) for c in calls})


@pytest.mark.parametrize("library", list(MODELS))
def test_the_layers_of_a_stack_share_one_function(library):
    probe, _, _, name = MODELS[library]()
    x = _inputs()
    apply = jax.jit(lambda p, x: p.apply(x, at=name.format(2)))
    # Every block's call: the selected one by a function of its own, the
    # others by one they share; and no warning of JAX's about the jaxprs
    # bridge cuts.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _shared_calls(apply, probe, x) == (DEPTH, 2)
    # Differentiated, JAX's linearization of each shared function serves
    # several layers (the first block's input has no tangent: a second).
    for step in (
        lambda p, x: p.value_and_grad(_loss, x, at=name.format(2)),
        lambda p, x: p.value_and_grad(_loss, x),
    ):
        calls, distinct = _shared_calls(jax.jit(step), probe, x)
        assert calls == 2 * DEPTH
        assert distinct < calls


@pytest.mark.parametrize("mode", ["eager", "jit"])
@pytest.mark.parametrize("library", list(MODELS))
def test_a_site_in_one_layer_of_a_stack_has_the_models_numbers(library, mode):
    probe, params, forward, name = MODELS[library]()
    x = _inputs()
    at = 2
    site = name.format(at)

    def run(p, x):
        return p.value_and_grad(_loss, x, at=site)

    result = (jax.jit(run) if mode == "jit" else run)(probe, x)
    loss, grads = jax.value_and_grad(lambda p: _loss(forward(p, x)))(params)
    np.testing.assert_allclose(result.loss, loss, rtol=1e-5)
    assert_tree_allclose(result.grads, grads, rtol=1e-5, atol=1e-6)
    # The activation gradient against jax.jvp of a perturbation by hand.
    value = result.activations[site]
    direction = jax.random.normal(jax.random.key(2), value.shape)
    zero = jnp.zeros_like(value)
    _, expected = jax.jvp(
        lambda d: _loss(forward(params, x, at=at, delta=d)), (zero,), (direction,)
    )
    np.testing.assert_allclose(
        jnp.vdot(result.activation_grads[site], direction), expected, rtol=1e-4
    )


@pytest.mark.parametrize("library", list(MODELS))
def test_every_site_and_a_patched_layer_in_a_stack(library):
    probe, params, forward, name = MODELS[library]()
    x = _inputs()
    every = jax.jit(lambda p, x: p.value_and_grad(_loss, x))(probe, x)
    # Each block's value, from the model by hand with a zero perturbation
    # recorded: the blocks' outputs differ, so no layer's is another's.
    for at in range(DEPTH):
        value = every.activations[name.format(at)]
        direction = jnp.ones_like(value)
        _, expected = jax.jvp(
            lambda d, at=at: _loss(forward(params, x, at=at, delta=d)),
            (jnp.zeros_like(value),),
            (direction,),
        )
        np.testing.assert_allclose(
            jnp.vdot(every.activation_grads[name.format(at)], direction),
            expected,
            rtol=1e-4,
        )
    sums = {float(jnp.sum(every.activations[name.format(i)])) for i in range(DEPTH)}
    assert len(sums) == DEPTH
    # A patch of block 1 (the run acts on its layer by name): the loss of
    # the model with block 1's output replaced by hand.
    patched = probe.value_and_grad(_loss, x, patch={name.format(1): lambda v: 2.0 * v})
    value = every.activations[name.format(1)]
    expected = _loss(forward(params, x, at=1, delta=value))
    np.testing.assert_allclose(patched.loss, expected, rtol=1e-5)
