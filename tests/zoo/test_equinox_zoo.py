"""Model zoo, Equinox: models composed of Equinox's own layers the way its
documentation writes them, probed at every site.

No third-party Equinox model zoo installs and runs here (eqxvision 0.2.8
imports the removed `equinox.experimental`; equimo and eqx-zoo need Python
>= 3.12), so the models follow Equinox's own examples: the BERT example's
blocks (`eqx.nn.Embedding`, `eqx.nn.MultiheadAttention` with
`eqx.nn.RotaryPositionalEmbedding` through `process_heads`, as its docstring
shows, feed-forward blocks under the model's own per-token `jax.vmap`), the
RNN example with an `eqx.nn.LSTMCell` under `lax.scan`, the stateful example
(`eqx.nn.BatchNorm`, `eqx.nn.SpectralNorm`, `eqx.nn.make_with_state`) behind
an `eqx.nn.Conv2d`, and an `eqx.nn.MLP`.

Every reference is Equinox's own, written here and never through bridge:

- loss, parameter gradients and new state: `eqx.filter_value_and_grad` of the
  model under the user's own `jax.vmap`;
- activations: each site's submodule called here on the inputs the probe
  recorded (`with_inputs=True`), under as many `jax.vmap`s as the site has
  mapped axes; for the BERT model also a forward pass written from its blocks;
- activation gradients: `jax.jvp` of the loss in `t`, where `eqx.tree_at`
  replaces the submodule with `Offset`, a module of this file that adds
  `t * (delta + gain * output)` to its output, `delta` per example. Inside the
  model's own `jax.vmap` a leaf cannot vary per token, so there the offset
  varies through `gain * output`. `vdot(activation_grad, offset / t)` must
  equal the jvp.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    assert_equals_plain,
    assert_tree_allclose,
    tree_vdot,
    value_and_grad_in,
)

import bridge

# -- the BERT example's blocks, with rotary position embeddings


class EmbedderBlock(eqx.Module):
    token_embedder: eqx.nn.Embedding
    segment_embedder: eqx.nn.Embedding
    layernorm: eqx.nn.LayerNorm
    dropout: eqx.nn.Dropout

    def __init__(self, vocab_size, num_segments, embedding_size, dropout_rate, key):
        k1, k2 = jax.random.split(key)
        self.token_embedder = eqx.nn.Embedding(vocab_size, embedding_size, key=k1)
        self.segment_embedder = eqx.nn.Embedding(num_segments, embedding_size, key=k2)
        self.layernorm = eqx.nn.LayerNorm(shape=embedding_size)
        self.dropout = eqx.nn.Dropout(dropout_rate)

    def __call__(self, token_ids, segment_ids, enable_dropout=False, key=None):
        tokens = jax.vmap(self.token_embedder)(token_ids)
        segments = jax.vmap(self.segment_embedder)(segment_ids)
        embedded = jax.vmap(self.layernorm)(tokens + segments)
        return self.dropout(embedded, inference=not enable_dropout, key=key)


class AttentionBlock(eqx.Module):
    attention: eqx.nn.MultiheadAttention
    rope_embeddings: eqx.nn.RotaryPositionalEmbedding
    layernorm: eqx.nn.LayerNorm
    dropout: eqx.nn.Dropout

    def __init__(self, hidden_size, num_heads, dropout_rate, key):
        self.attention = eqx.nn.MultiheadAttention(
            num_heads, hidden_size, dropout_p=dropout_rate, key=key
        )
        self.rope_embeddings = eqx.nn.RotaryPositionalEmbedding(
            hidden_size // num_heads
        )
        self.layernorm = eqx.nn.LayerNorm(shape=hidden_size)
        self.dropout = eqx.nn.Dropout(dropout_rate)

    def __call__(self, inputs, mask, enable_dropout=False, key=None):
        def process_heads(query_heads, key_heads, value_heads):
            rope = jax.vmap(self.rope_embeddings, in_axes=1, out_axes=1)
            return rope(query_heads), rope(key_heads), value_heads

        attention_key, dropout_key = (
            (None, None) if key is None else jax.random.split(key)
        )
        mask = jnp.logical_and(mask[:, None], mask[None, :])
        out = self.attention(
            query=inputs,
            key_=inputs,
            value=inputs,
            mask=mask,
            inference=not enable_dropout,
            key=attention_key,
            process_heads=process_heads,
        )
        out = self.dropout(out, inference=not enable_dropout, key=dropout_key)
        return jax.vmap(self.layernorm)(out + inputs)


class FeedForwardBlock(eqx.Module):
    mlp: eqx.nn.Linear
    output: eqx.nn.Linear
    layernorm: eqx.nn.LayerNorm
    dropout: eqx.nn.Dropout

    def __init__(self, hidden_size, intermediate_size, dropout_rate, key):
        k1, k2 = jax.random.split(key)
        self.mlp = eqx.nn.Linear(hidden_size, intermediate_size, key=k1)
        self.output = eqx.nn.Linear(intermediate_size, hidden_size, key=k2)
        self.layernorm = eqx.nn.LayerNorm(shape=hidden_size)
        self.dropout = eqx.nn.Dropout(dropout_rate)

    def __call__(self, inputs, enable_dropout=False, key=None):
        hidden = jax.nn.gelu(self.mlp(inputs))
        output = self.output(hidden)
        output = self.dropout(output, inference=not enable_dropout, key=key)
        return self.layernorm(output + inputs)


class TransformerLayer(eqx.Module):
    attention_block: AttentionBlock
    ff_block: FeedForwardBlock

    def __init__(self, hidden_size, intermediate_size, num_heads, dropout_rate, key):
        k1, k2 = jax.random.split(key)
        self.attention_block = AttentionBlock(hidden_size, num_heads, dropout_rate, k1)
        self.ff_block = FeedForwardBlock(
            hidden_size, intermediate_size, dropout_rate, k2
        )

    def __call__(self, inputs, mask, *, enable_dropout=False, key=None):
        attn_key, ff_key = (None, None) if key is None else jax.random.split(key)
        attention_output = self.attention_block(
            inputs, mask, enable_dropout=enable_dropout, key=attn_key
        )
        seq_len = inputs.shape[0]
        ff_keys = None if ff_key is None else jax.random.split(ff_key, seq_len)
        return jax.vmap(self.ff_block, in_axes=(0, None, 0))(
            attention_output, enable_dropout, ff_keys
        )


class Encoder(eqx.Module):
    embedder_block: EmbedderBlock
    layers: list
    pooler: eqx.nn.Linear

    def __init__(self, vocab, segments, hidden, intermediate, layers, heads, key):
        ek, pk, *lk = jax.random.split(key, layers + 2)
        self.embedder_block = EmbedderBlock(vocab, segments, hidden, 0.1, ek)
        self.layers = [
            TransformerLayer(hidden, intermediate, heads, 0.1, k) for k in lk
        ]
        self.pooler = eqx.nn.Linear(hidden, hidden, key=pk)

    def __call__(self, token_ids, segment_ids, *, enable_dropout=False, key=None):
        keys = [None] * (len(self.layers) + 1)
        if key is not None:
            keys = list(jax.random.split(key, len(self.layers) + 1))
        x = self.embedder_block(
            token_ids, segment_ids, enable_dropout=enable_dropout, key=keys[0]
        )
        mask = jnp.asarray(token_ids != 0, dtype=jnp.int32)
        for layer, layer_key in zip(self.layers, keys[1:], strict=True):
            x = layer(x, mask, enable_dropout=enable_dropout, key=layer_key)
        first_token_last_layer = x[..., 0, :]
        pooled = jnp.tanh(self.pooler(first_token_last_layer))
        return {"embeddings": x, "pooled": pooled}


class BertClassifier(eqx.Module):
    encoder: Encoder
    classifier_head: eqx.nn.Linear

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.encoder = Encoder(20, 2, 8, 16, layers=2, heads=2, key=k1)
        self.classifier_head = eqx.nn.Linear(8, 3, key=k2)

    def __call__(self, token_ids, segment_ids):
        pooled = self.encoder(token_ids, segment_ids)["pooled"]
        return self.classifier_head(pooled)


def _bert_forward(model: BertClassifier, token_ids, segment_ids):
    """The BERT model's forward pass, written here from its submodules: a few
    sites' values, for one example."""
    enc = model.encoder
    x = enc.embedder_block(token_ids, segment_ids)
    mask = jnp.asarray(token_ids != 0, dtype=jnp.int32)
    values = {"encoder/embedder_block": x}
    for i, layer in enumerate(enc.layers):
        a = layer.attention_block(x, mask)
        values[f"encoder/layers/{i}/attention_block"] = a
        values[f"encoder/layers/{i}/ff_block/mlp"] = jax.vmap(layer.ff_block.mlp)(a)
        x = jax.vmap(layer.ff_block)(a)
        values[f"encoder/layers/{i}"] = x
    values["encoder/pooler"] = enc.pooler(x[0])
    return values


# -- the RNN example, with an LSTM cell


class RNN(eqx.Module):
    """Equinox's RNN example: the scan body closes over the cell."""

    hidden_size: int = eqx.field(static=True)
    cell: eqx.nn.LSTMCell
    linear: eqx.nn.Linear
    bias: jax.Array

    def __init__(self, in_size, out_size, hidden_size, *, key):
        ckey, lkey = jax.random.split(key)
        self.hidden_size = hidden_size
        self.cell = eqx.nn.LSTMCell(in_size, hidden_size, key=ckey)
        self.linear = eqx.nn.Linear(hidden_size, out_size, use_bias=False, key=lkey)
        self.bias = jnp.zeros(out_size)

    def __call__(self, input):
        hidden = (jnp.zeros((self.hidden_size,)), jnp.zeros((self.hidden_size,)))

        def f(carry, inp):
            return self.cell(inp, carry), None

        (out, _), _ = jax.lax.scan(f, hidden, input)
        return jax.nn.sigmoid(self.linear(out) + self.bias)


class UnrolledRNN(RNN):
    """The same RNN with its loop unrolled, as bridge's error advises."""

    def __call__(self, input):
        carry = (jnp.zeros((self.hidden_size,)), jnp.zeros((self.hidden_size,)))
        for inp in input:
            carry = self.cell(inp, carry)
        return jax.nn.sigmoid(self.linear(carry[0]) + self.bias)


# -- the stateful example, behind a convolution


class ConvNet(eqx.Module):
    """Equinox's stateful example (BatchNorm, SpectralNorm) with a Conv2d and
    its BatchNorm in front; run under `jax.vmap(..., axis_name="batch")`."""

    conv: eqx.nn.Conv2d
    conv_norm: eqx.nn.BatchNorm
    norm1: eqx.nn.BatchNorm
    spectral_linear: eqx.nn.SpectralNorm[eqx.nn.Linear]
    norm2: eqx.nn.BatchNorm
    linear1: eqx.nn.Linear
    linear2: eqx.nn.Linear

    def __init__(self, key):
        keys = jax.random.split(key, 5)
        self.conv = eqx.nn.Conv2d(1, 4, kernel_size=3, padding=1, key=keys[0])
        self.conv_norm = eqx.nn.BatchNorm(4, axis_name="batch", mode="ema")
        self.norm1 = eqx.nn.BatchNorm(input_size=4, axis_name="batch", mode="ema")
        self.spectral_linear = eqx.nn.SpectralNorm(
            layer=eqx.nn.Linear(in_features=4, out_features=8, key=keys[1]),
            weight_name="weight",
            key=keys[2],
        )
        self.norm2 = eqx.nn.BatchNorm(input_size=8, axis_name="batch", mode="ema")
        self.linear1 = eqx.nn.Linear(in_features=8, out_features=8, key=keys[3])
        self.linear2 = eqx.nn.Linear(in_features=8, out_features=3, key=keys[4])

    def __call__(self, x, state):
        x = self.conv(x)
        x, state = self.conv_norm(x, state)
        x = jnp.mean(jax.nn.relu(x), axis=(1, 2))
        x, state = self.norm1(x, state)
        x, state = self.spectral_linear(x, state)
        x = jax.nn.relu(x)
        x, state = self.norm2(x, state)
        x = self.linear1(x)
        x = jax.nn.relu(x)
        x = self.linear2(x)
        return x, state


# -- the zoo


def _cross_entropy(labels):
    def loss(logits):
        logp = jax.nn.log_softmax(logits)
        return -jnp.mean(jnp.take_along_axis(logp, labels[:, None], axis=1))

    return loss


def _mse(y):
    return jnp.mean(jnp.square(y - 0.5))


@dataclasses.dataclass(frozen=True)
class Jvp:
    """An `Offset` at one submodule (`where`), which bridge sees as `sites`.

    `shape` is the offset's per-call shape (a pytree); `mapped`, the number of
    the model's own mapped axes between the batch axis and the call's value;
    `leaves`, where the library slices a wrapped function's array leaves
    (eqx.nn.MLP's activation: per layer, then per neuron), their full shape.
    `full(k, delta, gain, activation)` is the k-th site's offset over `t`.
    """

    sites: tuple[str, ...]
    where: Callable
    shape: Any
    mapped: int = 0
    leaves: tuple[int, ...] | None = None
    full: Callable | None = None


class Offset(eqx.Module):
    """Adds `t * (delta + gain * output)` to a submodule's output (the value,
    for a stateful layer's `(value, state)`)."""

    inner: Any
    t: Any
    delta: Any
    gain: Any

    def __call__(self, *args, **kwargs):
        out = self.inner(*args, **kwargs)
        stateful = (
            isinstance(out, tuple)
            and len(out) == 2
            and isinstance(out[1], eqx.nn.State)
        )
        value = out[0] if stateful else out
        value = jax.tree.map(
            lambda v, d, g: v + self.t * (d + g * v), value, self.delta, self.gain
        )
        return (value, out[1]) if stateful else value


@dataclasses.dataclass(frozen=True, eq=False)
class Zoo:
    model: Any
    state: Any
    args: tuple  # batched
    loss_fn: Callable
    jvps: tuple[Jvp, ...]

    def probe(self):
        variables = () if self.state is None else (self.state,)
        return bridge.probe(self.model, *variables, vmap=True)

    def loss(self, model):
        """The loss of the user's own batched call of `model` (and new state)."""
        if self.state is None:
            return self.loss_fn(jax.vmap(model)(*self.args)), None
        batched = jax.vmap(
            model, axis_name="batch", in_axes=(0, None), out_axes=(0, None)
        )
        out, state = batched(*self.args, self.state)
        return self.loss_fn(out), state


@functools.cache
def _build(name: str) -> Zoo:
    key = jax.random.key(0)
    if name == "bert":
        token_ids = jnp.array([[3, 5, 7, 2, 0, 0], [4, 9, 1, 8, 6, 0]])
        segment_ids = jnp.array([[0, 0, 0, 1, 1, 1], [0, 0, 1, 1, 1, 1]])
        layer = "encoder/layers/1/attention_block/rope_embeddings"
        return Zoo(
            BertClassifier(key),
            None,
            (token_ids, segment_ids),
            _cross_entropy(jnp.array([0, 2])),
            (
                Jvp(
                    ("encoder/embedder_block",),
                    lambda m: m.encoder.embedder_block,
                    (6, 8),
                ),
                Jvp(
                    ("encoder/layers/0/ff_block",),
                    lambda m: m.encoder.layers[0].ff_block,
                    (8,),
                    mapped=1,  # tokens
                ),
                Jvp(
                    (layer, f"{layer}#1"),  # queries, then keys
                    lambda m: m.encoder.layers[1].attention_block.rope_embeddings,
                    (6, 4),
                    mapped=1,  # heads
                ),
            ),
        )
    if name in ("rnn", "rnn-unrolled"):
        model = (RNN if name == "rnn" else UnrolledRNN)(3, 2, 8, key=key)
        xs = jax.random.normal(jax.random.key(1), (2, 5, 3))
        return Zoo(
            model,
            None,
            (xs,),
            _mse,
            (
                Jvp(
                    ("cell", *(f"cell#{k}" for k in range(1, 5))),  # every step
                    lambda m: m.cell,
                    ((8,), (8,)),
                ),
                Jvp(("linear",), lambda m: m.linear, (2,)),
            ),
        )
    if name in ("convnet-train", "convnet-eval"):
        model, state = eqx.nn.make_with_state(ConvNet)(key)
        if name == "convnet-eval":
            model = eqx.nn.inference_mode(model)
            state = _trained_state(model, state)
        x = jax.random.normal(jax.random.key(1), (4, 1, 8, 8))
        return Zoo(
            model,
            state,
            (x,),
            _cross_entropy(jnp.array([0, 1, 2, 1])),
            (
                Jvp(("conv_norm",), lambda m: m.conv_norm, (4, 8, 8)),
                Jvp(("spectral_linear",), lambda m: m.spectral_linear, (8,)),
                Jvp(("linear1",), lambda m: m.linear1, (8,)),
            ),
        )
    if name == "mlp":
        model = eqx.nn.MLP(4, 3, 8, depth=3, activation=jax.nn.gelu, key=key)
        x = jax.random.normal(jax.random.key(1), (5, 4))
        return Zoo(
            model,
            None,
            (x,),
            _mse,
            (
                Jvp(("layers/1",), lambda m: m.layers[1], (8,)),
                Jvp(
                    ("activation", "activation#1", "activation#2"),
                    lambda m: m.activation,
                    (),
                    leaves=(3, 8),  # (layers, neurons): row k at layer k
                    full=lambda k, d, g, a: d[:, k] + g[k][None] * a,
                ),
            ),
        )
    raise KeyError(name)


def _trained_state(model, state):
    """Moving averages that are not init's: one training step's state."""
    train = eqx.nn.inference_mode(model, value=False)
    x = jax.random.normal(jax.random.key(2), (4, 1, 8, 8))
    batched = jax.vmap(train, axis_name="batch", in_axes=(0, None), out_axes=(0, None))
    return batched(x, state)[1]


MODELS = ["bert", "rnn-unrolled", "convnet-train", "convnet-eval", "mlp"]


def _model_params(models=MODELS):
    """One xdist group per model: one worker builds and compiles it once."""
    return [
        pytest.param(m, marks=pytest.mark.xdist_group(f"zoo-equinox-{m}"))
        for m in models
    ]


# -- the references: Equinox's own calls, never bridge


def _is_shape(s):
    return isinstance(s, tuple) and all(isinstance(n, int) for n in s)


def _random(shape, seed):
    """Random normal leaves shaped like `shape`, a pytree of shape tuples."""
    shapes, treedef = jax.tree.flatten(shape, is_leaf=_is_shape)
    keys = jax.random.split(jax.random.key(seed), len(shapes))
    return jax.tree.unflatten(
        treedef, [jax.random.normal(k, s) for k, s in zip(keys, shapes, strict=True)]
    )


def _offsets(zoo: Zoo, spec: Jvp, seed: int):
    """`delta` per example (batch first) and `gain` per call."""
    batch = jax.tree.leaves(zoo.args)[0].shape[0]
    per_call = spec.shape if spec.leaves is None else spec.leaves
    shape = jax.tree.map(lambda s: (batch, *s), per_call, is_leaf=_is_shape)
    return _random(shape, seed), _random(per_call, seed + 1)


def _offset_loss(zoo: Zoo, spec: Jvp, delta, gain, t):
    """The loss with `Offset` put in by `eqx.tree_at`, per example."""
    sub = spec.where(zoo.model)
    t_leaf = t if spec.leaves is None else jnp.full(spec.leaves, t)

    def one(d, *args):
        model = eqx.tree_at(spec.where, zoo.model, Offset(sub, t_leaf, d, gain))
        return model(*args)

    if zoo.state is None:
        out = jax.vmap(one)(delta, *zoo.args)
    else:
        batched = jax.vmap(
            one, axis_name="batch", in_axes=(0, 0, None), out_axes=(0, None)
        )
        out, _ = batched(delta, *zoo.args, zoo.state)
    return zoo.loss_fn(out)


def _full(spec: Jvp, k: int, delta, gain, activation):
    """The offset at the spec's k-th site, in the site's shape: `delta` does
    not vary along the model's own mapped axes, `gain * output` does."""
    if spec.full is not None:
        return spec.full(k, delta, gain, activation)

    def one(d, g, a):
        d = d.reshape(d.shape[:1] + (1,) * spec.mapped + d.shape[1:])
        return jnp.broadcast_to(d, a.shape) + jnp.broadcast_to(g, a.shape) * a

    return jax.tree.map(one, delta, gain, activation)


@dataclasses.dataclass
class Expected:
    loss: Any
    grads: Any
    state: Any
    offsets: list  # (delta, gain) per jvp
    jvps: list


@functools.cache
def _expected(name: str) -> Expected:
    zoo = _build(name)
    offsets = [_offsets(zoo, spec, 10 * i) for i, spec in enumerate(zoo.jvps)]

    def compute(model):
        (loss, state), grads = eqx.filter_value_and_grad(zoo.loss, has_aux=True)(model)
        jvps = [
            jax.jvp(
                lambda t, spec=spec, d=d, g=g: _offset_loss(zoo, spec, d, g, t),
                (jnp.float32(0),),
                (jnp.float32(1),),
            )[1]
            for spec, (d, g) in zip(zoo.jvps, offsets, strict=True)
        ]
        return loss, grads, state, jvps

    loss, grads, state, jvps = eqx.filter_jit(compute)(zoo.model)
    return Expected(loss, grads, state, offsets, jvps)


def _submodule(model, site: str):
    node = model
    for part in site.partition("#")[0].split("/"):
        node = node[int(part)] if part.isdigit() else getattr(node, part)
    return node


def _recall(zoo: Zoo, site: str, inputs: tuple, activation):
    """The site's submodule called here on the recorded inputs, under as many
    `jax.vmap`s as make its output the site's shape; None where the call took
    keywords that `inputs` does not hold."""
    sub = _submodule(zoo.model, site)
    if not inputs:  # called with keywords only (MultiheadAttention here)
        return None
    if site == "spectral_linear/layer":  # called with a normalised weight
        return None
    kwargs = {"inference": True} if isinstance(sub, eqx.nn.Dropout) else {}
    stateful = isinstance(sub, eqx.nn.StatefulLayer) and sub.is_stateful()
    if stateful:  # `(x, state)`: the state as it was at this call, unmapped
        activation = _value(activation)
        inputs = (inputs[0], jax.tree.map(lambda a: a[0], inputs[1]))
    axes = tuple(
        None if a is None or isinstance(a, eqx.nn.State) else 0 for a in inputs
    )
    for depth in (1, 2, 3):
        f = lambda *a: sub(*a, **kwargs)
        for level in range(depth):
            outer = level == depth - 1
            f = jax.vmap(
                f,
                in_axes=axes,
                out_axes=(0, None) if stateful else 0,
                axis_name="batch" if stateful and outer else None,
            )
        try:
            shape = jax.eval_shape(f, *inputs)
        except Exception:  # the wrong number of vmaps
            continue
        value = shape[0] if stateful else shape
        if jax.tree.map(lambda s: s.shape, value) == jax.tree.map(
            jnp.shape, activation
        ):
            out = f(*inputs)
            return out[0] if stateful else out
    raise AssertionError(f"no number of vmaps gives {site}'s shape")


def _value(site_value):
    """A stateful layer's site holds `(value, None)`: its state is left out."""
    if isinstance(site_value, tuple) and len(site_value) == 2 and site_value[1] is None:
        return site_value[0]
    return site_value


# -- the tests


def _run(zoo: Zoo, mode: str, **options):
    return value_and_grad_in(mode, zoo.probe(), zoo.loss_fn, zoo.args, options)


@functools.cache
def _result(name: str, mode: str):
    """The probe at every site, with inputs: computed once per model and mode."""
    return _run(_build(name), mode, with_inputs=True)


def _recall_all(zoo: Zoo, res) -> dict[str, Any]:
    """`_recall` at every site, in one jitted call (op by op it costs seconds)."""

    def recall(inputs, activations):
        return {
            site: _recall(zoo, site, inputs[site], activation)
            for site, activation in activations.items()
        }

    return jax.jit(recall)(res.inputs, res.activations)


MODES = [pytest.param("eager", marks=pytest.mark.slow), "jit"]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", _model_params())
def test_every_site_equals_plain_equinox(name, mode):
    zoo = _build(name)
    res = _result(name, mode)
    expected = _expected(name)

    assert_equals_plain(
        res,
        expected.loss,
        expected.grads,
        None if zoo.state is None else expected.state,
    )

    # Every site: its value is its submodule's output on its recorded inputs.
    sites = zoo.probe().sites(*zoo.args)
    assert sorted(res.activations) == sorted(sites)
    assert sorted(res.activation_grads) == sorted(sites)
    recalled_all = _recall_all(zoo, res)
    for site, activation in res.activations.items():
        assert jax.tree.map(jnp.shape, activation) == jax.tree.map(
            lambda s: s.shape, sites[site]
        ), site
        recalled = recalled_all[site]
        if recalled is not None:
            assert_tree_allclose(recalled, _value(activation), rtol=1e-4, atol=1e-5)

    for spec, (delta, gain), jvp in zip(
        zoo.jvps, expected.offsets, expected.jvps, strict=True
    ):
        got = sum(
            tree_vdot(
                _value(res.activation_grads[site]),
                _full(spec, k, delta, gain, _value(res.activations[site])),
            )
            for k, site in enumerate(spec.sites)
        )
        np.testing.assert_allclose(
            got, jvp, rtol=2e-3, atol=1e-6, err_msg=spec.sites[0]
        )


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.xdist_group("zoo-equinox-bert")
def test_bert_sites_equal_a_forward_pass_written_from_its_blocks(mode):
    zoo = _build("bert")
    res = _result("bert", mode)
    values = jax.vmap(functools.partial(_bert_forward, zoo.model))(*zoo.args)
    for site, value in values.items():
        np.testing.assert_allclose(
            res.activations[site], value, rtol=1e-4, atol=1e-5, err_msg=site
        )


@pytest.mark.xdist_group("zoo-equinox-bert")
def test_bert_sites_are_what_a_researcher_expects():
    zoo = _build("bert")
    sites = zoo.probe().sites(*zoo.args)
    names = list(sites)
    layer = "encoder/layers/0"
    attention = f"{layer}/attention_block/attention"
    assert names[:4] == [
        "encoder",
        "encoder/embedder_block",
        "encoder/embedder_block/token_embedder",
        "encoder/embedder_block/segment_embedder",
    ]
    assert names[-2:] == ["encoder/pooler", "classifier_head"]
    # Per-token sites inside the model's own vmaps: (batch, tokens, features).
    for site in ("query_proj", "key_proj", "value_proj", "output_proj"):
        assert sites[f"{attention}/{site}"].shape == (2, 6, 8)
    assert sites["encoder/embedder_block/token_embedder"].shape == (2, 6, 8)
    assert sites[f"{layer}/ff_block"].shape == (2, 6, 8)
    assert sites[f"{layer}/ff_block/mlp"].shape == (2, 6, 16)
    # RoPE per head, for the queries then the keys: (batch, heads, tokens, size).
    rope = f"{layer}/attention_block/rope_embeddings"
    assert sites[rope].shape == sites[f"{rope}#1"].shape == (2, 2, 6, 4)
    assert (
        names.index(f"{attention}/value_proj")
        < names.index(rope)
        < names.index(f"{rope}#1")
        < names.index(f"{attention}/output_proj")
    )
    assert sites[f"{attention}/dropout"].shape == (2, 2, 6, 6)  # the weights
    assert sites["encoder"]["embeddings"].shape == (2, 6, 8)


@pytest.mark.xdist_group("zoo-equinox-rnn-unrolled")
def test_the_rnn_example_is_a_site_per_step_as_its_unrolled_twin():
    """Equinox's RNN example closes over its cell in `lax.scan`, which counts
    its iterations while a probe runs: the cell is one site of every step,
    `(steps, batch, hidden)`, equal step by step to the unrolled twin's
    `cell#k` (whose gradients this zoo checks against a `jax.jvp` of the
    twin with the step's output perturbed by hand), eager and jitted."""
    scanned, unrolled = _build("rnn"), _build("rnn-unrolled")
    reference = unrolled.probe().value_and_grad(unrolled.loss_fn, *unrolled.args)
    steps = ["cell", *(f"cell#{k}" for k in range(1, 5))]

    def run(probe, xs):
        return probe.value_and_grad(scanned.loss_fn, xs)

    probe = scanned.probe()
    for res in (run(probe, *scanned.args), jax.jit(run)(probe, *scanned.args)):
        np.testing.assert_allclose(res.loss, reference.loss, rtol=1e-6)
        for field in ("activations", "activation_grads"):
            stacked = jax.tree.leaves(getattr(res, field)["cell"])
            for step, name in enumerate(steps):
                twin = jax.tree.leaves(getattr(reference, field)[name])
                for got, want in zip(stacked, twin, strict=True):
                    scale = float(np.max(np.abs(want))) or 1.0
                    np.testing.assert_allclose(
                        got[step], want, rtol=1e-5, atol=1e-6 * scale
                    )


@pytest.mark.xdist_group("zoo-equinox-rnn-unrolled")
def test_the_rnn_example_probes_its_head_outside_the_scan():
    zoo = _build("rnn")
    res = jax.jit(lambda p, xs: p.value_and_grad(zoo.loss_fn, xs, at="linear"))(
        zoo.probe(), *zoo.args
    )
    (loss, _), grads = eqx.filter_value_and_grad(zoo.loss, has_aux=True)(zoo.model)
    np.testing.assert_allclose(res.loss, loss, rtol=1e-5)
    assert_tree_allclose(res.grads, grads, rtol=1e-4, atol=1e-6)


@pytest.mark.xdist_group("zoo-equinox-rnn-unrolled")
def test_the_unrolled_rnn_has_one_site_per_step():
    zoo = _build("rnn-unrolled")
    sites = zoo.probe().sites(*zoo.args)
    assert list(sites) == [
        "cell",
        "cell#1",
        "cell#2",
        "cell#3",
        "cell#4",
        "linear",
    ]
    h, c = sites["cell#4"]
    assert h.shape == c.shape == (2, 8)


@pytest.mark.xdist_group("zoo-equinox-convnet-train")
def test_convnet_sites_are_the_stateful_layers_values():
    zoo = _build("convnet-train")
    sites = zoo.probe().sites(*zoo.args)
    assert list(sites) == [
        "conv",
        "conv_norm",
        "norm1",
        "spectral_linear",
        "spectral_linear/layer",
        "norm2",
        "linear1",
        "linear2",
    ]
    # A stateful layer's site holds its value; its state is left out.
    assert sites["conv"].shape == sites["conv_norm"][0].shape == (4, 4, 8, 8)
    assert sites["conv_norm"][1] is None
    assert sites["spectral_linear"][0].shape == (4, 8)
    # SpectralNorm calls its layer with the normalised weight: the layer's
    # value is the SpectralNorm's.
    res = _result("convnet-train", "jit")
    np.testing.assert_array_equal(
        res.activations["spectral_linear/layer"], res.activations["spectral_linear"][0]
    )


@pytest.mark.xdist_group("zoo-equinox-mlp")
def test_mlp_sites_expose_the_hidden_activations():
    zoo = _build("mlp")
    sites = zoo.probe().sites(*zoo.args)
    assert list(sites) == [
        "layers/0",
        "activation",
        "layers/1",
        "activation#1",
        "layers/2",
        "activation#2",
        "layers/3",
        "final_activation",
    ]
    assert sites["activation#1"].shape == (5, 8)
