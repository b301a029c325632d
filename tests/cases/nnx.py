"""Flax NNX models for the conformance suite, with independent references.

The references never go through bridge's copy-and-subclass machinery: the
unprobed loss runs an `nnx.clone` with `nnx.update`, the perturbation is added
by this file's own hook on the target module's class, and the activations come
from NNX's own `nnx.capture(..., method_outputs=nnx.Intermediate)`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from helpers import add_at_float_leaves

import bridge
from cases import Case


def _find(model, path: str):
    """The module (or state) at `blocks/0/linear`, by attribute access and indexing."""
    node = model
    for part in path.split("/"):
        if isinstance(node, Sequence | nnx.List):
            node = node[int(part)]
        elif isinstance(node, Mapping | nnx.Dict):  # an nnx.State keys ints as ints
            node = (
                node[int(part)] if part.isdigit() and part not in node else node[part]
            )
        else:
            node = getattr(node, part)
    return node


def _parse_site(site: str) -> tuple[str, str, int]:
    """`path.method#k` -> (path, method, k)."""
    base, sep, index = site.rpartition("#")
    if not (sep and index.isdigit()):
        base, index = site, "0"
    path, _, method = base.partition(".")
    return path, method or "__call__", int(index)


@contextlib.contextmanager
def added_at_call(model, site: str, delta):
    """Adds `delta` to the output of call `site` of `model`'s submodule.

    Temporarily wraps the method on the target module's class (as
    `nnx.capture(method_outputs=...)` does) and counts the target's own calls.
    """
    path, method, index = _parse_site(site)
    target = _find(model, path)
    cls = type(target)
    original = getattr(cls, method)
    own = method in vars(cls)
    calls = [0]

    def hooked(self, *args, **kwargs):
        if self is not target:
            return original(self, *args, **kwargs)
        call = calls[0]
        calls[0] += 1
        out = original(self, *args, **kwargs)
        return add_at_float_leaves(out, delta) if call == index else out

    setattr(cls, method, hooked)
    try:
        yield
    finally:
        if own:
            setattr(cls, method, original)
        else:
            delattr(cls, method)


def get_value(variable):
    """`variable.get_value()` since flax 0.12.1; `.value` in 0.12.0."""
    if hasattr(type(variable), "get_value"):
        return variable.get_value()
    return variable.value


def captured_activations(model, args, kwargs):
    """Every method output of every submodule, recorded by `nnx.capture`."""
    clone = nnx.clone(model)
    _, intermediates = nnx.capture(
        clone, nnx.Intermediate, method_outputs=nnx.Intermediate
    )(*args, **kwargs)
    return captured_outputs(intermediates)


def captured_outputs(intermediates):
    """`nnx.capture`'s method outputs as `{site name: output}`, each call of a
    method its own site (`path`, `path#1`, ...; `path.method` for a method)."""
    found = {}

    def walk(tree, path):
        for key, value in tree.items():
            if isinstance(value, nnx.Variable):  # one method's outputs, per call
                if not path:
                    continue  # the root model is not a site
                base = "/".join(map(str, path))
                if key != "__call__":
                    base = f"{base}.{key}"
                for index, output in enumerate(get_value(value)):
                    found[base if index == 0 else f"{base}#{index}"] = output
            else:
                walk(value, (*path, key))

    walk(intermediates, ())
    return found


def snapshot(model):
    """Numpy copies of every variable (RNG keys as key data), and the graph."""

    def copy(x):
        if jnp.issubdtype(jnp.result_type(x), jax.dtypes.prng_key):
            x = jax.random.key_data(x)
        return np.array(x, copy=True)

    return {
        "state": jax.tree.map(copy, nnx.state(model)),
        "graph": np.array(repr(nnx.graphdef(model))),
    }


def fresh(kwargs):
    """The call's keywords with `nnx.Rngs` copied: calling advances them."""
    return {
        k: nnx.clone(v) if isinstance(v, nnx.Rngs) else v for k, v in kwargs.items()
    }


def non_params(model):
    state = nnx.state(model, nnx.Not(nnx.Param))
    return state if jax.tree.leaves(state) else None


def nnx_case(
    model,
    args,
    expected_sites,
    loss_fn=lambda y: jnp.mean(jnp.square(y - 0.5)),
    kwargs=None,
    bias_sites=(),
):
    kwargs = dict(kwargs or {})
    params = nnx.state(model, nnx.Param)

    # Whole-model references are jitted (one compilation instead of one per
    # op); the perturbed loss stays eager, so every site shares its per-op
    # compilations.
    @jax.jit
    def reference_loss(params, args):
        clone = nnx.clone(model)
        nnx.update(clone, params)
        return loss_fn(clone(*args, **fresh(kwargs)))

    def perturbed_loss(site, delta):
        clone = nnx.clone(model)
        with added_at_call(clone, site, delta):
            return loss_fn(clone(*args, **fresh(kwargs)))

    @jax.jit
    def reference_state():
        clone = nnx.clone(model)
        clone(*args, **fresh(kwargs))
        return non_params(clone)

    def bias_grad(site_path):
        return lambda grads: get_value(_find(grads, site_path)["bias"])

    return Case(
        probe=bridge.probe(model),
        args=args,
        kwargs=kwargs,
        loss_fn=loss_fn,
        expected_sites=expected_sites,
        trainable=params,
        reference_loss=reference_loss,
        perturbed_loss=perturbed_loss,
        snapshot=lambda: snapshot((model, kwargs)),
        bias_sites={site: bias_grad(site) for site in bias_sites},
        # `nnx.capture` since flax 0.12.6.
        reference_activations=(
            (lambda: captured_activations(model, args, fresh(kwargs)))
            if hasattr(nnx, "capture")
            else None
        ),
        reference_state=reference_state,
    )


def _inputs(*shape, seed=1):
    return jnp.asarray(np.random.default_rng(seed).normal(size=shape), jnp.float32)


class SharedMLP(nnx.Module):
    def __init__(self, rngs):
        self.shared = nnx.Linear(8, 8, rngs=rngs)
        self.hidden = nnx.Linear(8, 8, rngs=rngs)
        self.norm = nnx.LayerNorm(8, rngs=rngs)
        self.out = nnx.Linear(8, 3, rngs=rngs)

    def __call__(self, x):
        x = nnx.relu(self.shared(x))
        x = self.hidden(x)
        x = self.shared(nnx.tanh(x))  # the same module, called a second time
        return self.out(self.norm(x))


class SmallCNN(nnx.Module):
    def __init__(self, rngs):
        self.conv1 = nnx.Conv(3, 4, (3, 3), rngs=rngs)
        self.conv2 = nnx.Conv(4, 6, (3, 3), strides=2, rngs=rngs)
        self.head = nnx.Linear(6, 2, rngs=rngs)

    def __call__(self, x):
        x = nnx.relu(self.conv1(x))
        x = nnx.relu(self.conv2(x))
        return self.head(x.mean(axis=(1, 2)))


class Attention(nnx.Module):
    def __init__(self, rngs):
        self.attention = nnx.MultiHeadAttention(
            num_heads=2, in_features=8, qkv_features=8, decode=False, rngs=rngs
        )
        self.head = nnx.Linear(8, 2, rngs=rngs)

    def __call__(self, x):
        return self.head(self.attention(x))


class TrainMode(nnx.Module):
    """BatchNorm in training mode, and dropout drawing from the call's `nnx.Rngs`.

    (A stream stored in the model is tested in test_nnx.py: its typed key in
    `res.state` is beyond the shared suite's numpy comparisons.)
    """

    def __init__(self, rngs):
        self.linear = nnx.Linear(4, 6, rngs=rngs)
        self.norm = nnx.BatchNorm(6, use_running_average=False, rngs=rngs)
        self.dropout = nnx.Dropout(0.5)
        self.head = nnx.Linear(6, 2, rngs=rngs)

    def __call__(self, x, *, rngs):
        x = nnx.relu(self.norm(self.linear(x)))
        return self.head(self.dropout(x, rngs=rngs))


class TiedEmbedding(nnx.Module):
    """A language-model shape: embed, mix, read out with the tied embedding."""

    def __init__(self, rngs):
        self.embed = nnx.Embed(2, 8, rngs=rngs)
        self.mixer = nnx.Linear(8, 8, rngs=rngs)

    def __call__(self, tokens):
        h = nnx.gelu(self.mixer(self.embed(tokens)))
        return self.embed.attend(h)


class Block(nnx.Module):
    def __init__(self, features, rngs):
        self.linear = nnx.Linear(features, features, rngs=rngs)

    def __call__(self, x):
        return x + nnx.tanh(self.linear(x))


class Containers(nnx.Module):
    """Submodules in an nnx.List, a plain list, a tuple and a dict; the last
    returns a pytree with an integer leaf, which gets no gradient."""

    def __init__(self, rngs):
        self.blocks = nnx.List([Block(8, rngs) for _ in range(2)])
        self.extra = nnx.data([nnx.Linear(8, 8, rngs=rngs)])
        self.pair = nnx.data((nnx.Linear(8, 8, rngs=rngs), nnx.Linear(8, 8, rngs=rngs)))
        self.heads = nnx.data({"a": ArgmaxHead(rngs)})

    def __call__(self, x):
        for block in self.blocks:
            x = block(x)
        x = self.extra[0](x)
        x = self.pair[1](self.pair[0](x))
        logits, label = self.heads["a"](x)
        return logits * (label[:, None] + 1).astype(logits.dtype)


class AutoEncoder(nnx.Module):
    def __init__(self, rngs):
        self.enc = nnx.Linear(6, 4, rngs=rngs)
        self.dec = nnx.Linear(4, 6, rngs=rngs)

    def encode(self, x):
        return self.enc(x)

    def decode(self, z):
        return self.dec(z)

    def __call__(self, x):
        return self.decode(self.encode(x))


class Methods(nnx.Module):
    def __init__(self, rngs):
        self.autoencoder = AutoEncoder(rngs)

    def __call__(self, x):
        z = nnx.tanh(self.autoencoder.encode(x))
        return self.autoencoder(self.autoencoder.decode(z))


class ArgmaxHead(nnx.Module):
    """Returns a pytree with an integer leaf, which gets no gradient."""

    def __init__(self, rngs):
        self.linear = nnx.Linear(8, 3, rngs=rngs)

    def __call__(self, x):
        logits = self.linear(x)
        return logits, jnp.argmax(logits, axis=-1)


def _build(cls):
    """`cls(rngs)` with weights (and RNG keys) drawn by numpy.

    NNX's initializers would compile an XLA program per layer shape, for
    seconds on a small CPU; this builds the graph abstractly and compiles
    nothing. Batch statistics keep their initial values (mean 0, variance 1).
    """
    abstract = nnx.eval_shape(lambda: cls(nnx.Rngs(params=0, dropout=1)))
    graphdef, state = nnx.split(abstract)
    draws = np.random.default_rng(0)

    def fill(path, variable):
        if isinstance(variable, nnx.RngKey):
            return variable.replace(jax.random.key(int(draws.integers(2**31))))
        if isinstance(variable, nnx.RngCount):
            value = np.zeros(variable.shape)
        elif isinstance(variable, nnx.BatchStat):
            value = np.full(variable.shape, 0.0 if path[-1].key == "mean" else 1.0)
        else:
            fan_in = np.prod(variable.shape[:-1]) if variable.ndim > 1 else 4
            value = draws.normal(0.0, 1.0 / np.sqrt(fan_in), variable.shape)
        return variable.replace(jnp.asarray(value, variable.dtype))

    state = jax.tree_util.tree_map_with_path(
        fill, state, is_leaf=lambda x: isinstance(x, nnx.Variable)
    )
    return nnx.merge(graphdef, state)


def _tokens(*shape):
    return jnp.asarray(np.random.default_rng(3).integers(0, 2, shape), jnp.int32)


CASES = {
    "shared_mlp": lambda: nnx_case(
        _build(SharedMLP),
        (_inputs(4, 8),),
        ["shared", "hidden", "shared#1", "norm", "out"],
        bias_sites=("hidden", "out"),
    ),
    "conv": lambda: nnx_case(
        _build(SmallCNN),
        (_inputs(2, 8, 8, 3),),
        ["conv1", "conv2", "head"],
        bias_sites=("conv1", "conv2", "head"),
    ),
    "attention": lambda: nnx_case(
        _build(Attention),
        (_inputs(2, 5, 8),),
        [
            "attention",
            "attention/query",
            "attention/key",
            "attention/value",
            "attention/out",
            "head",
        ],
        bias_sites=("attention/query", "attention/out", "head"),
    ),
    "train_mode": lambda: nnx_case(
        _build(TrainMode),
        (_inputs(8, 4),),
        ["linear", "norm", "dropout", "head"],
        kwargs={"rngs": nnx.Rngs(dropout=7)},
        bias_sites=("linear", "head"),
    ),
    "embed": lambda: nnx_case(
        _build(TiedEmbedding),
        (_tokens(2, 5),),
        ["embed", "mixer", "embed.attend"],
        bias_sites=("mixer",),
    ),
    "containers": lambda: nnx_case(
        _build(Containers),
        (_inputs(3, 8),),
        [
            "blocks/0",
            "blocks/0/linear",
            "blocks/1",
            "blocks/1/linear",
            "extra/0",
            "pair/0",
            "pair/1",
            "heads/a",
            "heads/a/linear",
        ],
        bias_sites=("blocks/1/linear", "pair/0", "heads/a/linear"),
    ),
    "methods": lambda: nnx_case(
        _build(Methods),
        (_inputs(3, 6),),
        [
            "autoencoder.encode",
            "autoencoder/enc",
            "autoencoder.decode",
            "autoencoder/dec",
            "autoencoder",
            "autoencoder.encode#1",
            "autoencoder/enc#1",
            "autoencoder.decode#1",
            "autoencoder/dec#1",
        ],
    ),
}
