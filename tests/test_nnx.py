"""Flax NNX behaviour beyond the conformance suite.

Above all: the module passed in is left exactly as it was — its state, its
RNG counts, its graph and its classes — and the RNG streams, BatchNorm
statistics and parameter gradients agree with plain NNX on a clone.
"""

from __future__ import annotations

import contextlib
import inspect
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    assert_tree_allclose,
    assert_tree_equal,
    nnx_supported,
)

if not nnx_supported():
    pytest.skip(
        "bridge supports NNX from flax 0.12 (tests/test_core.py checks the error)",
        allow_module_level=True,
    )

from cases.nnx import _build, _inputs, added_at_call, snapshot  # noqa: E402
from flax import nnx  # noqa: E402

# JAX's own scan, bound before any probe runs: a probe counts the iterations
# of the `jax.lax.scan` the model looks up as it runs (a site in its body is
# one per iteration), never of this one, whose sites stay refused.
from jax.lax import scan as uncounted_scan  # noqa: E402

import bridge  # noqa: E402


def loss_fn(y):
    return jnp.mean(jnp.square(y - 0.5))


class TrainNet(nnx.Module):
    """BatchNorm in training mode, dropout from a stream stored in the model."""

    def __init__(self, rngs):
        self.linear = nnx.Linear(4, 6, rngs=rngs)
        self.norm = nnx.BatchNorm(6, use_running_average=False, rngs=rngs)
        self.dropout = nnx.Dropout(0.5, rngs=rngs)
        self.head = nnx.Linear(6, 2, rngs=rngs)

    def __call__(self, x):
        return self.head(self.dropout(nnx.relu(self.norm(self.linear(x)))))


@pytest.fixture(scope="module")
def train_net():
    return _build(TrainNet)


X = _inputs(8, 4)
#: `nnx.iter_modules` since flax 0.12.1; the method of the same walk in 0.12.0.
iter_modules = getattr(nnx, "iter_modules", None) or nnx.Module.iter_modules


def plain_step(model, x):
    """What NNX users write without bridge: `nnx.grad` on the module itself."""
    return nnx.value_and_grad(lambda m: loss_fn(m(x)))(model)


def probe_step(probe, x):
    return probe.value_and_grad(loss_fn, x)


def keys_as_data(state):
    return jax.tree.map(
        lambda x: (
            jax.random.key_data(x)
            if jnp.issubdtype(x.dtype, jax.dtypes.prng_key)
            else x
        ),
        state,
    )


@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_the_module_passed_in_is_left_exactly_as_it_was(train_net, mode):
    before = snapshot(train_net)
    classes = {path: type(m) for path, m in iter_modules(train_net)}
    probe = bridge.probe(train_net)
    step = jax.jit(probe_step) if mode == "jit" else probe_step
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        probe.sites(X)
        step(probe, X)
        probe.apply(X)
    assert not caught, [str(w.message) for w in caught]
    assert_tree_equal(snapshot(train_net), before)  # values, RNG counts, graph
    assert {path: type(m) for path, m in iter_modules(train_net)} == classes
    assert not jax.tree.leaves(
        nnx.state(train_net, nnx.Any(nnx.Perturbation, nnx.Intermediate))
    )
    assert not any(hasattr(m, "__captures__") for _, m in iter_modules(train_net))


@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_loss_grads_and_state_equal_plain_nnx_on_a_clone(train_net, mode):
    step = jax.jit(probe_step) if mode == "jit" else probe_step
    res = step(bridge.probe(train_net), X)
    clone = nnx.clone(train_net)
    loss, grads = plain_step(clone, X)
    np.testing.assert_allclose(res.loss, loss, rtol=1e-5)
    assert_tree_allclose(res.grads, grads)
    # `res.state` is the clone's non-Param state after its call: updated batch
    # statistics, and the dropout stream's count advanced by one.
    assert_tree_allclose(
        keys_as_data(res.state), keys_as_data(nnx.state(clone, nnx.Not(nnx.Param)))
    )
    assert res.state["dropout"]["rngs"]["count"][...] == 1
    assert train_net.dropout.rngs.count[...] == 0


def test_nnx_update_with_the_state_makes_the_next_step_a_plain_second_step(train_net):
    """A probe draws the mask the model's next plain call would; updating the
    model with `res.state` moves both on to the next mask together."""
    model, plain = nnx.clone(train_net), nnx.clone(train_net)
    first = bridge.probe(model).value_and_grad(loss_fn, X)
    assert bridge.probe(model).value_and_grad(loss_fn, X).loss == first.loss
    plain_step(plain, X)
    nnx.update(model, first.state)
    assert_tree_equal(keys_as_data(nnx.state(model)), keys_as_data(nnx.state(plain)))
    second = bridge.probe(model).value_and_grad(loss_fn, X)
    loss, grads = plain_step(plain, X)
    np.testing.assert_allclose(second.loss, loss, rtol=1e-5)
    assert_tree_allclose(second.grads, grads)
    assert second.loss != first.loss


def test_nnx_jit_works_around_the_probe_and_around_the_module(train_net):
    probe = bridge.probe(train_net)
    expected = probe_step(probe, X)

    @nnx.jit
    def step_on_module(model, x):
        return bridge.probe(model).value_and_grad(loss_fn, x)

    for res in (nnx.jit(probe_step)(probe, X), step_on_module(train_net, X)):
        np.testing.assert_allclose(res.loss, expected.loss, rtol=1e-5)
        assert_tree_allclose(res.grads, expected.grads)
        assert_tree_allclose(res.activation_grads, expected.activation_grads)
    assert train_net.dropout.rngs.count[...] == 0


def test_jit_traces_once_for_every_probe_of_the_same_architecture():
    traces = []

    @jax.jit
    def step(probe, x):
        traces.append(None)
        return probe.value_and_grad(loss_fn, x).loss

    first = _build(TwoLayer)
    second = _build(TwoLayer)
    nnx.update(second, jax.tree.map(lambda p: p * 2.0, nnx.state(second, nnx.Param)))
    losses = [step(bridge.probe(model), X) for model in (first, second)]
    assert len(traces) == 1
    for model, loss in zip((first, second), losses, strict=True):
        np.testing.assert_allclose(loss, loss_fn(model(X)), rtol=1e-5)


def test_the_probe_is_a_snapshot_of_the_module():
    model = _build(TwoLayer)
    probe = bridge.probe(model)
    before = probe.apply(X).outputs
    nnx.update(model, jax.tree.map(jnp.zeros_like, nnx.state(model, nnx.Param)))
    np.testing.assert_array_equal(probe.apply(X).outputs, before)
    np.testing.assert_array_equal(bridge.probe(model).apply(X).outputs, 0.0)


class TwoLayer(nnx.Module):
    def __init__(self, rngs):
        self.linear = nnx.Linear(4, 6, rngs=rngs)
        self.head = nnx.Linear(6, 2, rngs=rngs)

    def __call__(self, x):
        return self.head(nnx.relu(self.linear(x)))


class Aliased(nnx.Module):
    """One module under two attribute paths, called through both."""

    def __init__(self, rngs):
        self.first = nnx.Linear(4, 4, rngs=rngs)
        self.second = self.first

    def __call__(self, x):
        return self.second(nnx.tanh(self.first(x)))


def test_a_module_under_two_paths_is_named_as_nnx_state_keys_it():
    model = _build(Aliased)
    assert list(nnx.state(model, nnx.Param)) == ["first"]
    probe = bridge.probe(model)
    assert list(probe.sites(X)) == ["first", "first#1"]
    res = probe.value_and_grad(loss_fn, X)
    for site, grad in res.activation_grads.items():
        delta = jnp.ones_like(grad)

        def perturbed(t, site=site, delta=delta):
            clone = nnx.clone(model)
            with added_at_call(clone, site, t * delta):
                return loss_fn(clone(X))

        _, directional = jax.jvp(perturbed, (0.0,), (1.0,))
        np.testing.assert_allclose(jnp.vdot(grad, delta), directional, rtol=2e-4)


def test_an_rngs_passed_to_the_call_is_copied_not_advanced():
    class CallRngs(nnx.Module):
        def __init__(self, rngs):
            self.linear = nnx.Linear(4, 6, rngs=rngs)
            self.dropout = nnx.Dropout(0.5)

        def __call__(self, x, *, rngs):
            return self.dropout(self.linear(x), rngs=rngs)

    probe = bridge.probe(_build(CallRngs))
    rngs = nnx.Rngs(dropout=3)
    eager = probe.value_and_grad(loss_fn, X, rngs=rngs)
    jitted = jax.jit(lambda p, x: p.value_and_grad(loss_fn, x, rngs=rngs))(probe, X)
    assert rngs.dropout.count[...] == 0
    np.testing.assert_allclose(jitted.loss, eager.loss, rtol=1e-5)
    assert eager.state is None  # the model itself holds no RNG stream


class Tapped(nnx.Module):
    def __init__(self, rngs):
        self.block = TappedBlock(rngs)

    def __call__(self, x):
        return self.block(x)


class TappedBlock(nnx.Module):
    def __init__(self, rngs):
        self.linear = nnx.Linear(4, 3, rngs=rngs)

    def __call__(self, x):
        return nnx.relu(bridge.tap("pre", self.linear(x)))


@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_a_tap_is_a_site_under_its_module_path(mode):
    probe = bridge.probe(_build(Tapped))
    assert list(probe.sites(X)) == ["block", "block/linear", "block/pre"]
    step = jax.jit(probe_step) if mode == "jit" else probe_step
    res = step(probe, X)
    # The tap is the linear's output: same value, same gradient.
    assert_tree_allclose(res.activations["block/pre"], res.activations["block/linear"])
    assert_tree_allclose(
        res.activation_grads["block/pre"], res.activation_grads["block/linear"]
    )


def test_patch_and_inputs():
    model = _build(TwoLayer)
    probe = bridge.probe(model)
    fwd = probe.apply(X, patch={"linear": jnp.zeros_like})
    np.testing.assert_allclose(
        fwd.outputs, jnp.broadcast_to(model.head.bias[...], (8, 2)), rtol=1e-5
    )
    res = probe.value_and_grad(loss_fn, X, with_inputs=True)
    (head_input,) = res.inputs["head"]
    assert_tree_allclose(head_input, nnx.relu(res.activations["linear"]))
    assert_tree_allclose(res.inputs["linear"], (X,))


def test_selection_by_class_sees_the_module_classes():
    model = nnx.MultiHeadAttention(
        num_heads=2, in_features=8, qkv_features=8, decode=False, rngs=nnx.Rngs(0)
    )
    tokens = _inputs(2, 5, 8)
    res = bridge.probe(model).apply(tokens, at=nnx.LinearGeneral)
    assert list(res.activations) == ["query", "key", "value", "out"]


def test_vmap_gives_the_batched_numbers_for_a_per_example_loss():
    probe = bridge.probe(_build(TwoLayer))
    per_example = bridge.probe(_build(TwoLayer), vmap=True)
    sum_loss = lambda y: jnp.sum(jnp.square(y - 0.5))  # noqa: E731
    batched = probe.value_and_grad(sum_loss, X)
    mapped = per_example.value_and_grad(sum_loss, X)
    assert_tree_allclose(mapped.activation_grads, batched.activation_grads)
    assert_tree_allclose(mapped.activations, batched.activations)


def test_sequential_and_non_pytree_modules():
    class Plain(nnx.Module, pytree=False):
        def __init__(self, rngs):
            self.layers = [nnx.Linear(4, 4, rngs=rngs), nnx.Linear(4, 2, rngs=rngs)]

        def __call__(self, x):
            return self.layers[1](self.layers[0](x))

    seq = nnx.Sequential(
        nnx.Linear(4, 4, rngs=nnx.Rngs(0)), nnx.relu, Plain(nnx.Rngs(1))
    )
    probe = bridge.probe(seq)
    assert list(probe.sites(X)) == [
        "layers/0",
        "layers/2",
        "layers/2/layers/0",
        "layers/2/layers/1",
    ]
    res = probe.value_and_grad(loss_fn, X)
    loss, grads = plain_step(nnx.clone(seq), X)
    np.testing.assert_allclose(res.loss, loss, rtol=1e-5)
    assert_tree_allclose(res.grads, grads)


# -- NNX transforms in the model's own code ------------------------------------


class StackBlock(nnx.Module):
    def __init__(self, rngs):
        self.linear = nnx.Linear(4, 4, rngs=rngs)
        self.norm = nnx.LayerNorm(4, rngs=rngs)

    def __call__(self, x):
        return x + nnx.tanh(self.norm(self.linear(x)))


class ScannedStack(nnx.Module):
    """The standard NNX pattern: layers built with nnx.vmap, run with nnx.scan."""

    remat = False

    def __init__(self, rngs):
        @nnx.split_rngs(splits=3)
        @nnx.vmap(in_axes=0, out_axes=0)
        def create(rngs):
            return StackBlock(rngs)

        self.embed = nnx.Linear(3, 4, rngs=rngs)
        self.blocks = create(rngs)
        self.head = nnx.Linear(4, 2, rngs=rngs)

    def __call__(self, x):
        def forward(x, block):
            return block(x)

        if self.remat:
            forward = nnx.remat(forward)
        forward = nnx.scan(forward, in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        return self.head(forward(self.embed(x), self.blocks))


class RematScannedStack(ScannedStack):
    """The same, each layer rematerialised: `nnx.remat` inside `nnx.scan`."""

    remat = True


class UnrolledStack(nnx.Module):
    def __init__(self, rngs):
        self.embed = nnx.Linear(3, 4, rngs=rngs)
        self.blocks = nnx.List([StackBlock(rngs) for _ in range(3)])
        self.head = nnx.Linear(4, 2, rngs=rngs)

    def __call__(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def unrolled_like(scanned):
    """An `UnrolledStack` holding the scanned model's weights, layer by layer."""
    unrolled = nnx.clone(_build(UnrolledStack))
    nnx.update(unrolled.embed, nnx.state(scanned.embed))
    nnx.update(unrolled.head, nnx.state(scanned.head))
    stacked = nnx.state(scanned.blocks)
    for i, block in enumerate(unrolled.blocks):
        nnx.update(block, jax.tree.map(lambda a, i=i: a[i], stacked))
    return unrolled


STACK_X = _inputs(5, 3)
STACKED_SITES = ("blocks", "blocks/linear", "blocks/norm")


@pytest.mark.parametrize(
    "builder, mode",
    [(ScannedStack, "eager"), (ScannedStack, "jit"), (RematScannedStack, "jit")],
)
def test_a_scanned_site_stacks_iterations_and_equals_the_unrolled_model(builder, mode):
    model = _build(builder)
    before = snapshot(model)
    scanned, unrolled = bridge.probe(model), bridge.probe(unrolled_like(model))
    sites = scanned.sites(STACK_X)
    assert list(sites) == ["embed", *STACKED_SITES, "head"]
    assert sites["blocks/linear"].shape == (3, 5, 4)

    def run(probe, x):
        return probe.value_and_grad(loss_fn, x, with_inputs=True)

    if mode == "jit":
        run = jax.jit(run)
    res, ref = run(scanned, STACK_X), run(unrolled, STACK_X)
    np.testing.assert_allclose(res.loss, ref.loss, rtol=1e-5)
    for field in ("activations", "activation_grads", "inputs"):
        for site in ("embed", "head"):
            assert_tree_allclose(getattr(res, field)[site], getattr(ref, field)[site])
        for site in STACKED_SITES:
            layer = site.replace("blocks", "blocks/{}")
            for i in range(3):
                assert_tree_allclose(
                    jax.tree.map(lambda a, i=i: a[i], getattr(res, field)[site]),
                    getattr(ref, field)[layer.format(i)],
                )
    _, plain = plain_step(nnx.clone(model), STACK_X)
    assert_tree_allclose(res.grads, plain)
    assert res.state is None
    assert_tree_equal(snapshot(model), before)
    for _, module in iter_modules(model):  # the user's classes, unmarked
        assert not hasattr(type(module), "_bridge_reports")
        assert not hasattr(module, "_bridge_path")


def test_a_scanned_site_gradient_is_the_directional_derivative_of_each_layer():
    model = _build(ScannedStack)
    res = bridge.probe(model).value_and_grad(loss_fn, STACK_X, at="blocks/linear")
    deltas = jax.random.normal(jax.random.key(0), (3, 5, 4))
    unrolled = unrolled_like(model)

    @jax.jit
    def perturbed(t):
        clone = nnx.clone(unrolled)
        with contextlib.ExitStack() as stack:
            for i in range(3):  # one hook per layer of the unrolled model
                stack.enter_context(
                    added_at_call(clone, f"blocks/{i}/linear", t * deltas[i])
                )
            return loss_fn(clone(STACK_X))

    _, directional = jax.jvp(perturbed, (0.0,), (1.0,))
    grad = res.activation_grads["blocks/linear"]
    np.testing.assert_allclose(jnp.vdot(grad, deltas), directional, rtol=2e-4)


def test_vmap_true_puts_the_batch_axis_after_the_iterations():
    # (iterations, batch, ...) as without vmap=True: the per-example model
    # mapped by the probe gives the batched model's numbers in the same layout.
    model = _build(ScannedStack)
    sum_loss = lambda y: jnp.sum(jnp.square(y - 0.5))  # noqa: E731
    step = jax.jit(lambda probe, x: probe.value_and_grad(sum_loss, x))
    batched = step(bridge.probe(model), STACK_X)
    per_example = bridge.probe(model, vmap=True)
    assert per_example.sites(STACK_X)["blocks/linear"].shape == (3, 5, 4)
    mapped = step(per_example, STACK_X)
    for site, grad in batched.activation_grads.items():
        assert_tree_allclose(mapped.activation_grads[site], grad)
        assert_tree_allclose(mapped.activations[site], batched.activations[site])


def test_a_stacked_patch_is_sliced_per_iteration():
    model = _build(ScannedStack)
    scanned, unrolled = bridge.probe(model), bridge.probe(unrolled_like(model))
    values = jax.random.normal(jax.random.key(0), (3, 5, 4))
    res = scanned.apply(
        STACK_X, patch={"blocks/linear": values, "blocks/norm": jnp.tanh}
    )
    ref = unrolled.apply(
        STACK_X,
        patch={
            **{f"blocks/{i}/linear": values[i] for i in range(3)},
            "blocks/*/norm": jnp.tanh,
        },
    )
    np.testing.assert_allclose(res.outputs, ref.outputs, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(res.activations["blocks/linear"], values)


class Rematerialised(nnx.Module):
    """A shared block called twice through `nnx.remat`."""

    remat = True

    def __init__(self, rngs):
        self.block = StackBlock(rngs)
        self.head = nnx.Linear(4, 2, rngs=rngs)

    def __call__(self, x):
        def call(block, x):
            return block(x)

        if self.remat:
            call = nnx.remat(call)
        return self.head(call(self.block, call(self.block, x)))


class NotRematerialised(Rematerialised):
    remat = False


@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_sites_inside_remat_equal_those_of_the_plain_model(mode):
    model = _build(Rematerialised)
    plain_model = nnx.clone(_build(NotRematerialised))
    nnx.update(plain_model, nnx.state(model))
    x = _inputs(5, 4)

    def run(probe, x):
        return probe.value_and_grad(loss_fn, x, with_inputs=True)

    if mode == "jit":
        run = jax.jit(run)
    probe = bridge.probe(model)
    res, ref = run(probe, x), run(bridge.probe(plain_model), x)
    assert list(probe.sites(x)) == [
        "block",
        "block/linear",
        "block/norm",
        "block#1",
        "block/linear#1",
        "block/norm#1",
        "head",
    ]
    for field in ("activations", "activation_grads", "inputs"):
        assert_tree_allclose(getattr(res, field), getattr(ref, field))
    _, plain = plain_step(nnx.clone(model), x)
    assert_tree_allclose(res.grads, plain)


class Cell(nnx.Module):
    def __init__(self, rngs):
        self.linear = nnx.Linear(4, 4, rngs=rngs)

    def __call__(self, x):
        return nnx.tanh(self.linear(x))


class BroadcastScan(nnx.Module):
    """A recurrent cell: one set of weights broadcast to every step."""

    def __init__(self, rngs):
        self.cell = Cell(rngs)

    def __call__(self, xs):
        @nnx.scan(in_axes=(nnx.Carry, None, 0), out_axes=(nnx.Carry, 0))
        def step(carry, cell, x):
            carry = cell(carry + x)
            return carry, carry

        return step(jnp.zeros(xs.shape[1:]), self.cell, xs)[1]


class BroadcastParamsScan(BroadcastScan):
    """Parameters broadcast, the rest carried: bridge's variables are `Param`s."""

    def __call__(self, xs):
        axes = nnx.StateAxes({nnx.Param: None, ...: nnx.Carry})

        @nnx.scan(in_axes=(nnx.Carry, axes, 0), out_axes=(nnx.Carry, 0))
        def step(carry, cell, x):
            carry = cell(carry + x)
            return carry, carry

        return step(jnp.zeros(xs.shape[1:]), self.cell, xs)[1]


class CarriedInVmap(BroadcastScan):
    """A carried cell called inside an nnx.vmap inside the scan."""

    def __call__(self, xs):
        @nnx.scan(
            in_axes=(nnx.StateAxes({...: nnx.Carry}), nnx.Carry, 0),
            out_axes=(nnx.Carry, 0),
        )
        def step(cell, carry, x):
            carry = nnx.vmap(lambda c, v: c(v), in_axes=(None, 0))(cell, carry + x)
            return carry, carry

        return step(self.cell, jnp.zeros(xs.shape[1:]), xs)[1]


class NestedCarriedScans(BroadcastScan):
    """A carried cell inside a lax.scan inside an nnx.scan that carries it."""

    #: Whether the inner scan is `jax.lax.scan` looked up as the model runs
    #: (counted while a probe runs), or `uncounted_scan` (never counted).
    counted = True

    def __call__(self, xs):
        @nnx.scan(
            in_axes=(nnx.StateAxes({...: nnx.Carry}), nnx.Carry, 0),
            out_axes=(nnx.Carry, 0),
        )
        def step(cell, carry, x):
            def inner(c, _):
                return cell(c + x), None

            scan = jax.lax.scan if self.counted else uncounted_scan
            carry = scan(inner, carry, None, length=2)[0]
            return carry, carry

        return step(self.cell, jnp.zeros(xs.shape[1:]), xs)[1]


class NestedUncountedScans(NestedCarriedScans):
    counted = False


class BroadcastVmap(nnx.Module):
    def __init__(self, rngs):
        self.cell = Cell(rngs)

    def __call__(self, xs):
        return nnx.vmap(lambda cell, x: cell(x), in_axes=(None, 0))(self.cell, xs)


class TreeModeRemat(nnx.Module):
    def __init__(self, rngs):
        self.cell = Cell(rngs)

    def __call__(self, x):
        return nnx.remat(lambda cell, x: cell(x), graph_updates=False)(self.cell, x)


class TapInScan(ScannedStack):
    def __call__(self, x):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def forward(x, block):
            return bridge.tap("hidden", block(x))

        return self.head(forward(self.embed(x), self.blocks))


def _cell_by_hand(builder, model, xs, offsets):
    """`builder`'s model written by hand, the cell's value shifted by
    `offsets` (a row per step, per mapped example, or per step and inner
    iteration); the outputs and the cell's values."""
    if issubclass(builder, NestedCarriedScans):
        return _nested_by_hand(model, xs, offsets)
    linear = model.cell.linear

    def cell(v):
        return jnp.tanh(linear(v))

    if builder in (BroadcastVmap, TreeModeRemat):  # every row at once
        values = cell(xs) + offsets
        return values, values
    carry, values = jnp.zeros(xs.shape[1:]), []
    for step in range(xs.shape[0]):
        carry = cell(carry + xs[step]) + offsets[step]
        values.append(carry)
    return jnp.stack(values), jnp.stack(values)


@pytest.mark.parametrize(
    "builder, shape",
    [
        # A cell the transform broadcasts (the same weights at every step,
        # for every mapped example), carries, or calls in a scan of JAX's
        # own nested in the nnx.scan: a site per step (per mapped example,
        # mapped axis first), read from the computation.
        (BroadcastScan, (3, 5, 4)),
        (BroadcastParamsScan, (3, 5, 4)),
        (BroadcastVmap, (3, 5, 4)),
        (CarriedInVmap, (3, 5, 4)),
        (NestedCarriedScans, (3, 2, 5, 4)),
        (NestedUncountedScans, (3, 2, 5, 4)),
        pytest.param(
            TreeModeRemat,
            (3, 5, 4),
            marks=pytest.mark.skipif(
                "graph_updates" not in inspect.signature(nnx.remat).parameters,
                reason="nnx.remat(graph_updates=...): flax >= 0.12.6",
            ),
        ),
    ],
)
@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_a_cell_broadcast_or_carried_by_nnx_transforms_is_a_site_per_step(
    builder, shape, mode
):
    """Where NNX's transforms broadcast a module, carry it, or run it inside
    a scan of JAX's own in their body (or in tree mode), each call is a site
    of its own: values, per-step gradients and a patch, against the model
    written by hand with offsets; parameter gradients are plain
    `nnx.grad`'s."""
    xs = _inputs(3, 5, 4)
    model = _build(builder)
    probe = bridge.probe(model)
    assert probe.sites(xs)["cell"].shape == shape
    offsets = jnp.zeros(shape)
    ys, values = _cell_by_hand(builder, model, xs, offsets)
    grads = jax.grad(lambda o: loss_fn(_cell_by_hand(builder, model, xs, o)[0]))(
        offsets
    )

    def run(probe, x):
        return probe.value_and_grad(loss_fn, x, at=["cell"])

    res = (jax.jit(run) if mode == "jit" else run)(probe, xs)
    np.testing.assert_allclose(res.loss, loss_fn(ys), rtol=1e-6)
    np.testing.assert_allclose(res.activations["cell"], values, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(
        res.activation_grads["cell"], grads, rtol=1e-4, atol=1e-7
    )
    assert "cell" not in res.ran
    _, plain = plain_step(nnx.clone(model), xs)
    assert_tree_allclose(res.grads, plain)
    # A patch of every step's value at once: the outputs are the patch's
    # (the cell's last value in each step is the step's output).
    patched = probe.apply(xs, patch={"cell": jnp.full(shape, 0.25)})
    np.testing.assert_allclose(patched.outputs, 0.25)


def _nested_by_hand(model, xs, offsets):
    """`NestedCarriedScans` unrolled by hand: the cell's value at each step
    and inner iteration shifted by `offsets[step, iteration]`; the outputs
    and those values, `(steps, 2, ...)`."""
    linear = model.cell.linear
    carry, ys, values = jnp.zeros(xs.shape[1:]), [], []
    for step in range(xs.shape[0]):
        for inner in range(2):
            carry = jnp.tanh(linear(carry + xs[step])) + offsets[step, inner]
            values.append(carry)
        ys.append(carry)
    return jnp.stack(ys), jnp.stack(values).reshape(offsets.shape)


@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_a_tap_inside_an_nnx_scan_is_a_site_per_iteration(mode):
    """A tap in a scanned stack's body holds what the block's own site holds
    (a carried cell in a scan of the model's own inside an nnx.scan:
    `test_a_cell_broadcast_or_carried_by_nnx_transforms_is_a_site_per_step`)."""
    probe = bridge.probe(_build(TapInScan))
    assert probe.sites(STACK_X)["hidden"].shape == (3, 5, 4)

    def tapped(probe, x):
        return probe.value_and_grad(loss_fn, x, at=["blocks", "hidden"])

    res = (jax.jit(tapped) if mode == "jit" else tapped)(probe, STACK_X)
    for kind in ("activations", "activation_grads"):
        got = getattr(res, kind)
        np.testing.assert_allclose(got["hidden"], got["blocks"], rtol=1e-6)
    fwd = probe.apply(STACK_X, patch={"hidden": jnp.zeros((3, 5, 4))})
    np.testing.assert_allclose(fwd.activations["hidden"], 0.0)


# -- the model's own jits and JAX transforms ------------------------------------


def _offset(value, offsets, name):
    """A test-owned hook: `value` shifted by `offsets[name]` where given."""
    return value + offsets[name] if name in offsets else value


class JaxInside(nnx.Module):
    """`cell` (and a tap `t` of its value) called inside one transform of the
    model's own code, `wrap`; `offsets` shift the sites' values, for the
    references."""

    wrap = None

    def __init__(self, rngs):
        self.cell = Cell(rngs)
        self.head = nnx.Linear(4, 2, rngs=rngs)

    def __call__(self, x, offsets=None):
        offsets = offsets or {}

        def layer(cell, x, offsets):
            h = _offset(cell(x), offsets, "cell")
            return _offset(bridge.tap("t", h), offsets, "t")

        wrap = self.wrap
        if wrap == "nnx.jit":
            h = _CACHED_NNX_JIT(self.cell, x, offsets)
        elif wrap == "jax.jit":
            h = _CACHED_JAX_JIT(self.cell, x, offsets)
        elif wrap == "jax.vmap":  # the mapped axis first
            h = jax.vmap(lambda x, o: layer(self.cell, x, o))(
                jnp.stack([x, -x]), offsets
            )
            h = h[0] * h[1]
        elif wrap == "jax.checkpoint":  # the module an argument of it
            h = jax.checkpoint(layer)(self.cell, x, offsets)
        elif wrap == "scan bound at import":  # every step, steps first

            def step(h, i):
                h = layer(self.cell, h, {k: o[i] for k, o in offsets.items()})
                return h, None

            h, _ = uncounted_scan(step, x, jnp.arange(3))
        else:
            h = layer(self.cell, x, offsets)
        return self.head(h)


def _cell_and_tap(cell, x, offsets):
    h = _offset(cell(x), offsets, "cell")
    return _offset(bridge.tap("t", h), offsets, "t")


#: Made once, so that their traces are cached before the probe runs.
_CACHED_NNX_JIT = nnx.jit(_cell_and_tap)
_CACHED_JAX_JIT = jax.jit(_cell_and_tap)


@pytest.mark.parametrize(
    "wrap",
    ["nnx.jit", "jax.jit", "jax.vmap", "jax.checkpoint", "scan bound at import"],
)
@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_a_site_inside_the_models_own_jit_or_vmap_is_probed_as_any_other(wrap, mode):
    """A site inside `nnx.jit` or `jax.jit` (their traces cached by an earlier
    call) or the model's own `jax.checkpoint` probes as one outside; inside
    the model's own `jax.vmap` it holds every example, mapped axis first;
    inside a scan bound at import (read from the computation) every step,
    steps first. References: `jax.grad` with respect to offsets the test
    adds at the sites itself."""
    model = _build(type("Model", (JaxInside,), {"wrap": wrap}))
    x = _inputs(3, 4)
    model(x)  # the model's jitted functions cache their traces
    graphdef, state = nnx.split(model)
    shape = {"jax.vmap": (2, 3, 4), "scan bound at import": (3, 3, 4)}.get(wrap, (3, 4))

    def loss_of(offsets):
        return loss_fn(nnx.merge(graphdef, state, copy=True)(x, offsets))

    zeros = {"cell": jnp.zeros(shape), "t": jnp.zeros(shape)}
    loss, grads = jax.value_and_grad(loss_of)(zeros)
    inner = nnx.merge(graphdef, state, copy=True).cell
    if wrap == "jax.vmap":
        cell = jax.vmap(inner)(jnp.stack([x, -x]))
    elif wrap == "scan bound at import":
        steps = [inner(x)]
        for _ in range(2):
            steps.append(inner(steps[-1]))
        cell = jnp.stack(steps)
    else:
        cell = inner(x)

    probe = bridge.probe(model)
    sites = probe.sites(x)
    assert list(sites) == ["cell", "cell/linear", "t", "head"]
    assert sites["cell"].shape == sites["t"].shape == shape
    step = jax.jit(probe_step) if mode == "jit" else probe_step
    res = step(probe, x)
    np.testing.assert_allclose(res.loss, loss, rtol=1e-6)
    for name in ("cell", "t"):
        np.testing.assert_allclose(res.activations[name], cell, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(
            res.activation_grads[name], grads[name], rtol=1e-4, atol=1e-7
        )
    _, plain = plain_step(nnx.clone(model), x)
    assert_tree_allclose(res.grads, plain)


class OffsetCell(nnx.Module):
    """`Cell`'s `tanh(linear(x))`; `offsets` (the reference's) shift the
    values of its sites, `cell/linear` and `cell`."""

    def __init__(self, rngs):
        self.linear = nnx.Linear(4, 4, rngs=rngs)

    def __call__(self, x, offsets=None):
        offsets = offsets or {}
        h = nnx.tanh(_offset(self.linear(x), offsets, "cell/linear"))
        return _offset(h, offsets, "cell")


SCAN_STEPS = 3


class ScannedCell(nnx.Module):
    """`cell` closed over by the model's own `jax.lax.scan` over the
    iterations' indices, its carry starting as a Python 0 (the body is traced
    twice), then `head`. `offsets` (the reference's, `(iterations, ...)`):
    row `i` added at the iteration over `i`. `values=True` returns the scan's
    `ys` too: each iteration's cell output."""

    def __init__(self, rngs):
        self.cell = OffsetCell(rngs)
        self.head = nnx.Linear(4, 2, rngs=rngs)

    def __call__(self, x, offsets=None, values=False):
        def step(carry, i):
            h, total = carry
            row = None if offsets is None else {k: v[i] for k, v in offsets.items()}
            h = self.cell(h, row)
            return (h, total + jnp.mean(h)), h

        (h, total), hs = jax.lax.scan(step, (x, 0), jnp.arange(SCAN_STEPS))
        y = self.head(h + total)
        return (y, hs) if values else y


@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_a_cell_the_models_own_lax_scan_closes_over_is_a_site_per_iteration(mode):
    """While a probe runs, the model's own `jax.lax.scan` counts its
    iterations: the cell its body closes over, and the cell's `linear`, are a
    site per iteration, listed once though the body is traced twice. Each
    iteration's value is the model's own; its gradient, that of an offset the
    model adds by hand at that iteration (plain `jax.grad`); summed over the
    iterations, that of one offset shared by all; the parameters' gradients
    are plain NNX's."""
    model = _build(ScannedCell)
    x = _inputs(3, 4)
    graphdef, state = nnx.split(model)
    names, shape = ("cell", "cell/linear"), (SCAN_STEPS, 3, 4)

    def hand_loss(offsets):
        return loss_fn(nnx.merge(graphdef, state, copy=True)(x, offsets))

    loss, offset_grads = jax.value_and_grad(hand_loss)(
        {name: jnp.zeros(shape) for name in names}
    )
    shared = jax.grad(
        lambda one: hand_loss({n: jnp.broadcast_to(o, shape) for n, o in one.items()})
    )({name: jnp.zeros(shape[1:]) for name in names})
    plain = nnx.merge(graphdef, state, copy=True)
    _, hs = plain(x, values=True)
    # Each iteration's `linear` reads the carry the one before left.
    values = {
        "cell": hs,
        "cell/linear": plain.cell.linear(jnp.concatenate([x[None], hs[:-1]])),
    }
    for name in names:  # every iteration's gradient is its own
        assert not np.allclose(offset_grads[name][0], offset_grads[name][-1])

    probe = bridge.probe(model)
    sites = probe.sites(x)
    assert list(sites) == ["cell", "cell/linear", "head"]
    assert sites["cell"].shape == sites["cell/linear"].shape == shape
    step = jax.jit(probe_step) if mode == "jit" else probe_step
    res = step(probe, x)
    np.testing.assert_allclose(res.loss, loss, rtol=1e-6)
    for name in names:
        np.testing.assert_allclose(
            res.activations[name], values[name], rtol=1e-5, atol=1e-6
        )
        grads = res.activation_grads[name]
        np.testing.assert_allclose(grads, offset_grads[name], rtol=1e-4, atol=1e-7)
        np.testing.assert_allclose(grads.sum(0), shared[name], rtol=1e-4, atol=1e-7)
    _, plain_grads = plain_step(nnx.clone(model), x)
    assert_tree_allclose(res.grads, plain_grads)


class RetracedNnxScan(nnx.Module):
    """`nnx.scan` over stacked layers whose body JAX traces twice."""

    def __init__(self, rngs):
        keys = jax.random.split(jax.random.key(0), 3)
        self.layers = nnx.vmap(lambda k: nnx.Linear(4, 4, rngs=nnx.Rngs(k)))(keys)

    def __call__(self, x, offsets=None):
        def step(layer, carry, offset):
            h, total = carry
            h = jnp.tanh(layer(h) + offset)
            return (h, total + jnp.mean(h)), None

        offsets = jnp.zeros((3, *x.shape)) if offsets is None else offsets
        (h, total), _ = nnx.scan(
            step, in_axes=(0, nnx.Carry, 0), out_axes=(nnx.Carry, 0)
        )(self.layers, (x, 0), offsets)
        return h + total


def test_a_retraced_nnx_scan_lists_its_sites_once_and_probes_them():
    x = _inputs(3, 4)
    model = _build(RetracedNnxScan)
    graphdef, state = nnx.split(model)

    def loss_of(offsets):
        return loss_fn(nnx.merge(graphdef, state, copy=True)(x, offsets))

    grad = jax.grad(loss_of)(jnp.zeros((3, 3, 4)))
    probe = bridge.probe(model)
    assert {name: s.shape for name, s in probe.sites(x).items()} == {
        "layers": (3, 3, 4)
    }
    res = probe.value_and_grad(loss_fn, x)
    # The offset is added to the layer's value: the same gradient.
    np.testing.assert_allclose(
        res.activation_grads["layers"], grad, rtol=1e-4, atol=1e-7
    )


def test_errors_name_the_fix():
    model = _build(TwoLayer)
    with pytest.raises(TypeError, match=r"carries its own variables.*nnx.update"):
        bridge.probe(model, nnx.state(model))
    with pytest.raises(TypeError, match="defines no __call__"):
        bridge.probe(nnx.List([model]))


# -- a module carried by nnx.scan: a recurrent cell ------------------------------


class CarriedScan(nnx.Module):
    """A hand-written recurrence: the cell is a loop carry of the scan
    (`nnx.StateAxes({...: nnx.Carry})`), as `nnx.RNN` scans its cell."""

    reverse = False

    def __init__(self, rngs):
        self.cell = Cell(rngs)
        self.head = nnx.Linear(4, 2, rngs=rngs)

    def __call__(self, xs):
        @nnx.scan(
            in_axes=(nnx.StateAxes({...: nnx.Carry}), nnx.Carry, 0),
            out_axes=(nnx.Carry, 0),
            reverse=self.reverse,
        )
        def step(cell, carry, x):
            carry = cell(carry + x)
            return carry, carry

        return self.head(step(self.cell, jnp.zeros(xs.shape[1:]), xs)[1])


class ReversedCarriedScan(CarriedScan):
    reverse = True


class Recurrent(nnx.Module):
    """`nnx.RNN` over an `nnx.LSTMCell`, time on axis 1."""

    reverse = False

    def __init__(self, rngs):
        self.rnn = nnx.RNN(nnx.LSTMCell(4, 5, rngs=rngs), reverse=self.reverse)
        self.head = nnx.Linear(5, 2, rngs=rngs)

    def __call__(self, x):
        return self.head(self.rnn(x))


class ReversedRecurrent(Recurrent):
    reverse = True


GATES = ("ii", "hi", "if_", "hf", "ig", "hg", "io", "ho")
STEPS = 6


def _add(tree, offset):
    return jax.tree.map(jnp.add, tree, offset)


def unrolled_carried_scan(model, xs, offsets=None):
    """`CarriedScan` as a Python loop over the steps, on the same cell;
    `offsets[site][i]` is added to step i's value there (i in the order of
    `xs`). Returns the loss and each site's values, stacked like `xs`."""
    offsets = offsets or {"cell": [0.0] * len(xs), "cell/linear": [0.0] * len(xs)}
    cell, carry = model.cell, jnp.zeros(xs.shape[1:])
    values = {"cell": [None] * len(xs), "cell/linear": [None] * len(xs)}
    order = range(len(xs))
    for i in reversed(order) if model.reverse else order:
        linear = cell.linear(carry + xs[i]) + offsets["cell/linear"][i]
        carry = nnx.tanh(linear) + offsets["cell"][i]
        values["cell/linear"][i], values["cell"][i] = linear, carry
    values = {site: jnp.stack(steps) for site, steps in values.items()}
    return loss_fn(model.head(values["cell"])), values


def unrolled_recurrent(model, x, offsets=None):
    """`Recurrent` as a Python loop over time, on the same `LSTMCell`. Step i
    is the i-th the RNN's scan runs: with `reverse=True` the RNN flips the
    sequence before its (forward) scan, so step i reads `x[:, -1 - i]`, and
    its outputs stay in that order (`keep_order=False`)."""
    cell = model.rnn.cell
    carry = cell.initialize_carry(x[:, 0].shape, nnx.Rngs(0))
    outputs, ys = [], []
    for i in range(x.shape[1]):
        t = x.shape[1] - 1 - i if model.reverse else i
        out = cell(carry, x[:, t])
        if offsets is not None:
            out = _add(out, jax.tree.map(lambda o, i=i: o[i], offsets["rnn/cell"]))
        (carry, y) = out
        outputs.append(out)
        ys.append(y)
    stacked = jax.tree.map(lambda *steps: jnp.stack(steps), *outputs)
    return loss_fn(model.head(jnp.stack(ys, axis=1))), {"rnn/cell": stacked}


def carried_reference(model, x, unrolled):
    """Loss, per-step activations and their gradients (by `jax.grad` with
    respect to per-step offsets), and `nnx.grad`'s parameter gradients: the
    unrolled loop and plain NNX, no bridge."""
    _, values = unrolled(nnx.clone(model), x)
    zeros = jax.tree.map(jnp.zeros_like, values)
    (loss, values), grads = jax.value_and_grad(
        lambda o: unrolled(nnx.clone(model), x, o), has_aux=True
    )(zeros)
    _, params = plain_step(nnx.clone(model), x)
    return loss, values, grads, params


CARRIED = {
    CarriedScan: (unrolled_carried_scan, ("cell", "cell/linear"), _inputs(STEPS, 3, 4)),
    ReversedCarriedScan: (
        unrolled_carried_scan,
        ("cell", "cell/linear"),
        _inputs(STEPS, 3, 4),
    ),
    Recurrent: (unrolled_recurrent, ("rnn/cell",), _inputs(3, STEPS, 4)),
    ReversedRecurrent: (unrolled_recurrent, ("rnn/cell",), _inputs(3, STEPS, 4)),
}


@pytest.mark.parametrize(
    "builder, mode",
    [
        (CarriedScan, "eager"),
        (CarriedScan, "jit"),
        (ReversedCarriedScan, "jit"),
        (Recurrent, "eager"),
        (Recurrent, "jit"),
        (ReversedRecurrent, "jit"),
    ],
)
def test_a_carried_cell_site_stacks_the_steps_and_equals_the_unrolled_loop(
    builder, mode
):
    model = _build(builder)
    before = snapshot(model)
    unrolled, checked, x = CARRIED[builder]
    probe = bridge.probe(model)
    sites = probe.sites(x)
    if builder in (Recurrent, ReversedRecurrent):
        assert list(sites) == [
            "rnn",
            "rnn/cell.initialize_carry",  # called by the RNN, outside its scan
            "rnn/cell",
            *(f"rnn/cell/{gate}" for gate in GATES),
            "head",
        ]
        (c, h), y = sites["rnn/cell"]
        assert c.shape == h.shape == y.shape == (STEPS, 3, 5)
        assert sites["rnn/cell/ii"].shape == (STEPS, 3, 5)
    else:
        assert list(sites) == ["cell", "cell/linear", "head"]
        assert sites["cell"].shape == sites["cell/linear"].shape == (STEPS, 3, 4)

    def run(probe, x):
        return probe.value_and_grad(loss_fn, x)

    if mode == "jit":
        run = jax.jit(run)
    res = run(probe, x)
    loss, values, grads, params = carried_reference(model, x, unrolled)
    np.testing.assert_allclose(res.loss, loss, rtol=1e-5)
    for site in checked:
        assert_tree_allclose(res.activations[site], values[site])
        assert_tree_allclose(res.activation_grads[site], grads[site])
        assert abs(jnp.sum(jnp.abs(jax.tree.leaves(grads[site])[0]))) > 1e-6
    assert_tree_allclose(res.grads, params)
    assert_tree_equal(snapshot(model), before)


def test_a_carried_cell_takes_patches_and_records_its_inputs_per_step():
    model = _build(ReversedCarriedScan)
    x = _inputs(STEPS, 3, 4)
    values = jax.random.normal(jax.random.key(1), (STEPS, 3, 4))
    res = bridge.probe(model).apply(
        x, patch={"cell": values, "cell/linear": lambda v: 2.0 * v}
    )
    # Every step's value is replaced by its row, so the head sees `values`.
    clone = nnx.clone(model)
    np.testing.assert_allclose(res.outputs, clone.head(values), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(res.activations["cell"], values)
    # Each step's linear sees the previous step's patched value (reverse: the
    # step after it in xs order) plus its own input.
    previous = jnp.concatenate([values[1:], jnp.zeros((1, 3, 4))])
    np.testing.assert_allclose(
        res.activations["cell/linear"],
        2.0 * jax.vmap(clone.cell.linear)(previous + x),
        rtol=1e-5,
        atol=1e-6,
    )
    grads = bridge.probe(model).value_and_grad(loss_fn, x, with_inputs=True)
    (inputs,) = grads.inputs["cell"]
    carries = jnp.concatenate([grads.activations["cell"][1:], jnp.zeros((1, 3, 4))])
    np.testing.assert_allclose(inputs, carries + x, rtol=1e-5)


def test_vmap_true_gives_a_carried_site_the_batched_numbers():
    model = _build(Recurrent)
    x = _inputs(3, STEPS, 4)
    sum_loss = lambda y: jnp.sum(jnp.square(y - 0.5))  # noqa: E731
    step = jax.jit(lambda probe, x: probe.value_and_grad(sum_loss, x))
    batched = step(bridge.probe(model), x)
    mapped = step(bridge.probe(model, vmap=True), x)
    assert_tree_allclose(mapped.activation_grads, batched.activation_grads)
    assert_tree_allclose(mapped.activations, batched.activations)


@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_a_patch_value_reaches_a_scanned_site_left_out_of_the_selection(mode):
    """The patch rides in on the module whether or not the site is selected:
    the reference is the unrolled model computed by hand, each block's linear
    output replaced by its row."""
    model = _build(ScannedStack)
    values = jax.random.normal(jax.random.key(0), (3, 5, 4))

    def run(probe, x):
        return probe.apply(x, at="head", patch={"blocks/linear": values})

    if mode == "jit":
        run = jax.jit(run)
    res = run(bridge.probe(model), STACK_X)
    unrolled = unrolled_like(model)
    h = unrolled.embed(STACK_X)
    for i, block in enumerate(unrolled.blocks):
        h = h + nnx.tanh(block.norm(values[i]))
    np.testing.assert_allclose(res.outputs, unrolled.head(h), rtol=1e-5, atol=1e-6)
    assert list(res.activations) == ["head"]


@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_a_patch_value_reaches_a_carried_cell_left_out_of_the_selection(mode):
    model = _build(ReversedCarriedScan)
    x = _inputs(STEPS, 3, 4)
    values = jax.random.normal(jax.random.key(1), (STEPS, 3, 4))

    def run(probe, x):
        return probe.apply(x, at="head", patch={"cell": values})

    if mode == "jit":
        run = jax.jit(run)
    res = run(bridge.probe(model), x)
    # Every step's value is replaced by its row, so the head sees `values`.
    np.testing.assert_allclose(
        res.outputs, nnx.clone(model).head(values), rtol=1e-5, atol=1e-6
    )
    assert list(res.activations) == ["head"]
