"""Keras 3 models for the conformance suite, with independent references.

The loss, parameter gradients and state come from Keras's own pure call,
`model.stateless_call`, differentiated with `jax.grad`. Activations come
from Keras's own recording where it has one (a functional model's
intermediate outputs: `keras.Model(model.inputs, layer.output)`), else from
this file's own hook; perturbations are added by that hook: while it is
active, each listed layer's `call` is replaced on the instance by one that
adds `delta` at the call named `site` (the names written here by hand, calls
counted here) and records every value.
"""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
import keras
import numpy as np
from helpers import add_at_float_leaves, numpy_snapshot
from keras import layers

import bridge
from cases import Case


def _mse(y):
    return jnp.mean(jnp.square(y - 0.5))


@contextlib.contextmanager
def hooked(named_layers, site=None, delta=None):
    """`{name: value}` of every call of `named_layers` (`{layer: name}`),
    `delta` added at the call named `site` (a layer's k-th call `name#k`)."""
    values: dict = {}
    counts: dict = {}

    def reporting(layer, name):
        own = type(layer).call

        def call(*args, **kwargs):
            index = counts.get(name, 0)
            counts[name] = index + 1
            full = name if index == 0 else f"{name}#{index}"
            value = own(layer, *args, **kwargs)
            if full == site:
                value = add_at_float_leaves(value, delta)
            values[full] = value
            return value

        return call

    for layer, name in named_layers.items():
        object.__setattr__(layer, "call", reporting(layer, name))
    try:
        yield values
    finally:
        for layer in named_layers:
            object.__delattr__(layer, "call")


def keras_case(
    model,
    args,
    expected_sites,
    named_layers,
    *,
    kwargs=None,
    loss_fn=_mse,
    bias_sites=(),
    recorded_by_keras=(),
):
    """A case. `named_layers`: `{layer: site name}` for the hook;
    `bias_sites`: `(site, bias variable path)` pairs; `recorded_by_keras`:
    sites whose value Keras's own functional model gives (layers called once
    in a functional model)."""
    kwargs = dict(kwargs or {})
    # Keyed as the sites are named: relative to the model.
    prefix = f"{model.path}/"

    def key(variable):
        path = variable.path
        return path[len(prefix) :] if path.startswith(prefix) else path

    trainable = {key(v): v.value for v in model.trainable_variables}
    non_trainable = [v.value for v in model.non_trainable_variables]
    non_trainable_paths = [key(v) for v in model.non_trainable_variables]

    def stateless(trainable, args):
        values = [trainable[key(v)] for v in model.trainable_variables]
        return model.stateless_call(values, non_trainable, *args, **kwargs)

    @jax.jit
    def unprobed(trainable, args):
        return stateless(trainable, args)

    @functools.partial(jax.jit, static_argnums=0)
    def by_hand(site, delta):
        with hooked(named_layers, site, delta) as values:
            outputs = stateless(trainable, args)[0]
        return outputs, dict(values)

    def reference_activations():
        values = dict(by_hand(None, None)[1])
        for site in recorded_by_keras:
            layer = model.get_layer(site)
            values[site] = keras.Model(model.input, layer.output)(*args)
        return values

    def reference_state():
        updated = unprobed(trainable, args)[1]
        return dict(zip(non_trainable_paths, updated, strict=True)) or None

    # The hook must leave the model as it is: check it once, here.
    np.testing.assert_allclose(
        by_hand(None, None)[0], unprobed(trainable, args)[0], rtol=1e-5, atol=1e-6
    )
    return Case(
        probe=bridge.probe(model),
        args=args,
        kwargs=kwargs,
        loss_fn=loss_fn,
        expected_sites=expected_sites,
        trainable=trainable,
        reference_loss=lambda trainable, args: loss_fn(unprobed(trainable, args)[0]),
        perturbed_loss=lambda site, delta: loss_fn(by_hand(site, delta)[0]),
        snapshot=lambda: numpy_snapshot(
            [v.value for v in model.trainable_variables + model.non_trainable_variables]
        ),
        bias_sites={
            site: (lambda grads, path=path: grads[path]) for site, path in bias_sites
        },
        reference_activations=reference_activations,
        reference_state=reference_state,
    )


def _inputs(*shape, seed=1):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _seeded(seed):
    keras.utils.set_random_seed(seed)


def sequential_mlp():
    _seeded(0)
    model = keras.Sequential(
        [
            keras.Input((6,)),
            layers.Dense(8, activation="relu", name="hidden"),
            layers.LayerNormalization(name="norm"),
            layers.Dense(3, name="head"),
        ],
        name="mlp",
    )
    names = {model.get_layer(n): n for n in ("hidden", "norm", "head")}
    return keras_case(
        model,
        (_inputs(4, 6),),
        ["hidden", "norm", "head"],
        names,
        bias_sites=[("head", "head/bias")],
    )


def functional_shared():
    """A functional model calling one layer twice (`shared`, `shared#1`)."""
    _seeded(1)
    inputs = keras.Input((5,))
    shared = layers.Dense(5, name="shared")
    hidden = shared(layers.Activation("tanh", name="act")(shared(inputs)))
    joined = layers.Concatenate(name="cat")([hidden, inputs])
    model = keras.Model(inputs, layers.Dense(2, name="out")(joined), name="twice")
    names = {model.get_layer(n): n for n in ("shared", "act", "cat", "out")}
    return keras_case(
        model,
        (_inputs(3, 5),),
        ["shared", "act", "shared#1", "cat", "out"],
        names,
        bias_sites=[("out", "out/bias")],
        recorded_by_keras=["act", "cat", "out"],
    )


class Block(layers.Layer):
    """A custom layer: nested layers, BatchNormalization, dropout, a tap."""

    def __init__(self, width, **kwargs):
        super().__init__(**kwargs)
        self.query = layers.Dense(width, name="query")
        self.norm = layers.BatchNormalization(momentum=0.5, name="norm")
        self.drop = layers.Dropout(0.25, name="drop")

    def call(self, x, training=None):
        h = bridge.tap("pre", jnp.tanh(self.query(x)))
        return self.drop(self.norm(h, training=training), training=training)


class Subclassed(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.block_0 = Block(6, name="block_0")
        self.head = layers.Dense(2, name="head")

    def call(self, x, training=None):
        return self.head(self.block_0(x, training=training))


def subclassed_training():
    """A subclassed model in training mode: BatchNorm's statistics and the
    dropout's seed state come back in `res.state`."""
    _seeded(2)
    model = Subclassed(name="sub")
    x = _inputs(5, 4)
    model(x)
    block = model.block_0
    names = {
        block: "block_0",
        block.query: "block_0/query",
        block.norm: "block_0/norm",
        block.drop: "block_0/drop",
        model.head: "head",
    }
    return keras_case(
        model,
        (x,),
        [
            "block_0",
            "block_0/query",
            "block_0/pre",
            "block_0/norm",
            "block_0/drop",
            "head",
        ],
        names,
        kwargs={"training": True},
        bias_sites=[("head", "head/bias")],
    )


def small_cnn():
    _seeded(3)
    images = keras.Input((8, 8, 3))
    h = layers.Conv2D(4, 3, activation="relu", name="conv1")(images)
    h = layers.GlobalAveragePooling2D(name="pool")(
        layers.Conv2D(6, 3, strides=2, name="conv2")(h)
    )
    model = keras.Model(images, layers.Dense(3, name="head")(h), name="cnn")
    names = {model.get_layer(n): n for n in ("conv1", "conv2", "pool", "head")}
    return keras_case(
        model,
        (_inputs(2, 8, 8, 3),),
        ["conv1", "conv2", "pool", "head"],
        names,
        bias_sites=[("conv2", "conv2/bias"), ("head", "head/bias")],
        recorded_by_keras=["conv1", "conv2", "pool", "head"],
    )


def embed_attention():
    """Token ids through an embedding and Keras's MultiHeadAttention, whose
    projections are layers of its own (`attention/query`, ...)."""
    _seeded(4)
    ids = keras.Input((6,), dtype="int32")
    embedded = layers.Embedding(11, 8, name="embed")(ids)
    # With its scores returned, every Keras 3 computes them with its own
    # softmax layer (a site); else newer ones call a fused attention.
    attended, _ = layers.MultiHeadAttention(2, 4, name="attention")(
        embedded, embedded, return_attention_scores=True
    )
    model = keras.Model(ids, layers.Dense(3, name="head")(attended), name="attn")
    attention = model.get_layer("attention")
    names = {
        model.get_layer("embed"): "embed",
        attention: "attention",
        attention._query_dense: "attention/query",
        attention._key_dense: "attention/key",
        attention._value_dense: "attention/value",
        attention._softmax: "attention/softmax",
        attention._output_dense: "attention/attention_output",
        model.get_layer("head"): "head",
    }
    tokens = np.random.default_rng(5).integers(0, 11, (2, 6)).astype(np.int32)
    return keras_case(
        model,
        (tokens,),
        list(names.values()),
        names,
        bias_sites=[("head", "head/bias")],
        recorded_by_keras=["embed", "head"],
    )


CASES = {
    "sequential_mlp": sequential_mlp,
    "functional_shared": functional_shared,
    "subclassed_training": subclassed_training,
    "small_cnn": small_cnn,
    "embed_attention": embed_attention,
}
