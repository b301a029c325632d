"""Keras 3 on JAX: what the conformance suite (tests/cases/keras.py) does not
cover, against Keras itself.

Activation gradients against a twin functional model that adds an offset
input at the layer (`keras.layers.Add`), differentiated with `jax.grad`
through Keras's own `stateless_call`; in float32 and under Keras's
`mixed_bfloat16` policy; selection by class and predicate; inputs; training
mode, dropout's seed state and BatchNorm's statistics; JAX transforms inside
a custom layer's `call` (a scan, a branch), which the adapter knows nothing
of; `unwrap`; and the errors before any work.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import bridge

keras = pytest.importorskip("keras")
layers = keras.layers

pytestmark = pytest.mark.usefixtures("allow_rank_promotion")

X = np.random.default_rng(0).standard_normal((3, 5)).astype(np.float32)
MODES = ["eager", "jit"]


def _loss(outputs):
    return jnp.sum(jnp.square(outputs - 0.25))


def _maybe_jit(function, mode):
    return jax.jit(function) if mode == "jit" else function


def _values(variables):
    return [variable.value for variable in variables]


def _close(actual, expected, rtol=1e-5):
    """At the tensor's own scale: float32 rounding, not elementwise near zero."""
    actual = np.asarray(actual, np.float64)
    expected = np.asarray(expected, np.float64)
    scale = max(np.abs(expected).max(), 1e-30)
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=rtol * scale)


def _twins(policy=None):
    """A functional model `dense -> hidden -> out` and its twin, which takes
    an offset input added to `hidden`'s output by `keras.layers.Add`: the
    same layer objects, so the same variables."""
    previous = keras.config.dtype_policy()
    if policy is not None:
        keras.config.set_dtype_policy(policy)
    try:
        keras.utils.set_random_seed(0)
        inputs = keras.Input((5,))
        dense = layers.Dense(6, activation="tanh", name="dense")
        hidden = layers.Dense(4, name="hidden")
        out = layers.Dense(2, name="out")
        model = keras.Model(inputs, out(hidden(dense(inputs))), name="model")
        offset = keras.Input((4,))
        shifted = layers.Add()([hidden(dense(inputs)), offset])
        twin = keras.Model([inputs, offset], out(shifted), name="twin")
    finally:
        keras.config.set_dtype_policy(previous)
    return model, twin


def _offset_gradient(model, twin, x, dtype):
    """`d loss / d offset` at a zero offset added to `hidden`'s output."""

    def loss_of(offset):
        outputs, _ = twin.stateless_call(
            _values(model.trainable_variables), [], [x, offset]
        )
        return _loss(outputs.astype(jnp.float32))

    return jax.grad(loss_of)(jnp.zeros((x.shape[0], 4), dtype))


@pytest.mark.parametrize("mode", MODES)
def test_activation_gradient_equals_the_twin_model_offset_gradient(mode):
    model, twin = _twins()
    probe = bridge.probe(model)
    res = _maybe_jit(lambda p, x: p.value_and_grad(_loss, x), mode)(probe, X)
    assert list(res.activations) == ["dense", "hidden", "out"]
    _close(res.activation_grads["hidden"], _offset_gradient(model, twin, X, "float32"))
    # Parameter gradients: jax.grad through Keras's own pure call.
    reference = jax.grad(lambda values: _loss(model.stateless_call(values, [], X)[0]))(
        _values(model.trainable_variables)
    )
    # Keyed by the variables' paths, relative to the model as the sites are
    # (this functional model's layers were built outside its name scope).
    assert sorted(res.grads) == sorted(v.path for v in model.trainable_variables)
    for variable, expected in zip(model.trainable_variables, reference, strict=True):
        _close(res.grads[variable.path], expected)
    # Activations: Keras's own functional outputs.
    hidden = keras.Model(model.inputs[0], model.get_layer("hidden").output)(X)
    _close(res.activations["hidden"], hidden)


@pytest.mark.parametrize("mode", MODES)
def test_mixed_bfloat16_sites_are_bfloat16_and_match_keras(mode):
    model, twin = _twins("mixed_bfloat16")
    x = X.astype(np.float32)
    res = _maybe_jit(lambda p, x: p.value_and_grad(_loss, x), mode)(
        bridge.probe(model), x
    )
    assert res.activations["hidden"].dtype == jnp.bfloat16
    assert res.activation_grads["hidden"].dtype == jnp.bfloat16
    # The variables stay float32, and so do their gradients.
    assert all(g.dtype == jnp.float32 for g in res.grads.values())
    expected = _offset_gradient(model, twin, x, "bfloat16")
    _close(res.activation_grads["hidden"], expected, rtol=2e-2)
    hidden = keras.Model(model.inputs[0], model.get_layer("hidden").output)(x)
    _close(res.activations["hidden"], hidden, rtol=2e-2)


def test_selection_by_class_by_predicate_and_by_glob():
    model, _ = _twins()
    probe = bridge.probe(model)
    by_class = probe.value_and_grad(_loss, X, at=layers.Dense)
    assert list(by_class.activations) == ["dense", "hidden", "out"]
    by_predicate = probe.value_and_grad(
        _loss, X, at=lambda path, layer: getattr(layer, "units", 0) == 4
    )
    assert list(by_predicate.activations) == ["hidden"]
    by_glob = probe.value_and_grad(_loss, X, at="h*")
    assert list(by_glob.activations) == ["hidden"]
    _close(by_glob.activation_grads["hidden"], by_class.activation_grads["hidden"])


def test_inputs_are_the_layer_inputs_keras_computes():
    model, _ = _twins()
    res = bridge.probe(model).value_and_grad(_loss, X, at="hidden", with_inputs=True)
    dense = keras.Model(model.inputs[0], model.get_layer("dense").output)(X)
    (inputs,) = res.inputs["hidden"]
    _close(inputs, dense)


class _Noisy(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = layers.Dense(8, name="dense")
        self.norm = layers.BatchNormalization(momentum=0.5, name="norm")
        self.drop = layers.Dropout(0.5, name="drop")
        self.out = layers.Dense(2, name="out")

    def call(self, x, training=None):
        h = self.norm(self.dense(x), training=training)
        return self.out(self.drop(h, training=training))


@pytest.mark.parametrize("mode", MODES)
def test_training_passes_through_and_the_state_comes_back_as_keras_updates_it(mode):
    keras.utils.set_random_seed(1)
    model = _Noisy(name="noisy")
    model(X)
    probe = bridge.probe(model)
    trainable = _values(model.trainable_variables)
    state = _values(model.non_trainable_variables)
    # Relative to the model, as its sites are named.
    paths = [
        variable.path.removeprefix("noisy/")
        for variable in model.non_trainable_variables
    ]
    for training in (True, False):
        res = _maybe_jit(
            lambda p, x, training=training: p.value_and_grad(
                _loss, x, training=training
            ),
            mode,
        )(probe, X)
        outputs, updated = model.stateless_call(trainable, state, X, training=training)
        _close(res.loss, _loss(outputs))
        assert sorted(res.state) == sorted(paths)
        for path, value in zip(paths, updated, strict=True):
            if jnp.issubdtype(value.dtype, jnp.floating):
                _close(res.state[path], value)  # jitted: rounding
            else:
                np.testing.assert_array_equal(res.state[path], value, err_msg=path)
        seed = next(p for p in paths if p.endswith("seed_generator_state"))
        before = dict(zip(paths, state, strict=True))[seed]
        # Dropout drew from the seed generator in training only: its state
        # comes back advanced, and the dropped units have no gradient.
        advanced = not np.array_equal(res.state[seed], before)
        assert advanced == training
        dropped = np.asarray(res.activations["drop"]) == 0
        assert dropped.any() == training
        assert np.all(np.asarray(res.activation_grads["norm"])[dropped] == 0)


class _Scanner(layers.Layer):
    """A custom layer applying its `cell` three times with `jax.lax.scan`,
    then one of two heads chosen by `jax.lax.cond`."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.cell = layers.Dense(5, activation="tanh", name="cell")
        self.left = layers.Dense(5, name="left")
        self.right = layers.Dense(5, name="right")

    def build(self, shape):
        for layer in (self.cell, self.left, self.right):
            layer.build(shape)

    def call(self, x):
        h = jax.lax.scan(lambda h, _: (self.cell(h), None), x, None, length=3)[0]
        # Closures, not the layers themselves: JAX caches a branch's trace by
        # its function, and a Keras layer reads its variables from a scope
        # the cached trace would have closed over (plain Keras fails so too).
        return jax.lax.cond(
            jnp.sum(x) > 0, lambda h: self.left(h), lambda h: self.right(h), h
        )


@pytest.mark.parametrize("mode", MODES)
def test_sites_inside_a_custom_layers_scan_and_branch(mode):
    """The adapter reaches the calls; the core carries them through JAX's
    scan (one value per iteration) and cond (`ran`)."""
    keras.utils.set_random_seed(2)
    inputs = keras.Input((5,))
    scanner = _Scanner(name="scanner")
    model = keras.Model(inputs, scanner(inputs), name="scanned")
    res = _maybe_jit(lambda p, x: p.value_and_grad(_loss, x), mode)(
        bridge.probe(model), X
    )
    assert res.activation_grads["scanner/cell"].shape == (3, *X.shape)
    kernel, bias = scanner.cell.kernel.value, scanner.cell.bias.value
    taken = scanner.left if X.sum() > 0 else scanner.right
    head_kernel, head_bias = taken.kernel.value, taken.bias.value

    def by_hand(offsets):
        h = jnp.asarray(X)
        for offset in offsets:
            h = jnp.tanh(h @ kernel + bias) + offset
        return _loss(h @ head_kernel + head_bias)

    _close(
        res.activation_grads["scanner/cell"],
        jax.grad(by_hand)(jnp.zeros((3, *X.shape))),
    )
    assert bool(res.ran[f"scanner/{taken.name}"])
    untaken = "scanner/right" if taken is scanner.left else "scanner/left"
    assert not bool(res.ran[untaken])
    assert not np.any(res.activation_grads[untaken])


def test_unwrap_gives_a_copy_with_the_probes_weights():
    model, _ = _twins()
    probe = bridge.probe(model)
    (copy,) = probe.unwrap()
    assert copy is not model
    for mine, theirs in zip(model.weights, copy.weights, strict=True):
        np.testing.assert_array_equal(mine.value, theirs.value)
    res, again = (
        p.value_and_grad(_loss, X) for p in (probe, bridge.probe(*probe.unwrap()))
    )
    _close(again.loss, res.loss)
    # Changing the copy changes neither the model nor the probe.
    copy.get_layer("hidden").kernel.assign(np.zeros((6, 4), np.float32))
    assert np.any(model.get_layer("hidden").kernel.value)
    _close(probe.value_and_grad(_loss, X).loss, res.loss)


def test_the_model_is_left_as_it_was():
    """After a probe, every layer calls its own `call` again: nothing of the
    probe stays on the model, and Keras calls it as before."""
    model, _ = _twins()
    before = np.asarray(model(X))
    bridge.probe(model).value_and_grad(_loss, X)
    for layer in [model, *model._flatten_layers()]:
        assert "call" not in vars(layer), layer.name
    np.testing.assert_array_equal(np.asarray(model(X)), before)


# -- errors, before any work ---------------------------------------------------


def test_a_model_never_built_is_refused_naming_build():
    model = _Noisy(name="unbuilt")
    with pytest.raises(bridge.BridgeValueError, match=r"not built.*model\.build"):
        bridge.probe(model)


def test_variables_given_beside_a_keras_model_are_refused():
    model, _ = _twins()
    with pytest.raises(bridge.BridgeTypeError, match="holds its own variables"):
        bridge.probe(model, {"params": {}})


def test_a_keras_2_model_is_refused_saying_it_is_not_keras_3():
    # A Keras 2 model, as its classes' modules tell it (TensorFlow is not
    # installed here).
    Model = type("Model", (), {"__module__": "tf_keras.src.engine.training"})
    with pytest.raises(bridge.BridgeTypeError, match="Keras 2.*not a Keras 3"):
        bridge.probe(Model())


def test_a_model_on_another_backend_names_keras_backend_jax(tmp_path):
    """Keras reads its backend at import: in a fresh process, on NumPy's."""
    script = textwrap.dedent(
        """
        import os
        os.environ["KERAS_BACKEND"] = "numpy"
        import keras, bridge
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
        try:
            bridge.probe(model)
        except bridge.BridgeValueError as error:
            print(error)
        """
    )
    # Run outside the source tree: there `import bridge` would find the
    # checkout's `bridge/`, which lacks `bridge.adapters` when the installed
    # package is a wheel (CI's floors).
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr
    printed = result.stdout
    assert "'numpy' backend" in printed
    assert "Set KERAS_BACKEND=jax before `import keras`" in printed
