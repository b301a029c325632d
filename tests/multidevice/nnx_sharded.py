"""Run in a subprocess with 8 simulated CPU devices (see tests/test_sharding.py)."""

import jax
import jax.numpy as jnp
from checks import check_batch_sharded, check_shard_map, stacked_spec
from flax import nnx

import bridge


class Block(nnx.Module):
    def __init__(self, rngs):
        self.linear = nnx.Linear(16, 16, rngs=rngs)
        self.norm = nnx.LayerNorm(16, rngs=rngs)

    def __call__(self, x):
        return x + nnx.relu(self.norm(self.linear(x)))


class Model(nnx.Module):
    """An embedding, a scanned stack of three blocks, a head."""

    def __init__(self, rngs):
        @nnx.split_rngs(splits=3)
        @nnx.vmap(in_axes=0, out_axes=0)
        def create(rngs):
            return Block(rngs)

        self.embed = nnx.Linear(8, 16, rngs=rngs)
        self.blocks = create(rngs)
        self.head = nnx.Linear(16, 4, rngs=rngs)

    def __call__(self, x):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def forward(x, block):
            return block(x)

        return self.head(forward(self.embed(x), self.blocks))


def loss(y):
    return jnp.mean(jnp.square(y - 1.0))


x = jax.random.normal(jax.random.key(0), (32, 8))
probe = bridge.probe(Model(nnx.Rngs(1)))
step = jax.jit(lambda probe, x: probe.value_and_grad(loss, x))
single = step(probe, x)
assert single.activation_grads["blocks/linear"].shape == (3, 32, 16)

# A site inside the scanned stack holds (iterations, batch, ...).
spec_of = stacked_spec(lambda name: name.startswith("blocks"))
check_batch_sharded(step, probe, x, single, spec_of)
check_shard_map(probe, x, single, spec_of, lambda y: jnp.sum(jnp.square(y - 1.0)) / 128)
print("ok")
