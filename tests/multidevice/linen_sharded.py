"""Run in a subprocess with 8 simulated CPU devices (see tests/test_sharding.py)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
from checks import (
    check_batch_sharded,
    check_explicit_axes,
    check_shard_map,
    stacked_spec,
)

import bridge


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(32)(x))
        x = nn.LayerNorm()(x)
        return nn.Dense(4)(x)


def loss(y):
    return jnp.mean(jnp.square(y - 1.0))


x = jax.random.normal(jax.random.key(0), (32, 16))
model = MLP()
probe = bridge.probe(model, model.init(jax.random.key(1), x))
step = jax.jit(lambda probe, x: probe.value_and_grad(loss, x))
single = step(probe, x)

spec_of = stacked_spec(lambda name: False)
check_batch_sharded(step, probe, x, single, spec_of)
check_shard_map(probe, x, single, spec_of, lambda y: jnp.sum(jnp.square(y - 1.0)) / 128)

# Sharding in types (`Explicit` mesh axes): epsilons are created sharded like
# the activations, so activation gradients come back batch-sharded rather than
# replicated; with vmap=True the epsilons' batch axis is sharded like the
# inputs' (vmap refuses differently sharded mapped axes).
for vmap in (False, True):
    variables = model.init(jax.random.key(1), x[0] if vmap else x)
    one = bridge.probe(model, variables, vmap=vmap)
    result = check_explicit_axes(step, one, x, step(one, x))
    for name, grad in result.activation_grads.items():
        assert grad.sharding.spec[0] == "data", (vmap, name, grad.sharding)
print("ok")
