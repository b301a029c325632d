"""The benchmark's models, one builder per library and architecture.

A builder returns a `Workload`: the probe, its inputs and loss, the plain
`jax.value_and_grad` of the same loss, and the library's hand-written epsilon
trick, all as functions of explicit arguments so `jax.jit` compiles each once.
"""

from __future__ import annotations

import dataclasses
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
    hand: Callable | None  # (params, x) -> (loss, (grads, activation grads))
    one_site: str


def mse(y):
    return jnp.mean(jnp.square(y))


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

        def interceptor(next_fun, args, kwargs, context):
            out = next_fun(*args, **kwargs)
            if context.module.path == () or context.method_name != "__call__":
                return out
            return context.module.perturb("epsilon", out)

        perturbations = jax.tree.map(jnp.zeros_like, _nest(sites))

        def loss(params, perturbations):
            with nn.intercept_methods(interceptor):
                y = module.apply({"params": params, "perturbations": perturbations}, x)
            return mse(y)

        return jax.value_and_grad(loss, argnums=(0, 1))(params, perturbations)

    return Workload(
        "linen", name, probe, x, mse, plain, variables["params"], hand, one_site
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


def linen_mlp(batch=128, width=1024, depth=8):
    import flax.linen as nn

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            for _ in range(depth):
                x = nn.relu(nn.Dense(width)(x))
            return nn.Dense(10)(x)

    x = jax.random.normal(jax.random.key(1), (batch, width))
    return _linen("mlp", MLP(), x, "Dense_4")


def linen_cnn(batch=32):
    import flax.linen as nn

    class CNN(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.relu(nn.Conv(32, (3, 3))(x))
            for _ in range(2):
                h = nn.relu(nn.Conv(32, (3, 3))(nn.LayerNorm()(x)))
                x = x + nn.Conv(32, (3, 3))(h)
            return nn.Dense(10)(x.mean(axis=(1, 2)))

    x = jax.random.normal(jax.random.key(1), (batch, 32, 32, 3))
    return _linen("cnn", CNN(), x, "Conv_2")


def linen_transformer(batch=16, tokens=64, width=128, depth=4):
    import flax.linen as nn

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = x + nn.SelfAttention(num_heads=4)(nn.LayerNorm()(x))
            h = nn.gelu(nn.Dense(4 * width)(nn.LayerNorm()(x)))
            return x + nn.Dense(width)(h)

    class Transformer(nn.Module):
        @nn.compact
        def __call__(self, x):
            for _ in range(depth):
                x = Block()(x)
            return nn.Dense(10)(x.mean(axis=1))

    x = jax.random.normal(jax.random.key(1), (batch, tokens, width))
    return _linen("transformer", Transformer(), x, "Block_2/Dense_0")


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


def linen_scanned(depth: int, width=64, batch=8):
    """A stack of `depth` identical blocks under `nn.scan`, as users write it."""
    import flax.linen as nn

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

    x = jnp.ones((batch, width))
    module = Stack()
    return module, module.init(jax.random.key(0), x), x


BUILDERS = {
    "linen": [linen_mlp, linen_cnn, linen_transformer],
}
