"""Run in a subprocess with 8 simulated CPU devices (see tests/test_sharding.py)."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import bridge

assert jax.device_count() == 8, jax.devices()


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

mesh = jax.make_mesh((8,), ("data",))
batch_sharded = NamedSharding(mesh, P("data"))
replicated = NamedSharding(mesh, P())
sharded = step(jax.device_put(probe, replicated), jax.device_put(x, batch_sharded))

np.testing.assert_allclose(sharded.loss, single.loss, rtol=1e-6)
jax.tree.map(
    lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
    (sharded.grads, sharded.activation_grads),
    (single.grads, single.activation_grads),
)
for name, grad in sharded.activation_grads.items():
    # A site inside the scanned stack holds (iterations, batch, ...).
    spec = P(None, "data") if name.startswith("blocks") else P("data")
    assert grad.sharding.is_equivalent_to(NamedSharding(mesh, spec), grad.ndim), (
        name,
        grad.sharding,
    )


# shard_map: each device probes its shard. The epsilons must vary across
# devices like the activations they perturb, or their gradients (the activation
# gradients) would be summed over devices.
def local_step(probe, x):
    res = probe.value_and_grad(lambda y: jnp.sum(jnp.square(y - 1.0)) / 128, x)
    return res.grads, res.activation_grads


site_specs = {
    name: P(None, "data") if name.startswith("blocks") else P("data")
    for name in single.activation_grads
}
local = jax.jit(
    jax.shard_map(
        local_step,
        mesh=mesh,
        in_specs=(P(), P("data")),
        out_specs=(P(), site_specs),
    )
)
grads, activation_grads = local(
    jax.device_put(probe, replicated), jax.device_put(x, batch_sharded)
)
jax.tree.map(
    lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6),
    (grads, activation_grads),
    (single.grads, single.activation_grads),
)
print("ok")
