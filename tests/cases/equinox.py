"""Equinox models for the conformance suite, with independent references.

Each model comes with a forward pass written out by hand, through the same
submodules, with a hook at every site: the hook adds a perturbation at one
site (for `jax.jvp`) or records every site's value. Where the model applies a
layer per token with its own `jax.vmap`, the hand-written pass applies it to
all tokens at once and hooks the whole `(tokens, features)` value, so a
per-token perturbation is an ordinary addition: nothing is shared with the
adapter's mechanism. The loss and parameter gradients come from the unprobed
model's own `__call__`; with `vmap=True` both run under a plain `jax.vmap`.
"""

from __future__ import annotations

import functools
import inspect
import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from helpers import add_at_float_leaves, numpy_snapshot

import bridge
from cases import Case


def batch_norm(*args, **kwargs) -> eqx.nn.BatchNorm:
    """`eqx.nn.BatchNorm` with `mode="batch"` (equinox >= 0.13 warns without a
    mode). Before 0.13, the one mode there is (0.13's "legacy": it normalises
    with the running averages just updated); the references run the same
    module, so either is a valid case."""
    if "mode" in inspect.signature(eqx.nn.BatchNorm.__init__).parameters:
        kwargs.setdefault("mode", "batch")
    return eqx.nn.BatchNorm(*args, **kwargs)


def _clone(state):
    """`eqx.nn.State.set` invalidates the State it was called on: use a copy."""
    leaves, treedef = jax.tree.flatten(state)
    return jax.tree.unflatten(treedef, leaves)


def _nth(name: str, index: int) -> str:
    return name if index == 0 else f"{name}#{index}"


def _mse(y):
    return jnp.mean(jnp.square(y - 0.5))


class Hook:
    """Adds `delta` at call `site` and records every value, by site name."""

    def __init__(self, site=None, delta=None):
        self.site, self.delta, self.values = site, delta, {}

    def __call__(self, name, value):
        if name == self.site:
            value = add_at_float_leaves(value, self.delta)
        self.values[name] = value
        return value


def equinox_case(
    model,
    args,
    expected_sites,
    forward,
    *,
    state=None,
    vmap=False,
    axis_name=None,
    kwargs=None,
    loss_fn=_mse,
    bias_sites=(),
):
    """A case; `forward(model, *args, hook, state=..., **kwargs)` is the hand-written
    pass of one example (or of the batch with `vmap=False`)."""
    kwargs = dict(kwargs or {})
    arrays, static = eqx.partition(model, eqx.is_array)
    trainable = eqx.filter(model, eqx.is_inexact_array)
    has_state = state is not None

    def mapped(fn):
        """`fn(*args, extra)` of one example, over the batch if `vmap`."""
        if not vmap:
            return fn
        in_axes = (0,) * len(args) + (0,)
        out_axes = (0, None) if has_state else 0
        return jax.vmap(fn, in_axes=in_axes, out_axes=out_axes, axis_name=axis_name)

    @jax.jit
    def unprobed(trainable, args):
        model_now = eqx.combine(trainable, arrays, static)
        leading = (_clone(state),) if has_state else ()
        return mapped(lambda *a: model_now(*a[:-1], *leading, **kwargs))(*args, None)

    @functools.partial(jax.jit, static_argnums=0)
    def by_hand(site, delta):
        """The hand-written pass, adding `delta` at `site`: `(outputs, values)`."""

        def one(*a):
            hook = Hook(site, a[-1])
            fresh = _clone(state) if has_state else None
            return forward(model, *a[:-1], hook, state=fresh, **kwargs), hook.values

        if not vmap:
            return one(*args, delta)
        outputs_axes = (0, None) if has_state else 0
        return jax.vmap(
            one,
            in_axes=(0,) * len(args) + (0,),
            out_axes=(outputs_axes, 0),
            axis_name=axis_name,
        )(*args, delta)

    def outputs(result):
        return result[0] if has_state else result

    def reference_loss(trainable, args):
        return loss_fn(outputs(unprobed(trainable, args)))

    def perturbed_loss(site, delta):
        return loss_fn(outputs(by_hand(site, delta)[0]))

    # The hand-written pass must be the model: check it once, here.
    expected, got = unprobed(trainable, args), by_hand(None, None)[0]
    for e, g in zip(jax.tree.leaves(expected), jax.tree.leaves(got), strict=True):
        np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-6)

    def bias_grad(path):
        def get(grads):
            node = grads
            for part in path.split("/"):
                node = node[int(part)] if part.isdigit() else getattr(node, part)
            return node.bias

        return get

    probe = bridge.probe(model, *((state,) if has_state else ()), vmap=vmap)
    return Case(
        probe=probe,
        args=args,
        kwargs=kwargs,
        loss_fn=loss_fn,
        expected_sites=expected_sites,
        trainable=trainable,
        reference_loss=reference_loss,
        perturbed_loss=perturbed_loss,
        snapshot=lambda: numpy_snapshot((arrays, state)),
        bias_sites={site: bias_grad(site) for site in bias_sites},
        reference_activations=lambda: by_hand(None, None)[1],
        reference_state=(lambda: unprobed(trainable, args)[1]) if has_state else None,
    )


def _inputs(*shape, seed=1):
    return jax.random.normal(jax.random.key(seed), shape)


def _keys(n, seed=0):
    return jax.random.split(jax.random.key(seed), n)


# -- eqx.nn.MLP: `activation` applied per neuron inside the MLP's own vmap --------


def mlp_forward(mlp, x, hook, state=None):
    last = len(mlp.layers) - 1
    for i, layer in enumerate(mlp.layers[:-1]):
        x = hook(f"layers/{i}", layer(x))
        x = hook(_nth("activation", i), jax.nn.relu(x))
    x = hook(f"layers/{last}", mlp.layers[last](x))
    return hook("final_activation", x)


# -- eqx.nn.Sequential with eqx.nn.Lambda -----------------------------------------


def sequential_forward(seq, x, hook, state=None):
    for i, layer in enumerate(seq.layers):
        x = hook(f"layers/{i}", layer(x))
    return x


# -- eqx.nn.Conv2d (channel-first) ------------------------------------------------


class SmallCNN(eqx.Module):
    conv1: eqx.nn.Conv2d
    conv2: eqx.nn.Conv2d
    head: eqx.nn.Linear

    def __init__(self, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.conv1 = eqx.nn.Conv2d(3, 4, 3, key=k1)
        self.conv2 = eqx.nn.Conv2d(4, 6, 3, stride=2, key=k2)
        self.head = eqx.nn.Linear(6, 2, key=k3)

    def __call__(self, x):
        x = jax.nn.relu(self.conv1(x))
        x = jax.nn.relu(self.conv2(x))
        return self.head(x.mean(axis=(1, 2)))


def cnn_forward(model, x, hook, state=None):
    x = jax.nn.relu(hook("conv1", model.conv1(x)))
    x = jax.nn.relu(hook("conv2", model.conv2(x)))
    return hook("head", model.head(x.mean(axis=(1, 2))))


# -- Embedding, LayerNorm, MultiheadAttention: layers applied per token ------------


class Block(eqx.Module):
    embedding: eqx.nn.Embedding
    norm: eqx.nn.LayerNorm
    attn: eqx.nn.MultiheadAttention
    head: eqx.nn.Linear

    def __init__(self, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.embedding = eqx.nn.Embedding(11, 8, key=k1)
        self.norm = eqx.nn.LayerNorm(8)
        self.attn = eqx.nn.MultiheadAttention(
            2, 8, use_query_bias=True, use_output_bias=True, key=k2
        )
        self.head = eqx.nn.Linear(8, 3, key=k3)

    def __call__(self, tokens):
        h = jax.vmap(self.embedding)(tokens)
        normed = jax.vmap(self.norm)(h)
        h = h + self.attn(normed, normed, normed)
        return jax.vmap(self.head)(h)


def rowwise(layer, x):
    """An `eqx.nn.Linear` on every row of `x` at once."""
    y = x @ layer.weight.T
    return y if layer.bias is None else y + layer.bias[None]


def attention_by_hand(mha, x, hook, prefix):
    """`eqx.nn.MultiheadAttention` on all tokens at once, hooked per site."""
    tokens, heads = x.shape[0], mha.num_heads

    def project(name):
        value = hook(f"{prefix}/{name}", rowwise(getattr(mha, name), x))
        return value.reshape(tokens, heads, -1)

    q, k, v = project("query_proj"), project("key_proj"), project("value_proj")
    logits = jnp.einsum("shd,Shd->hsS", q / math.sqrt(q.shape[-1]), k)
    weights = hook(f"{prefix}/dropout", jax.nn.softmax(logits, axis=-1))
    mixed = jnp.einsum("hsS,Shd->shd", weights, v).reshape(tokens, -1)
    return hook(prefix, hook(f"{prefix}/output_proj", rowwise(mha.output_proj, mixed)))


def block_forward(model, tokens, hook, state=None):
    h = hook("embedding", model.embedding.weight[tokens])
    mean = h.mean(-1, keepdims=True)
    var = jnp.square(h - mean).mean(-1, keepdims=True)
    norm = model.norm
    normed = (h - mean) / jnp.sqrt(var + norm.eps) * norm.weight[None] + norm.bias[None]
    h = h + attention_by_hand(model.attn, hook("norm", normed), hook, "attn")
    return hook("head", rowwise(model.head, h))


# -- eqx.nn.GRUCell over a sequence: one module, called once per step --------------


class Recurrent(eqx.Module):
    cell: eqx.nn.GRUCell
    head: eqx.nn.Linear

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.cell = eqx.nn.GRUCell(4, 5, key=k1)
        self.head = eqx.nn.Linear(5, 2, key=k2)

    def __call__(self, xs):
        h = jnp.zeros(5)
        for x in xs:
            h = self.cell(x, h)
        return self.head(h)


def recurrent_forward(model, xs, hook, state=None):
    h = jnp.zeros(5)
    for t, x in enumerate(xs):
        h = hook(_nth("cell", t), model.cell(x, h))
    return hook("head", model.head(h))


# -- eqx.nn.BatchNorm with an eqx.nn.State -----------------------------------------


class BatchNormNet(eqx.Module):
    linear1: eqx.nn.Linear
    bn: eqx.nn.BatchNorm
    linear2: eqx.nn.Linear

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.linear1 = eqx.nn.Linear(4, 6, key=k1)
        # Not the probe's axis name: the probe rebinds it under vmap=True.
        self.bn = batch_norm(6, axis_name="examples")
        self.linear2 = eqx.nn.Linear(6, 2, key=k2)

    def __call__(self, x, state):
        x, state = self.bn(self.linear1(x), state)
        return self.linear2(jax.nn.relu(x)), state


def batchnorm_forward(model, x, hook, state):
    x = hook("linear1", model.linear1(x))
    normed, state = model.bn(x, state)
    normed, _ = hook("bn", (normed, None))
    return hook("linear2", model.linear2(jax.nn.relu(normed))), state


# -- eqx.nn.Dropout with key=, one example (vmap=False) ---------------------------


class DropoutNet(eqx.Module):
    linear1: eqx.nn.Linear
    dropout: eqx.nn.Dropout
    linear2: eqx.nn.Linear

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.linear1 = eqx.nn.Linear(6, 16, key=k1)
        self.dropout = eqx.nn.Dropout(0.5)
        self.linear2 = eqx.nn.Linear(16, 2, key=k2)

    def __call__(self, x, *, key):
        x = jax.nn.relu(self.linear1(x))
        return self.linear2(self.dropout(x, key=key))


def dropout_forward(model, x, hook, state=None, *, key):
    x = jax.nn.relu(hook("linear1", model.linear1(x)))
    kept = jax.random.bernoulli(key, 0.5, x.shape)
    x = hook("dropout", jnp.where(kept, x / 0.5, 0.0))
    return hook("linear2", model.linear2(x))


# -- a module called twice, LayerNorm, and methods other than __call__ ------------


class AutoEncoder(eqx.Module):
    enc: eqx.nn.Linear
    dec: eqx.nn.Linear

    def encode(self, x):
        return self.enc(x)

    def decode(self, z):
        return self.dec(z)


class SharedNet(eqx.Module):
    shared: eqx.nn.Linear
    norm: eqx.nn.LayerNorm
    coder: AutoEncoder

    def __init__(self, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.shared = eqx.nn.Linear(8, 8, key=k1)
        self.norm = eqx.nn.LayerNorm(8)
        self.coder = AutoEncoder(
            eqx.nn.Linear(8, 4, key=k2), eqx.nn.Linear(4, 8, key=k3)
        )

    def __call__(self, x):
        h = self.norm(jnp.tanh(self.shared(x)))
        h = self.shared(h)  # the same module, called a second time
        return self.coder.decode(jnp.tanh(self.coder.encode(h)))


def shared_forward(model, x, hook, state=None):
    h = jnp.tanh(hook("shared", model.shared(x)))
    norm = model.norm
    normed = (h - h.mean()) / jnp.sqrt(h.var() + norm.eps) * norm.weight + norm.bias
    h = hook("shared#1", model.shared(hook("norm", normed)))
    z = hook("coder.encode", hook("coder/enc", model.coder.enc(h)))
    return hook("coder.decode", hook("coder/dec", model.coder.dec(jnp.tanh(z))))


# -- tree surgery the model cannot see: a private method, a parameter wrapper ---


class Masked(eqx.Module):
    """A parameter wrapper the model never calls: its function unwraps it."""

    weight: jax.Array
    mask: jax.Array


def unwrap(p):
    return p.weight * p.mask if isinstance(p, Masked) else p


class Gaussian(eqx.Module):
    loc: jax.Array
    _log_scale: jax.Array

    def _log_prob(self, z):
        return -0.5 * ((z - self.loc) / jnp.exp(self._log_scale)) ** 2 - self._log_scale


class MaskedFlow(eqx.Module):
    """A flow-style model: a masked weight, then the base's private density."""

    w: Masked
    shift: eqx.nn.Linear
    base: Gaussian

    def __init__(self, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.w = Masked(jax.random.normal(k1, (3, 3)), jnp.tril(jnp.ones((3, 3))))
        self.shift = eqx.nn.Linear(3, 3, key=k2)
        self.base = Gaussian(jax.random.normal(k3, (3,)), 0.1 * jnp.arange(3.0))

    def __call__(self, x):
        return self.base._log_prob(jnp.tanh(self.shift(unwrap(self.w) @ x)))


def flow_forward(model, x, hook, state=None):
    y = hook("shift", model.shift((model.w.weight * model.w.mask) @ x))
    base = model.base
    z = (jnp.tanh(y) - base.loc) / jnp.exp(base._log_scale)
    return hook("base._log_prob", -0.5 * z**2 - base._log_scale)


def _batchnorm_case():
    model, state = eqx.nn.make_with_state(BatchNormNet)(jax.random.key(0))
    return equinox_case(
        model,
        (_inputs(8, 4),),
        ["linear1", "bn", "linear2"],
        batchnorm_forward,
        state=state,
        vmap=True,
        axis_name="examples",
        bias_sites=("linear1", "linear2"),
    )


CASES = {
    "mlp": lambda: equinox_case(
        eqx.nn.MLP(4, 3, 8, 2, key=jax.random.key(0)),
        (_inputs(5, 4),),
        [
            "layers/0",
            "activation",
            "layers/1",
            "activation#1",
            "layers/2",
            "final_activation",
        ],
        mlp_forward,
        vmap=True,
        bias_sites=("layers/0", "layers/1", "layers/2"),
    ),
    "sequential": lambda: equinox_case(
        eqx.nn.Sequential(
            [
                eqx.nn.Linear(5, 8, key=_keys(2)[0]),
                eqx.nn.Lambda(jnp.tanh),
                eqx.nn.Linear(8, 2, key=_keys(2)[1]),
            ]
        ),
        (_inputs(3, 5),),
        ["layers/0", "layers/1", "layers/2"],
        sequential_forward,
        vmap=True,
        bias_sites=("layers/0", "layers/2"),
    ),
    "conv": lambda: equinox_case(
        SmallCNN(jax.random.key(0)),
        (_inputs(2, 3, 8, 8),),
        ["conv1", "conv2", "head"],
        cnn_forward,
        vmap=True,
        bias_sites=("head",),
    ),
    "attention": lambda: equinox_case(
        Block(jax.random.key(0)),
        (jax.random.randint(jax.random.key(1), (3, 5), 0, 11),),
        [
            "embedding",
            "norm",
            "attn",
            "attn/query_proj",
            "attn/key_proj",
            "attn/value_proj",
            "attn/dropout",
            "attn/output_proj",
            "head",
        ],
        block_forward,
        vmap=True,
        bias_sites=("attn/query_proj", "attn/output_proj", "head"),
    ),
    "gru": lambda: equinox_case(
        Recurrent(jax.random.key(0)),
        (_inputs(2, 3, 4),),
        ["cell", "cell#1", "cell#2", "head"],
        recurrent_forward,
        vmap=True,
        bias_sites=("head",),
    ),
    "batchnorm": _batchnorm_case,
    "dropout": lambda: equinox_case(
        DropoutNet(jax.random.key(0)),
        (_inputs(6),),
        ["linear1", "dropout", "linear2"],
        dropout_forward,
        kwargs={"key": jax.random.key(7)},
        bias_sites=("linear1", "linear2"),
    ),
    "shared": lambda: equinox_case(
        SharedNet(jax.random.key(0)),
        (_inputs(8),),
        [
            "shared",
            "norm",
            "shared#1",
            "coder.encode",
            "coder/enc",
            "coder.decode",
            "coder/dec",
        ],
        shared_forward,
        bias_sites=("coder/enc", "coder/dec"),
    ),
    "flow": lambda: equinox_case(
        MaskedFlow(jax.random.key(0)),
        (_inputs(4, 3),),
        ["shift", "base._log_prob"],
        flow_forward,
        vmap=True,
        bias_sites=("shift",),
    ),
}
