"""Haiku-specific behaviour: transform kinds, rng, state, ResNet, errors.

The shared behaviours are in `test_conformance.py` (cases in `cases/haiku.py`);
here, what only Haiku has. Every number is checked against plain `apply`
(through `jax.grad`/`jax.jvp`), never against bridge itself.
"""

from __future__ import annotations

import functools

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cases.haiku import Model, _inputs, _random_params, batchnorm_net, call_name
from helpers import (
    add_at_float_leaves,
    assert_tree_allclose,
    numpy_snapshot,
    random_like,
    tree_vdot,
)

# JAX's own scan, bound before any probe runs: a probe counts the iterations
# of the `jax.lax.scan` the model looks up as it runs (a tap in its body is a
# site per iteration), never of this one, whose taps stay refused.
from jax.lax import scan as uncounted_scan

import bridge

MODES = ["eager", "jit"]


def mse(y):
    return jnp.mean(jnp.square(y - 0.5))


def run(probe, mode, *args, loss_fn=mse, **options):
    def call(probe, args):
        return probe.value_and_grad(loss_fn, *args, **options)

    return (jax.jit(call) if mode == "jit" else call)(probe, args)


def mlp(x):
    return hk.nets.MLP([8, 3])(x)


# -- both kinds of transform


TRANSFORMS = {
    "transform": hk.transform,
    "without_apply_rng": lambda f: hk.without_apply_rng(hk.transform(f)),
    "transform_with_state": hk.transform_with_state,
    "with_state_without_apply_rng": lambda f: hk.without_apply_rng(
        hk.transform_with_state(f)
    ),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", TRANSFORMS)
def test_every_kind_of_transform_gives_plain_apply_gradients(kind, mode):
    transformed = TRANSFORMS[kind](mlp)
    x = _inputs(4, 8)
    params = _random_params(
        jax.eval_shape(hk.transform(mlp).init, jax.random.key(0), x), 0
    )
    with_state = isinstance(transformed, hk.TransformedWithState)
    variables = (params, {}) if with_state else (params,)
    res = run(bridge.probe(transformed, *variables), mode, x)

    # The reference: d loss / d h via an added zero `h` at the first layer.
    def reference(params, delta):
        def interceptor(next_fun, args, kwargs, context):
            out = next_fun(*args, **kwargs)
            hit = context.method_name == "__call__" and (
                context.module.module_name == "mlp/~/linear_0"
            )
            return out + delta if hit else out

        with hk.intercept_methods(interceptor):
            return mse(hk.transform(mlp).apply(params, None, x))

    delta = jnp.zeros((4, 8))
    loss, (grads, activation_grad) = jax.value_and_grad(reference, (0, 1))(
        params, delta
    )
    np.testing.assert_allclose(res.loss, loss, rtol=1e-5)
    assert_tree_allclose(res.grads, grads)
    assert_tree_allclose(res.activation_grads["mlp/~/linear_0"], activation_grad)
    assert res.state == ({} if with_state else None)


# -- rng


def dropout_mlp(x):
    return hk.nets.MLP([8, 3])(x, dropout_rate=0.5, rng=hk.next_rng_key())


@pytest.mark.parametrize("mode", MODES)
def test_dropout_gives_plain_apply_numbers_with_the_same_key(mode):
    x = _inputs(4, 8)
    model = Model(dropout_mlp, (x,), with_state=False, apply_rng=True, rng=None)
    probe = bridge.probe(model.transformed, model.params)

    def step(probe, x, key):  # the key is an argument: not baked into jit
        return probe.value_and_grad(mse, x, rng=key)

    step = jax.jit(step) if mode == "jit" else step
    losses = []
    for seed in (7, 8):
        key = jax.random.key(seed)
        res = step(probe, x, key)
        reference = jax.value_and_grad(
            lambda params, key=key: mse(model.transformed.apply(params, key, x))
        )
        loss, grads = reference(model.params)
        np.testing.assert_allclose(res.loss, loss, rtol=1e-5)
        assert_tree_allclose(res.grads, grads)
        losses.append(res.loss)
    assert losses[0] != losses[1], "the key changes the dropout mask"


def test_a_model_that_needs_an_rng_fails_without_one_before_any_work():
    x = _inputs(4, 8)
    model = Model(dropout_mlp, (x,), with_state=False, apply_rng=True, rng=None)
    probe = bridge.probe(model.transformed, model.params)
    with pytest.raises(ValueError, match="non-None PRNGKey"):
        probe.sites(x)


def test_rng_is_refused_by_a_transform_without_apply_rng():
    transformed = hk.without_apply_rng(hk.transform(mlp))
    x = _inputs(4, 8)
    params = _random_params(jax.eval_shape(transformed.init, jax.random.key(0), x), 0)
    probe = bridge.probe(transformed, params)
    with pytest.raises(TypeError, match="made with hk.without_apply_rng"):
        probe.value_and_grad(mse, x, rng=jax.random.key(0))


# -- state


def _batchnorm_model():
    x = _inputs(4, 8)
    model = Model(batchnorm_net, (x,), with_state=True, apply_rng=False, rng=None)
    # A state that is not init's zeros, so an update is visible.
    model.state = jax.tree.map(lambda v: v + 1, model.state)
    return model, x


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    "at", [None, "batch_norm/~/mean_ema", "linear"], ids=["all", "ema", "linear"]
)
def test_state_equals_plain_apply_and_holds_no_epsilon(at, mode):
    model, x = _batchnorm_model()
    before = numpy_snapshot(model.state)
    res = run(
        bridge.probe(model.transformed, model.params, model.state), mode, x, at=at
    )
    _, expected = model.transformed.apply(model.params, model.state, x)
    assert_tree_allclose(res.state, expected)  # same bundles, same entries
    assert_tree_allclose(numpy_snapshot(model.state), before)


def test_an_epsilon_in_a_bundle_with_state_is_read_from_that_bundle():
    """`mean_ema` owns state; its epsilon sits beside it and gets the gradient."""
    model, x = _batchnorm_model()
    probe = bridge.probe(model.transformed, model.params, model.state)

    res = probe.value_and_grad(mse, x, at="*mean_ema")
    # The EMA's return value is unused by BatchNorm in training: zero gradient.
    np.testing.assert_array_equal(
        res.activation_grads["batch_norm/~/mean_ema"], np.zeros((1, 8), np.float32)
    )
    np.testing.assert_allclose(
        res.activations["batch_norm/~/mean_ema"],
        res.state["batch_norm/~/mean_ema"]["average"],
        rtol=1e-5,
    )


# -- ResNet: BatchNorm in training mode


def resnet(x):
    net = hk.nets.ResNet(
        blocks_per_group=(1, 1, 1, 1),
        num_classes=3,
        bottleneck=False,
        channels_per_group=(4, 4, 4, 4),
        use_projection=(False, True, True, True),
        initial_conv_config={"output_channels": 4, "kernel_shape": 3, "stride": 1},
    )
    return net(x, is_training=True)


@functools.cache
def _resnet():
    x = _inputs(2, 8, 8, 3)
    return Model(resnet, (x,), with_state=True, apply_rng=False, rng=None), x


@functools.cache
def _resnet_reference():
    """Loss, parameter gradients and new state of plain apply (compiled once)."""
    model, x = _resnet()

    def reference_loss(params):
        outputs, state = model.transformed.apply(params, model.state, x)
        return mse(outputs), state

    (loss, state), grads = jax.jit(jax.value_and_grad(reference_loss, has_aux=True))(
        model.params
    )
    return loss, grads, state


RESNET_SITES = [
    "res_net/~/initial_batchnorm",
    "res_net/~/block_group_1/~/block_0/~/shortcut_batchnorm",
    "res_net/~/block_group_3/~/block_0/~/conv_1",
    "res_net/~/block_group_3/~/block_0/~/batchnorm_1",
    "res_net/~/logits",
]


def test_resnet_in_training_mode():
    """Under `jax.jit` only: op-by-op, 58 sites cost many seconds. BatchNorm in
    training mode runs eagerly in the conformance suite's `batchnorm` case."""
    model, x = _resnet()
    probe = bridge.probe(model.transformed, model.params, model.state)
    sites = probe.sites(x)
    assert len(sites) == 58 and list(sites)[:3] == [
        "res_net",
        "res_net/~/initial_conv",
        "res_net/~/initial_batchnorm",
    ]
    res = run(probe, "jit", x, at=RESNET_SITES)
    assert sorted(res.activation_grads) == sorted(RESNET_SITES)

    loss, grads, state = _resnet_reference()
    np.testing.assert_allclose(res.loss, loss, rtol=1e-5)
    assert_tree_allclose(res.grads, grads, atol=1e-5)
    assert_tree_allclose(res.state, state)

    # The BatchNorm-offset identity: offset gradient = output gradient summed
    # over batch and space.
    for site in RESNET_SITES:
        if "batchnorm" in site:
            offset_grad = res.grads[site]["offset"]  # (1, 1, 1, C)
            summed = res.activation_grads[site].sum(axis=(0, 1, 2), keepdims=True)
            np.testing.assert_allclose(summed, offset_grad, rtol=1e-4, atol=1e-6)

    # A conv without bias: jvp of the loss with a hand-inserted perturbation.
    site = "res_net/~/block_group_3/~/block_0/~/conv_1"
    delta = jnp.asarray(
        np.random.default_rng(3).standard_normal(sites[site].shape, np.float32)
    )

    @jax.jit
    def perturbed_loss(t):
        counts: dict[str, int] = {}

        def interceptor(next_fun, args, kwargs, context):
            out = next_fun(*args, **kwargs)
            hit = call_name(context, counts) == site
            return add_at_float_leaves(out, t * delta) if hit else out

        with hk.intercept_methods(interceptor):
            outputs, _ = model.transformed.apply(model.params, model.state, x)
        return mse(outputs)

    _, directional = jax.jvp(perturbed_loss, (0.0,), (1.0,))
    np.testing.assert_allclose(
        jnp.vdot(res.activation_grads[site], delta), directional, rtol=2e-4, atol=1e-6
    )


# -- taps and vmap


class Tapped(hk.Module):
    def __call__(self, x, shift):
        hidden = bridge.tap("hidden", jax.nn.relu(hk.Linear(8)(x)) + shift)
        return hk.Linear(3)(hidden)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("with_state", [False, True], ids=["transform", "with_state"])
def test_a_tap_inside_a_module_is_a_site(with_state, mode):
    """The tap's gradient is that of an added `shift` at the same point."""
    x = _inputs(4, 8)
    model = Model(
        lambda x, shift=0.0: Tapped()(x, shift),
        (x,),
        with_state=with_state,
        apply_rng=False,
        rng=None,
    )
    variables = (model.params, model.state) if with_state else (model.params,)
    res = run(bridge.probe(model.transformed, *variables), mode, x, at="*/hidden")
    assert list(res.activation_grads) == ["tapped/hidden"]

    def reference(shift):
        state = (model.state,) if with_state else ()
        outputs = model.transformed.apply(model.params, *state, x, shift)
        return mse(outputs[0] if with_state else outputs)

    expected = jax.grad(reference)(jnp.zeros((4, 8)))
    assert_tree_allclose(res.activation_grads["tapped/hidden"], expected)


@pytest.mark.parametrize("with_state", [False, True], ids=["transform", "with_state"])
def test_vmap_gives_per_example_gradients(with_state):
    x = _inputs(4, 8)
    model = Model(mlp, (x[0],), with_state=with_state, apply_rng=False, rng=None)
    variables = (model.params, model.state) if with_state else (model.params,)
    probe = bridge.probe(model.transformed, *variables, vmap=True)
    res = jax.jit(lambda probe, x: probe.value_and_grad(lambda y: mse(y) * 4, x))(
        probe, x
    )
    # The model has no interaction across examples: per-example gradients of
    # the summed loss are the rows of the batched model's gradients.
    batched = bridge.probe(model.transformed, *variables).value_and_grad(
        lambda y: mse(y) * 4, x
    )
    assert_tree_allclose(res.activation_grads, batched.activation_grads)
    assert res.state == ({} if with_state else None)


# -- errors


def _mlp_params():
    x = _inputs(4, 8)
    return _random_params(
        jax.eval_shape(hk.transform(mlp).init, jax.random.key(0), x), 0
    ), x


def test_missing_params_is_an_error():
    with pytest.raises(TypeError, match=r"needs its params: bridge.probe\(transformed"):
        bridge.probe(hk.transform(mlp))


def test_missing_state_is_an_error():
    params, _ = _mlp_params()
    with pytest.raises(TypeError, match="needs its params and its state"):
        bridge.probe(hk.transform_with_state(mlp), params)


def test_state_for_a_plain_transform_is_an_error():
    params, _ = _mlp_params()
    with pytest.raises(TypeError, match="transform it with hk.transform_with_state"):
        bridge.probe(hk.transform(mlp), params, {})


@pytest.mark.parametrize("transform", [hk.transform, hk.transform_with_state])
def test_the_init_pair_passed_as_one_argument_says_to_unpack_it(transform):
    params, _ = _mlp_params()
    with pytest.raises(
        TypeError,
        match=r"got the \(params, state\) pair .* as one argument: unpack it",
    ):
        bridge.probe(transform(mlp), (params, {}))


def test_batch_norm_under_vmap_true_says_haiku_models_take_the_batch():
    x = _inputs(4, 5)
    transformed = hk.transform_with_state(batchnorm_net)
    params, state = transformed.init(jax.random.key(0), x)
    probe = bridge.probe(transformed, params, state, vmap=True)
    with pytest.raises(
        ValueError,
        match=r"batch_norm is an hk.BatchNorm, and with vmap=True the probe calls "
        r"the model on one example.*probe it with vmap=False",
    ):
        probe.value_and_grad(lambda out: jnp.sum(out[0]), x)


def test_state_that_is_not_a_mapping_is_an_error():
    params, _ = _mlp_params()
    with pytest.raises(TypeError, match="`state` must be the dict of dicts"):
        bridge.probe(hk.transform_with_state(mlp), params, [])


def test_params_of_another_model_fail_before_any_work():
    _, x = _mlp_params()
    probe = bridge.probe(hk.transform(mlp), {})
    with pytest.raises(ValueError, match="Unable to retrieve parameter"):
        probe.value_and_grad(mse, x)


# -- scanned stacks and rematerialisation
# Patches and layer inputs there: test_haiku_scan_interventions.py, which
# imports these models.


def block(x):
    h = jax.nn.relu(hk.Linear(8, name="lin")(x))
    return jnp.tanh(hk.Linear(8, name="out")(h))


def head(x):
    return hk.Linear(3, name="head")(x)


def stacked(x):
    x = hk.Linear(8, name="embed")(x)
    x = hk.experimental.layer_stack(3)(block)(x)
    return hk.remat(head)(x)


def unrolled(x):
    x = hk.Linear(8, name="embed")(x)
    for _ in range(3):  # `lin`, `lin_1`, `lin_2`: one name per layer
        x = block(x)
    return head(x)


STACK = "__layer_stack_no_per_layer"


def unrolled_params(params):
    """The stacked params sliced per layer, named as `unrolled` names them."""
    out = {k: v for k, v in params.items() if not k.startswith(STACK)}
    for i in range(3):
        for module in ("lin", "out"):
            name = module if i == 0 else f"{module}_{i}"
            out[name] = jax.tree.map(lambda v, i=i: v[i], params[f"{STACK}/{module}"])
    return out


@pytest.mark.parametrize(
    ("with_state", "wrapped", "mode"),
    [(False, False, "eager"), (True, False, "jit"), (False, True, "jit")],
    ids=["transform-eager", "with_state-jit", "wrapped_apply-jit"],
)
def test_a_layer_stack_site_stacks_layers_and_equals_the_unrolled_model(
    with_state, wrapped, mode
):
    """Also for a plain `hk.transform` whose `apply` is wrapped by the user's
    code (Haiku's own `apply` is then out of reach): bridge reads the stack
    from the computation, not from Haiku's state."""
    x = _inputs(4, 8)
    model = Model(stacked, (x,), with_state, apply_rng=False, rng=None)
    reference = Model(unrolled, (x,), with_state, apply_rng=False, rng=None)
    reference.params = unrolled_params(model.params)
    state = (model.state,) if with_state else ()
    transformed = model.transformed
    if wrapped:
        apply = transformed.apply
        transformed = hk.Transformed(
            transformed.init, functools.wraps(apply)(lambda *a: apply(*a))
        )
    probe = bridge.probe(transformed, model.params, *state)
    sites = probe.sites(x)
    assert list(sites) == ["embed", f"{STACK}/lin", f"{STACK}/out", "head"]
    assert sites[f"{STACK}/lin"].shape == (3, 4, 8)

    res = run(probe, mode, x, with_inputs=True)
    ref = run(
        bridge.probe(reference.transformed, reference.params, *state),
        mode,
        x,
        with_inputs=True,
    )
    np.testing.assert_allclose(res.loss, ref.loss, rtol=1e-5)
    for module in ("lin", "out"):
        for i in range(3):
            name = module if i == 0 else f"{module}_{i}"
            for field in ("activations", "activation_grads"):
                np.testing.assert_allclose(
                    getattr(res, field)[f"{STACK}/{module}"][i],
                    getattr(ref, field)[name],
                    rtol=1e-5,
                    atol=1e-6,
                )
    for site in ("embed", "head"):  # `head` is inside hk.remat
        assert_tree_allclose(res.activation_grads[site], ref.activation_grads[site])
        assert_tree_allclose(res.inputs[site], ref.inputs[site])
    (layer_inputs,) = res.inputs[f"{STACK}/lin"]
    np.testing.assert_allclose(layer_inputs[0], res.activations["embed"], rtol=1e-5)
    np.testing.assert_allclose(
        layer_inputs[1:], jnp.tanh(res.activations[f"{STACK}/out"][:-1]), rtol=1e-5
    )

    # Independent of bridge: plain parameter gradients, and the identity that a
    # layer's bias gradient is its output gradient summed over the batch.
    plain = jax.jit(jax.grad(lambda params: mse(model.apply(params, (x,))[0])))(
        model.params
    )
    assert_tree_allclose(res.grads, plain)
    np.testing.assert_allclose(
        res.activation_grads[f"{STACK}/lin"].sum(axis=1),
        plain[f"{STACK}/lin"]["b"],
        rtol=1e-5,
        atol=1e-6,
    )
    assert res.state == ({} if with_state else None)


def nested(x):
    layer = lambda x: jax.nn.relu(hk.Linear(8, name="lin")(x))  # noqa: E731
    inner = lambda x: hk.experimental.layer_stack(2)(layer)(x)  # noqa: E731
    return hk.experimental.layer_stack(2)(inner)(x)


def test_with_vmap_a_layer_stack_site_has_the_batch_axis_after_the_layers():
    x = _inputs(4, 8)
    transformed = hk.without_apply_rng(hk.transform(stacked))
    params = transformed.init(jax.random.key(0), x)
    probe = bridge.probe(transformed, params, vmap=True)
    reference = hk.without_apply_rng(hk.transform(unrolled))
    ref_probe = bridge.probe(reference, unrolled_params(params), vmap=True)
    assert probe.sites(x)[f"{STACK}/lin"].shape == (3, 4, 8)
    res, ref = run(probe, "jit", x), run(ref_probe, "jit", x)
    for i in range(3):
        name = "lin" if i == 0 else f"lin_{i}"
        for field in ("activations", "activation_grads"):
            np.testing.assert_allclose(
                getattr(res, field)[f"{STACK}/lin"][i],
                getattr(ref, field)[name],
                rtol=1e-5,
                atol=1e-6,
            )


def test_a_layer_stack_in_a_layer_stack_stacks_both_axes():
    x = _inputs(4, 8)
    model = Model(nested, (x,), True, apply_rng=False, rng=None)
    probe = bridge.probe(model.transformed, model.params, model.state)
    name = f"{STACK}/{STACK}/lin"
    res = jax.jit(lambda probe, x: probe.value_and_grad(mse, x, at=name))(probe, x)
    plain = jax.jit(jax.grad(lambda params: mse(model.apply(params, (x,))[0])))(
        model.params
    )
    assert res.activation_grads[name].shape == (2, 2, 4, 8)
    np.testing.assert_allclose(
        res.activation_grads[name].sum(axis=2), plain[name]["b"], rtol=1e-5, atol=1e-6
    )


def _branch_in_a_layer_stack(kind):
    def block(h):
        lin = hk.Linear(8, name="lin")
        if hk.running_init():
            return jnp.tanh(lin(h))
        if kind == "lax.cond":
            return jax.lax.cond(h.sum() > 0, lin, jnp.sin, h)
        return jax.lax.scan(lambda h, _: (jnp.tanh(lin(h)), None), h, None, length=2)[0]

    return lambda x: hk.experimental.layer_stack(2)(block)(x)


@pytest.mark.parametrize("kind", ["lax.cond", "lax.scan"])
def test_a_branch_or_loop_in_a_layer_stack_is_read_from_the_computation(kind):
    """On every supported jax (the floor's too, whose traces do not record
    their parent): a call in JAX's branch or loop in a layer stack's body is a
    site of every layer (and iteration), whose gradient summed over the
    iterations and the batch is each layer's bias gradient, from plain
    `jax.grad`."""
    x = _inputs(4, 8)
    transformed = hk.without_apply_rng(hk.transform(_branch_in_a_layer_stack(kind)))
    params = transformed.init(jax.random.key(0), x)
    probe = bridge.probe(transformed, params)
    site = f"{STACK}/lin"
    plain = jax.grad(lambda p: mse(transformed.apply(p, x)))(params)
    for res in (
        probe.value_and_grad(mse, x, at=[site]),
        jax.jit(lambda p, x: p.value_and_grad(mse, x, at=[site]))(probe, x),
    ):
        grads = res.activation_grads[site]
        assert grads.shape == ((2, 4, 8) if kind == "lax.cond" else (2, 2, 4, 8))
        summed = grads.sum(axis=tuple(range(1, grads.ndim - 1)))
        np.testing.assert_allclose(summed, plain[site]["b"], rtol=1e-5, atol=1e-6)


def recurrent(x, reverse=False):
    cell = hk.Linear(8, name="cell")
    h = hk.Linear(8, name="embed")(x)
    step = lambda carry, h: (jnp.tanh(cell(carry) + h), carry)  # noqa: E731
    return hk.scan(step, h[0], h, reverse=reverse)[0]


def recurrent_unrolled(x, reverse=False):
    cell = hk.Linear(8, name="cell")
    h = hk.Linear(8, name="embed")(x)
    carry = h[0]
    for i in reversed(range(len(h))) if reverse else range(len(h)):
        carry = jnp.tanh(cell(carry) + h[i])  # `cell`, `cell#1`, ...
    return carry


@pytest.mark.parametrize(
    ("with_state", "mode", "reverse"),
    [(False, "eager", False), (True, "jit", True)],
    ids=["transform-eager", "with_state-jit-reverse"],
)
def test_an_hk_scan_site_stacks_iterations_and_equals_the_unrolled_model(
    with_state, mode, reverse
):
    x = _inputs(3, 8)
    model = Model(recurrent, (x,), with_state, apply_rng=False, rng=None)
    reference = Model(recurrent_unrolled, (x,), with_state, apply_rng=False, rng=None)
    state = (model.state,) if with_state else ()
    probe = bridge.probe(model.transformed, model.params, *state)
    assert {k: v.shape for k, v in probe.sites(x, reverse=reverse).items()} == {
        "embed": (3, 8),
        "cell": (3, 8),  # (iterations, features), in the order of `xs`
    }

    def loss_fn(y):
        return jnp.sum(jnp.sin(y))

    res = run(probe, mode, x, loss_fn=loss_fn, reverse=reverse)
    ref = run(
        bridge.probe(reference.transformed, model.params, *state),
        mode,
        x,
        loss_fn=loss_fn,
        reverse=reverse,
    )
    np.testing.assert_allclose(res.loss, ref.loss, rtol=1e-5)
    rows = range(2, -1, -1) if reverse else range(3)
    for call, row in enumerate(rows):
        name = "cell" if call == 0 else f"cell#{call}"
        for field in ("activations", "activation_grads"):
            np.testing.assert_allclose(
                getattr(res, field)["cell"][row],
                getattr(ref, field)[name],
                rtol=1e-5,
                atol=1e-6,
            )
    plain = jax.jit(
        jax.grad(
            lambda params: loss_fn(
                reference.transformed.apply(params, *state, x, reverse)[0]
                if with_state
                else reference.transformed.apply(params, x, reverse)
            )
        )
    )(model.params)
    assert_tree_allclose(res.grads, plain)
    np.testing.assert_allclose(
        res.activation_grads["cell"].sum(axis=0), plain["cell"]["b"], rtol=1e-5
    )


def looped(x):
    cell = hk.Linear(8, name="cell")
    h = hk.Linear(8, name="embed")(x)
    return hk.fori_loop(0, 3, lambda i, h: jnp.tanh(cell(h)), h)


def test_a_site_inside_hk_fori_loop_holds_every_iteration():
    """One Linear applied in every iteration: the site holds each
    iteration's value and gradient, and the Linear's bias gradient is their
    sum over iterations and examples (the bias identity)."""
    x = _inputs(5, 8)
    model = Model(looped, (x,), True, apply_rng=False, rng=None)
    probe = bridge.probe(model.transformed, model.params, model.state)
    assert probe.sites(x)["cell"].shape == (3, 5, 8)
    loss, grads = jax.value_and_grad(lambda params: mse(model.apply(params, (x,))[0]))(
        model.params
    )
    for res in (
        probe.value_and_grad(mse, x),  # `at=None`: nothing left out
        jax.jit(lambda p: p.value_and_grad(mse, x))(probe),
    ):
        assert set(res.activations) == {"embed", "cell"}  # jit sorts keys
        np.testing.assert_allclose(res.loss, loss, rtol=1e-5)
        assert_tree_allclose(res.grads, grads)
        np.testing.assert_allclose(
            res.activation_grads["cell"].sum(axis=(0, 1)),
            grads["cell"]["b"],
            rtol=1e-5,
            atol=1e-6,
        )
        # Each iteration's value: the Linear of the previous one's tanh.
        cell = model.params["cell"]
        h = res.activations["embed"]
        for i in range(3):
            np.testing.assert_allclose(
                res.activations["cell"][i],
                h @ cell["w"] + cell["b"][None],
                rtol=1e-5,
                atol=1e-6,
            )
            h = jnp.tanh(res.activations["cell"][i])


class _TappedBlock(hk.Module):
    def __call__(self, x):
        return x + bridge.tap("pre", jnp.tanh(hk.Linear(8, name="lin")(x)))


def _tapped_layer_stack(x):
    return hk.experimental.layer_stack(3)(lambda x: _TappedBlock(name="block")(x))(x)


def _tapped_scan(x):
    block = _TappedBlock(name="block")

    def step(carry, _):
        return block(carry), None

    return hk.scan(step, x, None, length=3)[0]


@pytest.mark.parametrize("mode", ["eager", "jit"])
@pytest.mark.parametrize("stack", ["layer_stack", "scan"])
def test_a_tap_inside_a_layer_stack_or_hk_scan_is_stacked_over_iterations(stack, mode):
    function = _tapped_layer_stack if stack == "layer_stack" else _tapped_scan
    transformed = hk.without_apply_rng(hk.transform(function))
    x = _inputs(4, 8)
    params = transformed.init(jax.random.key(1), x)
    probe = bridge.probe(transformed, params)
    prefix = "__layer_stack_no_per_layer/" if stack == "layer_stack" else ""
    tap, lin = f"{prefix}block/pre", f"{prefix}block/lin"
    assert probe.sites(x)[tap].shape == (3, 4, 8)
    res = run(probe, mode, x)
    # The reference: the stack unrolled by hand, an offset added at the tap.
    (linear,) = params.values()
    delta = random_like(jax.ShapeDtypeStruct((3, 4, 8), jnp.float32), seed=4)

    def unrolled(t):
        h, taps = x, []
        for i in range(3):
            w, b = (
                (linear["w"][i], linear["b"][i])
                if stack == "layer_stack"
                else (linear["w"], linear["b"])
            )
            taps.append(jnp.tanh(h @ w + b[None]) + t * delta[i])
            h = h + taps[-1]
        return jnp.stack(taps), mse(h)

    (taps, loss), (_, directional) = jax.jvp(unrolled, (0.0,), (1.0,))
    np.testing.assert_allclose(res.loss, loss, rtol=1e-5)
    np.testing.assert_allclose(res.activations[tap], taps, atol=1e-6)
    assert abs(directional) > 1e-3  # the offset moves the loss
    np.testing.assert_allclose(
        tree_vdot(res.activation_grads[tap], delta), directional, rtol=1e-4
    )
    # The module calling the tap keeps its own epsilon: the bias identity.
    bias_grads = res.activation_grads[lin].sum(1)
    if stack == "scan":  # one Linear for every iteration: gradients summed
        bias_grads = bias_grads.sum(0)
    np.testing.assert_allclose(
        bias_grads, res.grads[next(iter(params))]["b"], rtol=1e-5, atol=1e-6
    )


def test_a_tap_inside_hk_fori_loop_holds_every_iteration_not_a_sum():
    def looped(x):
        body = lambda i, x: x + bridge.tap("h", jnp.tanh(x))  # noqa: E731
        return hk.fori_loop(0, 2, body, x)

    transformed = hk.without_apply_rng(hk.transform(looped))
    x = _inputs(4, 8)
    probe = bridge.probe(transformed, transformed.init(jax.random.key(0), x))
    assert probe.sites(x)["h"].shape == (2, 4, 8)  # every iteration

    # The reference: the loop unrolled, an offset added to each tap by hand.
    def reference(offsets):
        h = x
        for i in range(2):
            h = h + jnp.tanh(h) + offsets[i]
        return mse(h)

    grads = jax.grad(reference)(jnp.zeros((2, 4, 8)))
    res = probe.value_and_grad(mse, x, at="h")
    np.testing.assert_allclose(res.activation_grads["h"], grads, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(res.activations["h"][0], jnp.tanh(x), rtol=1e-6)


@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_a_per_example_batch_norm_over_the_probes_axis_equals_plain_vmap(mode):
    """The model the error above points to: written for one example, its
    BatchNorm reducing over the probe's axis `batch`."""

    def per_example(x):
        x = hk.Linear(8)(x)
        x = hk.BatchNorm(True, True, 0.9, cross_replica_axis="batch")(
            x, is_training=True
        )
        return hk.Linear(3)(jax.nn.relu(x))

    x = _inputs(6, 5)
    transformed = hk.without_apply_rng(hk.transform_with_state(per_example))
    key = jax.random.key(0)
    batched = jax.vmap(transformed.init, (None, 0), axis_name="batch")(key, x)
    params, state = jax.tree.map(lambda leaf: leaf[0], batched)

    def plain_loss(params):
        outputs, _ = jax.vmap(transformed.apply, (None, None, 0), axis_name="batch")(
            params, state, x
        )
        return jnp.sum(outputs**2)

    loss, grads = jax.value_and_grad(plain_loss)(params)

    def run(probe, x):
        return probe.value_and_grad(lambda outputs: jnp.sum(outputs**2), x)

    if mode == "jit":
        run = jax.jit(run)
    res = run(bridge.probe(transformed, params, state, vmap=True), x)
    np.testing.assert_allclose(res.loss, loss, rtol=1e-5)
    # The first Linear's bias gradient is zero in exact arithmetic (BatchNorm
    # removes the mean): ~1e-6 of float32 rounding either way.
    assert_tree_allclose(res.grads, grads, atol=1e-5)
    assert res.activations["batch_norm"].shape == (6, 8)


# -- JAX's own transforms in the model's code -------------------------------------


def _in_jax_vmap(x):
    """`hk.Linear` and a tap inside the model's own `jax.vmap` over a new
    leading axis (two copies of the input), then a head."""
    linear = hk.Linear(4, name="inner")

    def per_copy(h):
        return bridge.tap("t", jnp.sin(linear(h)))

    ys = jax.vmap(per_copy)(jnp.stack([x, 0.5 * x]))
    return hk.Linear(2, name="head")(ys[0] - ys[1])


def test_a_site_in_the_models_own_jax_vmap_holds_every_mapped_example():
    transformed = hk.without_apply_rng(hk.transform(_in_jax_vmap))
    x = jax.random.normal(jax.random.key(1), (3, 5))
    params = transformed.init(jax.random.key(0), x)
    probe = bridge.probe(transformed, params)
    sites = probe.sites(x)
    assert list(sites) == ["inner", "t", "head"]
    assert sites["inner"].shape == (2, 3, 4)  # the mapped axis first
    assert sites["t"].shape == (2, 3, 4)

    def loss(y):
        return jnp.sum(y**2)

    # The reference, plain JAX: offsets added to each copy's values by hand.
    def reference(params, offsets):
        inner, head = params["inner"], params["head"]
        copies = jnp.stack([x, 0.5 * x])
        pre = copies @ inner["w"] + inner["b"][None, None] + offsets["inner"]
        tapped = jnp.sin(pre) + offsets["t"]
        y = (tapped[0] - tapped[1]) @ head["w"] + head["b"][None]
        return loss(y), {"inner": pre, "t": tapped}

    zeros = {name: jnp.zeros((2, 3, 4)) for name in ("inner", "t")}
    (value, values), (grads, offset_grads) = jax.value_and_grad(
        reference, argnums=(0, 1), has_aux=True
    )(params, zeros)
    for run in (
        lambda p: p.value_and_grad(loss, x),
        jax.jit(lambda p: p.value_and_grad(loss, x, at=["inner", "t"])),
    ):
        res = run(probe)
        np.testing.assert_allclose(res.loss, value, rtol=1e-6)
        assert_tree_allclose(res.grads, grads, rtol=1e-5)
        for name in ("inner", "t"):
            np.testing.assert_allclose(res.activations[name], values[name], rtol=1e-6)
            np.testing.assert_allclose(
                res.activation_grads[name], offset_grads[name], rtol=1e-5
            )
    # A patch value in the site's whole shape replaces every copy's.
    patch = jax.random.normal(jax.random.key(2), (2, 3, 4))
    res = probe.value_and_grad(loss, x, at="head", patch={"t": patch})
    head = params["head"]
    want = loss((patch[0] - patch[1]) @ head["w"] + head["b"][None])
    np.testing.assert_allclose(res.loss, want, rtol=1e-6)


def _middle(kind, h):
    """`bridge.tap("t", sin(h))` inside JAX's own `kind` of transform (a
    `scan`: the one bound at import, which a probe never counts)."""

    def tapped(h):
        return bridge.tap("t", jnp.sin(h))

    if kind == "checkpoint":
        return jax.checkpoint(tapped)(h)
    if kind == "cond":
        return jax.lax.cond(jnp.all(jnp.isfinite(h)), tapped, jnp.cos, h)
    return _tapped_steps(uncounted_scan, h)[0]


STEPS = 3


def _tapped_steps(scan, h, offsets=None):
    """`h = bridge.tap("t", sin(h))` at each iteration of `scan` over the
    iterations' indices (its carry starts as a Python 0: traced twice); with
    `offsets` (`(iterations, ...)`, the reference's), row `i` added to the
    tap's value at the iteration over `i`. `h + 0.1 * total`, and the scan's
    `ys`: each iteration's tap value."""

    def step(carry, i):
        h, total = carry
        h = bridge.tap("t", jnp.sin(h))
        h = h if offsets is None else h + offsets[i]
        return (h, total + jnp.mean(h)), h

    (h, total), steps = scan(step, (h, 0), jnp.arange(STEPS))
    return h + 0.1 * total, steps


def _tap_in(kind, x):
    h = _middle(kind, hk.Linear(4, name="first")(x))
    return hk.Linear(2, name="last")(h)


@pytest.mark.parametrize("kind, shape", [("checkpoint", (3, 4)), ("scan", (3, 3, 4))])
@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_a_tap_in_a_jax_transform_is_read_from_the_computation(kind, shape, mode):
    """A tap inside JAX's own `jax.checkpoint`, or a scan bound at import
    (which a probe never counts, traced twice), is read from the computation
    JAX builds: listed once, its value (every iteration, iterations first)
    and its gradient and `first`'s against offsets added by hand, and the
    parameters' gradients plain JAX's."""
    transformed = hk.without_apply_rng(hk.transform(functools.partial(_tap_in, kind)))
    x = jax.random.normal(jax.random.key(1), (3, 5))
    params = transformed.init(jax.random.key(0), x)
    probe = bridge.probe(transformed, params)
    sites = probe.sites(x)
    assert list(sites) == ["first", "t", "last"]  # no phantom `t#1`
    assert sites["t"].shape == shape  # a scan's iterations first

    def loss(y):
        return jnp.sum(y**2)

    # The reference, plain JAX: offsets added by hand (`bridge.tap` outside a
    # probe is the value itself).
    def reference(params, offsets):
        first = x @ params["first"]["w"] + params["first"]["b"][None]
        first = first + offsets["first"]
        if kind == "checkpoint":
            h = jax.checkpoint(jnp.sin)(first) + offsets["t"]
            tapped = h
        else:
            h, tapped = _tapped_steps(jax.lax.scan, first, offsets["t"])
        y = h @ params["last"]["w"] + params["last"]["b"][None]
        return loss(y), (first, tapped)

    zeros = {"first": jnp.zeros((3, 4)), "t": jnp.zeros(shape)}
    (value, (first, tapped)), (grads, offset_grads) = jax.value_and_grad(
        reference, argnums=(0, 1), has_aux=True
    )(params, zeros)

    def step(probe):
        return probe.value_and_grad(loss, x)

    res = (jax.jit(step) if mode == "jit" else step)(probe)
    np.testing.assert_allclose(res.loss, value, rtol=1e-6)
    np.testing.assert_allclose(res.activations["first"], first, rtol=1e-6)
    np.testing.assert_allclose(res.activations["t"], tapped, rtol=1e-5, atol=1e-6)
    for site in ("first", "t"):
        np.testing.assert_allclose(
            res.activation_grads[site], offset_grads[site], rtol=1e-5, atol=1e-6
        )
    assert_tree_allclose(res.grads, grads, rtol=1e-5)


def _tap_in_the_models_scan(x, offsets=None):
    """`first`, the tap in the model's own `jax.lax.scan` (`_tapped_steps`),
    `last`. With `offsets` (the reference's), each shifts its site's values
    (`t`'s row `i` at the iteration over `i`), and the sites' values are
    returned beside the outputs."""
    offsets = offsets or {}

    def plus(name, value):
        return value + offsets[name] if name in offsets else value

    first = plus("first", hk.Linear(4, name="first")(x))
    h, steps = _tapped_steps(jax.lax.scan, first, offsets.get("t"))
    y = plus("last", hk.Linear(2, name="last")(h))
    return (y, {"first": first, "t": steps, "last": y}) if offsets else y


def test_a_tap_in_the_models_own_lax_scan_is_a_site_of_every_iteration():
    """While a probe runs, the model's own `jax.lax.scan` counts its
    iterations: its body's tap (traced twice) is one site of every iteration,
    which `at=None` probes with the rest, in silence. Its values are the
    scan's own `ys`; its gradients, those of offsets the model adds by hand
    (plain `jax.grad`), row `i` at the iteration over `i`, and summed over
    the iterations, that of one offset shared by all; the parameters'
    gradients are plain JAX's; eager and jitted."""
    transformed = hk.without_apply_rng(hk.transform(_tap_in_the_models_scan))
    x = jax.random.normal(jax.random.key(1), (3, 5))
    params = transformed.init(jax.random.key(0), x)
    probe = bridge.probe(transformed, params)
    sites = probe.sites(x)
    assert list(sites) == ["first", "t", "last"]
    assert sites["t"].shape == (STEPS, 3, 4)

    def loss(y):
        return jnp.sum(y**2)

    def reference(params, offsets):
        y, values = transformed.apply(params, x, offsets)
        return loss(y), values

    zeros = {name: jnp.zeros(site.shape) for name, site in sites.items()}
    (value, values), (grads, offset_grads) = jax.value_and_grad(
        reference, argnums=(0, 1), has_aux=True
    )(params, zeros)
    shared = jax.grad(
        lambda one: reference(
            params, {**zeros, "t": jnp.broadcast_to(one, sites["t"].shape)}
        )[0]
    )(jnp.zeros((3, 4)))
    # Every iteration's gradient is its own: the test tells them apart.
    assert not np.allclose(offset_grads["t"][0], offset_grads["t"][-1])
    for res in (
        probe.value_and_grad(loss, x),
        jax.jit(lambda p: p.value_and_grad(loss, x))(probe),
    ):
        assert set(res.activations) == {"first", "t", "last"}
        np.testing.assert_allclose(res.loss, value, rtol=1e-6)
        assert_tree_allclose(res.grads, grads, rtol=1e-5)
        for name in sites:
            np.testing.assert_allclose(
                res.activations[name], values[name], rtol=1e-5, atol=1e-6
            )
            np.testing.assert_allclose(
                res.activation_grads[name], offset_grads[name], rtol=1e-5, atol=1e-6
            )
        np.testing.assert_allclose(
            res.activation_grads["t"].sum(0), shared, rtol=1e-5, atol=1e-6
        )
