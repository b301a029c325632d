"""Model zoo, Flax NNX: library modules composed as the Flax guides do, and a
real NNX model from a package.

- `transformer`: token embedding, a pre-norm block with
  `nnx.MultiHeadAttention(decode=False)` and an `nnx.Sequential` MLP, a head;
- `cnn-train`: the Flax MNIST tutorial's CNN (Conv, BatchNorm, Dropout,
  average pooling, Linear), shrunk to 8x8 images, in training mode
  (`model.train()`), dropout keys from an `nnx.Rngs` passed to the call;
- `mamba2`: `mamba2_jax.Mamba2ForCausalLM` (PyPI `mamba2-jax`, pure NNX) from
  a tiny `Mamba2Config`, skipped where the package is not installed;
- `rnn`: `nnx.RNN` over `nnx.LSTMCell`: the cell is carried by the RNN's
  `nnx.scan`, so its sites hold every time step.

Every number is checked against a reference that does not go through bridge:

- loss, parameter gradients and the updated state: `jax.value_and_grad` of
  a plain NNX call on `nnx.merge` of the model's own split state;
- activations: NNX's own `nnx.capture(..., method_outputs=nnx.Intermediate)`;
- activation gradients: `jax.jacfwd` of the loss in one scalar per site,
  where this file swaps the site's module on a private merged copy for a
  wrapper module that adds `t * delta` to its output; `vdot(activation_grad,
  delta)` must equal that directional derivative.

The default tier runs the probe under `jax.jit`; its eager runs are the slow
tier (the references are jitted in both).
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cases.nnx import captured_outputs
from flax import nnx
from helpers import (
    assert_activations_equal_recorded,
    assert_directional_derivatives,
    assert_sites_shaped_like_recorded,
    float_leaves,
    value_and_grad_in,
)

import bridge


@pytest.fixture(autouse=True)
def _allow_rank_promotion_in_mamba2(request):
    """mamba2_jax broadcasts by rank promotion (`RMSNorm` multiplies
    `(batch, seq, features)` by `(features,)`), which the suite's
    `jax_numpy_rank_promotion="raise"` refuses; the modules written here keep it."""
    if "mamba2" in request.node.name:
        with jax.numpy_rank_promotion("allow"):
            yield
    else:
        yield


# -- the models ----------------------------------------------------------------


class Block(nnx.Module):
    """A pre-norm transformer block as the NNX guides write one."""

    def __init__(self, dim, heads, *, rngs):
        self.norm1 = nnx.LayerNorm(dim, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(
            num_heads=heads, in_features=dim, qkv_features=dim, decode=False, rngs=rngs
        )
        self.norm2 = nnx.LayerNorm(dim, rngs=rngs)
        self.mlp = nnx.Sequential(
            nnx.Linear(dim, 2 * dim, rngs=rngs),
            nnx.gelu,
            nnx.Linear(2 * dim, dim, rngs=rngs),
        )

    def __call__(self, x, mask=None):
        x = x + self.attn(self.norm1(x), mask=mask)
        return x + self.mlp(self.norm2(x))


class Transformer(nnx.Module):
    def __init__(self, vocab=50, dim=16, heads=2, classes=3, *, rngs):
        self.embed = nnx.Embed(vocab, dim, rngs=rngs)
        self.block = Block(dim, heads, rngs=rngs)
        self.norm = nnx.LayerNorm(dim, rngs=rngs)
        self.head = nnx.Linear(dim, classes, rngs=rngs)

    def __call__(self, ids, mask):
        x = self.block(self.embed(ids), mask=nnx.make_attention_mask(mask, mask))
        return self.head(self.norm(x).mean(axis=1))


class CNN(nnx.Module):
    """The Flax MNIST tutorial's CNN, for 8x8 single-channel images."""

    def __init__(self, *, rngs):
        self.conv1 = nnx.Conv(1, 4, kernel_size=(3, 3), rngs=rngs)
        self.batch_norm1 = nnx.BatchNorm(4, rngs=rngs)
        self.dropout1 = nnx.Dropout(rate=0.1)
        self.conv2 = nnx.Conv(4, 8, kernel_size=(3, 3), rngs=rngs)
        self.batch_norm2 = nnx.BatchNorm(8, rngs=rngs)
        self.avg_pool = functools.partial(
            nnx.avg_pool, window_shape=(2, 2), strides=(2, 2)
        )
        self.linear1 = nnx.Linear(2 * 2 * 8, 16, rngs=rngs)
        self.dropout2 = nnx.Dropout(rate=0.1)
        self.linear2 = nnx.Linear(16, 3, rngs=rngs)

    def __call__(self, x, rngs=None):
        x = self.avg_pool(
            nnx.relu(self.batch_norm1(self.dropout1(self.conv1(x), rngs=rngs)))
        )
        x = self.avg_pool(nnx.relu(self.batch_norm2(self.conv2(x))))
        x = x.reshape(x.shape[0], -1)
        x = nnx.relu(self.dropout2(self.linear1(x), rngs=rngs))
        return self.linear2(x)


class Recurrent(nnx.Module):
    def __init__(self, *, rngs):
        self.rnn = nnx.RNN(nnx.LSTMCell(4, 6, rngs=rngs))
        self.head = nnx.Linear(6, 2, rngs=rngs)

    def __call__(self, x):
        return self.head(self.rnn(x)[:, -1])


def _cross_entropy(labels, logits_of=lambda out: out):
    def loss_fn(out):
        logp = jax.nn.log_softmax(logits_of(out))
        picked = jnp.take_along_axis(logp, labels[..., None], axis=-1)
        return -jnp.mean(picked)

    return loss_fn


# name -> model, args, a factory of the call's keywords, loss, jvp sites
@functools.cache
def build(name):
    keys = jax.random.split(jax.random.key(3), 3)
    call_kwargs = dict
    if name == "transformer":
        model = Transformer(rngs=nnx.Rngs(0))
        ids = jax.random.randint(keys[0], (2, 6), 0, 50)
        mask = jnp.ones((2, 6), bool).at[1, 4:].set(False)
        args = (ids, mask)
        loss_fn = _cross_entropy(jnp.array([0, 2]))
        jvp_sites = ("block/attn/query", "block/attn", "block/mlp/layers/0")
    elif name == "cnn-train":
        model = CNN(rngs=nnx.Rngs(0))
        model.train()
        args = (jax.random.normal(keys[0], (4, 8, 8, 1)),)

        def call_kwargs():
            return {"rngs": nnx.Rngs(dropout=5)}

        loss_fn = _cross_entropy(jnp.array([0, 1, 2, 1]))
        jvp_sites = ("conv1", "batch_norm2", "dropout2")
    elif name == "mamba2":
        mamba2_jax = pytest.importorskip("mamba2_jax")
        config = mamba2_jax.Mamba2Config(
            vocab_size=50,
            hidden_size=16,
            state_size=8,
            head_dim=8,
            chunk_size=4,  # two chunks of the eight tokens
            num_hidden_layers=2,
        )
        model = mamba2_jax.Mamba2ForCausalLM(config, rngs=nnx.Rngs(0))
        ids = jax.random.randint(keys[0], (2, 8), 0, 50)
        args = (ids,)
        loss_fn = _cross_entropy(ids[:, 1:], lambda out: out["logits"][:, :-1])
        jvp_sites = (
            "backbone/layers/0/mixer/in_proj",
            "backbone/layers/0/mixer/conv1d",  # a tuple, (output, conv state)
            "backbone/layers/1",  # (hidden, conv state, ssm state)
        )
    elif name == "rnn":
        model = Recurrent(rngs=nnx.Rngs(0))
        args = (jax.random.normal(keys[0], (2, 5, 4)),)
        loss_fn = _cross_entropy(jnp.array([0, 1]))
        jvp_sites = ("rnn/cell", "head")
    else:
        raise ValueError(name)
    return SimpleNamespace(
        model=model,
        args=args,
        call_kwargs=call_kwargs,
        loss_fn=loss_fn,
        jvp_sites=jvp_sites,
    )


VARIANTS = ["transformer", "cnn-train", "mamba2"]


def _variants(modes=("jit", "eager")):
    params = []
    for name in VARIANTS:
        group = pytest.mark.xdist_group(f"zoo-nnx-{name}")
        for mode in modes:
            marks = [group] + ([pytest.mark.slow] if mode == "eager" else [])
            params.append(pytest.param(name, mode, marks=marks, id=f"{name}-{mode}"))
    return params


# -- the references: NNX and JAX alone, no bridge ----------------------------------


def _add_to_float_leaves(value, deltas):
    deltas = iter(deltas)
    return jax.tree.map(
        lambda x: x + next(deltas) if jnp.issubdtype(x.dtype, jnp.inexact) else x,
        value,
    )


def _split(name):
    """The model's own split, of a clone: nothing here touches the user's model."""
    return nnx.split(nnx.clone(build(name).model), nnx.Param, ...)


@functools.cache
def reference(name):
    m = build(name)
    graphdef, params, rest = _split(name)

    @jax.jit
    def plain(params, rest):  # what NNX users write: `nnx.value_and_grad`
        model = nnx.merge(graphdef, params, rest)
        loss, grads = nnx.value_and_grad(
            lambda model: m.loss_fn(model(*m.args, **m.call_kwargs()))
        )(model)
        return (loss, nnx.state(model, nnx.Not(nnx.Param))), grads

    @jax.jit
    def captured(params, rest):
        model = nnx.merge(graphdef, params, rest)
        _, intermediates = nnx.capture(
            model, nnx.Intermediate, method_outputs=nnx.Intermediate
        )(*m.args, **m.call_kwargs())
        return intermediates

    (loss, state), grads = plain(params, rest)
    return SimpleNamespace(
        loss=loss,
        grads=grads,
        state=state,
        activations=captured_outputs(captured(params, rest)),
    )


def _offset(inner, deltas):
    """A module that calls `inner` and adds `deltas` to its output's float leaves."""

    class Offset(nnx.Module):
        def __init__(self):
            self.inner = inner

        def __call__(self, *args, **kwargs):
            return _add_to_float_leaves(self.inner(*args, **kwargs), deltas)

    return Offset()


def _replace(model, path, make):
    *parents, last = path.split("/")
    node = model
    for part in parents:
        node = node[int(part)] if part.isdigit() else getattr(node, part)
    if last.isdigit():
        node[int(last)] = make(node[int(last)])
    else:
        setattr(node, last, make(getattr(node, last)))


@functools.cache
def jvp_reference(name):
    """`(deltas, d loss(t) / d t_i)` with `t_i * delta_i` added at site i."""
    m = build(name)
    graphdef, params, rest = _split(name)
    captured = reference(name).activations
    keys = jax.random.split(jax.random.key(11), len(m.jvp_sites))
    deltas = [
        [jax.random.normal(k, x.shape, x.dtype) for x in float_leaves(captured[s])]
        for s, k in zip(m.jvp_sites, keys, strict=True)
    ]

    def loss_along(t, params, rest):
        # A copy made inside the differentiated function: a training-mode
        # BatchNorm updates its statistics at this trace level.
        model = nnx.merge(graphdef, params, rest, copy=True)
        for i, site in enumerate(m.jvp_sites):
            _replace(
                model,
                site,
                lambda inner, i=i: _offset(inner, [t[i] * d for d in deltas[i]]),
            )
        return m.loss_fn(model(*m.args, **m.call_kwargs()))

    t = jnp.zeros(len(m.jvp_sites))
    return deltas, jax.jit(jax.jacfwd(loss_along))(t, params, rest)


# -- the probe -------------------------------------------------------------------


@functools.cache
def probed(name, mode):
    m = build(name)

    probe = bridge.probe(m.model)
    return value_and_grad_in(mode, probe, m.loss_fn, m.args, m.call_kwargs())


def _sites(name):
    m = build(name)
    return bridge.probe(m.model).sites(*m.args, **m.call_kwargs())


# -- tests -----------------------------------------------------------------------


@pytest.mark.xdist_group("zoo-nnx-transformer")
def test_transformer_sites_are_attribute_paths_in_call_order():
    sites = _sites("transformer")
    assert list(sites) == [
        "embed",
        "block",
        "block/norm1",
        "block/attn",
        "block/attn/query",
        "block/attn/key",
        "block/attn/value",
        "block/attn/out",
        "block/norm2",
        "block/mlp",
        "block/mlp/layers/0",  # `nnx.gelu`, layers/1, is a function
        "block/mlp/layers/2",
        "norm",
        "head",
    ]
    assert sites["block/attn/query"].shape == (2, 6, 2, 8)  # (..., heads, head dim)


@pytest.mark.xdist_group("zoo-nnx-cnn-train")
def test_cnn_sites_are_attribute_paths_in_call_order():
    assert list(_sites("cnn-train")) == [
        "conv1",
        "dropout1",
        "batch_norm1",
        "conv2",
        "batch_norm2",
        "linear1",
        "dropout2",
        "linear2",
    ]


@pytest.mark.xdist_group("zoo-nnx-mamba2")
def test_mamba2_sites_are_attribute_paths_in_call_order():
    sites = _sites("mamba2")
    layer = ["", "/norm", "/mixer", "/mixer/in_proj", "/mixer/conv1d"]
    layer += ["/mixer/norm", "/mixer/out_proj"]
    assert list(sites) == [
        "backbone",
        "backbone/embedder",
        *(f"backbone/layers/{i}{s}" for i in range(2) for s in layer),
        "backbone/final_norm",
    ]
    # A block returns (hidden states, conv state, SSM state).
    hidden, conv, ssm = sites["backbone/layers/1"]
    assert (hidden.shape, conv.shape, ssm.shape) == (
        (2, 8, 16),
        (2, 48, 3),
        (2, 4, 8, 8),
    )


@pytest.mark.parametrize(
    "name",
    [pytest.param(n, marks=pytest.mark.xdist_group(f"zoo-nnx-{n}")) for n in VARIANTS],
)
def test_sites_are_what_nnx_capture_records(name):
    assert_sites_shaped_like_recorded(_sites(name), reference(name).activations)


@pytest.mark.parametrize(("name", "mode"), _variants())
def test_loss_parameter_gradients_and_state_equal_plain_nnx(name, mode):
    res, ref = probed(name, mode), reference(name)
    np.testing.assert_allclose(res.loss, ref.loss, rtol=1e-5)
    assert jax.tree.structure(res.grads) == jax.tree.structure(ref.grads)
    for got, want in zip(
        jax.tree.leaves(res.grads), jax.tree.leaves(ref.grads), strict=True
    ):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)
    want_state = jax.tree.leaves(ref.state)
    got_state = jax.tree.leaves(res.state) if res.state is not None else []
    assert len(got_state) == len(want_state)
    for got, want in zip(got_state, want_state, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    if name == "cnn-train":  # training mode: the batch statistics moved
        assert want_state and not np.allclose(
            res.state["batch_norm1"]["mean"][...], 0.0
        )


@pytest.mark.parametrize(("name", "mode"), _variants())
def test_activations_equal_nnx_capture(name, mode):
    assert_activations_equal_recorded(probed(name, mode), reference(name).activations)


@pytest.mark.parametrize(("name", "mode"), _variants())
def test_activation_gradients_equal_jvp_of_a_hand_inserted_offset(name, mode):
    deltas, directional = jvp_reference(name)
    assert_directional_derivatives(
        probed(name, mode), build(name).jvp_sites, deltas, directional
    )


# -- nnx.RNN ---------------------------------------------------------------------


def _unrolled_rnn_loss(model, x, offsets=None):
    """`Recurrent` with its `nnx.RNN` scan written as a Python loop over time,
    calling the same `LSTMCell`; `offsets[i]` is added to step i's output."""
    cell = model.rnn.cell
    carry = cell.initialize_carry(x[:, 0].shape, nnx.Rngs(0))
    ys = []
    for i in range(x.shape[1]):
        out = cell(carry, x[:, i])
        if offsets is not None:
            out = _add_to_float_leaves(out, offsets[i])
        carry, y = out
        ys.append(y)
    return build("rnn").loss_fn(model.head(ys[-1]))


@pytest.mark.xdist_group("zoo-nnx-rnn")
def test_the_unrolled_reference_loop_is_the_rnn_model():
    m = build("rnn")
    (x,) = m.args
    np.testing.assert_allclose(
        _unrolled_rnn_loss(nnx.clone(m.model), x), m.loss_fn(m.model(x)), rtol=1e-6
    )


@pytest.mark.xdist_group("zoo-nnx-rnn")
def test_rnn_cell_site_stacks_the_time_steps_and_equals_the_unrolled_loop():
    m = build("rnn")
    (x,) = m.args
    probe = bridge.probe(m.model)
    sites = probe.sites(x)
    # Every module call is a site (DESIGN): the cell's `initialize_carry`,
    # called by the RNN before its scan, and the cell's gate projections.
    gates = ("ii", "hi", "if_", "hf", "ig", "hg", "io", "ho")
    assert list(sites) == [
        "rnn",
        "rnn/cell.initialize_carry",
        "rnn/cell",
        *(f"rnn/cell/{gate}" for gate in gates),
        "head",
    ]
    steps = x.shape[1]
    (c, h), y = sites["rnn/cell"]
    assert c.shape == h.shape == y.shape == (steps, 2, 6)
    res = jax.jit(lambda p: p.value_and_grad(m.loss_fn, x))(probe)
    delta = jax.tree.map(
        lambda s: jax.random.normal(jax.random.key(4), s.shape), sites["rnn/cell"]
    )
    per_step = [
        jax.tree.leaves(jax.tree.map(lambda d, i=i: d[i], delta)) for i in range(steps)
    ]
    _, expected = jax.jvp(
        lambda t: _unrolled_rnn_loss(
            nnx.clone(m.model), x, [[t * d for d in step] for step in per_step]
        ),
        (0.0,),
        (1.0,),
    )
    got = sum(
        jnp.vdot(g, d)
        for g, d in zip(
            jax.tree.leaves(res.activation_grads["rnn/cell"]),
            jax.tree.leaves(delta),
            strict=True,
        )
    )
    np.testing.assert_allclose(got, expected, rtol=2e-4, atol=1e-6)
