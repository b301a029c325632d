"""Interventions on Equinox sites inside a `lax.scan` over stacked layers (and
inside `jax.checkpoint`): `patch=` and `with_inputs=True`.

A scanned site holds every iteration, `(iterations, *value shape)`. A patch
value is given in that shape and each iteration takes its row; a patch
function is applied to each iteration's value (under the probe's `vmap=True`,
to the whole batch); the positional inputs are stacked like the values.

The references are the same model unrolled, its layers sliced out of the
stack: patched by bridge at its unrolled sites, and patched by hand, the test
itself swapping each layer for one that returns the patched value, with
gradients from plain `eqx.filter_value_and_grad`.

A layer the scan body closes over (an RNN cell), in the model's own
`jax.lax.scan`, is a site per step too: bridge counts the scan's iterations
while a probe runs. Its references are the same model with the cell's
output at each step changed by hand in the model's code (an offset added, a
patch applied: `ClosedOverCell.hand`), and the steps run in a Python loop.
"""

from __future__ import annotations

from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_tree_allclose
from test_equinox import (
    Checkpointed,
    ClosedOverCell,
    Dense,
    ScannedStack,
    _mlp_loss,
    _unrolled,
)

import bridge

ITERATIONS = 3
X = jax.random.normal(jax.random.key(1), (5, 4))
#: A value for `layers/linear`: one row per iteration, the batch after it.
PATCH = jax.random.normal(jax.random.key(2), (ITERATIONS, 5, 4))
STACKED = ("layers", "layers/linear", "layers/activation")

#: `(mode, vmap, remat)`: eager and jitted, with and without the probe's vmap
#: and `jax.checkpoint` on the scan body, each at least once.
SETTINGS = [
    ("eager", False, False),
    ("jit", False, True),
    ("eager", True, True),
    ("jit", True, False),
]


def _run(mode, fn, *args):
    return (jax.jit(fn) if mode == "jit" else fn)(*args)


def _centred(a):
    """Depends on the whole batch (axis 0 of one iteration's value): under
    vmap=True it is right only if the function sees every example."""
    return a - jnp.mean(a, axis=0, keepdims=True)


class Patched(eqx.Module):
    """A layer whose output the test replaces by hand, plus an epsilon whose
    gradient is the activation gradient there."""

    layer: Callable
    patch: Callable
    epsilon: jax.Array

    def __call__(self, x):
        return self.patch(self.layer(x)) + self.epsilon


def _patched_by_hand(model, epsilons, linear=None, activation=None):
    """`model` unrolled, each layer's `linear` output replaced by its row of
    `linear` and its `activation` output passed through `activation`, with
    the epsilons `{site: (iterations, ...)}` added after the patches."""
    unrolled = _unrolled(model)
    layers = []
    for i, layer in enumerate(unrolled.layers):
        replace_linear = (lambda h: h) if linear is None else (lambda h, i=i: linear[i])
        layer = eqx.tree_at(
            lambda block: (block.linear, block.activation),
            layer,
            (
                Patched(layer.linear, replace_linear, epsilons["layers/linear"][i]),
                Patched(
                    layer.activation,
                    activation or (lambda a: a),
                    epsilons["layers/activation"][i],
                ),
            ),
        )
        layers.append(Patched(layer, lambda h: h, epsilons["layers"][i]))
    return eqx.tree_at(lambda m: m.layers, unrolled, tuple(layers))


def _hand_reference(model, **patches):
    """`(loss, parameter gradients of model, activation gradients of the
    scanned sites stacked, the hand-patched model)`, by plain
    `eqx.filter_value_and_grad` of the model patched by hand."""
    epsilons = {site: jnp.zeros((ITERATIONS, 5, 4)) for site in STACKED}

    def loss(model_and_epsilons):
        hand = _patched_by_hand(*model_and_epsilons, **patches)
        return _mlp_loss(hand(X))

    value, (grads, activation_grads) = eqx.filter_value_and_grad(loss)(
        (model, epsilons)
    )
    return value, grads, activation_grads, _patched_by_hand(model, epsilons, **patches)


def _close_at_scale(actual, expected, rtol=1e-5):
    """Equal at the tensor's own scale: float32 rounding of an element near
    zero is no divergence."""
    scale = float(np.max(np.abs(expected)))
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=rtol * scale)


def _assert_equals_references(res, ref, hand, model):
    """`res`, of the scanned model, against bridge on the unrolled model
    (`ref`) and against the model patched by hand (`hand`)."""
    hand_loss, hand_grads, hand_activation_grads, hand_model = hand
    np.testing.assert_allclose(res.loss, hand_loss, rtol=1e-5)
    np.testing.assert_allclose(res.loss, ref.loss, rtol=1e-5)
    assert_tree_allclose(res.grads, hand_grads)
    for site in STACKED:
        np.testing.assert_allclose(
            res.activation_grads[site],
            hand_activation_grads[site],
            rtol=1e-5,
            atol=1e-7,
        )
        for i in range(ITERATIONS):
            unrolled_site = site.replace("layers", f"layers/{i}", 1)
            for field in ("activations", "activation_grads"):
                np.testing.assert_allclose(
                    getattr(res, field)[site][i],
                    getattr(ref, field)[unrolled_site],
                    rtol=1e-5,
                    atol=1e-7,
                )
            assert_tree_allclose(res.inputs[site][0][i], ref.inputs[unrolled_site][0])
    # The inputs, by hand: each layer's input is the previous one's output, the
    # activation's input the (patched) linear output.
    h = model.embed(X)
    for i, layer in enumerate(hand_model.layers):
        _close_at_scale(res.inputs["layers"][0][i], h)
        _close_at_scale(res.inputs["layers/linear"][0][i], h)
        linear_output = layer.layer.linear(h)
        _close_at_scale(res.inputs["layers/activation"][0][i], linear_output)
        _close_at_scale(res.activations["layers/linear"][i], linear_output)
        h = layer(h)
    for site in ("embed", "head"):
        np.testing.assert_allclose(
            res.activation_grads[site], ref.activation_grads[site], rtol=1e-5, atol=1e-7
        )


@pytest.mark.parametrize("mode, vmap, remat", SETTINGS)
def test_a_stacked_patch_value_gives_each_iteration_its_row(mode, vmap, remat):
    model = ScannedStack(jax.random.key(0), remat)
    scanned = bridge.probe(model, vmap=vmap)
    unrolled = bridge.probe(_unrolled(model), vmap=vmap)
    unrolled_patch = {f"layers/{i}/linear": PATCH[i] for i in range(ITERATIONS)}

    def run(probe, patch):
        return probe.value_and_grad(_mlp_loss, X, patch=patch, with_inputs=True)

    res = _run(mode, run, scanned, {"layers/linear": PATCH})
    ref = _run(mode, run, unrolled, unrolled_patch)
    # Recorded activations are the patched values.
    np.testing.assert_array_equal(res.activations["layers/linear"], PATCH)
    hand = _hand_reference(model, linear=PATCH)
    _assert_equals_references(res, ref, hand, model)

    # The forward pass alone.
    forward = _run(
        mode,
        lambda p: p.apply(X, at="layers/activation", patch={"layers/linear": PATCH}),
        scanned,
    )
    *_, hand_model = hand
    np.testing.assert_allclose(forward.outputs, hand_model(X), rtol=1e-5)
    np.testing.assert_allclose(
        forward.activations["layers/activation"],
        jnp.tanh(PATCH),
        rtol=1e-5,
    )


@pytest.mark.parametrize("mode, vmap, remat", SETTINGS)
def test_a_patch_function_is_applied_to_each_iteration(mode, vmap, remat):
    model = ScannedStack(jax.random.key(0), remat)
    scanned = bridge.probe(model, vmap=vmap)
    unrolled = bridge.probe(_unrolled(model), vmap=vmap)

    def patched_at(pattern):
        def run(probe):
            return probe.value_and_grad(
                _mlp_loss, X, patch={pattern: _centred}, with_inputs=True
            )

        return run

    res = _run(mode, patched_at("layers/activation"), scanned)
    ref = _run(mode, patched_at("layers/*/activation"), unrolled)
    hand = _hand_reference(model, activation=_centred)
    _assert_equals_references(res, ref, hand, model)
    # Each iteration's patched value, centred over the whole batch even where
    # the probe's vmap gives the model one example.
    np.testing.assert_allclose(
        res.activations["layers/activation"],
        jax.vmap(_centred)(jnp.tanh(res.activations["layers/linear"])),
        rtol=1e-5,
        atol=1e-6,
    )


@pytest.mark.parametrize("mode, vmap", [("eager", False), ("jit", True)])
def test_a_patched_site_outside_the_selection_is_patched_too(mode, vmap):
    model = ScannedStack(jax.random.key(0), remat=True)
    probe = bridge.probe(model, vmap=vmap)
    res = _run(
        mode,
        lambda p: p.value_and_grad(
            _mlp_loss, X, at="head", patch={"layers/linear": PATCH}
        ),
        probe,
    )
    hand_loss, hand_grads, _, hand_model = _hand_reference(model, linear=PATCH)
    assert list(res.activations) == ["head"]
    np.testing.assert_allclose(res.loss, hand_loss, rtol=1e-5)
    assert_tree_allclose(res.grads, hand_grads)
    forward = _run(
        mode, lambda p: p.apply(X, at="embed", patch={"layers/linear": PATCH}), probe
    )
    np.testing.assert_allclose(forward.outputs, hand_model(X), rtol=1e-5)


class GatedBlock(eqx.Module):
    """Takes integer, boolean and random-key inputs besides the hidden state."""

    linear: Dense

    def __call__(self, h, mask, position, key):
        noise = 0.01 * jax.random.normal(key, h.shape)
        return jnp.where(mask, self.linear(h), h) + 1e-6 * position + noise


class GatedStack(eqx.Module):
    layers: GatedBlock

    def __init__(self, key):
        self.layers = eqx.filter_vmap(lambda k: GatedBlock(Dense(4, k)))(
            jax.random.split(key, ITERATIONS)
        )

    def __call__(self, x, masks, positions, keys):
        dynamic, static = eqx.partition(self.layers, eqx.is_array)

        def step(h, xs):
            arrays, mask, position, key = xs
            return eqx.combine(arrays, static)(h, mask, position, key), None

        return jax.lax.scan(step, x, (dynamic, masks, positions, keys))[0]


@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_inputs_that_are_not_floats_come_back_exactly(mode):
    model = GatedStack(jax.random.key(0))
    masks = jax.random.bernoulli(jax.random.key(3), 0.5, (ITERATIONS, 5, 4))
    # Beyond float32's exact integers, negative, and wider than 16 bits.
    positions = jnp.array([2**24 + 1, -3, 70000], jnp.int32)
    keys = jax.random.split(jax.random.key(4), ITERATIONS)
    res = _run(
        mode,
        lambda p, *args: p.value_and_grad(_mlp_loss, *args, with_inputs=True),
        bridge.probe(model),
        X,
        masks,
        positions,
        keys,
    )
    hidden, recorded_masks, recorded_positions, recorded_keys = res.inputs["layers"]
    assert recorded_masks.dtype == jnp.bool_
    np.testing.assert_array_equal(recorded_masks, masks)
    assert recorded_positions.dtype == jnp.int32
    np.testing.assert_array_equal(recorded_positions, positions)
    assert recorded_keys.dtype == keys.dtype
    np.testing.assert_array_equal(
        jax.random.key_data(recorded_keys), jax.random.key_data(keys)
    )
    # The hidden states, by hand.
    h = X
    for i in range(ITERATIONS):
        layer = jax.tree.map(lambda a, i=i: a[i], model.layers)
        np.testing.assert_allclose(hidden[i], h, rtol=1e-5)
        np.testing.assert_allclose(res.inputs["layers/linear"][0][i], h, rtol=1e-5)
        h = layer(h, masks[i], positions[i], keys[i])
    np.testing.assert_allclose(res.loss, _mlp_loss(h), rtol=1e-5)


@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_a_site_inside_checkpoint_takes_patches_and_records_inputs(mode):
    keys = jax.random.split(jax.random.key(0), 2)
    inner, outer = eqx.nn.Linear(4, 4, key=keys[0]), eqx.nn.Linear(4, 2, key=keys[1])
    value = jax.random.normal(jax.random.key(2), (5, 4))
    checkpointed = bridge.probe(Checkpointed(inner, outer, True), vmap=True)

    def run(probe, value):
        patch = {"inner": value, "outer": _centred}
        return probe.value_and_grad(_mlp_loss, X, patch=patch, with_inputs=True)

    res = _run(mode, run, checkpointed, value)
    np.testing.assert_array_equal(res.activations["inner"], value)
    np.testing.assert_array_equal(res.inputs["inner"][0], X)
    np.testing.assert_allclose(res.inputs["outer"][0], value)

    def by_hand(outer_and_epsilon):
        outer, epsilon = outer_and_epsilon
        return _mlp_loss(_centred(jax.vmap(outer)(value)) + epsilon)

    loss, (outer_grads, outer_activation_grads) = eqx.filter_value_and_grad(by_hand)(
        (outer, jnp.zeros((5, 2)))
    )
    np.testing.assert_allclose(res.loss, loss, rtol=1e-5)
    assert_tree_allclose(res.grads.outer, outer_grads)
    np.testing.assert_allclose(
        res.activation_grads["outer"], outer_activation_grads, rtol=1e-5
    )
    # The patched-away layer's parameters get no gradient.
    assert not any(jnp.any(g) for g in jax.tree.leaves(res.grads.inner))


@pytest.mark.parametrize("vmap", [False, True])
def test_a_patch_of_the_wrong_shape_names_the_site_and_its_stacked_shape(vmap):
    probe = bridge.probe(ScannedStack(jax.random.key(0)), vmap=vmap)
    with pytest.raises(
        ValueError,
        match=r"patch for site 'layers/linear' does not fit: the site's value has "
        r"\(shape, dtype\) \(\(3, 5, 4\), dtype\('float32'\)\), the patch has "
        r"\(\(5, 4\)",
    ):
        probe.value_and_grad(_mlp_loss, X, patch={"layers/linear": PATCH[0]})
    # A patch function sees one iteration; it is checked where it is applied.
    with pytest.raises(
        ValueError, match=r"patch for site 'layers/activation' does not fit"
    ):
        probe.apply(X, patch={"layers/activation": lambda a: a[..., :2]})


class RecurrentThenHead(eqx.Module):
    recurrent: ClosedOverCell
    head: eqx.nn.Linear

    def __call__(self, xs):
        return self.head(self.recurrent(xs))


STEPS = 4
BATCH = 5
CELL = "recurrent/cell"


def _recurrent(counted=True):
    keys = jax.random.split(jax.random.key(0), 2)
    return RecurrentThenHead(
        ClosedOverCell(eqx.nn.Linear(3, 3, key=keys[0]), counted=counted),
        eqx.nn.Linear(3, 2, key=keys[1]),
    )


def _sequences(vmap):
    """One sequence `(steps, 3)`, or a batch of them under the probe's vmap."""
    shape = (BATCH, STEPS, 3) if vmap else (STEPS, 3)
    return jax.random.normal(jax.random.key(1), shape)


def _centred_over_the_batch(a):
    """`_centred` of one example's share of a batch: the batch is the
    `jax.vmap` named "batch" that `_by_hand` runs."""
    return a - jax.lax.pmean(a, "batch")


def _by_hand(model, xs, offsets, patch=None, patch_fn=None, vmap=False):
    """Without bridge: the cell's output at step `i` replaced by `patch[i]`
    (or passed through `patch_fn`: under vmap, one example's), then
    `offsets[i]` added, in the model's code (`ClosedOverCell.hand`). Returns
    the model's outputs, and the cell's inputs and outputs at every step
    from a Python loop over the steps (steps first, as the site)."""

    def one(xs, offsets, patch):
        def hand(i, out):
            if patch is not None:
                out = patch[i]
            elif patch_fn is not None:
                out = patch_fn(out)
            return out + offsets[i]

        cell = model.recurrent.cell
        h, inputs, outputs = xs[0], [], []
        for i in range(STEPS):
            inputs.append(h + xs[i])
            h = hand(i, cell(inputs[-1]))
            outputs.append(h)
        hand_model = RecurrentThenHead(ClosedOverCell(cell, hand), model.head)
        return hand_model(xs), jnp.stack(inputs), jnp.stack(outputs)

    if not vmap:
        return one(xs, offsets, patch)
    rows = None if patch is None else jnp.moveaxis(patch, 1, 0)
    outputs, inputs, values = jax.vmap(one, axis_name="batch")(xs, offsets, rows)
    return outputs, jnp.moveaxis(inputs, 1, 0), jnp.moveaxis(values, 1, 0)


def _hand_grads(model, xs, vmap, **patch):
    """`(loss, parameter gradients, the cell's output gradient at every
    step)`, by plain `eqx.filter_value_and_grad` with respect to the model
    and offsets added by hand at each step."""
    offsets = jnp.zeros(xs.shape[:-1] + (3,))

    def loss(model_and_offsets):
        model, offsets = model_and_offsets
        return _mlp_loss(_by_hand(model, xs, offsets, vmap=vmap, **patch)[0])

    value, (grads, offset_grads) = eqx.filter_value_and_grad(loss)((model, offsets))
    return value, grads, jnp.moveaxis(offset_grads, 1, 0) if vmap else offset_grads


CLOSED_OVER_SETTINGS = [
    ("eager", False),
    ("jit", False),
    ("eager", True),
    ("jit", True),
]


#: The model's own `jax.lax.scan` (counted while a probe runs), or JAX's
#: scan bound at import (read from the computation): the same site.
SCANS = pytest.mark.parametrize("counted", [True, False], ids=["counted", "imported"])


@SCANS
@pytest.mark.parametrize("mode, vmap", CLOSED_OVER_SETTINGS)
def test_a_layer_closed_over_by_the_scan_body_is_a_site_per_step(mode, vmap, counted):
    """Each step's value and input are the cell's at that step, each step's
    gradient that of an offset added at that step by hand."""
    model = _recurrent(counted=counted)
    xs = _sequences(vmap)
    probe = bridge.probe(model, vmap=vmap)
    batch = (BATCH,) if vmap else ()
    assert probe.sites(xs)[CELL].shape == (STEPS, *batch, 3)
    res = _run(
        mode, lambda p, xs: p.value_and_grad(_mlp_loss, xs, with_inputs=True), probe, xs
    )
    zeros = jnp.zeros(xs.shape)
    outputs, inputs, values = _by_hand(model, xs, zeros, vmap=vmap)
    loss, grads, cell_grads = _hand_grads(model, xs, vmap)
    np.testing.assert_allclose(res.loss, loss, rtol=1e-5)
    assert_tree_allclose(res.grads, grads)
    np.testing.assert_allclose(res.activations[CELL], values, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(res.inputs[CELL][0], inputs, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(
        res.activation_grads[CELL], cell_grads, rtol=1e-5, atol=1e-7
    )
    # Outside the scan: the last step's output, into the head.
    np.testing.assert_allclose(res.activations["recurrent"], values[-1], rtol=1e-5)
    np.testing.assert_allclose(res.inputs["head"][0], values[-1], rtol=1e-5)
    np.testing.assert_allclose(res.activations["head"], outputs, rtol=1e-5)
    np.testing.assert_allclose(
        res.activation_grads["recurrent"], cell_grads[-1], rtol=1e-5, atol=1e-7
    )


@SCANS
@pytest.mark.parametrize("how", ["value", "function"])
@pytest.mark.parametrize("mode, vmap", CLOSED_OVER_SETTINGS)
def test_a_layer_closed_over_by_the_scan_body_takes_a_patch_per_step(
    mode, vmap, how, counted
):
    """A stacked value gives each step its row; a function is applied at
    each step (under the probe's vmap, to the whole batch); selected or not,
    with gradients and inputs after the patch."""
    model = _recurrent(counted=counted)
    xs = _sequences(vmap)
    probe = bridge.probe(model, vmap=vmap)
    batch = (BATCH,) if vmap else ()
    if how == "value":
        patch = jax.random.normal(jax.random.key(2), (STEPS, *batch, 3))
        by_hand = {"patch": patch}
    else:
        patch = _centred
        by_hand = {"patch_fn": _centred_over_the_batch if vmap else _centred}

    res = _run(
        mode,
        lambda p, xs: p.value_and_grad(
            _mlp_loss, xs, patch={CELL: patch}, with_inputs=True
        ),
        probe,
        xs,
    )
    zeros = jnp.zeros(xs.shape)
    outputs, inputs, values = _by_hand(model, xs, zeros, vmap=vmap, **by_hand)
    loss, grads, cell_grads = _hand_grads(model, xs, vmap, **by_hand)
    np.testing.assert_allclose(res.loss, loss, rtol=1e-5)
    assert_tree_allclose(res.grads, grads)
    np.testing.assert_allclose(res.activations[CELL], values, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(res.inputs[CELL][0], inputs, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(
        res.activation_grads[CELL], cell_grads, rtol=1e-5, atol=1e-7
    )
    np.testing.assert_allclose(res.activations["head"], outputs, rtol=1e-5)
    if how == "value":
        np.testing.assert_array_equal(res.activations[CELL], patch)
        # The cell's output is replaced at every step: its parameters do
        # not reach the loss.
        assert not any(jnp.any(g) for g in jax.tree.leaves(res.grads.recurrent))
    else:
        # Each step's patched value, centred over the whole batch even where
        # the probe's vmap gives the model one example.
        cell = jax.vmap(model.recurrent.cell) if vmap else model.recurrent.cell
        np.testing.assert_allclose(
            res.activations[CELL],
            jax.vmap(lambda h: _centred(cell(h)))(res.inputs[CELL][0]),
            rtol=1e-5,
            atol=1e-6,
        )

    # Patched outside the selection, in the forward pass alone.
    forward = _run(
        mode, lambda p, xs: p.apply(xs, at="head", patch={CELL: patch}), probe, xs
    )
    assert list(forward.activations) == ["head"]
    np.testing.assert_allclose(forward.outputs, outputs, rtol=1e-5)


@pytest.mark.parametrize("mode, remat", [("eager", False), ("jit", True)])
def test_a_patch_value_downstream_leaves_the_values_upstream_as_they_are(mode, remat):
    # Values inside the scan leave through the backward pass of the outputs,
    # which a patch value downstream cuts: the head's (outside the scan), and
    # each iteration's activation (inside it, after the linear layer).
    model = ScannedStack(jax.random.key(0), remat)
    probe = bridge.probe(model)
    head = jnp.zeros((5, 2))
    activation = jax.random.normal(jax.random.key(4), (ITERATIONS, 5, 4))
    res = _run(
        mode,
        lambda p, x: p.value_and_grad(
            _mlp_loss,
            x,
            at=list(STACKED),
            patch={"head": head, "layers/activation": activation},
        ),
        probe,
        X,
    )
    np.testing.assert_allclose(res.loss, _mlp_loss(head), rtol=1e-5)
    # By hand: each layer's output is its input plus its row of `activation`.
    h = model.embed(X)
    for i, layer in enumerate(_unrolled(model).layers):
        np.testing.assert_allclose(
            res.activations["layers/linear"][i], layer.linear(h), rtol=1e-5
        )
        np.testing.assert_array_equal(
            res.activations["layers/activation"][i], activation[i]
        )
        h = h + activation[i]
        np.testing.assert_allclose(res.activations["layers"][i], h, rtol=1e-5)
    # Nothing upstream of the head's patch reaches the loss.
    for site in STACKED:
        np.testing.assert_array_equal(res.activation_grads[site], 0.0)
