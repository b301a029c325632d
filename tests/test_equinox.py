"""Equinox-specific behaviour: sites inside the model's own `jax.vmap`, state,
transforms the probe cannot see into, and the adapter's errors.

References are written by hand (an einsum for a Linear applied per element, a
loss whose gradient is known in closed form) or are Equinox's own
(`eqx.filter_grad`, the unprobed model).
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_tree_allclose

import bridge

MODES = ["eager", "jit"]


def _run(mode, fn, *args):
    return (jax.jit(fn) if mode == "jit" else fn)(*args)


class Nested(eqx.Module):
    """A Linear applied per `(a, b)` element by two vmaps of the model's own code.

    One example is `(a, in, b)`; the inner vmap maps axis 1 (`in_axes=1`), and
    the outer vmap puts its axis second in the output (`out_axes=1`), so the
    output is `(b, a, out)` while the site is `(a, b, out)`: mapped axes
    first, outermost first, whatever the model does with them afterwards.
    """

    linear: eqx.nn.Linear

    def __call__(self, x):
        per_a = lambda xa: jax.vmap(self.linear, in_axes=1)(xa)
        return jax.vmap(per_a, out_axes=1)(x)


def _nested():
    model = Nested(eqx.nn.Linear(3, 4, key=jax.random.key(0)))
    x = jax.random.normal(jax.random.key(1), (6, 2, 3, 5))  # (batch, a, in, b)
    return model, x


@pytest.mark.parametrize("mode", MODES)
def test_a_site_inside_nested_vmaps_holds_every_element_outermost_first(mode):
    model, x = _nested()
    weights = jax.random.normal(jax.random.key(2), (6, 5, 2, 4))  # like the output
    probe = bridge.probe(model, vmap=True)
    assert probe.sites(x)["linear"].shape == (6, 2, 5, 4)
    res = _run(
        mode,
        lambda p, x: p.value_and_grad(
            lambda y: jnp.sum(weights * y), x, with_inputs=True
        ),
        probe,
        x,
    )
    w, b = model.linear.weight, model.linear.bias
    expected = jnp.einsum("nazb,oz->nabo", x, w) + b[None, None, None]
    np.testing.assert_allclose(
        res.activations["linear"], expected, rtol=1e-5, atol=1e-6
    )
    # d loss / d output is `weights`: one gradient per element, never summed.
    np.testing.assert_allclose(
        res.activation_grads["linear"], weights.transpose(0, 2, 1, 3), rtol=1e-6
    )
    # The inputs are recorded the same way: (batch, a, b, in).
    (inputs,) = res.inputs["linear"]
    np.testing.assert_allclose(inputs, x.transpose(0, 1, 3, 2), rtol=1e-6)


@pytest.mark.parametrize("mode", MODES)
def test_a_patch_inside_the_model_vmap_has_the_site_shape(mode):
    model, x = _nested()
    probe = bridge.probe(model, vmap=True)
    replacement = jax.random.normal(jax.random.key(3), (6, 2, 5, 4))
    fwd = _run(mode, lambda p, x: p.apply(x, patch={"linear": replacement}), probe, x)
    np.testing.assert_allclose(fwd.outputs, replacement.transpose(0, 2, 1, 3))
    doubled = _run(
        mode, lambda p, x: p.apply(x, patch={"linear": lambda v: 2 * v}), probe, x
    )
    plain = jax.vmap(model)(x)
    np.testing.assert_allclose(doubled.outputs, 2 * plain, rtol=1e-6)
    np.testing.assert_allclose(
        doubled.activations["linear"], 2 * plain.transpose(0, 2, 1, 3), rtol=1e-6
    )


class TapInBlock(eqx.Module):
    linear: eqx.nn.Linear

    def __call__(self, xs):
        return jax.vmap(lambda x: bridge.tap("pre", self.linear(x)))(xs)


class Outer(eqx.Module):
    block: TapInBlock

    def __call__(self, xs):
        return self.block(xs)


@pytest.mark.parametrize("mode", MODES)
def test_a_tap_inside_the_model_vmap_holds_every_token(mode):
    model = Outer(TapInBlock(eqx.nn.Linear(3, 4, key=jax.random.key(0))))
    xs = jax.random.normal(jax.random.key(1), (5, 3))  # (tokens, in), one example
    weights = jax.random.normal(jax.random.key(2), (5, 4))
    probe = bridge.probe(model)
    assert list(probe.sites(xs)) == ["block", "block/linear", "block/pre"]
    res = _run(
        mode,
        lambda p, x: p.value_and_grad(lambda y: jnp.sum(weights * y), x),
        probe,
        xs,
    )
    expected = xs @ model.block.linear.weight.T + model.block.linear.bias[None]
    np.testing.assert_allclose(
        res.activations["block/pre"], expected, rtol=1e-5, atol=1e-6
    )
    np.testing.assert_allclose(res.activation_grads["block/pre"], weights, rtol=1e-6)
    np.testing.assert_allclose(res.activation_grads["block/linear"], weights, rtol=1e-6)


def _mlp_loss(y):
    return jnp.mean(jnp.square(y - 0.5))


@pytest.mark.parametrize("mode", MODES)
def test_grads_are_what_eqx_filter_grad_returns(mode):
    model = eqx.nn.MLP(3, 2, 4, 2, key=jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (5, 3))
    res = _run(
        mode,
        lambda p, x: p.value_and_grad(_mlp_loss, x),
        bridge.probe(model, vmap=True),
        x,
    )
    expected = eqx.filter_grad(lambda m, x: _mlp_loss(jax.vmap(m)(x)))(model, x)
    assert_tree_allclose(res.grads, expected)


def test_the_probe_works_under_eqx_filter_jit_and_an_outer_vmap():
    model = eqx.nn.MultiheadAttention(2, 4, key=jax.random.key(0))

    class SelfAttention(eqx.Module):
        attn: eqx.nn.MultiheadAttention

        def __call__(self, x):
            return self.attn(x, x, x)

    model = SelfAttention(model)
    xs = jax.random.normal(jax.random.key(1), (3, 5, 4))  # (batch, tokens, dim)
    batched = eqx.filter_jit(lambda p, x: p.value_and_grad(_mlp_loss, x))(
        bridge.probe(model, vmap=True), xs
    )
    # The same per-example gradients from a probe of one example under the
    # user's own vmap (the loss is a mean: scale by the batch size).
    single = jax.vmap(
        lambda x: bridge.probe(model).value_and_grad(_mlp_loss, x).activation_grads
    )(xs)
    for name, grad in batched.activation_grads.items():
        np.testing.assert_allclose(grad * 3, single[name], rtol=1e-5, atol=1e-7)
    assert batched.activation_grads["attn/query_proj"].shape == (3, 5, 4)


def test_sites_inside_scan_or_checkpoint_are_not_sites_and_change_nothing():
    class Checkpointed(eqx.Module):
        inner: eqx.nn.Linear
        outer: eqx.nn.Linear

        def __call__(self, x):
            return self.outer(jax.checkpoint(lambda x: self.inner(x))(x))

    keys = jax.random.split(jax.random.key(0), 2)
    x = jax.random.normal(jax.random.key(1), (4, 3))
    for model, expected_sites in [
        (
            eqx.nn.MLP(3, 2, 4, 3, scan=True, key=keys[0]),
            ["layers/0", "activation", "layers/2", "final_activation"],
        ),
        (
            Checkpointed(
                eqx.nn.Linear(3, 3, key=keys[0]), eqx.nn.Linear(3, 2, key=keys[1])
            ),
            ["outer"],
        ),
    ]:
        probe = bridge.probe(model, vmap=True)
        assert list(probe.sites(x)) == expected_sites
        res = probe.value_and_grad(_mlp_loss, x)
        loss, grads = eqx.filter_value_and_grad(lambda m, x: _mlp_loss(jax.vmap(m)(x)))(
            model, x
        )
        np.testing.assert_allclose(res.loss, loss, rtol=1e-6)
        assert_tree_allclose(res.grads, grads)


def _stateful_sequential():
    keys = jax.random.split(jax.random.key(0), 2)
    return eqx.nn.make_with_state(eqx.nn.Sequential)(
        [
            eqx.nn.Linear(3, 4, key=keys[0]),
            eqx.nn.BatchNorm(4, axis_name="batch", mode="batch"),
            eqx.nn.Linear(4, 2, key=keys[1]),
        ]
    )


@pytest.mark.parametrize("mode", MODES)
def test_state_threads_through_a_sequential_and_the_user_state_stays_usable(mode):
    model, state = _stateful_sequential()
    x = jax.random.normal(jax.random.key(1), (8, 3))
    probe = bridge.probe(model, state, vmap=True)
    assert list(probe.sites(x)) == ["layers/0", "layers/1", "layers/2"]
    res = _run(mode, lambda p, x: p.value_and_grad(_mlp_loss, x), probe, x)
    outputs, new_state = jax.vmap(
        model, in_axes=(0, None), out_axes=(0, None), axis_name="batch"
    )(x, state)  # fails if probing had used up the user's `state`
    np.testing.assert_allclose(res.loss, _mlp_loss(outputs), rtol=1e-6)
    assert_tree_allclose(res.state, new_state)
    # A stateful layer's site is its output, the State left out.
    normed, left_out = res.activations["layers/1"]
    assert normed.shape == (8, 4) and left_out is None
    np.testing.assert_allclose(normed.mean(0), np.zeros(4), atol=1e-5)


def test_the_user_model_keeps_its_batchnorm_axis_name_and_structure():
    keys = jax.random.split(jax.random.key(0), 2)
    model, state = eqx.nn.make_with_state(eqx.nn.Sequential)(
        [eqx.nn.Linear(3, 4, key=keys[0]), eqx.nn.BatchNorm(4, "mine", mode="batch")]
    )
    before = jax.tree.structure(model)
    x = jax.random.normal(jax.random.key(1), (8, 3))
    res = bridge.probe(model, state, vmap=True).value_and_grad(_mlp_loss, x)
    # Under vmap=True the BatchNorm averages over the probe's batch axis.
    np.testing.assert_allclose(res.activations["layers/1"][0].mean(0), 0, atol=1e-5)
    assert model.layers[1].axis_name == "mine"
    assert jax.tree.structure(model) == before
    assert type(model.layers[0]) is eqx.nn.Linear


def test_wrong_variables_are_refused_naming_the_fix():
    model = eqx.nn.Linear(3, 2, key=jax.random.key(0))
    with pytest.raises(TypeError, match=r"bridge\.probe\(module, state\)"):
        bridge.probe(model, {"params": model.weight})
    stateful, state = _stateful_sequential()
    with pytest.raises(TypeError, match=r"got 2 variable arguments"):
        bridge.probe(stateful, state, state)
    with pytest.raises(ValueError, match=r"no state was given.*make_with_state"):
        bridge.probe(stateful)


def test_a_stateful_model_must_return_outputs_and_state():
    class ForgetsState(eqx.Module):
        linear: eqx.nn.Linear
        bn: eqx.nn.BatchNorm

        def __call__(self, x, state):
            x, state = self.bn(self.linear(x), state)
            return x

    keys = jax.random.key(0)
    model, state = eqx.nn.make_with_state(ForgetsState)(
        eqx.nn.Linear(3, 4, key=keys), eqx.nn.BatchNorm(4, "batch", mode="batch")
    )
    probe = bridge.probe(model, state, vmap=True)
    with pytest.raises(TypeError, match=r"must return \(outputs, new_state\)"):
        probe.sites(jnp.ones((2, 3)))
