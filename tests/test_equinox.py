"""Equinox-specific behaviour: sites inside the model's own `jax.vmap`, state,
transforms the probe cannot see into, and the adapter's errors.

References are written by hand (an einsum for a Linear applied per element, a
loss whose gradient is known in closed form) or are Equinox's own
(`eqx.filter_grad`, the unprobed model).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cases.equinox import batch_norm
from helpers import (
    assert_tree_allclose,
    jaxpr_traces_record_their_parent,
    value_and_grad_in,
)
from jax.lax import scan as uncounted_scan

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
        res.activation_grads["linear"], weights.transpose(0, 2, 1, 3), rtol=1e-5
    )
    # The inputs are recorded the same way: (batch, a, b, in).
    (inputs,) = res.inputs["linear"]
    np.testing.assert_allclose(inputs, x.transpose(0, 1, 3, 2), rtol=1e-5)


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
    np.testing.assert_allclose(doubled.outputs, 2 * plain, rtol=1e-5)
    np.testing.assert_allclose(
        doubled.activations["linear"], 2 * plain.transpose(0, 2, 1, 3), rtol=1e-5
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
    np.testing.assert_allclose(res.activation_grads["block/pre"], weights, rtol=1e-5)
    np.testing.assert_allclose(res.activation_grads["block/linear"], weights, rtol=1e-5)


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


# -- scanned stacks of layers and rematerialisation -----------------------------


class Dense(eqx.Module):
    """A layer that takes a batch as well as one example (for vmap=False)."""

    weight: jax.Array
    bias: jax.Array

    def __init__(self, size, key):
        self.weight = jax.random.normal(key, (size, size)) / size**0.5
        self.bias = jnp.full((size,), 0.1)

    def __call__(self, x):
        h = x @ self.weight
        return h + jnp.broadcast_to(self.bias, h.shape)


class Block(eqx.Module):
    linear: Dense
    activation: Callable = jnp.tanh

    def __call__(self, x):
        return self.activation(self.linear(x)) + x


class ScannedStack(eqx.Module):
    """The standard Equinox pattern: layers built with `eqx.filter_vmap`, a
    `lax.scan` over their arrays, each step rebuilt with `eqx.combine`."""

    embed: Dense
    layers: Block
    head: eqx.nn.Linear
    remat: bool = eqx.field(static=True)

    def __init__(self, key, remat=False):
        keys = jax.random.split(key, 3)
        self.embed = Dense(4, keys[0])
        self.layers = eqx.filter_vmap(lambda k: Block(Dense(4, k)))(
            jax.random.split(keys[1], 3)
        )
        self.head = eqx.nn.Linear(4, 2, key=keys[2])
        self.remat = remat

    def __call__(self, x):
        dynamic, static = eqx.partition(self.layers, eqx.is_array)

        def step(h, layer_arrays):
            return eqx.combine(layer_arrays, static)(h), None

        if self.remat:
            step = jax.checkpoint(step)
        h, _ = jax.lax.scan(step, self.embed(x), dynamic)
        return _head(self.head, h)


class UnrolledStack(eqx.Module):
    embed: Dense
    layers: tuple
    head: eqx.nn.Linear

    def __call__(self, x):
        h = self.embed(x)
        for layer in self.layers:
            h = layer(h)
        return _head(self.head, h)


def _head(head, h):
    return jax.vmap(head)(h) if h.ndim == 2 else head(h)


def _unrolled(scanned):
    dynamic, static = eqx.partition(scanned.layers, eqx.is_array)
    layers = tuple(
        eqx.combine(jax.tree.map(lambda a, i=i: a[i], dynamic), static)
        for i in range(3)
    )
    return UnrolledStack(scanned.embed, layers, scanned.head)


@pytest.mark.parametrize(
    "mode, vmap, remat",
    [
        ("eager", False, False),
        ("jit", False, True),
        ("eager", True, True),
        ("jit", True, False),
    ],
)
def test_a_scanned_site_stacks_iterations_and_equals_the_unrolled_model(
    mode, vmap, remat
):
    model = ScannedStack(jax.random.key(0), remat)
    x = jax.random.normal(jax.random.key(1), (5, 4))
    scanned = bridge.probe(model, vmap=vmap)
    unrolled = bridge.probe(_unrolled(model), vmap=vmap)
    sites = scanned.sites(x)
    assert list(sites) == [
        "embed",
        "layers",
        "layers/linear",
        "layers/activation",
        "head",
    ]
    # (iterations, *value shape), the batch axis after the iterations, with or
    # without vmap=True.
    assert sites["layers/linear"].shape == (3, 5, 4)

    res = _run(mode, lambda p, x: p.value_and_grad(_mlp_loss, x), scanned, x)
    ref = _run(mode, lambda p, x: p.value_and_grad(_mlp_loss, x), unrolled, x)
    np.testing.assert_allclose(res.loss, ref.loss, rtol=1e-5)
    for site in ("layers", "layers/linear", "layers/activation"):
        for i in range(3):
            unrolled_site = site.replace("layers", f"layers/{i}", 1)
            for field in ("activations", "activation_grads"):
                stacked = getattr(res, field)[site]
                np.testing.assert_allclose(
                    stacked[i],
                    getattr(ref, field)[unrolled_site],
                    rtol=1e-5,
                    atol=1e-6,
                )
    for site in ("embed", "head"):
        np.testing.assert_allclose(
            res.activation_grads[site], ref.activation_grads[site], rtol=1e-5, atol=1e-7
        )
    mapped = (lambda m: jax.vmap(m)) if vmap else (lambda m: m)
    expected = eqx.filter_grad(lambda m: _mlp_loss(mapped(m)(x)))(model)
    assert_tree_allclose(res.grads, expected)

    # A selection of one scanned site, and the forward pass alone.
    one = _run(
        mode,
        lambda p, x: p.value_and_grad(_mlp_loss, x, at="layers/linear"),
        scanned,
        x,
    )
    assert list(one.activation_grads) == ["layers/linear"]
    np.testing.assert_allclose(
        one.activation_grads["layers/linear"],
        res.activation_grads["layers/linear"],
        rtol=1e-5,
    )
    forward = _run(mode, lambda p, x: p.apply(x, at="layers"), scanned, x)
    np.testing.assert_allclose(
        forward.activations["layers"], res.activations["layers"], rtol=1e-5
    )


def _step(h, layer):
    return layer(h), None


class ScansItsLayers(eqx.Module):
    """Scans the stacked module itself, with a body JAX caches across traces."""

    layers: eqx.nn.Linear

    def __call__(self, x):
        return jax.lax.scan(_step, x, self.layers)[0]


def test_a_scan_body_jax_traced_before_still_gives_every_site():
    model = ScansItsLayers(_stacked_linears(jax.random.key(0)))
    probe = bridge.probe(model, vmap=True)
    x = jax.random.normal(jax.random.key(1), (2, 3))
    first = probe.value_and_grad(_mlp_loss, x)
    again = probe.value_and_grad(_mlp_loss, x)
    assert list(probe.sites(x)) == list(again.activations) == ["layers"]
    hidden = x @ model.layers.weight[0].T + model.layers.bias[0][None]
    np.testing.assert_allclose(again.activations["layers"][0], hidden, rtol=1e-5)
    np.testing.assert_allclose(
        again.activation_grads["layers"], first.activation_grads["layers"]
    )


class Checkpointed(eqx.Module):
    inner: eqx.nn.Linear
    outer: eqx.nn.Linear
    filtered: bool = eqx.field(static=True)

    def __call__(self, x):
        if self.filtered:
            return self.outer(eqx.filter_checkpoint(self.inner)(x))
        return self.outer(jax.checkpoint(lambda x: self.inner(x))(x))


# On every jax, the floor's too: the core reads the checkpoint from the
# computation, where the adapter's route needed jaxpr traces' parents.
@pytest.mark.parametrize("filtered", [False, True], ids=["jax", "eqx"])
@pytest.mark.parametrize("mode", MODES)
def test_a_site_inside_checkpoint_equals_the_same_model_without_it(mode, filtered):
    keys = jax.random.split(jax.random.key(0), 2)
    inner, outer = eqx.nn.Linear(3, 3, key=keys[0]), eqx.nn.Linear(3, 2, key=keys[1])
    x = jax.random.normal(jax.random.key(1), (4, 3))
    checkpointed = bridge.probe(Checkpointed(inner, outer, filtered), vmap=True)
    plain = bridge.probe(eqx.nn.Sequential([inner, outer]), vmap=True)
    assert list(checkpointed.sites(x)) == ["inner", "outer"]
    res = _run(mode, lambda p, x: p.value_and_grad(_mlp_loss, x), checkpointed, x)
    ref = _run(mode, lambda p, x: p.value_and_grad(_mlp_loss, x), plain, x)
    np.testing.assert_allclose(res.loss, ref.loss, rtol=1e-5)
    for site, plain_site in [("inner", "layers/0"), ("outer", "layers/1")]:
        np.testing.assert_allclose(
            res.activations[site], ref.activations[plain_site], rtol=1e-5
        )
        np.testing.assert_allclose(
            res.activation_grads[site], ref.activation_grads[plain_site], rtol=1e-5
        )
    assert_tree_allclose(res.grads.inner, ref.grads.layers[0])


def _scan(counted: bool) -> Callable:
    """The model's scan: `jax.lax.scan`, looked up when the model runs, or
    `uncounted_scan`, JAX's own scan bound by name when this module was
    imported: the same `scan` in the computation, whose body's calls are
    sites per iteration."""
    return jax.lax.scan if counted else uncounted_scan


class ClosedOverCell(eqx.Module):
    """An RNN: the scan body closes over one cell, called at every step.

    `hand(step, output)`, where given, stands for the cell's output at
    `step` (the scan's `xs` carry each step's index): the tests' references
    without bridge (an offset added, a patch applied by hand)."""

    cell: eqx.nn.Linear
    hand: Callable | None = None
    counted: bool = eqx.field(static=True, default=True)

    def __call__(self, xs):
        def step(h, step_x):
            i, x = step_x
            out = self.cell(h + x)
            return (out if self.hand is None else self.hand(i, out)), None

        steps = jnp.arange(xs.shape[0])
        return _scan(self.counted)(step, xs[0], (steps, xs))[0]


class TapInScan(eqx.Module):
    """A tap in a scan over stacked layers; `hand` as in `ClosedOverCell`,
    applied to the tap's value."""

    layers: eqx.nn.Linear
    hand: Callable | None = None
    counted: bool = eqx.field(static=True, default=True)

    def __call__(self, x):
        dynamic, static = eqx.partition(self.layers, eqx.is_array)

        def step(h, step_arrays):
            i, arrays = step_arrays
            h = bridge.tap("h", eqx.combine(arrays, static)(h))
            return (h if self.hand is None else self.hand(i, h)), None

        steps = jnp.arange(jax.tree.leaves(dynamic)[0].shape[0])
        return _scan(self.counted)(step, x, (steps, dynamic))[0]


#: `eqx.nn.MLP(..., scan=True)`, since equinox 0.13.5.
_MLP_SCANS = "scan" in inspect.signature(eqx.nn.MLP.__init__).parameters


def _stacked_linears(key):
    return eqx.filter_vmap(lambda k: eqx.nn.Linear(3, 3, key=k))(
        jax.random.split(key, 2)
    )


@pytest.mark.skipif(not _MLP_SCANS, reason="eqx.nn.MLP(scan=True): equinox >= 0.13.5")
@pytest.mark.parametrize("mode", MODES)
def test_mlp_scanning_its_hidden_layers_is_a_site_per_layer(mode):
    """`eqx.nn.MLP(scan=True)` scans its stacked hidden layers and indexes its
    per-neuron activations by the traced step inside its own `jax.vmap`: each
    hidden layer and activation is a site per step, against the MLP written
    by hand with an offset at every site."""
    mlp = eqx.nn.MLP(3, 2, 4, 3, scan=True, key=jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (5, 3))
    SCANNED = ("layers/1", "activation#1")
    first, hidden, last = mlp.layers

    def by_hand(offsets, x):
        h = first.weight @ x + first.bias + offsets["layers/0"]
        h = jax.nn.relu(h) + offsets["activation"]
        for k in range(2):
            h = hidden.weight[k] @ h + hidden.bias[k] + offsets["layers/1"][k]
            h = jax.nn.relu(h) + offsets["activation#1"][k]
        y = last.weight @ h + last.bias + offsets["layers/2"]
        return y + offsets["final_activation"]

    def values(x):
        """Every site's value for one example, by hand."""
        h0 = first.weight @ x + first.bias
        h, hiddens, activations = jax.nn.relu(h0), [], []
        for k in range(2):
            hiddens.append(hidden.weight[k] @ h + hidden.bias[k])
            h = jax.nn.relu(hiddens[-1])
            activations.append(h)
        y = last.weight @ h + last.bias
        return {
            "layers/0": h0,
            "activation": jax.nn.relu(h0),
            "layers/1": jnp.stack(hiddens),
            "activation#1": jnp.stack(activations),
            "layers/2": y,
            "final_activation": y,
        }

    def loss_fn(outputs):
        return jnp.sum(jnp.square(outputs - 0.3))

    def steps_first(per_example):
        """A site scanned over is `(steps, batch, ...)` (the batch after
        the iterations); the others `(batch, ...)`."""
        return {
            name: jnp.moveaxis(value, 0, 1) if name.startswith(SCANNED) else value
            for name, value in per_example.items()
        }

    recorded = steps_first(jax.vmap(values)(x))
    zeros = jax.tree.map(jnp.zeros_like, recorded)
    loss, grads = jax.value_and_grad(
        lambda offsets: loss_fn(jax.vmap(by_hand)(steps_first(offsets), x))
    )(zeros)
    probe = bridge.probe(mlp, vmap=True)
    assert {name: s.shape for name, s in probe.sites(x).items()} == {
        name: value.shape for name, value in recorded.items()
    }
    res = value_and_grad_in(mode, probe, loss_fn, (x,))
    np.testing.assert_allclose(res.loss, loss, rtol=1e-6)
    assert_tree_allclose(res.activations, recorded)
    assert_tree_allclose(res.activation_grads, grads)


def test_a_scanned_site_takes_patches_and_records_inputs_like_the_unrolled_model():
    # More in test_equinox_scan_interventions.py: references patched by hand,
    # jit, vmap=True, checkpointed bodies, and the errors.
    model = ScannedStack(jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (2, 4))
    value = jax.random.normal(jax.random.key(2), (3, 2, 4))
    res = bridge.probe(model).value_and_grad(
        _mlp_loss,
        x,
        patch={"layers/linear": value, "layers/activation": jnp.negative},
        with_inputs=True,
    )
    ref = bridge.probe(_unrolled(model)).value_and_grad(
        _mlp_loss,
        x,
        patch={
            **{f"layers/{i}/linear": value[i] for i in range(3)},
            "layers/*/activation": jnp.negative,
        },
        with_inputs=True,
    )
    np.testing.assert_allclose(res.loss, ref.loss, rtol=1e-5)
    np.testing.assert_array_equal(res.activations["layers/linear"], value)
    for site in ("layers", "layers/linear", "layers/activation"):
        assert res.inputs[site][0].shape == (3, 2, 4)
        for i in range(3):
            unrolled_site = site.replace("layers", f"layers/{i}", 1)
            for field in ("activations", "activation_grads", "inputs"):
                assert_tree_allclose(
                    jax.tree.map(lambda a, i=i: a[i], getattr(res, field)[site]),
                    getattr(ref, field)[unrolled_site],
                )


def _stateful_sequential():
    keys = jax.random.split(jax.random.key(0), 2)
    return eqx.nn.make_with_state(eqx.nn.Sequential)(
        [
            eqx.nn.Linear(3, 4, key=keys[0]),
            batch_norm(4, axis_name="batch"),
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
    np.testing.assert_allclose(res.loss, _mlp_loss(outputs), rtol=1e-5)
    assert_tree_allclose(res.state, new_state)
    # A stateful layer's site is its output, the State left out.
    normed, left_out = res.activations["layers/1"]
    assert normed.shape == (8, 4) and left_out is None
    np.testing.assert_allclose(normed.mean(0), np.zeros(4), atol=1e-5)


def test_the_user_model_keeps_its_batchnorm_axis_name_and_structure():
    keys = jax.random.split(jax.random.key(0), 2)
    model, state = eqx.nn.make_with_state(eqx.nn.Sequential)(
        [eqx.nn.Linear(3, 4, key=keys[0]), batch_norm(4, "mine")]
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
        eqx.nn.Linear(3, 4, key=keys), batch_norm(4, "batch")
    )
    probe = bridge.probe(model, state, vmap=True)
    with pytest.raises(TypeError, match=r"must return \(outputs, new_state\)"):
        probe.sites(jnp.ones((2, 3)))


class Pooled(eqx.Module):
    conv: eqx.nn.Conv2d
    max_pool: eqx.nn.MaxPool2d
    avg_pool: eqx.nn.AvgPool2d

    def __init__(self, key):
        self.conv = eqx.nn.Conv2d(1, 2, 3, padding=1, key=key)
        self.max_pool = eqx.nn.MaxPool2d(2, stride=2)
        self.avg_pool = eqx.nn.AvgPool2d(2, stride=1)

    def __call__(self, x):
        return self.avg_pool(self.max_pool(self.conv(x)))


def test_pools_are_sites_and_their_reduction_is_not():
    # A pool's `operation` is the binary reduction `lax.reduce_window` traces on
    # scalars, not a step of the forward pass: wrapping it broke the model.
    model = Pooled(jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (2, 1, 6, 6))
    probe = bridge.probe(model, vmap=True)
    assert list(probe.sites(x)) == ["conv", "max_pool", "avg_pool"]

    def loss(y):
        return jnp.sum(y**2)

    res = jax.jit(lambda p, x: p.value_and_grad(loss, x))(probe, x)
    conv_out = jax.vmap(model.conv)(x)
    pooled = jax.vmap(model.max_pool)(conv_out)
    # Independent of bridge: the gradients of the loss as a function of each
    # layer's output, by plain jax.grad.
    tail = jax.vmap(model.avg_pool)
    expected = {
        "conv": jax.grad(lambda h: loss(tail(jax.vmap(model.max_pool)(h))))(conv_out),
        "max_pool": jax.grad(lambda h: loss(tail(h)))(pooled),
        "avg_pool": 2 * tail(pooled),
    }
    for name, grad in expected.items():
        np.testing.assert_allclose(res.activation_grads[name], grad, rtol=1e-5)


def test_a_jitted_step_partitions_its_probe_once_and_compares_it_by_identity(
    monkeypatch,
):
    # A jitted step flattens its probe argument on every call, and a cached
    # program compares the flattened structure with its own. Partitioning a
    # model into arrays and the rest walks every leaf (~1 ms for GPT-2 small,
    # most of a small step on an accelerator), and a fresh static part would
    # make that comparison `eqx.tree_equal` over the whole model: once per
    # probe, and the same static object after.
    model = eqx.nn.MLP(3, 2, 8, 2, key=jax.random.key(0))
    probe = bridge.probe(model, vmap=True)
    partitions = []
    partition = eqx.partition
    monkeypatch.setattr(
        eqx, "partition", lambda *a, **k: partitions.append(1) or partition(*a, **k)
    )
    x = jnp.ones((4, 3))
    step = jax.jit(lambda p, x: p.value_and_grad(_mlp_loss, x).activation_grads)
    first = step(probe, x)
    calls = len(partitions)
    for _ in range(3):
        again = step(probe, x)
    assert len(partitions) == calls
    assert_tree_allclose(again, first)
    assert probe.tree_flatten()[1][0] is probe.tree_flatten()[1][0]
    # The user's model is left as it was given.
    assert "_parts" not in vars(model)


@pytest.mark.parametrize(
    ("model", "x", "error"),
    [
        (eqx.nn.MLP(3, 2, 8, 2, key=jax.random.key(0)), jnp.ones((5, 3)), TypeError),
        (
            eqx.nn.Sequential([eqx.nn.Conv2d(3, 4, 3, key=jax.random.key(0))]),
            jnp.ones((2, 3, 8, 8)),
            ValueError,
        ),
    ],
    ids=["mlp", "conv"],
)
def test_a_batch_given_to_a_per_example_model_suggests_vmap_true(model, x, error):
    """JAX's or Equinox's own shape error, then what to do about it."""
    with pytest.raises(
        error, match=r"(?s)(dot_general|rank 3).*bridge\.probe\(model, vmap=True\)"
    ):
        bridge.probe(model).value_and_grad(jnp.sum, x)
    # With vmap=True the same inputs work, and bridge's own errors get no hint.
    bridge.probe(model, vmap=True).value_and_grad(jnp.sum, x)
    with pytest.raises(ValueError, match="matches no site") as info:
        bridge.probe(model).value_and_grad(jnp.sum, x[0], at="nothing")
    assert "vmap=True" not in str(info.value)


# -- tree surgery is invisible to the model's code -------------------------------


def _near(actual, expected, rtol=1e-5):
    """`actual` equals `expected` judged at the scale of the whole tensor."""
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    scale = float(np.max(np.abs(expected), initial=0.0))
    assert float(np.max(np.abs(actual - expected), initial=0.0)) <= (
        rtol * scale + 1e-6
    )


class Gaussian(eqx.Module):
    """A base distribution: a module whose methods, private ones included,
    the model calls from outside; it is never called itself."""

    loc: jax.Array
    _log_scale: jax.Array

    @property
    def scale(self):
        return jnp.exp(self._log_scale)

    def _standardise(self, x):
        return (x - self.loc) / self.scale

    def _log_prob(self, x):
        # A method the module calls on itself is part of this call.
        z = self._standardise(x)
        return -0.5 * jnp.sum(z**2) - jnp.sum(self._log_scale)

    def log_prob(self, x):
        return self._log_prob(x)


class Flow(eqx.Module):
    """A normalizing-flow-style model: a bijection, then the base's density."""

    shift: eqx.nn.Linear
    base: Gaussian

    def __call__(self, x):
        y = self.shift(x)
        # Private and public methods, a private field and a property, from outside.
        assert self.base._log_scale.shape == self.base.scale.shape
        return self.base._log_prob(y) + 0.5 * self.base.log_prob(y)


class HasFlow(eqx.Module):
    """The pattern inside a bigger model."""

    flow: Flow
    head: eqx.nn.Linear

    def __call__(self, x):
        return self.head(x)[0] + self.flow(x)


def _has_flow():
    keys = jax.random.split(jax.random.key(0), 4)
    flow = Flow(
        eqx.nn.Linear(3, 3, key=keys[0]),
        Gaussian(jax.random.normal(keys[1], (3,)), 0.1 * jnp.arange(3.0)),
    )
    return HasFlow(flow, eqx.nn.Linear(3, 2, key=keys[2]))


class _WithOffset(eqx.Module):
    """The test's own offset at a method's value: `method(x) + offset`."""

    module: eqx.Module
    method: str = eqx.field(static=True)
    offset: jax.Array

    def __getattr__(self, name):
        if name == self.method:
            return lambda *a: getattr(self.module, name)(*a) + self.offset
        return getattr(self.module, name)


@pytest.mark.parametrize("mode", MODES)
def test_a_private_method_called_from_outside_is_a_site_and_works(mode):
    model = _has_flow()
    x = jax.random.normal(jax.random.key(1), (3,))
    probe = bridge.probe(model)
    assert list(probe.sites(x)) == [
        "head",
        "flow",
        "flow/shift",
        "flow/base._log_prob",
        "flow/base.log_prob",
    ]
    res = _run(mode, lambda p, x: p.value_and_grad(jnp.sin, x), probe, x)
    _near(res.loss, jnp.sin(model(x)))
    y = model.flow.shift(x)
    _near(res.activations["flow/base._log_prob"], model.flow.base._log_prob(y))
    _near(res.activations["flow/base.log_prob"], model.flow.base.log_prob(y))
    assert_tree_allclose(res.grads, eqx.filter_grad(lambda m: jnp.sin(m(x)))(model))
    # Activation gradients: d loss / d offset, the offset put there by hand.
    for method in ("_log_prob", "log_prob"):

        def offset(t, method=method):
            base = _WithOffset(model.flow.base, method, t)
            return jnp.sin(eqx.tree_at(lambda m: m.flow.base, model, base)(x))

        _near(
            res.activation_grads[f"flow/base.{method}"],
            jax.jvp(offset, (0.0,), (1.0,))[1],
        )


class Parameterize(eqx.Module):
    """A parameter wrapper (a masked weight) the model never calls."""

    weight: jax.Array
    mask: jax.Array

    def unwrap(self):
        return self.weight * self.mask


def unwrap_by_isinstance(p):
    return p.weight * p.mask if isinstance(p, Parameterize) else p


def unwrap_tree(tree):
    """Unwraps every `Parameterize` in a tree, as utility packages do."""
    return jax.tree.map(
        unwrap_by_isinstance, tree, is_leaf=lambda x: isinstance(x, Parameterize)
    )


def unwrap_like_paramax(tree):
    """paramax's `unwrap`: nested wrappers first, then the wrapper's own
    `unwrap` method, never the tree it was given as a whole."""

    def _unwrap(tree, include_self):
        def is_leaf(x):
            return isinstance(x, Parameterize) and (include_self or x is not tree)

        def unwrap_one(leaf):
            if isinstance(leaf, Parameterize):
                return _unwrap(leaf, include_self=False).unwrap()
            return leaf

        return jax.tree.map(unwrap_one, tree, is_leaf=is_leaf)

    return _unwrap(tree, include_self=True)


class MaskedLayer(eqx.Module):
    w: Parameterize
    linear: eqx.nn.Linear

    def __call__(self, x):
        return self.linear(jnp.tanh(unwrap_by_isinstance(self.w) @ x))


class MaskedModel(eqx.Module):
    """Parameter wrappers unwrapped three ways: a function of one wrapper,
    a `jax.tree.map` over the whole model (whose layers it still calls) and
    paramax's way."""

    w: Parameterize
    layer: MaskedLayer
    how: str = eqx.field(static=True)

    def __call__(self, x):
        if self.how == "isinstance":
            assert isinstance(self.w, Parameterize)
            return self.layer(unwrap_by_isinstance(self.w) @ x)
        unwrap = unwrap_tree if self.how == "tree_map" else unwrap_like_paramax
        model = unwrap(self)
        return model.layer.linear(jnp.tanh(model.layer.w @ (model.w @ x)))


def _masked(how):
    keys = jax.random.split(jax.random.key(0), 3)

    def masked(key):
        weight = jax.random.normal(key, (3, 3))
        return Parameterize(weight, jnp.tril(jnp.ones((3, 3))))

    layer = MaskedLayer(masked(keys[0]), eqx.nn.Linear(3, 2, key=keys[1]))
    return MaskedModel(masked(keys[2]), layer, how)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("how", ["isinstance", "tree_map", "paramax"])
def test_a_parameter_wrapper_the_model_unwraps_is_left_to_it(mode, how):
    model = _masked(how)
    x = jax.random.normal(jax.random.key(1), (4, 3))
    probe = bridge.probe(model, vmap=True)
    sites = list(probe.sites(x))
    # The wrappers are no layers: only a method the model calls on one is a site.
    expected = {
        "isinstance": ["layer", "layer/linear"],
        "tree_map": ["layer/linear"],
        "paramax": ["w.unwrap", "layer/w.unwrap", "layer/linear"],
    }[how]
    assert sites == expected
    res = _run(mode, lambda p, x: p.value_and_grad(_mlp_loss, x), probe, x)
    outputs = jax.vmap(model)(x)
    _near(res.loss, _mlp_loss(outputs))
    _near(res.activations["layer/linear"], outputs)
    _near(res.activation_grads["layer/linear"], jax.grad(_mlp_loss)(outputs))
    expected = eqx.filter_grad(lambda m: _mlp_loss(jax.vmap(m)(x)))(model)
    assert_tree_allclose(res.grads, expected)
    # The user's model is left as it was.
    assert type(model.w) is Parameterize and type(model.layer) is MaskedLayer


class Tied(eqx.Module):
    """`eqx.nn.Shared` ties an embedding to the output layer's weight."""

    shared: eqx.nn.Shared

    def __init__(self, key):
        keys = jax.random.split(key, 2)
        embedding = eqx.nn.Embedding(7, 3, key=keys[0])
        linear = eqx.nn.Linear(3, 7, use_bias=False, key=keys[1])
        self.shared = eqx.nn.Shared(
            (embedding, linear),
            lambda pair: pair[1].weight,
            lambda pair: pair[0].weight,
        )

    def __call__(self, tokens):
        embedding, linear = self.shared()
        return jax.vmap(linear)(jnp.tanh(jax.vmap(embedding)(tokens)))


def test_shared_layers_are_sites_and_their_selectors_are_not():
    model = Tied(jax.random.key(0))
    tokens = jnp.array([0, 3, 6, 2])
    probe = bridge.probe(model)
    assert {name: s.shape for name, s in probe.sites(tokens).items()} == {
        "shared/pytree/0": (4, 3),
        "shared/pytree/1": (4, 7),
    }
    res = probe.value_and_grad(_mlp_loss, tokens)
    logits = model(tokens)
    _near(res.activations["shared/pytree/1"], logits)
    _near(res.activation_grads["shared/pytree/1"], jax.grad(_mlp_loss)(logits))
    assert_tree_allclose(
        res.grads, eqx.filter_grad(lambda m: _mlp_loss(m(tokens)))(model)
    )


class Registered(eqx.Module):
    """A layer whose class keeps a registry of its subclasses."""

    registry = {}  # noqa: RUF012

    weight: jax.Array

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        Registered.registry[cls.__name__] = cls

    def _scale(self, x):
        return self.weight * x

    def __call__(self, x):
        return jnp.tanh(self._scale(x))


class Clashing(eqx.Module):
    """A layer with a field named like one of bridge's own."""

    bridge_path: jax.Array

    def __call__(self, x):
        return self.bridge_path * x


class Calls(eqx.Module):
    registered: Registered
    clashing: Clashing

    def __call__(self, x):
        return self.clashing(self.registered._scale(x) + self.registered(x))


@pytest.mark.parametrize("mode", MODES)
def test_a_module_class_not_to_subclass_is_wrapped_and_answers_all_the_same(mode):
    model = Calls(Registered(jnp.arange(1.0, 4.0)), Clashing(jnp.full(3, 0.5)))
    # Equinox < 0.12 registers a subclass of its own (`_InitableModule`).
    registered_before = dict(Registered.registry)
    x = jax.random.normal(jax.random.key(1), (3,))
    probe = bridge.probe(model)
    assert list(probe.sites(x)) == [
        "registered._scale",
        "registered",
        "clashing",
    ]
    res = _run(mode, lambda p, x: p.value_and_grad(_mlp_loss, x), probe, x)
    _near(res.activations["registered._scale"], model.registered._scale(x))
    _near(res.activations["clashing"], model(x))

    def offset(t):
        scaled = model.registered._scale(x) + t
        return _mlp_loss(model.clashing(scaled + model.registered(x)))

    _near(
        res.activation_grads["registered._scale"],
        jax.grad(offset)(jnp.zeros(3)),
    )
    assert_tree_allclose(res.grads, eqx.filter_grad(lambda m: _mlp_loss(m(x)))(model))
    # bridge's wrapper is no subclass of it
    assert Registered.registry == registered_before


# -- the model's own jax.vmap inside a scanned stack -----------------------------

TOKENS, WIDTH, LAYERS, BATCH = 5, 4, 3, 2


class PerToken(eqx.Module):
    """A layer of a scanned stack that applies its sublayers per token with
    the model's own vmaps: one (`norm`, `linear`) and two (`mix`) deep."""

    norm: eqx.nn.LayerNorm
    linear: eqx.nn.Linear
    mix: eqx.nn.Linear

    def __call__(self, x):
        y = jax.vmap(self.linear)(jax.vmap(self.norm)(x))
        pairs = y.reshape(TOKENS, WIDTH // 2, 2)
        z = jax.vmap(jax.vmap(self.mix))(pairs).reshape(TOKENS, WIDTH)
        return x + jnp.tanh(z)


class PerTokenStack(eqx.Module):
    layers: PerToken
    head: eqx.nn.Linear
    remat: bool = eqx.field(static=True)

    def __init__(self, key, remat=False):
        keys = jax.random.split(key, 2)

        def make(k):
            k1, k2 = jax.random.split(k)
            return PerToken(
                eqx.nn.LayerNorm(WIDTH),
                eqx.nn.Linear(WIDTH, WIDTH, key=k1),
                eqx.nn.Linear(2, 2, key=k2),
            )

        self.layers = eqx.filter_vmap(make)(jax.random.split(keys[0], LAYERS))
        self.head = eqx.nn.Linear(WIDTH, 2, key=keys[1])
        self.remat = remat

    def __call__(self, x):
        dynamic, static = eqx.partition(self.layers, eqx.is_array)

        def step(h, arrays):
            return eqx.combine(arrays, static)(h), None

        if self.remat:
            step = jax.checkpoint(step)
        h, _ = jax.lax.scan(step, x, dynamic)
        return jax.vmap(self.head)(h)


_PER_TOKEN_SITES = ("layers", "layers/norm", "layers/linear", "layers/mix")


def _per_token_by_hand(model, x, offsets, patch=None):
    """The stack written out by hand, one example, with `offsets[site]` (one
    row per layer) added at each site and `patch` replacing `layers/linear`.
    Returns the outputs and each site's values, `(layers, tokens, ...)`."""
    dynamic, static = eqx.partition(model.layers, eqx.is_array)

    def step(h, xs):
        arrays, off, replacement = xs
        layer = eqx.combine(arrays, static)
        normed = jax.vmap(layer.norm)(h) + off["layers/norm"]
        y = jax.vmap(layer.linear)(normed)
        y = (y if replacement is None else replacement) + off["layers/linear"]
        pairs = y.reshape(TOKENS, WIDTH // 2, 2)
        z = jax.vmap(jax.vmap(layer.mix))(pairs) + off["layers/mix"]
        out = h + jnp.tanh(z.reshape(TOKENS, WIDTH)) + off["layers"]
        return out, {
            "layers/norm": normed,
            "layers/linear": y,
            "layers/mix": z,
            "layers": out,
        }

    h, values = jax.lax.scan(step, x, (dynamic, offsets, patch))
    return jax.vmap(model.head)(h), values


def _zero_offsets(batch=()):
    shapes = {
        "layers": (TOKENS, WIDTH),
        "layers/norm": (TOKENS, WIDTH),
        "layers/linear": (TOKENS, WIDTH),
        "layers/mix": (TOKENS, WIDTH // 2, 2),
    }
    return {name: jnp.zeros((LAYERS, *batch, *s)) for name, s in shapes.items()}


def _batched_by_hand(model, x, offsets, patch=None):
    """`_per_token_by_hand` over the batch, site values `(layers, batch, ...)`
    as the contract lays them out (the batch after the iterations)."""

    def one(x, offsets, patch):
        return _per_token_by_hand(model, x, offsets, patch)

    in_axes = (0, 1, None if patch is None else 1)
    outputs, values = jax.vmap(one, in_axes=in_axes, out_axes=(0, 1))(x, offsets, patch)
    return outputs, values


@pytest.mark.parametrize(
    "mode, vmap, remat",
    [("eager", True, False), ("jit", True, True), ("jit", False, False)],
)
def test_a_vmap_inside_a_scanned_layer_holds_iterations_then_batch_then_tokens(
    mode, vmap, remat
):
    model = PerTokenStack(jax.random.key(0), remat)
    if vmap:
        x = jax.random.normal(jax.random.key(1), (BATCH, TOKENS, WIDTH))
        batch, by_hand = (BATCH,), _batched_by_hand
    else:
        x = jax.random.normal(jax.random.key(1), (TOKENS, WIDTH))
        batch = ()
        by_hand = _per_token_by_hand
    probe = bridge.probe(model, vmap=vmap)
    shapes = {name: s.shape for name, s in probe.sites(x).items()}
    assert shapes == {
        "layers": (LAYERS, *batch, TOKENS, WIDTH),
        "layers/norm": (LAYERS, *batch, TOKENS, WIDTH),
        "layers/linear": (LAYERS, *batch, TOKENS, WIDTH),
        "layers/mix": (LAYERS, *batch, TOKENS, WIDTH // 2, 2),
        "head": (*batch, TOKENS, 2),
    }

    res = _run(
        mode,
        lambda p, x: p.value_and_grad(_mlp_loss, x, with_inputs=True),
        probe,
        x,
    )
    offsets = _zero_offsets(batch)
    outputs, values = by_hand(model, x, offsets)
    _near(res.loss, _mlp_loss(outputs))
    # d loss / d offset, each offset added at its site by hand.
    grads = jax.grad(lambda o: _mlp_loss(by_hand(model, x, o)[0]))(offsets)
    for site in _PER_TOKEN_SITES:
        _near(res.activations[site], values[site])
        _near(res.activation_grads[site], grads[site])
    # One direction by jax.jvp, independent of jax.grad.
    delta = jax.random.normal(jax.random.key(2), offsets["layers/linear"].shape)
    tangent = {**jax.tree.map(jnp.zeros_like, offsets), "layers/linear": delta}
    directional = jax.jvp(
        lambda o: _mlp_loss(by_hand(model, x, o)[0]), (offsets,), (tangent,)
    )[1]
    _near(jnp.vdot(res.activation_grads["layers/linear"], delta), directional)
    # The inputs, laid out like the values: a layer's input is the norm's value.
    (inputs,) = res.inputs["layers/linear"]
    _near(inputs, values["layers/norm"])
    mapped = (lambda m: jax.vmap(m)) if vmap else (lambda m: m)
    expected = eqx.filter_grad(lambda m: _mlp_loss(mapped(m)(x)))(model)
    assert_tree_allclose(res.grads, expected)

    # One site selected, and a patch value in the site's layout.
    replacement = jax.random.normal(jax.random.key(3), shapes["layers/linear"])
    patched = _run(
        mode,
        lambda p, x: p.value_and_grad(
            _mlp_loss, x, at="layers/mix", patch={"layers/linear": replacement}
        ),
        probe,
        x,
    )
    outputs, values = by_hand(model, x, offsets, replacement)
    _near(patched.loss, _mlp_loss(outputs))
    _near(patched.activations["layers/mix"], values["layers/mix"])
    grads = jax.grad(lambda o: _mlp_loss(by_hand(model, x, o, replacement)[0]))(offsets)
    _near(patched.activation_grads["layers/mix"], grads["layers/mix"])


class Heads(eqx.Module):
    """A scanned layer that maps a stack of heads (an ensemble) itself."""

    heads: eqx.nn.Linear

    def __call__(self, x):
        out = jax.vmap(lambda head: head(x))(self.heads)
        return x + jnp.tanh(out.sum(0))


def _stack_of_heads(key, heads=3):
    def make(k):
        make_head = lambda k: eqx.nn.Linear(WIDTH, WIDTH, key=k)  # noqa: E731
        return Heads(eqx.filter_vmap(make_head)(jax.random.split(k, heads)))

    return ScansItsLayers(eqx.filter_vmap(make)(jax.random.split(key, LAYERS)))


def _heads_by_hand(model, x, offset):
    """One example, `offset` (one row per layer) added to the heads' value."""

    def step(h, xs):
        layer, off = xs
        out = jax.vmap(lambda head: head(h))(layer.heads) + off
        return h + jnp.tanh(out.sum(0)), out

    return jax.lax.scan(step, x, (model.layers, offset))


@pytest.mark.parametrize("mode", MODES)
def test_a_stack_of_heads_the_scanned_layer_maps_holds_every_head(mode):
    model = _stack_of_heads(jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (BATCH, WIDTH))
    probe = bridge.probe(model, vmap=True)
    assert probe.sites(x)["layers/heads"].shape == (LAYERS, BATCH, 3, WIDTH)
    res = _run(
        mode,
        lambda p, x: p.value_and_grad(_mlp_loss, x, at="layers/heads"),
        probe,
        x,
    )

    def by_hand(offset):  # the batch after the iterations
        return jax.vmap(
            lambda x, o: _heads_by_hand(model, x, o), in_axes=(0, 1), out_axes=(0, 1)
        )(x, offset)

    offset = jnp.zeros((LAYERS, BATCH, 3, WIDTH))
    _near(res.activations["layers/heads"], by_hand(offset)[1])
    grad = jax.grad(lambda o: _mlp_loss(by_hand(o)[0]))(offset)
    _near(res.activation_grads["layers/heads"], grad)


def _tapped_in(kind: str, h: jax.Array, hand: Callable | None = None) -> jax.Array:
    """`bridge.tap("t", sin(h))` inside a transform of the model's own code:
    `kind` is "checkpoint", "cond", "scan" (two steps of the model's
    `jax.lax.scan`, which bridge counts) or "uncounted_scan" (the same with
    JAX's own scan bound at import, which bridge cannot count).

    `hand(step, value)`, where given, stands for the tap's value at `step`
    of a scan: the tests' references without bridge (the scan then carries
    each step's index as its `xs`)."""

    def tapped(h):
        return bridge.tap("t", jnp.sin(h))

    if kind == "checkpoint":
        return jax.checkpoint(tapped)(h)
    if kind == "cond":
        return jax.lax.cond(jnp.sum(h) > -1e9, tapped, jnp.cos, h)
    scan = _scan(counted=kind == "scan")
    if hand is None:
        return scan(lambda c, _: (tapped(c), None), h, None, length=2)[0]
    return scan(lambda c, i: (hand(i, tapped(c)), None), h, jnp.arange(2))[0]


class TapInTransform(eqx.Module):
    first: eqx.nn.Linear
    last: eqx.nn.Linear
    kind: str = eqx.field(static=True)
    hand: Callable | None = None

    def __call__(self, x):
        return self.last(_tapped_in(self.kind, self.first(x), self.hand))


@pytest.mark.parametrize("mode", MODES)
def test_a_tap_inside_jax_checkpoint_is_a_site(mode):
    """A tap inside the model's own `jax.checkpoint` is read from the
    computation (the body checkpointed again, with its policy): its value,
    and its gradient and `first`'s against offsets added by hand."""
    keys = jax.random.split(jax.random.key(0), 3)
    model = TapInTransform(
        eqx.nn.Linear(3, 4, key=keys[0]), eqx.nn.Linear(4, 2, key=keys[1]), "checkpoint"
    )
    x = jax.random.normal(keys[2], (3, 3))
    probe = bridge.probe(model, vmap=True)
    sites = probe.sites(x)
    assert list(sites) == ["first", "t", "last"]
    assert sites["t"].shape == (3, 4)

    def loss(y):
        return jnp.sum(y**2)

    res = _run(mode, lambda p, x: p.value_and_grad(loss, x), probe, x)

    # The reference, plain JAX: offsets added to `first`'s output and the tap.
    def reference(params, offsets):
        m = eqx.combine(params, eqx.filter(model, eqx.is_array, inverse=True))
        first = jax.vmap(m.first)(x)
        tapped = jnp.sin(first + offsets["first"])
        return loss(jax.vmap(m.last)(tapped + offsets["t"])), (first, tapped)

    params = eqx.filter(model, eqx.is_array)
    zeros = {"first": jnp.zeros((3, 4)), "t": jnp.zeros((3, 4))}
    (value, (first, tapped)), (grads, offset_grads) = jax.value_and_grad(
        reference, argnums=(0, 1), has_aux=True
    )(params, zeros)
    np.testing.assert_allclose(res.loss, value, rtol=1e-6)
    np.testing.assert_allclose(res.activations["first"], first, rtol=1e-6)
    np.testing.assert_allclose(res.activations["t"], tapped, rtol=1e-6)
    for site in ("first", "t"):
        np.testing.assert_allclose(
            res.activation_grads[site], offset_grads[site], rtol=1e-5, atol=1e-6
        )
    assert_tree_allclose(res.grads, grads, rtol=1e-5)


# -- a tap in the model's own jax.lax.scan: a site per iteration ----------------

#: Examples in a batch, and iterations of each scan below.
TAP_BATCH, TAP_STEPS = 5, 2


def _tap_in_stacked_scan(counted: bool = True) -> tuple[eqx.Module, str, Callable]:
    """`TapInScan` (a tap after each of two stacked layers), its site, and
    the tap's value at every iteration without bridge, `(steps, batch,
    ...)`, each layer sliced out of the stack by hand."""
    model = TapInScan(_stacked_linears(jax.random.key(0)), counted=counted)

    def values(x):
        h, out = x, []
        for i in range(TAP_STEPS):
            h = jax.vmap(jax.tree.map(lambda a, i=i: a[i], model.layers))(h)
            out.append(h)
        return jnp.stack(out)

    return model, "h", values


def _tap_in_closed_over_scan(
    counted: bool = True,
) -> tuple[eqx.Module, str, Callable]:
    """`TapInTransform` with a tap the body of a length-2 `jax.lax.scan`
    (no `xs`) closes over, its site, and its values without bridge."""
    keys = jax.random.split(jax.random.key(0), 2)
    model = TapInTransform(
        eqx.nn.Linear(3, 4, key=keys[0]),
        eqx.nn.Linear(4, 2, key=keys[1]),
        "scan" if counted else "uncounted_scan",
    )

    def values(x):
        h, out = jax.vmap(model.first)(x), []
        for _ in range(TAP_STEPS):
            h = jnp.sin(h)
            out.append(h)
        return jnp.stack(out)

    return model, "t", values


def _by_hand(model, x, offsets, patch=None, patch_fn=None):
    """The outputs of `model` on the batch `x` without bridge, the tap's
    value at step `i` of example `n` replaced by `patch[i, n]` (or passed
    through `patch_fn`), then `offsets[n, i]` added, in the model's code."""

    def one(x, offsets, patch):
        def hand(i, value):
            if patch is not None:
                value = patch[i]
            elif patch_fn is not None:
                value = patch_fn(value)
            return value + offsets[i]

        return dataclasses.replace(model, hand=hand)(x)

    rows = None if patch is None else jnp.moveaxis(patch, 1, 0)
    return jax.vmap(one)(x, offsets, rows)


def _twice_cos(v):
    return 2.0 * jnp.cos(v)


@pytest.mark.parametrize(
    "build",
    [
        _tap_in_stacked_scan,
        _tap_in_closed_over_scan,
        functools.partial(_tap_in_stacked_scan, counted=False),
        functools.partial(_tap_in_closed_over_scan, counted=False),
    ],
    ids=[
        "stacked_layers",
        "closed_over",
        "stacked_layers_scan_bound_at_import",
        "closed_over_scan_bound_at_import",
    ],
)
@pytest.mark.parametrize("mode", MODES)
def test_a_tap_in_the_model_scan_is_a_site_per_iteration(mode, build):
    """The model's own `jax.lax.scan`, looked up as it runs or bound at import, is the
    same `scan` in the computation: a tap its body runs is a site per iteration,
    `(steps, batch, ...)`, whose gradients are those of offsets added by hand at
    each step, and which takes a stacked patch value (a row per step) or a patch
    function (applied at every step)."""
    model, site, values = build()
    x = jax.random.normal(jax.random.key(1), (TAP_BATCH, 3))
    probe = bridge.probe(model, vmap=True)
    struct = probe.sites(x)[site]
    width = struct.shape[2:]
    assert struct.shape == (TAP_STEPS, TAP_BATCH, *width)
    zeros = jnp.zeros((TAP_BATCH, TAP_STEPS, *width))

    def hand_grads(**patch):
        """The loss and its gradient with respect to the hand offsets, laid
        out as the site."""
        value, grads = jax.value_and_grad(
            lambda o: _mlp_loss(_by_hand(model, x, o, **patch))
        )(zeros)
        return value, jnp.moveaxis(grads, 1, 0)

    def run(probe, x, patch):
        return probe.value_and_grad(_mlp_loss, x, at=site, patch=patch)

    # Unpatched: each step's value, and each step's own gradient.
    res = _run(mode, lambda p, x: run(p, x, {}), probe, x)
    loss, grads = hand_grads()
    _near(res.loss, loss)
    _near(res.activations[site], values(x))
    _near(res.activation_grads[site], grads)
    plain = eqx.filter_grad(lambda m: _mlp_loss(jax.vmap(m)(x)))(model)
    assert_tree_allclose(eqx.filter(res.grads, eqx.is_array), plain)

    # A stacked patch value: step `i` takes row `i`.
    value = jax.random.normal(jax.random.key(2), struct.shape)
    res = _run(mode, lambda p, x, v: run(p, x, {site: v}), probe, x, value)
    loss, grads = hand_grads(patch=value)
    np.testing.assert_array_equal(res.activations[site], value)
    _near(res.loss, loss)
    _near(res.activation_grads[site], grads)
    forward = _run(
        mode, lambda p, x, v: p.apply(x, at=site, patch={site: v}), probe, x, value
    )
    np.testing.assert_array_equal(forward.activations[site], value)
    _near(forward.outputs, _by_hand(model, x, zeros, patch=value))

    # A patch function, applied at every step.
    res = _run(mode, lambda p, x: run(p, x, {site: _twice_cos}), probe, x)
    loss, grads = hand_grads(patch_fn=_twice_cos)
    _near(res.loss, loss)
    _near(res.activation_grads[site], grads)
    forward = _run(
        mode, lambda p, x: p.apply(x, at=site, patch={site: _twice_cos}), probe, x
    )
    _near(forward.outputs, _by_hand(model, x, zeros, patch_fn=_twice_cos))


@pytest.mark.parametrize("mode", MODES)
def test_a_forward_pass_records_a_tap_and_the_stacked_layers_of_one_scan(mode):
    """`apply` records a tap in the model's own scan over stacked layers (a
    site of the control-flow route) and the scanned layer (a site of the
    tree route) in one run: both leave through one backward pass, as in
    `value_and_grad`. Checked against each step computed by hand (the layer
    sliced out of the stack, the patch applied to its output), unpatched,
    with a stacked patch value on the tap and with a patch function."""
    model, site, values = _tap_in_stacked_scan()
    x = jax.random.normal(jax.random.key(1), (TAP_BATCH, 3))
    probe = bridge.probe(model, vmap=True)

    def by_hand(patch=None, patch_fn=None):
        """`(the layer's output, the tap's value)` at every step, `(steps,
        batch, 3)`, and the outputs, without bridge."""
        h, layer_values, tap_values = x, [], []
        for i in range(TAP_STEPS):
            layer = jax.tree.map(lambda a, i=i: a[i], model.layers)
            out = jax.vmap(layer)(h)
            if patch is not None:
                h = patch[i]
            elif patch_fn is not None:
                h = patch_fn(out)
            else:
                h = out
            layer_values.append(out)
            tap_values.append(h)
        return jnp.stack(layer_values), jnp.stack(tap_values), h

    layer_values, tap_values, outputs = by_hand()
    _near(tap_values, values(x))  # the hand reference is the model's own
    value = jax.random.normal(jax.random.key(2), tap_values.shape)
    cases = [
        ({}, by_hand()),
        ({site: value}, by_hand(patch=value)),
        ({site: jnp.negative}, by_hand(patch_fn=jnp.negative)),
    ]
    for patch, (layer_values, tap_values, outputs) in cases:
        values_of = {"layers": layer_values, site: tap_values}
        stepped = _run(
            mode,
            lambda p, x, patch=patch: p.value_and_grad(_mlp_loss, x, patch=patch),
            probe,
            x,
        )
        for at in (None, ["layers", site]):
            forward = _run(
                mode,
                lambda p, x, at=at, patch=patch: p.apply(x, at=at, patch=patch),
                probe,
                x,
            )
            assert set(forward.activations) == {"layers", site}
            _near(forward.outputs, outputs)
            for name, expected in values_of.items():
                _near(forward.activations[name], expected)
                _near(forward.activations[name], stepped.activations[name])


class CheckpointInScan(eqx.Module):
    """A cell the model's own `jax.lax.scan` closes over, called inside a
    `jax.checkpoint` in the body; `hand` unrolls it with offsets."""

    cell: eqx.nn.Linear

    def __call__(self, xs):
        def body(h, x):
            h = jax.checkpoint(lambda h: jnp.tanh(self.cell(h + x)))(h)
            return h, h

        return jax.lax.scan(body, jnp.zeros(3), xs)[1].sum()

    def hand(self, xs, offsets):
        h, total = jnp.zeros(3), 0.0
        for i in range(xs.shape[0]):
            h = jnp.tanh(self.cell(h + xs[i]) + offsets[i])
            total = total + h.sum()
        return total


@pytest.mark.parametrize("mode", MODES)
def test_a_checkpoint_inside_the_models_scan_is_read_from_the_computation(mode):
    """Once refused: the call in `jax.checkpoint` inside the scan's body is a
    site per step, each step's gradient the hand offset's."""
    model = CheckpointInScan(eqx.nn.Linear(3, 3, key=jax.random.key(0)))
    xs = jnp.linspace(-1.0, 1.0, 12).reshape(4, 3)
    probe = bridge.probe(model)
    assert probe.sites(xs)["cell"].shape == (4, 3)
    res = _run(
        mode, lambda p, xs: p.value_and_grad(jnp.square, xs, at="cell"), probe, xs
    )
    grad = jax.grad(lambda o: model.hand(xs, o) ** 2)(jnp.zeros((4, 3)))
    np.testing.assert_allclose(res.activation_grads["cell"], grad, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(res.loss, model(xs) ** 2, rtol=1e-6)


@pytest.mark.skipif(
    jaxpr_traces_record_their_parent(),
    reason="jax >= 0.6.2 probes it: tests/test_checkpointed_loops.py",
)
@pytest.mark.parametrize("kind", ["checkpointed", "bounded"])
def test_a_site_in_an_equinox_while_loop_names_the_jax_it_needs(kind):
    """Before jax 0.6.2 (the floor), a call inside Equinox's while loop is
    listed and refused, saying which jax reads it; the rest of the model
    probes, with plain JAX's numbers (the bounded kind's: plain JAX does not
    differentiate Equinox 0.11's checkpointed kind on jax 0.4, bridge or
    not)."""
    from test_checkpointed_loops import LOOPS, Relax, inputs, loss_fn

    model, x = Relax(jax.random.key(0), LOOPS[kind]), inputs()
    probe = bridge.probe(model, vmap=True)
    assert "cell" in probe.sites(x)
    with pytest.raises(
        bridge.BridgeValueError,
        match=r"'cell'.*this jax does not record.*upgrade jax: bridge reads the "
        r"transforms around a call from jax 0\.6\.2",
    ):
        probe.value_and_grad(loss_fn, x, at="cell")
    if kind == "checkpointed":
        return
    res = jax.jit(lambda p, x: p.value_and_grad(loss_fn, x, at="head"))(probe, x)
    loss, grads = eqx.filter_value_and_grad(lambda m: loss_fn(jax.vmap(m)(x)))(model)
    np.testing.assert_allclose(res.loss, loss, rtol=1e-6)
    # The head's bias gradient is its output's gradient summed over the batch.
    assert_tree_allclose(res.activation_grads["head"].sum(0), grads.head.bias)
