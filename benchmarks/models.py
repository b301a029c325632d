"""The benchmark's models, one builder per library and architecture.

A builder returns a `Workload`: the probe, its inputs and loss, the plain
`jax.value_and_grad` of the same loss, and the library's hand-written epsilon
trick, all as functions of explicit arguments so `jax.jit` compiles each once.
Every library gets the same three architectures (an 8-layer MLP of width 1024,
a small ResNet-style CNN, a 4-layer transformer) and a scanned stack of
identical blocks, written the way that library's users write them.

The hand-written tricks are what a user writes without bridge, returning what
bridge's `value_and_grad` returns (the activations and their gradients):

- Linen: `Module.perturb` at every submodule output, via `nn.intercept_methods`.
- NNX: `Module.perturb` calls written into the model, run under `nnx.capture`
  with zero perturbations, differentiated with respect to them.
- Equinox: `eqx.tree_at` replaces each layer called once per example with a
  wrapper that adds an epsilon leaf (per-example model under `jax.vmap`).
- Haiku: `hk.get_state` epsilons written into a `transform_with_state` model.

Their zeros are made inside the traced function, as bridge makes its own, so
XLA can fold the additions away in both.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

import bridge


@dataclasses.dataclass
class Workload:
    library: str
    model: str
    probe: Any
    x: jax.Array
    loss: Callable
    plain: Callable  # (params, x) -> (loss, grads)
    params: Any
    # (hand_params, x) -> ((loss, activations), (grads, activation grads))
    hand: Callable | None
    hand_params: Any
    hand_sites: int  # how many sites the hand-written trick perturbs
    one_site: str


@dataclasses.dataclass(frozen=True)
class Sizes:
    batch_mlp: int = 32
    width_mlp: int = 1024
    depth_mlp: int = 8
    batch_cnn: int = 8
    image: int = 32
    channels: int = 16
    batch_tf: int = 8
    tokens: int = 64
    width_tf: int = 128
    depth_tf: int = 4
    width_scan: int = 64
    batch_scan: int = 8
    # The transformers' compute and parameter dtypes (bfloat16 / mixed
    # precision on an accelerator: `benchmarks/tpu.py`).
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32


FULL = Sizes(batch_mlp=16, tokens=32)
QUICK = Sizes(4, 32, 2, 2, 8, 4, 2, 8, 16, 1, 8, 2)


def mse(y):
    return jnp.mean(jnp.square(y.astype(jnp.float32)))


def _zeros_in_trace(tree):
    """Zeros shaped like `tree`, made where they are used (inside `jit`)."""
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), tree)


def _structs(tree):
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(jnp.shape(a), a.dtype), tree)


# -- Flax Linen ----------------------------------------------------------------------


def _linen(name, module, x, one_site):
    import flax.linen as nn

    variables = module.init(jax.random.key(0), x)
    probe = bridge.probe(module, variables)
    sites = probe.sites(x)

    def plain(params, x):
        return jax.value_and_grad(lambda p: mse(module.apply({"params": p}, x)))(params)

    def hand(params, x):
        """Flax's own `perturb`, called at every submodule output by an interceptor."""

        perturbations = _nest(sites)

        def loss(params, perturbations):
            activations = []

            def interceptor(next_fun, args, kwargs, context):
                out = next_fun(*args, **kwargs)
                if context.module.path == () or context.method_name != "__call__":
                    return out
                activations.append(out)
                return context.module.perturb("epsilon", out)

            with nn.intercept_methods(interceptor):
                y = module.apply({"params": params, "perturbations": perturbations}, x)
            return mse(y), activations

        return jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(
            params, perturbations
        )

    params = variables["params"]
    return Workload(
        "linen",
        name,
        probe,
        x,
        mse,
        plain,
        params,
        hand,
        params,
        len(sites),
        one_site,
    )


def _nest(sites):
    """`{"a/b": struct}` -> `{"a": {"b": {"epsilon": zeros}}}` (calls made once)."""
    tree: dict = {}
    for path, struct in sites.items():
        node = tree
        for part in path.split("/"):
            node = node.setdefault(part, {})
        node["epsilon"] = jnp.zeros(struct.shape, struct.dtype)
    return tree


def linen_mlp(s: Sizes = FULL):
    import flax.linen as nn

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            for _ in range(s.depth_mlp):
                x = nn.relu(nn.Dense(s.width_mlp)(x))
            return nn.Dense(10)(x)

    x = jax.random.normal(jax.random.key(1), (s.batch_mlp, s.width_mlp))
    return _linen("mlp", MLP(), x, "Dense_1")


def linen_cnn(s: Sizes = FULL):
    import flax.linen as nn

    class CNN(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.relu(nn.Conv(s.channels, (3, 3))(x))
            for _ in range(2):
                h = nn.relu(nn.Conv(s.channels, (3, 3))(nn.LayerNorm()(x)))
                x = x + nn.Conv(s.channels, (3, 3))(h)
            return nn.Dense(10)(x.mean(axis=(1, 2)))

    x = jax.random.normal(jax.random.key(1), (s.batch_cnn, s.image, s.image, 3))
    return _linen("cnn", CNN(), x, "Conv_2")


def linen_transformer(s: Sizes = FULL):
    import flax.linen as nn

    types = {"dtype": s.dtype, "param_dtype": s.param_dtype}

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = x + nn.SelfAttention(num_heads=4, **types)(nn.LayerNorm(**types)(x))
            h = nn.gelu(nn.Dense(4 * s.width_tf, **types)(nn.LayerNorm(**types)(x)))
            return x + nn.Dense(s.width_tf, **types)(h)

    class Transformer(nn.Module):
        @nn.compact
        def __call__(self, x):
            for _ in range(s.depth_tf):
                x = Block()(x)
            return nn.Dense(10, **types)(x.mean(axis=1))

    x = jax.random.normal(jax.random.key(1), (s.batch_tf, s.tokens, s.width_tf))
    x = x.astype(s.dtype)
    return _linen("transformer", Transformer(), x, "Block_0/Dense_0")


def linen_wide(sites: int, width=8):
    """`sites` tiny Dense layers: tracing time as the number of sites grows."""
    import flax.linen as nn

    class Wide(nn.Module):
        @nn.compact
        def __call__(self, x):
            for _ in range(sites):
                x = nn.Dense(width)(x)
            return x

    x = jnp.ones((2, width))
    module = Wide()
    return module, module.init(jax.random.key(0), x), x


def linen_scanned(depth: int, s: Sizes = FULL):
    """A stack of `depth` identical blocks under `nn.scan`: `(probe, plain, x)`."""
    import flax.linen as nn

    width = s.width_scan

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x, _):
            return x + nn.Dense(width)(nn.gelu(nn.LayerNorm()(x))), None

    class Stack(nn.Module):
        @nn.compact
        def __call__(self, x):
            scan = nn.scan(
                Block,
                variable_axes={"params": 0},
                split_rngs={"params": True},
                length=depth,
            )
            return scan()(x, None)[0]

    x = jnp.ones((s.batch_scan, width))
    module = Stack()
    variables = module.init(jax.random.key(0), x)

    def plain(params, x):
        return jax.value_and_grad(lambda p: mse(module.apply({"params": p}, x)))(params)

    return bridge.probe(module, variables), plain, variables["params"], x


# -- Flax NNX ------------------------------------------------------------------------


def _nnx(name, make, x, one_site):
    """`make(hand)` builds the model; `hand=True` writes `perturb` calls into it."""
    from flax import nnx

    model = make(False)
    probe = bridge.probe(model)
    graphdef, params = nnx.split(model)

    def plain(params, x):
        def loss(params):
            return mse(nnx.merge(graphdef, params)(x))

        return jax.value_and_grad(loss)(params)

    hand_model = make(True)
    hand_graphdef, hand_params = nnx.split(hand_model)
    # NNX's step 1: run once to learn the perturbations' shapes (abstractly).
    perturbations = jax.eval_shape(
        lambda p, x: nnx.capture(nnx.merge(hand_graphdef, p), nnx.Perturbation)(x)[1],
        hand_params,
        x,
    )
    perturbations = jax.tree.map(
        lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype), perturbations
    )

    def hand(params, x):
        def loss(params, perturbations):
            model = nnx.merge(hand_graphdef, params)
            y, activations = nnx.capture(model, _activation_type(), init=perturbations)(
                x
            )
            return mse(y), activations

        return jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(
            params, _zeros_in_trace(perturbations)
        )

    return Workload(
        "nnx",
        name,
        probe,
        x,
        mse,
        plain,
        params,
        hand,
        hand_params,
        len(jax.tree.leaves(perturbations)),
        one_site,
    )


@functools.cache
def _activation_type():
    from flax import nnx

    class Activation(nnx.Intermediate):
        """A value the NNX hand trick keeps (apart from its perturbations)."""

    return Activation


def _mark(module, hand, name, x):
    if not hand:
        return x
    module.sow(_activation_type(), f"{name}_value", x)
    return module.perturb(name, x)


def nnx_mlp(s: Sizes = FULL):
    from flax import nnx

    class MLP(nnx.Module):
        def __init__(self, hand, rngs):
            width = s.width_mlp
            self.layers = nnx.List(
                [nnx.Linear(width, width, rngs=rngs) for _ in range(s.depth_mlp)]
            )
            self.head = nnx.Linear(s.width_mlp, 10, rngs=rngs)
            self.hand = hand

        def __call__(self, x):
            for i, layer in enumerate(self.layers):
                x = nnx.relu(_mark(self, self.hand, f"layer{i}", layer(x)))
            return _mark(self, self.hand, "head", self.head(x))

    x = jax.random.normal(jax.random.key(1), (s.batch_mlp, s.width_mlp))
    return _nnx("mlp", lambda hand: MLP(hand, nnx.Rngs(0)), x, "layers/1")


def nnx_cnn(s: Sizes = FULL):
    from flax import nnx

    c = s.channels

    class Block(nnx.Module):
        def __init__(self, hand, rngs):
            self.norm = nnx.LayerNorm(c, rngs=rngs)
            self.conv1 = nnx.Conv(c, c, (3, 3), rngs=rngs)
            self.conv2 = nnx.Conv(c, c, (3, 3), rngs=rngs)
            self.hand = hand

        def __call__(self, x):
            h = _mark(self, self.hand, "norm", self.norm(x))
            h = nnx.relu(_mark(self, self.hand, "conv1", self.conv1(h)))
            return x + _mark(self, self.hand, "conv2", self.conv2(h))

    class CNN(nnx.Module):
        def __init__(self, hand, rngs):
            self.stem = nnx.Conv(3, c, (3, 3), rngs=rngs)
            self.blocks = nnx.List([Block(hand, rngs) for _ in range(2)])
            self.head = nnx.Linear(c, 10, rngs=rngs)
            self.hand = hand

        def __call__(self, x):
            x = nnx.relu(_mark(self, self.hand, "stem", self.stem(x)))
            for i, block in enumerate(self.blocks):
                x = _mark(self, self.hand, f"block{i}", block(x))
            return _mark(self, self.hand, "head", self.head(x.mean(axis=(1, 2))))

    x = jax.random.normal(jax.random.key(1), (s.batch_cnn, s.image, s.image, 3))
    return _nnx("cnn", lambda hand: CNN(hand, nnx.Rngs(0)), x, "blocks/0/conv2")


def nnx_transformer(s: Sizes = FULL):
    from flax import nnx

    w = s.width_tf

    types = {"dtype": s.dtype, "param_dtype": s.param_dtype}

    class Block(nnx.Module):
        def __init__(self, hand, rngs):
            self.norm1 = nnx.LayerNorm(w, rngs=rngs, **types)
            self.attention = nnx.MultiHeadAttention(
                num_heads=4, in_features=w, decode=False, rngs=rngs, **types
            )
            self.norm2 = nnx.LayerNorm(w, rngs=rngs, **types)
            self.fc1 = nnx.Linear(w, 4 * w, rngs=rngs, **types)
            self.fc2 = nnx.Linear(4 * w, w, rngs=rngs, **types)
            self.hand = hand

        def __call__(self, x):
            def mark(name, value):
                return _mark(self, self.hand, name, value)

            x = x + mark("attention", self.attention(mark("norm1", self.norm1(x))))
            h = nnx.gelu(mark("fc1", self.fc1(mark("norm2", self.norm2(x)))))
            return x + mark("fc2", self.fc2(h))

    class Transformer(nnx.Module):
        def __init__(self, hand, rngs):
            self.blocks = nnx.List([Block(hand, rngs) for _ in range(s.depth_tf)])
            self.head = nnx.Linear(w, 10, rngs=rngs, **types)
            self.hand = hand

        def __call__(self, x):
            for i, block in enumerate(self.blocks):
                x = _mark(self, self.hand, f"block{i}", block(x))
            return _mark(self, self.hand, "head", self.head(x.mean(axis=1)))

    x = jax.random.normal(jax.random.key(1), (s.batch_tf, s.tokens, w))
    x = x.astype(s.dtype)
    return _nnx(
        "transformer", lambda hand: Transformer(hand, nnx.Rngs(0)), x, "blocks/0/fc1"
    )


def nnx_scanned(depth: int, s: Sizes = FULL):
    """Layers built with `nnx.vmap`, run with `nnx.scan`: `(probe, plain, x)`."""
    from flax import nnx

    width = s.width_scan

    class Block(nnx.Module):
        def __init__(self, rngs):
            self.norm = nnx.LayerNorm(width, rngs=rngs)
            self.linear = nnx.Linear(width, width, rngs=rngs)

        def __call__(self, x):
            return x + self.linear(nnx.gelu(self.norm(x)))

    class Stack(nnx.Module):
        def __init__(self, rngs):
            @nnx.split_rngs(splits=depth)
            @nnx.vmap(in_axes=0, out_axes=0)
            def create(rngs):
                return Block(rngs)

            self.blocks = create(rngs)

        def __call__(self, x):
            def forward(x, block):
                return block(x)

            forward = nnx.scan(forward, in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
            return forward(x, self.blocks)

    model = Stack(nnx.Rngs(0))
    graphdef, params = nnx.split(model)

    def plain(params, x):
        return jax.value_and_grad(lambda p: mse(nnx.merge(graphdef, p)(x)))(params)

    x = jnp.ones((s.batch_scan, width))
    return bridge.probe(model), plain, params, x


# -- Equinox (per-example models, probed with vmap=True) -----------------------------


def _perturbed():
    import equinox as eqx

    class Perturbed(eqx.Module):
        """A layer whose output gets `epsilon` added: the hand-written trick."""

        layer: Any
        epsilon: jax.Array
        activations: list = eqx.field(static=True)  # where the values go

        def __call__(self, *args, **kwargs):
            out = self.layer(*args, **kwargs)
            self.activations.append(out)
            return out + self.epsilon

    return Perturbed


def _resolve(model, path):
    for part in path.split("/"):
        model = model[int(part)] if part.isdigit() else getattr(model, part)
    return model


def _equinox(name, model, x, one_site, hand_paths):
    """`hand_paths`: the layers the hand trick wraps (called once per example)."""
    import equinox as eqx

    probe = bridge.probe(model, vmap=True)
    params, static = eqx.partition(model, eqx.is_inexact_array)

    def plain(params, x):
        def loss(params):
            return mse(jax.vmap(eqx.combine(params, static))(x))

        return jax.value_and_grad(loss)(params)

    sites = probe.sites(x)
    epsilons = {path: sites[path] for path in hand_paths}
    Perturbed = _perturbed()

    def hand(params, x):
        def loss(params, epsilons):
            model = eqx.combine(params, static)

            def one(x, epsilons):
                # Innermost layers first: `tree_at` cannot replace a layer and
                # one inside it at once.
                wrapped, activations = model, []
                for path in sorted(hand_paths, key=lambda p: -p.count("/")):
                    wrapped = eqx.tree_at(
                        lambda m, path=path: _resolve(m, path),
                        wrapped,
                        Perturbed(_resolve(wrapped, path), epsilons[path], activations),
                    )
                return wrapped(x), activations

            y, activations = jax.vmap(one)(x, epsilons)
            return mse(y), activations

        return jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(
            params, _zeros_in_trace(epsilons)
        )

    return Workload(
        "equinox",
        name,
        probe,
        x,
        mse,
        plain,
        params,
        hand,
        params,
        len(hand_paths),
        one_site,
    )


def equinox_mlp(s: Sizes = FULL):
    import equinox as eqx

    class MLP(eqx.Module):
        layers: list
        head: eqx.nn.Linear

        def __init__(self, key):
            keys = jax.random.split(key, s.depth_mlp + 1)
            self.layers = [
                eqx.nn.Linear(s.width_mlp, s.width_mlp, key=k) for k in keys[:-1]
            ]
            self.head = eqx.nn.Linear(s.width_mlp, 10, key=keys[-1])

        def __call__(self, x):
            for layer in self.layers:
                x = jax.nn.relu(layer(x))
            return self.head(x)

    x = jax.random.normal(jax.random.key(1), (s.batch_mlp, s.width_mlp))
    paths = [f"layers/{i}" for i in range(s.depth_mlp)] + ["head"]
    return _equinox("mlp", MLP(jax.random.key(0)), x, "layers/1", paths)


def equinox_cnn(s: Sizes = FULL):
    import equinox as eqx

    c = s.channels

    class Block(eqx.Module):
        norm: eqx.nn.GroupNorm
        conv1: eqx.nn.Conv2d
        conv2: eqx.nn.Conv2d

        def __init__(self, key):
            k1, k2 = jax.random.split(key)
            self.norm = eqx.nn.GroupNorm(1, c)
            self.conv1 = eqx.nn.Conv2d(c, c, 3, padding=1, key=k1)
            self.conv2 = eqx.nn.Conv2d(c, c, 3, padding=1, key=k2)

        def __call__(self, x):
            return x + self.conv2(jax.nn.relu(self.conv1(self.norm(x))))

    class CNN(eqx.Module):
        stem: eqx.nn.Conv2d
        blocks: list
        head: eqx.nn.Linear

        def __init__(self, key):
            keys = jax.random.split(key, 4)
            self.stem = eqx.nn.Conv2d(3, c, 3, padding=1, key=keys[0])
            self.blocks = [Block(k) for k in keys[1:3]]
            self.head = eqx.nn.Linear(c, 10, key=keys[3])

        def __call__(self, x):
            x = jax.nn.relu(self.stem(x))
            for block in self.blocks:
                x = block(x)
            return self.head(x.mean(axis=(1, 2)))

    x = jax.random.normal(jax.random.key(1), (s.batch_cnn, 3, s.image, s.image))
    paths = ["stem", "head"] + [
        f"blocks/{i}{leaf}"
        for i in range(2)
        for leaf in ("", "/norm", "/conv1", "/conv2")
    ]
    return _equinox("cnn", CNN(jax.random.key(0)), x, "blocks/0/conv2", paths)


def equinox_transformer(s: Sizes = FULL):
    import equinox as eqx

    w = s.width_tf

    class Block(eqx.Module):
        norm1: eqx.nn.LayerNorm
        attention: eqx.nn.MultiheadAttention
        norm2: eqx.nn.LayerNorm
        fc1: eqx.nn.Linear
        fc2: eqx.nn.Linear

        def __init__(self, key):
            k1, k2, k3 = jax.random.split(key, 3)
            dtype = s.param_dtype
            self.norm1 = eqx.nn.LayerNorm(w, dtype=dtype)
            self.attention = eqx.nn.MultiheadAttention(4, w, dtype=dtype, key=k1)
            self.norm2 = eqx.nn.LayerNorm(w, dtype=dtype)
            self.fc1 = eqx.nn.Linear(w, 4 * w, dtype=dtype, key=k2)
            self.fc2 = eqx.nn.Linear(4 * w, w, dtype=dtype, key=k3)

        def __call__(self, x):
            h = jax.vmap(self.norm1)(x)
            x = x + self.attention(h, h, h)
            h = jax.nn.gelu(jax.vmap(self.fc1)(jax.vmap(self.norm2)(x)))
            return x + jax.vmap(self.fc2)(h)

    class Transformer(eqx.Module):
        blocks: list
        head: eqx.nn.Linear

        def __init__(self, key):
            keys = jax.random.split(key, s.depth_tf + 1)
            self.blocks = [Block(k) for k in keys[:-1]]
            self.head = eqx.nn.Linear(w, 10, dtype=s.param_dtype, key=keys[-1])

        def __call__(self, x):
            model = self
            if s.dtype != s.param_dtype:  # mixed precision: compute in s.dtype
                model = jax.tree.map(
                    lambda a: a.astype(s.dtype) if eqx.is_inexact_array(a) else a, self
                )
            for block in model.blocks:
                x = block(x)
            return model.head(x.mean(axis=0))

    x = jax.random.normal(jax.random.key(1), (s.batch_tf, s.tokens, w))
    x = x.astype(s.dtype)
    # Layers applied per token with the model's own `jax.vmap` (norms, fc1, fc2,
    # the attention's projections) cannot take a per-example epsilon leaf.
    paths = ["head"] + [
        f"blocks/{i}{leaf}" for i in range(s.depth_tf) for leaf in ("", "/attention")
    ]
    return _equinox(
        "transformer", Transformer(jax.random.key(0)), x, "blocks/0/fc1", paths
    )


def equinox_scanned(depth: int, s: Sizes = FULL):
    """Layers built with `eqx.filter_vmap`, run by `lax.scan`: `(probe, plain, x)`."""
    import equinox as eqx

    width = s.width_scan

    class Block(eqx.Module):
        norm: eqx.nn.LayerNorm
        linear: eqx.nn.Linear

        def __init__(self, key):
            self.norm = eqx.nn.LayerNorm(width)
            self.linear = eqx.nn.Linear(width, width, key=key)

        def __call__(self, x):
            return x + self.linear(jax.nn.gelu(self.norm(x)))

    class Stack(eqx.Module):
        layers: Block

        def __init__(self, key):
            self.layers = eqx.filter_vmap(Block)(jax.random.split(key, depth))

        def __call__(self, x):
            dynamic, static = eqx.partition(self.layers, eqx.is_array)

            def step(h, layer_arrays):
                return eqx.combine(layer_arrays, static)(h), None

            return jax.lax.scan(step, x, dynamic)[0]

    model = Stack(jax.random.key(0))
    params, static = eqx.partition(model, eqx.is_inexact_array)

    def plain(params, x):
        return jax.value_and_grad(lambda p: mse(jax.vmap(eqx.combine(p, static))(x)))(
            params
        )

    x = jnp.ones((s.batch_scan, width))
    return bridge.probe(model, vmap=True), plain, params, x


# -- Haiku ---------------------------------------------------------------------------


def _haiku(name, forward, x, one_site, s: Sizes = FULL):
    """`forward(x, mark)`: the model, `mark(value)` after every layer call."""
    import haiku as hk

    def identity(value):
        return value

    if s.dtype != s.param_dtype:  # mixed precision: parameters cast when read
        forward = _cast_parameters(forward, s.dtype)

    transformed = hk.without_apply_rng(hk.transform(lambda x: forward(x, identity)))
    params = transformed.init(jax.random.key(0), x.astype(jnp.float32))
    params = jax.tree.map(lambda a: a.astype(s.param_dtype), params)
    probe = bridge.probe(transformed, params)

    def plain(params, x):
        return jax.value_and_grad(lambda p: mse(transformed.apply(p, x)))(params)

    def with_epsilons(x):
        count, activations = iter(range(10**6)), []

        def mark(value):
            epsilon = hk.get_state(
                f"epsilon_{next(count)}", value.shape, value.dtype, init=jnp.zeros
            )
            activations.append(value)
            return value + epsilon

        return forward(x, mark), activations

    perturbed = hk.without_apply_rng(hk.transform_with_state(with_epsilons))
    epsilons = _structs(jax.eval_shape(perturbed.init, jax.random.key(0), x)[1])

    def hand(params, x):
        def loss(params, epsilons):
            (y, activations), _ = perturbed.apply(params, epsilons, x)
            return mse(y), activations

        return jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(
            params, _zeros_in_trace(epsilons)
        )

    return Workload(
        "haiku",
        name,
        probe,
        x,
        mse,
        plain,
        params,
        hand,
        params,
        len(jax.tree.leaves(epsilons)),
        one_site,
    )


def _cast_parameters(forward, dtype):
    import haiku as hk

    def cast(next_getter, value, context):
        return next_getter(value.astype(dtype))

    def with_types(x, mark):
        with hk.custom_getter(cast):
            return forward(x, mark)

    return with_types


def haiku_mlp(s: Sizes = FULL):
    import haiku as hk

    def forward(x, mark):
        for _ in range(s.depth_mlp):
            x = jax.nn.relu(mark(hk.Linear(s.width_mlp)(x)))
        return mark(hk.Linear(10)(x))

    x = jax.random.normal(jax.random.key(1), (s.batch_mlp, s.width_mlp))
    return _haiku("mlp", forward, x, "linear_1")


def _haiku_norm():
    import haiku as hk

    return hk.LayerNorm(axis=-1, create_scale=True, create_offset=True)


def haiku_cnn(s: Sizes = FULL):
    import haiku as hk

    def forward(x, mark):
        x = jax.nn.relu(mark(hk.Conv2D(s.channels, 3)(x)))
        for _ in range(2):
            h = mark(_haiku_norm()(x))
            h = jax.nn.relu(mark(hk.Conv2D(s.channels, 3)(h)))
            x = x + mark(hk.Conv2D(s.channels, 3)(h))
        return mark(hk.Linear(10)(x.mean(axis=(1, 2))))

    x = jax.random.normal(jax.random.key(1), (s.batch_cnn, s.image, s.image, 3))
    return _haiku("cnn", forward, x, "conv2_d_2")


def haiku_transformer(s: Sizes = FULL):
    import haiku as hk

    w = s.width_tf

    def forward(x, mark):
        for _ in range(s.depth_tf):
            h = mark(_haiku_norm()(x))
            attention = hk.MultiHeadAttention(
                num_heads=4, key_size=w // 4, w_init=hk.initializers.VarianceScaling()
            )
            x = x + mark(attention(h, h, h))
            h = jax.nn.gelu(mark(hk.Linear(4 * w)(mark(_haiku_norm()(x)))))
            x = x + mark(hk.Linear(w)(h))
        return mark(hk.Linear(10)(x.mean(axis=1)))

    x = jax.random.normal(jax.random.key(1), (s.batch_tf, s.tokens, w))
    return _haiku("transformer", forward, x.astype(s.dtype), "linear", s)


def haiku_scanned(depth: int, s: Sizes = FULL):
    """Blocks under `hk.experimental.layer_stack`: `(probe, plain, x)`."""
    import haiku as hk

    width = s.width_scan

    def block(x):
        return x + hk.Linear(width)(jax.nn.gelu(_haiku_norm()(x)))

    def forward(x):
        return hk.experimental.layer_stack(depth)(block)(x)

    transformed = hk.without_apply_rng(hk.transform(forward))
    x = jnp.ones((s.batch_scan, width))
    params = transformed.init(jax.random.key(0), x)

    def plain(params, x):
        return jax.value_and_grad(lambda p: mse(transformed.apply(p, x)))(params)

    return bridge.probe(transformed, params), plain, params, x


BUILDERS = {
    "linen": [linen_mlp, linen_cnn, linen_transformer],
    "nnx": [nnx_mlp, nnx_cnn, nnx_transformer],
    "equinox": [equinox_mlp, equinox_cnn, equinox_transformer],
    "haiku": [haiku_mlp, haiku_cnn, haiku_transformer],
}

SCANNED = {
    "linen": linen_scanned,
    "nnx": nnx_scanned,
    "equinox": equinox_scanned,
    "haiku": haiku_scanned,
}
